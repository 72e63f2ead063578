"""Exercise 9's experiment (a window that keeps its blocks): the rule, the measurement, the prediction.

Each wrong answer is fed to the checker and its red line must name it: the
library's class passed (no change), a subclass that calls the library's
rule, a rule that still frees, a leak, a measurement of the library's rule
or of the last step, a far prediction, a crash.
"""

from pagedkv.checks.ch09_measure import (LONG_DECODES, check_keep_window_experiment as check,
                                         serve_long_decodes)
from pagedkv.common import cdiv
from pagedkv.single_type_managers import SlidingWindowManager


class Keep(SlidingWindowManager):
    def remove_skipped_blocks(self, request_id, num_computed_tokens):
        pass


TRACE = serve_long_decodes(Keep)
TRUE = max(TRACE)
LIBRARY = max(serve_long_decodes(SlidingWindowManager))


def test_keeping_the_blocks_holds_more_than_the_window():
    assert TRUE > 1.5 * LIBRARY
    # ...but less than every table whole at once: the shortest finishes first.
    assert TRUE < sum(cdiv(p + d, 16) for p, d in LONG_DECODES)


def test_right_rule_measurement_and_close_prediction_pass():
    report = check(Keep, TRUE + 2, TRUE, verbose=False)
    assert report.passed, [r.detail for r in report.results]


def test_the_library_class_passed_is_no_change():
    report = check(SlidingWindowManager, TRUE, LIBRARY, verbose=False)
    assert "Diagnosis: no change" in report.results[0].detail
    assert "library's own SlidingWindowManager" in report.results[0].detail


def test_a_subclass_without_the_override_is_no_change():
    class Same(SlidingWindowManager):
        pass

    report = check(Same, TRUE, LIBRARY, verbose=False)
    assert "Diagnosis: no change" in report.results[0].detail


def test_calling_the_library_is_refused_by_name():
    class Super(SlidingWindowManager):
        def remove_skipped_blocks(self, request_id, num_computed_tokens):
            super().remove_skipped_blocks(request_id, num_computed_tokens)

    report = check(Super, TRUE, LIBRARY, verbose=False)
    assert "calls the library's SlidingWindowManager.remove_skipped_blocks" in report.results[0].detail


def test_a_rule_that_still_frees_is_named():
    class HalfWindow(SlidingWindowManager):  # frees behind a window twice as long
        def remove_skipped_blocks(self, request_id, num_computed_tokens):
            blocks = self.req_to_blocks.get(request_id, [])
            last = max(0, num_computed_tokens - 2 * self.sliding_window) // self.block_size
            freed = [b for b in blocks[:last] if not b.is_null]
            for i in range(last):
                blocks[i] = self.block_pool.null_block
            self.block_pool.free_blocks(freed)

    report = check(HalfWindow, TRUE, max(serve_long_decodes(HalfWindow)), verbose=False)
    assert "Diagnosis: still frees" in report.results[0].detail
    assert report.results[1].passed  # measured right for *its* rule


def test_a_leak_is_named():
    class Leak(Keep):
        def free(self, request_id):
            self.req_to_blocks.pop(request_id, None)

    report = check(Leak, TRUE, TRUE, verbose=False)
    assert "Diagnosis: a leak" in report.results[0].detail


def test_measuring_the_library_rule_is_named():
    report = check(Keep, TRUE, LIBRARY, verbose=False)
    assert "Diagnosis: the library's rule measured" in report.results[1].detail


def test_measuring_the_last_step_is_named():
    report = check(Keep, TRUE, TRACE[-1], verbose=False)
    assert "Diagnosis: the last step, not the peak" in report.results[1].detail


def test_a_far_prediction_names_what_it_missed():
    report = check(Keep, LIBRARY, TRUE, verbose=False)
    assert [r.passed for r in report.results] == [True, True, False]
    assert "off by" in report.results[2].detail
    assert "admission cap" in report.results[2].detail
    high = check(Keep, sum(cdiv(p + d, 16) for p, d in LONG_DECODES), TRUE, verbose=False)
    assert "the peak comes at one of the finishes" in high.results[2].detail


def test_a_crash_is_named():
    class Crash(SlidingWindowManager):
        def remove_skipped_blocks(self, request_id, num_computed_tokens):
            return self.req_to_blocks[request_id][num_computed_tokens]  # an index past the table

    report = check(Crash, TRUE, TRUE, verbose=False)
    assert "Diagnosis: a crash in your policy" in report.results[0].detail
    assert "Diagnosis: a crash in your policy" in report.results[1].detail


def test_the_stub_prints_one_line():
    class Stub(SlidingWindowManager):
        def remove_skipped_blocks(self, request_id, num_computed_tokens):
            raise NotImplementedError

    report = check(Stub, None, None, verbose=False)
    assert report.stub and len(report.results) == 1


def test_not_a_manager_class_is_named():
    report = check(None, None, None, verbose=False)
    assert "not a SlidingWindowManager subclass" in report.results[0].detail


def test_skipping_no_tokens_is_the_same_rule_written_elsewhere():
    class SkipNothing(SlidingWindowManager):
        def get_num_skipped_tokens(self, num_computed_tokens):
            return 0

    report = check(SkipNothing, TRUE, max(serve_long_decodes(SkipNothing)), verbose=False)
    assert report.passed, [r.detail for r in report.results]


def test_a_peak_at_the_first_finish_is_named():
    first = len(LONG_DECODES) * cdiv(sum(LONG_DECODES[-1]), 16)  # all four, before the shortest ends
    assert first < TRUE
    report = check(Keep, first, TRUE, verbose=False)
    assert "need not come at the first finish" in report.results[2].detail
