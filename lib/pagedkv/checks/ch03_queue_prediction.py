"""Exercise 3's prediction task: the free queue a scripted trace leaves.

The notebook shows ``QUEUE_TRACE`` (four requests on a pool of 8 blocks:
allocations, full blocks cached, requests finishing tail first, a prefix
hit); the reader writes the free queue it leaves, head first, into
``predicted_queue`` before running anything. ``check_free_queue_prediction``
runs the trace on the library's ``BlockPool``, compares, and on a mismatch
draws the pool as the trace leaves it beside the pool as predicted (the
book's ``render_pool``). A small list model of the pool's rules replays the
same trace with one rule changed, to name the misunderstanding a wrong
queue points to.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from ..block_pool import BlockPool
from ..request import Request
from ..views.pool_picture import render_pool
from ._harness import Mistake, catalogue
from .predict_harness import PredictionReport, check_prediction, side_by_side

__all__ = ["check_free_queue_prediction", "QUEUE_TRACE", "run_queue_trace"]

#: The trace, as the notebook shows it (and as the checker runs it).
QUEUE_TRACE = """\
pool = BlockPool(8)                          # queue [1, 2, ..., 7]
hashes = Request("A", list(range(8)), hash_block_size=4).block_hashes
a = pool.get_new_blocks(3)                   # request A, blocks of 4
pool.cache_full_blocks(a, hashes, 0, 2)      # A's first 2 blocks are full
b = pool.get_new_blocks(3)                   # request B
pool.free_blocks(list(reversed(a)))          # A finishes, tail first
c = pool.get_new_blocks(2)                   # request C
d = [pool.get_cached_block(hashes[0])]       # D's prompt starts as A's did
pool.touch(d)                                # ... and D takes that block
pool.free_blocks(list(reversed(b)))          # B finishes, tail first
"""

#: The same trace as data, for the list model.
_OPS = [("get", "A", 3), ("cache", "A", 2), ("get", "B", 3), ("free", "A"),
        ("get", "C", 2), ("hit", "D", "A", 0), ("free", "B")]


def run_queue_trace() -> tuple[BlockPool, dict[str, list]]:
    """Run ``QUEUE_TRACE`` on the library: the pool, and who still holds what."""
    namespace: dict = {"BlockPool": BlockPool, "Request": Request}
    exec(QUEUE_TRACE, namespace)  # noqa: S102 -- the module's own constant
    return namespace["pool"], {"C": namespace["c"], "D": namespace["d"]}


def queue_model(*, all_tail=False, all_head=False, batch_reversed=False,
                touch_keeps=False, pop_tail=False) -> list[int]:
    """The free queue after ``_OPS`` under the pool's rules, one of them changed."""
    queue, ref, hashed, held = list(range(1, 8)), {}, set(), {}
    first_blocks: dict[str, list[int]] = {}
    for op in _OPS:
        if op[0] == "get":
            _, name, n = op
            got = queue[-n:][::-1] if pop_tail else queue[:n]
            queue = [b for b in queue if b not in got]
            for b in got:
                ref[b] = 1
                hashed.discard(b)  # eviction at reuse
            held[name] = first_blocks[name] = got
        elif op[0] == "cache":
            hashed.update(held[op[1]][:op[2]])
        elif op[0] == "free":
            head, tail = [], []
            for b in reversed(held.pop(op[1])):
                ref[b] -= 1
                if ref[b] == 0:
                    (tail if b in hashed else head).append(b)
            if batch_reversed:
                head = head[::-1]
            if all_tail:
                queue = queue + head + tail
            elif all_head:
                queue = head + tail + queue
            else:
                queue = head + queue + tail
        else:  # a prefix hit on the block at index op[3] of op[2]'s table
            b = first_blocks[op[2]][op[3]]
            if ref.get(b, 0) == 0 and not touch_keeps:
                queue.remove(b)
            ref[b] = ref.get(b, 0) + 1
            held[op[1]] = [b]
    return queue


QUEUE_MISTAKES = [
    Mistake("every freed block at the tail", "only a block with a hash "
            "waits at the tail, still matchable; a block without one can "
            "never be hit again, so it goes to the head and is reused first",
            lambda: queue_model(all_tail=True)),
    Mistake("hashed blocks at the head", "a block with a hash stays "
            "matchable while it waits: it goes to the tail, evicted last",
            lambda: queue_model(all_head=True)),
    Mistake("B's blocks in reverse", "free_blocks takes its list in "
            "eviction order, B's table reversed (its last block first), and "
            "the batch keeps that order at the head",
            lambda: queue_model(batch_reversed=True)),
    Mistake("D's block left in the queue", "a prefix hit touches its blocks: "
            "a block nobody held leaves the free queue, so no allocation "
            "can hand it to someone else while D reads it",
            lambda: queue_model(touch_keeps=True)),
    Mistake("allocation from the tail", "get_new_blocks pops the head, the "
            "blocks least worth keeping; the tail keeps the cached ones",
            lambda: queue_model(pop_tail=True)),
]


# ----------------------------------------------------------- the picture
@dataclass
class _Block:
    """What ``render_pool`` reads of a block, for a pool drawn as predicted."""

    block_id: int
    ref_cnt: int
    block_hash: object
    is_null: bool


class _Queue:
    def __init__(self, blocks: list[_Block]) -> None:
        self.blocks = blocks

    def get_all_free_blocks(self) -> list[_Block]:
        return list(self.blocks)


class _PredictedPool:
    """The trace's pool with its free queue replaced by the prediction.

    A block predicted free is drawn free (its hash kept, so a cached block
    stays amber); a block the trace leaves free but the prediction leaves
    out is drawn held (``ref_cnt`` 1). Only what ``render_pool`` reads.
    """

    def __init__(self, pool: BlockPool, queue_ids: list[int]) -> None:
        predicted = set(queue_ids)
        self.blocks = []
        for b in pool.blocks:
            ref = b.ref_cnt
            if b.block_id in predicted:
                ref = 0
            elif ref == 0 and not b.is_null:
                ref = 1
            self.blocks.append(_Block(b.block_id, ref, b.block_hash, b.is_null))
        self.num_gpu_blocks = pool.num_gpu_blocks
        self.free_block_queue = _Queue([self.blocks[i] for i in queue_ids])

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_queue.blocks)

    def get_usage(self) -> float:
        held = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        return held / max(self.num_gpu_blocks - 1, 1)


def _read(predicted) -> list[int]:
    shape = ("expected the free queue as a list of block ids, head first, "
             "such as [1, 2, 3]")
    if isinstance(predicted, (str, bytes)) or not hasattr(predicted, "__iter__"):
        raise AssertionError(f"{shape}; got {type(predicted).__name__} {predicted!r:.40}")
    ids = list(predicted)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise AssertionError(f"{shape}; got {ids!r:.60}")
    return [int(i) for i in ids]


def _compare(got: list[int], want: list[int], pool: BlockPool, holders) -> str | None:
    if got == want:
        return None
    words = f"you predicted the queue {got}, the trace leaves {want} (head first)"
    held = {b.block_id: name for name, blocks in holders.items() for b in blocks}
    for b in got:
        if not 0 <= b < pool.num_gpu_blocks:
            return f"{words}: there is no block {b} in a pool of {pool.num_gpu_blocks}"
        if b == 0:
            return f"{words}: block 0 is the null block, never free"
        if b in held:
            return f"{words}: block {b} is held by {held[b]}, so it is not in the queue"
    if len(set(got)) != len(got):
        return f"{words}: a block is in the queue once at most"
    missing = [b for b in want if b not in got]
    if missing:
        return f"{words}: block {missing[0]} is free too"
    first = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    return f"{words}: position {first} holds block {want[first]}, not {got[first]}"


def _diagnose(got: list[int]) -> str | None:
    for m in QUEUE_MISTAKES:
        if m.model() == got:
            return m.diagnosis()
    return None


def check_free_queue_prediction(predicted_queue) -> PredictionReport:
    """Grade a prediction of the free queue (block ids, head first) ``QUEUE_TRACE`` leaves."""
    pool, holders = run_queue_trace()
    want = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]

    def draw(got):
        n = pool.num_gpu_blocks
        got = list(dict.fromkeys(b for b in got if 0 < b < n))  # what can be drawn
        changed = {b for i, b in enumerate(want) if i >= len(got) or got[i] != b}
        changed |= {b for i, b in enumerate(got) if i >= len(want) or want[i] != b}
        predicted_owners = {name: [b for b in blocks if b.block_id not in got]
                            for name, blocks in holders.items()}
        return side_by_side(
            render_pool(pool, holders, "the trace", highlight=changed),
            render_pool(_PredictedPool(pool, got), predicted_owners, "your prediction",
                        highlight=changed), min_px=480)

    return check_prediction(
        "prediction", "predicted_queue", predicted_queue, want,
        read=_read, compare=lambda got, w: _compare(got, w, pool, holders),
        draw=draw, diagnose=_diagnose,
        name="your free queue, head first, is the one the trace leaves",
        hint="replay the trace one line at a time: where does each freed "
             "block go, and what does a hit take out?")


catalogue(check_free_queue_prediction, QUEUE_MISTAKES)
