"""Block pool throughput: the intrusive free queue against a ``collections.deque``.

Two measurements, each a ratio taken in one run:

1. **Trace replay.** A fixed, seeded trace of operations on a 20,000-block pool:
   each operation either allocates 1-8 blocks (a new batch, held) or frees one
   held batch in reverse order, as a request frees its blocks. We report blocks
   moved per second (blocks allocated plus blocks freed, divided by time) for
   ``BlockPool`` and for ``DequeBlockPool``, a pool with the same semantics
   built on a deque of block ids (nano-vllm's design). With no prefix hits
   both do O(1) work per block; the deque's pops run in C.

2. **Removal from the middle.** A prefix hit on a cached block that nobody
   holds must take it out of the free queue, wherever it is. The intrusive
   queue unlinks it in O(1); ``deque.remove`` scans. We time one removal (and
   the append that puts the block back) at growing pool sizes.

Performance notes. Two choices in ``pagedkv.block_pool`` are made for this
benchmark's figures rather than for the reader. ``free_blocks`` fuses the
free queue's ``prepend_n``/``append_n`` into its reference counting (one walk
over a batch instead of two, the runs linked into the queue inline), where
vLLM 0.33.0 builds two lists and then calls ``prepend_n`` and ``append_n``;
and the hot loops read a block's ``_block_hash`` slot, not the
``block_hash`` property (a function call per block). The repository's
``tools/core_metrics.py`` replays this trace on vLLM 0.33.0's own pool
(read from its wheel) and prints the ratio, which the fused loop keeps at
1.5 or more.

Run: ``python -m pagedkv.bench block_pool [--blocks N] [--ops N] [--repeats N] [--quick]``.
The pieces live in ``pagedkv.sim.deque_pool``, where chapter 3 runs a small version.
"""

from __future__ import annotations

import argparse

from pagedkv.block_pool import BlockPool
from pagedkv.sim.deque_pool import (DequeBlockPool, blocks_moved_per_second, make_alloc_free_trace, removal_cost,
                                    replay_trace)

__all__ = ["main"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.bench block_pool", description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20_000, help="pool size (default 20,000)")
    parser.add_argument("--ops", type=int, default=200_000, help="trace length (default 200,000)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds; the best counts")
    parser.add_argument("--quick", action="store_true", help="a small run for smoke tests")
    args = parser.parse_args(argv)
    if args.quick:
        args.blocks, args.ops, args.repeats = 2_000, 20_000, 1

    trace = make_alloc_free_trace(args.blocks, args.ops)
    moved = replay_trace(BlockPool(args.blocks), trace)
    print(f"trace: {args.ops:,} operations on a {args.blocks:,}-block pool, {moved:,} blocks moved")
    print(f"best of {args.repeats} interleaved rounds, CPU time of this process")

    def listened() -> BlockPool:  # the observer hook, with a listener that does nothing
        pool = BlockPool(args.blocks)
        pool.subscribe(lambda pool, event: None)
        return pool

    rates = blocks_moved_per_second(
        {"ours": lambda: BlockPool(args.blocks), "deque": lambda: DequeBlockPool(args.blocks), "hooked": listened},
        trace,
        args.repeats,
    )
    ours, naive, hooked = rates["ours"], rates["deque"], rates["hooked"]
    print(f"BlockPool (intrusive queue)      {ours / 1e6:6.2f} M blocks/s")
    print(f"DequeBlockPool (deque of ids)    {naive / 1e6:6.2f} M blocks/s")
    print(f"ratio intrusive / deque          {ours / naive:6.2f}")
    print(f"BlockPool with a no-op listener  {hooked / 1e6:6.2f} M blocks/s ({hooked / ours:.2f} of bare)")
    target = 3e6
    print(f"target >= {target / 1e6:.0f} M blocks/s: {'met' if ours >= target else 'NOT met'}")

    sizes = [1_000, 4_000, 16_000] if args.quick else [1_000, 4_000, 16_000, 64_000]
    cost = removal_cost(sizes, removals=500 if args.quick else 2_000, repeats=1 if args.quick else 3)
    print("removal from a random position of the free queue (+ append back), per operation:")
    print(f"{'pool size':>10} {'intrusive':>12} {'deque.remove':>14} {'ratio':>8}")
    for n, a, b in zip(cost["sizes"], cost["intrusive"], cost["deque"]):
        print(f"{n:>10,} {a * 1e6:>10.2f}us {b * 1e6:>12.2f}us {b / a:>8.1f}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
