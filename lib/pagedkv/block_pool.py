"""The block pool: every physical KV-cache block, one free queue, one prefix cache.

This is vLLM V1's allocator core (``vllm/v1/core/block_pool.py``), rebuilt
small enough to read in one sitting, with the same names and the same
semantics. The KV *data* lives elsewhere, in per-layer tensors indexed by block
id; here is only the metadata that decides which block a request gets. It is
built from two smaller pieces, read first:

- ``pagedkv.free_queue``: ``KVCacheBlock`` and ``FreeKVCacheBlockQueue``, the
  intrusive free list (both re-exported here);
- ``pagedkv.pool_events``: ``PoolEvent`` and the subscribe/notify half of the
  pool (``subscribe``, ``unsubscribe``, ``deferred_events``).

Public API (stable: ``kv_cache_manager`` and the views build on it)
-------------------------------------------------------------------

``BlockPool(num_gpu_blocks, enable_caching=True)``
    ``blocks``, ``free_block_queue``, ``cached_block_hash_to_block``,
    ``null_block`` (block 0: taken at construction, never freed or cached);

    - ``get_new_blocks(num_blocks)`` -> list of blocks popped from the head,
      each with ``ref_cnt == 1``; a popped block that still carried a hash
      loses it, and its prefix-cache entry dies here.
    - ``free_blocks(ordered_blocks)``: decrement; ``ordered_blocks`` is in
      eviction priority (first evicted first), so a request frees its blocks
      ``reversed``. Blocks reaching 0 *without* a hash go to the head, in that
      order (the first is the next one reused); blocks reaching 0 *with* a hash
      go to the tail, in that order, keeping the hash (last recycled, still
      matchable).
    - ``touch(blocks)``: a prefix hit; a zero-ref block leaves the free queue;
      every block's ``ref_cnt`` goes up by one.
    - ``cache_full_blocks(blocks, block_hashes, num_cached_blocks, num_full_blocks)``:
      ``blocks[i]`` gets ``block_hashes[i]`` for
      ``num_cached_blocks <= i < num_full_blocks`` and enters the prefix
      cache. Blocks that already carry that hash (prefix hits) and the null
      block are skipped. ``blocks`` is one request's block list and
      ``block_hashes`` its chained hashes (``pagedkv.hashing``).
    - ``evict_blocks(block_ids)``: the listed free blocks leave the prefix
      cache (hash and entry dropped), staying in the free queue where they
      are; unhashed ones are skipped, a held cached one is refused.
    - ``cached_block_hashes_by_block``: block id -> the further keys a block is
      filed under beside its hash (only grouped managers file any; see
      ``single_type_managers``); they leave the cache with the block's hash.
    - ``get_cached_block(block_hash)`` -> the block cached under that hash, or
      ``None`` (a key that is not a ``bytes`` or ``int`` hash is a
      ``TypeError``: ``3.0`` and ``True`` would otherwise find ``3`` and ``1``).
    - ``get_num_free_blocks()``, ``get_usage()`` (fraction in use, null block
      excluded), ``reset_prefix_cache()`` (False, and nothing done, while any
      block but the null block is in use).
    - ``check()``: verify every invariant; raise ``InvariantError`` naming the
      broken one. Costs nothing unless called.
    - ``subscribe``/``unsubscribe``/``deferred_events``: see ``pool_events``.

Bad input (freeing a block whose ``ref_cnt`` is 0 or the null block, asking
for more blocks than are free, caching a block that is free...) raises
``ValueError``/``TypeError`` naming the value, and leaves every structure as
it was.

Where we are stricter than vLLM 0.33.0
--------------------------------------
- ``free_blocks`` and ``touch`` refuse the null block; vLLM skips it silently,
  because its block tables hold the null block in place of blocks a sliding
  window dropped. Our tables never hold it (one full-attention group, and
  ``KVCacheManager.check()`` verifies it), so the null block reaching these
  calls can only be a caller's mistake, and an error says where.
- ``evict_blocks`` refuses a cached block that a request holds; vLLM
  un-caches it (see there).
- ``cache_full_blocks`` validates its range and its blocks (see there); vLLM
  returns silently when ``num_cached_blocks >= num_full_blocks`` and asserts
  only that a newly cached block has no hash yet.

Block hashes may be ``bytes`` (``pagedkv.hashing``) or ``int``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .common import InvariantError, check_int, require
from .free_queue import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock
from .pool_events import EventSource, ListenerWarning, PoolEvent

__all__ = [
    "BlockHash",
    "KVCacheBlock",
    "FreeKVCacheBlockQueue",
    "BlockPool",
    "PoolEvent",
    "InvariantError",
    "ListenerWarning",
]


def _run_ids(first: KVCacheBlock | None, last: KVCacheBlock | None) -> tuple[int, ...]:
    """The ids of a linked run of blocks, ``first`` to ``last`` inclusive (none if ``first`` is None)."""
    ids = []
    block = first
    while block is not None:
        ids.append(block.block_id)
        if block is last:
            break
        block = block.next_free_block
    return tuple(ids)


class BlockPool(EventSource):
    """Every KV-cache block of one cache group, its free queue and its prefix cache."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool = True) -> None:
        super().__init__()
        num_gpu_blocks = check_int(num_gpu_blocks, "num_gpu_blocks", 0)
        if num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1 (block 0 is the null block), got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = bool(enable_caching)
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        # Free blocks, including cached blocks nobody holds (eviction candidates).
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # Prefix cache: hash -> {block_id: block}. Several blocks may hold the
        # same hash: two requests can compute the same prefix before either is
        # cached, and we never merge them afterwards, because a block id, once
        # in a block table, must not change (block tables are append-only).
        # Lookups return the first block cached under the hash.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        # block id -> keys the block is filed under besides its own hash, in
        # filing order (vLLM's ``cached_block_hashes_by_block``): a grouped
        # full-attention block that holds a prompt's tail is filed whole and
        # under the tail's partial key. Only a hashed block has any; it loses
        # them all with its hash. Empty on the single-group path.
        self.cached_block_hashes_by_block: dict[int, list[BlockHash]] = {}
        # Block 0 is a placeholder that block tables may point at; it is taken
        # out of the queue for good and its ref_cnt is not maintained.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    # -- allocation --------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) held by requests."""
        usable = self.num_gpu_blocks - 1
        if usable == 0:
            return 0.0
        return 1.0 - self.free_block_queue.num_free_blocks / usable

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the head of the free queue; each gets ``ref_cnt = 1``.

        Does not look in the prefix cache (that is the manager's job, before
        calling this). A popped block that still carries a hash from a previous
        tenant is evicted: its prefix-cache entry dies here, at reuse, not when
        it was freed.
        """
        num_blocks = check_int(num_blocks, "num_blocks", 0)
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get num_blocks={num_blocks} new blocks: only "
                             f"{self.free_block_queue.num_free_blocks} are free")
        ret = self.free_block_queue.popleft_n(num_blocks)
        # Each block's own work: a reference, and a stale cache entry dropped.
        evicted = None  # block ids whose cache entry dies here; rarely any
        for block in ret:
            block.ref_cnt = 1  # was 0, as for every queued block
            if block._block_hash is not None:
                self._evict_cached_block(block)
                if evicted is None:
                    evicted = []
                evicted.append(block.block_id)
        if self._listeners:
            if evicted:
                self._emit(PoolEvent("evict", tuple(evicted)))
            self._emit(PoolEvent("allocate", tuple([b.block_id for b in ret])))
        return ret

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        """Drop ``block``'s prefix-cache entries (its hash's, and any further key's) and its hash."""
        keys = [block.block_hash]
        if self.cached_block_hashes_by_block:
            keys += self.cached_block_hashes_by_block.pop(block.block_id, ())
        for block_hash in keys:
            same_hash = self.cached_block_hash_to_block[block_hash]
            del same_hash[block.block_id]
            if not same_hash:
                del self.cached_block_hash_to_block[block_hash]
        block.reset_hash()

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Take the blocks ``block_ids`` out of the prefix cache; they stay where they are.

        vLLM 0.33.0's name and meaning: each listed block that carries a hash
        loses it and its prefix-cache entry, so no later lookup can hit it; a
        block without a hash is skipped. A free block stays in the free queue,
        at its place. Stricter than vLLM, which also un-caches blocks that
        requests still hold (its KV connector reports failed loads): a held
        cached block is refused, because ``KVCacheManager`` counts a running
        request's cached blocks and its ``check()`` requires them to keep
        their hashes. All ids are checked first (an int, a block of this pool,
        not held if hashed): on a bad one nothing has changed. The pool's
        entries go (a block's further keys with its hash); a ``KVCacheManager``'s
        partial entries are its own.
        """
        try:  # a list, so that a bad id is refused with nothing changed
            ids = [check_int(b, f"block_ids[{i}]", 0) for i, b in enumerate(block_ids)]
        except TypeError:
            if isinstance(block_ids, Iterable):
                raise
            raise TypeError(f"block_ids must be an iterable of block ids, got "
                            f"{type(block_ids).__name__} {block_ids!r}") from None
        for i, block_id in enumerate(ids):
            if block_id >= self.num_gpu_blocks:
                raise ValueError(f"block_ids[{i}] = {block_id} is not a block of this pool "
                                 f"(num_gpu_blocks={self.num_gpu_blocks})")
            block = self.blocks[block_id]
            if block.block_hash is not None and block.ref_cnt > 0:
                raise ValueError(f"block {block_id} is cached but held (ref_cnt {block.ref_cnt}): "
                                 "only a free cached block can be evicted")
        evicted = []
        for block_id in dict.fromkeys(ids):  # each block once, in the order given
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict_cached_block(block)
                evicted.append(block_id)
        if self._listeners and evicted:
            self._emit(PoolEvent("uncache", tuple(evicted)))

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Release one reference to each block; queue those that reach zero.

        ``ordered_blocks`` is in eviction priority (a request frees its blocks
        reversed: its tail, the least shareable prefix, goes first). Of the
        blocks reaching zero, those without a hash go to the *head*, in order,
        and are reused next; those with a hash go to the *tail*, in order,
        keeping it: recycled last, matchable until then (LRU prefix cache).

        All or nothing: a block that is not held (``ref_cnt`` 0, or listed more
        often than it is held), not this pool's, or the null block (see the
        module docstring) makes the whole call a ``ValueError``, nothing changed.
        """
        # A list, so that bad input can be refused with nothing changed.
        blocks = ordered_blocks if type(ordered_blocks) is list else list(ordered_blocks)
        pool_blocks, caching, queue = self.blocks, self.enable_caching, self.free_block_queue
        # One pass: decrement, and chain the blocks reaching zero into two
        # private runs (unhashed for the head, hashed for the tail): the
        # queue's prepend_n/append_n fused with the counting (why: the notes of
        # pagedkv.bench.block_pool). The null block's ref_cnt is 0: the first
        # test refuses it.
        head_first = head_last = tail_first = tail_last = None
        num_queued = 0
        remaining = iter(blocks)
        try:
            for block in remaining:
                ref_cnt = block.ref_cnt - 1
                if ref_cnt < 0 or pool_blocks[block.block_id] is not block:
                    raise LookupError
                block.ref_cnt = ref_cnt
                if ref_cnt == 0:
                    num_queued += 1
                    block._free_queue = queue  # it will be linked into this queue
                    if block._block_hash is None or not caching:
                        if head_last is None:
                            head_first = block
                        else:
                            head_last.next_free_block = block
                            block.prev_free_block = head_last
                        head_last = block
                    else:
                        if tail_last is None:
                            tail_first = block
                        else:
                            tail_last.next_free_block = block
                            block.prev_free_block = tail_last
                        tail_last = block
        except Exception:  # a bad block (or no block at all); the iterator stopped just past it
            raise self._undo_free(blocks, len(blocks) - len(list(remaining)) - 1) from None
        # Only now, with the whole batch valid, do the runs enter the queue
        # (each line links a pair both ways).
        if head_first is not None:  # head_first becomes the head: reused next
            head = queue.fake_free_list_head
            old_first = head.next_free_block
            head.next_free_block, head_first.prev_free_block = head_first, head
            head_last.next_free_block, old_first.prev_free_block = old_first, head_last
        if tail_first is not None:  # tail_last becomes the tail: recycled last
            tail = queue.fake_free_list_tail
            old_last = tail.prev_free_block
            old_last.next_free_block, tail_first.prev_free_block = tail_first, old_last
            tail_last.next_free_block, tail.prev_free_block = tail, tail_last
        queue.num_free_blocks += num_queued
        if self._listeners:
            self._emit(PoolEvent("free", tuple([b.block_id for b in blocks]),
                                 _run_ids(head_first, head_last), _run_ids(tail_first, tail_last)))

    def _undo_free(self, blocks: list[KVCacheBlock], bad: int) -> Exception:
        """Put back what ``free_blocks`` did to ``blocks[:bad]``; the error that ``blocks[bad]`` deserves."""
        error = self._bad_free(blocks[bad])  # describe it before undoing
        for block in blocks[:bad]:  # references back, private runs unlinked
            block.ref_cnt += 1
            block.prev_free_block = block.next_free_block = None
        return error

    def owns(self, block: KVCacheBlock) -> bool:
        """True when ``block`` is one of this pool's blocks (not a look-alike from another pool)."""
        block_id = block.block_id
        return type(block_id) is int and 0 <= block_id < self.num_gpu_blocks and self.blocks[block_id] is block

    def _bad_free(self, block: KVCacheBlock) -> Exception:
        if not isinstance(block, KVCacheBlock):
            return TypeError(f"free_blocks expects KVCacheBlock, got {type(block).__name__} {block!r}")
        if block.is_null:
            return ValueError("cannot free the null block (block 0 is never allocated)")
        if not self.owns(block):
            return ValueError(f"block {block.block_id} does not belong to this pool")
        return ValueError(
            f"cannot free block {block.block_id}: its ref_cnt is already {block.ref_cnt} "
            "(freed twice, or listed more times than it is held)"
        )

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix hit: take one more reference to each block.

        A block nobody held is still in the free queue as an eviction
        candidate; it leaves the queue (O(1), from anywhere in it) so it cannot
        be recycled while in use.

        The null block is refused, where vLLM skips it: vLLM's hits may contain
        it (sliding-window groups), ours never do, so it can only be a mistake.
        """
        blocks = list(blocks)
        for block in blocks:  # validate everything first: nothing changes on error
            if not isinstance(block, KVCacheBlock):
                raise TypeError(f"touch expects KVCacheBlock, got {type(block).__name__} {block!r}")
            if block.is_null:
                raise ValueError("cannot touch the null block (it is never shared)")
            if not self.owns(block):
                raise ValueError(f"block {block.block_id} does not belong to this pool")
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1
        if self._listeners:
            self._emit(PoolEvent("touch", tuple([b.block_id for b in blocks])))

    # -- prefix cache ------------------------------------------------------

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Enter one request's newly full blocks into the prefix cache.

        ``blocks`` is the request's block list, ``block_hashes`` its chained
        hashes (one per full block). Blocks ``num_cached_blocks`` up to
        ``num_full_blocks - 1`` get their hash: ``blocks[i].block_hash =
        block_hashes[i]``. A block that already carries that same hash (a prefix
        hit) and the null block are skipped. No-op when caching is disabled.

        Duplicates are kept, not merged (see ``cached_block_hash_to_block``).

        Stricter than vLLM 0.33.0, which returns silently when
        ``num_cached_blocks >= num_full_blocks`` and otherwise only asserts
        that a newly cached block carries no hash. Here the whole range is
        validated before anything is hashed, and each check names a real
        mistake: ``num_cached_blocks > num_full_blocks`` or a range past the
        block list (the caller's counters went wrong), a block that is free
        (cached after it was freed), another pool's block, a hash that is not
        ``bytes``/``int``, one block twice, or a block that already holds a
        *different* hash (the request's hashes do not describe its blocks).
        """
        num_cached_blocks = check_int(num_cached_blocks, "num_cached_blocks", 0)
        num_full_blocks = check_int(num_full_blocks, "num_full_blocks", 0)
        if num_cached_blocks > num_full_blocks:
            raise ValueError(f"num_cached_blocks={num_cached_blocks} exceeds num_full_blocks={num_full_blocks}")
        if num_full_blocks > len(blocks) or num_full_blocks > len(block_hashes):
            raise ValueError(f"num_full_blocks={num_full_blocks} exceeds len(blocks)={len(blocks)} "
                             f"or len(block_hashes)={len(block_hashes)}")
        if not self.enable_caching:
            return
        todo: list[tuple[KVCacheBlock, BlockHash]] = []  # validated first: a refusal changes nothing
        seen: set[int] = set()
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            if not isinstance(block, KVCacheBlock):
                raise TypeError(f"blocks[{i}] is {type(block).__name__} {block!r}, not a KVCacheBlock")
            if block.is_null:
                continue
            if not self.owns(block):
                raise ValueError(f"blocks[{i}] (block {block.block_id}) does not belong to this pool")
            if isinstance(block_hash, bool) or not isinstance(block_hash, (bytes, int)):
                raise TypeError(f"block_hashes[{i}] = {block_hash!r} is not a bytes or int hash")
            if block.ref_cnt <= 0:
                raise ValueError(f"blocks[{i}] (block {block.block_id}) has ref_cnt {block.ref_cnt}: "
                                 "only blocks a request holds can be cached")
            if block.block_id in seen:
                raise ValueError(f"block {block.block_id} appears twice in "
                                 f"blocks[{num_cached_blocks}:{num_full_blocks}]")
            seen.add(block.block_id)
            if block.block_hash is not None:
                if block.block_hash != block_hash:
                    raise ValueError(f"blocks[{i}] (block {block.block_id}) already holds a different hash "
                                     f"than block_hashes[{i}]")
                continue  # already cached under this hash: a prefix hit
            todo.append((block, block_hash))
        for block, block_hash in todo:
            block.block_hash = block_hash
            self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block
        if self._listeners and todo:
            self._emit(PoolEvent("cache", tuple(b.block_id for b, _ in todo)))

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block cached under ``block_hash`` (the first cached, if several), or None.

        ``TypeError`` for a key that is not a ``bytes`` or ``int`` hash: ``3.0``
        and ``True`` compare equal to ``3`` and ``1`` in a dict and would find
        the blocks cached under those.
        """
        if type(block_hash) is not bytes and (
            isinstance(block_hash, bool) or not isinstance(block_hash, (bytes, int))
        ):
            raise TypeError(
                f"block_hash must be a bytes or int hash, got {type(block_hash).__name__} {block_hash!r}"
            )
        same_hash = self.cached_block_hash_to_block.get(block_hash)
        if not same_hash:
            return None
        return next(iter(same_hash.values()))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, but only when no request holds a block.

        Returns False, and changes nothing, while any block but the null block
        is in use: a running request's blocks are in its block table and
        their hashes must stay consistent with what it computed.
        """
        num_used_blocks = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used_blocks != 1:  # only the null block
            return False
        cleared = []
        for block in self.blocks:
            if block.block_hash is not None:
                block.reset_hash()
                cleared.append(block.block_id)
        self.cached_block_hash_to_block = {}
        self.cached_block_hashes_by_block = {}
        if self._listeners:
            self._emit(PoolEvent("reset", tuple(cleared)))
        return True

    # -- invariants --------------------------------------------------------

    def check(self) -> None:
        """Verify every invariant; raise ``InvariantError`` naming the first broken one."""
        self._check_blocks()
        queued = self.free_block_queue.check()  # the list itself: links, sentinels, count
        self._check_free_means_unreferenced(queued)
        self._check_prefix_cache()

    def _check_blocks(self) -> None:
        n = self.num_gpu_blocks
        require(len(self.blocks) == n, "one block per id", f"{len(self.blocks)} blocks for num_gpu_blocks={n}")
        for i, block in enumerate(self.blocks):
            require(block.block_id == i, "one block per id", lambda: f"blocks[{i}] has block_id {block.block_id}")
        null = self.null_block
        require(null is self.blocks[0] and null.is_null, "null block is block 0", f"null_block is {null!r}")
        require(not any(b.is_null for b in self.blocks[1:]), "null block is block 0", "another block is marked is_null")
        require(null.prev_free_block is None and null.next_free_block is None, "null block is never free",
                "block 0 is linked into the free queue")
        require(null.block_hash is None, "null block is never cached", f"block 0 holds hash {null.block_hash!r}")

    def _check_free_means_unreferenced(self, queued: list[KVCacheBlock]) -> None:
        """Queued blocks are this pool's, with ref_cnt 0; every other block is held and unlinked."""
        queued_ids = set()
        for block in queued:
            require(self.owns(block), "queue holds pool blocks", lambda: f"foreign block {block!r} in the free queue")
            require(block.ref_cnt == 0, "free <=> ref_cnt == 0",
                    lambda: f"queued block {block.block_id} has ref_cnt {block.ref_cnt}")
            queued_ids.add(block.block_id)
        for block in self.blocks[1:]:
            if block.block_id in queued_ids:
                continue
            require(block.ref_cnt > 0, "free <=> ref_cnt == 0",
                    lambda: f"block {block.block_id} is out of the queue with ref_cnt {block.ref_cnt}")
            require(block.prev_free_block is None and block.next_free_block is None, "links consistent",
                    lambda: f"block {block.block_id} is out of the queue but still linked")

    def _check_prefix_cache(self) -> None:
        """The prefix cache and the blocks' hashes agree, both ways."""
        table = self.cached_block_hash_to_block
        require(self.enable_caching or not (table or any(b.block_hash is not None for b in self.blocks)),
                "no cache without caching", "a hash is recorded while enable_caching=False")
        n, num_entries = self.num_gpu_blocks, 0
        for block_hash, same_hash in table.items():
            require(same_hash, "cache map agrees with hashes", lambda: f"empty entry for hash {block_hash!r}")
            for block_id, block in same_hash.items():
                num_entries += 1
                require(0 <= block_id < n and self.blocks[block_id] is block, "cache map agrees with hashes",
                        lambda: f"entry {block_id} is not pool block {block_id}")
                require(block.block_hash == block_hash
                        or block_hash in self.cached_block_hashes_by_block.get(block_id, ()),
                        "cache map agrees with hashes",
                        lambda: f"block {block_id} is filed under a hash it does not hold")
        num_keys = sum(b.block_hash is not None for b in self.blocks)
        for block_id, keys in self.cached_block_hashes_by_block.items():
            block = self.blocks[block_id]
            require(keys and block.block_hash is not None and len(set(keys)) == len(keys)
                    and block.block_hash not in keys, "further keys only beside a hash",
                    lambda: f"block {block_id} holds {block.block_hash!r} and further keys {keys!r}")
            num_keys += len(keys)
        require(num_keys == num_entries, "cache map agrees with hashes",
                f"blocks hold {num_keys} keys, the map has {num_entries} entries")
