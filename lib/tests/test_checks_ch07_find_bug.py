"""Exercise 7 part 2's find-the-bug (the merge) and modify-and-measure (the split count) tasks.

The answers pass; first attempts are named (what that means: ``find_bug_notebooks``).
"""

from __future__ import annotations

import pytest
import torch
from find_bug_notebooks import cell as _cell, failures, module as _module  # imports pagedkv first

from pagedkv.checks import ch07_find_bug, ch07_split_measure


# ------------------------------------------------------------------ 7: the merge
MERGE_FOUND = "found: the first wrong request and the first wrong variable"
MERGE_FIX = "the fixed merge equals attention (three batches, 3 to 8 splits)"


def _merge(old: str = "", new: str = "", tag: str = "m"):
    src = _cell("exercises/07_paged_attention.ipynb", "def merge_kernel(").replace(
        "from pagedkv.checks import ch07_find_bug as find_bug\n", "").replace(
        "from pagedkv.checks.ch07b_find_bug import interpreted\n", "")
    fix = _cell("solutions/07_paged_attention.ipynb", "def merge_fixed_kernel(")
    if old:
        assert old in fix
        fix = fix.replace(old, new)
    m = _module(src + "\n\n" + fix, tag)
    return m, (lambda p, lse2: m.merge(p, lse2, kernel=m.merge_fixed_kernel))


def test_the_planted_merge_bug_is_wrong_for_the_long_request_only():
    case = ch07_find_bug.merge_case()
    m, fixed = _merge()
    got = m.merge(case["partials"], case["lse2"]).cpu()
    right = [torch.allclose(got[r], case["want"][r], atol=1e-4) for r in range(3)]
    assert right == [True, False, True]
    assert ch07_find_bug.wrong_requests(case) == [1]
    report = ch07_find_bug.check_merge_bug({"request": 1, "variable": "w"}, fixed)
    assert report, failures(report)


@pytest.mark.parametrize("found, words", [
    ({"request": 0, "variable": "w"}, "is merged right"),  # the first request, unchecked
    ({"request": 1, "variable": "lse"}, "holds the right values"),  # blaming the split kernel
    ({"request": 1, "variable": "total"}, "holds the right values"),  # the division, downstream
])
def test_first_merge_localisations_are_named(found, words):
    _, fixed = _merge()
    failed = failures(ch07_find_bug.check_merge_bug(found, fixed))
    assert list(failed) == [MERGE_FOUND] and words in failed[MERGE_FOUND]


def test_first_merge_fixes_are_rejected():
    # natural log kept, the max's subtraction dropped
    _, fix = _merge("w = tl.exp2(lse - m)", "w = tl.exp(lse)", "nomax")
    assert MERGE_FIX in failures(ch07_find_bug.check_merge_bug({"request": 1, "variable": "w"}, fix))
    # equal weights: "the splits are the same size"
    _, fix = _merge("w = tl.exp2(lse - m)", "w = tl.where(lse > float('-inf'), 1.0, 0.0)", "equal")
    assert MERGE_FIX in failures(ch07_find_bug.check_merge_bug({"request": 1, "variable": "w"}, fix))


# ------------------------------------------------------------------ 7: the split count, measured
PREDICTION = "your prediction matches the measurement, figure by figure"


def _policy(p):
    return lambda seq_lens, num_kv_heads: p


def test_the_measurement_follows_the_split_count():
    one, four = ch07_split_measure.measure_splits(1), ch07_split_measure.measure_splits(4)
    assert one["right"] and four["right"]
    assert one["extra_bytes"] == 0 and one["empty_programs"] == 0
    assert four["kv_bytes"] == one["kv_bytes"] == 247 * 2 * 32 * 4 * 2  # every key once
    # segments of 64 keys (TILE_N): 200 fills four, 40 and 7 one each: 6 empty, for each of 2 KV heads
    assert four["programs"] == 3 * 2 * 4 and four["empty_programs"] == (3 + 3) * 2
    assert four["extra_bytes"] > 0


def test_the_solution_prediction_passes():
    src = _cell("solutions/07_paged_attention.ipynb", "def num_splits_for(")
    ns: dict = {}
    exec(src, ns)  # noqa: S102 -- the solution notebook's own cell
    report = ch07_split_measure.check_split_policy(ns["num_splits_for"], ns["predicted"])
    assert report, failures(report)


@pytest.mark.parametrize("change, words", [  # each a newcomer's first prediction
    (dict(programs=4 * 2), "the grid's axes"),  # splits x KV heads, the requests forgotten
    (dict(empty_programs=6), "one empty program per KV head"),  # empty segments counted once
    (dict(kv_bytes=4 * 126_464), "K/V read once"),  # each split reads all the keys
    (dict(extra_bytes=0), "the partials' round trip"),  # splitting is free
    (dict(extra_bytes=2 * 4 * 3_168), "q read by every split"),  # the query re-reads forgotten
])
def test_first_predictions_are_named(change, words):
    right = {k: ch07_split_measure.measure_splits(4)[k] for k in ch07_split_measure.KEYS}
    predicted = dict(right, **change)
    failed = failures(ch07_split_measure.check_split_policy(_policy(4), predicted))
    assert list(failed) == [PREDICTION], failed
    assert words in failed[PREDICTION], failed[PREDICTION]


def test_segments_not_rounded_to_tiles_are_named():
    # cdiv(seq_len, 4) keys a segment, not rounded to whole tiles: no segment is empty (40 -> 4 x 10,
    # 7 -> 2, 2, 2, 1); the kernel's segments of 64 keys leave 3 of 40's and 3 of 7's empty
    right = {k: ch07_split_measure.measure_splits(4)[k] for k in ch07_split_measure.KEYS}
    failed = failures(ch07_split_measure.check_split_policy(_policy(4), dict(right, empty_programs=0)))
    assert "segments of whole tiles" in failed[PREDICTION], failed


def test_a_policy_out_of_range_is_refused():
    failed = failures(ch07_split_measure.check_split_policy(_policy(0), None))
    assert "an int from 1 to 64" in failed["your policy gives a split count the library takes"]
    with pytest.raises(ValueError, match="num_splits must be an int from 1 to 64, got 0"):
        ch07_split_measure.measure_splits(0)


COMPILED_MODE = '''
import os
os.environ.pop("TRITON_INTERPRET", None)
import torch
torch.cuda.is_available = lambda: True  # what a GPU machine's import sees: compiled-mode kernels
import triton
import triton.language as tl

import pagedkv
from pagedkv import _device
from pagedkv.checks import ch07_split_measure, ch07b_find_bug

assert not _device.INTERPRETED


@triton.jit
def row_max(x_ptr, out_ptr, N: tl.constexpr):
    m = tl.max(tl.load(x_ptr + tl.arange(0, N)), 0)  # tl.max: one of Triton's own @jit helpers
    if tl.program_id(0) == 0:
        print("max", m)
    tl.store(out_ptr + tl.program_id(0), m)


out = torch.zeros(2)
ch07b_find_bug.interpreted(row_max)[(2,)](torch.arange(8.0), out, N=8)
print(out.tolist())
m = ch07_split_measure.measure_splits(3)
print(m["programs"], m["empty_programs"], m["kv_bytes"], m["extra_bytes"], m["right"])
'''


def test_stepping_and_measuring_run_where_kernels_are_compiled(tmp_path):
    # On a GPU the library's kernels (and Triton's own @jit helpers) are compiled-mode JITFunctions:
    # the notebooks' interpreted copies and the split measurement must still run them as Python.
    import subprocess
    import sys

    script = tmp_path / "compiled_mode.py"
    script.write_text(COMPILED_MODE)
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-3:] == ["max [7.]", "[7.0, 7.0]", "18 10 126464 25152 True"], done.stdout
