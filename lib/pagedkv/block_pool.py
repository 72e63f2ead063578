"""The block pool: every physical KV-cache block, one free queue, one prefix cache.

This is vLLM V1's allocator core (``vllm/v1/core/block_pool.py`` and the block
classes of ``kv_cache_utils.py``), rebuilt small enough to read in one sitting,
with the same names and the same semantics. The KV *data* lives elsewhere, in
per-layer tensors indexed by block id; here is only the metadata that decides
which block a request gets.

Public API (stable: ``kv_cache_manager`` and the views build on it)
-------------------------------------------------------------------

``KVCacheBlock(block_id)``
    Slots dataclass: ``block_id``, ``ref_cnt``, ``block_hash`` (property; set
    once, cleared only by ``reset_hash()``), ``prev_free_block``,
    ``next_free_block`` (owned by the free queue), ``is_null``.

``FreeKVCacheBlockQueue(blocks)``
    Intrusive doubly linked list with sentinels ``fake_free_list_head`` /
    ``fake_free_list_tail``; ``num_free_blocks``, ``popleft()``,
    ``popleft_n(n)``, ``remove(block)`` (O(1)), ``append(block)``,
    ``append_n(blocks)``, ``prepend_n(blocks)`` (afterwards ``blocks[0]`` is
    the head, in the given order), ``get_all_free_blocks()`` (head to tail).

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
    - ``get_cached_block(block_hash)`` -> the block cached under that hash, or
      ``None`` (a key that is not a ``bytes`` or ``int`` hash is a
      ``TypeError``: ``3.0`` and ``True`` would otherwise find ``3`` and ``1``).
    - ``get_num_free_blocks()``, ``get_usage()`` (fraction in use, null block
      excluded), ``reset_prefix_cache()`` (False, and nothing done, while any
      block but the null block is in use).
    - ``check()``: verify every invariant; raise ``InvariantError`` naming the
      broken one. Costs nothing unless called.
    - ``subscribe(listener)`` / ``unsubscribe(listener)``: the observer hook.
      After each mutation the pool calls ``listener(pool, event)`` with a
      ``PoolEvent``. With no listener the only cost is one truth test per call.
      ``deferred_events()``: a context manager that holds the notifications of
      the mutations made inside it and delivers them, in order, when it exits,
      so that a caller making several pool calls as one operation (the
      manager's ``allocate_slots``) is observed only once it is consistent.

Listeners cannot corrupt the pool. They run only after a mutation is complete,
and an exception raised by a listener is contained: every other listener still
runs, the operation returns normally, and the failure is reported as a
``ListenerWarning`` (a ``RuntimeWarning``) naming the listener, the event and
the exception. A view that breaks must not break the allocator it watches.

Bad input (freeing a block whose ``ref_cnt`` is 0 or the null block, asking
for more blocks than are free, removing a block that is not in this queue...)
raises ``ValueError``/``TypeError`` naming the value, and leaves every
structure as it was.

Where we are stricter than vLLM 0.33.0
--------------------------------------
- ``free_blocks`` and ``touch`` refuse the null block; vLLM skips it silently,
  because its block tables hold the null block in place of blocks a sliding
  window dropped. Our tables never hold it (one full-attention group, and
  ``KVCacheManager.check()`` verifies it), so the null block reaching these
  calls can only be a caller's mistake, and an error says where.
- ``cache_full_blocks`` validates its range and its blocks (see there); vLLM
  returns silently when ``num_cached_blocks >= num_full_blocks`` and asserts
  only that a newly cached block has no hash yet.

Block hashes may be ``bytes`` (``pagedkv.hashing``) or ``int``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple, Union

from .common import InvariantError, check_int

__all__ = [
    "BlockHash",
    "KVCacheBlock",
    "FreeKVCacheBlockQueue",
    "BlockPool",
    "PoolEvent",
    "InvariantError",
    "ListenerWarning",
]

#: What a block hash may be: SHA-256 bytes from ``pagedkv.hashing``, or an int.
BlockHash = Union[bytes, int]



class ListenerWarning(RuntimeWarning):
    """A pool listener raised; the pool contained the exception and stayed consistent."""



@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one physical KV-cache block (its data lives in the KV tensors).

    Blocks compare and hash by identity (``eq=False``): two blocks are the same
    block only if they are the same object, so ``block in some_list`` and sets
    of blocks are cheap and never confuse blocks of two pools.
    """

    # Index of the block in every layer's KV tensor, 0 .. num_gpu_blocks - 1.
    block_id: int
    # How many requests hold this block. 0 <=> the block sits in the free queue
    # (except the null block, whose count is never maintained).
    ref_cnt: int = 0
    # Hash of the token prefix this block completes; only set while the block
    # is full and cached. Read it through ``block_hash``.
    _block_hash: BlockHash | None = None
    # Links of the intrusive free list, set by FreeKVCacheBlockQueue (and by
    # BlockPool's batch fast paths); both are None exactly when the block is
    # not in the queue.
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    # The placeholder block 0: never allocated, freed or cached.
    is_null: bool = False
    # The queue this block was last linked into, set by whoever links it (the
    # queue, or BlockPool.free_blocks). Meaningful only while the block is
    # linked: it lets ``remove`` refuse a block that sits in another queue.
    _free_queue: FreeKVCacheBlockQueue | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def block_hash(self) -> BlockHash | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHash) -> None:
        # A block's hash is set once, when it fills; changing it in place would
        # leave a stale prefix-cache entry pointing at the wrong content.
        if self._block_hash is not None:
            raise ValueError(
                f"block {self.block_id} already has a hash; call reset_hash() first"
            )
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        """Forget the hash (the block is being reused for other content)."""
        self._block_hash = None

    def __repr__(self) -> str:
        # Ids, not blocks, for the links: printing a neighbour would recurse.
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"block_hash={self._block_hash!r}, prev_free_block={prev_id}, "
            f"next_free_block={next_id}{', is_null=True' if self.is_null else ''})"
        )


class FreeKVCacheBlockQueue:
    """The free blocks as a doubly linked list threaded through the blocks themselves.

    Why not ``collections.deque``? A prefix hit must pull a cached block out of
    the *middle* of the queue, and ``deque.remove`` is a linear scan. Here the
    links live on the blocks, so ``remove`` is O(1), and no Python object is
    allocated while linking or unlinking.

    Two sentinel blocks (id -1) bracket the list, so every real block in the
    queue has a non-None neighbour on both sides and no operation needs a
    special case for an empty queue or for the ends.

    Order is eviction order: the head is reused first. At construction the
    blocks are queued in the order given (block id order for a pool).

    ``BlockPool.get_new_blocks`` and ``free_blocks`` perform the same splices
    as ``popleft_n``, ``prepend_n`` and ``append_n`` inline, fused with their
    reference counting, so that a batch costs one pass and no temporary list.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        self.num_free_blocks = 0
        self.fake_free_list_head.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = self.fake_free_list_head
        self.append_n(list(blocks))

    # -- taking blocks out -------------------------------------------------

    def popleft(self) -> KVCacheBlock:
        """Unlink and return the head block."""
        first = self.fake_free_list_head.next_free_block
        if first is self.fake_free_list_tail:
            raise ValueError("No free blocks available")
        self.fake_free_list_head.next_free_block = first.next_free_block
        first.next_free_block.prev_free_block = self.fake_free_list_head
        first.prev_free_block = first.next_free_block = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Unlink and return the first ``n`` blocks, head first, in one pass."""
        if type(n) is not int or n < 0:
            n = check_int(n, "n", 0)
        if n > self.num_free_blocks:
            raise ValueError(
                f"cannot pop n={n} blocks: only {self.num_free_blocks} are free"
            )
        return self._popleft_n(n)

    def _popleft_n(self, n: int) -> list[KVCacheBlock]:
        # Unchecked: the caller guarantees 0 <= n <= num_free_blocks.
        head = self.fake_free_list_head
        ret = []
        append = ret.append
        block = head.next_free_block
        for _ in range(n):
            append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        # Splice the sentinel to the first block not taken (maybe the tail sentinel).
        head.next_free_block = block
        block.prev_free_block = head
        self.num_free_blocks -= n
        return ret

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue, in O(1).

        Refused (``ValueError``, nothing changed) when the block is in no queue,
        or linked into *another* queue: unlinking it here would corrupt that
        queue and this queue's count at once.
        """
        if not isinstance(block, KVCacheBlock):
            raise TypeError(f"expected a KVCacheBlock, got {type(block).__name__} {block!r}")
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        if block._free_queue is not self:
            raise ValueError(f"block {block.block_id} is linked into another free queue, not this one")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    # -- putting blocks back -----------------------------------------------

    def append(self, block: KVCacheBlock) -> None:
        """Link ``block`` in at the tail (it will be reused last)."""
        if not isinstance(block, KVCacheBlock):
            raise TypeError(f"expected a KVCacheBlock, got {type(block).__name__} {block!r}")
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = tail
        block._free_queue = self
        tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Link ``blocks`` in at the tail, in the given order."""
        self._check_insertable(blocks)
        self._append_n(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Link ``blocks`` in at the head so that ``blocks[0]`` becomes the head."""
        self._check_insertable(blocks)
        self._prepend_n(blocks)

    def _check_insertable(self, blocks: Sequence[KVCacheBlock]) -> None:
        # Linking a block that is already queued, or the same block twice,
        # would silently cut the list: refuse before touching any link.
        seen: set[int] = set()
        for block in blocks:
            if not isinstance(block, KVCacheBlock):
                raise TypeError(f"expected a KVCacheBlock, got {type(block).__name__} {block!r}")
            if block.prev_free_block is not None or block.next_free_block is not None:
                raise ValueError(f"block {block.block_id} is already in the free queue")
            if id(block) in seen:
                raise ValueError(f"block {block.block_id} appears twice in one batch")
            seen.add(id(block))

    def _append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        # Unchecked: blocks are distinct and unlinked.
        self._insert_after(self.fake_free_list_tail.prev_free_block, blocks)

    def _prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        # Unchecked: blocks are distinct and unlinked.
        self._insert_after(self.fake_free_list_head, blocks)

    def _insert_after(self, prev: KVCacheBlock, blocks: Sequence[KVCacheBlock]) -> None:
        """Link ``blocks`` as one chain, in order, between ``prev`` and its successor."""
        if not blocks:
            return
        nxt = prev.next_free_block
        for block in blocks:
            block.prev_free_block = prev
            block._free_queue = self
            prev.next_free_block = block
            prev = block
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    # -- looking -----------------------------------------------------------

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The queued blocks from head to tail (a linear walk; for tests and views)."""
        ret = []
        block = self.fake_free_list_head.next_free_block
        tail = self.fake_free_list_tail
        while block is not tail and block is not None:
            ret.append(block)
            block = block.next_free_block
        return ret

    def __len__(self) -> int:
        return self.num_free_blocks


class PoolEvent(NamedTuple):
    """One mutation of a pool, reported to its listeners after it happened.

    ``kind`` is one of:

    - ``"evict"``: ``block_ids`` lost their hash because they are being reused
      (reported just before the ``"allocate"`` that reuses them);
    - ``"allocate"``: ``block_ids`` were popped from the head, in order;
    - ``"free"``: ``block_ids`` were released, in the order given; of those that
      reached ``ref_cnt == 0``, ``head`` went to the head and ``tail`` (hashed) to
      the tail of the free queue;
    - ``"touch"``: ``block_ids`` gained a reference (a prefix hit);
    - ``"cache"``: ``block_ids`` received a hash and entered the prefix cache;
    - ``"reset"``: ``reset_prefix_cache`` cleared the hashes of ``block_ids``.
    """

    kind: str
    block_ids: tuple[int, ...]
    head: tuple[int, ...] = ()
    tail: tuple[int, ...] = ()


Listener = Callable[["BlockPool", PoolEvent], None]


def _run_ids(first: KVCacheBlock | None, last: KVCacheBlock | None) -> tuple[int, ...]:
    """The ids of a linked run of blocks, ``first`` to ``last`` inclusive."""
    ids = []
    block = first
    while block is not None:
        ids.append(block.block_id)
        if block is last:
            break
        block = block.next_free_block
    return tuple(ids)


class BlockPool:
    """Every KV-cache block of one cache group, its free queue and its prefix cache."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool = True) -> None:
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
        # Block 0 is a placeholder that block tables may point at; it is taken
        # out of the queue for good and its ref_cnt is not maintained.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self._listeners: list[Listener] = []
        # Events held back by deferred_events(), or None when delivered at once.
        self._held_events: list[PoolEvent] | None = None

    # -- observer hook -----------------------------------------------------

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(pool, event)`` after every mutation; returns an unsubscribe function."""
        if not callable(listener):
            raise TypeError(f"listener must be callable, got {listener!r}")
        self._listeners.append(listener)
        return lambda: self.unsubscribe(listener)

    def unsubscribe(self, listener: Listener) -> None:
        """Stop calling ``listener`` (no error if it was not subscribed)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _emit(self, event: PoolEvent, stacklevel: int = 3) -> None:
        # Called only after a mutation is complete, so the pool is consistent
        # whatever a listener does; a listener's exception is contained here.
        if self._held_events is not None:
            self._held_events.append(event)
            return
        for listener in list(self._listeners):
            try:
                listener(self, event)
            except Exception as exc:  # noqa: BLE001 -- a broken view must not break the allocator
                warnings.warn(
                    f"pool listener {listener!r} raised {type(exc).__name__}: {exc} on a "
                    f"{event.kind!r} event; the pool is unaffected and the other listeners ran",
                    ListenerWarning,
                    stacklevel=stacklevel,  # the pool method's caller
                )

    @contextmanager
    def deferred_events(self) -> Iterator[None]:
        """Hold listener notifications until the ``with`` block ends, then deliver them in order.

        For callers that make several pool calls as one operation: listeners
        then see the operation only once the caller's own structures agree with
        the pool. Nested uses deliver at the outermost exit. Events are
        delivered even if the block raises (they describe mutations that did
        happen).
        """
        if self._held_events is not None:  # nested: the outer block delivers
            yield
            return
        self._held_events = held = []
        try:
            yield
        finally:
            self._held_events = None
            if self._listeners:
                for event in held:
                    # The caller of the method that opened the ``with`` (past contextlib).
                    self._emit(event, stacklevel=5)

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
        if type(num_blocks) is not int or num_blocks < 0:  # fast path: a plain int >= 0
            num_blocks = check_int(num_blocks, "num_blocks", 0)
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise ValueError(
                f"cannot get num_blocks={num_blocks} new blocks: only "
                f"{queue.num_free_blocks} are free"
            )
        # One pass: unlink each block from the head (what queue.popleft_n does),
        # take its reference and drop a stale cache entry.
        head = queue.fake_free_list_head
        ret = []
        take = ret.append
        evicted = None  # block ids whose cache entry dies here; rarely any
        block = head.next_free_block
        for _ in range(num_blocks):
            take(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block.ref_cnt = 1  # was 0, as for every queued block
            if block._block_hash is not None:
                self._evict_cached_block(block)
                if evicted is None:
                    evicted = []
                evicted.append(block.block_id)
            block = nxt
        head.next_free_block = block  # the first block not taken, or the tail sentinel
        block.prev_free_block = head
        queue.num_free_blocks -= num_blocks
        if self._listeners:
            if evicted:
                self._emit(PoolEvent("evict", tuple(evicted)))
            self._emit(PoolEvent("allocate", tuple([b.block_id for b in ret])))
        return ret

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        """Drop ``block``'s prefix-cache entry and its hash."""
        block_hash = block._block_hash
        same_hash = self.cached_block_hash_to_block[block_hash]
        del same_hash[block.block_id]
        if not same_hash:
            del self.cached_block_hash_to_block[block_hash]
        block.reset_hash()

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Release one reference to each block; queue those that reach zero.

        ``ordered_blocks`` is in eviction priority: the first is evicted first.
        A request frees its blocks in reverse (its tail, the least shareable
        prefix, should go first). Of the blocks reaching zero, those without a
        hash never match the prefix cache, so they go to the *head*, in order,
        and are reused next (LIFO, warm in GPU caches). Those with a hash go to
        the *tail*, in order, keeping their hash: they are recycled last and
        stay matchable until then (LRU eviction of the prefix cache).

        All or nothing: a block that is not held (``ref_cnt`` 0, or listed more
        often than it is held), not this pool's, or the null block makes the
        whole call a ``ValueError`` with nothing changed. vLLM skips the null
        block silently because its tables hold it in place of blocks a sliding
        window dropped; ours never do, so here it is a caller's mistake.
        """
        # The only allocation: the argument as a list, so that bad input can be
        # refused with nothing changed (an iterator cannot be walked twice).
        blocks = ordered_blocks if type(ordered_blocks) is list else list(ordered_blocks)
        pool_blocks = self.blocks
        caching = self.enable_caching
        queue = self.free_block_queue
        # One pass: decrement, and chain the blocks that reach zero into two
        # private runs, in order: unhashed ones for the head, hashed ones for
        # the tail. The runs are spliced into the queue only after the whole
        # batch has passed (what queue.prepend_n and queue.append_n do). The
        # null block's ref_cnt is always 0, so the first test refuses it too.
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
                    # It will be linked into this queue. (An undo below leaves it
                    # unlinked, where the tag means nothing.)
                    block._free_queue = queue
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
        except Exception:  # a bad block (or not a block at all); the iterator stopped just past it
            bad = len(blocks) - len(list(remaining)) - 1
            error = self._bad_free(blocks[bad])  # describe it before undoing
            for block in blocks[:bad]:  # undo: references back, private runs unlinked
                block.ref_cnt += 1
                block.prev_free_block = block.next_free_block = None
            raise error from None
        if head_first is not None:  # head_first becomes the head: reused next
            head = queue.fake_free_list_head
            old_first = head.next_free_block
            head.next_free_block = head_first
            head_first.prev_free_block = head
            head_last.next_free_block = old_first
            old_first.prev_free_block = head_last
        if tail_first is not None:  # tail_last becomes the tail: recycled last
            tail = queue.fake_free_list_tail
            old_last = tail.prev_free_block
            old_last.next_free_block = tail_first
            tail_first.prev_free_block = old_last
            tail_last.next_free_block = tail
            tail.prev_free_block = tail_last
        queue.num_free_blocks += num_queued
        if self._listeners:
            self._emit(PoolEvent("free", tuple([b.block_id for b in blocks]),
                                 _run_ids(head_first, head_last), _run_ids(tail_first, tail_last)))

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

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
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
            raise ValueError(
                f"num_cached_blocks={num_cached_blocks} exceeds num_full_blocks={num_full_blocks}"
            )
        if num_full_blocks > len(blocks) or num_full_blocks > len(block_hashes):
            raise ValueError(
                f"num_full_blocks={num_full_blocks} exceeds len(blocks)={len(blocks)} "
                f"or len(block_hashes)={len(block_hashes)}"
            )
        if not self.enable_caching:
            return
        # Validate the whole range before hashing anything.
        todo: list[tuple[KVCacheBlock, BlockHash]] = []
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
                raise ValueError(
                    f"blocks[{i}] (block {block.block_id}) has ref_cnt {block.ref_cnt}: "
                    "only blocks a request holds can be cached"
                )
            if block.block_id in seen:
                raise ValueError(f"block {block.block_id} appears twice in blocks[{num_cached_blocks}:{num_full_blocks}]")
            seen.add(block.block_id)
            if block._block_hash is not None:
                if block._block_hash != block_hash:
                    raise ValueError(
                        f"blocks[{i}] (block {block.block_id}) already holds a different hash "
                        f"than block_hashes[{i}]"
                    )
                continue  # already cached under this hash: a prefix hit
            todo.append((block, block_hash))
        table = self.cached_block_hash_to_block
        for block, block_hash in todo:
            block.block_hash = block_hash
            same_hash = table.get(block_hash)
            if same_hash is None:
                table[block_hash] = {block.block_id: block}
            else:
                same_hash[block.block_id] = block
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
            if block._block_hash is not None:
                block.reset_hash()
                cleared.append(block.block_id)
        self.cached_block_hash_to_block = {}
        if self._listeners:
            self._emit(PoolEvent("reset", tuple(cleared)))
        return True

    # -- invariants --------------------------------------------------------

    def check(self) -> None:
        """Verify every invariant; raise ``InvariantError`` naming the first broken one."""

        def fail(name: str, detail: str) -> None:
            raise InvariantError(f"invariant '{name}' broken: {detail}")

        n = self.num_gpu_blocks
        if len(self.blocks) != n:
            fail("one block per id", f"{len(self.blocks)} blocks for num_gpu_blocks={n}")
        for i, block in enumerate(self.blocks):
            if block.block_id != i:
                fail("one block per id", f"blocks[{i}] has block_id {block.block_id}")

        null = self.null_block
        if null is not self.blocks[0] or not null.is_null:
            fail("null block is block 0", f"null_block is {null!r}")
        if any(b.is_null for b in self.blocks[1:]):
            fail("null block is block 0", "another block is marked is_null")
        if null.prev_free_block is not None or null.next_free_block is not None:
            fail("null block is never free", "block 0 is linked into the free queue")
        if null._block_hash is not None:
            fail("null block is never cached", f"block 0 holds hash {null._block_hash!r}")

        # Walk the queue forwards, checking the back links as we go.
        queue = self.free_block_queue
        head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
        if head.prev_free_block is not None or tail.next_free_block is not None:
            fail("sentinels end the list", "a sentinel has an outer link")
        queued: set[int] = set()
        prev, block = head, head.next_free_block
        while block is not tail:
            if block is None:
                fail("links consistent", f"the list breaks after block {prev.block_id}")
            if block.prev_free_block is not prev:
                fail("links consistent", f"block {block.block_id}.prev is not block {prev.block_id}")
            if not (0 <= block.block_id < n) or self.blocks[block.block_id] is not block:
                fail("queue holds pool blocks", f"foreign block {block!r} in the free queue")
            if block.block_id in queued:
                fail("links consistent", f"block {block.block_id} appears twice (a cycle)")
            if block._free_queue is not queue:
                fail("queued blocks know their queue", f"block {block.block_id} is not tagged with this queue")
            queued.add(block.block_id)
            if block.ref_cnt != 0:
                fail("free <=> ref_cnt == 0", f"queued block {block.block_id} has ref_cnt {block.ref_cnt}")
            prev, block = block, block.next_free_block
        if tail.prev_free_block is not prev:
            fail("links consistent", "the tail sentinel does not point back at the last block")
        if len(queued) != queue.num_free_blocks:
            fail("num_free_blocks counts the queue", f"{len(queued)} queued, counter says {queue.num_free_blocks}")

        for block in self.blocks[1:]:
            if block.block_id in queued:
                continue
            if block.ref_cnt <= 0:
                fail("free <=> ref_cnt == 0", f"block {block.block_id} is out of the queue with ref_cnt {block.ref_cnt}")
            if block.prev_free_block is not None or block.next_free_block is not None:
                fail("links consistent", f"block {block.block_id} is out of the queue but still linked")

        # The prefix cache and the blocks' hashes agree, both ways.
        table = self.cached_block_hash_to_block
        if not self.enable_caching and (table or any(b._block_hash is not None for b in self.blocks)):
            fail("no cache without caching", "a hash is recorded while enable_caching=False")
        num_entries = 0
        for block_hash, same_hash in table.items():
            if not same_hash:
                fail("cache map agrees with hashes", f"empty entry for hash {block_hash!r}")
            for block_id, block in same_hash.items():
                num_entries += 1
                if not (0 <= block_id < n) or self.blocks[block_id] is not block:
                    fail("cache map agrees with hashes", f"entry {block_id} is not pool block {block_id}")
                if block._block_hash != block_hash:
                    fail("cache map agrees with hashes", f"block {block_id} is filed under a hash it does not hold")
        num_hashed = sum(b._block_hash is not None for b in self.blocks)
        if num_hashed != num_entries:
            fail("cache map agrees with hashes", f"{num_hashed} blocks hold a hash, the map has {num_entries} entries")
