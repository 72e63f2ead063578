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
        with ch08.one_thread():
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
    out = capsys.readouterr().out  # one message (wrapped to fit the column), no property run
    assert out.count("\u274c") == 1 and "\u2705" not in out and max(map(len, out.splitlines())) <= 79


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


# -- issue 27: the later tasks (worker table, token budget, n > 1, log line) ----------------------------

from pagedkv.checks import ch08_diagnose as diag  # noqa: E402
from pagedkv.checks import ch08_engine_tasks as tasks  # noqa: E402
from pagedkv.checks import ch08_fan_out as fan  # noqa: E402


@functools.cache
def solution(name):
    """A function of the solution notebook, with the names its import cell gives it."""
    import re

    from pagedkv.common import cdiv

    fn = load_cell_function(SOLUTION, name)
    fn.__globals__.update(re=re, cdiv=cdiv)
    return fn


def remove_row(table, row_of, rid):
    return load_cell_function(SOLUTION, "remove_row")(table, row_of, rid)


@pytest.mark.parametrize("name, count", [("update_block_table", 4), ("tokens_this_step", 4),
                                         ("fan_out", 3), ("blocks_in_use", 3), ("diagnose", 4)])
def test_each_later_solution_passes(name, count, capsys):
    report = getattr(checks, f"check_{name}")(solution(name))
    assert report and len(report.results) == count
    assert "\u274c" not in capsys.readouterr().out


@pytest.mark.parametrize("name, args", [("update_block_table", 3), ("tokens_this_step", 4),
                                        ("fan_out", 3), ("blocks_in_use", 4), ("diagnose", 1)])
def test_each_later_stub_prints_one_line(name, args, capsys):
    def stub(*a):
        raise NotImplementedError

    report = getattr(checks, f"check_{name}")(stub)
    assert report.stub and len(report.results) == 1
    assert capsys.readouterr().out.count("\n") == 1


# 1. the worker's table


def _update(running_with_add=False, remove=("finished", "preempted"), resumed_append=False, clear=False):
    def update(table, row_of, out):
        leaving = []
        if "finished" in remove:
            leaving += out.finished_req_ids
        if "preempted" in remove:
            leaving += out.preempted_req_ids
        for rid in leaving:
            if clear:
                table.clear_row(row_of.pop(rid))
            else:
                remove_row(table, row_of, rid)
        for rid in out.num_scheduled_tokens:
            ids = out.new_block_ids.get(rid, [])
            if rid in out.scheduled_running_reqs or (resumed_append and rid in out.scheduled_resumed_reqs):
                if running_with_add and rid in out.scheduled_running_reqs:
                    table.add_row(ids, row_of[rid])
                else:
                    table.append_row(ids, row_of[rid])
            elif rid in row_of:  # kept through its preemption: appended to
                table.append_row(ids, row_of[rid])
            else:
                row_of[rid] = len(row_of)
                table.add_row(ids, row_of[rid])
    return update


TABLE_CASES = {
    "add_row for running": (_update(running_with_add=True), "add_row for a running request (overwrites)"),
    "resumed appended": (_update(resumed_append=True), "append_row for a resumed request (stale blocks kept)"),
    "preempted kept": (_update(remove=("finished",)), "forgot the preempted rows"),
    "finished kept": (_update(remove=("preempted",)), "forgot the finished rows"),
    "holes": (_update(clear=True), "left a hole in the rows"),
}


@pytest.mark.parametrize("case", list(TABLE_CASES))
def test_table_mistakes_are_named(case):
    fn, mistake = TABLE_CASES[case]
    details = failures(checks.check_update_block_table(fn))
    assert details and all(f"Diagnosis: {mistake}" in d for d in details), details


def test_a_kept_preempted_row_fails_only_where_someone_is_preempted():
    report = checks.check_update_block_table(TABLE_CASES["preempted kept"][0])
    assert [r.passed for r in report.results] == [True, False, False, True]


# 2. the token budget


@pytest.mark.parametrize("mistake", tasks.BUDGET_MISTAKES, ids=lambda m: m.name)
def test_budget_mistakes_are_named(mistake):
    details = failures(checks.check_tokens_this_step(mistake.model))
    assert details and all(f"Diagnosis: {mistake.name} --" in d for d in details), details


def test_the_budget_oracle_agrees_with_the_scheduler():
    states = tasks._budget_states(3, 200)
    assert all(tasks._budget_reference(*s[:4]) == s[4] for s in states)
    # the states reach every branch: a chunk, a running chunk, the seat limit
    assert any(0 < s[4][-1] < s[2][-1] for s in states if s[2])
    assert any(max(s[1], default=0) > 1 for s in states)
    assert any(len(s[1]) + sum(1 for x in s[4][len(s[1]):] if x) == s[3] and 0 in s[4][len(s[1]):]
               for s in states)


def test_a_short_answer_is_refused_without_a_diagnosis():
    details = failures(checks.check_tokens_this_step(lambda b, r, w, m: tasks._budget_reference(b, r, w, m)[:-1]))
    assert details and "one each, 0 for a request that gets nothing" in details[0]


# 3. n > 1


@pytest.mark.parametrize("mistake", fan.FAN_OUT_MISTAKES, ids=lambda m: m.name)
def test_fan_out_mistakes_are_named(mistake):
    details = failures(checks.check_fan_out(mistake.model))
    assert details and all(f"Diagnosis: {mistake.name} --" in d for d in details), details


@pytest.mark.parametrize("mistake", fan.BLOCKS_MISTAKES, ids=lambda m: m.name)
def test_blocks_mistakes_are_named(mistake):
    details = failures(checks.check_blocks_in_use(mistake.model))
    assert details and all(f"Diagnosis: {mistake.name} --" in d for d in details), details


# 4. the log line


@pytest.mark.parametrize("mistake", diag.DIAGNOSE_MISTAKES, ids=lambda m: m.name)
def test_diagnose_mistakes_are_named(mistake):
    details = failures(checks.check_diagnose(mistake.model))
    assert details and all(f"Diagnosis: {mistake.name} --" in d for d in details), details


def test_a_parser_that_needs_a_preemptions_part_is_named():
    import re

    good = solution("diagnose")

    def needs_it(line):
        int(re.search(r"Preemptions: (\d+)", line).group(1))
        return good(line)

    details = failures(checks.check_diagnose(needs_it))
    assert details and all("expected a Preemptions part in every line" in d for d in details), details


def test_the_engine_runs_give_every_verdict():
    verdicts = {diag._expected_verdict(stats) for _, stats in diag._engine_lines(0)}
    assert verdicts == set(diag.VERDICTS)


# -- issue 36 §7: the two gaps the wider set of wrong answers found ----------------------------------


def test_a_strict_threshold_fails_at_exactly_90_percent_and_is_named():
    good = solution("diagnose")

    def strict(line):  # "> 90" where the rule says "at least 90%"
        verdict = good(line)
        if verdict == "memory-bound" and "usage: 90.0%" in line:
            return "queue-bound"
        return verdict

    report = checks.check_diagnose(strict)
    failed = [r for r in report.results if not r.passed]
    assert [r.name for r in failed] == ["memory-bound: a queue behind a full pool (90.0% included)"]
    line = " ".join(failed[0].line().split())
    assert line.startswith("\u274c") and "usage: 90.0%" in line
    assert "you said 'queue-bound', expected 'memory-bound'" in line
    assert "Diagnosis: a strict > at the threshold -- the rule is a usage of at least 90%" in line


def _add_first(table, row_of, out):
    """Adds the arrivals first, then removes the departures: fine until the table is full."""
    for rid in out.num_scheduled_tokens:
        ids = out.new_block_ids.get(rid, [])
        if rid in out.scheduled_running_reqs:
            table.append_row(ids, row_of[rid])
        else:
            row_of[rid] = len(row_of)
            table.add_row(ids, row_of[rid])
    for rid in out.finished_req_ids + out.preempted_req_ids:
        remove_row(table, row_of, rid)


def test_adding_arrivals_before_removing_departures_fails_on_a_full_table_by_name():
    report = checks.check_update_block_table(_add_first)
    # the roomy scenarios never fill the table, so only the full one catches it
    assert [r.passed for r in report.results] == [True, True, True, False]
    line = " ".join(report.results[3].line().split())
    assert line.startswith("\u274c a full table: a request joins as another leaves")
    assert "all 3 rows were in use" in line
    assert "Diagnosis: added arrivals before removing departures -- the table has max_num_seqs rows" in line


def test_a_kept_finished_row_on_the_full_table_is_not_called_adding_first():
    details = failures(checks.check_update_block_table(TABLE_CASES["finished kept"][0]))
    assert details and not any("added arrivals before removing" in d for d in details)
