"""How fast the fragmentation simulator replays a trace: simulated requests per second.

    python -m pagedkv.bench fragmentation [--requests 100000] [--workload chat] [--kinds paged,token]

Every allocator replays the same seeded trace on the reference pool (Llama-3-8B
on an H100: 26,785 blocks of 16 = 428,560 token slots, max_model_len 32,768),
to the last request. The figure is wall-clock, so it depends on the machine; the
ratios against the paged allocator, taken in the same run, travel better.
The simulator's cost per step grows with the number of running requests, so
the allocators that admit more do more work per step and finish in fewer steps.
"""

from __future__ import annotations

import argparse
import time

from pagedkv import budget
from pagedkv import sim


def reference_pool_slots() -> int:
    pool = budget.kv_pool_bytes(budget.gpu_spec("H100 SXM 80GB").total_bytes, 0.92, 14.96 * budget.GiB,
                                6.0 * budget.GiB)
    return budget.token_slots(budget.num_gpu_blocks(pool, "Llama-3-8B", 16), 16)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.bench fragmentation")
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--workload", default="chat", choices=sorted(sim.WORKLOADS))
    parser.add_argument("--arrival-rate", type=float, default=8.0, help="requests per step (Poisson)")
    parser.add_argument("--kinds", default=",".join(sim.ALLOCATOR_KINDS),
                        help="comma-separated allocator kinds: " + ", ".join(sim.ALLOCATOR_KINDS))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    for k in kinds:
        if k not in sim.ALLOCATOR_KINDS:
            parser.error(f"unknown allocator kind {k!r}; choose from {', '.join(sim.ALLOCATOR_KINDS)}")

    slots = reference_pool_slots()
    t0 = time.perf_counter()
    trace = sim.make_request_trace(args.workload, args.requests, arrival_rate=args.arrival_rate, seed=args.seed)
    gen_s = time.perf_counter() - t0
    print(trace.describe())
    print(f"pool: {slots:,} token slots; trace generated in {gen_s * 1e3:.1f} ms "
          f"({args.requests / gen_s:,.0f} requests/s)\n")
    print(f"{'allocator':28s} {'steps':>9s} {'peak running':>12s} {'seconds':>8s} {'sim requests/s':>15s} {'steps/s':>10s}")
    rates: dict[str, float] = {}
    for kind in kinds:
        alloc = sim.make_allocator(kind, slots, block_size=args.block_size)
        t0 = time.perf_counter()
        res = sim.simulate(alloc, trace)
        dt = time.perf_counter() - t0
        assert res.finished == len(trace)
        alloc.check()
        rates[kind] = len(trace) / dt
        print(f"{res.allocator:28s} {res.steps:9,d} {int(res.running.max()):12,d} {dt:8.2f} "
              f"{rates[kind]:15,.0f} {res.steps / dt:10,.0f}")
    if "paged" in rates:
        print("\nsimulated requests/s relative to paged (same run): "
              + ", ".join(f"{k} {r / rates['paged']:.2f}x" for k, r in rates.items()))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
