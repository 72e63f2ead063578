"""Checks for exercises/04_block_table.ipynb.

The learner computes the slot mapping in numpy from a block table:

* ``slot_mapping_numpy(block_table, req_indices, positions, block_size) -> np.ndarray``
  with ``block_table`` an ``[num_rows, max_blocks]`` int32 array, ``req_indices``
  and ``positions`` int64 arrays of one entry per token (``req_indices == -1``
  marks padding), returning one int64 slot per token (``-1`` for padding).

Each case is compared with the library's reference
(``pagedkv.kernels.compute_slot_mapping_ref``) and with a token-by-token oracle
written here. A wrong slot is compared with the answers of the common
mistakes (the int32 wrap, a ceil where the floor belongs, padding looked up in
row -1, offset and column swapped...), and the line names the one it matches.
The padding property judges padding tokens only: a wrong slot for an ordinary
token there is left to the other properties.
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.slot_mapping import compute_slot_mapping_ref
from ._harness import Checker, CheckReport, WrongAnswer, catalogue
from .slot_mistakes import SLOT_MISTAKES, diagnose_slots

__all__ = ["check_slot_mapping_numpy"]

BLOCK_SIZES = (1, 8, 16, 32, 128)


def _oracle(table: np.ndarray, reqs: np.ndarray, positions: np.ndarray, block_size: int) -> list[int]:
    out = []
    for r, p in zip(reqs.tolist(), positions.tolist()):
        out.append(-1 if r == -1 else int(table[r, p // block_size]) * block_size + p % block_size)
    return out


def random_table_case(rng: np.random.Generator, block_size: int, padding: bool = True):
    """A table of distinct block ids with some rows partly filled, and tokens inside the filled part."""
    rows, width = int(rng.integers(1, 6)), int(rng.integers(1, 9))
    table = np.zeros((rows, width), dtype=np.int32)
    lengths = rng.integers(1, width + 1, size=rows)
    ids = rng.permutation(rows * width * 2)[: rows * width].astype(np.int32)
    for r in range(rows):
        table[r, : lengths[r]] = ids[r * width : r * width + lengths[r]]
    n = int(rng.integers(1, 40))
    reqs = rng.integers(0, rows, size=n).astype(np.int64)
    positions = np.array([rng.integers(0, lengths[r] * block_size) for r in reqs], dtype=np.int64)
    if padding:
        pad = rng.random(n) < 0.2
        reqs[pad], positions[pad] = -1, 0
    return table, reqs, positions


def _call(fn, table, reqs, positions, block_size, what: str) -> np.ndarray:
    """Run the learner's function on copies; return its answer as a 1-D array of the right length."""
    got = fn(table.copy(), reqs.copy(), positions.copy(), block_size)
    arr = np.asarray(got)
    if arr.shape != (len(reqs),):
        raise AssertionError(f"{what}: expected one slot per token, shape ({len(reqs)},), got shape {arr.shape}")
    return arr


def _compare(got: np.ndarray, want: list[int], reqs, positions, what: str,
             table=None, block_size=None, only=None) -> None:
    """Compare slot by slot (``only``: the tokens to judge); name the mistake."""
    for i, (g, w) in enumerate(zip(got.tolist(), want)):
        if g != w and (only is None or i in only):
            kind = "padding" if int(reqs[i]) == -1 else f"row {int(reqs[i])}"
            raise WrongAnswer(
                f"{what}: token {i} ({kind}, position {int(positions[i])}) expected slot {w}, got {g}",
                None if table is None else diagnose_slots(got, table, reqs, positions, block_size))


def check_slot_mapping_numpy(fn, cases: int = 60, seed: int = 0) -> CheckReport:
    """Check ``fn(block_table, req_indices, positions, block_size) -> np.ndarray`` of int64 slots."""
    rng = np.random.default_rng(seed)
    with Checker("slot_mapping_numpy") as c:
        c.probe(lambda: fn(np.zeros((1, 1), np.int32), np.zeros(1, np.int64),
                           np.zeros(1, np.int64), 16))

        def worked_example():
            table = np.zeros((4, 300), dtype=np.int32)
            table[3, :256] = np.arange(256) + 5000
            table[3, 256] = 1913
            reqs, pos = np.array([3], dtype=np.int64), np.array([4096], dtype=np.int64)
            got = _call(fn, table, reqs, pos, 16, "row 3, position 4096, block_size 16")
            _compare(got, [30608], reqs, pos, "the worked example", table, 16)

        c.prop("the worked example: row 3, position 4096 -> block 1913 -> slot 30,608", worked_example,
               "column = position // block_size, offset = position % block_size, slot = block * block_size + offset")

        def returns_int64():
            table, reqs, pos = random_table_case(rng, 16)
            got = fn(table.copy(), reqs.copy(), pos.copy(), 16)
            if not isinstance(got, np.ndarray):
                raise AssertionError(f"expected a numpy array, got {type(got).__name__}")
            if got.dtype != np.int64:
                raise AssertionError(f"expected dtype int64, got {got.dtype}")
            if got.shape != (len(reqs),):
                raise AssertionError(f"expected shape ({len(reqs)},), got {got.shape}")

        c.prop("returns an int64 numpy array with one slot per token", returns_int64,
               "build the result with numpy operations, then .astype(np.int64)")

        def padding():
            table = np.array([[7, 9], [4, 0]], dtype=np.int32)
            reqs = np.array([-1, 0, -1, 1, -1], dtype=np.int64)
            pos = np.array([0, 17, 5, 3, 0], dtype=np.int64)
            got = _call(fn, table, reqs, pos, 16, "a batch with padding tokens")
            _compare(got, [-1, 9 * 16 + 1, -1, 4 * 16 + 3, -1], reqs, pos, "padding", table, 16,
                     only={0, 2, 4})

        c.prop("padding tokens (req_indices == -1) get slot -1", padding,
               "compute every token, then np.where(req_indices == -1, -1, slots); index row 0 for padding so "
               "nothing reads out of range")

        def wide_slots():
            table = np.array([[20_000_000, 3]], dtype=np.int32)
            reqs, pos = np.array([0, 0], dtype=np.int64), np.array([5, 130], dtype=np.int64)
            got = _call(fn, table, reqs, pos, 128, "block id 20,000,000 at block_size 128")
            _compare(got, [20_000_000 * 128 + 5, 3 * 128 + 2], reqs, pos, "slots past 2**31", table, 128)

        c.prop("slots past 2**31 do not overflow", wide_slots,
               "block ids are int32 but block_id * block_size need not fit: cast to int64 before multiplying")

        def randomized():
            for k in range(cases):
                bs = BLOCK_SIZES[k % len(BLOCK_SIZES)]
                table, reqs, pos = random_table_case(rng, bs)
                what = f"random case {k} (block_size {bs}, table {table.shape[0]} x {table.shape[1]})"
                got = _call(fn, table, reqs, pos, bs, what)
                want = _oracle(table, reqs, pos, bs)
                library = compute_slot_mapping_ref(torch.from_numpy(table), torch.from_numpy(reqs),
                                                   torch.from_numpy(pos), bs).tolist()
                assert library == want, "the library and the oracle disagree (a bug in pagedkv, not in your code)"
                _compare(got, want, reqs, pos, what, table, bs)

        c.prop(f"{cases} random tables at block sizes 1, 8, 16, 32, 128 match the library", randomized,
               "index the table with two arrays at once: block_table[req_indices, positions // block_size]")

        def leaves_inputs_alone():
            table, reqs, pos = random_table_case(rng, 8)
            copies = (table.copy(), reqs.copy(), pos.copy())
            fn(table, reqs, pos, 8)
            for name, before, after in zip(("block_table", "req_indices", "positions"), copies, (table, reqs, pos)):
                if not np.array_equal(before, after):
                    raise AssertionError(f"{name} was modified")

        c.prop("the block table and the inputs are left unchanged", leaves_inputs_alone,
               "replace -1 with 0 in a copy (np.where), not in req_indices itself")
    return c.report


catalogue(check_slot_mapping_numpy, SLOT_MISTAKES)
