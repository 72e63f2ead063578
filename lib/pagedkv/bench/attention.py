"""Paged attention against SDPA on contiguous K/V, and against the GPU's bandwidth.

``python -m pagedkv.bench attention [--json PATH]``

Llama-3-8B's attention shapes (32 query heads, 8 KV heads, head_dim 128),
bf16, blocks of 16 tokens scattered over the pool: decode at batch 1, 16, 64
x context 1k, 4k, 16k, and a prefill of 4 x 2k. For each shape, in the same
run: the kernel's time, the bytes it must move (K/V read once, Q read, O
written) as GB/s and as a share of the device's datasheet peak, and the ratio
to ``torch.nn.functional.scaled_dot_product_attention`` (flash backend where
it accepts the shape) on the same K/V laid out contiguously. Then split-KV on
and off at batch 1 x 16k. On a CPU the kernel runs in Triton's interpreter,
whose speed says nothing about a GPU: the script checks that the paths agree
and reports no timings.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import pagedkv
from pagedkv.bench._cuda_timing import device_ceilings, gbps, time_ms
from pagedkv.bench._report import merge_section
from pagedkv.budget import gpu_for_device_name
from pagedkv.kernels.attention import launch_attention, paged_attention, paged_attention_ref, paginate, plan_attention
from ..common import cdiv

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DECODE = [(b, c) for b in (1, 16, 64) for c in (1024, 4096, 16384)]
PREFILL = (4, 2048)
BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
REPORT = "book/gpu_report.json"  # committed after a GPU run; the book's benchmarks page reads it


def _interpreter_check() -> bool:
    """A mixed batch on small shapes: kernel (split and unsplit) against the reference."""
    g = torch.Generator().manual_seed(0)
    q_lens, ctx = [5, 1, 1], [20, 70, 3]
    keys = [torch.randn(c + n, 2, 32, generator=g) for c, n in zip(ctx, q_lens)]
    values = [torch.randn_like(k) for k in keys]
    kc, vc, table, seq_lens = paginate(keys, values, 16)
    q = torch.randn(sum(q_lens), 8, 32, generator=g)
    qsl = torch.tensor([0, 5, 6, 7], dtype=torch.int32)
    ref = paged_attention_ref(q, kc, vc, table, seq_lens, qsl, 32 ** -0.5)
    return all(torch.allclose(paged_attention(q, kc, vc, table, seq_lens, qsl, 32 ** -0.5, num_splits=s),
                              ref, atol=1e-4) for s in (1, 3))


def _paged_case(batch: int, q_len: int, ctx: int, dev, g, block: int = BLOCK):
    """Q for ``batch`` requests of ``ctx + q_len`` tokens, K/V in shuffled blocks."""
    seq = ctx + q_len
    nblk = cdiv(seq, block)
    num_blocks = batch * nblk
    kc = torch.randn(num_blocks, block, KV_HEADS, HEAD_DIM, device=dev, generator=g, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(num_blocks, device=dev, generator=g).to(torch.int32).view(batch, nblk)
    q = torch.randn(batch * q_len, HEADS, HEAD_DIM, device=dev, generator=g, dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), seq, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=dev)
    return q, kc, vc, table, seq_lens, qsl


def _sdpa(q, kc, vc, table, batch, q_len, seq):
    """SDPA on the same K/V gathered into contiguous [batch, heads, seq, dim]; returns (fn, backend)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

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


def _measure(name, batch, q_len, ctx, dev, g, peak, splits=None, block=BLOCK):
    seq = ctx + q_len
    q, kc, vc, table, seq_lens, qsl = _paged_case(batch, q_len, ctx, dev, g, block)
    scale = HEAD_DIM ** -0.5
    plan = plan_attention(HEADS, KV_HEADS, [q_len] * batch, [seq] * batch, splits)
    out = torch.empty_like(q)
    ref = paged_attention_ref(q, kc, vc, table, seq_lens, qsl, scale) if batch * seq <= 65536 else None
    got = paged_attention(q, kc, vc, table, seq_lens, qsl, scale, num_splits=plan.num_splits)
    if ref is not None:
        err = (got.float() - ref.float()).abs().max().item()
        assert err < 3e-2, f"{name}: kernel differs from reference by {err}"
    ms = time_ms(lambda: launch_attention(q, kc, vc, table, seq_lens, qsl, scale, plan, out))
    sdpa_fn, backend = _sdpa(q, kc, vc, table, batch, q_len, seq)
    ms_sdpa = time_ms(sdpa_fn)
    nbytes = 2 * batch * seq * KV_HEADS * HEAD_DIM * 2 + 2 * q.numel() * 2  # K+V once, Q in, O out
    flops = 4 * batch * HEADS * HEAD_DIM * q_len * (seq - (q_len - 1) / 2)  # QK^T and PV, causal
    row = dict(name=name, batch=batch, q_len=q_len, context=ctx, block_size=block, num_splits=plan.num_splits,
               kernel_ms=ms, sdpa_ms=ms_sdpa, sdpa_backend=backend, gbps=gbps(nbytes, ms),
               tflops=flops / (ms * 1e-3) / 1e12, time_vs_sdpa=ms / ms_sdpa)
    row["pct_peak"] = row["gbps"] / peak if peak else None
    return row


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
    rows = [_measure(f"decode {b}x{c}", b, 1, c, dev, g, peak) for b, c in DECODE]
    rows.append(_measure(f"prefill {PREFILL[0]}x{PREFILL[1]}", PREFILL[0], PREFILL[1], 0, dev, g, peak))
    print(f"{'shape':<18}{'splits':>7}{'kernel us':>11}{'GB/s':>9}{'% peak':>8}{'TFLOP/s':>9}"
          f"{'SDPA us':>10}{'kernel/SDPA':>12}  SDPA backend")
    for r in rows:
        pct = f"{r['pct_peak']:.0%}" if r["pct_peak"] is not None else "-"
        print(f"{r['name']:<18}{r['num_splits']:>7}{r['kernel_ms'] * 1e3:>11.1f}{r['gbps']:>9,.0f}{pct:>8}"
              f"{r['tflops']:>9.1f}{r['sdpa_ms'] * 1e3:>10.1f}{r['time_vs_sdpa']:>11.2f}x  {r['sdpa_backend']}")

    blocks = [_measure(f"decode 16x4096 block {b}", 16, 1, 4096, dev, g, peak, block=b) for b in BLOCK_SIZES]
    print("decode 16x4096 by block size: " + ", ".join(
        f"{r['block_size']}: {r['gbps']:,.0f} GB/s" for r in blocks))

    one = _measure("decode 1x16384 unsplit", 1, 1, 16384, dev, g, peak, splits=1)
    split = _measure("decode 1x16384 split", 1, 1, 16384, dev, g, peak)
    speedup = one["kernel_ms"] / split["kernel_ms"]
    print(f"split-KV at batch 1 x 16k: {one['kernel_ms'] * 1e3:.1f} us unsplit, "
          f"{split['kernel_ms'] * 1e3:.1f} us with {split['num_splits']} splits: {speedup:.2f}x")

    target = next(r for r in rows if r["name"] == "decode 64x4096")
    print("targets: decode 64x4k >= 70% of peak: "
          + (f"{target['pct_peak']:.0%}" if target["pct_peak"] is not None else "no datasheet peak")
          + f"; <= 1.25x SDPA's time: {target['time_vs_sdpa']:.2f}x; split-KV >= 2x: {speedup:.2f}x")
    report = dict(device=torch.cuda.get_device_name(dev), summary=pagedkv.device_summary(),
                  copy_ceiling_gbps=copy_gbps, peak_gbps=peak, rows=rows + blocks + [one, split],
                  split_speedup=speedup)
    if args.json:
        merge_section(args.json, "attention", report)
        print(f"figures written to {args.json}")
    return 0


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
    rows = [_measure(f"decode 16x4096 block {b}", 16, 1, 4096, dev, g, peak, block=b) for b in BLOCK_SIZES]
    rows += [_measure(f"decode {b}x{c}", b, 1, c, dev, g, peak) for b, c in DECODE if c <= 4096]
    for r in rows:
        pct = f", {r['pct_peak']:.0%} of peak" if r["pct_peak"] else ""
        print(f"{r['name']}: {r['gbps']:,.0f} GB/s{pct}, {r['time_vs_sdpa']:.2f}x SDPA's time")
    _plot(rows, peak, torch.cuda.get_device_name(dev))


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
