"""The paged-attention kernel on random mixed batches (hypothesis), against both references.

Apart from test_attention.py so that a machine without hypothesis (a bare GPU
instance) still runs every other kernel test.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_attention import check_all_three, make_case  # noqa: E402


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_shapes(data):
    num_reqs = data.draw(st.integers(1, 4))
    q_lens = data.draw(st.lists(st.integers(0, 300), min_size=num_reqs, max_size=num_reqs))
    ctx = data.draw(st.lists(st.integers(0, 1000), min_size=num_reqs, max_size=num_reqs))
    ctx = [max(c, 1 - n) for c, n in zip(ctx, q_lens)]  # at least one token per request
    block_size = data.draw(st.sampled_from([1, 8, 16, 32, 64, 128]))
    heads, kv_heads = data.draw(st.sampled_from([(2, 2), (4, 1), (8, 1)]))
    splits = data.draw(st.sampled_from([None, 1, 3]))
    case, dense = make_case(q_lens, ctx, heads=heads, kv_heads=kv_heads, head_dim=16,
                            block_size=block_size, seed=data.draw(st.integers(0, 10**6)))
    check_all_three(case, dense, torch.float32, num_splits=splits)
