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


def test_the_solution_and_the_library_pass_every_property(capsys, monkeypatch):
    assert checks.check_free_block_queue(SolutionQueue)
    out = capsys.readouterr().out
    assert "\u274c" not in out and out.count("\u2705") == 8
    # The library's own queue is refused as a learner's answer (it is the
    # oracle); with that gate off, it passes every property.
    assert not checks.check_free_block_queue(FreeKVCacheBlockQueue)
    from pagedkv.checks._harness import Checker
    monkeypatch.setattr(Checker, "written_here", lambda *a, **k: None)
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


# ------------------------------------------------- issue 36: attribution
def test_a_popleft_n_bug_is_reported_under_popleft_n_not_append_n():
    # The new first block keeps its stale back link, but only on a queue of
    # 7 popped by 4: every other size is right.
    class Bugged(SolutionQueue):
        def popleft_n(self, n):
            taken = super().popleft_n(n)
            if n == 4 and taken and self.num_free_blocks == 3:
                self.fake_free_list_head.next_free_block.prev_free_block = taken[-1]
                taken[-1].next_free_block = None
            return taken

    report = checks.check_free_block_queue(Bugged)
    by_name = {r.name.split(" ")[0]: r for r in report.results}
    assert not by_name["popleft_n(n)"].passed
    assert "popleft_n(4) on a fresh queue of 7" in by_name["popleft_n(n)"].detail


def test_a_setup_broken_by_popleft_n_names_popleft_n():
    # Correct on a fresh queue (ids in order), wrong once blocks were linked
    # back in out of order: the prepend_n line must name the popleft_n that
    # set its queue up.
    class OutOfOrderBug(SolutionQueue):
        def popleft_n(self, n):
            first = self.fake_free_list_head.next_free_block
            taken = super().popleft_n(n)
            if len(taken) > 1 and taken[0].block_id > taken[1].block_id:
                taken[0].next_free_block = first  # a stale link left behind
            return taken

    report = checks.check_free_block_queue(OutOfOrderBug, cases=5)
    lines = {r.name.split("(")[0]: r for r in report.results}
    detail = lines["prepend_n"].detail
    assert not lines["prepend_n"].passed
    assert "after popleft_n(5) of the queue [2, 0, 4, 5, 6]" in detail
    assert "set up this property: the bug is in popleft_n" in detail
    assert lines["popleft_n"].passed and lines["append_n"].passed


def test_the_exercise_text_names_popleft_n_not_popleft():
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for folder in ("exercises", "solutions"):
        nb = json.loads((root / folder / "03_block_pool.ipynb").read_text())
        text = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        assert "`popleft`" not in text, folder


# ------------------------------------------- issue 36: the prediction task
from pagedkv.checks import ch03_queue_prediction as qp  # noqa: E402


def test_the_prediction_passes_and_an_empty_one_prints_one_line(capsys):
    assert checks.check_free_queue_prediction([6, 5, 4, 2])
    report = checks.check_free_queue_prediction(None)
    assert report.stub and not report and report.picture is None
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "\u274c prediction: not made yet (write it into predicted_queue, then run this cell)"


def test_the_list_model_replays_the_library_trace():
    pool, _ = qp.run_queue_trace()
    assert qp.queue_model() == [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    models = [m.model() for m in qp.QUEUE_MISTAKES]
    assert qp.queue_model() not in models and len(set(map(tuple, models))) == len(models)


import pytest  # noqa: E402


@pytest.mark.parametrize("predicted, said, name", [
    ([2, 6, 5, 4], "position 0 holds block 6, not 2", "every freed block at the tail"),
    ([4, 5, 6, 2], "position 0 holds block 6, not 4", "B's blocks in reverse"),
    ([6, 5, 4, 2, 1], "block 1 is held by D", "D's block left in the queue"),
    ([6, 5, 4, 7], "block 7 is held by C", "hashed blocks at the head"),
    ([6, 5, 4], "block 2 is free too", None),
])
def test_a_wrong_prediction_is_named_and_drawn_side_by_side(predicted, said, name):
    report = checks.check_free_queue_prediction(predicted)
    detail = report.results[0].detail
    assert not report and said in detail
    assert (f"Diagnosis: {name}" in detail) if name else "Diagnosis" not in detail
    picture = report.picture
    assert "What the trace leads to" in picture and "Your prediction" in picture
    assert picture.count("class='pagedkv-pool'") == 2  # the book's render_pool, twice
    assert "free queue from its head: 6 5 4 2*" in picture
    shown = " ".join(str(b) + ("*" if b == 2 else "") for b in predicted if b not in (1, 7))
    assert f"free queue from its head: {shown}" in picture


@pytest.mark.parametrize("predicted, said", [
    ("6542", "expected the free queue as a list of block ids"),
    ([6, 5, 4, 2.0], "expected the free queue as a list of block ids"),
    ([0, 6, 5, 4], "block 0 is the null block"),
    ([6, 6, 5, 4, 2], "a block is in the queue once at most"),
    ([6, 5, 4, 12], "there is no block 12"),
])
def test_a_malformed_prediction_is_a_red_line_not_a_crash(predicted, said):
    report = checks.check_free_queue_prediction(predicted)
    assert not report and said in report.results[0].detail


def test_the_exercise_shows_the_trace_the_checker_runs():
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for folder in ("exercises", "solutions"):
        nb = json.loads((root / folder / "03_block_pool.ipynb").read_text())
        text = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        assert qp.QUEUE_TRACE in text, folder
