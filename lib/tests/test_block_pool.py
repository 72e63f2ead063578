"""BlockPool (block_pool), FreeKVCacheBlockQueue and KVCacheBlock (free_queue): scenarios, bad input, and a state machine.

The state machine drives the pool the way a KV-cache manager does (prefix
lookups, hits, allocation, caching of full blocks, freeing in reverse, cache
resets, refused requests) and compares it after every step with ``PoolModel``,
a plain-Python model that knows nothing about linked lists.
"""

from __future__ import annotations

import warnings

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from pagedkv.block_pool import BlockPool
from pagedkv.common import InvariantError
from pagedkv.free_queue import FreeKVCacheBlockQueue, KVCacheBlock
from pagedkv.pool_events import ListenerWarning, PoolEvent
from pagedkv.hashing import hash_request_tokens

H = [bytes([i]) * 32 for i in range(16)]  # distinct stand-in hashes for scenarios


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def snapshot(pool: BlockPool):
    """Everything observable about a pool, to prove that a refused call changed nothing."""
    return (
        free_ids(pool),
        pool.get_num_free_blocks(),
        [(b.ref_cnt, b.block_hash, getattr(b.prev_free_block, "block_id", None),
          getattr(b.next_free_block, "block_id", None)) for b in pool.blocks],
        {h: list(d) for h, d in pool.cached_block_hash_to_block.items()},
    )


# ---------------------------------------------------------------- scenarios


def test_fresh_pool_takes_block_0_as_the_null_block():
    pool = BlockPool(8)
    pool.check()
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert free_ids(pool) == [1, 2, 3, 4, 5, 6, 7]
    assert pool.get_num_free_blocks() == 7 and pool.get_usage() == 0.0


def test_allocation_pops_the_head_and_unhashed_frees_go_back_to_the_head():
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)
    assert ids(a) == [1, 2, 3] and [b.ref_cnt for b in a] == [1, 1, 1]
    assert free_ids(pool) == [4, 5, 6, 7]
    assert pool.get_usage() == pytest.approx(3 / 7)
    pool.free_blocks(reversed(a))  # a request frees its tail first
    pool.check()
    assert free_ids(pool) == [3, 2, 1, 4, 5, 6, 7]
    assert ids(pool.get_new_blocks(2)) == [3, 2]  # LIFO: the most recently freed first


def test_hashed_frees_go_to_the_tail_and_stay_matchable():
    pool = BlockPool(8)
    a = pool.get_new_blocks(4)  # 3 full blocks and a partial one
    pool.cache_full_blocks(a, H[:3], num_cached_blocks=0, num_full_blocks=3)
    pool.check()
    assert [b.block_hash for b in a] == [H[0], H[1], H[2], None]
    pool.free_blocks(reversed(a))
    pool.check()
    # 4 had no hash: head. 3, 2, 1 kept their hashes: tail, in the order freed.
    assert free_ids(pool) == [4, 5, 6, 7, 3, 2, 1]
    assert [pool.get_cached_block(h).block_id for h in H[:3]] == [1, 2, 3]


def test_a_preempted_request_hits_its_own_blocks_from_the_tail():
    pool = BlockPool(8)
    a = pool.get_new_blocks(4)
    pool.cache_full_blocks(a, H[:3], 0, 3)
    pool.free_blocks(reversed(a))  # preempted
    hits = [pool.get_cached_block(h) for h in H[:3]]
    pool.touch(hits)
    pool.check()
    assert ids(hits) == [1, 2, 3] and [b.ref_cnt for b in hits] == [1, 1, 1]
    assert free_ids(pool) == [4, 5, 6, 7]  # pulled out of the middle/tail of the queue
    tail = pool.get_new_blocks(1)
    assert ids(tail) == [4]


def test_pressure_recycles_cached_blocks_and_the_entry_dies_at_reuse():
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, H[:2], 0, 2)
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [3, 4, 5, 2, 1]
    pool.get_new_blocks(3)  # 3, 4, 5: the cached blocks survive
    assert pool.get_cached_block(H[1]) is pool.blocks[2]
    c = pool.get_new_blocks(1)  # reuses block 2: its entry dies now
    pool.check()
    assert ids(c) == [2] and c[0].block_hash is None
    assert pool.get_cached_block(H[1]) is None
    assert pool.get_cached_block(H[0]) is pool.blocks[1]  # not recycled yet


def test_shared_block_leaves_the_queue_once_and_returns_when_the_last_holder_frees():
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, H[:2], 0, 2)
    pool.touch([a[0]])  # a second request shares block 1
    assert a[0].ref_cnt == 2
    pool.free_blocks(reversed(a))
    pool.check()
    assert a[0].ref_cnt == 1 and free_ids(pool) == [3, 4, 5, 2]
    pool.free_blocks([a[0]])
    assert free_ids(pool) == [3, 4, 5, 2, 1]


def test_null_block_is_skipped_by_caching_and_excluded_from_usage():
    pool = BlockPool(4)
    a = pool.get_new_blocks(3)
    assert pool.get_usage() == 1.0
    table = [pool.null_block, *a]
    pool.cache_full_blocks(table, H[:4], 0, 4)
    pool.check()
    assert pool.null_block.block_hash is None and ids(a) == [1, 2, 3]
    assert [b.block_hash for b in a] == H[1:4]


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use_then_accepted():
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, H[:2], 0, 2)
    before = snapshot(pool)
    assert pool.reset_prefix_cache() is False
    assert snapshot(pool) == before
    pool.free_blocks(reversed(a))
    order = free_ids(pool)
    assert pool.reset_prefix_cache() is True
    pool.check()
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert free_ids(pool) == order  # the queue order is untouched


def test_cache_full_blocks_skips_blocks_already_holding_their_hash():
    pool = BlockPool(8)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, H[:2], 0, 2)
    b = [a[0], *pool.get_new_blocks(2)]  # a hit on block 1, then two new blocks
    pool.touch([a[0]])
    pool.cache_full_blocks(b, [H[0], H[5], H[6]], 0, 3)  # block 1 already holds H[0]
    pool.check()
    assert [x.block_hash for x in b] == [H[0], H[5], H[6]]


def test_duplicate_hashes_are_kept_and_the_first_cached_block_answers():
    pool = BlockPool(6)
    a = pool.get_new_blocks(1)
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [H[0]], 0, 1)
    pool.cache_full_blocks(b, [H[0]], 0, 1)  # computed twice before either was cached
    pool.check()
    assert list(pool.cached_block_hash_to_block[H[0]]) == [1, 2]
    assert pool.get_cached_block(H[0]) is a[0]
    pool.free_blocks(a)
    pool.free_blocks(b)
    assert free_ids(pool) == [3, 4, 5, 1, 2]
    pool.get_new_blocks(4)  # 3, 4, 5, then 1: its entry dies, block 2 still answers
    assert pool.get_cached_block(H[0]) is b[0]


def test_without_caching_every_free_goes_to_the_head():
    pool = BlockPool(6, enable_caching=False)
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(a, H[:3], 0, 3)  # no-op
    assert all(b.block_hash is None for b in a)
    pool.free_blocks(reversed(a))
    pool.check()
    assert free_ids(pool) == [3, 2, 1, 4, 5]


def test_a_pool_of_one_block_is_only_the_null_block():
    pool = BlockPool(1)
    pool.check()
    assert pool.get_num_free_blocks() == 0 and pool.get_usage() == 0.0
    assert pool.get_new_blocks(0) == []
    with pytest.raises(ValueError, match="num_blocks=1"):
        pool.get_new_blocks(1)


def test_queue_operations_keep_order_and_links():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert ids(q.popleft_n(2)) == [0, 1] and q.num_free_blocks == 4
    assert blocks[0].prev_free_block is None and blocks[0].next_free_block is None
    q.remove(blocks[4])  # middle
    q.remove(blocks[2])  # head
    q.remove(blocks[5])  # tail
    assert ids(q.get_all_free_blocks()) == [3]
    q.prepend_n([blocks[0], blocks[1]])
    q.append_n([blocks[5], blocks[4]])
    q.append(blocks[2])
    assert ids(q.get_all_free_blocks()) == [0, 1, 3, 5, 4, 2] and len(q) == 6
    assert q.popleft() is blocks[0]
    assert q.popleft_n(0) == [] and ids(q.get_all_free_blocks()) == [1, 3, 5, 4, 2]
    q.prepend_n([])
    q.append_n([])
    assert ids(q.popleft_n(5)) == [1, 3, 5, 4, 2] and q.num_free_blocks == 0
    assert q.fake_free_list_head.next_free_block is q.fake_free_list_tail
    assert q.fake_free_list_tail.prev_free_block is q.fake_free_list_head


def test_observer_reports_each_mutation_after_it_happened():
    pool = BlockPool(6)
    events: list[PoolEvent] = []
    seen_free_counts = []

    def listener(p, event):
        events.append(event)
        seen_free_counts.append(p.get_num_free_blocks())

    unsubscribe = pool.subscribe(listener)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, H[:1], 0, 1)
    pool.free_blocks(reversed(a))
    pool.touch([a[0]])
    pool.get_new_blocks(4)  # reaches block 1? no: 2, 3, 4, 5 -- block 1 is held
    pool.free_blocks([a[0]])
    pool.get_new_blocks(1)  # block 1 again, evicting H[0]
    assert events == [
        PoolEvent("allocate", (1, 2)),
        PoolEvent("cache", (1,)),
        PoolEvent("free", (2, 1), head=(2,), tail=(1,)),
        PoolEvent("touch", (1,)),
        PoolEvent("allocate", (2, 3, 4, 5)),
        PoolEvent("free", (1,), head=(), tail=(1,)),
        PoolEvent("evict", (1,)),
        PoolEvent("allocate", (1,)),
    ]
    assert seen_free_counts == [3, 3, 5, 4, 0, 1, 0, 0]
    unsubscribe()
    pool.free_blocks(pool.blocks[1:])
    assert pool.reset_prefix_cache() is True
    assert len(events) == 8  # nothing after unsubscribing


def test_cached_blocks_are_found_by_bytes_and_int_hashes_only():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(a, [3, 1, H[0]], 0, 3)  # int hashes are allowed, as are bytes
    assert pool.get_cached_block(3) is a[0] and pool.get_cached_block(1) is a[1] and pool.get_cached_block(H[0]) is a[2]
    for key in (3.0, True, 1.0 + 0j):  # equal to 3 or 1 in a dict, but not hashes
        with pytest.raises(TypeError, match="block_hash must be a bytes or int hash"):
            pool.get_cached_block(key)
    assert pool.get_cached_block(4) is None


def test_a_raising_listener_is_contained_and_reported():
    pool = BlockPool(6)
    calls = []

    def broken(p, event):
        p.check()  # the pool is consistent when a listener runs
        raise KeyError("view bug")

    pool.subscribe(broken)
    pool.subscribe(lambda p, event: calls.append(event.kind))  # a later listener still runs
    before_free = pool.get_num_free_blocks()
    with pytest.warns(ListenerWarning, match=r"raised KeyError: 'view bug' on a 'allocate' event") as record:
        blocks = pool.get_new_blocks(2)
    assert record[0].filename == __file__  # reported where the pool was called
    assert [b.ref_cnt for b in blocks] == [1, 1] and pool.get_num_free_blocks() == before_free - 2
    with pytest.warns(ListenerWarning, match="'free' event"):
        pool.free_blocks(reversed(blocks))
    assert calls == ["allocate", "free"]
    pool.check()


def test_deferred_events_are_delivered_in_order_when_the_block_ends():
    pool = BlockPool(6)
    events = []
    pool.subscribe(lambda p, event: events.append((event.kind, p.get_num_free_blocks())))
    with pool.deferred_events():
        a = pool.get_new_blocks(2)
        with pool.deferred_events():  # nested: the outer block delivers
            pool.cache_full_blocks(a, H[:1], 0, 1)
        assert events == []
        pool.free_blocks([a[1]])
    assert events == [("allocate", 4), ("cache", 4), ("free", 4)]  # each sees the state at delivery
    with pytest.raises(ZeroDivisionError):
        with pool.deferred_events():
            pool.free_blocks([a[0]])
            1 / 0
    assert events[-1] == ("free", 5)  # delivered even though the block raised
    pool.check()


# ---------------------------------------------------------------- bad input


def _pool_with_request():
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(a, H[:2], 0, 2)
    return pool, a


@pytest.mark.parametrize(
    "name, exc, words",
    [
        ("free a free block", ValueError, "block 4: its ref_cnt is already 0"),
        ("free a batch whose last block is free", ValueError, "block 4"),
        ("free a block twice in one batch", ValueError, "block 3: its ref_cnt is already 0"),
        ("free the null block", ValueError, "null block"),
        ("free a block of another pool", ValueError, "does not belong"),
        ("free an int", TypeError, "int 3"),
        ("get more blocks than are free", ValueError, "num_blocks=6"),
        ("get a negative number of blocks", ValueError, "-1"),
        ("get a float number of blocks", TypeError, "2.0"),
        ("get True blocks", TypeError, "True"),
        ("touch the null block", ValueError, "null block"),
        ("touch a block of another pool", ValueError, "does not belong"),
        ("cache with num_cached > num_full", ValueError, "num_cached_blocks=2"),
        ("cache beyond the block list", ValueError, "num_full_blocks=4"),
        ("cache a different hash on a hashed block", ValueError, "different hash"),
        ("cache a free block", ValueError, "ref_cnt 0"),
        ("cache a float hash", TypeError, "1.5"),
        ("cache the same block twice", ValueError, "appears twice"),
        ("look up a float hash", TypeError, "block_hash must be a bytes or int hash, got float 3.0"),
        ("look up True", TypeError, "block_hash must be a bytes or int hash, got bool True"),
        ("look up a list", TypeError, "got list"),
        ("remove a block of the pool's queue from another queue", ValueError,
         "block 4 is linked into another free queue"),
    ],
)
def test_bad_input_raises_a_named_error_and_changes_nothing(name, exc, words):
    pool, a = _pool_with_request()
    other = BlockPool(8).get_new_blocks(2)[1]
    free_block = pool.blocks[4]
    calls = {
        "free a free block": lambda: pool.free_blocks([free_block]),
        "free a batch whose last block is free": lambda: pool.free_blocks([*reversed(a), free_block]),
        "free a block twice in one batch": lambda: pool.free_blocks([a[2], a[1], a[2]]),
        "free the null block": lambda: pool.free_blocks([pool.null_block]),
        "free a block of another pool": lambda: pool.free_blocks([a[0], other]),
        "free an int": lambda: pool.free_blocks([a[0], 3]),
        "get more blocks than are free": lambda: pool.get_new_blocks(6),
        "get a negative number of blocks": lambda: pool.get_new_blocks(-1),
        "get a float number of blocks": lambda: pool.get_new_blocks(2.0),
        "get True blocks": lambda: pool.get_new_blocks(True),
        "touch the null block": lambda: pool.touch([free_block, pool.null_block]),
        "touch a block of another pool": lambda: pool.touch([free_block, other]),
        "cache with num_cached > num_full": lambda: pool.cache_full_blocks(a, H[:3], 2, 1),
        "cache beyond the block list": lambda: pool.cache_full_blocks(a, H[:4], 0, 4),
        "cache a different hash on a hashed block": lambda: pool.cache_full_blocks(a, [H[9], H[1], H[2]], 0, 3),
        "cache a free block": lambda: pool.cache_full_blocks([a[2], free_block], [H[2], H[3]], 0, 2),
        "cache a float hash": lambda: pool.cache_full_blocks(a, [H[0], H[1], 1.5], 0, 3),
        "cache the same block twice": lambda: pool.cache_full_blocks([a[2], a[2]], [H[2], H[3]], 0, 2),
        "look up a float hash": lambda: pool.get_cached_block(3.0),
        "look up True": lambda: pool.get_cached_block(True),
        "look up a list": lambda: pool.get_cached_block([1]),
        "remove a block of the pool's queue from another queue":
            lambda: FreeKVCacheBlockQueue([KVCacheBlock(9)]).remove(free_block),
    }
    before = snapshot(pool)
    with pytest.raises(exc) as info:
        calls[name]()
    assert words in str(info.value)
    assert snapshot(pool) == before
    pool.check()


def test_queue_bad_input_raises_and_changes_nothing():
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = FreeKVCacheBlockQueue(blocks)
    popped = q.popleft_n(2)

    def state():
        return ids(q.get_all_free_blocks()), q.num_free_blocks, [(b.prev_free_block, b.next_free_block) for b in blocks]

    before = state()
    with pytest.raises(ValueError, match="block 0 is not in the free queue"):
        q.remove(popped[0])
    with pytest.raises(ValueError, match="n=3"):
        q.popleft_n(3)
    with pytest.raises(ValueError, match="block 2 is already in the free queue"):
        q.append(blocks[2])
    with pytest.raises(ValueError, match="block 3 is already in the free queue"):
        q.prepend_n([popped[0], blocks[3]])
    with pytest.raises(ValueError, match="block 1 appears twice"):
        q.append_n([popped[1], popped[1]])
    with pytest.raises(TypeError, match="int 7"):
        q.prepend_n([popped[0], 7])
    other_blocks = [KVCacheBlock(10 + i) for i in range(3)]
    other = FreeKVCacheBlockQueue(other_blocks)
    other_before = ids(other.get_all_free_blocks()), other.num_free_blocks
    with pytest.raises(ValueError, match="block 11 is linked into another free queue, not this one"):
        q.remove(other_blocks[1])  # linked, but into `other`: unlinking it here would corrupt both
    with pytest.raises(ValueError, match="block 2 is linked into another free queue"):
        other.remove(blocks[2])
    with pytest.raises(TypeError, match="expected a KVCacheBlock, got int 3"):
        q.remove(3)
    assert (ids(other.get_all_free_blocks()), other.num_free_blocks) == other_before
    assert state() == before
    q.popleft_n(2)
    with pytest.raises(ValueError, match="No free blocks available"):
        q.popleft()


def test_a_refused_batch_unlinks_what_it_had_linked():
    """prepend_n/append_n check each block as they link it; a late refusal undoes the earlier links."""
    blocks = [KVCacheBlock(i) for i in range(8)]
    q = FreeKVCacheBlockQueue(blocks)
    taken = q.popleft_n(5)  # 0..4 out; 5, 6, 7 queued

    def state():
        return ids(q.check()), q.num_free_blocks, [(b.prev_free_block, b.next_free_block) for b in blocks]

    before = state()
    with pytest.raises(ValueError, match="block 6 is already in the free queue"):
        q.prepend_n([taken[0], taken[1], taken[2], blocks[6]])
    with pytest.raises(ValueError, match="block 3 appears twice"):
        q.append_n([taken[4], taken[3], taken[2], taken[3]])
    with pytest.raises(TypeError, match="expected a KVCacheBlock, got str 'x'"):
        q.append_n([taken[0], taken[1], "x"])
    assert state() == before
    q.prepend_n(taken[:2])
    q.append_n(taken[2:])
    assert ids(q.check()) == [0, 1, 5, 6, 7, 2, 3, 4]


def test_queue_check_names_a_broken_link():
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.check() == blocks
    blocks[2].prev_free_block = blocks[0]
    with pytest.raises(InvariantError, match="invariant 'links consistent' broken: block 2.prev is not block 1"):
        q.check()
    blocks[2].prev_free_block = blocks[1]
    q.num_free_blocks = 3
    with pytest.raises(InvariantError, match="invariant 'num_free_blocks counts the queue' broken"):
        q.check()


def test_a_block_hash_is_set_once():
    block = KVCacheBlock(5)
    block.block_hash = H[0]
    with pytest.raises(ValueError, match="block 5 already has a hash"):
        block.block_hash = H[1]
    assert block.block_hash == H[0]
    block.reset_hash()
    block.block_hash = H[1]
    assert block.block_hash == H[1]


def test_repr_names_neighbours_by_id_without_recursing():
    pool = BlockPool(4)
    assert repr(pool.blocks[2]) == (
        "KVCacheBlock(block_id=2, ref_cnt=0, block_hash=None, prev_free_block=1, next_free_block=3)"
    )


def test_constructor_rejects_bad_sizes():
    with pytest.raises(ValueError, match="got 0"):
        BlockPool(0)
    with pytest.raises(TypeError, match="'8'"):
        BlockPool("8")


# ---------------------------------------------------------------- check() catches corruption


def _corruptions():
    def broken_back_link(pool):
        pool.blocks[3].prev_free_block = pool.blocks[5]

    def freed_but_referenced(pool):
        pool.blocks[4].ref_cnt = 1

    def held_with_zero_refs(pool):
        pool.blocks[1].ref_cnt = 0

    def counter_off(pool):
        pool.free_block_queue.num_free_blocks += 1

    def stale_cache_entry(pool):
        pool.blocks[1].reset_hash()

    def unfiled_hash(pool):
        pool.blocks[2]._block_hash = H[7]

    def null_in_queue(pool):
        pool.free_block_queue.append(pool.null_block)

    def cycle(pool):
        pool.blocks[6].next_free_block = pool.blocks[4]

    def held_but_linked(pool):
        pool.blocks[1].next_free_block = pool.blocks[4]

    return [
        (broken_back_link, "links consistent"),
        (freed_but_referenced, "free <=> ref_cnt == 0"),
        (held_with_zero_refs, "free <=> ref_cnt == 0"),
        (counter_off, "num_free_blocks counts the queue"),
        (stale_cache_entry, "cache map agrees with hashes"),
        (unfiled_hash, "cache map agrees with hashes"),
        (null_in_queue, "null block is never free"),
        (cycle, "links consistent"),
        (held_but_linked, "links consistent"),
    ]


@pytest.mark.parametrize("corrupt, invariant_name", _corruptions(), ids=lambda x: getattr(x, "__name__", x))
def test_check_names_the_broken_invariant(corrupt, invariant_name):
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(a, H[:2], 0, 2)
    pool.check()
    corrupt(pool)
    with pytest.raises(InvariantError, match=f"invariant '{invariant_name}'") as info:
        pool.check()
    assert isinstance(info.value, AssertionError)


# ---------------------------------------------------------------- state machine


class PoolModel:
    """What the pool should hold, in plain lists and dicts (no links, no blocks)."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool):
        self.caching = enable_caching
        self.free = list(range(1, num_gpu_blocks))  # head first
        self.ref = [0] * num_gpu_blocks
        self.hash: list[bytes | None] = [None] * num_gpu_blocks
        self.cache: dict[bytes, list[int]] = {}  # hash -> block ids, first cached first

    def lookup(self, h: bytes) -> int | None:
        return self.cache[h][0] if h in self.cache else None

    def allocate(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        for b in taken:
            if self.hash[b] is not None:
                self.cache[self.hash[b]].remove(b)
                if not self.cache[self.hash[b]]:
                    del self.cache[self.hash[b]]
                self.hash[b] = None
            self.ref[b] = 1
        return taken

    def release(self, ordered: list[int]) -> None:
        head, tail = [], []
        for b in ordered:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (tail if self.hash[b] is not None else head).append(b)
        self.free = head + self.free + tail

    def touch(self, hit: list[int]) -> None:
        for b in hit:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1

    def cache_blocks(self, table: list[int], hashes: list[bytes], lo: int, hi: int) -> None:
        if not self.caching:
            return
        for i in range(lo, hi):
            b = table[i]
            if self.hash[b] is None:
                self.hash[b] = hashes[i]
                self.cache.setdefault(hashes[i], []).append(b)

    def reset(self) -> bool:
        if any(self.ref[1:]):
            return False
        self.hash = [None] * len(self.hash)
        self.cache = {}
        return True


BLOCK_SIZE = 2
# Prompts share prefixes often (a few system prompts, then a short tail from a
# tiny alphabet), so prefix hits, evictions and duplicates all happen.
PROMPTS = [[0, 1, 0, 1, 0, 1, 0, 1], [0, 1, 2, 2, 1, 0, 2, 2], [2, 2, 2, 2, 2, 2, 2, 2]]
tokens_st = st.builds(
    lambda prompt, keep, tail: prompt[:keep] + tail,
    st.sampled_from(PROMPTS),
    st.integers(0, 8),
    st.lists(st.integers(0, 2), max_size=3),
)


class Request:
    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.blocks: list[KVCacheBlock] = []
        self.num_cached = 0


class BlockPoolMachine(RuleBasedStateMachine):
    operations = 0  # rule executions, counted across all examples
    checks = 0  # invariant runs (after every rule)

    @initialize(num_gpu_blocks=st.integers(1, 16), enable_caching=st.sampled_from([True, True, True, False]))
    def make_pool(self, num_gpu_blocks, enable_caching):
        self.pool = BlockPool(num_gpu_blocks, enable_caching)
        self.model = PoolModel(num_gpu_blocks, enable_caching)
        self.requests: list[Request] = []

    def _refused(self, call, exc=ValueError) -> None:
        before = snapshot(self.pool)
        with pytest.raises(exc):
            call()
        assert snapshot(self.pool) == before

    def _lookup(self, hashes: list[bytes]) -> list[KVCacheBlock]:
        """The longest run of cached blocks at the start of ``hashes`` (pool and model agree)."""
        hits: list[KVCacheBlock] = []
        for h in hashes:
            block = self.pool.get_cached_block(h)
            assert (block.block_id if block else None) == self.model.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def _admit(self, tokens_list: list[list[int]]) -> None:
        """Admit requests scheduled in the same step, as a manager would.

        All look up their prefix before any of them caches its blocks, so two
        requests with the same prompt both miss and compute the same blocks:
        the pool then holds two blocks under one hash.
        """
        plans = []
        for tokens in tokens_list:
            hashes = hash_request_tokens(BLOCK_SIZE, tokens)
            plans.append((tokens, hashes, self._lookup(hashes)))
        num_new = [-(-len(t) // BLOCK_SIZE) - len(hits) for t, _, hits in plans]
        if sum(num_new) > self.pool.get_num_free_blocks():
            self._refused(lambda: self.pool.get_new_blocks(sum(num_new)))
            return
        distinct_hits = {id(b): b for _, _, hits in plans for b in hits}.values()
        if sum(num_new) > self.pool.get_num_free_blocks() - sum(b.ref_cnt == 0 for b in distinct_hits):
            return  # the hits themselves would take the room: the manager would wait
        requests = []
        for (tokens, hashes, hits), n in zip(plans, num_new):
            request = Request(list(tokens))
            self.pool.touch(hits)
            self.model.touch([b.block_id for b in hits])
            new = self.pool.get_new_blocks(n)
            assert [b.block_id for b in new] == self.model.allocate(n)
            request.blocks = hits + new
            requests.append(request)
        for request, (tokens, hashes, hits) in zip(requests, plans):
            self.pool.cache_full_blocks(request.blocks, hashes, len(hits), len(hashes))
            self.model.cache_blocks([b.block_id for b in request.blocks], hashes, len(hits), len(hashes))
            request.num_cached = len(hashes)
        self.requests += requests

    @rule(tokens=tokens_st)
    def admit(self, tokens):
        """One new request: prefix hits first, then new blocks, then its full blocks cached."""
        BlockPoolMachine.operations += 1
        self._admit([tokens])

    @rule(tokens=tokens_st)
    def admit_twice_in_one_step(self, tokens):
        """Two identical prompts in one step: both miss, both cache, duplicates coexist."""
        BlockPoolMachine.operations += 1
        self._admit([tokens, tokens])

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def extend(self, data, more):
        """A request decodes a few tokens: new blocks as needed, newly full blocks cached."""
        BlockPoolMachine.operations += 1
        request = data.draw(st.sampled_from(self.requests))
        tokens = request.tokens + more
        num_new = -(-len(tokens) // BLOCK_SIZE) - len(request.blocks)
        if num_new > self.pool.get_num_free_blocks():
            self._refused(lambda: self.pool.get_new_blocks(num_new))
            return
        request.tokens = tokens
        new = self.pool.get_new_blocks(num_new)
        assert [b.block_id for b in new] == self.model.allocate(num_new)
        request.blocks += new
        hashes = hash_request_tokens(BLOCK_SIZE, tokens)
        self.pool.cache_full_blocks(request.blocks, hashes, request.num_cached, len(hashes))
        self.model.cache_blocks([b.block_id for b in request.blocks], hashes, request.num_cached, len(hashes))
        request.num_cached = len(hashes)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish(self, data):
        """A request finishes (or is preempted): free its blocks tail first."""
        BlockPoolMachine.operations += 1
        request = data.draw(st.sampled_from(self.requests))
        self.requests.remove(request)
        self.pool.free_blocks(reversed(request.blocks))
        self.model.release([b.block_id for b in reversed(request.blocks)])

    @rule(now=st.integers(0, 7))
    def reset_prefix_cache(self, now):
        if now:  # rarely: a reset wipes the cache that the other rules exercise
            return
        BlockPoolMachine.operations += 1
        assert self.pool.reset_prefix_cache() == self.model.reset()

    @precondition(lambda self: self.pool.get_num_free_blocks() > 0)
    @rule(data=st.data())
    def free_a_free_block(self, data):
        BlockPoolMachine.operations += 1
        block = data.draw(st.sampled_from(self.pool.free_block_queue.get_all_free_blocks()))
        self._refused(lambda: self.pool.free_blocks([block]))

    @precondition(lambda self: any(r.blocks for r in self.requests))
    @rule(data=st.data())
    def free_one_block_too_often(self, data):
        """List a block once more than it is held, at the end of a batch: all or nothing."""
        BlockPoolMachine.operations += 1
        request = data.draw(st.sampled_from([r for r in self.requests if r.blocks]))
        block = data.draw(st.sampled_from(request.blocks))
        self._refused(lambda: self.pool.free_blocks([*reversed(request.blocks), *[block] * block.ref_cnt]))

    @rule()
    def free_the_null_block(self):
        BlockPoolMachine.operations += 1
        self._refused(lambda: self.pool.free_blocks([self.pool.null_block]))

    @rule(data=st.data())
    def other_invalid_calls(self, data):
        """Lookups by non-hash keys, and removing a block from a queue it is not in."""
        BlockPoolMachine.operations += 1
        pool = self.pool
        stranger = FreeKVCacheBlockQueue([KVCacheBlock(99)])
        calls = [
            (lambda: pool.get_cached_block(data.draw(st.sampled_from([0.0, 1.0, True, False, None, "h"]))),
             TypeError),
            (lambda: stranger.remove(data.draw(st.sampled_from(pool.blocks))), ValueError),
            (lambda: pool.touch([pool.null_block]), ValueError),
        ]
        queued = pool.free_block_queue.get_all_free_blocks()
        if queued:
            calls.append((lambda: stranger.remove(data.draw(st.sampled_from(queued))), ValueError))
        call, exc = data.draw(st.sampled_from(calls))
        self._refused(call, exc)

    @rule(on=st.booleans())
    def flaky_listener(self, on):
        """A listener that raises on every event must not change what the pool does."""
        if not on:
            self.pool._listeners.clear()
        elif not self.pool._listeners:
            def broken(p, event):
                p.check()
                raise RuntimeError("broken view")

            self.pool.subscribe(broken)

    @invariant()
    def matches_the_model(self):
        BlockPoolMachine.checks += 1
        pool, model = self.pool, self.model
        pool.check()
        assert free_ids(pool) == model.free
        assert pool.get_num_free_blocks() == len(model.free)
        assert [b.ref_cnt for b in pool.blocks[1:]] == model.ref[1:]
        assert [b.block_hash for b in pool.blocks] == model.hash
        assert {h: list(d) for h, d in pool.cached_block_hash_to_block.items()} == model.cache
        usable = pool.num_gpu_blocks - 1
        assert pool.get_usage() == pytest.approx(0.0 if usable == 0 else 1 - len(model.free) / usable)


def test_block_pool_matches_an_independent_model_over_5000_operations():
    BlockPoolMachine.operations = BlockPoolMachine.checks = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ListenerWarning)  # the flaky listener's, tested above
        _run_block_pool_machine()
    assert BlockPoolMachine.operations >= 5000, f"only {BlockPoolMachine.operations} operations"
    assert BlockPoolMachine.checks >= BlockPoolMachine.operations  # check() after each one


def _run_block_pool_machine():
    run_state_machine_as_test(
        BlockPoolMachine,
        settings=settings(
            max_examples=180,
            stateful_step_count=60,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


# ---------------------------------------------------------------- the benchmark's contrast pool


def test_benchmark_trace_and_deque_pool_agree_with_block_pool():
    from pagedkv.bench.block_pool import DequeBlockPool, make_alloc_free_trace, replay_trace

    trace = make_alloc_free_trace(num_gpu_blocks=200, num_ops=3_000, seed=1)
    assert all(1 <= op <= 8 for op in trace if op > 0)
    ours, naive = BlockPool(200), DequeBlockPool(200)
    moved = replay_trace(ours, trace)
    assert moved == replay_trace(naive, trace) and moved > 3_000
    ours.check()
    assert free_ids(ours) == list(naive.free_block_ids)
    # A prefix hit from the middle: both pools take the same block out.
    a, b = ours.get_new_blocks(3), naive.get_new_blocks(3)
    ours.cache_full_blocks(a, H[:3], 0, 3)
    for block, h in zip(b, H[:3]):
        block.block_hash = h
    ours.free_blocks(reversed(a))
    naive.free_blocks(reversed(b))
    ours.touch([a[1]])
    naive.touch([b[1]])
    assert free_ids(ours) == list(naive.free_block_ids)
