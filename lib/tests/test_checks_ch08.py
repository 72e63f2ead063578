"""The chapter 8 checker: the solution notebook's loop passes; each mistake fails with its own diagnosis.

The loop under test is the one committed in solutions/08_serving_engine.ipynb,
so the solution the site shows is the one these tests run.
"""

from __future__ import annotations

import collections
import functools
from pathlib import Path

import pytest
import torch

from pagedkv import checks
from tools.notebooks import load_cell_function
from pagedkv.checks import ch08_serving_engine as ch08
from pagedkv.engine import preempt_last_running

SOLUTION = Path(__file__).resolve().parents[2] / "solutions" / "08_serving_engine.ipynb"


@functools.cache
def solution_loop():
    return load_cell_function(SOLUTION, "allocate_with_preemption")


def failures(report) -> list[str]:
    return [r.detail for r in report.results if not r.passed]


def test_solution_passes_every_property(capsys):
    report = checks.check_preemption_loop(solution_loop())
    assert report and len(report.results) == 8
    assert "\u274c" not in capsys.readouterr().out
    # The engine runs are compared with the library's loop, and say so.
    engine_names = [r.name for r in report.results if r.name.startswith("engine, ")]
    assert len(engine_names) == 5
    assert all(n.endswith(": as preempt_last_running") for n in engine_names)
    assert not any("vLLM" in r.name for r in report.results)


def test_a_differently_written_correct_loop_passes():
    def loop(scheduler, request, num_new_tokens):
        manager = scheduler.kv_cache_manager
        blocks = manager.allocate_slots(request, num_new_tokens)
        while blocks is None and request in scheduler.running:
            scheduler.preempt(max(scheduler.running, key=lambda r: r.arrival))
            if request in scheduler.running:
                blocks = manager.allocate_slots(request, num_new_tokens)
        return blocks

    assert checks.check_preemption_loop(loop, seed=1)


def test_untouched_stub_prints_one_line(capsys):
    def stub(scheduler, request, num_new_tokens):
        raise NotImplementedError

    report = checks.check_preemption_loop(stub)
    assert len(report.results) == 1 and "not implemented yet" in report.results[0].detail
    out = capsys.readouterr().out
    assert "Hint" not in out and out.count("not implemented yet") == 1


def alloc(scheduler, request, n):
    return scheduler.kv_cache_manager.allocate_slots(request, n)


def preempt_first(scheduler, request, n):
    while (blocks := alloc(scheduler, request, n)) is None:
        victim = scheduler.running[0]
        scheduler.preempt(victim)
        if victim is request:
            return None
    return blocks


def give_up(scheduler, request, n):
    return alloc(scheduler, request, n)


def retry_forever(scheduler, request, n):
    while (blocks := alloc(scheduler, request, n)) is None:
        pass
    return blocks


def no_stop_at_self(scheduler, request, n):
    while True:
        blocks = alloc(scheduler, request, n)
        if blocks is not None:
            return blocks
        scheduler.preempt(scheduler.running[-1])


def empty_list_for_self(scheduler, request, n):
    while (blocks := alloc(scheduler, request, n)) is None:
        victim = scheduler.running[-1]
        scheduler.preempt(victim)
        if victim is request:
            return []
    return blocks


def preempt_before_trying(scheduler, request, n):
    while True:
        victim = scheduler.running[-1]
        scheduler.preempt(victim)
        if victim is request:
            return None
        blocks = alloc(scheduler, request, n)
        if blocks is not None:
            return blocks


def one_victim_at_most(scheduler, request, n):
    blocks = alloc(scheduler, request, n)
    if blocks is None:
        victim = scheduler.running[-1]
        scheduler.preempt(victim)
        if victim is not request:
            blocks = alloc(scheduler, request, n)
    return blocks


def free_directly(scheduler, request, n):
    while (blocks := alloc(scheduler, request, n)) is None:
        victim = scheduler.running[-1]
        scheduler.kv_cache_manager.free(victim)
        scheduler.running.remove(victim)
        if victim is request:
            return None
    return blocks


def requeue_at_back(scheduler, request, n):
    while (blocks := alloc(scheduler, request, n)) is None:
        victim = scheduler.running[-1]
        scheduler.preempt(victim)
        scheduler.waiting.remove(victim.request_id)
        scheduler.waiting.append(victim)
        if victim is request:
            return None
    return blocks


MISTAKES = {
    preempt_first: "preempted the first running request (",
    give_up: "gave up without preempting",
    retry_forever: "never stops",
    no_stop_at_self: "did not stop when the request itself was preempted",
    empty_list_for_self: "returned blocks for a preempted request",
    preempt_before_trying: "preempted someone when the request already fit",
    one_victim_at_most: "returned None while X was still running",
    free_directly: "with kv_cache_manager.free",
    requeue_at_back: "do not move it to the back",
}


@pytest.mark.parametrize("mistake", list(MISTAKES), ids=lambda f: f.__name__)
def test_each_mistake_fails_with_its_diagnosis(mistake):
    details = failures(checks.check_preemption_loop(mistake))
    assert details, mistake.__name__
    assert all(MISTAKES[mistake] in d for d in details), details
    other = [w for f, w in MISTAKES.items() if f is not mistake]
    assert not any(w in d for d in details for w in other), details


def test_a_loop_that_hangs_is_stopped_and_named(capsys):
    def hang(scheduler, request, n):
        while True:
            pass

    report = checks.check_preemption_loop(hang, timeout=1.0)
    assert len(report.results) == 1 and "no answer within 1 s" in report.results[0].detail
    assert "never stops" in report.results[0].detail


def test_a_foul_caught_by_the_learner_still_counts():
    def swallows(scheduler, request, n):
        try:
            return preempt_first(scheduler, request, n)
        except Exception:  # noqa: BLE001 -- the mistake under test
            return preempt_last_running(scheduler, request, n)

    details = failures(checks.check_preemption_loop(swallows))
    assert details and all("preempted the first running request" in d for d in details)


def test_a_different_decision_without_a_foul_is_caught_by_the_step_comparison():
    def lookahead(scheduler, request, n):  # every move is legal, but it asks for 4 extra slots
        manager = scheduler.kv_cache_manager
        while (blocks := manager.allocate_slots(request, n, num_lookahead_tokens=4)) is None:
            victim = scheduler.running[-1]
            scheduler.preempt(victim)
            if victim is request:
                return None
        return blocks

    details = failures(checks.check_preemption_loop(lookahead))
    assert any("preempt_last_running \u00ab" in d or "other blocks" in d for d in details), details
    assert any("expected it to have" in d for d in details), details


def test_the_scenarios_take_every_branch_of_the_loop():
    """Engines: fits at once, after one victim, preempts itself; hand-built pools: two victims, then itself."""
    seen = collections.Counter()

    def counting(scheduler, request, n):
        victims = 0
        while (blocks := alloc(scheduler, request, n)) is None:
            victim = scheduler.running[-1]
            scheduler.preempt(victim)
            victims += 1
            if victim is request:
                seen[f"itself after {victims - 1}", kind] += 1
                return None
        seen[f"fits after {victims}", kind] += 1
        return blocks

    kind = "engine"
    for scenario in ch08._scenarios(0).values():
        with ch08._one_thread():
            for _ in ch08._steps(scenario, counting):
                pass
    kind = "hand-built"
    for spec, free, rid, n in ch08.HAND_BUILT.values():
        sched = ch08._hand_built(spec, free)
        counting(sched, sched.requests[rid], n)
    for branch in ("fits after 0", "fits after 1", "itself after 0"):
        assert seen[branch, "engine"] >= 3, seen
    for branch in ("fits after 0", "fits after 1", "fits after 2", "itself after 0", "itself after 2"):
        assert seen[branch, "hand-built"] >= 1, seen


def test_the_checker_restores_torch_threads():
    before = torch.get_num_threads()
    checks.check_preemption_loop(give_up)
    assert torch.get_num_threads() == before


# -- issue 20: the library's own loop, messages that name the real mistake, the cost of a hang --------


@pytest.mark.parametrize("wrap", [lambda f: f, functools.partial, lambda f: functools.wraps(f)(lambda *a: f(*a))],
                         ids=["itself", "partial", "wrapped"])
def test_the_librarys_own_loop_is_refused(wrap, capsys):
    report = checks.check_preemption_loop(wrap(preempt_last_running))
    assert not report and len(report.results) == 1
    assert "the library's own preempt_last_running" in report.results[0].detail
    assert capsys.readouterr().out.count("\n") == 1


def test_freeing_directly_names_the_admission_it_causes():
    (detail, *_) = failures(checks.check_preemption_loop(free_directly))
    assert "admits waiting requests in the same step" in detail


def test_preempting_the_wrong_request_says_what_fcfs_does():
    (detail, *_) = failures(checks.check_preemption_loop(preempt_first))
    assert "vLLM's FCFS policy preempts the last request of the running list" in detail
    assert "least work" not in detail


def test_a_hang_costs_one_timeout():
    import time

    def hang(scheduler, request, n):
        while True:
            pass

    start = time.perf_counter()
    checks.check_preemption_loop(hang, timeout=0.5)
    assert time.perf_counter() - start < 0.5 + 3.0


def test_the_referee_patches_nothing_of_the_library():
    sched = ch08._hand_built([("A", 9, 8), ("X", 9, 8), ("C", 5, 4)], 0)
    seen = []

    def loop(scheduler, request, n):  # the learner's loop, looking at the real objects
        seen.append((sorted(vars(sched)), sorted(vars(sched.kv_cache_manager))))
        return preempt_first(scheduler, request, n)

    before = (sorted(vars(sched)), sorted(vars(sched.kv_cache_manager)))
    with pytest.raises(AssertionError, match="preempted the first running request"):
        ch08._Refereed(loop)(sched, sched.requests["X"], 1)
    assert seen == [before]
