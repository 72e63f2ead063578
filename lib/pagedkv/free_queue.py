"""A KV-cache block's metadata, and the free queue threaded through the blocks themselves.

vLLM V1 keeps ``KVCacheBlock`` and ``FreeKVCacheBlockQueue`` in
``vllm/v1/core/kv_cache_utils.py``, beside hashing helpers and the
configuration code that sizes the cache. Here they get a module of their own,
named for what joins them: the block's ``prev_free_block``/``next_free_block``
fields exist only so that the free queue can be an intrusive linked list, so
the block and the queue are one concept, read together. ``pagedkv.block_pool``
builds the pool on top of them (and re-exports both names).

Public API
----------

``KVCacheBlock(block_id)``
    Slots dataclass: ``block_id``, ``ref_cnt``, ``block_hash`` (property; set
    once, cleared only by ``reset_hash()``), ``prev_free_block``,
    ``next_free_block`` (owned by the free queue), ``is_null``.

``FreeKVCacheBlockQueue(blocks)``
    Doubly linked list with sentinels ``fake_free_list_head`` /
    ``fake_free_list_tail``; ``num_free_blocks``, ``popleft()``,
    ``popleft_n(n)``, ``remove(block)`` (O(1)), ``append(block)``,
    ``append_n(blocks)``, ``prepend_n(blocks)`` (afterwards ``blocks[0]`` is
    the head, in the given order), ``get_all_free_blocks()`` (head to tail),
    ``check()`` (the list's own invariants; returns the queued blocks).

Bad input (popping more blocks than are queued, linking a block that is
already in a queue, or the same block twice, removing a block that is not in
this queue) raises ``ValueError``/``TypeError`` naming the value and leaves
the queue and every block as they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .common import check_int, require
from .hashing import BlockHash  # re-exported: the pool's blocks carry it

__all__ = ["BlockHash", "KVCacheBlock", "FreeKVCacheBlockQueue"]


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
    # BlockPool.free_blocks, which fuses append_n/prepend_n with its reference
    # counting); both are None exactly when the block is not in a queue.
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    # The placeholder block 0: never allocated, freed or cached.
    is_null: bool = False
    # The queue this block was last linked into. Meaningful only while the
    # block is linked: it lets ``remove`` refuse a block of another queue.
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


def _not_a_block(value: object) -> TypeError:
    return TypeError(f"expected a KVCacheBlock, got {type(value).__name__} {value!r}")


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
    ``BlockPool.get_new_blocks`` takes its blocks with ``popleft_n``;
    ``BlockPool.free_blocks`` performs ``prepend_n``/``append_n``'s splices
    itself, fused with its reference counting (one pass instead of two: see
    there why).
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
        if type(n) is not int or n < 0:  # fast path: a plain int >= 0
            n = check_int(n, "n", 0)
        if n > self.num_free_blocks:
            raise ValueError(
                f"cannot pop n={n} blocks: only {self.num_free_blocks} are free"
            )
        head = self.fake_free_list_head
        ret = []
        take = ret.append
        block = head.next_free_block
        for _ in range(n):
            take(block)
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
            raise _not_a_block(block)
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
        self._link_run(self.fake_free_list_tail.prev_free_block, (block,))

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Link ``blocks`` in at the tail, in the given order."""
        self._link_run(self.fake_free_list_tail.prev_free_block, blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Link ``blocks`` in at the head so that ``blocks[0]`` becomes the head."""
        self._link_run(self.fake_free_list_head, blocks)

    def _link_run(self, anchor: KVCacheBlock, blocks: Sequence[KVCacheBlock]) -> None:
        """Link ``blocks``, in order, between ``anchor`` and its successor, in one pass.

        Each block is checked as it is linked. A block in a queue has both
        links set (the queue keeps them None together otherwise), and so has
        a block met earlier in this batch, so testing one link refuses both.
        Refusal unlinks the blocks linked so far: nothing changes.
        """
        nxt = anchor.next_free_block
        last = anchor
        for block in blocks:
            if not isinstance(block, KVCacheBlock) or block.prev_free_block is not None:
                self._unlink_back_to(anchor, last, nxt)
                raise self._refusal(block, blocks)
            block.prev_free_block = last
            block._free_queue = self
            last.next_free_block = block
            last = block
        if last is anchor:  # an empty batch
            return
        last.next_free_block = nxt
        nxt.prev_free_block = last
        self.num_free_blocks += len(blocks)

    @staticmethod
    def _unlink_back_to(anchor: KVCacheBlock, last: KVCacheBlock, nxt: KVCacheBlock) -> None:
        # Undo a partial _link_run: walk back from the last block linked.
        while last is not anchor:
            prev = last.prev_free_block
            last.prev_free_block = last.next_free_block = None
            last = prev
        anchor.next_free_block = nxt

    @staticmethod
    def _refusal(block: object, blocks: Sequence[KVCacheBlock]) -> Exception:
        if not isinstance(block, KVCacheBlock):
            return _not_a_block(block)
        if sum(b is block for b in blocks) > 1:
            return ValueError(f"block {block.block_id} appears twice in one batch")
        return ValueError(f"block {block.block_id} is already in the free queue")

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

    def check(self) -> list[KVCacheBlock]:
        """Verify the list's own invariants and return the queued blocks, head first.

        Raises ``InvariantError`` naming the broken invariant: the sentinels end
        the list, every back link mirrors a forward link, no block appears twice
        (no cycle), every queued block is tagged with this queue, and
        ``num_free_blocks`` counts the list. What a queued block may be (its
        reference count, its pool) is the pool's business.
        """
        head, tail = self.fake_free_list_head, self.fake_free_list_tail
        require(head.prev_free_block is None and tail.next_free_block is None, "sentinels end the list",
                "a sentinel has an outer link")
        queued: list[KVCacheBlock] = []
        seen: set[int] = set()
        prev, block = head, head.next_free_block
        while block is not tail:
            require(block is not None, "links consistent", lambda: f"the list breaks after block {prev.block_id}")
            require(block.prev_free_block is prev, "links consistent",
                    lambda: f"block {block.block_id}.prev is not block {prev.block_id}")
            require(id(block) not in seen, "links consistent", lambda: f"block {block.block_id} appears twice (a cycle)")
            require(block._free_queue is self, "queued blocks know their queue",
                    lambda: f"block {block.block_id} is not tagged with this queue")
            seen.add(id(block))
            queued.append(block)
            prev, block = block, block.next_free_block
        require(tail.prev_free_block is prev, "links consistent",
                "the tail sentinel does not point back at the last block")
        require(len(queued) == self.num_free_blocks, "num_free_blocks counts the queue",
                f"{len(queued)} queued, counter says {self.num_free_blocks}")
        return queued
