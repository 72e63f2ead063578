"""The scheduler's view of KV memory: ``Request`` and ``KVCacheManager``.

This is vLLM V1's ``KVCacheManager`` for one cache group (the roles of its
unitary coordinator and ``FullAttentionManager`` folded into one class), built on
``pagedkv.block_pool.BlockPool``; a model with other kinds of layers gets
``pagedkv.grouped_kv_cache_manager.GroupedKVCacheManager``, the same interface
over a coordinator of groups. Both answer with ``KVCacheBlocks``, one block
list per group. The scheduler asks two questions per request:

* ``get_computed_blocks(request)``: how much of this prompt is already in the
  prefix cache? The longest cached prefix, stopping at the first miss, capped
  so the last prompt token is always recomputed (its logits are needed).
* ``allocate_slots(request, num_new_tokens, ...)``: give this step's tokens
  (draft tokens included, never cached) somewhere to live, or return
  ``None`` (nothing changed) so the scheduler can preempt someone and retry.
  The capacity test is one subtraction.

Sharing and copy-on-write
-------------------------
Full blocks are shared by reference count: a prefix hit *touches* the cached
block (``ref_cnt += 1``) and the request appends its own new blocks after it.
No copy is ever needed, because nobody writes into a full block again.

When the prefix-match unit ``hash_block_size`` is finer than ``block_size``, a
hit can end *inside* a block: at 4,100 cached tokens with 16-token blocks,
logical block 256 is shared with only 4 of its 16 slots valid for this request,
and the request must write slots 4..15. It cannot write into a block others
hold, so the manager redirects that table entry to a fresh private block (the
one write to a block table that is not an append) and records a pending copy
``(src, dst)``. The copies run on the worker, in every layer, before the
forward pass reads the cache (``pagedkv.kernels.copy_blocks``).

The copy protocol, explicitly:

1. ``allocate_slots`` records ``(src, dst)``; ``src`` keeps the reference the
   prefix hit took, ``dst`` gets one more reference beyond the request's own.
2. ``take_pending_copies()`` hands the pairs (block ids) to the worker, which
   must run them before this step's forward pass.
3. ``acknowledge_copies(pairs)``, once the step has run, drops those two extra
   references. Until then neither end can be recycled, even if the request is
   freed in the meantime (a cancelled request cannot revoke an issued copy).

Step 3 is ours: vLLM 0.33.0's scheduler drains the pairs with their held ends
(``take_kv_cache_block_copies()``) and frees the ends once their step is done.

Prefix-cache entries
--------------------
Full-block entries live in the block pool (``cache_full_blocks``): a block is
cached as soon as the step that fills it is scheduled, as vLLM does. Partial
entries (a prefix ending inside a block, at a multiple of ``hash_block_size``)
live here, in ``partial_hash_to_block``, because the pool keeps one hash per
block, and every such boundary of a computed block gets one (vLLM 0.33.0's
pool keeps partial keys itself, one per request, and only beside a Mamba group).
A partial entry names a prefix whose KV is already *computed* (recorded from
``request.num_computed_tokens`` as a step is scheduled, before it advances): a
copy reads its source before the forward pass, so its valid slots must hold
real KV. Slots once written are not rewritten while a block is held, so an
entry stays valid until the pool hands its block out again (eviction at reuse).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from .block_pool import BlockPool
from .free_queue import KVCacheBlock
from .common import InvariantError, cdiv, check_int, check_real, require
from .hashing import BlockHash
from .kv_cache_coordinator import KVCacheBlocks, PrefixCacheStats
from .request import Request
from .step_tokens import check_step_tokens

__all__ = ["KVCacheManager", "KVCacheBlocks", "PrefixCacheStats", "InvariantError"]

class KVCacheManager:
    """Blocks for requests: prefix hits, slot allocation, freeing, and copy-on-write of partial hits.

    Args:
        num_blocks: blocks in the pool, including the null block 0.
        block_size: tokens per block.
        enable_caching: prefix caching on or off.
        hash_block_size: the prefix-match unit, a divisor of ``block_size``
            (default: ``block_size``, so hits end on block boundaries and no copy
            is ever needed).
        watermark: fraction of the blocks an *admission* (a request's first
            allocation) must leave free, so running requests can keep growing.
            As in vLLM, it applies only while other requests are scheduled
            (see ``allocate_slots``'s ``has_scheduled_reqs``): a request that
            fits the whole pool may run alone.

    Public attributes (read-only) include ``block_pool``, ``block_size``,
    ``req_to_blocks`` (request id -> block table) and ``watermark_blocks``,
    ``int(watermark * num_blocks)``.

    Extension points, through which exercises 3 and 6 plug in a learner's
    functions, all by subclassing: the class attribute ``block_pool_class``,
    the ``BlockPool`` (sub)class the pool is built from (its
    ``free_blocks``/``touch`` are the ones the manager calls); and the
    methods ``release_blocks`` (the step of ``free`` that returns a table to
    the pool), ``redirect_partial_hit`` (the copy-on-write step of a partial
    hit), ``get_computed_blocks`` and ``allocate_slots``. An override must
    leave exactly the state the library's leaves; ``check()`` verifies it.

    Request ids are the keys of every per-request table, so they must be unique
    among live requests: a *different* ``Request`` object with the id of one
    that holds blocks is refused by ``get_computed_blocks``, ``allocate_slots``
    and ``free`` (it would otherwise be handed the other request's blocks).
    """

    #: The class the pool is built from (an extension point: see above).
    block_pool_class: type[BlockPool] = BlockPool
    #: One KV-cache group, full attention; no coordinator (its role is folded in here).
    num_kv_cache_groups: int = 1
    coordinator = None

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_block_size: int | None = None, watermark: float = 0.0):
        self.block_size = check_int(block_size, "block_size", 1)
        hash_block_size = self.block_size if hash_block_size is None else check_int(hash_block_size, "hash_block_size", 1)
        if self.block_size % hash_block_size:
            raise ValueError(f"hash_block_size={hash_block_size} must divide block_size={self.block_size}")
        watermark = check_real(watermark, "watermark", minimum=0, maximum=1, open_max=True)
        pool_class = self.block_pool_class
        if not (isinstance(pool_class, type) and issubclass(pool_class, BlockPool)):
            raise TypeError(f"block_pool_class must be BlockPool or a subclass of it, got {pool_class!r}")
        self.block_pool = pool_class(check_int(num_blocks, "num_blocks", 2), enable_caching)
        self.enable_caching = bool(enable_caching)
        self.hash_block_size = hash_block_size
        self.hashes_per_block = self.block_size // hash_block_size
        self.watermark_blocks = int(watermark * num_blocks)
        # request id -> its blocks in logical order (the scheduler-side block table).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> the Request object that holds those blocks (same keys as req_to_blocks).
        self._holders: dict[str, Request] = {}
        # request id -> how many of its leading full blocks are in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        # request id -> how many of its leading hash blocks have had their partial entry considered.
        self.num_partial_recorded: dict[str, int] = {}
        # Partial prefix entries: hash -> (block, valid tokens in it); reverse index per block id.
        self.partial_hash_to_block: dict[BlockHash, tuple[KVCacheBlock, int]] = {}
        self._partial_hashes_by_block: dict[int, set[BlockHash]] = {}
        # Copy-on-write pairs: recorded, then handed to the worker, then acknowledged.
        self._pending_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        self._inflight_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        self._stats = PrefixCacheStats()

    # ------------------------------------------------------------- queries
    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (the null block excluded)."""
        return self.block_pool.get_usage()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Lookups recorded by ``record_prefix_cache_stats`` (at admission) since the last reset."""
        return self._stats

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count an admitted request's lookup: ``request.num_tokens`` queried, ``num_hits`` found.

        The scheduler calls it once the request's slots are allocated (vLLM's
        "record at admission so unscheduled lookups are not counted"), not
        ``get_computed_blocks``, which a request that keeps waiting repeats
        every step. A request with ``num_preemptions > 0`` counts as
        preempted. Nothing is counted with prefix caching off.
        """
        if not self.enable_caching:
            return
        preempted = getattr(request, "num_preemptions", 0) > 0
        self._stats = self._stats.record(request.num_tokens, num_hits, preempted)

    def reset_prefix_cache_stats(self) -> PrefixCacheStats:
        """Return the statistics so far and start counting afresh."""
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks, one list per group (a copy: editing it changes nothing)."""
        blocks = self.req_to_blocks.get(request_id) if isinstance(request_id, str) else None
        if blocks is None:
            self.get_block_ids(request_id)  # raises, naming the problem
        return KVCacheBlocks((list(blocks),))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids (vLLM's one list per group is ``get_blocks(request_id).get_block_ids()``)."""
        if not isinstance(request_id, str):
            raise TypeError(f"expected a request id, got {type(request_id).__name__} {request_id!r}")
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            raise KeyError(f"request {request_id!r} holds no blocks (never allocated, or already freed)")
        return [b.block_id for b in blocks]

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    # ------------------------------------------------------- prefix lookup
    def _bind(self, request: Request) -> None:
        """Refuse what is not a ``Request``, and a ``Request`` whose id a *different* live one holds.

        Then bind the request's prefix-match unit to ours on first contact (a
        request built with another unit is refused there).
        """
        if not isinstance(request, Request):
            raise TypeError(f"expected a Request, got {type(request).__name__} {request!r}")
        holder = self._holders.get(request.request_id)
        if holder is not None and holder is not request:
            raise ValueError(
                f"request id {request.request_id!r} is held by another live Request object "
                f"({holder!r}); ids must be unique among live requests (free the other one first)"
            )
        if request.hash_block_size != self.hash_block_size:
            request.bind_hash_block_size(self.hash_block_size)

    def _partial_hit(self, request: Request, num_full: int) -> tuple[KVCacheBlock, int] | None:
        """How a finer match unit extends a hit of ``num_full`` blocks into the next: the longest
        partial entry, as ``(block, valid tokens)``, or None."""
        r, B, h = self.hashes_per_block, self.block_size, self.hash_block_size
        hashes, base = request.block_hashes, num_full * r
        for k in range(r - 1, 0, -1):
            if num_full * B + k * h <= request.num_tokens - 1 and base + k - 1 < len(hashes):
                entry = self.partial_hash_to_block.get(hashes[base + k - 1])
                if entry is not None:
                    return entry[0], k * h
        return None

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of a new request: ``(blocks, num_computed_tokens)``.

        Stops at the first miss; capped at ``request.num_tokens - 1`` tokens.
        When the hit ends inside a block, the last block is shared and only
        partly valid: ``allocate_slots`` will give the request a private copy.
        Changes nothing (the statistics count a lookup when the request is
        admitted: ``record_prefix_cache_stats``).
        """
        self._bind(request)
        if request.request_id in self.req_to_blocks:
            raise ValueError(f"request {request.request_id!r} already holds blocks; look up new requests only")
        if not self.enable_caching:
            return KVCacheBlocks(([],)), 0
        r, B = self.hashes_per_block, self.block_size
        hashes, max_hit = request.block_hashes, request.num_tokens - 1  # the last token is always recomputed
        blocks: list[KVCacheBlock] = []
        while (len(blocks) + 1) * B <= max_hit:
            block = self.block_pool.get_cached_block(hashes[(len(blocks) + 1) * r - 1])
            if block is None:
                break
            blocks.append(block)
        num_tokens = len(blocks) * B
        # A hit can end inside a block only when the match unit is finer than a block.
        partial = self._partial_hit(request, len(blocks)) if r > 1 else None
        if partial is not None:
            blocks.append(partial[0])
            num_tokens += partial[1]
        return KVCacheBlocks((blocks,)), num_tokens

    # ---------------------------------------------------------- allocation
    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | Sequence[KVCacheBlock] | None = None,
                       num_lookahead_tokens: int = 0, *,
                       has_scheduled_reqs: bool | None = None) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` tokens (after any prefix hit); return the new blocks or ``None``.

        Args:
            request: the request; its ``num_computed_tokens`` is where this step starts.
            num_new_tokens: tokens computed this step, at least 1, including
                unverified draft tokens as in vLLM: ``num_computed_tokens +
                num_new_computed_tokens + num_new_tokens`` at most
                ``request.num_tokens_with_spec`` (plus async placeholders;
                ``pagedkv.step_tokens``). Drafts get slots but are cached only
                up to ``request.num_tokens``, so a rejected draft never enters
                the prefix cache. The book models drafts here, at the manager;
                the engine has no drafter, so its requests carry none.
            num_new_computed_tokens, new_computed_blocks: a prefix hit from
                ``get_computed_blocks``, for a request that holds no blocks yet.
            num_lookahead_tokens: extra slots past this step's tokens, never
                cached (vLLM's, for draft models with a KV cache). The manager
                knows no ``max_model_len``, so unlike vLLM it does not cap
                them: the scheduler keeps requests within the context window.
            has_scheduled_reqs: vLLM's name and meaning: whether other requests
                are already scheduled to run this step. The admission watermark
                applies only when they are, so a request that fits the whole
                pool, but not the pool minus the watermark, runs when alone.
                ``None`` (the default) infers it as vLLM's scheduler computes it
                (``bool(self.running)``): another request holds blocks here.
                (vLLM's own default is ``True``; its scheduler always passes
                the real value, and so does ours by default.) Pass ``True`` to
                apply the watermark regardless.

        Returns the blocks allocated by this call (a copy-on-write block first,
        if any), or ``None`` when they do not fit; then nothing has changed.
        Raises ``TypeError``/``ValueError`` for bad arguments, also before any change.
        Pool listeners are notified once the whole allocation is done.
        """
        self._bind(request)
        B, h, r = self.block_size, self.hash_block_size, self.hashes_per_block
        num_new_tokens = check_int(num_new_tokens, "num_new_tokens", 1)
        num_new_computed_tokens = check_int(num_new_computed_tokens, "num_new_computed_tokens", 0)
        num_lookahead_tokens = check_int(num_lookahead_tokens, "num_lookahead_tokens", 0)
        hit = list(new_computed_blocks or []) if not isinstance(new_computed_blocks, KVCacheBlocks) \
            else list(new_computed_blocks.blocks[0]) if len(new_computed_blocks.blocks) == 1 else None
        if hit is None:
            raise ValueError(f"new_computed_blocks spans {len(new_computed_blocks.blocks)} KV-cache groups; "
                             "this manager has one")
        rid = request.request_id
        req_blocks = self.req_to_blocks.get(rid, [])
        self._check_allocation(request, req_blocks, num_new_tokens, num_new_computed_tokens, hit,
                               has_scheduled_reqs)
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        partial_hit = bool(hit) and num_new_computed_tokens % B != 0

        # The capacity test: one subtraction.
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, B)
        num_new_blocks = max(num_required - len(req_blocks) - len(hit), 0)
        num_to_allocate = num_new_blocks + partial_hit  # the private copy is one more block
        num_evictable_hits = sum(1 for b in hit if b.ref_cnt == 0)  # touching takes them off the queue
        # The watermark holds back an admission (a request with no blocks: vLLM's
        # WAITING or PREEMPTED) only while other requests are scheduled.
        if has_scheduled_reqs is None:  # as vLLM's scheduler computes it: another request holds blocks
            has_scheduled_reqs = any(other != rid for other in self.req_to_blocks)
        watermark = self.watermark_blocks if not req_blocks and has_scheduled_reqs else 0
        if num_to_allocate + num_evictable_hits > self.block_pool.get_num_free_blocks() - watermark:
            return None

        # From here on nothing can fail. Listeners hear of it once it is all done.
        with self.block_pool.deferred_events():
            # Touch hits first, so the pops below cannot take them.
            self.block_pool.touch(hit)
            req_blocks = self.req_to_blocks.setdefault(rid, req_blocks)
            self._holders[rid] = request
            req_blocks.extend(hit)
            self.num_cached_block.setdefault(rid, num_new_computed_tokens // B)
            self.num_partial_recorded.setdefault(rid, num_new_computed_tokens // h)
            new_blocks = self.block_pool.get_new_blocks(num_to_allocate)
            for block in new_blocks:  # reuse evicts: the pool dropped full entries, we drop partial ones
                for block_hash in self._partial_hashes_by_block.pop(block.block_id, ()):
                    del self.partial_hash_to_block[block_hash]
            if partial_hit:  # the last hit block is shared and partly valid: a private copy
                self.redirect_partial_hit(req_blocks, len(hit) - 1, new_blocks[0])
            req_blocks.extend(new_blocks[partial_hit:])

            # Cache the blocks this step fills, as soon as it is scheduled, up to the tokens known
            # (a placeholder has no token, a draft may be rejected: neither has a hash): vLLM's
            # num_tokens_to_cache, capped at num_tokens.
            self._cache_full(request, min(num_computed + num_new_tokens, request.num_tokens))
            if self.enable_caching and r > 1:  # partial prefixes exist only with a finer match unit
                self._record_partial_entries(request)
        return KVCacheBlocks((new_blocks,))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the blocks the first ``num_computed_tokens`` known tokens fill (vLLM's name): under async
        scheduling a step's input may be a placeholder when scheduled, so its block is cached on output."""
        check_int(num_computed_tokens, "num_computed_tokens", 0)
        if request.request_id not in self.req_to_blocks:
            raise KeyError(f"request {request.request_id!r} holds no blocks")
        with self.block_pool.deferred_events():
            self._cache_full(request, min(num_computed_tokens, request.num_tokens))

    def _cache_full(self, request: Request, num_tokens: int) -> None:
        rid, r, req_blocks = request.request_id, self.hashes_per_block, self.req_to_blocks[request.request_id]
        num_full = min(num_tokens // self.block_size, len(req_blocks))
        if self.enable_caching and num_full > self.num_cached_block[rid]:
            self.block_pool.cache_full_blocks(req_blocks, request.block_hashes[r - 1::r],
                                              self.num_cached_block[rid], num_full)
            self.num_cached_block[rid] = num_full

    def _check_allocation(self, request: Request, req_blocks: list[KVCacheBlock], num_new_tokens: int,
                          num_new_computed_tokens: int, hit: list[KVCacheBlock],
                          has_scheduled_reqs: bool | None) -> None:
        """``allocate_slots``'s argument checks beyond the plain types: raise before any change."""
        B, rid = self.block_size, request.request_id
        if (hit or num_new_computed_tokens) and req_blocks:
            raise ValueError(f"request {rid!r} already holds blocks; a prefix hit applies to a new request only")
        if cdiv(num_new_computed_tokens, B) != len(hit):
            raise ValueError(f"num_new_computed_tokens={num_new_computed_tokens} does not match "
                             f"{len(hit)} new_computed_blocks of {B} tokens")
        if not req_blocks and request.num_computed_tokens:
            raise ValueError(f"request {rid!r} holds no blocks but says num_computed_tokens="
                             f"{request.num_computed_tokens} (reset it to 0 after preemption)")
        if request.num_computed_tokens > len(req_blocks) * B:
            raise ValueError(f"request {rid!r} says num_computed_tokens={request.num_computed_tokens}, "
                             f"more than its {len(req_blocks)} blocks hold")
        if has_scheduled_reqs is not None and not isinstance(has_scheduled_reqs, bool):
            raise TypeError(f"has_scheduled_reqs must be a bool or None, got "
                            f"{type(has_scheduled_reqs).__name__} {has_scheduled_reqs!r}")
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        # Past num_tokens (and async placeholders) only by the request's drafts: checked there, off the plain path.
        if num_computed + num_new_tokens > request.num_tokens + getattr(request, "num_output_placeholders", 0):
            check_step_tokens(request, num_computed, num_new_tokens)
        if hit:
            self._validate_hit(request, hit, num_new_computed_tokens)

    def _validate_hit(self, request: Request, hit: list[KVCacheBlock], num_tokens: int) -> None:
        """A hit must still be what ``get_computed_blocks`` says now (nothing evicted in between).

        Checked block by block, without a second lookup: full block ``i`` is
        the block cached under this request's hash of its first ``i + 1``
        blocks; a last, partial block is the longest partial entry past them.
        A partial hit is used whole, and only while its block has not filled
        and been cached in full since the lookup (a longer hit would exist).
        """
        r, B = self.hashes_per_block, self.block_size
        num_full, hashes = num_tokens // B, request.block_hashes
        cached = self.block_pool.get_cached_block
        ok = (self.enable_caching and num_tokens % self.hash_block_size == 0 and num_tokens < request.num_tokens
              and all(cached(hashes[(i + 1) * r - 1]) is hit[i] for i in range(num_full)))
        partial = self._partial_hit(request, num_full) if ok and num_tokens % B else None
        if num_tokens % B and (partial is None or partial[0] is not hit[-1]):
            ok = False
        if not ok:
            raise ValueError(f"stale or foreign prefix hit for request {request.request_id!r}: "
                             f"blocks {[b.block_id for b in hit]} with {num_tokens} tokens are not cached for it")
        if partial is not None:
            if (num_full + 1) * B < request.num_tokens and cached(hashes[(num_full + 1) * r - 1]) is not None:
                raise ValueError(f"stale prefix hit for request {request.request_id!r}: its block {num_full} "
                                 "has filled and been cached since the lookup (look the request up again)")
            longest = num_full * B + partial[1]
            if longest != num_tokens:
                raise ValueError(f"a partial hit must be used whole: request {request.request_id!r} hits "
                                 f"{longest} tokens, not {num_tokens}")

    def redirect_partial_hit(self, req_blocks: list[KVCacheBlock], block_idx: int, cow: KVCacheBlock) -> None:
        """Point ``req_blocks[block_idx]`` (shared, partly valid) at the fresh private ``cow`` block.

        Copy-on-write of a partial prefix hit, the one non-append table write.

        ``source`` keeps the reference its prefix hit took; ``cow`` takes one more
        beyond the request's own. Both are released by ``acknowledge_copies``.
        """
        source = req_blocks[block_idx]
        req_blocks[block_idx] = cow
        cow.ref_cnt += 1  # the pending copy's reference (the block is out of the free queue)
        self.record_copy(source, cow)

    def record_copy(self, source: KVCacheBlock, destination: KVCacheBlock) -> None:
        """Queue one copy-on-write pair for :meth:`take_pending_copies` (the caller holds both references)."""
        self._pending_copies.append((source, destination))

    def _record_partial_entries(self, request: Request) -> None:
        """Enter partial prefixes whose KV is computed (``request.num_computed_tokens``) into the cache.

        One entry per hash block that ends inside a block, so only when the
        match unit is finer than a block (the callers test it). A block that is
        the destination of an outstanding copy holds no valid KV until the copy
        is acknowledged: stop there and retry next time.
        """
        r, h = self.hashes_per_block, self.hash_block_size
        rid = request.request_id
        blocks = self.req_to_blocks[rid]
        busy = {id(dst) for _, dst in self._pending_copies + self._inflight_copies}
        j = self.num_partial_recorded[rid]
        end = min(request.num_computed_tokens // h, len(request.block_hashes), len(blocks) * r)
        while j < end:
            block = blocks[j // r]
            if id(block) in busy:
                break
            if (j + 1) % r:
                block_hash = request.block_hashes[j]
                if block_hash not in self.partial_hash_to_block:
                    self.partial_hash_to_block[block_hash] = (block, (j % r + 1) * h)
                    self._partial_hashes_by_block.setdefault(block.block_id, set()).add(block_hash)
            j += 1
        self.num_partial_recorded[rid] = j

    # ---------------------------------------------------------- copy-on-write
    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Hand this step's copy-on-write pairs ``(src, dst)`` to the worker.

        The worker runs them (``copy_blocks``) before the forward pass. The pairs
        stay referenced until ``acknowledge_copies`` is called with them.
        """
        taken = self._pending_copies
        self._pending_copies = []
        self._inflight_copies.extend(taken)
        return [(s.block_id, d.block_id) for s, d in taken]

    def acknowledge_copies(self, block_pairs: Iterable[tuple[int, int]]) -> None:
        """The worker has run these taken copies: release the references that kept both ends alive."""
        pairs = [tuple(p) for p in block_pairs]
        inflight = {(s.block_id, d.block_id): (s, d) for s, d in self._inflight_copies}
        if len(set(pairs)) != len(pairs):
            raise ValueError(f"a copy is acknowledged twice in {pairs}")
        for p in pairs:
            if p not in inflight:
                pending = any((s.block_id, d.block_id) == p for s, d in self._pending_copies)
                why = "was not taken yet" if pending else "is not an outstanding copy"
                raise ValueError(f"copy {p} {why}")
        done = {p for p in pairs}
        self._inflight_copies = [(s, d) for s, d in self._inflight_copies if (s.block_id, d.block_id) not in done]
        to_free = [b for p in pairs for b in (inflight[p][1], inflight[p][0])]
        self.block_pool.free_blocks(to_free)

    @property
    def outstanding_copies(self) -> list[tuple[int, int]]:
        """Copies recorded but not yet acknowledged (pending first, then in flight)."""
        return [(s.block_id, d.block_id) for s, d in self._pending_copies + self._inflight_copies]

    # --------------------------------------------------------------- freeing
    def free(self, request: Request | str) -> None:
        """Free a finished or preempted request's blocks, tail first (the tail is evicted first).

        Computed partial prefixes are entered into the cache before the blocks go
        back, so a request that returns can hit them until they are reused.

        A request that holds no blocks (aborted while waiting, or already freed)
        is a no-op, as in vLLM. A ``Request`` object whose id is held by a
        *different* live ``Request`` object is refused (``ValueError``).
        """
        rid = request.request_id if isinstance(request, Request) else request
        if not isinstance(rid, str):
            raise TypeError(f"expected a Request or a request id, got {type(rid).__name__} {rid!r}")
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:
            return
        if isinstance(request, Request):
            self._bind(request)  # refuses a different Request object under the holder's id
        with self.block_pool.deferred_events():
            if isinstance(request, Request) and self.enable_caching and self.hashes_per_block > 1:
                self._record_partial_entries(request)
            del self.req_to_blocks[rid], self.num_cached_block[rid], self.num_partial_recorded[rid]
            del self._holders[rid]
            self.release_blocks(blocks)

    def release_blocks(self, req_blocks: list[KVCacheBlock]) -> None:
        """Hand a freed request's block table (in table order) back to the pool, tail first.

        ``free`` calls it last, once the request's entries are gone, inside
        its ``deferred_events``. Tail first because ``free_blocks`` takes
        blocks in eviction priority and a request's tail is the least
        shareable part of its prefix. An extension point: a subclass may
        override it, and must leave the pool as this one does.
        """
        self.block_pool.free_blocks(reversed(req_blocks))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, full and partial; refused (False) while any block is in use."""
        with self.block_pool.deferred_events():
            if not self.block_pool.reset_prefix_cache():
                return False
            self.partial_hash_to_block.clear()
            self._partial_hashes_by_block.clear()
        return True

    # ------------------------------------------------------------ invariants
    def check(self) -> None:
        """Verify the pool's invariants and the manager's; raise ``InvariantError`` naming the broken one."""

        pool = self.block_pool
        pool.check()
        require(self._holders.keys() == self.req_to_blocks.keys()
                and all(r.request_id == rid for rid, r in self._holders.items()),
                "one holder per table", f"holders {sorted(self._holders)}, tables {sorted(self.req_to_blocks)}")
        expected = [0] * pool.num_gpu_blocks
        for rid, blocks in self.req_to_blocks.items():
            require(len({id(b) for b in blocks}) == len(blocks), "a table has no duplicate blocks",
                    f"{rid!r}: {[b.block_id for b in blocks]}")
            for b in blocks:
                require(pool.owns(b) and not b.is_null, "tables hold pool blocks", f"{rid!r} holds {b!r}")
                expected[b.block_id] += 1
            require(0 <= self.num_cached_block[rid] <= len(blocks), "cached count within the table",
                    f"{rid!r}: {self.num_cached_block[rid]} of {len(blocks)}")
            for b in blocks[:self.num_cached_block[rid]]:
                require(not self.enable_caching or b.block_hash is not None, "counted cached blocks hold a hash",
                        f"{rid!r} block {b.block_id}")
        copies = self._pending_copies + self._inflight_copies
        dsts = [d.block_id for _, d in copies]
        require(len(set(dsts)) == len(dsts), "no block is the dst of two outstanding copies", f"dsts {dsts}")
        for s, d in copies:
            expected[s.block_id] += 1
            expected[d.block_id] += 1
        for b in pool.blocks[1:]:
            require(b.ref_cnt == expected[b.block_id], "ref_cnt = table entries + outstanding copy ends",
                    f"block {b.block_id} has ref_cnt {b.ref_cnt}, expected {expected[b.block_id]}")
        for block_hash, (block, n) in self.partial_hash_to_block.items():
            require(pool.owns(block) and not block.is_null, "partial entries name pool blocks", f"{block!r}")
            require(0 < n < self.block_size and n % self.hash_block_size == 0,
                    "a partial entry ends inside its block at a hash-block boundary", f"{n} tokens")
            require(block_hash in self._partial_hashes_by_block.get(block.block_id, ()),
                    "partial index agrees both ways", f"block {block.block_id}")
        n_index = sum(len(v) for v in self._partial_hashes_by_block.values())
        require(n_index == len(self.partial_hash_to_block), "partial index agrees both ways",
                f"{n_index} indexed, {len(self.partial_hash_to_block)} entries")
