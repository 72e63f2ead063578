"""A performance model of the attention benchmark on an H200, from the compile report.

    python tools/perf_model.py [--write | --check]

For every shape ``python -m pagedkv.bench attention`` times, this predicts a
range of kernel times on an H200 before any GPU has run it, from what the
ahead-of-time compile says (``book/compile_report.json``: registers, shared
memory, programs per SM, K/V buffers and the main loop's SASS instructions)
and the plan the library makes for the shape (``plan_attention``: the work
list, the tiles, the split count). The first GPU run tests it: the benchmarks
page shows prediction and measurement side by side. ``--write`` stores
``book/perf_model.json`` and re-renders ``book/benchmarks.md``; ``--check``
fails if the committed file differs from what this computes now.

The time of one launch is the largest of four floors, plus launch overhead:

* **bandwidth**: the bytes the benchmark counts (K and V read once, Q read,
  O written) at 92 % (low) to 70 % (high) of the datasheet's 4,800 GB/s;
* **issue**: every program runs ``iterations x loop instructions`` per warp;
  an SM issues 4 warp-instructions a cycle at best (low) and 2 (high), at the
  1.98 GHz boost clock, over 132 SMs;
* **tensor cores**: the multiply-adds the padded tiles execute (QK^T and PV,
  rows x keys x padded head_dim, twice) at 989 (low) to 600 (high) dense
  bf16 TFLOP/s;
* **latency**: an iteration waits for its K/V tiles, requested ``buffers``
  iterations ahead: 0.5 us (low) to 0.8 us (high) of HBM latency divided by
  the K/V buffers in flight. A resident program slot runs one iteration per
  that time, so the floor is the larger of the longest program's iterations
  and all iterations over the resident capacity (programs per SM x 132);
* **launches**: 1 us (low) to 3 us (high) per launch (split-KV adds the merge).

The split count is the one ``plan_attention`` would choose on an H200: from
the compile report's programs per SM of the split kernel. A model is not a
measurement: its constants are datasheet figures and rough latencies, named
here so that the first GPU run can say which one was wrong.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "lib"))

from pagedkv.bench import attention as bench  # noqa: E402
from pagedkv.bench._report import COMPILE_JSON, PAGE_MD, PERF_MODEL_JSON  # noqa: E402
from pagedkv.common import cdiv  # noqa: E402
from pagedkv.kernels.attention import plan_attention  # noqa: E402
from pagedkv.kernels.residency import choose_splits  # noqa: E402

H200 = dict(name="H200", target="sm_90", sms=132, clock_ghz=1.98, bandwidth_gbs=4800.0,
            tensor_tflops=989.0)
# (low, high) of each constant the docstring names.
BANDWIDTH_SHARE = (0.92, 0.70)
ISSUE_PER_CYCLE = (4, 2)
TENSOR_TFLOPS = (989.0, 600.0)
HBM_LATENCY_US = (0.5, 0.8)
LAUNCH_US = (1.0, 3.0)


def shapes() -> list[tuple[str, list[int], list[int], int | None]]:
    """The benchmark's shapes: (name, q_lens, context lengths, forced split count)."""
    rows = [(f"decode {b}x{c}", [1] * b, [c] * b, None) for b, c in bench.DECODE]
    batch, prompt = bench.PREFILL
    rows.append((f"prefill {batch}x{prompt}", [prompt] * batch, [0] * batch, None))
    chunk, decodes, ctx = bench.MIXED
    rows.append((f"mixed {chunk}+{decodes}x{ctx}", *bench._mixed_lens(chunk, decodes, ctx), None))
    rows.append(("decode 1x16384 unsplit", [1], [16384], 1))
    return rows


def _row(report: dict, name: str) -> dict:
    return next(r for r in report["rows"] if r["name"] == name)


def _programs(plan, q_lens, seqs) -> list[int]:
    """Iterations of the main loop of every program of one KV head (the kernel's own arithmetic)."""
    iters = []
    for r, t in plan.work_items():
        kv_end = seqs[r] - q_lens[r] + min((t + 1) * plan.block_q, q_lens[r])
        seg = cdiv(cdiv(kv_end, plan.num_splits), plan.tile_n) * plan.tile_n
        for s in range(plan.num_splits):
            lo, hi = s * seg, min((s + 1) * seg, kv_end)
            iters.append(cdiv(max(hi - lo, 0), plan.tile_n))
    return iters


def predict(report: dict, name: str, q_lens: list[int], ctx: list[int], splits: int | None) -> dict:
    seqs = [c + n for c, n in zip(ctx, q_lens)]
    heads, kv_heads, dim = bench.HEADS, bench.KV_HEADS, bench.HEAD_DIM
    decode = max(q_lens) <= 1
    main_row = _row(report, f"{'decode 64 x 4k' if decode else 'prefill 4 x 2k'} bf16 d{dim} b{bench.BLOCK}")
    split_row = _row(report, f"split 1 x 16k bf16 d{dim} b{bench.BLOCK}")
    plan = plan_attention(heads, kv_heads, q_lens, seqs, 1)
    if splits is None and decode:  # what plan_attention chooses on an H200
        capacity = split_row[H200["target"]]["resident"] * H200["sms"]
        splits = choose_splits(plan.grid[0] * kv_heads, max(seqs), plan.tile_n, capacity)
    plan = plan_attention(heads, kv_heads, q_lens, seqs, splits or 1)
    fig = (split_row if plan.num_splits > 1 else main_row)[H200["target"]]
    iters = _programs(plan, q_lens, seqs) * kv_heads
    capacity = fig["resident"] * H200["sms"]
    nbytes = 2 * sum(seqs) * kv_heads * dim * 2 + 2 * sum(q_lens) * heads * dim * 2
    dim_p2 = 1 << (dim - 1).bit_length()
    flops = sum(iters) * 2 * 2 * plan.block_m * plan.tile_n * dim_p2
    instructions = sum(iters) * fig["loop_sass"] * plan.num_warps
    launches = 1 + (plan.num_splits > 1)
    terms = {}
    for i, bound in enumerate(("low", "high")):
        terms[bound] = dict(
            bandwidth=nbytes / (H200["bandwidth_gbs"] * BANDWIDTH_SHARE[i] * 1e3),
            issue=instructions / (ISSUE_PER_CYCLE[i] * H200["clock_ghz"] * 1e3 * H200["sms"]),
            tensor=flops / (TENSOR_TFLOPS[i] * 1e6),
            latency=max(max(iters), sum(iters) / capacity) * HBM_LATENCY_US[i] / fig["kv_buffers"],
        )
    low, high = (max(terms[b].values()) + launches * LAUNCH_US[i] for i, b in enumerate(("low", "high")))
    return dict(name=name, kernel_row=main_row["name"] if plan.num_splits == 1 else split_row["name"],
                grid=list(plan.grid), programs=math.prod(plan.grid), capacity=capacity,
                waves=cdiv(math.prod(plan.grid), capacity), num_splits=plan.num_splits,
                bytes=nbytes, max_iterations=max(iters), iterations=sum(iters),
                terms={b: {k: round(v, 2) for k, v in t.items()} for b, t in terms.items()},
                bound=max(terms["low"], key=terms["low"].get),
                predicted_us=[round(low, 1), round(high, 1)])


def model(report: dict) -> dict:
    constants = dict(device=H200, bandwidth_share=BANDWIDTH_SHARE, issue_per_cycle=ISSUE_PER_CYCLE,
                     tensor_tflops=TENSOR_TFLOPS, hbm_latency_us=HBM_LATENCY_US, launch_us=LAUNCH_US)
    return dict(triton=report["triton"], constants=constants,
                rows=[predict(report, *shape) for shape in shapes()])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="store book/perf_model.json and re-render the page")
    ap.add_argument("--check", action="store_true", help="fail if the committed model differs")
    ap.add_argument("--against", metavar="GPU_REPORT", help="print each measured time beside its prediction")
    opts = ap.parse_args(argv)
    got = model(json.loads((ROOT / COMPILE_JSON).read_text()))
    measured = {}
    if opts.against:
        section = json.loads(Path(opts.against).read_text()).get("attention", {})
        measured = {r["name"]: r["kernel_ms"] * 1e3 for r in section.get("rows", [])}
    inside = 0
    for r in got["rows"]:
        lo, hi = r["predicted_us"]
        line = (f"{r['name']:<24} {r['programs']:>6} programs, {r['waves']} wave(s), "
                f"{r['num_splits']} split(s): {lo:>7.1f} - {hi:>7.1f} us ({r['bound']})")
        if r["name"] in measured:
            us = measured[r["name"]]
            inside += lo <= us <= hi
            line += f"; measured {us:.1f} us, {'inside' if lo <= us <= hi else 'OUTSIDE'}"
        print(line)
    if measured:
        print(f"{inside} of {sum(r['name'] in measured for r in got['rows'])} measured shapes inside the range")
    path = ROOT / PERF_MODEL_JSON
    if opts.write:
        path.write_text(json.dumps(got, indent=1) + "\n")
        from pagedkv.bench import _report
        import os
        os.chdir(ROOT)
        _report.main([])
    if opts.check:
        committed = json.loads(path.read_text()) if path.exists() else None
        if committed != json.loads(json.dumps(got)):
            print(f"{PERF_MODEL_JSON} differs from the model computed now: run tools/perf_model.py --write")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
