"""Exercise 5's prediction task and the check of its two kernels together (issue 36 §3, §5).

The prediction (a step of Model Runner V2: rows kept for life, staged
appends, the gather): the solution's slots pass, an empty one prints one
line, each modelled misreading (of the appends, of the gather or of the slot
formula) is named and drawn with the block-major picture, a malformed one is
a red line.
The pipeline check: the solution's kernels pass, stubs print one line, and
wrong kernels fail, without the notebook importing the library's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedkv import checks
from pagedkv.checks import ch05_tasks as tasks
from pagedkv.kernels import compute_slot_mapping, reshape_and_cache

ROOT = Path(__file__).resolve().parents[2]
RIGHT = [23, 44, 45, 46, 29, 5]


def flat(result) -> str:
    return " ".join(result.line().split())


def test_the_right_slots_pass(capsys):
    assert checks.check_slot_prediction(RIGHT)
    assert checks.check_slot_prediction(tuple(RIGHT))
    assert "\u274c" not in capsys.readouterr().out


def test_the_trace_is_the_librarys():
    blocks, entries, positions, slots = tasks.run_slot_trace()
    assert slots == RIGHT
    assert blocks == {"B": [5, 11], "D": [2, 7], "C": [4, 8, 1]}


def test_an_empty_prediction_prints_one_line(capsys):
    report = checks.check_slot_prediction(None)
    assert report.stub and capsys.readouterr().out.count("\u274c") == 1


@pytest.mark.parametrize("got, name", [
    ([23, 44, 45, 46, 9, 5], "D's overwrite read as an append"),
    ([47, 0, 1, 2, 29, 5], "the tail append read as a replacement"),
    ([3, 0, 1, 2, 33, 1], "the per-request rows read by batch entry"),
    ([20, 44, 44, 44, 28, 4], "offset forgotten"),
    ([8, 11, 12, 13, 8, 2], "block id not scaled"),
])
def test_each_misreading_is_named_and_drawn(got, name):
    report = checks.check_slot_prediction(got)
    line = flat(report.results[0])
    assert line.startswith("\u274c") and f"Diagnosis: {name} --" in line
    fig = report.picture
    assert [ax.get_title() for ax in fig.axes] == ["the trace's slots", "your slots"]


def test_the_first_wrong_token_is_named():
    report = checks.check_slot_prediction([23, 44, 45, 46, 29, 6])
    assert "token 5 (C's position 9) goes to slot 5, not 6" in flat(report.results[0])


@pytest.mark.parametrize("got, words", [
    ("23 44", "got str"),
    ([23, 44], "got 2"),
    ([23, 44, 45, 46, 29, 1.5], "one slot per token"),
    ({"B": 23}, "got dict"),
])
def test_a_malformed_prediction_is_a_red_line(got, words):
    report = checks.check_slot_prediction(got)
    assert not report and words in flat(report.results[0])


def test_a_slot_outside_the_cache_is_drawn_under_the_grid():
    report = checks.check_slot_prediction([23, 44, 45, 46, 29, 500])
    assert "C9: slot 500" in report.picture.axes[1].get_xlabel()


def test_the_notebooks_show_the_trace_the_checker_runs():
    for folder in ("exercises", "solutions"):
        nb = json.loads((ROOT / folder / "05_slot_mapping.ipynb").read_text())
        text = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        assert "```python\n" + tasks.SLOT_TRACE.rstrip("\n") + "\n```" in text


# ------------------------------------------------------------------ both kernels
def test_the_librarys_kernels_pass_the_pipeline_check():
    assert checks.check_both_kernels(compute_slot_mapping, reshape_and_cache)


def test_the_pipeline_check_names_a_wrong_kernel():
    def shifted(table, reqs, positions, block_size):
        out = compute_slot_mapping(table, reqs, positions, block_size)
        return torch.where(out >= 0, out + 1, out)

    report = checks.check_both_kernels(shifted, reshape_and_cache)
    # one step through both: wrong slots put the keys and values in the wrong places too
    assert [r.passed for r in report.results] == [False, False]
    assert "your slots" in report.results[0].detail


def test_the_pipeline_check_stops_at_a_stub(capsys):
    def stub(*args):
        raise NotImplementedError

    report = checks.check_both_kernels(stub, stub)
    assert report.stub and capsys.readouterr().out.count("\n") == 1
