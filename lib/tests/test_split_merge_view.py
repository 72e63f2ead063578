"""Chapter 7's split-KV picture: drawn from the kernel's own partials, and they merge to its output."""

from __future__ import annotations

import math

import pytest
import torch

import pagedkv
from pagedkv.kernels.attention import paginate

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from pagedkv.views.split_merge import split_merge, split_merge_figure, split_merge_table  # noqa: E402

DEV = pagedkv.default_device()


def _case(n=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(n, 2, 16, generator=g), torch.randn(n, 2, 16, generator=g)
    q = torch.randn(1, 4, 16, generator=g)
    k[100:110, 0] += 1.5 * q[0, 0]  # keys of split 1 match head 0's query
    kc, vc, table, lens = paginate([k], [v], 16, seed=seed)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    return tuple(t.to(DEV) for t in (q, kc, vc, table, lens, qsl)) + (0.25,)


def test_the_row_merges_to_the_unsplit_output_and_weights_sum_to_one():
    sm = split_merge(*_case(), num_splits=5)  # 300 keys in 64-key tiles: split 4 starts at 320
    assert sm.segments == [(0, 64), (64, 128), (128, 192), (192, 256), (256, 300)]
    torch.testing.assert_close(sm.merged, sm.unsplit, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sm.kernel, sm.unsplit, atol=1e-5, rtol=1e-5)
    assert math.isclose(sm.weights.sum().item(), 1.0, rel_tol=1e-6)
    assert int(sm.weights.argmax()) == 1  # the segment holding the matching keys
    # The lse is the log-sum-exp of the segment's own scores.
    lo, hi = sm.segments[2]
    assert math.isclose(sm.lse[2].item(), torch.logsumexp(sm.scores[lo:hi], 0).item(), rel_tol=1e-5)


def test_an_empty_split_weighs_nothing_and_is_drawn_empty():
    sm = split_merge(*_case(n=200), num_splits=4)  # seg = 64: split 3 starts at 192, keys end at 200
    sm5 = split_merge(*_case(n=200), num_splits=5)  # seg = 64 again: split 4 starts at 256
    assert sm5.segments[4] == (256, 200) and sm5.weights[4].item() == 0.0
    assert math.isinf(sm5.lse[4].item()) and sm.weights.min().item() > 0
    table = split_merge_table(sm5).splitlines()
    assert table[-1].split()[:3] == ["4", "none", "-"]
    fig = split_merge_figure(sm5)
    top, bottom = fig.axes
    assert any("no keys" in t.get_text() for t in top.texts)
    assert [t.get_text() for t in bottom.get_yticklabels()][-2:] == [
        "merged: sum of weight x partial", "the kernel, one split"]


def test_bad_row_is_refused():
    with pytest.raises(ValueError, match="token"):
        split_merge(*_case(), num_splits=2, token=1)
    with pytest.raises(ValueError, match="head"):
        split_merge(*_case(), num_splits=2, head=4)


def test_the_compile_prediction_is_read_from_the_committed_report():
    import json
    from pathlib import Path

    from pagedkv.views.kernel_source import kernel_prediction, programs_per_sm

    report = json.loads((Path(__file__).resolve().parents[2] / "book" / "compile_report.json").read_text())
    row = next(r for r in report["rows"] if (r.get("kind"), r.get("dtype"), r.get("head_dim"),
                                             r.get("block_size")) == ("split", "bf16", 128, 16))
    assert programs_per_sm("split", "bf16", 128, 16) == row["sm_90"]["resident"]
    assert programs_per_sm("split", "bf16", 128, 16, target="sm_80") == row["sm_80"]["resident"]
    text = kernel_prediction("split", "bf16", 128, 16)
    assert "predicted" in text and all(len(line) <= 79 for line in text.splitlines())
    with pytest.raises(LookupError, match="no merge"):
        programs_per_sm("merge", "bf16", 128, 16)
