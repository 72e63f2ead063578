"""The deque-backed pool that chapter 3 races against ``BlockPool``, and the race itself.

``DequeBlockPool`` has ``BlockPool``'s semantics on a ``collections.deque`` of
free block ids (nano-vllm's design). Its pops run in C, so on plain allocation
and freeing it can win; a prefix hit on a free cached block must take that
block out of the middle of the queue, and ``deque.remove`` scans where the
intrusive list unlinks in O(1).

* ``make_alloc_free_trace``/``replay_trace``: a seeded trace of allocations (1-8 blocks,
  held) and frees (a held batch, in reverse order, as a request frees).
* ``blocks_moved_per_second``: blocks allocated plus freed per CPU second, for
  several pools in interleaved rounds (the best round counts).
* ``removal_cost``: one removal from a random position (and the append back) at
  growing pool sizes.

``python -m pagedkv.bench block_pool`` runs the full-size race.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from ..free_queue import KVCacheBlock

__all__ = [
    "DequeBlockPool",
    "make_alloc_free_trace",
    "replay_trace",
    "blocks_moved_per_second",
    "removal_cost",
]


class DequeBlockPool:
    """The naive contrast: ``BlockPool``'s semantics on a ``deque`` of free block ids.

    Allocation pops from the left, unhashed frees go back on the left, hashed
    frees on the right: the same order as ``BlockPool``. Only ``touch`` differs
    in cost: taking a block out of the middle is ``deque.remove``, a linear
    scan of the free ids.
    """

    def __init__(self, num_gpu_blocks: int) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_ids: deque[int] = deque(range(1, num_gpu_blocks))  # block 0 is the null block
        self.cached_block_hash_to_block: dict = {}

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > len(self.free_block_ids):
            raise ValueError(f"cannot get num_blocks={num_blocks} new blocks")
        popleft, blocks = self.free_block_ids.popleft, self.blocks
        ret = [blocks[popleft()] for _ in range(num_blocks)]
        for block in ret:
            if block._block_hash is not None:
                del self.cached_block_hash_to_block[block._block_hash]
                block.reset_hash()
            block.ref_cnt = 1
        return ret

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        to_head, to_tail = [], []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (to_head if block._block_hash is None else to_tail).append(block.block_id)
        # extendleft reverses; reverse first so to_head[0] ends up leftmost.
        self.free_block_ids.extendleft(reversed(to_head))
        self.free_block_ids.extend(to_tail)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_ids.remove(block.block_id)  # O(n) scan
            block.ref_cnt += 1


def make_alloc_free_trace(num_gpu_blocks: int = 20_000, num_ops: int = 200_000, seed: int = 0) -> list[int]:
    """A replayable trace: ``n > 0`` allocates a batch of n blocks; ``~i`` frees held batch i.

    Freeing swaps the last held batch into slot i (so indices stay dense); the
    replayer does the same. The trace keeps the pool between about 30 % and
    90 % full, so both allocation and freeing stay possible.
    """
    rng = random.Random(seed)
    usable = num_gpu_blocks - 1
    free = usable
    held: list[int] = []  # sizes of held batches
    trace: list[int] = []
    for _ in range(num_ops):
        in_use = usable - free
        want_alloc = rng.random() < (0.7 if in_use < 0.3 * usable else 0.5 if in_use < 0.9 * usable else 0.0)
        n = rng.randint(1, 8)
        if (want_alloc or not held) and n <= free:
            trace.append(n)
            held.append(n)
            free -= n
        else:
            i = rng.randrange(len(held))
            trace.append(~i)
            free += held[i]
            held[i] = held[-1]
            held.pop()
    return trace


def replay_trace(pool, trace: Sequence[int]) -> int:
    """Run ``trace`` on ``pool``; return the number of blocks moved (allocated + freed)."""
    held: list[list[KVCacheBlock]] = []
    get_new_blocks, free_blocks = pool.get_new_blocks, pool.free_blocks
    moved = 0
    for op in trace:
        if op > 0:
            held.append(get_new_blocks(op))
            moved += op
        else:
            i = ~op
            batch = held[i]
            held[i] = held[-1]
            held.pop()
            free_blocks(reversed(batch))
            moved += len(batch)
    return moved


def blocks_moved_per_second(
    make_pools: dict[str, Callable[[], object]], trace: Sequence[int], repeats: int = 5
) -> dict[str, float]:
    """Replay ``trace`` on a fresh pool of each kind, ``repeats`` rounds, interleaved; best rate per kind.

    Interleaving gives every kind the same share of a noisy machine; the best
    round is the one least disturbed by other processes. Time is this
    process's CPU time, so being descheduled does not count.
    """
    best = {name: 0.0 for name in make_pools}
    for _ in range(repeats):
        for name, make_pool in make_pools.items():
            pool = make_pool()
            t0 = time.process_time()
            moved = replay_trace(pool, trace)
            dt = time.process_time() - t0
            best[name] = max(best[name], moved / dt)
    return best


def removal_cost(
    sizes: Sequence[int], removals: int = 2_000, seed: int = 0, repeats: int = 3
) -> dict[str, list[float]]:
    """Seconds per removal from a random position of a full free queue, at each pool size.

    Each removed block is appended back, so the queue keeps its length. The
    same random positions serve both implementations.
    """
    from pagedkv.free_queue import FreeKVCacheBlockQueue

    ours, naive = [], []
    for n in sizes:
        rng = random.Random(seed)
        picks = [rng.randrange(n) for _ in range(removals)]
        best_ours = best_naive = float("inf")
        for _ in range(repeats):
            blocks = [KVCacheBlock(i) for i in range(n)]
            queue = FreeKVCacheBlockQueue(blocks)
            remove, append = queue.remove, queue.append
            t0 = time.process_time()
            for i in picks:
                block = blocks[i]
                remove(block)
                append(block)
            best_ours = min(best_ours, (time.process_time() - t0) / removals)

            ids = deque(range(n))
            dremove, dappend = ids.remove, ids.append
            t0 = time.process_time()
            for i in picks:
                dremove(i)
                dappend(i)
            best_naive = min(best_naive, (time.process_time() - t0) / removals)
        ours.append(best_ours)
        naive.append(best_naive)
    return {"sizes": list(sizes), "intrusive": ours, "deque": naive}
