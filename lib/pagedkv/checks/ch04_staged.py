"""Exercise 4's second task: a row's new block ids, staged (Model Runner V2).

The learner writes ``append_block_ids(table, num_blocks, req_index,
new_block_ids, overwrite)`` for one KV-cache group, as vLLM 0.33.0's
``BlockTables`` does for each group (``append_block_ids``,
``v1/worker/gpu/block_table.py:125-144``):

* ``table`` is a ``pagedkv.staged_write.StagedWriteTensor`` of
  ``[max_num_reqs, width]`` int32, the rows requests keep for life;
* ``num_blocks`` is the host's ``[max_num_reqs]`` numpy array of row lengths;
* the ids go in from column 0 when ``overwrite`` (a new or resumed request),
  else after the row's blocks; they are *staged* (``table.stage_write``), and
  the row's length follows; a row that would pass ``width`` is refused
  (``ValueError``) with nothing staged and nothing changed.

``check_staged_append`` runs scripted and random sequences of appends, with
``table.apply_write()`` between steps as the worker calls it, and compares
what reaches the device, the row lengths and the entries copied with the
library's ``BlockTables`` (one group) and with an oracle written here. A
wrong answer is compared with models of the common mistakes (overwrite
ignored, every append from column 0, the length not updated, the whole row
staged, the length changed by a refused append); writing the device tensor
directly, or applying inside the append, is named by what it does before the
worker's ``apply_write``. A function that runs the library's
``BlockTables.append_block_ids`` is told that the task is to write it.
"""

from __future__ import annotations

import numpy as np
import torch

from .._device import default_device
from ..block_tables import BlockTables
from ..request_state import RequestState
from ..staged_write import StagedWriteTensor
from ._harness import Checker, CheckReport, Mistake, WrongAnswer, catalogue

__all__ = ["check_staged_append"]

REFUSED = "refused"


def _model(rows, width, steps, *, start="tail", update=True, whole=False, early=False):
    """Snapshots after each step, ``(cells, lengths, copied, answers)``, under one changed rule.

    ``steps`` is a list of steps, each a list of ``(row, ids, overwrite)``.
    """
    cells = [[0] * width for _ in range(rows)]
    lengths = [0] * rows
    out = []
    for step in steps:
        staged: set[tuple[int, int]] = set()
        answers = []
        for row, ids, overwrite in step:
            if start == "tail":
                s = 0 if overwrite else lengths[row]
            elif start == "zero":
                s = 0
            else:  # overwrite ignored: always after the row's blocks
                s = lengths[row]
            end = s + len(ids)
            if end > width:
                if early:
                    lengths[row] = end
                answers.append(REFUSED)
                continue
            cells[row][s:end] = ids
            cols = range(width) if whole == "width" else range(end) if whole == "live" else range(s, end)
            staged.update((row, c) for c in cols)
            if update:
                lengths[row] = end
            answers.append(None)
        out.append(([list(r) for r in cells], list(lengths), len(staged), answers))
    return out


STAGED_MISTAKES = [
    Mistake("overwrite ignored", "a request that takes a row (overwrite=True) "
            "writes from column 0: the row may still hold the blocks of the "
            "request that had it before", lambda r, w, s: _model(r, w, s, start="append")),
    Mistake("an append that overwrites", "a running request's new blocks go "
            "after the row's blocks (overwrite=False): the ids already in the "
            "row never move", lambda r, w, s: _model(r, w, s, start="zero")),
    Mistake("the row length not updated", "num_blocks[req_index] is where the "
            "next append starts and what the gather copies: it must end where "
            "the new ids end", lambda r, w, s: _model(r, w, s, update=False)),
    Mistake("the whole row staged", "only the entries that changed are "
            "staged: a decode step appends one id, and sending the row's "
            "every column is the copy staged writes exist to avoid",
            lambda r, w, s: _model(r, w, s, whole="width")),
    Mistake("the row's blocks restaged", "stage only the new ids, from where "
            "they start: the row's older blocks are already on the device, and "
            "restaging them copies the whole row every time a block is added",
            lambda r, w, s: _model(r, w, s, whole="live")),
    Mistake("a refused append changed the row length", "check that the ids "
            "fit before changing anything: a refused call leaves num_blocks "
            "and the staged writes as they were",
            lambda r, w, s: _model(r, w, s, early=True)),
]
DIRECT = Mistake("written to the device directly", "the append only stages: "
                 "nothing reaches table.gpu until the worker calls "
                 "apply_write(), once for the whole step")
APPLIED = Mistake("applied inside the append", "the worker applies the staged "
                  "writes once per step, after every row's append: an apply "
                  "per append is a copy per request")


def _learner(fn, rows, width, steps):
    """The learner's snapshots, and whether anything reached the device before an apply."""
    dev = default_device()
    table = StagedWriteTensor((rows, width), torch.int32, dev)
    num_blocks = np.zeros(rows, dtype=np.int32)
    out, early = [], None
    for step in steps:
        before_copied = table.num_copied_elements
        answers = []
        for row, ids, overwrite in step:
            device_before = table.gpu.cpu().clone()
            try:
                result = fn(table, num_blocks, row, list(ids), overwrite)
            except ValueError:
                answers.append(REFUSED)
                continue
            if result is not None:
                raise AssertionError(f"append_block_ids returned {type(result).__name__} "
                                     f"{result!r:.40}: it changes the table and num_blocks in place "
                                     "and returns None")
            answers.append(None)
            if early is None and not bool((table.gpu.cpu() == device_before).all()):
                early = APPLIED if table.num_copied_elements > before_copied else DIRECT
        table.apply_write()
        copied = table.num_copied_elements - before_copied
        out.append((table.gpu.cpu().tolist(), [int(n) for n in num_blocks], copied, answers))
    return out, early


def _library(rows, width, steps):
    """The same steps on the library's BlockTables (one group, every row held)."""
    state = RequestState(rows)
    for k in range(rows):
        state.add_request(f"r{k}")
    tables = BlockTables(state, [16], [width], device=default_device())
    out = []
    for step in steps:
        answers = []
        for row, ids, overwrite in step:
            try:
                tables.append_block_ids(row, [ids], overwrite)
                answers.append(None)
            except ValueError:
                answers.append(REFUSED)
        copied = tables.apply_staged_writes()
        out.append((tables.block_tables[0].gpu.cpu().tolist(), tables.num_blocks[0].tolist(),
                    copied, answers))
    return out


def _describe(steps, got, want) -> str:
    for k, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        calls = "; ".join(f"row {r} {'=' if o else '+='} {ids}" for r, ids, o in steps[k])
        (gc, gl, gn, ga), (wc, wl, wn, wa) = g, w
        if ga != wa:
            i = next(i for i, (x, y) in enumerate(zip(ga, wa)) if x != y)
            r, ids, o = steps[k][i]
            said = "refused" if ga[i] == REFUSED else "accepted"
            return (f"step {k} [{calls}]: the append of {ids} to row {r} (overwrite={o}) was {said}; "
                    f"a row of {len(wc[0])} columns holding {wl[r] if o else gl[r]} blocks "
                    f"{'accepts' if wa[i] is None else 'refuses'} it")
        for r in range(len(wc)):
            if gc[r] != wc[r] or gl[r] != wl[r]:
                return (f"step {k} [{calls}]: after apply_write, row {r} is {gc[r]} with num_blocks "
                        f"{gl[r]}; expected {wc[r]} with num_blocks {wl[r]}")
        return (f"step {k} [{calls}]: apply_write copied {gn} entries to the device; the changed "
                f"entries are {wn}")
    return "the steps differ in number"


def _random_steps(rng: np.random.Generator):
    rows, width = int(rng.integers(1, 6)), int(rng.integers(2, 9))
    steps, lengths = [], [0] * rows
    next_id = 1
    for _ in range(int(rng.integers(1, 6))):
        step = []
        for row in rng.permutation(rows)[: int(rng.integers(1, rows + 1))].tolist():
            overwrite = bool(rng.random() < 0.3)
            start = 0 if overwrite else lengths[row]
            room = width - start
            n = int(rng.integers(0, room + 1)) if rng.random() < 0.85 else room + int(rng.integers(1, 3))
            ids = list(range(next_id, next_id + n))
            next_id += n
            if n <= room:
                lengths[row] = start + n
            step.append((int(row), ids, overwrite))
        steps.append(step)
    return rows, width, steps


#: A new request in row 2, then a decode step that appends one block.
WORKED = (4, 4, [[(2, [7, 3], True)], [(2, [9], False)]])
#: Row 1 held a finished request's 3 blocks; a new request takes it.
REUSED = (3, 4, [[(1, [4, 5, 6], True)], [(1, [8], True)], [(1, [2], False)]])
OVERFLOW = (2, 3, [[(0, [1, 2], True)], [(0, [3, 4], False), (1, [5], True)], [(0, [6], False)]])


def _diagnose(fn, cases) -> str | None:
    candidates = list(STAGED_MISTAKES)
    wrong = False
    for rows, width, steps in cases:
        try:
            got, early = _learner(fn, rows, width, steps)
        except Exception:  # noqa: BLE001 -- no diagnosis then
            return None
        if early is not None:
            return early.diagnosis()
        if got == _model(rows, width, steps):
            continue
        wrong = True
        candidates = [m for m in candidates if m.model(rows, width, steps) == got]
        if not candidates:
            return None
    return candidates[0].diagnosis() if wrong else None


def check_staged_append(fn, cases: int = 80, seed: int = 0, timeout: float = 20.0) -> CheckReport:
    """Check ``append_block_ids(table, num_blocks, req_index, new_block_ids, overwrite) -> None``."""
    rng = np.random.default_rng(seed)
    randoms = [_random_steps(rng) for _ in range(cases)]
    with Checker("append_block_ids", timeout=timeout) as c:
        c.probe(lambda: _learner(fn, *WORKED))
        c.written_here("append_block_ids", lambda: _learner(fn, *WORKED),
                       {"BlockTables.append_block_ids": BlockTables.append_block_ids})

        def diagnose():
            return _diagnose(fn, [WORKED, REUSED, OVERFLOW, *randoms])

        def case(setup, what):
            def body():
                got, early = _learner(fn, *setup)
                want = _library(*setup)
                assert want == _model(*setup), "the library and the oracle disagree (a bug in pagedkv)"
                if early is not None:
                    raise WrongAnswer(f"{what}: the device tensor changed before apply_write()",
                                      early.diagnosis())
                if got != want:
                    raise WrongAnswer(f"{what}: {_describe(setup[2], got, want)}",
                                      diagnose() or _diagnose(fn, [setup]))
            return body

        c.prop("a new request in row 2 gets [7, 3]; its next block 9 goes to column 2",
               case(WORKED, "the worked example"),
               "where does each call start writing, and what does num_blocks say afterwards?",
               diagnose)

        def staged_only():
            got, early = _learner(fn, *WORKED)
            if early is not None:
                raise WrongAnswer("the device tensor changed before apply_write()", early.diagnosis())
            copies = [n for _, _, n, _ in got]
            if copies != [2, 1]:
                raise WrongAnswer(f"apply_write copied {copies} entries in the two steps; the entries "
                                  "that changed are [2, 1]", diagnose())

        c.prop("only the new entries reach the device, and only at apply_write()", staged_only,
               "stage the new ids only; the worker applies once per step", diagnose)
        c.prop("a new request in a row a finished one left starts at column 0",
               case(REUSED, "a row reused"), "what does overwrite=True say about the row's old blocks?",
               diagnose)
        c.prop("a row that would overflow is refused (ValueError), changing nothing",
               case(OVERFLOW, "a full row"),
               "check that the ids fit before anything changes", diagnose)

        def randomized():
            for k, setup in enumerate(randoms):
                got, early = _learner(fn, *setup)
                want = _library(*setup)
                if early is not None:
                    raise WrongAnswer(f"random case {k}: the device tensor changed before apply_write()",
                                      early.diagnosis())
                if got != want:
                    raise WrongAnswer(f"random case {k} ({setup[0]} rows x {setup[1]} columns): "
                                      f"{_describe(setup[2], got, want)}", diagnose())

        c.prop(f"{cases} random sequences match BlockTables: cells, row lengths, entries copied",
               randomized, "the message names the step and the row: replay it by hand", diagnose)
    return c.report


catalogue(check_staged_append, STAGED_MISTAKES, [DIRECT, APPLIED])


def replay_model(rows: int, width: int, steps, **rule):
    """The oracle's snapshots ``(cells, lengths, copied, answers)`` after each step, under one rule.

    ``rule`` is one of ``_model``'s keywords (``whole="live"``: every append
    restages the row's live blocks from column 0). For other checkers.
    """
    return _model(rows, width, steps, **rule)


def replay_learner(fn, rows: int, width: int, steps):
    """The learner's ``append`` replayed as the worker calls it: ``(snapshots, early mistake)``."""
    return _learner(fn, rows, width, steps)
