"""The attention benchmark's cases, on a CPU: what a GPU run times must be the right work.

The timing itself needs CUDA; the cases do not. A mixed step (one prompt chunk
and decodes) in two copies: the copies share no block (each timed call reads
its own memory), and SDPA's calls, one per group of equal requests, give the
reference's answer for every request.
"""

from __future__ import annotations

import torch

from pagedkv.bench import attention as bench
from pagedkv.common import cdiv
from pagedkv.kernels import paged_attention_ref


def test_mixed_case_copies_share_no_block_and_sdpa_groups_equal_the_reference():
    g = torch.Generator().manual_seed(0)
    q_lens, ctx = bench._mixed_lens(8, 3, 20)
    assert (q_lens, ctx) == ([8, 1, 1, 1], [0, 20, 20, 20])
    q, kc, vc, tables, seq_lens, qsl = bench._paged_case(q_lens, ctx, "cpu", g, copies=2, dtype=torch.float32)
    seqs = seq_lens.tolist()
    assert seqs == [8, 21, 21, 21] and qsl.tolist() == [0, 8, 9, 10, 11]
    used = [{b for r, s in enumerate(seqs) for b in tables[c, r, :cdiv(s, bench.BLOCK)].tolist()} for c in (0, 1)]
    assert len(used[0]) == len(used[1]) == sum(cdiv(s, bench.BLOCK) for s in seqs)
    assert not used[0] & used[1]
    calls, _backend = bench._sdpa_calls(q, kc, vc, tables, q_lens, seqs)
    chunk, decodes = calls[1]()  # copy 1: the chunk (causal), then the three decodes
    got = torch.cat([o.transpose(1, 2).reshape(-1, bench.HEADS, bench.HEAD_DIM) for o in (chunk, decodes)])
    want = paged_attention_ref(q[1], kc, vc, tables[1], seq_lens, qsl, bench.HEAD_DIM ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
