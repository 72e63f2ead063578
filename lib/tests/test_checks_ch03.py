"""The chapter 3 checker: right answers pass, each kind of wrong answer fails the right property."""

from __future__ import annotations

import time

from pagedkv import checks
from pagedkv.free_queue import FreeKVCacheBlockQueue, KVCacheBlock


def verdicts(report):
    return [r.passed for r in report.results]


class StubQueue:
    """The exercise as handed out: construction given, the four operations to write."""

    def __init__(self, blocks):
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = prev

    def popleft_n(self, n):
        raise NotImplementedError

    def remove(self, block):
        raise NotImplementedError

    def append_n(self, blocks):
        raise NotImplementedError

    def prepend_n(self, blocks):
        raise NotImplementedError


class SolutionQueue(StubQueue):
    """The solution notebook's answer."""

    def popleft_n(self, n):
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks: only {self.num_free_blocks} are free")
        taken, block = [], self.fake_free_list_head.next_free_block
        for _ in range(n):
            taken.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self.fake_free_list_head.next_free_block = block
        block.prev_free_block = self.fake_free_list_head
        self.num_free_blocks -= n
        return taken

    def remove(self, block):
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append_n(self, blocks):
        last = self.fake_free_list_tail.prev_free_block
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
        last.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks):
        old_first = self.fake_free_list_head.next_free_block
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = old_first
        old_first.prev_free_block = prev
        self.num_free_blocks += len(blocks)


def test_the_solution_and_the_library_pass_every_property(capsys):
    assert checks.check_free_block_queue(SolutionQueue)
    out = capsys.readouterr().out
    assert "\u274c" not in out and out.count("\u2705") == 8
    assert checks.check_free_block_queue(FreeKVCacheBlockQueue)


def test_the_stub_prints_one_line(capsys):
    report = checks.check_free_block_queue(StubQueue)
    assert report.stub and len(report.results) == 1
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "not implemented yet" in out


def test_a_partly_written_queue_says_which_operations_are_stubs_without_hints():
    class Half(SolutionQueue):
        append_n = StubQueue.append_n
        prepend_n = StubQueue.prepend_n

    report = checks.check_free_block_queue(Half)
    assert verdicts(report)[:4] == [True] * 4 and not report.stub
    assert report.results[4].detail.endswith("NotImplementedError)")  # no hint for a stub


def test_prepending_one_at_a_time_reverses_the_batch():
    class Reversed(SolutionQueue):
        def prepend_n(self, blocks):
            for block in blocks:
                super().prepend_n([block])

    report = checks.check_free_block_queue(Reversed)
    assert verdicts(report) == [True, True, True, True, True, False, True, False]
    assert "expected [2, 0, 4, 5, 6]" in report.results[5].detail
    assert "Diagnosis: reversed batch" in report.results[5].detail
    assert "Diagnosis: reversed batch" in report.results[7].detail


def test_append_n_at_the_head_is_named():
    class WrongEnd(SolutionQueue):
        append_n = SolutionQueue.prepend_n

    report = checks.check_free_block_queue(WrongEnd)
    assert "Diagnosis: linked at the wrong end" in report.results[4].detail


def test_remove_that_leaves_the_block_linked_is_caught():
    class Sticky(SolutionQueue):
        def remove(self, block):
            block.prev_free_block.next_free_block = block.next_free_block
            block.next_free_block.prev_free_block = block.prev_free_block
            self.num_free_blocks -= 1

    report = checks.check_free_block_queue(Sticky)
    assert verdicts(report)[3] is False and verdicts(report)[7] is False
    assert "block 3 is out of the queue but still has a link" in report.results[3].detail


def test_remove_that_forgets_the_back_link_is_caught_walking_backward():
    class OneWay(SolutionQueue):
        def remove(self, block):
            block.prev_free_block.next_free_block = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            self.num_free_blocks -= 1

    report = checks.check_free_block_queue(OneWay)
    assert verdicts(report)[3] is False
    assert "tail to head" in report.results[3].detail or "walking backward" in report.results[3].detail


def test_a_remove_that_searches_the_queue_fails_only_the_walking_property():
    class Searching(SolutionQueue):
        def remove(self, block):
            node = self.fake_free_list_head.next_free_block
            while node is not block:  # looks for the block first: O(n)
                node = node.next_free_block
            super().remove(node)

    report = checks.check_free_block_queue(Searching)
    assert verdicts(report) == [True, True, True, True, True, True, False, True]
    assert "remove(block 1000)" in report.results[6].detail and "walks the queue" in report.results[6].detail


def test_popleft_n_without_the_capacity_check_is_caught():
    class Unchecked(SolutionQueue):
        def popleft_n(self, n):
            n = min(n, self.num_free_blocks)
            return super().popleft_n(n)

    report = checks.check_free_block_queue(Unchecked)
    assert verdicts(report)[2] is False
    assert "should raise ValueError" in report.results[2].detail


def test_wrong_type_and_miscount_are_red_lines():
    class Tuple(SolutionQueue):
        def popleft_n(self, n):
            return tuple(super().popleft_n(n))

    report = checks.check_free_block_queue(Tuple)
    assert verdicts(report)[1] is False and "should return a list, got tuple" in report.results[1].detail

    class Miscount(SolutionQueue):
        def append_n(self, blocks):
            super().append_n(blocks)
            self.num_free_blocks -= len(blocks) * 2  # wrong sign

    report = checks.check_free_block_queue(Miscount)
    assert verdicts(report)[4] is False and "num_free_blocks is" in report.results[4].detail


def test_a_crash_and_a_hang_are_red_lines():
    class Crashes(SolutionQueue):
        def append_n(self, blocks):
            return blocks[0].no_such_attribute

    report = checks.check_free_block_queue(Crashes)
    assert verdicts(report)[4] is False and "raised AttributeError" in report.results[4].detail

    class Hangs(SolutionQueue):
        def prepend_n(self, blocks):
            while True:
                pass

    start = time.monotonic()
    report = checks.check_free_block_queue(Hangs, timeout=0.3)
    # The probe meets the hang first: one timeout, and every property says so at once.
    assert time.monotonic() - start < 0.3 + 3.0
    assert not any(verdicts(report)) and all("no answer within 0.3 s" in r.detail for r in report.results)


def test_a_cycle_is_reported_not_followed_forever():
    class Cycle(SolutionQueue):
        def append_n(self, blocks):
            super().append_n(blocks)
            if blocks:
                blocks[-1].next_free_block = blocks[0]  # a loop that never reaches the tail

    report = checks.check_free_block_queue(Cycle, timeout=5)
    assert verdicts(report)[4] is False
    assert "never reaches the tail sentinel" in report.results[4].detail
