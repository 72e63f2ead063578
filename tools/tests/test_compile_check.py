"""The compile check fails where it must, and its committed report is the page's and the compiler's.

Each test compiles one or two kernels for sm_90/sm_80 (no GPU: the bundled
ptxas), about a second each.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import compile_check as cc  # noqa: E402
from pagedkv.bench import _report  # noqa: E402
from pagedkv.kernels import attention as attn  # noqa: E402


@triton.jit
def _arange_of_three(out_ptr, N: tl.constexpr):
    # tl.arange needs a power of two: this kernel cannot compile.
    tl.store(out_ptr + tl.arange(0, N), 1.0)


def _oversized_attention() -> cc.Case:
    """fp32 prefill at head_dim 256 with tiles far too wide for an A100's shared memory."""
    plan = attn.AttentionPlan(block_m=64, block_q=16, tile_n=128, num_q_tiles=1, num_splits=1,
                              grid=(1, 1, 1), num_warps=8, num_stages=3)
    meta = cc._meta
    q = meta(64, 32, 256, dtype=torch.float32)
    cache = meta(1, 16, 8, 256, dtype=torch.float32)
    i32 = torch.int32
    (kernel, _, args, kwargs), = attn.kernel_launches(plan, q, cache, cache, meta(4, 129, dtype=i32),
                                                      meta(4, dtype=i32), meta(5, dtype=i32), 0.06, q,
                                                      interpreted=False)
    info = dict(attention=True, kernel="_paged_attention_kernel", kind="prefill", dtype="fp32", head_dim=256,
                tiles=dict(block_m=64, tile_n=128, num_warps=8, num_stages=3, num_splits=1))
    return cc.Case("injected fp32 d256 128-key tiles", kernel, args, kwargs, info)


def test_an_injected_shared_memory_overflow_fails_on_sm80():
    rows, failures = cc.run_cases([_oversized_attention()], targets=("sm_80",))
    shared = rows[0]["sm_80"]["shared"]
    assert shared > attn.SM_LIMITS[80].shared_per_block
    assert any("shared memory, over sm_80" in f for f in failures), failures
    assert rows[0]["sm_80"]["resident"] == 0  # it could not launch at all


def test_an_injected_compile_error_fails():
    case = cc.Case("injected arange of 3", _arange_of_three, (cc._meta(4, dtype=torch.float32),), dict(N=3))
    rows, failures = cc.run_cases([case], targets=("sm_90",))
    assert len(failures) == 1 and "does not compile" in failures[0] and "sm_90" in failures[0]
    assert "sm_90" not in rows[0]


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
    gpu = ROOT / _report.REPORT_JSON
    page = _report.render(json.loads(gpu.read_text()) if gpu.exists() else None, _committed())
    assert (ROOT / _report.PAGE_MD).read_text() == page, "run `make test-compile` to refresh the page"
    assert "## Compiled kernels" in page


def test_the_committed_report_is_what_the_compiler_gives_now():
    committed = _committed()
    if committed["triton"] != triton.__version__:
        pytest.skip(f"report from triton {committed['triton']}, this is {triton.__version__}")
    cases = [c for c in cc.all_cases(quick=True) if c.name == "decode 64 x 4k bf16 d128 b16"]
    rows, failures = cc.run_cases(cases)
    assert failures == [] and cc.stale_rows(rows, committed) == []
    # The decode loop overlaps its loads: at least two K/V buffers on both targets.
    assert all(rows[0][t]["kv_buffers"] >= 2 for t in cc.TARGETS)


def test_copy_blocks_moves_16_bytes_per_load_when_aligned():
    cases = [c for c in cc.library_cases() if c.name == "copy_blocks 2-byte b16"]
    unaligned = cc.Case("unaligned", cases[0].kernel, cases[0].args, dict(cases[0].kwargs, ALIGNED=False))
    rows, failures = cc.run_cases(cases + [unaligned], targets=("sm_90",))
    assert failures == []
    assert rows[0]["sm_90"]["vec16_loads"] > 0  # one ld.global.v4.b32 per 8 elements
    assert rows[1]["sm_90"]["vec16_loads"] == 0  # without the launcher's alignment check: 2-byte loads
    rows = {r["name"]: r for r in _committed()["rows"]}
    assert all(rows[f"copy_blocks {e}-byte b16"]["sm_90"]["vec16_loads"] > 0 for e in (1, 2, 4, 8))
