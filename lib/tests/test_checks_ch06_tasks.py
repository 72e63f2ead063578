"""Exercise 6's prediction and design tasks (issue 36 §3, §4).

The prediction: the solution's tables and copies pass, an empty one prints
one line, each modelled misunderstanding is named, a malformed one is a red
line, and a wrong one is drawn beside the trace's picture. The designs: any
valid design passes, an invalid one is refused with its reason, a valid one
that misses is drawn.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv import checks
from pagedkv.checks import ch06_copy_prediction as cp
from pagedkv.checks import ch06_designs as designs

ROOT = Path(__file__).resolve().parents[2]
RIGHT_TABLES = {"B": [1, 4, 5], "C": [1, 2, 6], "D": [1, 2, 7]}
RIGHT_COPIES = [(2, 4), (3, 7)]


def flat(result) -> str:
    return " ".join(result.line().split())


# ------------------------------------------------------------------ prediction
def test_the_right_prediction_passes(capsys):
    report = checks.check_copy_prediction(RIGHT_TABLES, RIGHT_COPIES)
    assert report and report.picture is None
    assert "\u274c" not in capsys.readouterr().out


def test_lists_for_pairs_are_read_as_pairs():
    assert checks.check_copy_prediction(RIGHT_TABLES, [[2, 4], [3, 7]])


def test_an_empty_prediction_prints_one_line(capsys):
    report = checks.check_copy_prediction(None, None)
    assert not report and report.stub
    out = capsys.readouterr().out
    assert "not made yet" in out and "predicted_tables and" in out
    assert out.count("\u274c") == 1


def test_half_a_prediction_asks_for_the_other_half():
    report = checks.check_copy_prediction(RIGHT_TABLES, None)
    assert not report and "predicted_copies is still None" in report.results[0].detail


@pytest.mark.parametrize("mistake", cp.COPY_MISTAKES, ids=lambda m: m.name)
def test_each_misunderstanding_is_named_and_drawn(mistake):
    tables, copies = mistake.model()
    assert (tables, copies) != (RIGHT_TABLES, RIGHT_COPIES)
    report = checks.check_copy_prediction(tables, copies)
    line = flat(report.results[0])
    assert line.startswith("\u274c") and f"Diagnosis: {mistake.name} --" in line
    # the book's own picture, twice: the trace's state and the predicted one
    assert report.picture.count("pagedkv-paged-layout") == 2
    assert "What the trace leads to" in report.picture and "Your prediction" in report.picture


@pytest.mark.parametrize("tables, copies, words", [
    ("B C D", RIGHT_COPIES, "predicted_tables is str"),
    ({"B": [1, 4, 5]}, RIGHT_COPIES, "predicted_tables names ['B']"),
    ({**RIGHT_TABLES, "C": [1, 2, "6"]}, RIGHT_COPIES, "holds '6'"),
    (RIGHT_TABLES, [(2, 4, 5)], "predicted_copies[0] has 3 ids"),
    (RIGHT_TABLES, "(2, 4)", "predicted_copies is str"),
])
def test_a_malformed_prediction_is_a_red_line(tables, copies, words):
    report = checks.check_copy_prediction(tables, copies)
    assert not report and words in report.results[0].detail


def test_the_first_difference_is_named():
    report = checks.check_copy_prediction({**RIGHT_TABLES, "D": [1, 2, 7, 8]}, RIGHT_COPIES)
    assert "D's table: you predicted [1, 2, 7, 8], the trace leaves [1, 2, 7]" in flat(report.results[0])


def test_the_notebooks_show_the_trace_the_checker_runs():
    for folder in ("exercises", "solutions"):
        nb = json.loads((ROOT / folder / "06_copy_on_write.ipynb").read_text())
        text = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        assert "```python\n" + cp.COPY_TRACE.rstrip("\n") + "\n```" in text


def test_the_list_model_agrees_with_the_library():
    manager, requests, copies = cp.run_copy_trace()
    tables = {r.request_id: manager.get_block_ids(r.request_id) for r in requests[1:]}
    assert (tables, copies) == cp.copy_model() == (RIGHT_TABLES, RIGHT_COPIES)


# ------------------------------------------------------------------ the resumption design
GOOD = [("admit", "V", 17), ("preempt", "V"), ("admit", "X", 36), ("finish", "X"), ("resume", "V")]


@pytest.mark.parametrize("trace", [
    GOOD,
    # another design: fill the pool around V first, then free it
    [("admit", "W", 20), ("admit", "V", 17), ("preempt", "V"), ("admit", "X", 16),
     ("finish", "W"), ("resume", "V")],
])
def test_any_valid_resumption_design_passes(trace):
    result = designs.run_resume_design(trace)
    assert result["hits"] == 2
    assert checks.check_resume_design(trace)


@pytest.mark.parametrize("trace, reason", [
    ("admit V", "expected a list of steps, got str"),
    ([("admit", "V", 16)], "V's prompt is 17 tokens, not 16"),
    ([("admit", "V", 17), ("preempt", "W")], "W is not running, so it cannot preempt"),
    ([("admit", "V", 17), ("resume", "V")], "V is not preempted, so it cannot resume"),
    ([("admit", "V", 17), ("admit", "V", 17)], "V was admitted before"),
    ([("admit", "V", 17), ("preempt", "V")], "the trace never resumes V: resume V somewhere"),
    ([("admit", "X", 8)], "admit V somewhere"),
    ([("admit", "V", 17), ("preempt", "V"), ("admit", "X", 33), ("resume", "V")],
     "the pool cannot resume V"),
    ([("admit", "V", 17), ("admit", "X", 64)], "the pool cannot admit X"),
    ([("evict", "V")], "'evict' is no step"),
    ([("admit", "V")], "write ('admit', name, num_tokens)"),
    ([("admit", "V", 17.0)], "num_tokens must be an int"),
    ([("admit", "V", 17)] + [("admit", f"X{i}", 1) for i in range(12)], "13 steps: at most 12"),
])
def test_an_invalid_design_is_refused_with_its_reason(trace, reason):
    report = checks.check_resume_design(trace)
    assert not report and reason in flat(report.results[0])


def test_a_valid_design_that_misses_says_what_it_found_and_draws_the_pool():
    trace = [("admit", "V", 17), ("preempt", "V"), ("admit", "X", 20), ("finish", "X"), ("resume", "V")]
    report = checks.check_resume_design(trace)
    assert "V resumed at step 4 and hit 4 of its old blocks [1, 2, 3, 4, 5]" in flat(report.results[0])
    assert "pagedkv-pool" in report.picture and "old blocks outlined" in report.picture


def test_the_resumption_design_waits_for_a_design(capsys):
    report = checks.check_resume_design(None)
    assert report.stub and capsys.readouterr().out.count("\n") == 1


# ------------------------------------------------------------------ the block-size design
SYSTEM = list(range(1000, 1064))


@pytest.mark.parametrize("workload", [
    [SYSTEM, list(SYSTEM)],
    [SYSTEM[:50] + [1], SYSTEM[:50] + [2], SYSTEM[:40] + [3, 4]],
])
def test_any_losing_workload_passes(workload):
    assert checks.check_block_size_design(workload)


def test_the_hits_are_the_capped_prefix_in_whole_blocks():
    got = designs.run_block_size_design([SYSTEM, list(SYSTEM)])
    assert got[16]["hits"] == [0, 48] and got[32]["hits"] == [0, 32]


@pytest.mark.parametrize("workload, reason", [
    ([SYSTEM], "1 prompts: from 2 to 8"),
    ([SYSTEM, SYSTEM[:10]], "prompt 1 shares 10 tokens with an earlier prompt at most"),
    ([SYSTEM, "abc"], "prompt 1 is str"),
    ([SYSTEM, SYSTEM + [-1]], "token ids are ints from 0 to 49,999"),
    ([SYSTEM, list(range(300))], "prompt 1 has 300 tokens"),
    ({"a": SYSTEM}, "got dict"),
])
def test_an_invalid_workload_is_refused_with_its_reason(workload, reason):
    report = checks.check_block_size_design(workload)
    assert not report and reason in flat(report.results[0])


def test_a_workload_that_loses_nothing_is_drawn_at_both_block_sizes():
    report = checks.check_block_size_design([SYSTEM, SYSTEM[:40] + [1]])
    assert "[0, 32] at block size 16, [0, 32] at 32" in flat(report.results[0])
    assert "block size 16: hits" in report.picture and "block size 32: hits" in report.picture
