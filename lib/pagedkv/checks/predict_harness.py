"""What the prediction tasks of the exercises share.

A prediction task shows a scripted trace; the reader writes the state it
leads to into a variable *before* running it, and a checker compares. Each
checker (``ch01_shared_card``, ``ch02_holes``, ``ch03_queue_prediction``,
``ch04_table_prediction``) runs its trace on the library, so the expected
state is computed, never typed in, and then:

* an empty prediction (``None``, the exercise's unfilled state) prints one
  line, ``no prediction yet``, and nothing else;
* a prediction of the wrong shape (a string where a list belongs) is a red
  line saying what shape is expected;
* a wrong prediction is a red line naming the first difference (and the
  mistake, where a known one explains it), and the checker draws the expected
  state and the predicted one side by side with the book's own pictures
  (``render_pool``, ``render_block_table``, ``draw_extents``,
  ``plot_shared_card``). Where the column is too narrow for two pictures,
  the second sits under the first.

The picture is kept on the report (``report.picture``: HTML, or a matplotlib
figure) and shown in a notebook; outside one it is only kept, so tests can
read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ._harness import FAIL, Checker, CheckReport, WrongAnswer, fit_column

__all__ = ["PredictionReport", "check_prediction", "side_by_side", "show"]

NO_PREDICTION = "not made yet (write it into {variable}, then run this cell)"


@dataclass
class PredictionReport(CheckReport):
    """A ``CheckReport`` that also keeps the picture drawn for a wrong prediction."""

    variable: str = "the variable"
    picture: Any = None

    def __str__(self) -> str:
        if self.stub:
            return fit_column(f"{FAIL} {self.title}: {NO_PREDICTION.format(variable=self.variable)}")
        return super().__str__()


def side_by_side(expected_html: str, predicted_html: str, min_px: int = 320) -> str:
    """Two pictures in one HTML block: what the trace leads to, then the prediction.

    Each takes half the width where ``2 x min_px`` fits, and the full width
    one above the other where it does not.
    """
    def panel(title: str, body: str) -> str:
        return (f"<div style='flex:1 1 {min_px}px;min-width:{min_px}px;max-width:100%'>"
                f"<div style='font-weight:bold;font-size:13px;margin:2px 0'>{title}</div>{body}</div>")

    return ("<div class='pagedkv-prediction' style='display:flex;flex-wrap:wrap;gap:12px;"
            "align-items:flex-start'>"
            + panel("What the trace leads to", expected_html)
            + panel("Your prediction", predicted_html) + "</div>")


def show(picture) -> None:
    """Show an HTML string or a matplotlib figure in a notebook (nothing elsewhere)."""
    try:
        from IPython import get_ipython
        from IPython.display import HTML, display
    except ImportError:  # pragma: no cover -- IPython comes with Jupyter
        return
    if get_ipython() is None:
        return
    display(HTML(picture) if isinstance(picture, str) else picture)


def check_prediction(title: str, variable: str, predicted, expected, *,
                     read: Callable[[Any], Any], compare: Callable[[Any, Any], str | None],
                     draw: Callable[[Any], Any], name: str,
                     diagnose: Callable[[Any], str | None] = lambda got: None,
                     hint: str = "replay the trace one line at a time on paper",
                     verbose: bool = True) -> PredictionReport:
    """Grade one prediction: one line, and a picture when it is wrong.

    ``read(predicted)`` turns the reader's value into the form ``expected``
    has, raising ``AssertionError`` with the expected shape when it cannot;
    ``compare(got, expected)`` returns ``None`` when they agree, else the
    first difference in words; ``draw(got)`` returns the picture of the
    expected state beside the predicted one; ``diagnose(got)`` names a known
    mistake, or ``None``. ``name`` is the property's line.
    """
    if predicted is None:
        report = PredictionReport(title, stub=True, variable=variable)
        if verbose:
            print(str(report))
        return report
    state: dict = {}

    def body():
        got = read(predicted)
        state["got"] = got
        difference = compare(got, expected)
        if difference:
            raise WrongAnswer(difference, diagnose(got))

    with Checker(title, verbose=False) as c:
        c.prop(name, body, hint)
    results = c.report.results
    picture = None
    if not all(r.passed for r in results):
        try:
            picture = draw(state.get("got", predicted))
        except Exception:  # noqa: BLE001 -- a prediction too malformed to draw: the line says why
            picture = None
    report = PredictionReport(title, results=results, variable=variable, picture=picture)
    if verbose:
        print(str(report))
        if picture is not None:
            show(picture)
    return report
