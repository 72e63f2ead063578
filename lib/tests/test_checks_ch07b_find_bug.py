"""Exercise 7 part 1's find-the-bug task (the window gather): the answer passes, first attempts are named.

What a first attempt is, and where the kernels come from: ``find_bug_notebooks``.
"""

from __future__ import annotations

import pytest
from find_bug_notebooks import cell as _cell, failures, module as _module  # imports pagedkv first

from pagedkv.checks import ch07b_find_bug


# ------------------------------------------------------------------ 7b: the window gather
WINDOW_FOUND = "found: the program, the first wrong position, the variable"
WINDOW_FIX = "the fixed gather equals the reference (four cases, block sizes 1 to 16)"


def _window(fix_src: str | None = None, tag: str = "w"):
    src = _cell("exercises/07b_kernel_puzzles.ipynb", "def window_gather_kernel(")
    if fix_src is not None:
        src += "\n\n" + fix_src
    return _module(src, tag)


def _window_fix(old: str = "", new: str = "", tag: str = "wf"):
    fix = _cell("solutions/07b_kernel_puzzles.ipynb", "def window_gather_fixed_kernel(")
    if old:
        assert old in fix
        fix = fix.replace(old, new)
    m = _window(fix, tag)
    return lambda *a: m.window_gather(*a, kernel=m.window_gather_fixed_kernel)


RIGHT_WINDOW = {"program": 2, "first_wrong_position": 6, "variable": "slot"}


def test_the_planted_window_bug_is_wrong_in_one_program_only():
    case = ch07b_find_bug.window_case()
    got = _window().window_gather(**case).cpu()
    want = ch07b_find_bug.reference_window_gather(**case)
    right = [(got[r] == want[r]).all().item() for r in range(3)]
    assert right == [True, True, False]
    assert ch07b_find_bug.planted_diagnosis(case) == {2: 6}


def test_the_solution_window_fix_passes():
    report = ch07b_find_bug.check_window_bug(RIGHT_WINDOW, _window_fix())
    assert report, failures(report)


@pytest.mark.parametrize("found, words", [
    # the row index j read off the output instead of the position
    ({"program": 2, "first_wrong_position": 0, "variable": "slot"}, "that is a row index j"),
    # the longest program that starts past 0, not the one off a block border
    ({"program": 1, "first_wrong_position": 4, "variable": "slot"}, "gathers every row right"),
    # blaming the table lookup without printing it
    ({"program": 2, "first_wrong_position": 6, "variable": "block"}, "holds the right values"),
    ({"program": 2, "first_wrong_position": 6, "variable": "column"}, "holds the right values"),
])
def test_first_localisations_are_named(found, words):
    report = ch07b_find_bug.check_window_bug(found, _window_fix())
    assert list(failures(report)) == [WINDOW_FOUND]
    assert words in failures(report)[WINDOW_FOUND]


def test_first_fixes_are_rejected():
    # the unfixed kernel handed back as the fix
    m = _window()
    failed = failures(ch07b_find_bug.check_window_bug(RIGHT_WINDOW, m.window_gather))
    assert list(failed) == [WINDOW_FIX] and "program 2 (seq_len 14), row 0 (position 6)" in failed[WINDOW_FIX]
    # the modulo dropped: the window's place taken as the row in the block
    fix = _window_fix("+ pos % block_size", "+ (pos - first)", "drop")
    failed = failures(ch07b_find_bug.check_window_bug(RIGHT_WINDOW, fix))
    assert WINDOW_FIX in failed
    # the row in the block taken from the output row j: the same mistake, spelled another way
    fix = _window_fix("+ pos % block_size", "+ j % block_size", "rowj")
    failed = failures(ch07b_find_bug.check_window_bug(RIGHT_WINDOW, fix))
    assert WINDOW_FIX in failed


def test_a_fix_in_pytorch_is_caught():
    failed = failures(ch07b_find_bug.check_window_bug(
        RIGHT_WINDOW, lambda *a: ch07b_find_bug.reference_window_gather(*a)))
    assert "computes in a Triton kernel" in failed and "no Triton kernel ran" in failed[
        "computes in a Triton kernel"]


def test_the_untouched_window_task_is_one_line():
    report = ch07b_find_bug.check_window_bug(None, _window_fix())
    assert report.stub and len(report.results) == 1
