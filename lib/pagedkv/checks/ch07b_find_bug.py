"""Exercise 7 part 1, "find the bug": a sliding-window gather that is wrong in some programs.

The notebook builds ``window_gather_kernel``: program ``r`` copies the K rows
of request ``r``'s last ``min(window, seq_len)`` positions, read through its
block-table row, into ``out[r, :n]`` (zeros after). Its planted bug takes a
row's offset inside its block from the row's place in the *window* rather
than from its *position*: ``(pos - first) % block_size`` for ``pos %
block_size``. The two agree exactly when the window starts on a block
border (``first % block_size == 0``, which includes every request no longer
than the window), so only some programs are wrong.

The reader reports where (``found``: the program, the first wrong position,
the first wrong variable) and writes the fixed kernel. Everything this
module grades against is computed from that rule and the notebook's case,
never typed in: ``planted_diagnosis`` derives the programs and positions.

``interpreted(kernel)`` gives an interpreted copy of any ``@triton.jit``
kernel, on any machine (CPU tensors): what the notebook steps through.
"""

from __future__ import annotations

import numpy as np
import torch

from .._device import default_device
from ..common import cdiv
from ._harness import Checker, CheckReport, Mistake, WrongAnswer
from .interpreter_probes import bounded_accesses
from .kernel_probes import count_triton_launches, interpreted_kernel, skipped_triton_launches

__all__ = ["interpreted", "window_case", "reference_window_gather", "planted_diagnosis",
           "check_window_bug", "VARIABLES"]

#: What ``found["variable"]`` may name, in the order the kernel computes them.
VARIABLES = ("first", "pos", "column", "block", "slot")


def interpreted(kernel):
    """An interpreted copy of a ``@triton.jit`` kernel, on any machine: see ``interpreted_kernel``."""
    return interpreted_kernel(kernel)


def window_case(seed: int = 0, lens=(5, 12, 14), block_size: int = 4, row: int = 4,
                window: int = 8, device=None) -> dict:
    """A paged K cache (one head, rows of ``row`` values) and a scattered table.

    Slots past a request's ``seq_len`` in its last block hold NaN, and the
    table's columns past its last block hold an id past the pool (never to
    be loaded).
    """
    g = torch.Generator().manual_seed(seed)
    need = [cdiv(n, block_size) for n in lens]
    num_blocks = sum(need) + 3
    ids = torch.randperm(num_blocks, generator=g)[: sum(need)].tolist()
    width = max(need) + 1
    table = torch.full((len(lens), width), num_blocks + 7, dtype=torch.int32)
    cache = torch.randn(num_blocks, block_size, row, generator=g)
    k = 0
    for r, (n, b) in enumerate(zip(lens, need)):
        table[r, :b] = torch.tensor(ids[k:k + b], dtype=torch.int32)
        last = ids[k + b - 1]
        cache[last, n - (b - 1) * block_size:] = float("nan")
        k += b
    dev = default_device() if device is None else device
    return dict(key_cache=cache.to(dev), block_table=table.to(dev),
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), window=window)


def reference_window_gather(key_cache, block_table, seq_lens, window):
    """``out[r, j]``: the K row of position ``max(seq_len - window, 0) + j``, zeros past the sequence."""
    block_size, row = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(len(seq_lens), window, row, dtype=key_cache.dtype)
    for r, n in enumerate(seq_lens.tolist()):
        first = max(n - window, 0)
        for j, pos in enumerate(range(first, n)):
            block = int(block_table[r, pos // block_size])
            out[r, j] = key_cache[block, pos % block_size].cpu()
    return out


def planted_diagnosis(case: dict) -> dict:
    """Where the planted rule goes wrong on ``case``: ``{program: first wrong position}``.

    A row is wrong where the window's offset and the position's differ.
    """
    bs, w = case["key_cache"].shape[1], case["window"]
    wrong = {}
    for r, n in enumerate(case["seq_lens"].tolist()):
        first = max(n - w, 0)
        bad = [pos for pos in range(first, n) if (pos - first) % bs != pos % bs]
        if bad:
            wrong[r] = bad[0]
    return wrong


WRONG_PROGRAM = Mistake(
    "a program that is right",
    "compare each program's rows with the reference: a program whose window starts on a "
    "block border (or that is no longer than the window) gets every row right")
WRONG_VARIABLE = Mistake(
    "a variable that holds the right values",
    "print the candidates in the wrong program beside what they should be: pos and "
    "column follow from seq_len, block is the table entry at column; the first that "
    "disagrees is the one to name")
NOT_A_KERNEL = Mistake(
    "not a Triton kernel",
    "the fix is a kernel: with every Triton launch skipped the output must be nothing your "
    "wrapper computed")


def _as_int(x, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise AssertionError(f"{what} must be an int, got {type(x).__name__} {x!r}")
    return int(x)


def _located(found, case: dict) -> None:
    if not isinstance(found, dict) or set(found) != {"program", "first_wrong_position", "variable"}:
        raise AssertionError('found must be a dict with keys "program", "first_wrong_position" and '
                             f'"variable", got {found!r}')
    wrong = planted_diagnosis(case)
    program = _as_int(found["program"], 'found["program"]')
    if program not in wrong:
        lens = case["seq_lens"].tolist()
        raise WrongAnswer(f"program {program} (seq_len {lens[program] if 0 <= program < len(lens) else '?'})"
                          f" gathers every row right", WRONG_PROGRAM.diagnosis())
    pos = _as_int(found["first_wrong_position"], 'found["first_wrong_position"]')
    first = max(case["seq_lens"].tolist()[program] - case["window"], 0)
    if pos != wrong[program]:
        hint = (" (that is a row index j; the position is first + j)" if pos == wrong[program] - first
                else "")
        raise WrongAnswer(f"program {program}'s first wrong row is not at position {pos}{hint}",
                          "print pos and the row gathered beside the reference's, row by row")
    var = found["variable"]
    if var not in VARIABLES:
        raise AssertionError(f'found["variable"] must be one of {VARIABLES}, got {var!r}')
    if var != "slot":
        raise WrongAnswer(f"{var} holds the right values in program {program}", WRONG_VARIABLE.diagnosis())


def _fixed_cases(seed: int):
    yield window_case(seed)  # the notebook's case
    yield window_case(seed + 1, lens=(3, 17, 30, 9), block_size=4, row=8, window=8)
    yield window_case(seed + 2, lens=(1, 7, 16, 33), block_size=1, row=4, window=8)
    yield window_case(seed + 3, lens=(40, 21), block_size=16, row=4, window=16)


def _run_fix(gather, case: dict):
    with bounded_accesses({k: v for k, v in case.items() if isinstance(v, torch.Tensor)}) as bounds, \
            np.errstate(all="ignore"):
        try:
            return gather(case["key_cache"], case["block_table"], case["seq_lens"], case["window"])
        except Exception as exc:  # noqa: BLE001 -- a stray lane is named; anything else is the reader's
            if bounds.violation is None:
                raise
            raise WrongAnswer(bounds.violation, "every load is masked by pos < seq_len, the table's "
                              "too: a column past the last block holds an id past the pool") from exc


def _stub():
    raise NotImplementedError


def check_window_bug(found, window_gather_fixed, seed: int = 0, timeout: float = 60.0) -> CheckReport:
    """Grade where the planted bug is (``found``) and the fixed gather (a wrapper launching a kernel)."""
    with Checker("find the bug: the window gather", timeout=timeout) as c:
        if found is None:  # the untouched notebook: one line
            c.probe(_stub)
        c.prop("found: the program, the first wrong position, the variable",
               lambda: _located(found, window_case(seed, device="cpu")))

        def fixed():
            for i, case in enumerate(_fixed_cases(seed)):
                got = _run_fix(window_gather_fixed, case)
                want = reference_window_gather(**case)
                if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
                    raise AssertionError(f"case {i}: expected a tensor shaped {tuple(want.shape)}, got "
                                         f"{getattr(got, 'shape', type(got).__name__)}")
                bad = ~torch.isclose(got.cpu().float(), want, atol=0, rtol=0).all(-1)
                if bad.any():
                    r, j = (int(x) for x in bad.nonzero()[0])
                    n = int(case["seq_lens"][r])
                    raise WrongAnswer(f"case {i} (block size {case['key_cache'].shape[1]}, window "
                                      f"{case['window']}): program {r} (seq_len {n}), row {j} "
                                      f"(position {max(n - case['window'], 0) + j}) differs",
                                      "print pos, block and slot in that program under the "
                                      "interpreter beside what the table says")

        c.prop("the fixed gather equals the reference (four cases, block sizes 1 to 16)", fixed)

        def in_a_kernel():
            case = window_case(seed + 5)
            with count_triton_launches() as n:
                window_gather_fixed(case["key_cache"], case["block_table"], case["seq_lens"], case["window"])
            if n.count == 0:
                raise WrongAnswer("no Triton kernel ran", NOT_A_KERNEL.diagnosis())
            with skipped_triton_launches():
                got = window_gather_fixed(case["key_cache"], case["block_table"], case["seq_lens"],
                                          case["window"])
            if isinstance(got, torch.Tensor) and torch.equal(got.cpu(), reference_window_gather(**case)):
                raise WrongAnswer("with every launch skipped it still returned the answer",
                                  NOT_A_KERNEL.diagnosis())

        c.prop("computes in a Triton kernel", in_a_kernel)
    return c.report
