"""The chapter 2 checkers: right answers pass, each kind of wrong answer fails the right property."""

import time

import pytest

from pagedkv import checks


def verdicts(report):
    return [r.passed for r in report.results]


# ------------------------------------------------------------------ solutions
def tail_ok(lengths, probs, block_size):
    return sum(p * ((block_size - n % block_size) % block_size) for n, p in zip(lengths, probs))


def largest_ok(allocated, capacity):
    best, end = 0, 0
    for start, length in sorted(allocated):
        best, end = max(best, start - end), start + length
    return max(best, capacity - end)


def trace_ok(capacity):
    # Four equal extents and a remainder; free the 1st and 3rd: two separate holes.
    q = capacity // 4
    ops = [("admit", name, q) for name in "abcd"]
    if capacity % 4:
        ops.append(("admit", "rest", capacity % 4))
    ops += [("finish", "a"), ("finish", "c")]
    return ops, q + 1


def test_correct_solutions_pass_every_property(capsys):
    assert checks.check_expected_tail_waste(tail_ok)
    assert checks.check_largest_free_extent(largest_ok)
    assert checks.check_fragmenting_trace(trace_ok)
    out = capsys.readouterr().out
    assert "\u274c" not in out and out.count("\u2705") == 5 + 5 + 3


def test_numpy_answers_are_accepted():
    import numpy as np

    def tail_np(lengths, probs, block_size):
        return np.dot(probs, (-np.asarray(lengths)) % block_size)

    assert checks.check_expected_tail_waste(tail_np, cases=20)


# ------------------------------------------------------------------ (a) wrong answers
def test_forgetting_the_outer_modulo_charges_a_whole_block_for_full_sequences():
    report = checks.check_expected_tail_waste(lambda L, P, B: sum(p * (B - n % B) for n, p in zip(L, P)))
    assert verdicts(report) == [False, False, False, False, False]
    assert "one sequence of 16 tokens at block 16: expected 0, got 16" in report.results[0].detail
    assert "Diagnosis: a full last block charged" in report.results[0].detail


def test_a_plain_average_ignores_the_probabilities():
    report = checks.check_expected_tail_waste(lambda L, P, B: sum((-n) % B for n in L) / len(L))
    assert verdicts(report) == [True, True, False, True, False]
    assert "expected 3.1, got 7.75" in report.results[2].detail
    assert "Diagnosis: probabilities ignored" in report.results[2].detail


def test_the_uniform_shortcut_is_not_the_answer():
    report = checks.check_expected_tail_waste(lambda L, P, B: (B - 1) / 2)
    assert verdicts(report) == [False, False, False, True, False]
    assert "Diagnosis: the uniform shortcut" in report.results[1].detail


def test_used_slots_instead_of_free_ones_is_named():
    report = checks.check_expected_tail_waste(lambda L, P, B: sum(p * (n % B) for n, p in zip(L, P)))
    assert "Diagnosis: used slots, not free ones" in report.results[0].detail


# ------------------------------------------------------------------ (b) wrong largest extents
def test_forgetting_the_hole_after_the_last_extent():
    def no_tail(allocated, capacity):
        best, end = 0, 0
        for start, length in sorted(allocated):
            best, end = max(best, start - end), start + length
        return best if allocated else capacity

    report = checks.check_largest_free_extent(no_tail)
    assert verdicts(report) == [True, True, False, True, False]
    assert "Diagnosis: the hole after the last extent missed" in report.results[2].detail


def test_total_free_is_not_the_largest_hole():
    report = checks.check_largest_free_extent(lambda A, cap: cap - sum(n for _, n in A))
    assert verdicts(report) == [True, False, False, False, False]
    assert "expected 30, got 60" in report.results[1].detail
    assert "Diagnosis: total free, not the largest hole" in report.results[1].detail


def test_assuming_sorted_input():
    def unsorted_walk(allocated, capacity):
        best, end = 0, 0
        for start, length in allocated:  # no sort
            best, end = max(best, start - end), start + length
        return max(best, capacity - end)

    report = checks.check_largest_free_extent(unsorted_walk)
    assert verdicts(report)[:4] == [True, True, True, False]
    assert "Diagnosis: extents not sorted" in report.results[3].detail
    assert not report


# ------------------------------------------------------------------ (b) wrong traces
def test_a_full_pool_is_shortage_not_fragmentation():
    report = checks.check_fragmenting_trace(lambda cap: ([("admit", "a", cap)], 1))
    assert verdicts(report) == [True, True, False]
    assert "that is a full pool, not fragmentation" in report.results[2].detail
    assert "Diagnosis: a full pool" in report.results[2].detail


def test_freeing_neighbours_leaves_one_big_hole():
    def neighbours(cap):
        q = cap // 4
        ops = [("admit", n, q) for n in "abcd"] + [("finish", "a"), ("finish", "b")]
        return ops, q + 1

    report = checks.check_fragmenting_trace(neighbours)
    assert verdicts(report) == [True, False, True]
    assert "was admitted" in report.results[1].detail


def test_malformed_traces_are_explained():
    report = checks.check_fragmenting_trace(lambda cap: ([("finish", "ghost")], 1))
    assert verdicts(report) == [False, False, False]
    assert "finish a request that is admitted" in report.results[0].detail
    report = checks.check_fragmenting_trace(lambda cap: ([("admit", "a", cap), ("admit", "b", 1)], 1))
    assert "first-fit refused" in report.results[0].detail
    report = checks.check_fragmenting_trace(lambda cap: [("admit", "a", 1)])
    assert "expected (ops, need)" in report.results[0].detail
    report = checks.check_fragmenting_trace(lambda cap: ([("admit", "a", 2.5)], 1))
    assert "expected an integer, got float" in report.results[0].detail


# ------------------------------------------------------------------ robustness
def test_crashes_wrong_types_and_stubs_become_red_lines():
    def crashes(*args):
        return {}["missing"]

    for check in (checks.check_expected_tail_waste, checks.check_largest_free_extent, checks.check_fragmenting_trace):
        report = check(crashes)
        assert not report and all("raised KeyError" in r.detail or "did not replay" in r.detail
                                  for r in report.results)

        def stub(*args):
            raise NotImplementedError

        report = check(stub)
        assert not report and report.stub and len(report.results) == 1
        assert "not implemented yet" in report.results[0].detail
    report = checks.check_expected_tail_waste(lambda *a: "7.75")
    assert not report and "expected a number, got str" in report.results[0].detail
    report = checks.check_largest_free_extent(lambda *a: 30.0)
    assert not report and "expected an integer, got float" in report.results[0].detail


def test_a_hang_becomes_a_timeout_line_and_the_rest_still_run():
    def hangs(*args):
        while True:
            time.sleep(0.01)

    for check in (checks.check_expected_tail_waste, checks.check_largest_free_extent, checks.check_fragmenting_trace):
        report = check(hangs, timeout=0.2)
        assert not report and len(report.results) >= 3
        assert "no answer within 0.2 s" in report.results[0].detail


# ----------------------------------------------- a trace each policy wins
def best_fit_wins():
    return 12, [5, 1, 3, 3], [0, 2], [3, 5]


def first_fit_wins():
    return 12, [6, 1, 4, 1], [0, 2], [3, 4, 3]


def test_the_policy_traces_pass(capsys):
    assert checks.check_best_fit_wins(best_fit_wins)
    assert checks.check_first_fit_wins(first_fit_wins)
    out = capsys.readouterr().out
    assert "\u274c" not in out and out.count("\u2705") == 6


def test_the_policy_stubs_print_one_line(capsys):
    def stub():
        raise NotImplementedError

    for check in (checks.check_best_fit_wins, checks.check_first_fit_wins):
        assert check(stub).stub
    assert capsys.readouterr().out.count("\n") == 2


@pytest.mark.parametrize("check, trace, passed, name", [
    (checks.check_best_fit_wins, first_fit_wins(), [True, False, False],
     "the policies swapped"),
    (checks.check_first_fit_wins, best_fit_wins(), [True, False, False],
     "the policies swapped"),
    (checks.check_best_fit_wins, (12, [5, 1, 3, 3], [0, 1], [3, 3]),
     [True, True, False], "one hole"),
    (checks.check_best_fit_wins, (12, [5, 1, 3, 3], [0, 2], [3, 6]),
     [True, False, True], "more asked than free"),
    (checks.check_first_fit_wins, (12, [5, 1, 3, 3], [0, 2], [3, 3]),
     [True, True, False], "requests of one size"),
    (checks.check_first_fit_wins, (12, [5, 1, 3, 3], [0, 2], [5, 3]),
     [True, True, False], "no request refused"),
])
def test_each_policy_mistake_is_named(check, trace, passed, name):
    report = check(lambda: trace)
    assert [r.passed for r in report.results] == passed
    failed = [r for r in report.results if not r.passed]
    assert all(f"Diagnosis: {name}" in r.detail for r in failed)


@pytest.mark.parametrize("trace, words", [
    ([12], "expected (capacity, layout, frees, requests)"),
    ((12, [5, 1, 3, 3], [0, 7], [3, 5]), "frees [0, 7]"),
    ((8, [5, 1, 3, 3], [0, 2], [3, 5]), "more than the pool's 8"),
    ((12, [5, 1, 3, 3], [0, 2], []), "requests is empty"),
    ((12, [5, 1, 3, 3], [0, 2], [3, 0]), "at least one slot"),
])
def test_a_malformed_policy_trace_fails_the_first_line_only_with_its_reason(
        trace, words):
    report = checks.check_best_fit_wins(lambda: trace)
    assert [r.passed for r in report.results] == [False, False, False]
    assert words in report.results[0].detail
    assert "did not replay" in report.results[1].detail


# ------------------------------------------- issue 36: the prediction task
import pytest  # noqa: E402

from pagedkv.checks import ch02_hole_prediction as hp  # noqa: E402


def test_the_hole_prediction_passes_in_any_order_and_an_empty_one_prints_one_line(capsys):
    assert checks.check_hole_prediction([(18, 12), (52, 23)])
    assert checks.check_hole_prediction([[52, 23], [18, 12]])
    report = checks.check_hole_prediction(None)
    assert report.stub and not report and report.picture is None
    assert capsys.readouterr().out.splitlines()[-1] == (
        "\u274c prediction: not made yet (write it into predicted_holes, then run this cell)")


def test_the_hole_model_replays_the_library_allocator():
    assert hp.hole_model() == hp.run_hole_trace().free_extents() == [(18, 12), (52, 23)]
    from pagedkv import sim

    pool = sim.VariableExtentAllocator(100, 100, policy="first-fit")
    for op in hp._OPS:
        pool.admit(op[1], op[2]) if op[0] == "admit" else pool.finish(op[1])
    assert hp.hole_model("first-fit") == pool.free_extents()
    models = [m.model() for m in hp.HOLE_MISTAKES]
    assert hp.hole_model() not in models and len({repr(m) for m in models}) == len(models)


@pytest.mark.parametrize("predicted, said, name", [
    ([(40, 35)], "you predicted the holes [(40, 35)]", "first-fit's holes"),
    ([(18, 12), (52, 8), (60, 15)], "the trace leaves [(18, 12), (52, 23)]", "freed neighbours kept apart"),
    ([(12, 18), (58, 17)], "you predicted the holes [(12, 18), (58, 17)]", "the largest hole"),
    ([(18, 12), (52, 20)], "32 slots free in all, the trace leaves 35", None),
])
def test_a_wrong_hole_prediction_is_named_and_drawn(predicted, said, name):
    report = checks.check_hole_prediction(predicted)
    detail = report.results[0].detail
    assert not report and said in detail
    assert (f"Diagnosis: {name}" in detail) if name else "Diagnosis" not in detail
    top, bottom = report.picture.axes  # draw_extents, the trace above the prediction
    assert top.get_title(loc="left").startswith("the trace: holes [(18, 12), (52, 23)]")
    assert bottom.get_title(loc="left").startswith("your prediction")
    labels = [t.get_text() for t in bottom.texts]
    assert any(t.startswith("hole ") for t in labels)


@pytest.mark.parametrize("predicted, said", [
    ("18,12", "expected the holes as a list of (start, length) pairs"),
    ([(18, 12, 3)], "expected the holes as a list of (start, length) pairs"),
    ([(18.0, 12)], "expected the holes as a list of (start, length) pairs"),
    ([(90, 20)], "(90, 20) is not a hole of a 100-slot pool"),
])
def test_a_malformed_hole_prediction_is_a_red_line(predicted, said):
    report = checks.check_hole_prediction(predicted)
    assert not report and said in report.results[0].detail


def test_the_exercise_shows_the_trace_the_checker_runs():
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for folder in ("exercises", "solutions"):
        nb = json.loads((root / folder / "02_fragmentation.ipynb").read_text())
        text = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        assert hp.HOLE_TRACE in text, folder


# --------------------------------------------- issue 36: the design task
from pagedkv.checks import ch02_block_size as bs  # noqa: E402


def largest_size_ok(lengths, probs, max_share):
    best = None
    for B in range(16, 1025, 16):
        if bs.waste_share(lengths, probs, B) <= max_share:
            best = B
    return best


def test_the_largest_block_size_passes_and_its_stub_prints_one_line(capsys):
    assert checks.check_largest_block_size(largest_size_ok)

    def stub(*a):
        raise NotImplementedError

    report = checks.check_largest_block_size(stub)
    assert report.stub and len(report.results) == 1


def test_the_design_answers_the_fixed_cases():
    heavy = bs._cases(0, 0)[0]
    assert largest_size_ok(*heavy[1:]) == 128 and largest_size_ok([612], [1.0], 0.05) == 640
    assert largest_size_ok([1, 2, 3], [0.2, 0.3, 0.5], 0.02) is None


@pytest.mark.parametrize("fn, verdict, said, name", [
    (bs._first_under, [False, False, True, False], "16 keeps the waste at 0.58%, but the larger 128",
     "the first size under the share"),
    (bs._stop_at_first_over, [True, False, True, False], "80 keeps the waste at 4.38%, but the larger 640",
     "stopped at the first size over the share"),
    (bs._by_tokens, [False, True, True, False], "112 keeps the waste at 4.21%", "the share of the tokens"),
    (lambda L, P, s: 100, [False, False, False, False], "100 is not a multiple of 16",
     "not a block size vLLM takes"),
    (lambda L, P, s: None, [False, False, True, False], "got None, but 128 keeps the waste at 4.77%",
     "None while a size fits"),
    (lambda L, P, s: 1024, [False, False, False, False], "block size 1024 wastes", None),
])
def test_an_invalid_design_fails_with_its_reason(fn, verdict, said, name):
    report = checks.check_largest_block_size(fn, cases=10)
    assert verdicts(report) == verdict
    details = " ".join(r.detail for r in report.results if not r.passed)
    assert said in details
    if name:
        assert f"Diagnosis: {name}" in details


def test_a_float_or_a_crash_is_a_red_line():
    report = checks.check_largest_block_size(lambda *a: 128.0, cases=3)
    assert not report and "expected a block size (an int) or None, got float" in report.results[0].detail
    report = checks.check_largest_block_size(lambda *a: [][1], cases=3)
    assert not report and "raised IndexError" in report.results[0].detail
