"""Exercise 5's Model Runner V2 tasks: the step's gathered table, and its slot mapping.

* ``gather_block_tables(block_table, num_blocks, idx_mapping, num_reqs_padded)``
  in PyTorch (``check_gather_block_tables``) and, optionally, as a Triton
  kernel behind the same signature (``check_gather_kernel``): row ``i`` of the
  ``[num_reqs_padded, width]`` int32 result is row ``idx_mapping[i]`` of the
  per-request table up to its ``num_blocks``, zeros past it, and rows past
  ``len(idx_mapping)`` are zeros; a row out of range or named twice is refused
  with a ``ValueError`` naming the row. As ``pagedkv.kernels.gather_block_tables``
  (vLLM 0.33.0's ``BlockTables.gather_block_tables``, ``v1/worker/gpu/block_table.py:160-211``).
* ``slot_mapping_gathered(input_block_table, query_start_loc, positions, block_size)``
  (``check_gathered_slot_mapping``): batch entry ``i`` owns tokens
  ``query_start_loc[i]:query_start_loc[i+1]``, and token ``t`` of entry ``i``
  goes to ``input_block_table[i, p // B] * B + p % B``, int64.

Each is compared on seeded random cases with the library
(``gather_block_tables_ref``, ``compute_slot_mapping_ref``) and with oracles
written here; a wrong answer is compared with models of the common mistakes
(gathered by batch position or in table order, a stale tail copied, padding
rows missing, row -1 read as the last row, a repeated row gathered twice; one
row per token, a token at an entry's start given to the entry before, off by
one at a block boundary, the position used as the offset, and the slot
formula's mistakes). A function that runs the library's gather or slot
mapping is told that the task is to write it.
"""

from __future__ import annotations

import numpy as np
import torch

from .._device import default_device
from ..block_tables import BlockTables
from ..kernels.gather_block_tables import (check_idx_mapping, gather_block_tables, gather_block_tables_ref,
                                           launch_gather_block_tables)
from ..kernels.slot_mapping import compute_slot_mapping, compute_slot_mapping_ref, launch_slot_mapping
from ._harness import Checker, CheckReport, Mistake, WrongAnswer, catalogue, name_mistake
from .kernel_probes import count_triton_launches, guarded_rows, skipped_triton_launches
from .slot_mistakes import SLOT_MISTAKES, diagnose_slots

__all__ = ["check_gather_block_tables", "check_gather_kernel", "check_gathered_slot_mapping"]

LIBRARY_GATHER = {
    "gather_block_tables": gather_block_tables,
    "gather_block_tables_ref": gather_block_tables_ref,
    "launch_gather_block_tables": launch_gather_block_tables,
    "check_idx_mapping": check_idx_mapping,
    "BlockTables.gather_block_tables": BlockTables.gather_block_tables,
}
LIBRARY_SLOTS = {
    "compute_slot_mapping": compute_slot_mapping,
    "compute_slot_mapping_ref": compute_slot_mapping_ref,
    "launch_slot_mapping": launch_slot_mapping,
    "BlockTables.compute_slot_mappings": BlockTables.compute_slot_mappings,
}


# ================================================================ the gather
def gather_oracle(table, num_blocks, idx, padded, *, rows="idx", mask=True, pad=True):
    """The gathered rows as lists, under vLLM's rule or one changed piece of it."""
    t, n = table.tolist(), num_blocks.tolist()
    idx = [int(r) for r in idx]
    if rows == "positions":
        idx = list(range(len(idx)))
    elif rows == "sorted":
        idx = sorted(idx)
    width = len(t[0])
    out = [[t[r][c] if (c < n[r] or not mask) else 0 for c in range(width)] for r in idx]
    return out + [[0] * width for _ in range(padded - len(idx))] if pad else out


def _as_model(**rule):
    return lambda table, n, idx, padded: gather_oracle(table, n, idx, padded, **rule)


GATHER_MISTAKES = [
    Mistake("gathered by batch position instead of row", "entry i of the "
            "step's table is the row idx_mapping[i] names: a request keeps its "
            "row for life, and the batch is whatever rows this step lists",
            _as_model(rows="positions")),
    Mistake("the rows in table order", "the step's table follows the batch's "
            "order, idx_mapping's, not the rows' numbers: entry i is what the "
            "step's i-th request reads", _as_model(rows="sorted")),
    Mistake("a stale tail copied", "columns past a row's num_blocks hold "
            "whatever the row's last holder left there: the gathered row has "
            "the row's blocks, then zeros", _as_model(mask=False)),
    Mistake("padding rows missing", "the result has num_reqs_padded rows: "
            "the rows past the batch are zeros (the null block)",
            _as_model(pad=False)),
]
MINUS_ONE = Mistake("row -1 read as the last row", "PyTorch reads index -1 "
                    "as the last row; idx_mapping never names it, and a -1 "
                    "there must be refused with a ValueError naming it")
TWICE = Mistake("a repeated row gathered twice", "two batch entries for one "
                "row would run one request's tokens twice and write its KV "
                "twice: refuse it with a ValueError naming the row")
OUT_OF_RANGE = Mistake("a row past the table not refused", "a row >= "
                       "max_num_reqs is not in the table: refuse it with a "
                       "ValueError naming it, before anything is read")
PADDING_LEFT = Mistake("padding rows not zeroed", "a row past the batch "
                       "must read as the null block, 0, in every column: "
                       "memory from torch.empty holds whatever was there")
NO_KERNEL = Mistake("no kernel", "the task is the kernel: the rows must be "
                    "written by a @triton.jit function's launch")
TORCH_ANSWER = Mistake("computed outside the kernel", "with every launch "
                       "skipped the answer is still right: PyTorch gathered "
                       "it, not the kernel")


def _random_gather(rng: np.random.Generator):
    """A table whose rows hold live blocks then a stale tail, and a batch of distinct rows."""
    rows, width = int(rng.integers(1, 9)), int(rng.integers(1, 9))
    table = rng.integers(1, 1000, size=(rows, width)).astype(np.int32)  # every cell non-zero: stale ids
    num_blocks = rng.integers(0, width + 1, size=rows).astype(np.int32)
    n = int(rng.integers(1, rows + 1))
    idx = rng.permutation(rows)[:n].astype(np.int64)
    padded = n + int(rng.integers(0, 3))
    return torch.from_numpy(table), torch.from_numpy(num_blocks), torch.from_numpy(idx), padded


WORKED_GATHER = (torch.tensor([[3, 9, 9, 9], [1, 4, 9, 9], [9, 9, 9, 9], [6, 2, 8, 9],
                               [9, 9, 9, 9], [7, 9, 9, 9]], dtype=torch.int32),
                 torch.tensor([1, 2, 0, 3, 0, 1], dtype=torch.int32), torch.tensor([3, 0, 5, 1]), 6)


def _call_gather(fn, case, what, kernel=False, launches=None):
    table, num_blocks, idx, padded = case
    dev = default_device()
    t = guarded_rows(table) if kernel else table.to(dev).clone()
    args = (t, num_blocks.to(dev).clone(), idx.to(dev).clone(), padded)
    before = [a.clone() for a in args[:3]]
    with count_triton_launches() as n:
        got = fn(*args)
    if launches is not None:
        launches.append(n.count)
    for name, b, a in zip(("block_table", "num_blocks", "idx_mapping"), before, args[:3]):
        if not torch.equal(b, a):
            raise AssertionError(f"{what}: {name} was changed; the inputs belong to the caller")
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what}: expected a torch.Tensor, got {type(got).__name__}")
    if got.dtype != torch.int32 or got.device.type != dev.type:
        raise AssertionError(f"{what}: expected int32 on {dev}, got {got.dtype} on {got.device}")
    return got.cpu()


def _compare_gather(fn, case, what, kernel=False, launches=None, diagnose=None):
    got = _call_gather(fn, case, what, kernel, launches)
    table, num_blocks, idx, padded = case
    want = gather_oracle(table, num_blocks, idx.tolist(), padded)
    library = gather_block_tables_ref(table, num_blocks, idx, padded).tolist()
    assert library == want, "the library and the oracle disagree (a bug in pagedkv, not in your code)"
    if got.tolist() != want:
        mistake = next((m.diagnosis() for m in GATHER_MISTAKES
                        if m.model(table, num_blocks, idx.tolist(), padded) == got.tolist()), None)
        if got.shape != (padded, table.shape[1]):
            raise WrongAnswer(f"{what}: expected shape ({padded}, {table.shape[1]}), got {tuple(got.shape)}",
                              mistake or (diagnose() if diagnose else None))
        i = next(i for i, (g, w) in enumerate(zip(got.tolist(), want)) if g != w)
        source = (f"row {int(idx[i])} ({int(num_blocks[idx[i]])} blocks)" if i < len(idx) else "padding")
        if i >= len(idx) and not mistake:
            mistake = PADDING_LEFT.diagnosis()
        raise WrongAnswer(f"{what}: idx_mapping {idx.tolist()}: entry {i} ({source}) should be {want[i]}, "
                          f"got {got.tolist()[i]}", mistake or (diagnose() if diagnose else None))


def _refusal(fn, case, row, mistake, kernel):
    table, num_blocks, idx, padded = case
    try:
        _call_gather(fn, case, "", kernel)
    except ValueError as err:
        if str(row) not in str(err):
            raise AssertionError(f"idx_mapping {idx.tolist()}: the ValueError should name row {row}; "
                                 f"it says {err}") from None
        return
    except IndexError as err:
        raise WrongAnswer(f"idx_mapping {idx.tolist()}: raised IndexError: {err}", mistake.diagnosis()) from None
    except (RuntimeError, AssertionError) as err:
        raise WrongAnswer(f"idx_mapping {idx.tolist()}: {type(err).__name__}: {err}",
                          mistake.diagnosis()) from None
    raise WrongAnswer(f"idx_mapping {idx.tolist()} on a table of {table.shape[0]} rows was gathered, "
                      "not refused", mistake.diagnosis())


def _gather_checks(c: Checker, fn, cases, kernel: bool, launches: list) -> None:
    def diagnose():
        found = None
        for case in cases:
            try:
                got = _call_gather(fn, case, "", kernel).tolist()
            except Exception:  # noqa: BLE001
                return None
            if got == gather_oracle(*case[:2], case[2].tolist(), case[3]):
                continue
            here = [m for m in GATHER_MISTAKES if m.model(*case[:2], case[2].tolist(), case[3]) == got]
            found = here if found is None else [m for m in found if m in here]
            if not found:
                return None
        return found[0].diagnosis() if found else None

    c.prop("the worked example: idx_mapping [3, 0, 5, 1], padded to 6 rows",
           lambda: _compare_gather(fn, WORKED_GATHER, "the worked example", kernel, launches, diagnose),
           "entry i copies row idx_mapping[i], its num_blocks columns; everything else is 0", diagnose)

    def stale():
        table, n, _, _ = WORKED_GATHER
        for idx in ([0, 1, 3], [5, 3]):
            _compare_gather(fn, (table, n, torch.tensor(idx), len(idx)), "stale columns", kernel,
                            launches, diagnose)

    c.prop("columns past a row's num_blocks are 0, not the row's last holder's ids", stale,
           "which columns of a row does the request own?", diagnose)

    def padding():
        table, n, idx, _ = WORKED_GATHER
        case = (table, n, idx[:2], 5)
        if kernel:
            _compare_gather(fn, case, "padded to 5 rows", kernel, launches, diagnose)
            return
        with skipped_triton_launches():  # fresh torch.empty buffers hold poison, not zeros
            _compare_gather(fn, case, "padded to 5 rows", kernel, launches, diagnose)

    c.prop("rows past the batch are zeros, up to num_reqs_padded", padding,
           "what does a padding row hold, and how many rows come back?", diagnose)

    def refusals():
        table, n, _, _ = WORKED_GATHER
        _refusal(fn, (table, n, torch.tensor([3, 0, 3]), 3), 3, TWICE, kernel)
        _refusal(fn, (table, n, torch.tensor([1, -1]), 2), -1, MINUS_ONE, kernel)
        _refusal(fn, (table, n, torch.tensor([0, 6]), 2), 6, OUT_OF_RANGE, kernel)

    c.prop("a row named twice, row -1 and a row past the table are refused (ValueError naming it)",
           refusals, "check idx_mapping before reading anything")

    def randomized():
        for k, case in enumerate(cases):
            _compare_gather(fn, case, f"random case {k} ({case[0].shape[0]} x {case[0].shape[1]} table)",
                            kernel, launches, diagnose)

    c.prop(f"{len(cases)} random tables match gather_block_tables_ref", randomized,
           "the message names the entry and its row", diagnose)


def check_gather_block_tables(fn, cases: int = 60, seed: int = 0, timeout: float = 30.0) -> CheckReport:
    """Check ``gather_block_tables(block_table, num_blocks, idx_mapping, num_reqs_padded)`` in PyTorch."""
    rng = np.random.default_rng(seed)
    randoms = [_random_gather(rng) for _ in range(cases)]
    with Checker("gather_block_tables", timeout=timeout) as c:
        c.probe(lambda: _call_gather(fn, WORKED_GATHER, "probe"))
        c.written_here("gather_block_tables", lambda: _call_gather(fn, WORKED_GATHER, "probe"),
                       LIBRARY_GATHER)
        _gather_checks(c, fn, randoms, False, [])
    return c.report


def check_gather_kernel(fn, cases: int = 12, seed: int = 1, timeout: float = 90.0) -> CheckReport:
    """Check the same gather, written as a Triton kernel behind the same signature."""
    rng = np.random.default_rng(seed)
    randoms = [_random_gather(rng) for _ in range(cases)]
    launches: list[int] = []
    with Checker("gather kernel", timeout=timeout) as c:
        c.probe(lambda: _call_gather(fn, WORKED_GATHER, "probe", True))
        c.written_here("the gather kernel", lambda: _call_gather(fn, WORKED_GATHER, "probe", True),
                       LIBRARY_GATHER)
        _gather_checks(c, fn, randoms, True, launches)

        def in_kernel():
            if not launches or min(launches) == 0:
                raise WrongAnswer(f"{launches.count(0)} of {len(launches)} calls ran no Triton kernel",
                                  NO_KERNEL.diagnosis())
            dev = default_device()
            table, n, idx, padded = WORKED_GATHER
            with skipped_triton_launches():
                got = fn(guarded_rows(table), n.to(dev), idx.to(dev), padded)
            if isinstance(got, torch.Tensor) and got.cpu().tolist() == gather_oracle(table, n, idx.tolist(),
                                                                                     padded):
                raise WrongAnswer("with every Triton launch skipped the rows still come out right",
                                  TORCH_ANSWER.diagnosis())

        c.prop("gathers in a Triton kernel", in_kernel,
               "the wrapper validates and allocates; the kernel writes every row")
    return c.report


catalogue(check_gather_block_tables, GATHER_MISTAKES, [PADDING_LEFT, MINUS_ONE, TWICE, OUT_OF_RANGE])
catalogue(check_gather_kernel, GATHER_MISTAKES, [PADDING_LEFT, MINUS_ONE, TWICE, OUT_OF_RANGE, NO_KERNEL,
                                                 TORCH_ANSWER])


# ============================================= the slot mapping from the gathered table
def _entries(qsl, num_tokens, side="right"):
    """The batch entry of each token (``side='left'`` gives a boundary token to the entry before)."""
    q = np.asarray(qsl)
    return np.searchsorted(q, np.arange(num_tokens), side=side) - 1


def slots_oracle(table, qsl, positions, block_size, *, entries="right", column=None, offset=None):
    t = np.asarray(table).tolist()
    pos = np.asarray(positions).tolist()
    rows = list(range(len(pos))) if entries == "token" else _entries(qsl, len(pos), entries).tolist()
    out = []
    for r, p in zip(rows, pos):
        col = p // block_size if column is None else column(p, block_size)
        if not (-len(t) <= r < len(t)) or not 0 <= col < len(t[r]):  # row -1: the last, as PyTorch reads it
            raise IndexError(col)
        b = t[r][col]
        out.append(b * block_size + (p % block_size if offset is None else offset(p, block_size)))
    return out


GATHERED_SLOT_MISTAKES = [
    Mistake("one row per token", "row i of the gathered table is batch "
            "entry i, which owns tokens query_start_loc[i] to "
            "query_start_loc[i+1] - 1: a prefill chunk's tokens share one row",
            lambda t, q, p, b: slots_oracle(t, q, p, b, entries="token")),
    Mistake("a token at an entry's start given to the entry before", "token "
            "query_start_loc[i] is entry i's first token: the entries' ranges "
            "are half-open, start included, end excluded",
            lambda t, q, p, b: slots_oracle(t, q, p, b, entries="left")),
    Mistake("off by one at a block boundary", "position p is in column "
            "p // block_size: position block_size - 1 is the first block's "
            "last slot, position block_size the second block's first",
            lambda t, q, p, b: slots_oracle(t, q, p, b, column=lambda x, B: (x + 1) // B)),
    Mistake("the position used as the offset", "a slot is its block's first "
            "slot plus the offset inside the block, p % block_size, not the "
            "whole position", lambda t, q, p, b: slots_oracle(t, q, p, b, offset=lambda x, B: x)),
]


def _call_slots(fn, table, qsl, positions, block_size, what):
    dev = default_device()
    args = (table.to(dev).clone(), qsl.to(dev).clone(), positions.to(dev).clone())
    before = [a.clone() for a in args]
    got = fn(*args, block_size)
    for name, b, a in zip(("input_block_table", "query_start_loc", "positions"), before, args):
        if not torch.equal(b, a):
            raise AssertionError(f"{what}: {name} was changed; the inputs belong to the caller")
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what}: expected a torch.Tensor, got {type(got).__name__}")
    if got.shape != (positions.numel(),):
        raise AssertionError(f"{what}: expected one slot per token, shape ({positions.numel()},), "
                             f"got {tuple(got.shape)}")
    return got.cpu()


#: A step where every mistake gives its own slots and no row is out of range for any of them.
DIAGNOSTIC_SLOTS = (torch.tensor([[3, 8], [2, 9], [6, 5], [7, 1]], dtype=torch.int32),
                    torch.tensor([0, 1, 3, 4]), torch.tensor([2, 3, 4, 1]), 4)


def _diagnose_slots(fn) -> str | None:
    """Name the mistake from the learner's slots on ``DIAGNOSTIC_SLOTS``."""
    table, qsl, positions, bs = DIAGNOSTIC_SLOTS
    got = _call_slots(fn, table, qsl, positions, bs, "")
    entries = torch.from_numpy(_entries(qsl, positions.numel()))
    return name_mistake(got.tolist(), DIAGNOSTIC_SLOTS, GATHERED_SLOT_MISTAKES) or \
        diagnose_slots(got, table, entries, positions, bs)


def _compare_slots(fn, case, what):
    table, qsl, positions, bs = case
    got = _call_slots(fn, table, qsl, positions, bs, what)
    want = slots_oracle(table, qsl, positions, bs)
    entries = torch.from_numpy(_entries(qsl, positions.numel()))
    assert compute_slot_mapping_ref(table, entries, positions, bs).tolist() == want, \
        "the library and the oracle disagree (a bug in pagedkv, not in your code)"
    if got.tolist() != want:
        k = next(i for i, (g, w) in enumerate(zip(got.tolist(), want)) if g != w)
        mistake = name_mistake(got.tolist(), (table, qsl, positions, bs), GATHERED_SLOT_MISTAKES) or \
            diagnose_slots(got, table, entries, positions, bs)
        if mistake is None:
            try:
                mistake = _diagnose_slots(fn)
            except Exception:  # noqa: BLE001 -- no diagnosis then
                mistake = None
        raise WrongAnswer(f"{what}: token {k} (entry {int(entries[k])}, position {int(positions[k])}) "
                          f"expected slot {want[k]}, got {got.tolist()[k]}", mistake)


def _random_slots(rng: np.random.Generator, block_size: int):
    n, width = int(rng.integers(1, 6)), int(rng.integers(1, 7))
    table = rng.permutation(n * width * 3)[: n * width].reshape(n, width).astype(np.int32)
    lens = rng.integers(1, 6, size=n)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    positions = np.concatenate([rng.integers(0, width * block_size, size=k) for k in lens]).astype(np.int64)
    return torch.from_numpy(table), torch.from_numpy(qsl), torch.from_numpy(positions), block_size


#: Chapter 5's step: B's prompt positions 3..6 in entry 0, D's position 5, C's decode at 9.
WORKED_SLOTS = (torch.tensor([[5, 11, 0, 0], [2, 7, 0, 0], [4, 8, 1, 0]], dtype=torch.int32),
                torch.tensor([0, 4, 5, 6]), torch.tensor([3, 4, 5, 6, 5, 9]), 4)


def check_gathered_slot_mapping(fn, cases: int = 60, seed: int = 0, timeout: float = 30.0) -> CheckReport:
    """Check ``slot_mapping_gathered(input_block_table, query_start_loc, positions, block_size)``."""
    rng = np.random.default_rng(seed)
    randoms = [_random_slots(rng, (1, 4, 16, 128)[k % 4]) for k in range(cases)]
    with Checker("slot_mapping_gathered", timeout=timeout) as c:
        c.probe(lambda: _call_slots(fn, *WORKED_SLOTS, "probe"))
        c.written_here("slot_mapping_gathered", lambda: _call_slots(fn, *WORKED_SLOTS, "probe"), LIBRARY_SLOTS)

        def diagnose():
            return _diagnose_slots(fn)

        c.prop("the worked step: B's chunk, D's and C's tokens -> [23, 44, 45, 46, 29, 5]",
               lambda: _compare_slots(fn, WORKED_SLOTS, "the worked step"),
               "first the entry each token belongs to, then its row's block at p // B", diagnose)

        def int64():
            got = _call_slots(fn, *WORKED_SLOTS, "the worked step")
            if got.dtype != torch.int64:
                raise AssertionError(f"expected int64 slots, got {got.dtype}")

        c.prop("returns int64 slots, one per token", int64,
               "slots pass 2**31 on a large pool: they are int64")

        def boundaries():
            table = torch.tensor([[3, 8, 6], [2, 9, 0]], dtype=torch.int32)
            qsl, pos = torch.tensor([0, 4, 7]), torch.tensor([15, 16, 31, 32, 0, 15, 16])
            _compare_slots(fn, (table, qsl, pos, 16), "positions at block boundaries (B = 16)")

        c.prop("positions on either side of a block boundary, tokens on either side of an entry's start",
               boundaries, "which column holds position 16, and which entry token 4?", diagnose)

        def wide():
            table = torch.tensor([[20_000_000, 3]], dtype=torch.int32)
            _compare_slots(fn, (table, torch.tensor([0, 2]), torch.tensor([5, 130]), 128), "slots past 2**31")

        c.prop("slots past 2**31 do not overflow", wide,
               "the gathered table is int32; its product with block_size may not be", diagnose)

        def randomized():
            for k, case in enumerate(randoms):
                _compare_slots(fn, case, f"random step {k} (block_size {case[3]})")

        c.prop(f"{cases} random steps at block sizes 1, 4, 16, 128 match the library", randomized,
               "the message names the token, its entry and its position", diagnose)
    return c.report


catalogue(check_gathered_slot_mapping, GATHERED_SLOT_MISTAKES, SLOT_MISTAKES)
