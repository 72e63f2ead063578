"""Compiles for the tests of the compile check, run in a subprocess: ``python _compile_cases.py NAME``.

A process that ran Triton's interpreter cannot compile for a GPU (``tl.max``
and the other library functions were decorated for the interpreter when
``triton.language`` was imported), so the tests, which share pytest's process
with the interpreter tests, compile here. Prints one JSON line: rows and failures.
"""

from __future__ import annotations

import json
import sys

import compile_check as cc  # imports triton before pagedkv can select the interpreter
import torch
import triton
import triton.language as tl

from pagedkv.kernels import attention as attn


@triton.jit
def _arange_of_three(out_ptr, N: tl.constexpr):
    # tl.arange needs a power of two: this kernel cannot compile.
    tl.store(out_ptr + tl.arange(0, N), 1.0)


def _oversized_attention() -> cc.Case:
    """fp32 prefill at head_dim 256 with tiles far too wide for an A100's shared memory."""
    plan = attn.AttentionPlan(block_m=64, block_q=16, tile_n=128, num_splits=1,
                              grid=(1, 1, 1), num_warps=8, num_stages=3,
                              work=torch.zeros((1, 2), dtype=torch.int32))
    meta, i32 = cc._meta, torch.int32
    q = meta(64, 32, 256, dtype=torch.float32)
    cache = meta(1, 16, 8, 256, dtype=torch.float32)
    (kernel, _, args, kwargs), = attn.kernel_launches(plan, q, cache, cache, meta(4, 129, dtype=i32),
                                                      meta(4, dtype=i32), meta(5, dtype=i32), 0.06, q,
                                                      interpreted=False)
    info = dict(attention=True, kind="prefill", dtype="fp32", head_dim=256,
                tiles=dict(block_m=64, tile_n=128, num_warps=8, num_stages=3, num_splits=1))
    return cc.Case("injected fp32 d256 128-key tiles", kernel, args, kwargs, info)


def _attention_case(kind="decode", **plan_changes) -> cc.Case:
    """The committed bf16 d128 b16 row of ``kind``, its plan changed as given (an injected regression)."""
    case = next(c for c in cc.all_cases(quick=True) if c.name == f"{kind} {'64 x 4k' if kind == 'decode' else '4 x 2k'} bf16 d128 b16")
    tiles = dict(case.info["tiles"], **plan_changes)
    kwargs = dict(case.kwargs, num_stages=tiles["num_stages"], num_warps=tiles["num_warps"], BLOCK_M=tiles["block_m"],
                  BLOCK_Q=tiles["block_m"] // 4)
    return cc.Case(f"injected {kind} {plan_changes}", case.kernel, case.args, kwargs, dict(case.info, tiles=tiles))


def _unaligned_decode() -> cc.Case:
    case = _attention_case()
    cache = torch.empty(1 * 16 * 8 * 128 + 1, dtype=torch.bfloat16)[1:].view(1, 16, 8, 128)  # 2 B off
    args = list(case.args)
    args[1] = args[2] = cache
    return cc.Case("injected unaligned caches", case.kernel, tuple(args), case.kwargs, case.info)


def _copy_aligned_and_not():
    case = next(c for c in cc.library_cases() if c.name == "copy_blocks 2-byte b16")
    return [case, cc.Case("unaligned", case.kernel, case.args, dict(case.kwargs, ALIGNED=False))]


def main(name: str) -> dict:
    if name == "overflow":
        rows, failures = cc.run_cases([_oversized_attention()], targets=("sm_80",))
    elif name == "compile_error":
        case = cc.Case("injected arange of 3", _arange_of_three, (cc._meta(4, dtype=torch.float32),), dict(N=3))
        rows, failures = cc.run_cases([case], targets=("sm_90",))
    elif name == "decode":
        cases = [c for c in cc.all_cases(quick=True) if c.name == "decode 64 x 4k bf16 d128 b16"]
        rows, failures = cc.run_cases(cases)
        failures += cc.stale_rows(rows, json.loads(cc.REPORT_JSON.read_text()))
    elif name == "notebooks":
        try:
            cases = cc.notebook_cases()
        except Exception as exc:  # a cell that does not decorate in compiled mode, or has no arguments
            return dict(rows=[], failures=[f"{type(exc).__name__}: {exc}"], triton=triton.__version__)
        rows, failures = cc.run_cases(cases, targets=("sm_90",))
    elif name == "narrow_copies":
        rows, failures = cc.run_cases([_unaligned_decode()], targets=("sm_90",))
    elif name == "one_buffer":
        rows, failures = cc.run_cases([_attention_case(num_stages=1)], targets=("sm_90",))
    elif name == "replicated":
        rows, failures = cc.run_cases([_attention_case("prefill", block_m=64)])
    elif name == "sliding":
        rows, failures = cc.run_cases(cc.sliding_window_cases())
    elif name == "copy":
        rows, failures = cc.run_cases(_copy_aligned_and_not(), targets=("sm_90",))
    else:
        raise SystemExit(f"unknown case set {name!r}")
    return dict(rows=rows, failures=failures, triton=triton.__version__)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
