"""The chapter-7 mixed-batch driver and the kernel excerpt."""

from __future__ import annotations

import ast

import pytest
import torch

from pagedkv.kernels import dense_attention_ref, paged_attention_ref
from pagedkv.request import Request
from pagedkv.sim.mixed_batch import MixedBatchDriver, kernel_main_loop_source


def _driver():
    return MixedBatchDriver(32, 16, 2, 16, generator=torch.Generator().manual_seed(3))


def test_mixed_batch_shares_prefix_blocks_and_attends_like_dense():
    drv = _driver()
    doc = list(range(200, 240))
    a = Request("A", doc + [1, 2, 3])
    drv.step([(a, a.num_tokens)])
    a.append_output_token_ids(9)
    b = Request("B", doc + [5, 6])
    table, seq_lens, qsl = drv.step([(b, b.num_tokens), (a, 1)])
    assert qsl.tolist() == [0, 42 - 32, 42 - 32 + 1]  # B computes 10 tokens past the 2-block hit
    assert drv.manager.get_block_ids("B")[:2] == drv.manager.get_block_ids("A")[:2]
    assert seq_lens.tolist() == [42, 44]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(int(qsl[-1]), 4, 16, generator=g)
    out = paged_attention_ref(q, drv.key_cache, drv.value_cache, table, seq_lens, qsl, 0.35)
    kv = [drv.kv_of(torch.tensor(r.all_token_ids), torch.arange(r.num_tokens)) for r in (b, a)]
    dense = dense_attention_ref(q, torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv]),
                                qsl, [0, 42, 86], 0.35)
    assert (out - dense).abs().max().item() < 1e-4


def test_mixed_batch_refuses_a_bad_generator_and_a_full_pool():
    with pytest.raises(TypeError, match="generator"):
        MixedBatchDriver(8, 4, 1, 4, generator=0)
    drv = MixedBatchDriver(3, 4, 1, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="X"):
        drv.step([(Request("X", list(range(20))), 20)])


def test_kernel_main_loop_is_the_library_loop_and_fits_the_page():
    text = kernel_main_loop_source()
    assert text.startswith("for ") and "tl.load(table_row" in text and "tl.exp2" in text
    assert max(len(line) for line in text.splitlines()) <= 79
    ast.parse(text)  # the wrapped excerpt is still Python
