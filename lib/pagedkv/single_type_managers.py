"""One manager per KV-cache group: the block tables of one kind of layer.

vLLM 0.33.0's ``SingleTypeKVCacheManager`` and two of its kinds
(``v1/core/single_type_kv_cache_manager.py``), over one ``BlockPool`` that
every group shares:

- ``FullAttentionManager``: a request keeps every block until it ends; a
  prefix hit is the longest run of cached blocks from the left.
- ``SlidingWindowManager``: blocks whose tokens have left the window go back
  to the pool while the request runs (``remove_skipped_blocks``), and the
  null block takes their place in the table, so positions do not move and
  the kernel skips them; a prefix hit needs only the last window's blocks,
  so it is searched right to left.

Every group's blocks come from the same pool, so the prefix cache must tell
them apart: the same tokens hashed once per request are filed once per group,
under ``make_block_hash_with_group_id(block_hash, group_id)``, the hash's bytes
followed by the group id in 4 big-endian bytes, as vLLM files them
(``make_block_hash_with_group_id``, ``v1/core/kv_cache_utils.py:60-69``).
Without the tag a full-attention lookup could return a sliding-window block
of the same tokens, whose layers hold other keys.

Invariants (``check()``): a table holds this pool's blocks, the null block
only as a leading run (a window's skipped head) and never in a
full-attention table; ``num_cached_block`` stays within the table; a hashed
block in a table carries this group's tag, and in a full-attention table
every block under ``num_cached_block`` is hashed (a window's mask may leave
blocks no hit can use unfiled).

Partial hits: when a hit ends inside one of a group's blocks (vLLM 0.33.0
makes such hits only beside a Mamba group in "align" mode whose block is
longer than the hash block), the shared block is copied before the request
writes into it: ``allocate_new_blocks`` gives the request a private block in
its place (``_apply_cow``) and queues ``(source, copy)`` until the copy has
run (``take_pending_cow_copies``); both ends hold one extra reference until
then, which ``check()`` counts.

The prompt's tail: a full-attention block longer than the hash block is also
filed under the key of the prompt's last hittable hash-block boundary when
that boundary falls inside it (``FullAttentionManager._cache_partial_tail_block``).
If the block is already filed whole, the tail key becomes a second key of the
same block (the pool's ``cached_block_hashes_by_block``), and all its keys
die together when the block is reused or its entry replaced.

What we leave out of vLLM's managers: EAGLE drops,
context parallelism, external (connector) tokens, and sparse retention
(``prefix_cache_retention_interval``, whose default ``None`` caches densely).
"""

from __future__ import annotations

from typing import ClassVar, Sequence

from .block_pool import BlockPool
from .common import cdiv, check_int, require
from .free_queue import KVCacheBlock
from .kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

__all__ = ["make_block_hash_with_group_id", "block_hashes_at", "uncache_block", "cache_block_under",
           "cache_partial_key",
           "SingleTypeKVCacheManager",
           "FullAttentionManager", "SlidingWindowManager", "get_manager_for_kv_cache_spec"]


def make_block_hash_with_group_id(block_hash: bytes, group_id: int) -> bytes:
    """The key a group's block is cached under: the hash, then the group id as 4 big-endian bytes."""
    if not isinstance(block_hash, bytes):
        raise TypeError(f"block_hash must be bytes, got {type(block_hash).__name__} {block_hash!r}")
    return block_hash + check_int(group_id, "group_id", 0).to_bytes(4, "big")


def block_hashes_at(block_hashes: Sequence[bytes], hash_block_size: int, block_size: int) -> Sequence[bytes]:
    """The request's hashes viewed at ``block_size``: block ``i`` is named by hash ``(i + 1) * r - 1``.

    Hashes are chained, so the hash of the last hash block inside a block
    names the whole prefix up to the block's end (vLLM's
    ``BlockHashListWithBlockSize``, ``v1/core/kv_cache_utils.py:1233-1263``).
    """
    if block_size == hash_block_size:
        return block_hashes
    r = block_size // hash_block_size
    return block_hashes[r - 1::r]


def uncache_block(block_pool: BlockPool, block: KVCacheBlock) -> None:
    """Take a held block's hash, and every further key of it, out of the prefix cache (vLLM's
    ``_remove_cached_block_hashes``, ``v1/core/block_pool.py:630-649``): a partial entry is
    replaced when its block fills, or moves to a copy. The pool's public ``evict_blocks``
    refuses held blocks, so its eviction step is called directly."""
    if block.block_hash is not None:
        block_pool._evict_cached_block(block)


def cache_block_under(block_pool: BlockPool, block: KVCacheBlock, key: bytes) -> None:
    """File one held, unhashed block under ``key`` (it joins the end of that key's entries)."""
    block_pool.cache_full_blocks([block], [key], 0, 1)


def cache_partial_key(block_pool: BlockPool, block: KVCacheBlock, key: bytes, full_key: bytes | None) -> None:
    """File a held block under a prompt tail's partial ``key`` as well (vLLM's
    ``BlockPool.cache_partial_block``, ``v1/core/block_pool.py:486-603``, for a full-attention
    block): the key becomes the block's hash if it has none, else a further key beside the
    hash, which can only be the block's own whole-block key ``full_key`` (the block lies at or
    past the request's hit, so no other request filed it)."""
    pool = block_pool
    if block.is_null or block.block_hash == key or key in pool.cached_block_hashes_by_block.get(block.block_id, ()):
        return
    if block.block_hash is None:
        cache_block_under(pool, block, key)
        return
    require(block.block_hash == full_key, "a tail block holds its tail key or its whole-block key",
            f"block {block.block_id} holds {block.block_hash!r}")
    pool.cached_block_hashes_by_block.setdefault(block.block_id, []).append(key)
    pool.cached_block_hash_to_block.setdefault(key, {})[block.block_id] = block


class SingleTypeKVCacheManager:
    """The block tables of one group (``SingleTypeKVCacheManager``,
    ``v1/core/single_type_kv_cache_manager.py:49-160``).

    Args:
        kv_cache_spec: the group's spec (its ``block_size`` is this group's).
        block_pool: the pool every group shares.
        enable_caching: prefix caching on or off.
        kv_cache_group_id: this group's index; it tags the group's hashes.
        hash_block_size: tokens per request hash; divides ``block_size``.
        max_admission_blocks_per_request: for groups that recycle blocks
            (sliding window), the cap on what one request is counted for at
            admission (``SlidingWindowSpec.max_admission_blocks_per_request``).
    """

    spec_class: ClassVar[type] = KVCacheSpec
    #: Whether a hit may end inside a block (at a hash-block boundary) when partial hits are on.
    supports_fine_grained_hash_lookup: ClassVar[bool] = False
    #: Where a table may hold the null block: "none", a leading run ("head"), or "anywhere".
    null_entries: ClassVar[str] = "none"

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool,
                 kv_cache_group_id: int, hash_block_size: int | None = None,
                 max_admission_blocks_per_request: int | None = None) -> None:
        if not isinstance(kv_cache_spec, self.spec_class):
            raise TypeError(f"{type(self).__name__} manages {self.spec_class.__name__} groups, "
                            f"got {type(kv_cache_spec).__name__}")
        if not isinstance(block_pool, BlockPool):
            raise TypeError(f"block_pool must be a BlockPool, got {type(block_pool).__name__}")
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        hash_block_size = self.block_size if hash_block_size is None else check_int(hash_block_size, "hash_block_size", 1)
        if self.block_size % hash_block_size:
            raise ValueError(f"hash_block_size={hash_block_size} must divide the group's block_size={self.block_size}")
        self.hash_block_size = hash_block_size
        self.block_pool = block_pool
        self.enable_caching = bool(enable_caching)
        self.kv_cache_group_id = check_int(kv_cache_group_id, "kv_cache_group_id", 0)
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        # request id -> the group's block table for it, in token order. The
        # table is append-only but for one edit: a sliding window replaces
        # leading entries by the null block.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many leading table entries are in the prefix cache
        # (or were skipped): cache_blocks starts after them.
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block
        # Tokens a hit must be a multiple of; the coordinator sets it.
        self.cache_hit_alignment_tokens = self.block_size
        # request id -> (table index, shared block) of a partial hit awaiting its copy.
        self._partial_hit_reqs: dict[str, tuple[int, KVCacheBlock]] = {}
        # (source, copy) pairs whose copy has not run yet; both hold an extra reference.
        self._pending_cow_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []

    # ---------------------------------------------------------------- sizing
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens no later token will attend to; none for full attention."""
        return 0

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, apply_admission_cap: bool = False) -> int:
        """Blocks the pool must hand over for the request to have ``num_tokens`` slots
        (``get_num_blocks_to_allocate``, ``v1/core/single_type_kv_cache_manager.py:176-266``).

        Fresh blocks past what the table (or the hit) covers, and past what the
        window has already skipped; plus each hit block sitting in the free
        queue, since touching it takes it out of the queue.
        """
        num_required_blocks = cdiv(num_tokens, self.block_size)
        if apply_admission_cap and self.max_admission_blocks_per_request is not None:
            num_required_blocks = min(num_required_blocks, self.max_admission_blocks_per_request)
        num_req_blocks = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:  # running: no new hits
            return max(num_required_blocks - num_req_blocks, 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_new_blocks = max(num_required_blocks - max(num_skipped_blocks, len(new_computed_blocks) + num_req_blocks), 0)
        skip = max(0, num_skipped_blocks - num_req_blocks)
        num_evictable = sum(b.ref_cnt == 0 and not b.is_null for b in new_computed_blocks[skip:])
        if self._has_partial_local_hit(new_computed_blocks, total_computed_tokens):
            num_new_blocks += 1  # the private copy of the shared tail block
        return num_new_blocks + num_evictable

    def _has_partial_local_hit(self, new_computed_blocks: Sequence[KVCacheBlock], num_local_computed_tokens: int) -> bool:
        # The hit ends inside one of this group's blocks: that block is shared and must be copied.
        return len(new_computed_blocks) > 0 and num_local_computed_tokens % self.block_size != 0

    def get_num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks ``allocate_new_blocks(request_id, num_tokens)`` will take from the pool."""
        return (max(0, cdiv(num_tokens, self.block_size) - len(self.req_to_blocks.get(request_id, ())))
                + (request_id in self._partial_hit_reqs))

    # ------------------------------------------------------------ allocation
    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int) -> None:
        """A new request's prefix hit enters its table (``add_local_computed_blocks``,
        ``v1/core/single_type_kv_cache_manager.py:268-325``).

        Hit blocks the window has already skipped are not taken: the null
        block stands in for them. The rest are touched (one more reference,
        out of the free queue). All of them count as cached.
        """
        num_skipped_blocks = self.get_num_skipped_tokens(num_local_computed_tokens) // self.block_size
        kept = list(new_computed_blocks[num_skipped_blocks:])
        if self.enable_caching:
            # vLLM's touch skips the null block; ours refuses it (see block_pool).
            self.block_pool.touch([b for b in kept if not b.is_null])
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        req_blocks.extend([self._null_block] * num_skipped_blocks)
        req_blocks.extend(kept)
        self.num_cached_block[request_id] = len(req_blocks)
        if self._has_partial_local_hit(kept, num_local_computed_tokens):
            # The last hit block is valid only up to the hit: remember it for the
            # copy, and count only the full blocks as cached, so the private copy
            # is filed once it fills.
            block_idx = num_local_computed_tokens // self.block_size
            self._partial_hit_reqs[request_id] = (block_idx, kept[-1])
            self.num_cached_block[request_id] = block_idx

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Append fresh blocks until the table covers ``num_tokens`` tokens; return them
        (``allocate_new_blocks``, ``v1/core/single_type_kv_cache_manager.py:370-411``).

        A pending partial hit is copied first: its shared block is replaced, at
        the same index, by a fresh private block (the table's one edit that is
        not an append), which comes first in the list returned."""
        cow_blocks = []
        if request_id in self._partial_hit_reqs:
            block_idx, source_block = self._partial_hit_reqs.pop(request_id)
            cow_block = self.block_pool.get_new_blocks(1)[0]
            self._apply_cow(request_id, block_idx, source_block, cow_block)
            cow_blocks.append(cow_block)
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return cow_blocks
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return cow_blocks + new_blocks

    def _apply_cow(self, request_id: str, block_idx: int, source_block: KVCacheBlock,
                   cow_block: KVCacheBlock) -> None:
        """Point the table at a private copy of a partly hit block (``_apply_cow``,
        ``v1/core/single_type_kv_cache_manager.py:455-475``).

        The source keeps the reference the hit took, and the copy takes one
        more than the table's, until the copy has run on the worker: a free in
        the same step must not recycle either end while the copy reads or
        writes it."""
        req_blocks = self.req_to_blocks[request_id]
        require(req_blocks[block_idx] is source_block, "a partial hit's block is where the hit put it",
                f"{request_id!r} entry {block_idx} is block {req_blocks[block_idx].block_id}, "
                f"not {source_block.block_id}")
        req_blocks[block_idx] = cow_block
        self._pending_cow_copies.append((source_block, cow_block))
        cow_block.ref_cnt += 1

    @property
    def pending_cow_copies(self) -> tuple[tuple[KVCacheBlock, KVCacheBlock], ...]:
        """The queued ``(source, copy)`` pairs, read-only (each end holds one reference for it)."""
        return tuple(self._pending_cow_copies)

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """Hand over the queued ``(source, copy)`` pairs (``take_pending_cow_copies``,
        ``v1/core/single_type_kv_cache_manager.py:423-429``); the caller runs the copies, then
        frees both ends of each pair once."""
        pending, self._pending_cow_copies = self._pending_cow_copies, []
        return pending

    def new_step_starts(self) -> None:
        """A scheduling step begins (a Mamba group forgets what it cached in the last one)."""

    # ---------------------------------------------------------------- caching
    def reachable_block_mask(self, start_block: int, end_block: int,
                             alignment_tokens: int) -> list[bool] | None:
        """Which of the newly full blocks a future hit could use; None means all of them."""
        return None

    def cache_blocks(self, request, num_tokens: int, alignment_tokens: int | None = None) -> None:
        """File the request's newly full blocks under this group's tagged hashes
        (``cache_blocks``, ``v1/core/single_type_kv_cache_manager.py:477-543``).

        ``num_tokens`` counts tokens whose KV is written (or will be by this
        step); only blocks whose tokens all have a hash are full. Null
        entries (skipped by the window) are passed over, and so are blocks
        the mask says no hit could use.
        """
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_hashed_tokens = len(request.block_hashes) * self.hash_block_size
        num_full = min(num_tokens, num_hashed_tokens) // self.block_size
        if num_cached >= num_full:
            return
        blocks = self.req_to_blocks[rid]
        hashes = block_hashes_at(request.block_hashes, self.hash_block_size, self.block_size)
        mask = self.reachable_block_mask(num_cached, num_full, alignment_tokens or self.block_size)
        gid = self.kv_cache_group_id
        # The pool files blocks[i] under keys[i] for num_cached <= i < num_full
        # and passes over the null block; a masked block is handed as null.
        keys: list = [None] * num_cached
        todo = list(blocks[:num_full])
        for i in range(num_cached, num_full):
            keys.append(make_block_hash_with_group_id(hashes[i], gid))
            if mask is not None and not mask[i - num_cached]:
                todo[i] = self._null_block
            elif not todo[i].is_null and todo[i].block_hash not in (None, keys[i]):
                # A partial entry on a block that has now filled: the full key replaces it
                # (vLLM's partial->full promotion in ``cache_full_blocks``).
                uncache_block(self.block_pool, todo[i])
        self.block_pool.cache_full_blocks(todo, keys, num_cached, num_full)
        self.num_cached_block[rid] = num_full

    # --------------------------------------------------------------- freeing
    def free(self, request_id: str) -> None:
        """Return the request's blocks, tail first (the tail is the least shareable prefix)
        (``free``, ``v1/core/single_type_kv_cache_manager.py:571-601``).

        The null entries at the head are not blocks the request holds.
        """
        req_blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self._partial_hit_reqs.pop(request_id, None)
        self.block_pool.free_blocks(reversed([b for b in req_blocks if not b.is_null]))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no later token attends to and put the null block in their entries
        (``remove_skipped_blocks``, ``v1/core/single_type_kv_cache_manager.py:655-720``).

        ``num_computed_tokens`` must count only tokens whose step has run
        (processed and committed): a block a running step still reads is never
        freed. Walks from the last skipped block leftwards and stops at the
        first null entry, which marks where the previous call stopped. The
        freed blocks go back in that order: the one nearest the window first.
        """
        num_skipped_tokens = self.get_num_skipped_tokens(num_computed_tokens)
        if num_skipped_tokens <= 0 or request_id not in self.req_to_blocks:
            return
        blocks = self.req_to_blocks[request_id]
        last = min(num_skipped_tokens // self.block_size, len(blocks))
        freed = []
        for i in range(last - 1, -1, -1):
            if blocks[i] is self._null_block:
                break
            freed.append(blocks[i])
            blocks[i] = self._null_block
        if freed:
            self.block_pool.free_blocks(freed)

    # ---------------------------------------------------------------- lookup
    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[bytes], max_length: int, kv_cache_group_ids: list[int],
                               block_pool: BlockPool, kv_cache_spec: KVCacheSpec, alignment_tokens: int,
                               hash_block_size: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest prefix, at most ``max_length`` tokens and a multiple of
        ``alignment_tokens``, that every group in ``kv_cache_group_ids`` has cached:
        one block list per group (null where a block is not needed), and its length."""
        raise NotImplementedError

    @staticmethod
    def _cached(block_pool: BlockPool, block_hash: bytes, group_ids: list[int]) -> list[KVCacheBlock] | None:
        """One cached block per group for this hash, or None if any group misses (``get_cached_block``,
        ``v1/core/block_pool.py:202-228``)."""
        found = []
        for gid in group_ids:
            block = block_pool.get_cached_block(make_block_hash_with_group_id(block_hash, gid))
            if block is None:
                return None
            found.append(block)
        return found

    # ------------------------------------------------------------ invariants
    def check(self) -> None:
        """This group's invariants (the pool checks its own: ``block_pool.check()``)."""
        pool, null = self.block_pool, self._null_block
        require(self.num_cached_block.keys() <= self.req_to_blocks.keys(), "cached counts name live tables",
                f"{sorted(self.num_cached_block.keys() - self.req_to_blocks.keys())}")
        for rid, blocks in self.req_to_blocks.items():
            ids = [b.block_id for b in blocks]
            real = [b for b in blocks if b is not null]
            require(all(pool.owns(b) for b in blocks), "tables hold pool blocks", f"{rid!r}: {ids}")
            require(len({b.block_id for b in real}) == len(real), "a table has no duplicate blocks", f"{rid!r}: {ids}")
            for b in real:
                require(b.ref_cnt > 0, "a table's blocks are held", f"{rid!r} holds block {b.block_id} with ref_cnt 0")
            head = len(blocks) - len(real)
            if self.null_entries != "anywhere":
                require(all(b is null for b in blocks[:head]), "null entries only at the head",
                        f"group {self.kv_cache_group_id}, {rid!r}: {ids}")
            require(head == 0 or self.null_entries != "none", "only a window or a state group skips blocks",
                    f"group {self.kv_cache_group_id} ({type(self).__name__}), {rid!r}: {ids}")
            n = self.num_cached_block.get(rid, 0)
            require(0 <= n <= len(blocks), "cached count within the table", f"{rid!r}: {n} of {len(blocks)}")
            tag = self.kv_cache_group_id.to_bytes(4, "big")
            for i, b in enumerate(blocks):
                # A window's mask may leave a counted block unfiled; full attention files every one.
                must = self.enable_caching and i < n and b is not null and self.null_entries == "none"
                require(b.block_hash[-4:] == tag if b.block_hash is not None else not must,
                        "a table's cached blocks hold this group's hash", f"group {self.kv_cache_group_id}, "
                        f"{rid!r} entry {i} (block {b.block_id}, {n} counted cached)")


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every block kept to the end; hits from the left."""

    spec_class = FullAttentionSpec
    supports_fine_grained_hash_lookup = True

    def cache_blocks(self, request, num_tokens: int, alignment_tokens: int | None = None) -> None:
        """The full blocks, then, when the block is longer than the hash block, the prompt's
        tail under a partial key (``FullAttentionManager.cache_blocks``,
        ``v1/core/single_type_kv_cache_manager.py:840-857``)."""
        super().cache_blocks(request, num_tokens, alignment_tokens)
        if self.block_size != self.hash_block_size:
            self._cache_partial_tail_block(request, num_tokens)

    def _cache_partial_tail_block(self, request, num_tokens: int) -> None:
        """File the block holding the prompt's last hash-block boundary a resend can hit
        (``num_prompt_tokens - 1`` rounded down) under that boundary's key, once the
        boundary is computed and only when it ends inside a block
        (``_cache_partial_tail_block``, ``v1/core/single_type_kv_cache_manager.py:859-897``).
        Beside a hybrid's scheduler-block rounding the block is already full, so the key
        joins its whole-block key; a hit can use it only when partial hits are on."""
        h = self.hash_block_size
        boundary = min((len(request.prompt_token_ids) - 1) // h, len(request.block_hashes)) * h
        if boundary <= 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        blocks = self.req_to_blocks.get(request.request_id, [])
        block_idx = boundary // self.block_size
        if block_idx >= len(blocks):
            return
        gid = self.kv_cache_group_id
        full = block_hashes_at(request.block_hashes, h, self.block_size)
        full_key = make_block_hash_with_group_id(full[block_idx], gid) if block_idx < len(full) else None
        cache_partial_key(self.block_pool, blocks[block_idx],
                          make_block_hash_with_group_id(request.block_hashes[boundary // h - 1], gid), full_key)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                               alignment_tokens, hash_block_size):
        """Left to right, stopping at the first miss: hashes are chained, so a
        block whose prefix missed cannot hit (``FullAttentionManager.find_longest_cache_hit``,
        ``v1/core/single_type_kv_cache_manager.py:743-838``). With partial hits on
        (``alignment_tokens`` is the hash block, shorter than the block), the hit
        may then end inside the next block: its hash-block boundaries are probed
        right to left, where a prompt's tail entry may sit."""
        block_size = kv_cache_spec.block_size
        hashes = block_hashes_at(block_hashes, hash_block_size, block_size)
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        for block_hash in hashes[:max_length // block_size]:
            cached = cls._cached(block_pool, block_hash, kv_cache_group_ids)
            if cached is None:
                break
            for blocks, block in zip(computed, cached):
                blocks.append(block)
        hit_length = len(computed[0]) * block_size
        if alignment_tokens < block_size and block_size % alignment_tokens == 0:
            # Fine-grained: alignment_tokens is the hash block, so block_hashes index its boundaries.
            scale = block_size // alignment_tokens
            first = len(computed[0]) * scale
            for fine_idx in range(min(first + scale - 1, max_length // alignment_tokens, len(block_hashes)) - 1,
                                  first - 1, -1):
                cached = cls._cached(block_pool, block_hashes[fine_idx], kv_cache_group_ids)
                if cached is not None:
                    for blocks, block in zip(computed, cached):
                        blocks.append(block)
                    hit_length = (fine_idx + 1) * alignment_tokens
                    break
        hit_length -= hit_length % alignment_tokens
        for blocks in computed:
            del blocks[cdiv(hit_length, block_size):]
        return computed, hit_length


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window: blocks behind the window freed as the request runs; hits from the right."""

    spec_class = SlidingWindowSpec
    null_entries = "head"

    def __init__(self, kv_cache_spec: SlidingWindowSpec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.sliding_window = kv_cache_spec.sliding_window

    @staticmethod
    def _contiguous_blocks_for_hit(window: int, block_size: int) -> int:
        # The next token attends to the window - 1 tokens before it: the blocks
        # that hold them must all be cached, and nothing further left.
        return cdiv(window - 1, block_size)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """With ``num_computed_tokens`` computed, the next token attends to the last
        ``sliding_window - 1`` of them: the tokens before those are skipped
        (``get_num_skipped_tokens``, ``v1/core/single_type_kv_cache_manager.py:1148-1184``).
        Window 4, 7 computed: the next token (7) attends to 4..7, so 4 are skipped."""
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def reachable_block_mask(self, start_block, end_block, alignment_tokens):
        """Under dense retention a hit can end at every ``alignment_tokens`` boundary, and
        needs the ``need`` blocks before it: cache only those, all when every block is one
        (``SlidingWindowManager.reachable_block_mask``, ``v1/core/single_type_kv_cache_manager.py:1067-1146``)."""
        if alignment_tokens % self.block_size:
            return None
        need = self._contiguous_blocks_for_hit(self.sliding_window, self.block_size)
        per_segment = alignment_tokens // self.block_size
        if need >= per_segment:
            return None
        return [i % per_segment >= per_segment - need for i in range(start_block, end_block)]

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                               alignment_tokens, hash_block_size):
        """Right to left: the first run of ``cdiv(window - 1, block_size)`` cached
        blocks found from the right ends the longest hit; everything left of the
        run is null (never read). A run that reaches block 0 is a hit however
        short (``SlidingWindowManager.find_longest_cache_hit``,
        ``v1/core/single_type_kv_cache_manager.py:969-1065``, without EAGLE)."""
        block_size = kv_cache_spec.block_size
        hashes = block_hashes_at(block_hashes, hash_block_size, block_size)
        need = cls._contiguous_blocks_for_hit(kv_cache_spec.sliding_window, block_size)
        max_num_blocks = max_length // block_size
        computed = tuple([block_pool.null_block] * max_num_blocks for _ in kv_cache_group_ids)
        run, found = 0, False
        for i in range(max_num_blocks - 1, -1, -1):
            cached = cls._cached(block_pool, hashes[i], kv_cache_group_ids)
            if cached is None:
                run = 0
                continue
            # The run's right end must sit on an alignment boundary.
            if run == 0 and block_size != alignment_tokens and ((i + 1) * block_size) % alignment_tokens:
                continue
            for blocks, block in zip(computed, cached):
                blocks[i] = block
            run += 1
            if run >= need:
                for blocks in computed:
                    del blocks[i + run:]
                found = True
                break
        if not found:  # only a run starting at block 0 counts
            for blocks in computed:
                del blocks[run:]
            while block_size != alignment_tokens and len(computed[0]) * block_size % alignment_tokens:
                for blocks in computed:
                    blocks.pop()
        return computed, len(computed[0]) * block_size


#: The manager class for each spec class (vLLM's ``KVCacheSpecRegistry``, reduced to a dict).
MANAGER_FOR_SPEC: dict[type, type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
}


def get_manager_for_kv_cache_spec(kv_cache_spec: KVCacheSpec, max_in_flight_tokens: int, max_model_len: int,
                                  managers: dict | None = None, **kwargs) -> SingleTypeKVCacheManager:
    """The manager for a group's spec; a sliding window gets its admission cap
    (``get_manager_for_kv_cache_spec``, ``v1/core/single_type_kv_cache_manager.py:2608-2653``).
    ``managers`` replaces the registry (``pagedkv.mamba_manager`` adds its kind to it)."""
    registry = MANAGER_FOR_SPEC if managers is None else managers
    for spec_class in type(kv_cache_spec).__mro__:
        if spec_class in registry:
            break
    else:
        raise ValueError(f"no manager for a {type(kv_cache_spec).__name__} group "
                         f"(known: {', '.join(c.__name__ for c in registry)})")
    if isinstance(kv_cache_spec, SlidingWindowSpec):
        kwargs["max_admission_blocks_per_request"] = kv_cache_spec.max_admission_blocks_per_request(
            max_in_flight_tokens, max_model_len)
    return registry[spec_class](kv_cache_spec, **kwargs)
