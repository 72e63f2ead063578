"""Exercise 3's experiment (every block to the tail): the rule, the measurement for it, the prediction.

Each wrong answer is fed to the checker and its red line must name it: the
0.33.0 rule written by hand, the library's free_blocks called, a reversed
batch, a measurement of the library's rule, a far prediction, a crash.
"""

from pagedkv.block_pool import BlockPool
from pagedkv.checks.ch03_measure import check_free_rule_experiment as check, hit_rate


class AllToTail(BlockPool):
    def free_blocks(self, ordered_blocks):
        freed = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.append(block)
        self.free_block_queue.append_n(freed)


class Reversed(BlockPool):
    def free_blocks(self, ordered_blocks):
        freed = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.append(block)
        self.free_block_queue.append_n(freed[::-1])


class TodayByHand(BlockPool):
    def free_blocks(self, ordered_blocks):
        head, tail = [], []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (head if block.block_hash is None else tail).append(block)
        self.free_block_queue.prepend_n(head)
        self.free_block_queue.append_n(tail)


class CallsTheLibrary(BlockPool):
    def free_blocks(self, ordered_blocks):
        super().free_blocks(ordered_blocks)


TRUE = hit_rate(AllToTail)
TODAY = hit_rate(BlockPool)


def test_the_old_rule_loses_hits_under_pressure():
    assert TODAY - TRUE > 0.05


def test_right_rule_measurement_and_close_prediction_pass():
    report = check(AllToTail, round(TRUE, 2), TRUE, verbose=False)
    assert report.passed, [r.detail for r in report.results]


def test_todays_rule_by_hand_is_named():
    report = check(TodayByHand, 0.5, hit_rate(TodayByHand), verbose=False)
    assert "Diagnosis: the 0.33.0 rule" in report.results[0].detail
    assert report.results[1].passed  # measured right for *its* rule


def test_a_reversed_batch_is_named():
    report = check(Reversed, 0.5, hit_rate(Reversed), verbose=False)
    assert "Diagnosis: reversed" in report.results[0].detail


def test_calling_the_library_is_refused_by_name():
    report = check(CallsTheLibrary, 0.5, TODAY, verbose=False)
    assert "calls the library's BlockPool.free_blocks" in report.results[0].detail


def test_measuring_the_library_rule_is_named():
    report = check(AllToTail, 0.5, TODAY, verbose=False)
    assert "Diagnosis: the library's rule measured" in report.results[1].detail


def test_a_far_prediction_names_what_it_missed():
    report = check(AllToTail, round(TODAY, 2), TRUE, verbose=False)
    assert [r.passed for r in report.results] == [True, True, False]
    assert "off by" in report.results[2].detail
    assert "no hash and can never be hit" in report.results[2].detail


def test_a_crash_is_named():
    class Crash(BlockPool):
        def free_blocks(self, ordered_blocks):
            return ordered_blocks[0]  # an iterator from the manager: not subscriptable

    report = check(Crash, 0.5, TRUE, verbose=False)
    assert "Diagnosis: a crash in your policy" in report.results[1].detail


def test_not_a_pool_class_is_named():
    report = check(None, None, None, verbose=False)
    assert "not a BlockPool subclass" in report.results[0].detail


def test_walking_the_iterator_twice_is_named():
    class TwoPasses(BlockPool):
        def free_blocks(self, ordered_blocks):
            for block in ordered_blocks:
                block.ref_cnt -= 1
            self.free_block_queue.append_n([b for b in ordered_blocks if b.ref_cnt == 0])

    report = check(TwoPasses, 0.5, TRUE, verbose=False)
    assert "Diagnosis: the blocks walked twice" in report.results[0].detail
