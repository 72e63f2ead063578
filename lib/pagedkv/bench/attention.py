"""Paged attention against SDPA on contiguous K/V, and against the GPU's bandwidth.

``python -m pagedkv.bench attention [--json PATH]``

Llama-3-8B's attention shapes (32 query heads, 8 KV heads, head_dim 128),
bf16, blocks of 16 tokens scattered over the pool: decode at batch 1, 16, 64
x context 1k, 4k, 16k, a prefill of 4 x 2k, and a mixed step of chunked
prefill (one 2k-token chunk with 63 decodes at 4k). For each shape, in the same
run: the kernel's time, the bytes it must move (K/V read once, Q read, O
written) as GB/s and as a share of the device's datasheet peak, and the ratio
to ``torch.nn.functional.scaled_dot_product_attention`` (flash backend where
it accepts the shape) on the same K/V laid out contiguously (for the mixed
step, SDPA's two calls: the chunk and the decodes). Then split-KV on and off at
batch 1 x 16k. Times are device times from a CUDA graph of back-to-back
launches, each on its own copy of the data, L2 flushed before each repetition;
the launch is planned before (see ``_cuda_timing``). On a CPU the kernel runs
in Triton's interpreter, whose speed says nothing about a GPU: the script
checks that the paths agree, on the benchmark's own cases, and reports no timings.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

import pagedkv
from pagedkv.bench._cuda_timing import copies_for_cold_l2, device_ceilings, gbps, time_graph_ms
from pagedkv.bench._report import merge_section
from pagedkv.budget import gpu_for_device_name
from pagedkv.kernels.attention import kernel_launches, paged_attention_ref, plan_attention
from ..common import cdiv

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DECODE = [(b, c) for b in (1, 16, 64) for c in (1024, 4096, 16384)]
PREFILL = (4, 2048)
MIXED = (2048, 63, 4096)  # one prompt chunk of 2k tokens, 63 decodes at a 4k context
BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
REPORT = "book/gpu_report.json"  # committed after a GPU run; the book's benchmarks page reads it


def _mixed_lens(chunk: int, decodes: int, ctx: int) -> tuple[list[int], list[int]]:
    """(q_lens, context lengths) of a chunked-prefill step: the chunk first (a new prompt)."""
    return [chunk] + [1] * decodes, [0] + [ctx] * decodes


def _paged_case(q_lens, ctx_lens, dev, g, block=BLOCK, copies=1, heads=HEADS, kv_heads=KV_HEADS,
                dim=HEAD_DIM, dtype=torch.bfloat16):
    """Requests of ``ctx + q_len`` tokens, K/V in shuffled blocks, ``copies`` times over.

    Returns ``(q, key_cache, value_cache, tables, seq_lens, query_start_loc)``:
    ``q[c]`` and ``tables[c]`` are copy ``c``'s queries and block table. The
    copies share the caches but no block, so back-to-back calls on successive
    copies read different memory (a cold L2 for each, see ``copies_for_cold_l2``).
    Unused table columns hold block 0 (never read).
    """
    seqs = [c + n for c, n in zip(ctx_lens, q_lens)]
    nblk = [cdiv(s, block) for s in seqs]
    per_copy = sum(nblk)
    kc = torch.randn(copies * per_copy, block, kv_heads, dim, device=dev, generator=g, dtype=dtype)
    vc = torch.randn_like(kc)
    ids = torch.randperm(copies * per_copy, device=dev, generator=g).to(torch.int32).view(copies, per_copy)
    tables = torch.zeros(copies, len(seqs), max(nblk), dtype=torch.int32, device=dev)
    start = 0
    for r, n in enumerate(nblk):
        tables[:, r, :n] = ids[:, start:start + n]
        start += n
    q = torch.randn(copies, sum(q_lens), heads, dim, device=dev, generator=g, dtype=dtype)
    seq_lens = torch.tensor(seqs, dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=dev)
    return q, kc, vc, tables, seq_lens, qsl


def _planned_calls(plan, q, kc, vc, tables, seq_lens, qsl, scale):
    """One call per copy, its launches prepared in advance (scratch included): a call
    only launches. Returns (calls, outputs)."""
    outs = torch.empty_like(q)
    calls = []
    for c in range(q.shape[0]):
        launches = kernel_launches(plan, q[c], kc, vc, tables[c], seq_lens, qsl, scale, outs[c])

        def call(launches=launches):
            for kernel, grid, args, kwargs in launches:
                kernel[grid](*args, **kwargs)
        calls.append(call)
    return calls, outs


def _interpreter_check() -> bool:
    """The benchmark's own cases, small: a mixed batch in two copies, kernel (split-KV
    off and on) against the reference, launched as the timing launches."""
    g = torch.Generator().manual_seed(0)
    q_lens, ctx = [5, 1, 1], [20, 70, 3]
    q, kc, vc, tables, seq_lens, qsl = _paged_case(q_lens, ctx, "cpu", g, copies=2, heads=8, kv_heads=2,
                                                   dim=32, dtype=torch.float32)
    ok = True
    for splits in (1, 3):
        plan = plan_attention(8, 2, q_lens, [c + n for c, n in zip(ctx, q_lens)], splits, head_dim=32,
                              dtype=torch.float32)
        calls, outs = _planned_calls(plan, q, kc, vc, tables, seq_lens, qsl, 32 ** -0.5)
        for c, call in enumerate(calls):
            call()
            ref = paged_attention_ref(q[c], kc, vc, tables[c], seq_lens, qsl, 32 ** -0.5)
            ok &= torch.allclose(outs[c], ref, atol=1e-4)
    return ok


def _sdpa(q, kc, vc, table, q_len, seq):
    """SDPA on the same K/V gathered into contiguous [batch, heads, seq, dim]; returns (fn, backend).

    Every request of ``table`` has ``q_len`` queries and ``seq`` tokens; q holds their queries.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch = table.shape[0]
    k = kc[table.long()].flatten(1, 2)[:, :seq].transpose(1, 2).contiguous()
    v = vc[table.long()].flatten(1, 2)[:, :seq].transpose(1, 2).contiguous()
    qd = q.view(batch, q_len, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    causal = q_len > 1 and q_len == seq
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        def fn(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qd, k, v, is_causal=causal,
                                                                        enable_gqa=True)
        try:
            fn()
            return fn, backend.name.lower()
        except RuntimeError:
            continue
    raise RuntimeError("no SDPA backend accepted the shape")


def _sdpa_calls(q, kc, vc, tables, q_lens, seqs):
    """SDPA for each copy: one call per group of equal (q_len, seq) requests, in request order."""
    groups = [(n, s, len(list(run))) for (n, s), run in itertools.groupby(zip(q_lens, seqs))]
    calls, backends = [], set()
    for c in range(q.shape[0]):
        fns, r, t = [], 0, 0
        for n, s, count in groups:
            fn, backend = _sdpa(q[c, t:t + n * count], kc, vc, tables[c, r:r + count], n, s)
            fns.append(fn)
            backends.add(backend)
            r, t = r + count, t + n * count
        calls.append(lambda fns=fns: [fn() for fn in fns])
    return calls, "+".join(sorted(backends))


def _measure(name, q_lens, ctx_lens, dev, g, peak, splits=None, block=BLOCK):
    seqs = [c + n for c, n in zip(ctx_lens, q_lens)]
    kv_bytes = 2 * sum(seqs) * KV_HEADS * HEAD_DIM * 2
    nbytes = kv_bytes + 2 * sum(q_lens) * HEADS * HEAD_DIM * 2  # K+V once, Q in, O out
    copies = copies_for_cold_l2(nbytes)
    q, kc, vc, tables, seq_lens, qsl = _paged_case(q_lens, ctx_lens, dev, g, block, copies)
    scale = HEAD_DIM ** -0.5
    plan = plan_attention(HEADS, KV_HEADS, q_lens, seqs, splits)
    calls, outs = _planned_calls(plan, q, kc, vc, tables, seq_lens, qsl, scale)
    if sum(seqs) <= 65536:
        calls[0]()
        ref = paged_attention_ref(q[0], kc, vc, tables[0], seq_lens, qsl, scale)
        err = (outs[0].float() - ref.float()).abs().max().item()
        assert err < 3e-2, f"{name}: kernel differs from reference by {err}"
    ms, method = time_graph_ms(calls)
    sdpa_calls, backend = _sdpa_calls(q, kc, vc, tables, q_lens, seqs)
    ms_sdpa, _ = time_graph_ms(sdpa_calls)
    flops = sum(4 * HEADS * HEAD_DIM * n * (s - (n - 1) / 2) for n, s in zip(q_lens, seqs))  # QK^T, PV; causal
    row = dict(name=name, batch=len(q_lens), q_len=max(q_lens), context=max(ctx_lens), block_size=block,
               num_splits=plan.num_splits, kernel_ms=ms, sdpa_ms=ms_sdpa, sdpa_backend=backend,
               gbps=gbps(nbytes, ms), tflops=flops / (ms * 1e-3) / 1e12, time_vs_sdpa=ms / ms_sdpa,
               copies=copies, timing=method)
    row["pct_peak"] = row["gbps"] / peak if peak else None
    return row


def _uniform(name, batch, q_len, ctx, dev, g, peak, splits=None, block=BLOCK):
    return _measure(name, [q_len] * batch, [ctx] * batch, dev, g, peak, splits, block)


def _print_row(r) -> None:
    pct = f"{r['pct_peak']:.0%}" if r["pct_peak"] is not None else "-"
    print(f"{r['name']:<22}{r['num_splits']:>7}{r['kernel_ms'] * 1e3:>11.1f}{r['gbps']:>9,.0f}{pct:>8}"
          f"{r['tflops']:>9.1f}{r['sdpa_ms'] * 1e3:>10.1f}{r['time_vs_sdpa']:>11.2f}x  {r['sdpa_backend']}",
          flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.bench attention", description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)

    print(pagedkv.device_summary())
    if not pagedkv.on_gpu():
        print("Timings need a GPU: on a CPU the kernel runs in Triton's interpreter,")
        print("whose speed says nothing about a GPU. No times or GB/s are reported here.")
        verdict = "matches" if _interpreter_check() else "DOES NOT match"
        print(f"interpreter check: the kernel (split-KV off and on) {verdict} the reference")
        return 0 if verdict == "matches" else 1

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    copy_gbps, gpu = device_ceilings(dev)
    peak = gpu.peak_bandwidth_gbs if gpu else None
    print(f"shapes: {HEADS} query heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, bf16, block size {BLOCK}")
    print(f"{'shape':<22}{'splits':>7}{'kernel us':>11}{'GB/s':>9}{'% peak':>8}{'TFLOP/s':>9}"
          f"{'SDPA us':>10}{'kernel/SDPA':>12}  SDPA backend")
    rows = []
    for name, q_lens, ctx in ([(f"decode {b}x{c}", [1] * b, [c] * b) for b, c in DECODE]
                              + [(f"prefill {PREFILL[0]}x{PREFILL[1]}", [PREFILL[1]] * PREFILL[0], [0] * PREFILL[0]),
                                 (f"mixed {MIXED[0]}+{MIXED[1]}x{MIXED[2]}", *_mixed_lens(*MIXED))]):
        rows.append(_measure(name, q_lens, ctx, dev, g, peak))
        _print_row(rows[-1])
    print(f"timing: {rows[0]['timing']} (per-shape copies of the data so that each call reads from HBM)")
    if args.json:  # the main table now, in case a later part runs out of time
        merge_section(args.json, "attention", _report_section(dev, copy_gbps, peak, rows))

    blocks = [_uniform(f"decode 16x4096 block {b}", 16, 1, 4096, dev, g, peak, block=b) for b in BLOCK_SIZES]
    print("decode 16x4096 by block size: " + ", ".join(
        f"{r['block_size']}: {r['gbps']:,.0f} GB/s" for r in blocks))

    one = _uniform("decode 1x16384 unsplit", 1, 1, 16384, dev, g, peak, splits=1)
    split = _uniform("decode 1x16384 split", 1, 1, 16384, dev, g, peak)
    speedup = one["kernel_ms"] / split["kernel_ms"]
    print(f"split-KV at batch 1 x 16k: {one['kernel_ms'] * 1e3:.1f} us unsplit, "
          f"{split['kernel_ms'] * 1e3:.1f} us with {split['num_splits']} splits: {speedup:.2f}x")

    target = next(r for r in rows if r["name"] == "decode 64x4096")
    print("targets: decode 64x4k >= 70% of peak: "
          + (f"{target['pct_peak']:.0%}" if target["pct_peak"] is not None else "no datasheet peak")
          + f"; <= 1.25x SDPA's time: {target['time_vs_sdpa']:.2f}x; split-KV >= 2x: {speedup:.2f}x")
    if args.json:
        merge_section(args.json, "attention", _report_section(dev, copy_gbps, peak, rows + blocks + [one, split],
                                                              split_speedup=speedup))
        print(f"figures written to {args.json}")
    return 0


def _report_section(dev, copy_gbps, peak, rows, **extra) -> dict:
    return dict(device=torch.cuda.get_device_name(dev), summary=pagedkv.device_summary(),
                copy_ceiling_gbps=copy_gbps, peak_gbps=peak, rows=rows, **extra)


def _committed_report() -> dict | None:
    """The committed GPU report, found from the book's root (the folder with _toc.yml)."""
    here = Path.cwd()
    for folder in (here, *here.parents):
        if (folder / "_toc.yml").exists():
            path = folder / REPORT
            return json.loads(path.read_text()).get("attention") if path.exists() else None
    return None


def _plot(rows, peak, device):
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(7.2, 3.0), constrained_layout=True)
    by_block = [r for r in rows if r["name"].startswith("decode 16x4096 block")]
    left.plot([r["block_size"] for r in by_block], [r["gbps"] for r in by_block], "o-", label="paged kernel")
    if peak:
        left.axhline(peak, color="grey", ls="--", label="datasheet peak")
    left.set_xscale("log", base=2)
    left.set(xlabel="block size (tokens)", ylabel="GB/s", title="decode 16 x 4k")
    left.legend(fontsize=8)
    names = {f"decode {b}x{c}" for b, c in DECODE}
    sweep = [r for r in rows if r["name"] in names]
    labels = [f"{r['batch']}x{r['context'] // 1024}k" for r in sweep]
    x = range(len(sweep))
    right.bar([i - 0.2 for i in x], [r["gbps"] for r in sweep], 0.4, label="paged kernel")
    right.bar([i + 0.2 for i in x], [r["gbps"] / r["time_vs_sdpa"] for r in sweep], 0.4, label="SDPA")
    right.set_xticks(list(x), labels, rotation=60, fontsize=7)
    right.set(ylabel="GB/s", title="decode, batch x context")
    right.legend(fontsize=8)
    fig.suptitle(device, fontsize=9)
    plt.show()


def gpu_sweep_figure() -> None:
    """Chapter 7's GPU cell: measure and plot on a GPU, else show the committed report."""
    if not pagedkv.on_gpu():
        print("These figures need a GPU: on a CPU the kernel runs in Triton's interpreter.")
        report = _committed_report()
        if report is None:
            print("No GPU report is committed yet (python -m pagedkv.bench attention writes one).")
            return
        print(f"Committed report: {report['device']} ({report['summary']})")
        _plot(report["rows"], report["peak_gbps"], report["device"])
        return
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    gpu = gpu_for_device_name(torch.cuda.get_device_name(dev))
    peak = gpu.peak_bandwidth_gbs if gpu else None
    rows = [_uniform(f"decode 16x4096 block {b}", 16, 1, 4096, dev, g, peak, block=b) for b in BLOCK_SIZES]
    rows += [_uniform(f"decode {b}x{c}", b, 1, c, dev, g, peak) for b, c in DECODE if c <= 4096]
    for r in rows:
        pct = f", {r['pct_peak']:.0%} of peak" if r["pct_peak"] else ""
        print(f"{r['name']}: {r['gbps']:,.0f} GB/s{pct}, {r['time_vs_sdpa']:.2f}x SDPA's time")
    _plot(rows, peak, torch.cuda.get_device_name(dev))


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
