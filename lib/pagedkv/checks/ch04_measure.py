"""Exercise 4, modify and measure: restage the whole row, and count what it costs.

Section 2's ``append_block_ids`` stages only the new ids. The reader writes
the design staged writes exist to avoid, ``append_whole_row`` (same
signature: every call restages the row's live blocks from column 0), hands
both to ``sim.replay_table_writes`` (the function is the extension point),
predicts the ratio of cells copied to the device, whole row over new ids
only, then measures it on ``sim.TABLE_WORKLOAD``. The checker replays the
trace with the reader's function, so the measurement is graded for *their*
rule, against the checker's own new-ids-only count.
"""

from __future__ import annotations

import functools
import random

import numpy as np

from ..block_tables import BlockTables
from ..sim.table_writes import TABLE_WORKLOAD, replay_table_writes
from ..staged_write import StagedWriteTensor
from ._harness import Mistake, WrongAnswer, catalogue
from .ch04_staged import replay_learner, replay_model
from .measure_harness import Experiment, check_experiment

__all__ = ["check_whole_row_experiment", "copy_ratio"]


def _new_only(table, num_blocks, req_index, new_block_ids, overwrite):
    start = 0 if overwrite else int(num_blocks[req_index])
    if start + len(new_block_ids) > table.gpu.shape[1]:
        raise ValueError("row full")
    table.stage_write(req_index, start, new_block_ids)
    num_blocks[req_index] = start + len(new_block_ids)


def _whole_row(table, num_blocks, req_index, new_block_ids, overwrite):
    start = 0 if overwrite else int(num_blocks[req_index])
    if start + len(new_block_ids) > table.gpu.shape[1]:
        raise ValueError("row full")
    row = [int(x) for x in table.np[req_index, :start]] + list(new_block_ids)
    table.stage_write(req_index, 0, row)
    num_blocks[req_index] = len(row)


@functools.lru_cache(maxsize=None)
def _new_only_cells() -> int:
    return replay_table_writes(_new_only, TABLE_WORKLOAD)


@functools.lru_cache(maxsize=None)
def _reference_ratio() -> float:
    return replay_table_writes(_whole_row, TABLE_WORKLOAD) / _new_only_cells()


def copy_ratio(append) -> float:
    """Cells copied with ``append`` over cells copied staging new ids only, on the notebook's trace."""
    return replay_table_writes(append, TABLE_WORKLOAD) / _new_only_cells()


MEASUREMENT_MISTAKES = [
    Mistake("the ratio upside down", "divide the whole row's cells by the new ids' cells: "
            "the answer says how many times more the naive design copies", lambda t: 1 / t),
    Mistake("one function measured twice", "replay the trace once with append_whole_row and "
            "once with your section-2 append_block_ids", lambda t: 1.0),
]


def _cases():
    """Scripted and random worker steps: (rows, width, steps), steps of (row, ids, overwrite)."""
    cases = [(4, 4, [[(2, [7, 3], True)], [(2, [9], False)]]),
             (3, 4, [[(1, [4, 5, 6], True)], [(1, [8], True)], [(1, [2], False)]]),
             (2, 3, [[(0, [1, 2], True)], [(0, [3, 4], False), (1, [5], True)], [(0, [6], False)]])]
    rng = random.Random(4)
    for _ in range(40):
        rows, width = rng.randrange(1, 4), rng.randrange(2, 7)
        lengths, steps, nid = [0] * rows, [], 1
        for _ in range(rng.randrange(1, 6)):
            step = []
            for row in rng.sample(range(rows), rng.randrange(1, rows + 1)):
                overwrite = lengths[row] == 0 or rng.random() < 0.2
                n = rng.randrange(1, 3)
                step.append((row, list(range(nid, nid + n)), overwrite))
                nid += n
                start = 0 if overwrite else lengths[row]
                if start + n <= width:
                    lengths[row] = start + n
            steps.append(step)
        cases.append((rows, width, steps))
    return cases


def check_whole_row_experiment(append_whole_row, predicted_ratio=None, measured_ratio=None,
                               verbose: bool = True):
    """Grade exercise 4's experiment: the whole-row append, the copy ratio, the prediction."""

    def probe():
        table = StagedWriteTensor((2, 4), device="cpu")
        append_whole_row(table, np.zeros(2, dtype=np.int32), 1, [5, 6], True)

    def check_rule():
        for rows, width, steps in _cases():
            got, early = replay_learner(append_whole_row, rows, width, steps)
            want = replay_model(rows, width, steps, whole="live")
            if early is not None:
                raise WrongAnswer("a cell reached the device before the worker's apply_write",
                                  early.diagnosis())
            if got != want:
                k = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
                mistake = None
                if got == replay_model(rows, width, steps):
                    mistake = ("new ids only -- that is section 2's rule, the one vLLM uses; "
                               "here every call restages the row's live blocks from column 0")
                elif got == replay_model(rows, width, steps, whole="width"):
                    mistake = ("the whole width staged -- restage the row's blocks (its first "
                               "num_blocks cells and the new ids), not its empty columns")
                raise WrongAnswer(f"{rows} rows x {width} columns, step {k} {steps[k]}: cells, "
                                  f"lengths, copied {got[k][:3]}, expected {want[k][:3]}",
                                  mistake)

    def lesson(pred, true):
        if pred < true:
            return ("every block decoding adds restages the whole row, the prompt's blocks "
                    "included: a request whose prompt fills p blocks and which decodes d more "
                    "pays about d * (p + d / 2) cells more, where new ids pay d; the long "
                    "requests of a heavy tail dominate that sum")
        return ("the prompt's blocks arrive in one call and are staged once under both rules; "
                "only a block that decoding adds restages the row, once per block_size "
                "tokens, not on every step")

    e = Experiment(
        title="experiment: the whole row restaged",
        rule="append_whole_row restages the row's live blocks from column 0",
        check_rule=check_rule, probe=probe,
        library={"BlockTables.append_block_ids": BlockTables.append_block_ids},
        remeasure=lambda: copy_ratio(append_whole_row),
        what="cells copied, whole row over new ids only", measured=measured_ratio,
        predicted=predicted_ratio, measured_name="measured_ratio",
        predicted_name="predicted_ratio", lesson=lesson, fmt=lambda v: f"{v:.2f}x",
        tolerance=0.01, prediction_tolerance=0.25 * _reference_ratio(),
        measurement_mistakes=MEASUREMENT_MISTAKES,
        rule_hint="read the row's live blocks from the host mirror (table.np), add the new "
                  "ids, stage all of them from column 0",
        measure_hint="replay_table_writes(append_whole_row) over "
                     "replay_table_writes(append_block_ids), both on sim.TABLE_WORKLOAD")
    return check_experiment(e, verbose)


catalogue(check_whole_row_experiment, MEASUREMENT_MISTAKES)
