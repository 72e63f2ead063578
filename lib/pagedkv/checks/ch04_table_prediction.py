"""Exercise 4's prediction task: the block-table rows a scripted trace leaves.

The notebook shows ``TABLE_TRACE``: five requests in a ``BlockTable``, one
that grows, two that finish, a row moved into a hole, a request that joins
and one that grows after its move. The reader writes rows 0-4 as the
kernels read them (``table.row(r)``: the first ``num_blocks_per_row[r]``
cells) into ``predicted_rows`` before running anything.
``check_table_prediction`` runs the trace on the library's ``BlockTable``,
compares, and on a mismatch draws the rows the trace leaves beside the
predicted ones (the book's ``render_block_table``). A list model of the
table replays the trace with one rule changed to name the misunderstanding.
"""

from __future__ import annotations

import numbers

from ..block_table import BlockTable
from ..views.block_table_picture import render_block_table
from ._harness import Mistake, catalogue
from .predict_harness import PredictionReport, check_prediction, side_by_side

__all__ = ["check_table_prediction", "TABLE_TRACE", "run_table_trace"]

#: The trace, as the notebook shows it (and as the checker runs it).
TABLE_TRACE = """\
table = BlockTable(max_num_reqs=6, max_num_blocks_per_req=4, device="cpu")
for row, blocks in enumerate([[3, 7], [1], [4, 9, 2], [8], [5, 6]]):
    table.add_row(blocks, row)       # p, q, r, s, t in rows 0-4
table.append_row([11], 0)            # p's next block
table.clear_row(3)                   # s finishes
table.clear_row(1)                   # q finishes
table.move_row(4, 1)                 # t moves into q's row
table.add_row([12, 10], 3)           # u takes s's row
table.append_row([13], 1)            # t's next block
"""

#: Who holds each row once the trace has run (row 4 is empty).
ROW_OWNERS = ["p", "t", "r", "u", "-"]

_OPS = [("add", [[3, 7], [1], [4, 9, 2], [8], [5, 6]]), ("append", [11], 0),
        ("clear", 3), ("clear", 1), ("move", 4, 1), ("add_one", [12, 10], 3),
        ("append", [13], 1)]


def run_table_trace() -> BlockTable:
    """Run ``TABLE_TRACE`` on the library's ``BlockTable``."""
    namespace: dict = {"BlockTable": BlockTable}
    exec(TABLE_TRACE, namespace)  # noqa: S102 -- the module's own constant
    return namespace["table"]


def table_model(*, move_keeps_source=False, move_keeps_length=False,
                append_overwrites=False) -> list[list[int]]:
    """Rows 0-4 after ``_OPS`` under the table's rules, one of them changed.

    A row is its cells and its length; the kernels read ``cells[:length]``.
    """
    cells = [[0] * 4 for _ in range(6)]
    length = [0] * 6

    def append(ids, r, at=None):
        start = length[r] if at is None else at
        cells[r][start:start + len(ids)] = ids
        length[r] = start + len(ids)

    for op in _OPS:
        if op[0] == "add":
            for r, ids in enumerate(op[1]):
                append(ids, r, 0)
        elif op[0] == "add_one":
            append(op[1], op[2], 0)
        elif op[0] == "append":
            append(op[1], op[2], 0 if append_overwrites else None)
        elif op[0] == "clear":
            cells[op[1]] = [0] * 4
            length[op[1]] = 0
        else:  # move src -> tgt
            src, tgt = op[1], op[2]
            cells[tgt] = list(cells[src])
            if not move_keeps_length:
                length[tgt] = length[src]
            if not move_keeps_source:
                cells[src] = [0] * 4
                length[src] = 0
    return [cells[r][:length[r]] for r in range(5)]


TABLE_MISTAKES = [
    Mistake("the moved row left in place", "move_row clears the row it "
            "moves out of: row 4 is empty, or a padded batch reading past "
            "num_reqs would still find t's blocks there",
            lambda: table_model(move_keeps_source=True)),
    Mistake("the length left behind", "a row is its cells and its length, "
            "and move_row moves both: row 1 gets t's length, 2, not the 0 "
            "q's cleared row had, before t's next block is appended",
            lambda: table_model(move_keeps_length=True)),
    Mistake("an append that overwrites", "append_row adds at the row's "
            "length: the blocks already in a row never move",
            lambda: table_model(append_overwrites=True)),
]


def _read(predicted) -> list[list[int]]:
    shape = ("expected rows 0-4 as a list of 5 lists of block ids, such as "
             "[[1, 2], [3], [], [4], []]")
    try:
        rows = [list(r) for r in predicted]
    except TypeError:
        raise AssertionError(f"{shape}; got {type(predicted).__name__} "
                             f"{predicted!r:.40}") from None
    if isinstance(predicted, (str, bytes)) or len(rows) != 5 or any(
            isinstance(b, bool) or not isinstance(b, numbers.Integral)
            for r in rows for b in r):
        raise AssertionError(f"{shape}; got {predicted!r:.60}")
    return [[int(b) for b in r] for r in rows]


def _compare(got, want) -> str | None:
    if got == want:
        return None
    first = next(r for r in range(5) if got[r] != want[r])
    return (f"row {first} ({ROW_OWNERS[first]}): you predicted {got[first]}, "
            f"the trace leaves {want[first]}")


def _diagnose(got) -> str | None:
    for m in TABLE_MISTAKES:
        if m.model() == got:
            return m.diagnosis()
    return None


def _rows(rows) -> dict[str, list[int]]:
    return {f"row {r} ({ROW_OWNERS[r]})": list(ids) for r, ids in enumerate(rows)}


def check_table_prediction(predicted_rows) -> PredictionReport:
    """Grade a prediction of rows 0-4 (block ids, as ``table.row(r)`` reads them) after ``TABLE_TRACE``."""
    table = run_table_trace()
    want = [table.row(r) for r in range(5)]

    def draw(got):
        return side_by_side(render_block_table(_rows(want), title="the trace"),
                            render_block_table(_rows(got), title="your prediction"))

    return check_prediction(
        "prediction", "predicted_rows", predicted_rows, want,
        read=_read, compare=_compare, draw=draw, diagnose=_diagnose,
        name="your rows 0-4 are the ones the trace leaves",
        hint="replay the trace one line at a time, each row's cells and "
             "its length")


catalogue(check_table_prediction, TABLE_MISTAKES)
