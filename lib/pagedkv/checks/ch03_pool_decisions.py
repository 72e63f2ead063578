"""Checks for the freeing decisions of exercises/03_block_pool.ipynb.

The learner writes two of ``BlockPool``'s decisions, as functions of the pool:

* ``free_blocks(pool, ordered_blocks)``: release one reference to each block;
  of those reaching zero, unhashed ones go to the *head* of the free queue in
  the given order, hashed ones to the *tail* in the given order; the null
  block is never touched (skipped, as vLLM does, or refused with
  ``ValueError``, as the library does: its ``ref_cnt`` stays 0 either way);
* ``free_request(pool, req_blocks)``: what ``KVCacheManager.free`` asks of
  the pool for a finished request: its blocks in table order, freed tail
  first (``reversed``);
* ``touch(pool, blocks)``: a prefix hit; a block nobody holds leaves the free
  queue, and every block's ``ref_cnt`` rises by one.

What an allocation takes and what a lookup finds (``get_new_blocks``,
``find_longest_cache_hit``) are checked in ``ch03_allocation``; the pools
both modules build are in ``ch03_pool_fixtures``.

Each checker builds one real ``KVCacheManager`` that runs the learner's
function through the library's extension points (a ``BlockPool`` subclass as
the manager's ``block_pool_class``; ``release_blocks`` for ``free_request``)
and runs seeded random operation sequences -- admissions with prefix hits,
prefill chunks, decode steps, preemptions, finished requests, copy-on-write
-- beside an untouched manager, comparing after every operation the block
tables, every ``ref_cnt``, the free queue in order and the cached hashes,
with ``check()`` on both. A difference is diagnosed by running the learner's
function on small fixed cases whose answer tells the common mistakes apart.
"""

from __future__ import annotations

from ..block_pool import BlockPool
from ..free_queue import KVCacheBlock
from ..kv_cache_manager import KVCacheManager
from ._harness import Checker, CheckReport, Mistake, WrongAnswer, catalogue
from .ch03_pool_fixtures import hashed_pool, queue_ids, snapshot_pool
from .manager_trial import manager_trial

__all__ = ["check_free_blocks", "check_touch"]


# --------------------------------------------------------------- free_blocks
def _free_model(before: list[int], batch: list[KVCacheBlock], *,
                unhashed_tail=False, hashed_head=False, reverse_head=False,
                reverse_tail=False, ignore_refs=False, all_tail=False,
                swapped=False) -> list[int]:
    """The free queue after freeing ``batch``, with one decision swapped."""
    head, tail = [], []
    for b in batch:
        if b.ref_cnt - 1 > 0 and not ignore_refs:
            continue
        if all_tail:  # vLLM before 0.24: every freed block to the tail, in order
            tail.append(b.block_id)
            continue
        hashed = b.block_hash is not None
        (tail if hashed != swapped else head).append(b.block_id)
    if reverse_head:
        head = head[::-1]
    if reverse_tail:
        tail = tail[::-1]
    if unhashed_tail:
        return before + head + tail
    if hashed_head:
        return tail + head + before
    return head + before + tail


FREE_MISTAKES = [
    Mistake("unhashed blocks appended", "a block without a hash can never "
            "match the prefix cache, so nothing is gained by keeping it: it "
            "belongs at the head, reused first, and at the tail it pushes "
            "cached blocks out sooner"),
    Mistake("hashed blocks prepended", "a block with a hash stays matchable "
            "while it waits: it belongs at the tail, evicted last, not at "
            "the head where the next allocation takes it"),
    Mistake("reversed batch", "the blocks reaching the head are in reverse "
            "order: linking them in one at a time at the head turns the "
            "batch around, and the first one listed must be reused first"),
    Mistake("hashed batch reversed", "the hashed blocks reach the tail in "
            "reverse order: the first one listed must be evicted first"),
    Mistake("ref_cnt not decremented, or queued while held", "a block is "
            "free only when its last reference goes: one reference comes "
            "off each block, and a block still held stays out of the queue"),
    Mistake("the null block queued", "block 0 is never allocated, so it is "
            "never freed either: it must never enter the free queue"),
    Mistake("forgot reversed", "free_request frees the table head first: a "
            "request's tail, the least shareable part of its prefix, must "
            "be evicted first, so its blocks go in tail first"),
    Mistake("the null block's ref_cnt changed", "block 0 is never "
            "allocated, so no reference to it is ever taken: freeing it "
            "must change nothing (yours took its ref_cnt from 0 below 0, "
            "where the pool's check() and a later free would trip on it)"),
    Mistake("every block to the tail (vLLM's rule before 0.24)", "an "
            "unhashed block can never match the prefix cache: appended "
            "behind the cached blocks it pushes them out sooner. 0.33.0 "
            "sends blocks without a hash to the head, reused first, and only "
            "hashed ones to the tail"),
    Mistake("head and tail swapped", "the hashed blocks went to the head "
            "and the unhashed ones to the tail: a block that a later prompt "
            "can still match is the one worth keeping longest, so it waits "
            "at the tail, and a block without a hash is reused first"),
]


def _diagnose_free(free_blocks, free_request) -> str | None:
    """Run the learner's functions on fixed pools; name the first mistake seen."""
    try:
        pool, blocks = hashed_pool()
        before = queue_ids(pool)
        free_blocks(pool, list(blocks))
        got = queue_ids(pool)
        models = [
            (0, dict(unhashed_tail=True)), (1, dict(hashed_head=True)),
            (2, dict(reverse_head=True)), (3, dict(reverse_tail=True)),
            (4, dict(ignore_refs=True)), (8, dict(all_tail=True)),
            (9, dict(swapped=True)),
        ]
        pool2, blocks2 = hashed_pool()
        for i, kw in models:
            if got == _free_model(before, blocks2, **kw):
                return FREE_MISTAKES[i].diagnosis()
        if got != _free_model(before, blocks2):
            return None
        pool, blocks = hashed_pool(hashed=(), twice=())
        before = queue_ids(pool)
        free_request(pool, list(blocks))
        if queue_ids(pool) == [b.block_id for b in blocks] + before:
            return FREE_MISTAKES[6].diagnosis()
    except Exception:  # noqa: BLE001 -- the trial's message says what happened
        return None
    return None


def _free_manager(learner_free_blocks, learner_free_request=None):
    """A ``KVCacheManager`` class whose pool frees with the learner's ``free_blocks``.

    Built through the library's extension points: the pool is a ``BlockPool``
    subclass (``block_pool_class``); with ``learner_free_request``, the step of
    ``free`` that returns a table to the pool (``release_blocks``) is the
    learner's too. Without it, the library's ``release_blocks`` calls the
    pool's (the learner's) ``free_blocks`` on the reversed table.
    """
    class LearnerPool(BlockPool):
        def free_blocks(self, ordered_blocks):
            learner_free_blocks(self, ordered_blocks)

    class LearnerManager(KVCacheManager):
        block_pool_class = LearnerPool

        if learner_free_request is not None:
            def release_blocks(self, req_blocks):
                learner_free_request(self.block_pool, req_blocks)

    return LearnerManager


def check_free_blocks(free_blocks, free_request, seeds: int = 12,
                      timeout: float = 30.0) -> CheckReport:
    """Check ``free_blocks(pool, ordered_blocks)`` and ``free_request(pool, req_blocks)``."""
    with Checker("free_blocks", timeout=timeout) as c:
        def probe():
            pool, blocks = hashed_pool()
            free_blocks(pool, blocks)

        c.probe(probe)

        def delegation():
            pool, blocks = hashed_pool()
            free_blocks(pool, blocks[:3])
            free_request(pool, blocks[3:])

        c.written_here("free_blocks", delegation, {
            "BlockPool.free_blocks": BlockPool.free_blocks,
            "KVCacheManager.release_blocks": KVCacheManager.release_blocks,
            "KVCacheManager.free": KVCacheManager.free})

        def order():
            pool, blocks = hashed_pool()
            before = queue_ids(pool)
            free_blocks(pool, list(blocks))
            got = queue_ids(pool)
            ref, ref_blocks = hashed_pool()
            ref.free_blocks(list(ref_blocks))
            want = queue_ids(ref)
            if got != want:
                raise WrongAnswer(
                    f"freeing blocks {[b.block_id for b in blocks]} (2 and 4 "
                    f"hashed, 3 held twice) into a queue {before}: the queue "
                    f"is {got}, expected {want}",
                    _diagnose_free(free_blocks, free_request))
            refs = [b.ref_cnt for b in blocks]
            if refs != [b.ref_cnt for b in ref_blocks]:
                raise WrongAnswer(f"ref_cnt afterwards {refs}, expected "
                                  f"{[b.ref_cnt for b in ref_blocks]}",
                                  FREE_MISTAKES[4].diagnosis())

        c.prop("at 0, unhashed blocks go to the head, hashed ones to the tail, "
               "in order", order,
               "which blocks can a later prompt still match, and which "
               "end of the queue is reused first?")

        def null_block():
            pool, blocks = hashed_pool()
            before = snapshot_pool(pool)
            try:
                free_blocks(pool, [pool.null_block])
            except ValueError:
                pass
            if pool.null_block.ref_cnt != 0:
                raise WrongAnswer(f"freeing the null block took its ref_cnt "
                                  f"to {pool.null_block.ref_cnt}",
                                  FREE_MISTAKES[7].diagnosis())
            if snapshot_pool(pool) != before or (
                    pool.null_block.prev_free_block is not None):
                raise WrongAnswer("freeing the null block changed the pool",
                                  FREE_MISTAKES[5].diagnosis())

        c.prop("the null block is never queued, its ref_cnt stays 0",
               null_block, "block 0 is not a block any request holds: what "
               "should freeing it do?")

        def tail_first():
            pool, blocks = hashed_pool(hashed=(), twice=())
            before = queue_ids(pool)
            free_request(pool, list(blocks))
            want = [b.block_id for b in reversed(blocks)] + before
            if queue_ids(pool) != want:
                raise WrongAnswer(
                    f"free_request of table {[b.block_id for b in blocks]}: "
                    f"the queue is {queue_ids(pool)}, expected {want}",
                    _diagnose_free(free_blocks, free_request))

        c.prop("free_request frees a request's blocks tail first", tail_first,
               "free_blocks takes blocks in eviction order: which of a "
               "request's blocks should go first?")

        def trials():
            # Even seeds: the learner's free_blocks under the library's free;
            # odd seeds: the learner's free_request as well.
            for seed in range(seeds):
                manager = _free_manager(free_blocks,
                                        free_request if seed % 2 else None)
                manager_trial(manager, seed, diagnose=lambda: _diagnose_free(
                    free_blocks, free_request))

        c.prop(f"{seeds} random scheduler runs in KVCacheManager match the "
               "library at every step", trials,
               "the message names the operation and the first difference",
               lambda: _diagnose_free(free_blocks, free_request))
    return c.report


catalogue(check_free_blocks, FREE_MISTAKES)


# --------------------------------------------------------------------- touch
TOUCH_MISTAKES = [
    Mistake("forgot the touch", "a block nobody held is still in the free "
            "queue, an eviction candidate: while a request reads it, the "
            "next allocation may hand it to another request and overwrite "
            "it (a held block is never in the queue)"),
    Mistake("only free blocks counted", "every hit block gains a reference, "
            "also one other requests already hold: ref_cnt counts holders, "
            "and the new request is one more"),
    Mistake("removed a block that is not queued", "a block that someone "
            "holds is not in the free queue at all: only a block nobody "
            "holds can leave it"),
    Mistake("ref_cnt set, not raised", "ref_cnt counts the requests that "
            "hold a block: a shared block already has holders, and the hit "
            "adds one to them"),
]


def _touch_case():
    """A free cached block (ref 0, in the queue) and a block two requests hold."""
    pool, blocks = hashed_pool(held=4, hashed=(1,), twice=(2,))
    pool.free_blocks([blocks[1]])  # ref 0, hashed: queued at the tail
    return pool, blocks[1], blocks[2]


def _diagnose_touch(touch) -> str | None:
    pool, free, held = _touch_case()
    try:
        touch(pool, [free, held])
    except ValueError:
        return TOUCH_MISTAKES[2].diagnosis()
    except Exception:  # noqa: BLE001 -- the property's message says what
        return None
    if free.prev_free_block is not None or free.block_id in queue_ids(pool):
        return TOUCH_MISTAKES[0].diagnosis()
    if held.ref_cnt == 2:
        return TOUCH_MISTAKES[1].diagnosis()
    if held.ref_cnt == 1 or free.ref_cnt != 1:
        return TOUCH_MISTAKES[3].diagnosis()
    return None


def _touch_manager(learner_touch):
    """A ``KVCacheManager`` class whose pool (``block_pool_class``) touches with the learner's ``touch``."""
    class LearnerPool(BlockPool):
        def touch(self, blocks):
            learner_touch(self, blocks)

    class LearnerManager(KVCacheManager):
        block_pool_class = LearnerPool

    return LearnerManager


def check_touch(touch, seeds: int = 12, timeout: float = 30.0) -> CheckReport:
    """Check ``touch(pool, blocks)``, a prefix hit on the pool."""
    with Checker("touch", timeout=timeout) as c:
        c.probe(lambda: touch(_touch_case()[0], []))
        case = _touch_case()
        c.written_here("touch", lambda: touch(case[0], [case[1], case[2]]),
                       {"BlockPool.touch": BlockPool.touch})

        def fixed():
            pool, free, held = _touch_case()
            touch(pool, [free, held])
            problems = []
            if free.block_id in queue_ids(pool) or free.prev_free_block:
                problems.append(f"block {free.block_id} (free, cached) is "
                                "still in the free queue")
            if (free.ref_cnt, held.ref_cnt) != (1, 3):
                problems.append(f"ref_cnt of the free block {free.ref_cnt}, of "
                                f"the held one {held.ref_cnt}; expected 1 and 3")
            try:
                pool.check()
            except AssertionError as exc:
                problems.append(f"check() fails: {exc}")
            if problems:
                raise WrongAnswer("; ".join(problems), _diagnose_touch(touch))

        c.prop("a free cached block leaves the queue; every ref_cnt rises by "
               "one", fixed,
               "where is a block nobody holds, and what does the next "
               "allocation do to it?",
               lambda: _diagnose_touch(touch))

        def trials():
            for seed in range(seeds):
                manager_trial(_touch_manager(touch), seed,
                              diagnose=lambda: _diagnose_touch(touch))

        c.prop(f"{seeds} random scheduler runs with prefix hits match the "
               "library at every step", trials,
               "the message names the operation and the first difference",
               lambda: _diagnose_touch(touch))
    return c.report


catalogue(check_touch, TOUCH_MISTAKES)


