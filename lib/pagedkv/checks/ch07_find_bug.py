"""Exercise 7 part 2, "find the bug": a split-KV merge that is right for some requests only.

The notebook builds ``merge_kernel``: program ``i`` merges row ``i`` (one
token, one head) of the library's split partials (``attention_partials``)
into the output. Its planted bug weighs each split by ``exp(lse - max)``
although the library's lse is in base 2: the weights should be ``2 **
(lse - max)``. A row with one non-empty segment is right whatever the base
(its only weight is 1, the empty ones 0), so only the requests long enough
for two segments are wrong.

The reader reports the first wrong request and the first variable holding a
wrong value (``found``) and writes the fixed kernel. What the check grades
``found`` against is computed from the batch and the plan
(``wrong_requests``), never typed in.
"""

from __future__ import annotations

import numpy as np
import torch

from .._device import default_device
from ..kernels.attention import attention_partials, paged_attention_ref
from ..kernels.attention_plan import plan_attention, split_segments
from ._harness import Checker, CheckReport, Mistake, WrongAnswer
from .ch07_split_measure import decode_batch
from .kernel_probes import count_triton_launches, skipped_triton_launches

__all__ = ["merge_case", "wrong_requests", "check_merge_bug", "MERGE_VARIABLES"]

#: What ``found["variable"]`` may name, in the order the kernel computes them.
MERGE_VARIABLES = ("lse", "m", "w", "o", "total")


def merge_case(seq_lens=(40, 200, 7), num_splits: int = 4, num_heads: int = 8, num_kv_heads: int = 2,
               head_dim: int = 32, block_size: int = 16, seed: int = 0, device=None) -> dict:
    """The library's split partials of one decode batch, and the attention they merge into."""
    q, kc, vc, table, lens, qsl = decode_batch(seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed)
    dev = default_device() if device is None else device
    args = [t.to(dev) for t in (q, kc, vc, table, lens, qsl)] + [head_dim ** -0.5]
    partials, lse2 = attention_partials(*args, num_splits=num_splits)
    want = paged_attention_ref(q, kc, vc, table, lens, qsl, head_dim ** -0.5)
    return dict(partials=partials, lse2=lse2, want=want, seq_lens=list(seq_lens), num_splits=num_splits,
                num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)


def wrong_requests(case: dict) -> list[int]:
    """The requests the planted rule gets wrong: those whose keys fill two segments or more."""
    plan = plan_attention(case["num_heads"], case["num_kv_heads"], [1] * len(case["seq_lens"]),
                          case["seq_lens"], case["num_splits"], head_dim=case["head_dim"],
                          dtype=torch.float32)
    return [r for r, n in enumerate(case["seq_lens"])
            if sum(lo < hi for lo, hi in split_segments(n, case["num_splits"], plan.tile_n)) > 1]


RIGHT_REQUEST = Mistake(
    "a request that is right",
    "compare each request's rows with the reference: a request whose keys all fall in one "
    "segment has one weight of 1 and the others 0, whatever the weights' formula")
RIGHT_VARIABLE = Mistake(
    "a variable that holds the right values",
    "in a wrong program print each variable beside what it should be: lse is what the split "
    "kernel stored, m its max; the first that disagrees with its definition is the one to name")
NOT_A_KERNEL = Mistake("not a Triton kernel",
                       "the merge is a kernel: with every Triton launch skipped nothing may remain")


def _located(found, case: dict) -> None:
    if not isinstance(found, dict) or set(found) != {"request", "variable"}:
        raise AssertionError(f'found must be a dict with keys "request" and "variable", got {found!r}')
    req = found["request"]
    if isinstance(req, bool) or not isinstance(req, (int, np.integer)):
        raise AssertionError(f'found["request"] must be an int, got {req!r}')
    wrong = wrong_requests(case)
    if int(req) not in wrong:
        raise WrongAnswer(f"request {req} is merged right", RIGHT_REQUEST.diagnosis())
    if int(req) != wrong[0]:
        raise WrongAnswer(f"request {req} is wrong, but not the first wrong one",
                          "name the wrong request with the smallest index")
    var = found["variable"]
    if var not in MERGE_VARIABLES:
        raise AssertionError(f'found["variable"] must be one of {MERGE_VARIABLES}, got {var!r}')
    if var != "w":
        raise WrongAnswer(f"{var} holds the right values", RIGHT_VARIABLE.diagnosis())


def _cases():
    yield merge_case()
    yield merge_case(seq_lens=(300, 5, 129, 64), num_splits=3, seed=1)
    yield merge_case(seq_lens=(90, 1000), num_splits=8, num_heads=4, num_kv_heads=4, seed=2)


def _close(got, want) -> bool:
    return isinstance(got, torch.Tensor) and got.shape == want.shape and bool(
        torch.allclose(got.cpu().float(), want.float(), atol=1e-4, rtol=1e-4))


def check_merge_bug(found, merge_fixed, timeout: float = 60.0) -> CheckReport:
    """Grade where the planted bug is (``found``) and the fixed merge (``merge_fixed(partials, lse2)``)."""
    with Checker("find the bug: the merge", timeout=timeout) as c:
        if found is None:  # the untouched notebook: one line
            c.probe(_stub)
        c.prop("found: the first wrong request and the first wrong variable",
               lambda: _located(found, merge_case()))

        def fixed():
            for i, case in enumerate(_cases()):
                got = merge_fixed(case["partials"], case["lse2"])
                if not _close(got, case["want"]):
                    rows = (~torch.isclose(got.cpu().float(), case["want"], atol=1e-4, rtol=1e-4)).any(-1)
                    bad = sorted({int(r) for r in rows.nonzero()[:, 0]}) if got.shape == case[
                        "want"].shape else "all"
                    raise WrongAnswer(f"case {i} ({case['num_splits']} splits, seq_lens {case['seq_lens']}):"
                                      f" requests {bad} differ from the attention",
                                      "print lse, m and w in a wrong program and work w out by "
                                      "hand from what lse is")

        c.prop("the fixed merge equals attention (three batches, 3 to 8 splits)", fixed)

        def in_a_kernel():
            case = merge_case(seed=3)
            with count_triton_launches() as n:
                merge_fixed(case["partials"], case["lse2"])
            if n.count == 0:
                raise WrongAnswer("no Triton kernel ran", NOT_A_KERNEL.diagnosis())
            with skipped_triton_launches():
                got = merge_fixed(case["partials"], case["lse2"])
            if _close(got, case["want"]):
                raise WrongAnswer("with every launch skipped it still returned the answer",
                                  NOT_A_KERNEL.diagnosis())

        c.prop("computes in a Triton kernel", in_a_kernel)
    return c.report


def _stub():
    raise NotImplementedError
