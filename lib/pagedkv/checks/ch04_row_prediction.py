"""Exercise 4's prediction task: the rows of one step's batch after a trace (Model Runner V2).

The notebook shows ``ROW_TRACE``: five requests arrive on a worker of six
rows, two finish, two more arrive, and a step names five of them. The reader
writes the step's ``idx_mapping`` (the row of each batch entry) into
``predicted_idx_mapping`` before running anything. ``check_row_prediction``
runs the trace on the library's ``RequestState``, compares, and on a mismatch
draws the step's batch twice, side by side: each entry with the row the
trace gives it and the row predicted. Models of the trace with one rule
changed name the misunderstanding: the first or lowest free row taken, a
freed row queued behind the others, the V1 runner's dense rows (finished
requests' holes filled by moving the last row down), rows sorted, batch
positions for rows.
"""

from __future__ import annotations

import numbers

from ..request_state import RequestState
from ._harness import Mistake, catalogue
from .ch04_rows import RowsOracle
from .predict_harness import PredictionReport, check_prediction, side_by_side

__all__ = ["check_row_prediction", "ROW_TRACE", "run_row_trace"]

#: The trace, as the notebook shows it (and as the checker runs it).
ROW_TRACE = """\
rows = RequestState(max_num_reqs=6)
for name in ["p", "q", "r", "s", "t"]:
    rows.add_request(name)           # p, q, r, s, t arrive in that order
rows.remove_request("s")             # s finishes
rows.remove_request("q")             # q finishes
rows.add_request("u")                # u arrives
rows.add_request("v")                # v arrives
idx_mapping = rows.idx_mapping(["t", "p", "u", "v", "r"])  # this step
"""

BATCH = ["t", "p", "u", "v", "r"]
_OPS = [("add", n) for n in "pqrst"] + [("remove", "s"), ("remove", "q"), ("add", "u"), ("add", "v")]


def run_row_trace() -> list[int]:
    """Run ``ROW_TRACE`` on the library's ``RequestState``: the step's ``idx_mapping``."""
    namespace: dict = {"RequestState": RequestState}
    exec(ROW_TRACE, namespace)  # noqa: S102 -- the module's own constant
    return [int(r) for r in namespace["idx_mapping"]]


def rows_model(**rule) -> list[int]:
    """The step's ``idx_mapping`` under vLLM's rules, one of them changed (``RowsOracle``'s)."""
    model = RowsOracle(6, **rule)
    for op, name in _OPS:
        (model.add_request if op == "add" else model.remove_request)(name)
    return [int(r) for r in model.idx_mapping(BATCH)]


def v1_dense_model() -> list[int]:
    """The V1 runner's rows: p..t in rows 0-4; s and q leave and t moves into q's hole; u, v append."""
    rows = {"p": 0, "t": 1, "r": 2, "u": 3, "v": 4}
    return [rows[n] for n in BATCH]


ROW_PREDICTION_MISTAKES = [
    Mistake("the first free row", "add_request pops the *last* free row: "
            "p, the first to arrive, gets row 5, not row 0",
            lambda: rows_model(take="first")),
    Mistake("the lowest free row", "a freed row goes back to the end the "
            "next add_request takes from, whatever its number",
            lambda: rows_model(take="lowest")),
    Mistake("a freed row queued behind the others", "the row freed last is "
            "handed out first: q's row goes to u", lambda: rows_model(give_back="front")),
    Mistake("the V1 runner's dense rows", "under Model Runner V2 no row "
            "moves: t keeps its row when s and q leave, and u and v take the "
            "freed rows", v1_dense_model),
    Mistake("the rows sorted", "idx_mapping keeps the batch's order: entry "
            "0 is t's row", lambda: rows_model(batch="sorted")),
    Mistake("batch positions instead of rows", "entry i is the row the "
            "request holds, not i", lambda: rows_model(batch="positions")),
]


def _read(predicted) -> list[int]:
    shape = "expected predicted_idx_mapping as a list of 5 rows, one per batch entry (t, p, u, v, r)"
    if isinstance(predicted, (str, bytes, dict)) or not hasattr(predicted, "__iter__"):
        raise AssertionError(f"{shape}; got {type(predicted).__name__} {predicted!r:.40}")
    got = list(predicted)
    if len(got) != 5 or any(isinstance(r, bool) or not isinstance(r, numbers.Integral) for r in got):
        raise AssertionError(f"{shape}; got {got!r:.60}")
    return [int(r) for r in got]


def _compare(got, want) -> str | None:
    if got == want:
        return None
    k = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    return (f"you predicted {got}, the trace gives {want}: entry {k} ({BATCH[k]}) is row {want[k]}, "
            f"not {got[k]}")


def _diagnose(got) -> str | None:
    for m in ROW_PREDICTION_MISTAKES:
        if m.model() == got:
            return m.diagnosis()
    return None


def render_rows(idx_mapping, num_rows: int = 6) -> str:
    """The worker's rows as a strip of cells, each batch entry's request in the row it names."""
    from ..views.style import escape, owner_color

    owner = {}
    for name, row in zip(BATCH, idx_mapping):
        owner.setdefault(row, []).append(name)
    cells = []
    for r in range(num_rows):
        names = owner.get(r, [])
        colour = owner_color(names[0]) if len(names) == 1 else ("#d7191c" if names else "#e9ecef")
        label = "/".join(names) or "&nbsp;"
        cells.append(f"<td style='padding:3px 6px;text-align:center;background:{colour};"
                     f"border-radius:3px;min-width:28px'>{escape(label) if names else label}</td>")
    heads = "".join(f"<th style='font-weight:normal;color:#868e96;font-size:11px'>row {r}</th>"
                    for r in range(num_rows))
    batch = ", ".join(f"{n}: {r}" for n, r in zip(BATCH, idx_mapping))
    return (f"<table style='border-spacing:3px'><tr>{heads}</tr><tr>{''.join(cells)}</tr></table>"
            f"<div style='font-size:12px'>idx_mapping = [{escape(batch)}]</div>")


def check_row_prediction(predicted_idx_mapping) -> PredictionReport:
    """Grade a prediction of the ``idx_mapping`` that ``ROW_TRACE``'s step builds."""
    want = run_row_trace()
    assert want == rows_model(), "the trace and its model disagree (a bug in pagedkv)"

    def draw(got):
        return side_by_side(render_rows(want), render_rows(got))

    return check_prediction(
        "prediction", "predicted_idx_mapping", predicted_idx_mapping, want,
        read=_read, compare=_compare, draw=draw, diagnose=_diagnose,
        name="your idx_mapping is the step's",
        hint="keep the free list on paper, in order: which end does add_request "
             "take from, and where does remove_request put a row back?")


catalogue(check_row_prediction, ROW_PREDICTION_MISTAKES)
