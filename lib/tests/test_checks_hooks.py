"""The public extension points the checkers drive the library through (issue 16).

``KVCacheManager.redirect_partial_hit`` is the copy-on-write step of a
partial prefix hit, which exercise 6's checker overrides in a subclass with
the learner's function instead of assigning a private method. ``block_pool_class`` (a
``BlockPool`` subclass with the learner's ``free_blocks`` or ``touch``) and
``release_blocks`` (the learner's ``free_request``) carry exercise 3's;
``BlockPool.evict_blocks`` punches the hole in the cache that exercise 6's
lookup cases need.
"""

from __future__ import annotations


import pytest

from pagedkv.block_pool import BlockPool
from pagedkv.checks.manager_trial import manager_trial
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.request import Request


def test_redirect_partial_hit_is_called_for_every_partial_hit_and_changes_nothing_else():
    calls = []

    class Observed(KVCacheManager):
        def redirect_partial_hit(self, req_blocks, block_idx, cow_block):
            calls.append((self, block_idx, cow_block.block_id))
            super().redirect_partial_hit(req_blocks, block_idx, cow_block)  # the default, observed

    for seed in range(6):
        manager_trial(Observed, seed, aligned=False)  # raises on any difference from the plain manager
    assert calls, "the trials must reach partial hits"
    assert all(isinstance(m, Observed) for m, _, _ in calls)


def test_a_wrong_redirect_is_seen_by_the_trial():
    class NoCopy(KVCacheManager):
        def redirect_partial_hit(self, req_blocks, block_idx, cow_block):
            req_blocks[block_idx] = cow_block  # redirects, but records no copy and takes no reference

    with pytest.raises(AssertionError):
        for seed in range(6):
            manager_trial(NoCopy, seed, aligned=False)


def test_the_manager_takes_no_copy_hook_argument():
    # one extension mechanism: the hook is a method, overridden by subclassing
    with pytest.raises(TypeError, match="redirect_partial_hit"):
        KVCacheManager(8, 4, redirect_partial_hit=lambda *a: None)


# ------------------------------------------------ block_pool_class, release_blocks
def _pool_state(pool):
    return ([b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            {h: sorted(d) for h, d in pool.cached_block_hash_to_block.items()})


def _recording_manager(calls):
    """A manager class whose pool and ``release_blocks`` record their calls, then do the library's work."""
    class Pool(BlockPool):
        def free_blocks(self, ordered_blocks):
            ordered_blocks = list(ordered_blocks)
            calls.append(("free_blocks", [b.block_id for b in ordered_blocks]))
            super().free_blocks(ordered_blocks)

        def touch(self, blocks):
            calls.append(("touch", [b.block_id for b in blocks]))
            super().touch(blocks)

    class Manager(KVCacheManager):
        block_pool_class = Pool

        def release_blocks(self, req_blocks):
            calls.append(("release_blocks", [b.block_id for b in req_blocks]))
            super().release_blocks(req_blocks)

    return Manager


def test_the_manager_builds_its_pool_from_block_pool_class_and_calls_its_methods():
    calls = []
    m = _recording_manager(calls)(16, 4)
    assert type(m.block_pool).__mro__[1] is BlockPool
    a = Request("a", list(range(1, 11)), hash_block_size=4)
    m.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    table = m.get_block_ids("a")
    m.free(a)
    # free() hands the table over in table order; the library's release_blocks frees it tail first.
    # (allocate_slots touches its prefix hit, here none, first.)
    assert calls == [("touch", []), ("release_blocks", table), ("free_blocks", table[::-1])]
    b = Request("b", list(range(1, 11)) + [99], hash_block_size=4)
    hit, n = m.get_computed_blocks(b)
    m.allocate_slots(b, 11 - n, n, hit)
    assert calls[-1] == ("touch", table[:2])  # the two cached full blocks
    m.check()


def test_recording_overrides_change_nothing_in_the_trial():
    calls = []
    for seed in range(4):
        manager_trial(_recording_manager(calls), seed)
    kinds = {k for k, _ in calls}
    assert kinds == {"release_blocks", "free_blocks", "touch"}


def test_a_wrong_release_blocks_is_seen_by_the_trial():
    class HeadFirst(KVCacheManager):
        def release_blocks(self, req_blocks):
            self.block_pool.free_blocks(req_blocks)  # forgot reversed

    with pytest.raises(AssertionError, match="free queue"):
        for seed in range(6):
            manager_trial(HeadFirst, seed)


def test_block_pool_class_must_be_a_block_pool_subclass():
    class NotAPool(KVCacheManager):
        block_pool_class = dict

    with pytest.raises(TypeError, match="block_pool_class must be BlockPool or a subclass of it, got <class 'dict'>"):
        NotAPool(8, 4)


# ----------------------------------------------------------------- evict_blocks
def _freed_cached_pool():
    """A pool where blocks 1-3 were held, 1 and 2 cached, then all freed (2 is still held twice)."""
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [b"h1", b"h2", b"h3"], 0, 2)
    pool.touch([blocks[1]])
    pool.free_blocks(blocks[::-1])
    return pool, blocks


def test_evict_blocks_uncaches_a_free_block_where_it_stands():
    pool, blocks = _freed_cached_pool()
    pool.free_blocks([blocks[1]])  # block 2 now free too
    queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    events = []
    pool.subscribe(lambda p, e: events.append(e))
    pool.evict_blocks({1, 3, 5})  # 3 and 5 carry no hash: skipped
    assert pool.get_cached_block(b"h1") is None and blocks[0].block_hash is None
    assert pool.get_cached_block(b"h2") is blocks[1]
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == queue
    assert [(e.kind, e.block_ids) for e in events] == [("uncache", (1,))]
    pool.check()


@pytest.mark.parametrize("ids, error, message", [
    ([1, 2], ValueError, r"block 2 is cached but held \(ref_cnt 1\): only a free cached block can be evicted"),
    ([1, 8], ValueError, r"block_ids\[1\] = 8 is not a block of this pool \(num_gpu_blocks=8\)"),
    ([1, -1], ValueError, r"block_ids\[1\] must be >= 0, got -1"),
    ([1, True], TypeError, r"block_ids\[1\] must be an int, got bool True"),
    (3, TypeError, r"block_ids must be an iterable of block ids, got int 3"),
])
def test_evict_blocks_refuses_bad_ids_with_nothing_changed(ids, error, message):
    pool, _ = _freed_cached_pool()
    before = _pool_state(pool)
    with pytest.raises(error, match=message):
        pool.evict_blocks(ids)
    assert _pool_state(pool) == before
    pool.check()
