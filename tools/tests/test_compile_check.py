"""The compile check fails where it must, and its committed report is the page's and the compiler's.

Compiles run in a subprocess (``_compile_cases.py``): this process runs
Triton's interpreter for the other tests, and a process that did cannot
compile for a GPU. Each compiles one or two kernels for sm_90/sm_80 with the
bundled ptxas (no GPU), a few seconds each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pagedkv  # noqa: F401  (first: this process runs the interpreter, see lib/tests/conftest.py)
import pytest
import triton

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import compile_check as cc  # noqa: E402  (no compiling in this process)
from pagedkv.bench import _report  # noqa: E402
from pagedkv.kernels import attention as attn  # noqa: E402


def _compile(name: str) -> dict:
    """Run one case set of _compile_cases.py in a fresh process without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tools"), str(ROOT / "lib"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("_compile_cases.py")), name],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_an_injected_shared_memory_overflow_fails_on_sm80():
    got = _compile("overflow")
    fig = got["rows"][0]["sm_80"]
    assert fig["shared"] > attn.SM_LIMITS[80].shared_per_block
    assert any("shared memory, over sm_80" in f for f in got["failures"]), got["failures"]
    assert fig["resident"] == 0  # it could not launch at all


def test_an_injected_compile_error_fails():
    got = _compile("compile_error")
    assert len(got["failures"]) == 1, got["failures"]
    assert "does not compile" in got["failures"][0] and "sm_90" in got["failures"][0]
    assert "sm_90" not in got["rows"][0]


def test_a_spill_fails_only_for_two_byte_attention_up_to_head_dim_128():
    case = cc.Case("c", None, (), {}, dict(attention=True, dtype="bf16", head_dim=128))
    fig = dict(regs=200, spills=8, shared=1000)
    assert cc.violations(case, "sm_90", fig) == ["c [sm_90]: 8 B of spills (bf16/fp16 attention at "
                                                 "head_dim <= 128 may not spill)"]
    case.info["dtype"] = "fp32"
    assert cc.violations(case, "sm_90", fig) == []
    assert cc.violations(case, "sm_90", dict(fig, regs=256))  # over 255 registers fails for any case


def test_resident_programs_takes_the_tightest_limit():
    a100 = attn.SM_LIMITS[80]
    assert attn.resident_programs(128, 0, 4, a100) == 4  # 128 regs x 128 threads: registers bind
    assert attn.resident_programs(32, 40_000, 4, a100) == 4  # 167,936 // 41,024: shared memory binds
    assert attn.resident_programs(16, 0, 1, a100) == 32  # the 32-program limit
    assert attn.resident_programs(32, a100.shared_per_block + 1, 4, a100) == 0


def _committed():
    return json.loads((ROOT / "book" / "compile_report.json").read_text())


def test_the_page_shows_the_committed_compile_report():
    gpu, cpu = ROOT / _report.REPORT_JSON, ROOT / _report.CPU_JSON
    model = ROOT / _report.PERF_MODEL_JSON
    page = _report.render(json.loads(gpu.read_text()) if gpu.exists() else None, _committed(),
                          json.loads(cpu.read_text()) if cpu.exists() else None,
                          json.loads(model.read_text()) if model.exists() else None)
    assert (ROOT / _report.PAGE_MD).read_text() == page, "run `make test-compile` to refresh the page"
    assert "## Compiled kernels" in page


def test_the_committed_report_is_what_the_compiler_gives_now():
    committed = _committed()
    if committed["triton"] != triton.__version__:
        pytest.skip(f"report from triton {committed['triton']}, this is {triton.__version__}")
    got = _compile("decode")
    assert got["failures"] == []  # within the limits, and equal to the committed row
    # The decode loop overlaps its loads: at least two K/V buffers on both targets.
    assert all(got["rows"][0][t]["kv_buffers"] >= 2 for t in cc.TARGETS)


def test_every_notebook_kernel_decorates_and_compiles_for_sm90():
    # run-plain's way of running a cell, with Triton in compiled mode as on a GPU:
    # "@jit functions should be defined in a Python file" unless the cell's
    # source is registered under its own file name.
    got = _compile("notebooks")
    assert got["failures"] == []
    defining = {f"{p.parent.name}/{p.name}" for d in ("chapters", "exercises", "solutions")
                for p in sorted((ROOT / d).glob("*.ipynb"))
                if any(c["cell_type"] == "code" and "@triton.jit" in "".join(c["source"])
                       for c in json.loads(p.read_text())["cells"])}
    assert defining and {r["notebook"] for r in got["rows"]} == defining
    assert all(r["sm_90"]["regs"] > 0 for r in got["rows"])


def test_copy_blocks_moves_16_bytes_per_load_when_aligned():
    got = _compile("copy")
    assert got["failures"] == []
    aligned, unaligned = (r["sm_90"] for r in got["rows"])
    assert aligned["vec16_loads"] > 0  # one ld.global.v4.b32 per 8 elements
    assert unaligned["vec16_loads"] == 0  # without the launcher's alignment check: 2-byte loads
    rows = {r["name"]: r for r in _committed()["rows"]}
    assert all(rows[f"copy_blocks {e}-byte b16"]["sm_90"]["vec16_loads"] > 0 for e in (1, 2, 4, 8))


def test_split_kv_fills_the_resident_capacity_not_the_sm_count():
    # 17 decode requests x 8 KV heads = 136 programs: more than an H200's 132
    # SMs, but under its 3 x 132 resident programs, so the keys are split, into
    # as many segments as fit one wave: 2 x 136 = 272 <= 396 (3 would be 408).
    assert attn.choose_splits(136, 4096, 64, capacity=3 * 132) == 2
    assert all(attn.choose_splits(p, 32768, 32, 6 * 132) * p <= 6 * 132 for p in range(1, 6 * 132))
    assert attn.choose_splits(3 * 132, 4096, 64, capacity=3 * 132) == 1  # already full
    assert attn.choose_splits(8, 1024, 64, capacity=3 * 132) == 1  # short sequences never split
    assert attn.choose_splits(8, 16384, 64, capacity=4 * 132) == 64  # capped at 64 segments
    rule = attn.split_rule(3, 132)
    assert "resident" in rule and "3 programs per SM x 132 SMs = 396" in rule


# ------------------------------------------------------------------ structure, injected regressions

def test_the_committed_attention_rows_pass_the_structure_checks():
    for row in _committed()["rows"]:
        if row.get("kind") not in ("decode", "prefill", "split"):
            continue
        for t in cc.TARGETS:
            fig = row[t]
            assert fig["cp_async16"] > 0 and fig["cp_async_narrow"] == 0, (row["name"], t)
            assert fig["mma_rows"] <= row["tiles"]["block_m"], (row["name"], t)
            assert fig["loop_sass"] > 0, (row["name"], t)
            if row["kind"] != "prefill" and row["dtype"] != "fp32":
                assert fig["kv_buffers"] >= 2, (row["name"], t)


def test_an_injected_unaligned_cache_fails_on_narrow_copies():
    # The same decode launch with the caches one element off a 16-byte boundary:
    # Triton can no longer prove alignment: no 16-byte cp.async is left (a 2-byte
    # piece cannot be a cp.async at all, so K/V go through plain loads).
    got = _compile("narrow_copies")
    fig = got["rows"][0]["sm_90"]
    assert fig["cp_async16"] == 0 or fig["cp_async_narrow"] > 0
    assert any("K/V copies are not all 16 bytes" in f for f in got["failures"]), got["failures"]


def test_an_injected_single_buffer_decode_fails():
    got = _compile("one_buffer")  # decode at num_stages=1: nothing loads ahead
    assert got["rows"][0]["sm_90"]["kv_buffers"] < 2
    assert any("K/V buffer(s) in the decode loop" in f for f in got["failures"]), got["failures"]


def test_an_injected_replicated_mma_layout_fails_on_sm90_only():
    # The old prefill tile: 64 rows with 8 warps. sm_90's wgmma layout puts the
    # 8 warps along the rows, 128 of them, so the tile is computed twice.
    got = _compile("replicated")
    row = got["rows"][0]
    assert row["sm_90"]["mma_rows"] == 128 and row["sm_80"]["mma_rows"] <= 64
    assert [f for f in got["failures"] if "replicated MMA layout" in f] == [
        f for f in got["failures"] if "sm_90" in f and "replicated" in f]
    assert any("replicated MMA layout: it covers 128 rows of a 64-row tile" in f and "[sm_90]" in f
               for f in got["failures"]), got["failures"]
    assert not any("[sm_80]" in f for f in got["failures"]), got["failures"]


def test_the_sliding_window_variant_compiles_within_the_rules():
    """The kernel with SLIDING (a sliding-window layer's launch) keeps the full one's structure.

    Not in the committed report: it is compiled here, for both targets, and
    held to the same rules (no spill, 16-byte copies, two K/V buffers in the
    decode and split loops, no replicated MMA layout).
    """
    got = _compile("sliding")
    assert got["failures"] == []
    assert [r["name"] for r in got["rows"]] == [f"{k} bf16 d128 b16 window 1024" for k in
                                                ("decode 64 x 4k", "prefill 4 x 2k", "split 1 x 16k")]
    full = {r["name"]: r for r in _committed()["rows"]}
    for row in got["rows"]:
        for t in cc.TARGETS:
            assert row[t]["loop_sass"] > 0 and row[t]["cp_async16"] > 0, (row["name"], t)
            # the window adds a compare to the loop's mask: another kernel than the committed full one
            if got["triton"] == _committed()["triton"]:
                assert row[t]["loop_sass"] != full[row["name"].removesuffix(" window 1024")][t]["loop_sass"]


def test_interpreter_only_kernels_are_launched_only_through_the_interpreter():
    """A kernel the compile check skips must never be launched compiled by a notebook."""
    import json
    import re

    from tools.notebooks import NOTEBOOK_DIRS

    seen = set()
    for path in sorted(p for d in NOTEBOOK_DIRS for p in (cc.ROOT / d).glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            src = "".join(cell["source"])
            for name in cc.INTERPRETER_ONLY:
                for m in re.finditer(rf"\b{name}\b(?!\s*\()", src):
                    line = src[src.rfind("\n", 0, m.start()) + 1:src.find("\n", m.end())]
                    if line.lstrip().startswith("def ") or "interpreted(" in line:
                        seen.add(name)
                        continue
                    raise AssertionError(f"{path.name}: {name} used outside interpreted(): {line!r}")
    assert seen == cc.INTERPRETER_ONLY
