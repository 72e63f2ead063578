"""Exercise 2's experiment (worst-fit): the policy, the measurement for *that* policy, the prediction.

Each wrong answer a reader may give is fed to the checker, and the red line
must name it: a wrong rule, a measurement of the library's rule, a
percentage, a prediction far off, the library's own rule handed in, a crash.
"""

from pagedkv.checks.ch02_measure import check_worst_fit_experiment as check, external_share
from pagedkv.sim import VariableExtentAllocator


def worst_fit(holes, need):
    best = None
    for start, length in holes:
        if length >= need and (best is None or length > best[1]):
            best = (start, length)
    return None if best is None else best[0]


TRUE = external_share(worst_fit)
FIRST = external_share("first-fit")


def lines(report):
    return [(r.passed, r.detail) for r in report.results]


def test_the_policy_moves_the_measurement():
    # The experiment must be able to tell the rules apart, or no measurement is graded.
    assert abs(TRUE - FIRST) > 0.01


def test_right_policy_measurement_and_close_prediction_pass(capsys):
    report = check(worst_fit, round(TRUE, 2), TRUE, verbose=False)
    assert report.passed, lines(report)
    assert "you predicted" in report.results[2].name


def test_first_fit_for_worst_fit_is_named():
    first = lambda holes, need: next((s for s, n in holes if n >= need), None)  # noqa: E731
    report = check(first, 0.2, external_share(first), verbose=False)
    assert not report.results[0].passed
    assert "Diagnosis: first-fit" in report.results[0].detail
    # ...but its measurement is graded against *its* rule: right for first-fit.
    assert report.results[1].passed


def test_a_hole_too_small_is_named():
    largest = lambda holes, need: max(holes, key=lambda h: (h[1], -h[0]))[0] if holes else None  # noqa: E731
    report = check(largest, None, None, verbose=False)
    assert "Diagnosis: a hole too small" in report.results[0].detail


def test_measuring_the_library_rule_is_named():
    report = check(worst_fit, 0.2, FIRST, verbose=False)
    assert report.results[0].passed and not report.results[1].passed
    assert "Diagnosis: the library's first-fit measured" in report.results[1].detail


def test_a_percentage_is_named():
    report = check(worst_fit, 0.2, 100 * TRUE, verbose=False)
    assert "Diagnosis: a percentage" in report.results[1].detail


def test_a_far_prediction_says_how_far_and_what_it_teaches():
    report = check(worst_fit, 0.45, TRUE, verbose=False)
    assert [r.passed for r in report.results] == [True, True, False]
    detail = report.results[2].detail
    assert "off by" in detail and "Diagnosis:" in detail and "paging" in detail


def test_missing_prediction_and_measurement_say_which_variable():
    report = check(worst_fit, None, None, verbose=False)
    assert "measured_external" in report.results[1].detail
    assert "predicted_external" in report.results[2].detail


def test_the_library_rule_handed_in_is_refused_by_name():
    report = check("best-fit", 0.2, external_share("best-fit"), verbose=False)
    assert not report.passed
    assert "Diagnosis: the library's own rule" in report.results[0].detail


def test_a_crash_in_the_policy_is_named_with_its_line():
    def crash(holes, need):
        return holes[3][0]

    report = check(crash, 0.2, TRUE, verbose=False)
    assert "IndexError" in report.results[0].detail and "line" in report.results[0].detail
    assert "Diagnosis: a crash in your policy" in report.results[0].detail
    assert "Diagnosis: a crash in your policy" in report.results[1].detail


def test_the_stub_prints_one_line(capsys):
    def stub(holes, need):
        raise NotImplementedError

    report = check(stub, None, None)
    assert report.stub and capsys.readouterr().out.count("\n") == 1


def test_the_extension_point_refuses_a_bad_answer_with_nothing_changed():
    pool = VariableExtentAllocator(100, 100, lambda holes, need: 7)
    try:
        pool.admit("a", 10)
    except ValueError as exc:
        assert "not the start of a hole" in str(exc)
    else:
        raise AssertionError("a start inside no hole was accepted")
    assert pool.free_extents() == [(0, 100)] and pool.num_requests == 0
    pool.check()
