"""Exercise 8's victim policy (modify and measure) and planted bug (find it with check()).

The answers are the solution notebook's cells; a first attempt is what a
newcomer writes before measuring or before calling ``check()`` after every
step, and each must fail with a line that names what it misread.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.checks import ch08_find_bug, ch08_victims
from pagedkv.engine import preempt_last_running

ROOT = Path(__file__).resolve().parents[2]


def _cell(notebook: str, marker: str) -> dict:
    cells = json.loads((ROOT / notebook).read_text())["cells"]
    src = next("".join(c["source"]) for c in cells if c["cell_type"] == "code" and marker in "".join(c["source"]))
    ns: dict = {}
    exec(src, ns)  # noqa: S102 -- the notebook's own cell
    return ns


def failures(report) -> dict:
    return {r.name: r.detail for r in report.results if not r.passed}


def longest(running, request):
    return max(running, key=lambda r: r.num_computed_tokens)


def lowest_priority(running, request):
    return max(running, key=lambda r: (r.priority, r.arrival))


PREDICTION = "your prediction matches the measurement, metric by metric"
RUNS = "your rule runs the workload, check() holding after every step, and differs from the default"


def test_the_three_rules_measure_differently_on_the_workload():
    # the workload is built so that the rules disagree: otherwise the task measures nothing
    runs = {name: ch08_victims.drive(ch08_victims.victim_loop(rule))
            for name, rule in [("newest", ch08_victims.newest), ("longest", longest),
                               ("lowest", lowest_priority)]}
    assert all(r.broke is None and len(r.ttft) == 6 for r in runs.values())
    assert runs["longest"].preemptions < runs["newest"].preemptions
    assert runs["longest"].recomputed > runs["newest"].recomputed
    assert runs["longest"].mean_ttft > runs["newest"].mean_ttft
    assert runs["lowest"].mean_ttft < runs["newest"].mean_ttft


def test_the_solution_rule_and_prediction_pass():
    ns = _cell("solutions/08_serving_engine.ipynb", "def choose_victim(")
    report = ch08_victims.check_victim_policy(ns["choose_victim"], ns["predicted"])
    assert report, failures(report)


@pytest.mark.parametrize("predicted, words", [
    # "fewer preemptions, so less work lost": the size of each victim forgotten
    ({"preemptions": "fewer", "recomputed": "fewer", "mean_ttft": "more"}, "fewer preemptions of bigger victims"),
    # "more blocks freed at once, so newcomers get in sooner"
    ({"preemptions": "fewer", "recomputed": "more", "mean_ttft": "fewer"}, "a preempted request queues ahead"),
    # "the longest holds more, so it is preempted more often"
    ({"preemptions": "more", "recomputed": "more", "mean_ttft": "more"}, "a bigger victim frees more blocks"),
])
def test_first_predictions_for_longest_first_are_named(predicted, words):
    failed = failures(ch08_victims.check_victim_policy(longest, predicted))
    assert list(failed) == [PREDICTION] and words in failed[PREDICTION], failed


def test_the_default_rule_is_not_a_change_and_a_bad_victim_is_refused():
    failed = failures(ch08_victims.check_victim_policy(ch08_victims.newest, None))
    assert "change the policy" in failed[RUNS]

    def outsider(running, request):
        return type(request)("Z", [1], 1)

    failed = failures(ch08_victims.check_victim_policy(outsider, None))
    assert "the victim must be one of the running requests" in failed[RUNS]


# ------------------------------------------------------------------ the planted loop
FOUND = "found: the first step check() fails, the request and the invariant"
FIXED = "the fixed loop: check() holds after every step, and the victim is still the longest"


def test_the_notebook_builds_the_planted_loop():
    ns = _cell("exercises/08_serving_engine.ipynb", "def make_room_longest(")
    planted = ch08_victims.drive(ns["make_room_longest"])
    assert planted.broke == ch08_victims.drive(ch08_find_bug.PLANTED).broke
    assert ch08_find_bug.planted_failure() == {
        "step": planted.broke[0], "request": "B", "invariant": "a waiting request has computed nothing"}


def test_the_solution_passes():
    found = _cell("solutions/08_serving_engine.ipynb", "found = {")["found"]
    fixed = _cell("solutions/08_serving_engine.ipynb", "def make_room_fixed(")["make_room_fixed"]
    report = ch08_find_bug.check_keep_progress_bug(found, fixed)
    assert report, failures(report)


@pytest.mark.parametrize("change, words", [
    # check() called once, after the run: another invariant, at the last step
    ({"step": 27, "invariant": "the running requests hold blocks, no others"}, "check() only at the end"),
    # the request that asked for room, not the one check() names
    ({"request": "A"}, "another request"),
    # a paraphrase of the invariant
    ({"invariant": "preempted requests hold no blocks"}, "another invariant"),
])
def test_first_localisations_are_named(change, words):
    fixed = _cell("solutions/08_serving_engine.ipynb", "def make_room_fixed(")["make_room_fixed"]
    found = dict(ch08_find_bug.planted_failure(), **change)
    failed = failures(ch08_find_bug.check_keep_progress_bug(found, fixed))
    assert list(failed) == [FOUND] and words in failed[FOUND], failed


def test_first_fixes_are_rejected():
    found = ch08_find_bug.planted_failure()
    # the library's loop: check() holds, but the policy is gone
    failed = failures(ch08_find_bug.check_keep_progress_bug(found, preempt_last_running))
    assert "the victim is the running request that has computed the most" in failed[FIXED]
    # the planted loop handed back: the invariant still breaks
    failed = failures(ch08_find_bug.check_keep_progress_bug(found, ch08_find_bug.PLANTED))
    assert "a waiting request has computed nothing" in failed[FIXED]

    # keeping the progress only when the victim is not the request itself: still broken
    def half_fixed(scheduler, request, n):
        while True:
            blocks = scheduler.kv_cache_manager.allocate_slots(request, n)
            if blocks is not None:
                return blocks
            victim = max(scheduler.running, key=lambda r: r.num_computed_tokens)
            kept = victim.num_computed_tokens
            scheduler.preempt(victim)
            if victim is request:
                return None
            victim.num_computed_tokens = kept // 4 * 4

    failed = failures(ch08_find_bug.check_keep_progress_bug(found, half_fixed))
    assert "a waiting request has computed nothing" in failed[FIXED]


def test_the_untouched_task_is_one_line():
    report = ch08_find_bug.check_keep_progress_bug(None, None)
    assert report.stub and len(report.results) == 1
