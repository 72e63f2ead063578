"""The chapter 9 checkers: right answers pass; each wrong answer fails with a line naming its mistake."""

from __future__ import annotations

import pytest

from pagedkv.checks import ch09_hybrid_hit as hh
from pagedkv.checks import ch09_window as cw
from pagedkv.kv_cache_coordinator import get_kv_cache_coordinator
from pagedkv.kv_cache_spec import KVCacheGroupSpec, SlidingWindowSpec


def verdicts(report):
    return [r.passed for r in report.results]


def text(report):
    """Every result line, with the column wrapping undone."""
    return " ".join(" ".join(r.line() for r in report.results).split())


# ------------------------------------------------------------ skipped_blocks
def skipped_blocks(num_computed_tokens, sliding_window, block_size):
    """The solution notebook's answer."""
    return max(0, num_computed_tokens - sliding_window + 1) // block_size


def test_the_solution_passes_every_property():
    report = cw.check_skipped_blocks(skipped_blocks)
    assert report and all(verdicts(report)) and len(report.results) == 3


@pytest.mark.parametrize("mistake", cw.WINDOW_MISTAKES, ids=lambda m: m.name)
def test_each_wrong_window_rule_is_named(mistake):
    report = cw.check_skipped_blocks(mistake.model)
    assert not report
    assert f"Diagnosis: {mistake.name}" in text(report)


def test_the_library_is_caught_when_the_learner_calls_it():
    from pagedkv.single_type_managers import SlidingWindowManager

    def cheat(n, w, b):
        manager = object.__new__(SlidingWindowManager)
        manager.sliding_window = w
        return manager.get_num_skipped_tokens(n) // b

    report = cw.check_skipped_blocks(cheat)
    assert not report and "the library's own function" in text(report)
    assert "SlidingWindowManager.get_num_skipped_tokens" in text(report)


def test_a_stub_gives_one_line_and_a_crash_becomes_a_red_line():
    def stub(n, w, b):
        raise NotImplementedError

    report = cw.check_skipped_blocks(stub)
    assert report.stub and len(report.results) == 1

    def crash(n, w, b):
        return [][n]

    report = cw.check_skipped_blocks(crash)
    assert not any(verdicts(report)) and "IndexError" in text(report)


def test_a_float_is_refused():
    report = cw.check_skipped_blocks(lambda n, w, b: max(0, n - w + 1) / b)
    assert not report and "float" in text(report)


def test_the_library_oracle_counts_null_entries():
    # window 8, blocks of 4: at 15 computed, 8 tokens are skipped: blocks 0 and 1
    assert cw.library_skipped_blocks(15, 8, 4) == 2
    assert cw.library_skipped_blocks(14, 8, 4) == 1
    assert cw.library_skipped_blocks(3, 8, 4) == 0


# ------------------------------------------------------- released prediction
def test_the_release_trace_leaves_entries_0_and_1_at_null():
    coord, r = cw.run_release_trace()
    row = coord.get_blocks("R")[0]
    assert [i for i, b in enumerate(row) if b.is_null] == [0, 1]
    assert r.num_computed_tokens == 17
    coord.check()


def test_the_right_prediction_passes_and_none_is_a_stub():
    assert cw.check_released_prediction([1, 0])
    assert cw.check_released_prediction(None).stub


@pytest.mark.parametrize("predicted, words", [
    ([0, 1, 2], "counting the step still in flight"),
    ([0, 1, 2], "releasing the block holding the oldest in-window token"),
    ([0, 1, 2], "the window one token short"),
    ([1, 2], "block ids instead of table entries"),
    ([0, 1, 7], "there is no entry 7"),
    ("0, 1", "expected the released table entries as a list"),
])
def test_each_wrong_prediction_is_named(predicted, words):
    report = cw.check_released_prediction(predicted)
    assert not report and words in text(report)
    assert report.picture is not None or isinstance(predicted, str)


# ---------------------------------------------------------------- hybrid_hit
def hybrid_hit(full_cached, window_cached, window, block_size, max_length):
    """The solution notebook's answer."""
    need = -(-(window - 1) // block_size)

    def full_hit(length):
        n = 0
        while n < length // block_size and n in full_cached:
            n += 1
        return n * block_size

    def window_hit(length):
        run = 0
        for i in range(length // block_size - 1, -1, -1):
            if i not in window_cached:
                run = 0
                continue
            run += 1
            if run >= need:
                return (i + run) * block_size
        return run * block_size

    length = max_length
    while True:
        shorter = window_hit(full_hit(length))
        if shorter >= length:
            return length
        length = shorter


def test_the_hybrid_solution_passes_and_agrees_with_the_library_on_every_case():
    report = hh.check_hybrid_hit(hybrid_hit)
    assert report and all(verdicts(report)) and len(report.results) == 3
    for case in hh._cases():
        assert hybrid_hit(*case) == hh.library_hybrid_hit(*case)


def test_the_chapters_trap_is_8_tokens_where_the_smaller_answer_says_16():
    case = ({0, 1, 2, 3, 5}, {0, 1, 3, 4, 5}, 8, 4, 24)
    assert hh.library_hybrid_hit(*case) == 8
    assert hh.HIT_MISTAKES[0].model(*case) == 16


@pytest.mark.parametrize("mistake", hh.HIT_MISTAKES, ids=lambda m: m.name)
def test_each_wrong_hit_rule_is_named(mistake):
    report = hh.check_hybrid_hit(mistake.model)
    assert not report
    assert f"Diagnosis: {mistake.name}" in text(report)


@pytest.mark.parametrize("name", ["HybridKVCacheCoordinator.find_longest_cache_hit", "library_hybrid_hit"])
def test_calling_the_library_is_caught(name):
    if name == "library_hybrid_hit":
        def cheat(f, s, w, b, cap):
            return hh.library_hybrid_hit(f, s, w, b, cap)
    else:
        def cheat(f, s, w, b, cap):
            coord = get_kv_cache_coordinator(
                [KVCacheGroupSpec(["s"], SlidingWindowSpec(block_size=b, num_kv_heads=1, head_size=4,
                                                          sliding_window=w))] * 2, 8, 64, 1)
            coord.find_longest_cache_hit([], cap)
            return hybrid_hit(f, s, w, b, cap)
    report = hh.check_hybrid_hit(cheat)
    assert not report and name in text(report)


def test_a_lookup_that_edits_its_input_is_caught():
    def greedy(f, s, w, b, cap):
        answer = hybrid_hit(f, s, w, b, cap)
        f.clear()
        return answer

    report = hh.check_hybrid_hit(greedy)
    assert verdicts(report)[0] is False and "changed its input sets" in text(report)


# ------------------------------------------------------------ hit prediction
def test_the_hit_trace_gives_12():
    assert hh.run_hit_trace() == 12 == hybrid_hit(*hh._TRACE_STATE)


@pytest.mark.parametrize("predicted, words", [
    (20, "the smaller per-group hit, without asking again"),
    (20, "full attention only"),
    (28, "the window only"),
    (0, "the window read left to right"),
    (0, "a window one block too wide"),
    (14, "whole blocks of 4"),
    ("12", "expected the hit as a number of tokens"),
])
def test_each_wrong_hit_prediction_is_named(predicted, words):
    report = hh.check_hit_prediction(predicted)
    assert not report and words in text(report)


def test_the_right_hit_prediction_passes():
    assert hh.check_hit_prediction(12)
    assert hh.check_hit_prediction(None).stub


# -------------------------------------------------------------- trap design
def test_no_design_yet_is_one_line():
    report = hh.check_trap_design(None)
    assert report.stub and len(report.results) == 1


def test_a_good_trap_passes():
    assert hh.check_trap_design(({0, 1, 2, 3, 4, 5}, {0, 1, 2, 3, 4, 6, 7}))
    assert hh.check_trap_design(lambda: ({0, 1, 2, 3, 4, 5}, {0, 1, 2, 3, 4, 6, 7}))


@pytest.mark.parametrize("design, failing, words", [
    (({0, 1, 2, 3, 5}, {0, 1, 3, 4, 5}), 1, "the coordinator hits 8 tokens"),  # the chapter's: too short
    ((set(range(8)), set(range(8))), 2, "the smaller, 32, is the hit"),  # no trap at all
    (({0, 1, 2}, {9}), 0, "not a block index"),
    ([{0}, {0}], 0, "expected a pair"),
])
def test_each_weak_design_fails_the_property_it_misses(design, failing, words):
    report = hh.check_trap_design(design)
    assert not report
    assert verdicts(report)[failing] is False and words in text(report)


# ------------------------------------------------------------- planted bug
from pagedkv.checks import ch09_planted as cp  # noqa: E402


def test_the_library_order_passes():
    report = cp.check_decode_step(cp.reference_decode_step)
    assert report and all(verdicts(report))


def test_the_solution_notebooks_fix_passes():
    def decode_step(coord, request, token):
        coord.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
        request.append_output_token_ids(token)
        coord.allocate_new_blocks(request.request_id, request.num_tokens)
        request.num_computed_tokens = request.num_tokens

    assert cp.check_decode_step(decode_step)


@pytest.mark.parametrize("mistake", cp.DECODE_MISTAKES, ids=lambda m: m.name)
def test_the_planted_bug_and_each_wrong_fix_are_named(mistake):
    report = cp.check_decode_step(mistake.model)
    assert not report and f"Diagnosis: {mistake.name}" in text(report)


def test_the_planted_bug_frees_a_block_its_own_step_reads():
    report = cp.check_decode_step(cp.DECODE_MISTAKES[0].model)
    assert "is already the null block" in text(report)
