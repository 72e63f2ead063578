"""Paged attention with a sliding window, against PyTorch's SDPA with the same mask.

A sliding-window layer's query at position ``p`` sees keys ``p - W + 1 .. p``
(transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - W``). A
sliding-window KV-cache group returns the blocks that left every query's
window to the pool and puts the null block (id 0) in their table entries.
The cases here are built that way, then poisoned: the null block and every
released block hold NaN, so an implementation that reads one of them, even
masked, returns NaN. Released blocks are never handed out again here, so
every block a request still holds is finite. The expected output is SDPA on
contiguous K/V with a mask built here from positions, never from a table.

Three implementations: the Triton kernel (interpreted on a CPU), its
reference ``paged_attention_ref`` and the model's batched PyTorch path
(``plan_batch`` + ``batched_paged_attention``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pagedkv
from pagedkv.kernels import paged_attention, paged_attention_ref
from pagedkv.kernels.attention import (attention_partials, dense_attention_ref, first_columns, merge_partials_ref,
                                       split_segments)
from pagedkv.model import AttentionMetadata
from pagedkv.model.paged_attention import batched_paged_attention, plan_batch

DEV = pagedkv.default_device()
TOL = {torch.float32: 2e-5 if not pagedkv.on_gpu() else 2e-3, torch.bfloat16: 3e-2}


def window_case(q_lens, ctx_lens, window, *, block_size=4, heads=4, kv_heads=2, head_dim=32,
                dtype=torch.float32, seed=0):
    """A batch whose table holds the null block where a sliding-window group released blocks.

    Returns ``(args, expected, released)``: the kernel's arguments, SDPA's
    output with the window mask, and the ids of the released blocks.
    Block 0 is the null block; the pool's other blocks are shuffled.
    """
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    keys = [torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for n in seq_lens]
    values = [torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for n in seq_lens]
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(need) + 2  # the null block, every block, two spare
    order = (1 + torch.randperm(num_blocks - 1, generator=g)).tolist()
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    # Columns past a row's blocks hold the null block, as the engine's gathered tables do.
    table = torch.zeros((len(seq_lens), max(need) + 2), dtype=torch.int32)
    released = []
    for r, n in enumerate(seq_lens):
        ids, order = order[:need[r]], order[need[r]:]
        table[r, :need[r]] = torch.tensor(ids, dtype=torch.int32)
        for j, b in enumerate(ids):
            rows = slice(j * block_size, min((j + 1) * block_size, n))
            key_cache[b, :rows.stop - rows.start] = keys[r][rows]
            value_cache[b, :rows.stop - rows.start] = values[r][rows]
        # The group frees the blocks wholly before the first new token's window
        # (vLLM's SlidingWindowManager: num_computed_tokens - W + 1 tokens skipped).
        skipped = max(0, ctx_lens[r] - window + 1) // block_size
        released += ids[:skipped]
        table[r, :skipped] = 0
    for b in [0, *released]:  # poison: any read of these, even masked, turns the output NaN
        key_cache[b] = float("nan")
        value_cache[b] = float("nan")
    # The expectation: SDPA on each request's contiguous K/V, mask from positions.
    group = heads // kv_heads
    expected, start = [], 0
    for r, n in enumerate(seq_lens):
        qr = q[start:start + q_lens[r]].float().transpose(0, 1)
        pos_q = torch.arange(ctx_lens[r], n)[:, None]
        pos_k = torch.arange(n)[None, :]
        mask = (pos_k <= pos_q) & (pos_k > pos_q - window)
        kr = keys[r].float().repeat_interleave(group, 1).transpose(0, 1)
        vr = values[r].float().repeat_interleave(group, 1).transpose(0, 1)
        expected.append(F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=head_dim ** -0.5)
                        .transpose(0, 1).to(dtype))
        start += q_lens[r]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = dict(q=q.to(DEV), key_cache=key_cache.to(DEV), value_cache=value_cache.to(DEV),
                block_table=table.to(DEV), seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(DEV),
                query_start_loc=qsl.to(DEV), scale=head_dim ** -0.5)
    return args, torch.cat(expected).to(DEV), released


def batched(args, window):
    """The model's PyTorch path (TorchBackend) on the same arguments."""
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64, device=DEV), args["block_table"],
                             args["seq_lens"], args["query_start_loc"])
    kc = args["key_cache"]
    plan = plan_batch(meta, kc.shape[0], kc.shape[1], args["q"].shape[0], window)
    return batched_paged_attention(args["q"], kc, args["value_cache"], plan, args["scale"])


def assert_close(got, want, dtype=torch.float32):
    assert got.shape == want.shape
    assert not got.isnan().any(), "NaN in the output: a released block or the null block was read"
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err:.3g} > {TOL[dtype]:.1g}"


# (q_lens, ctx_lens, window, block_size): decodes deep past the window, prefill
# chunks that cross it, a window of 1 (a token sees itself only), a window that
# never slides, windows that do not divide the block size, block size 1.
CASES = [
    ([1, 1, 1], [40, 9, 3], 8, 4),
    ([20, 1, 5], [0, 33, 30], 8, 4),
    ([13, 6], [25, 17], 5, 4),
    ([3, 1], [30, 21], 1, 4),
    ([7, 1], [11, 14], 64, 4),
    ([9, 1, 2], [19, 40, 7], 6, 1),
    ([33, 1], [40, 70], 24, 16),
]


@pytest.mark.parametrize("q_lens,ctx_lens,window,block_size", CASES)
def test_all_three_equal_sdpa_with_the_window_mask_and_never_read_released_blocks(q_lens, ctx_lens, window,
                                                                                   block_size):
    args, want, released = window_case(q_lens, ctx_lens, window, block_size=block_size)
    assert_close(paged_attention(**args, sliding_window=window), want)
    assert_close(paged_attention_ref(**args, sliding_window=window), want)
    assert_close(batched(args, window), want)
    # Every column before a row's first column read is a released block's.
    first = first_columns(args["seq_lens"].tolist(), q_lens, block_size, window)
    assert sum(first) == len(released)


@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_split_kv_with_a_window_equals_sdpa(num_splits):
    args, want, _ = window_case([1, 1, 4], [60, 23, 50], 16, block_size=4, seed=3)
    assert_close(paged_attention(**args, sliding_window=16, num_splits=num_splits), want)
    partials, lse2 = attention_partials(**args, num_splits=num_splits, sliding_window=16)
    assert not torch.isnan(partials).any() and not torch.isnan(lse2).any()
    assert_close(merge_partials_ref(partials, lse2).to(args["q"].dtype), want)


def test_the_poison_is_live_full_attention_over_the_same_table_reads_it():
    """The control: without the window the kernel walks from column 0, reads the null block, returns NaN."""
    args, _, released = window_case([1, 1], [30, 12], 8, seed=5)
    assert released  # the case did release blocks
    assert paged_attention(**args).isnan().any()
    assert paged_attention_ref(**args).isnan().any()
    assert batched(args, None).isnan().any()


@pytest.mark.parametrize("case_window,kernel_window", [(8, 7), (9, 8)])
def test_an_off_by_one_window_differs_from_sdpa(case_window, kernel_window):
    """W keys, itself included: one key fewer gives other numbers, so the cases above can fail."""
    args, want, _ = window_case([6, 1], [20, 30], case_window, seed=6)
    got = paged_attention(**args, sliding_window=kernel_window)
    assert not got.isnan().any() and (got - want).abs().max().item() > 1e-3


def test_bf16_with_a_window():
    args, want, _ = window_case([9, 1], [30, 44], 12, block_size=16, dtype=torch.bfloat16, seed=7)
    assert_close(paged_attention(**args, sliding_window=12), want, torch.bfloat16)
    assert_close(batched(args, 12), want, torch.bfloat16)


def test_dense_attention_ref_takes_the_window():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(10, 2, 16, generator=g), torch.randn(10, 2, 16, generator=g)
    q = torch.randn(4, 2, 16, generator=g)
    out = dense_attention_ref(q, k, v, [0, 4], [0, 10], 0.25, sliding_window=3)
    # query 3 sits at position 9 and sees keys 7, 8, 9 only
    s = (q[3:4].transpose(0, 1) @ k[7:10].transpose(0, 1).transpose(1, 2)) * 0.25
    want = (s.softmax(-1) @ v[7:10].transpose(0, 1)).transpose(0, 1)
    assert torch.allclose(out[3:4], want, atol=1e-6)


def test_split_segments_start_at_the_window():
    assert split_segments(40, 2, 16, kv_start=9) == [(9, 25), (25, 40)]
    assert split_segments(40, 2, 16) == [(0, 32), (32, 40)]


@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-3, ValueError), (True, TypeError), (4.0, TypeError),
                                     ("8", TypeError)])
def test_a_bad_window_is_refused_before_any_launch(bad, exc):
    args, _, _ = window_case([1], [10], 4)
    for fn in (paged_attention, paged_attention_ref):
        with pytest.raises(exc, match="sliding_window"):
            fn(**args, sliding_window=bad)
    with pytest.raises(exc, match="sliding_window"):
        batched(args, bad)


def test_columns_before_the_window_may_hold_anything_but_those_in_it_are_checked():
    args, want, _ = window_case([1, 1], [30, 12], 8, seed=8)
    table = args["block_table"].clone()
    table[0, 0] = -5  # before request 0's window: never read, so not checked
    assert_close(paged_attention(**dict(args, block_table=table), sliding_window=8), want)
    table[0, 7] = 10**6  # position 28..31: inside the window
    with pytest.raises(IndexError, match=r"block_table\[0, 7\]"):
        paged_attention(**dict(args, block_table=table), sliding_window=8)
    with pytest.raises(IndexError, match=r"block_table\[0, 0\]"):  # full attention reads column 0
        paged_attention(**dict(args, block_table=table))


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_equal_sdpa(seed):
    """Seeded random batches: lengths, chunks, windows, block sizes and head groups drawn at random."""
    g = torch.Generator().manual_seed(100 + seed)

    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    num_reqs = draw(1, 4)
    q_lens = [draw(1, 1) if draw(0, 1) else draw(1, 24) for _ in range(num_reqs)]
    ctx_lens = [draw(0, 60) for _ in range(num_reqs)]
    window, block_size = draw(1, 40), [1, 2, 4, 8, 16][draw(0, 4)]
    kv_heads = [1, 2][draw(0, 1)]
    heads = kv_heads * [1, 2, 4][draw(0, 2)]
    args, want, _ = window_case(q_lens, ctx_lens, window, block_size=block_size, heads=heads, kv_heads=kv_heads,
                                seed=seed)
    splits = [None, 2, 3][draw(0, 2)]
    assert_close(paged_attention(**args, sliding_window=window, num_splits=splits), want)
    assert_close(paged_attention_ref(**args, sliding_window=window), want)
    assert_close(batched(args, window), want)
