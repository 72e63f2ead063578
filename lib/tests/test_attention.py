"""The paged-attention kernel against its gather reference and against PyTorch's SDPA.

Three implementations meet here: the Triton kernel (interpreted on a CPU,
compiled on a GPU), ``paged_attention_ref`` (gather through the table, then
dense attention) and ``dense_attention_ref`` (SDPA on contiguous K/V, which
never sees a block table). Tables are scattered and their unused columns hold
garbage, so a kernel that reads past ``seq_len`` fails rather than passes.
"""

from __future__ import annotations

import math

import pytest
import torch

import pagedkv
from pagedkv.kernels import dense_attention_ref, paged_attention, paged_attention_ref
from pagedkv.kernels.attention import (attention_partials, launch_planned, merge_partials_ref, paginate,
                                       plan_attention, split_segments, validated_plan)

DEV = pagedkv.default_device()
# fp32 never rounds through TF32: the kernel passes input_precision="ieee" to both of its fp32
# tl.dot calls (kernels/attention.py, FP32_DOT), overriding Triton's TF32 default on Ampere and
# later. The interpreter's tl.dot is numpy's matmul, hence the tight bound; compiled, the same
# IEEE products are summed in another order (FMA tiles, exp2 on the GPU's approximate unit),
# and 2e-3 leaves room for that (not measured yet on a GPU; it could likely be tightened).
TOL = {torch.float32: 2e-5 if not pagedkv.on_gpu() else 2e-3, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def make_case(q_lens, ctx_lens, *, heads=4, kv_heads=2, head_dim=32, block_size=16,
              dtype=torch.float32, seed=0, unused=10**6):
    """Random K/V per request, paged into shuffled blocks; q for the last q_len positions."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    keys = [torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for n in seq_lens]
    values = [torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for n in seq_lens]
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    kc, vc, table, lens = paginate(keys, values, block_size, sum(-(-n // block_size) for n in seq_lens) + 3,
                                   seed=seed, unused=unused)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    kv_start = [0, *torch.tensor(seq_lens).cumsum(0).tolist()]
    case = dict(q=q.to(DEV), key_cache=kc.to(DEV), value_cache=vc.to(DEV), block_table=table.to(DEV),
                seq_lens=lens.to(DEV), query_start_loc=qsl.to(DEV), scale=head_dim ** -0.5)
    dense = dict(key=torch.cat(keys).to(DEV), value=torch.cat(values).to(DEV), kv_start_loc=kv_start)
    return case, dense


def assert_close(got, want, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    assert err <= TOL[dtype], f"max abs error {err:.3g} > {TOL[dtype]:.1g}"


def check_all_three(case, dense, dtype, num_splits=None):
    out = paged_attention(**case, num_splits=num_splits)
    ref = paged_attention_ref(**case)
    sdpa = dense_attention_ref(case["q"], dense["key"], dense["value"], case["query_start_loc"],
                               dense["kv_start_loc"], case["scale"])
    assert out.device == case["q"].device
    assert_close(out, ref, dtype)
    assert_close(out, sdpa, dtype)
    return out


@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_mixed_batch_every_block_size_and_gqa_ratio(block_size, heads, kv_heads):
    # Two prefill chunks (one after a context, one fresh) and three decode tokens.
    case, dense = make_case([13, 9, 1, 1, 1], [20, 0, 1, 40, 70], heads=heads, kv_heads=kv_heads,
                            block_size=block_size, seed=block_size)
    check_all_three(case, dense, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes_accumulate_in_fp32(dtype):
    case, dense = make_case([20, 1, 1], [30, 100, 5], heads=8, kv_heads=2, dtype=dtype, seed=3)
    out = check_all_three(case, dense, dtype)
    assert out.dtype == dtype


@pytest.mark.parametrize("head_dim", [16, 64, 80, 96, 112, 128, 256])
def test_head_dims(head_dim):
    # 80, 96 and 112 (Phi-2, Phi-3, ...) are padded to the next power of two, the extra dims masked.
    case, dense = make_case([5, 1], [11, 30], heads=4, kv_heads=1, head_dim=head_dim, seed=head_dim)
    check_all_three(case, dense, torch.float32)


def test_padded_head_dim_in_bf16_with_split_kv():
    case, dense = make_case([1, 3], [200, 40], heads=8, kv_heads=2, head_dim=96, dtype=torch.bfloat16, seed=9)
    check_all_three(case, dense, torch.bfloat16, num_splits=3)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 8])
def test_split_kv_matches_unsplit(num_splits):
    # Long decode contexts plus one prefill chunk, so some segments are empty for some tiles.
    case, dense = make_case([1, 1, 6], [300, 17, 40], heads=8, kv_heads=2, seed=7)
    check_all_three(case, dense, torch.float32, num_splits=num_splits)


def test_split_kv_in_bf16():
    case, dense = make_case([1, 1], [500, 90], heads=8, kv_heads=2, dtype=torch.bfloat16, seed=8)
    check_all_three(case, dense, torch.bfloat16, num_splits=4)


def test_request_without_new_tokens_produces_nothing():
    case, dense = make_case([4, 0, 1], [10, 25, 9], seed=4)
    assert case["q"].shape[0] == 5
    check_all_three(case, dense, torch.float32)


def test_block_size_1_equals_block_size_16():
    # SGLang's token-level table and vLLM's 16-token blocks hold the same K/V: same output.
    a, _ = make_case([7, 1], [30, 44], block_size=1, seed=5)
    b, _ = make_case([7, 1], [30, 44], block_size=16, seed=5)
    assert torch.equal(a["q"], b["q"])
    assert_close(paged_attention(**a), paged_attention(**b), torch.float32)


def test_garbage_in_unused_columns_is_never_read():
    for unused in (-1, 10**6, -(2**31)):
        case, dense = make_case([3, 1], [10, 20], block_size=8, seed=6, unused=unused)
        check_all_three(case, dense, torch.float32)


def test_inputs_are_not_modified():
    case, _ = make_case([6, 1], [10, 33], seed=9)
    before = {k: v.clone() for k, v in case.items() if isinstance(v, torch.Tensor)}
    paged_attention(**case, num_splits=3)
    for k, v in before.items():
        assert torch.equal(case[k], v), k


def test_dense_reference_is_softmax_attention():
    # The baseline itself, against the formula written out.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 16, generator=g) for n, h in ((3, 4), (7, 2), (7, 2)))
    out = dense_attention_ref(q, k, v, [0, 3], [0, 7], 0.25)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    for i in range(3):
        s = torch.einsum("hd,nhd->hn", q[i], kk[: 4 + i + 1]) * 0.25
        want = torch.einsum("hn,nhd->hd", s.softmax(-1), vv[: 4 + i + 1])
        torch.testing.assert_close(out[i], want, atol=1e-5, rtol=1e-5)


def test_plan_shapes_the_grid():
    decode = plan_attention(32, 8, [1] * 64, [4096] * 64)
    assert (decode.block_m, decode.block_q) == (16, 4)  # the group of 4 query heads, padded for tl.dot
    assert decode.grid[:2] == (64, 8)
    prefill = plan_attention(32, 8, [2048] * 4, [2048] * 4, num_splits=1)
    assert prefill.block_q * 4 == prefill.block_m and prefill.grid == (4 * 2048 // prefill.block_q, 8, 1)
    assert plan_attention(4, 4, [1], [10_000], num_splits=6).grid == (1, 4, 6)


def test_work_list_holds_only_tiles_with_new_tokens():
    # The mixed batch of the review: one 2k chunk and 63 decodes. Padding every
    # request to the chunk's 64 tiles launched 32,768 programs, 1,016 with work.
    mixed = plan_attention(32, 8, [2048] + [1] * 63, [2048] + [4096] * 63, num_splits=1)
    tiles = 2048 // mixed.block_q
    assert mixed.grid == (tiles + 63, 8, 1)
    assert mixed.work_items() == [(0, t) for t in range(tiles)] + [(r, 0) for r in range(1, 64)]
    # A request with no new tokens this step gets no program.
    assert plan_attention(8, 2, [3, 0, 1], [3, 5, 9]).work_items() == [(0, 0), (2, 0)]
    # Axis 0 holds the work: a step of 70,000 one-token requests fits (axis 2 stopped at 65,535).
    assert plan_attention(8, 8, [1] * 70_000, [1] * 70_000, num_splits=1).grid == (70_000, 8, 1)


def test_one_work_list_serves_every_layer():
    """validated_plan puts the list on the kernels' device once; each layer's launch reuses it."""
    torch.manual_seed(0)
    q_lens, ctx = [5, 1, 0, 2], [3, 9, 4, 0]
    keys = [torch.randn(c + n, 2, 16) for c, n in zip(ctx, q_lens)]
    values = [torch.randn(c + n, 2, 16) for c, n in zip(ctx, q_lens)]
    kc, vc, table, seq_lens = paginate(keys, values, 4, seed=1)
    qsl = torch.tensor([0, 5, 6, 6, 8], dtype=torch.int32)
    q = torch.randn(8, 4, 16)
    args = (kc, vc, table, seq_lens, qsl, 0.25)
    plan = validated_plan(q, *args)
    assert plan.work.device == q.device and plan.work_items() == [(0, 0), (1, 0), (3, 0)]
    for layer in range(2):
        qs = q + layer
        torch.testing.assert_close(launch_planned(plan, qs, *args), paged_attention_ref(qs, *args),
                                   atol=1e-5, rtol=1e-5)


def test_partials_are_the_split_kernels_and_merge_to_its_output():
    # One decode token and a 6-token chunk: the chunk's tile has segments past some rows' limits.
    case, dense = make_case([1, 6], [300, 40], heads=8, kv_heads=2, seed=12)
    partials, lse2 = attention_partials(**case, num_splits=4)
    assert partials.shape == (4, 7, 8, 32) and lse2.shape == (4, 7, 8)
    assert partials.dtype == lse2.dtype == torch.float32
    assert_close(merge_partials_ref(partials, lse2), paged_attention(**case, num_splits=4), torch.float32)
    assert_close(merge_partials_ref(partials, lse2), paged_attention_ref(**case), torch.float32)
    # Each segment's lse is the log-sum-exp of its own keys' scores (base 2), or -inf without keys.
    plan = validated_plan(**case, num_splits=4)
    keys = dense["key"][:301, 0].float()
    scores = keys @ case["q"][0, 0].float() * case["scale"]
    for s, (lo, hi) in enumerate(split_segments(301, 4, plan.tile_n)):
        want = torch.logsumexp(scores[lo:hi], 0).item() / math.log(2) if lo < hi else -math.inf
        assert math.isclose(lse2[s, 0, 0].item(), want, rel_tol=1e-5, abs_tol=1e-5), (s, lo, hi)


def test_split_segments_cut_whole_tiles_and_leave_late_splits_empty():
    assert split_segments(1000, 4, 64) == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert split_segments(76, 4, 64) == [(0, 64), (64, 76), (128, 76), (192, 76)]
    assert split_segments(10, 1, 64) == [(0, 10)]
    # A row of the chunk that sees no key of a segment has lse -inf there, and the merge still holds.
    case, _ = make_case([16], [60], heads=4, kv_heads=2, seed=13)
    plan = validated_plan(**case, num_splits=2)
    assert split_segments(76, 2, plan.tile_n) == [(0, 64), (64, 76)] and plan.block_q >= 16
    _, lse2 = attention_partials(**case, num_splits=2)
    assert torch.isinf(lse2[1, :4]).all() and torch.isfinite(lse2[1, 4:]).all()  # positions 60..63
    assert torch.isfinite(lse2[0]).all()


def test_partials_refuse_a_single_split():
    case, _ = make_case([1], [20], seed=14)
    for bad in (1, 0, True, 2.0):
        with pytest.raises(ValueError, match="num_splits"):
            attention_partials(**case, num_splits=bad)


# ------------------------------------------------------------------ refused inputs

def _refused(case, exc, *words, **extra):
    before = {k: v.clone() for k, v in case.items() if isinstance(v, torch.Tensor)}
    for fn in (paged_attention, paged_attention_ref):
        with pytest.raises(exc) as info:
            fn(**case, **extra)
        for w in words:
            assert w in str(info.value), (w, str(info.value))
    for k, v in before.items():
        if isinstance(case[k], torch.Tensor) and case[k].shape == v.shape and case[k].device.type != "meta":
            assert torch.equal(case[k], v)


def test_out_of_range_block_id_names_request_and_column():
    case, _ = make_case([2, 1], [20, 40], block_size=16, seed=1)
    case["block_table"][1, 2] = case["key_cache"].shape[0]  # column 2 covers positions 32..40
    _refused(case, IndexError, "block_table[1, 2]", "request 1", "column 2")
    case["block_table"][1, 2] = -3
    _refused(case, IndexError, "block_table[1, 2] = -3")


def test_malformed_metadata_is_refused():
    base, _ = make_case([2, 1], [5, 7], block_size=4, seed=2)

    def variant(**changes):
        c = dict(base)
        c.update(changes)
        return c

    i32 = dict(dtype=torch.int32, device=DEV)
    _refused(variant(seq_lens=torch.tensor([1, 8], **i32)), ValueError, "seq_lens[0] = 1", "2 new tokens")
    _refused(variant(seq_lens=torch.tensor([0, 8], **i32), query_start_loc=torch.tensor([0, 0, 3], **i32)),
             ValueError, "seq_lens[0] = 0")
    _refused(variant(query_start_loc=torch.tensor([0, 3, 2], **i32)), ValueError, "query_start_loc")
    _refused(variant(query_start_loc=torch.tensor([1, 2, 3], **i32)), ValueError, "query_start_loc[0]")
    _refused(variant(query_start_loc=torch.tensor([0, 2, 4], **i32)), ValueError, "q has 3 tokens")
    _refused(variant(seq_lens=base["seq_lens"].long()), TypeError, "seq_lens must be int32")
    _refused(variant(block_table=base["block_table"][:, :1].contiguous()), ValueError, "columns")
    _refused(variant(q=base["q"].half()), TypeError, "share one dtype")
    _refused(variant(q=base["q"][:, :3].contiguous()), ValueError, "multiple of num_kv_heads")
    _refused(variant(scale=float("nan")), TypeError, "scale")
    _refused(base, ValueError, "num_splits", num_splits=0)


def test_bad_head_dim_and_devices():
    case, _ = make_case([1], [5], head_dim=16)
    for dim in (44, 264):  # not a multiple of 8; over 256
        c = dict(case, q=torch.zeros(1, 4, dim, device=DEV), key_cache=torch.zeros(3, 16, 2, dim, device=DEV),
                 value_cache=torch.zeros(3, 16, 2, dim, device=DEV))
        _refused(c, ValueError, "head_dim must be one of 16, 24, 32", "80, 88, 96", f"got {dim}")
    _refused(dict(case, q=case["q"].to("meta")), ValueError, "q is on the meta device")
    if DEV.type == "cpu":
        return
    _refused(dict(case, seq_lens=case["seq_lens"].cpu()), ValueError, "one device")


def test_scale_is_the_softmax_scale():
    case, dense = make_case([3], [4], seed=11)
    for scale in (0.05, 1.0):
        c = dict(case, scale=scale)
        out = paged_attention(**c)
        want = dense_attention_ref(c["q"], dense["key"], dense["value"], c["query_start_loc"],
                                   dense["kv_start_loc"], scale)
        assert_close(out, want, torch.float32)
    assert not math.isclose(paged_attention(**dict(case, scale=0.05)).sum().item(),
                            paged_attention(**dict(case, scale=1.0)).sum().item())


def test_report_figure_draws_from_synthetic_rows(monkeypatch):
    # The GPU figure's code path, fed rows shaped like the benchmark's (no GPU needed).
    matplotlib = pytest.importorskip("matplotlib")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pagedkv.bench import attention as bench

    rows = [dict(name=f"decode 16x4096 block {b}", block_size=b, gbps=1000.0 + b, batch=16, context=4096,
                 time_vs_sdpa=1.1) for b in bench.BLOCK_SIZES]
    rows += [dict(name=f"decode {b}x{c}", block_size=16, gbps=2000.0, batch=b, context=c, time_vs_sdpa=1.2)
             for b, c in bench.DECODE]
    monkeypatch.setattr(plt, "show", lambda: None)
    bench._plot(rows, 4800.0, "test device")
    fig = plt.gcf()
    left, right = fig.axes
    assert len(left.lines[0].get_xdata()) == len(bench.BLOCK_SIZES)
    assert len(right.patches) == 2 * len(bench.DECODE)
    plt.close(fig)
