"""Exercise 8's prediction and design tasks (issue 36 §3, §4).

The prediction (who runs and who is preempted in step 4): the solution's
answer passes, an empty one prints one line, each modelled misunderstanding
is named and drawn, a malformed one is a red line. The design (the smallest
pool that never preempts): the right size passes, a pool that preempts or
one that is not the smallest fails with what it found, and an invalid one
is refused with its reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv import checks
from pagedkv.checks import ch08_tasks as tasks

ROOT = Path(__file__).resolve().parents[2]
RIGHT = {"runs": ["A", "B"], "preempted": ["D", "C"], "waiting": ["C", "D", "E"]}


def flat(result) -> str:
    return " ".join(result.line().split())


def test_the_right_step_passes_in_any_order_of_runs(capsys):
    assert checks.check_step_prediction(RIGHT)
    assert checks.check_step_prediction({**RIGHT, "runs": ["B", "A"]})
    assert "\u274c" not in capsys.readouterr().out


def test_the_list_model_is_the_library():
    sched, out, _ = tasks.run_step_trace()
    assert list(out.num_scheduled_tokens) == RIGHT["runs"]
    assert out.preempted_req_ids == RIGHT["preempted"]
    assert [r.request_id for r in sched.waiting] == RIGHT["waiting"]
    assert tasks.step_model() == RIGHT


def test_an_empty_prediction_prints_one_line(capsys):
    report = checks.check_step_prediction(None)
    assert report.stub and capsys.readouterr().out.count("\n") == 1


@pytest.mark.parametrize("mistake", tasks.STEP_MISTAKES, ids=lambda m: m.name)
def test_each_misunderstanding_is_named_and_drawn(mistake):
    got = mistake.model()
    assert got != RIGHT
    report = checks.check_step_prediction(got)
    line = flat(report.results[0])
    assert line.startswith("\u274c") and f"Diagnosis: {mistake.name} --" in line
    assert report.picture.count("pagedkv-paged-layout") == 2


@pytest.mark.parametrize("predicted, words", [
    ("A B", "got str"),
    ({"runs": ["A"]}, "its keys are ['runs']"),
    ({**RIGHT, "runs": "AB"}, "predicted_step['runs'] is str"),
    ({**RIGHT, "preempted": [4]}, "holds 4, not a request id"),
    ({**RIGHT, "waiting": ["C", "D", "F"]}, "names 'F': the requests are A, B, C, D and E"),
])
def test_a_malformed_prediction_is_a_red_line(predicted, words):
    report = checks.check_step_prediction(predicted)
    assert not report and words in flat(report.results[0])


def test_the_order_of_the_victims_matters():
    report = checks.check_step_prediction({**RIGHT, "preempted": ["C", "D"]})
    assert "who is preempted, in order: you predicted ['C', 'D'], the trace preempts ['D', 'C']" \
        in flat(report.results[0])


def test_the_notebooks_show_the_trace_the_checker_runs():
    for folder in ("exercises", "solutions"):
        nb = json.loads((ROOT / folder / "08_serving_engine.ipynb").read_text())
        text = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        assert "```python\n" + tasks.STEP_TRACE.rstrip("\n") + "\n```" in text


# ------------------------------------------------------------------ the pool design
def test_the_smallest_pool_passes_and_is_the_smallest():
    assert checks.check_pool_design(9)
    assert tasks.run_pool_design(9)[0] == 0 and tasks.run_pool_design(8)[0] > 0
    # larger pools never preempt either: the property is the edge, not a guess
    assert all(tasks.run_pool_design(n)[0] == 0 for n in range(9, 16))


def test_a_pool_that_preempts_says_so_and_is_drawn():
    report = checks.check_pool_design(8)
    assert "on 8 blocks (7 usable) the workload preempts 2 time(s)" in flat(report.results[0])
    assert report.picture is not None  # the KV usage of the runs on 7, 8 and 9 blocks


def test_a_pool_that_is_not_the_smallest_says_so():
    report = checks.check_pool_design(12)
    assert "on 11 blocks it runs without a preemption too: 12 is not the smallest" \
        in flat(report.results[0])


@pytest.mark.parametrize("size, reason", [
    (9.0, "expected num_gpu_blocks as an int, got float"),
    (True, "expected num_gpu_blocks as an int, got bool"),
    ("9", "expected num_gpu_blocks as an int, got str"),
    (1, "try a pool from 2 to 200 blocks"),
    (6, "the engine refuses to start on 6 blocks: one 24-token request (max_model_len) needs 6"),
])
def test_an_invalid_pool_is_refused_with_its_reason(size, reason):
    report = checks.check_pool_design(size)
    assert not report and reason in flat(report.results[0])


def test_the_pool_design_waits_for_a_design(capsys):
    report = checks.check_pool_design(None)
    assert report.stub and capsys.readouterr().out.count("\n") == 1


# ------------------------------------------------------------ issue 45: the misread rule named
def _library_step():
    sched, out, _ = tasks.run_step_trace()
    return {"runs": list(out.num_scheduled_tokens), "preempted": list(out.preempted_req_ids),
            "waiting": [r.request_id for r in sched.waiting]}


def test_the_waiting_queue_in_preemption_order_is_named():
    right = _library_step()
    assert len(right["preempted"]) >= 2, "the trace must preempt twice for the order to show"
    victims = right["preempted"]
    got = {**right, "waiting": victims + [r for r in right["waiting"] if r not in victims]}
    assert got != right
    line = flat(checks.check_step_prediction(got).results[0])
    assert "Diagnosis: the waiting queue in preemption order --" in line, line
    assert "Hint:" not in line


def test_admitting_after_a_preemption_is_named_whoever_is_admitted():
    right = _library_step()
    from pagedkv.engine import EngineRequest, ModelRunnerOutput, Scheduler
    from pagedkv.kv_cache_manager import KVCacheManager
    ns = {"KVCacheManager": KVCacheManager, "Scheduler": Scheduler,
          "EngineRequest": EngineRequest, "ModelRunnerOutput": ModelRunnerOutput}
    exec(tasks.STEP_TRACE.replace("out = step()", "pass"), ns)  # the trace up to step 3
    running_before = [r.request_id for r in ns["sched"].running]
    assert right["preempted"] and set(right["runs"]) <= set(running_before)
    newcomer = next(r for r in right["waiting"] if r not in right["preempted"])
    victim = right["preempted"][-1]
    for admitted in (newcomer, victim):
        got = {"runs": right["runs"] + [admitted], "preempted": right["preempted"],
               "waiting": [r for r in right["waiting"] if r != admitted]}
        line = flat(checks.check_step_prediction(got).results[0])
        assert "Diagnosis: admitting after a preemption --" in line, (admitted, line)
        assert "Hint:" not in line
