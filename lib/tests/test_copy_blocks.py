"""The block-copy kernel against its PyTorch reference and a per-element Python oracle.

On a CPU the kernel runs in Triton's interpreter, so shapes stay small.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import pagedkv
from pagedkv.kernels import copy_blocks, copy_blocks_ref
from pagedkv.kernels.copy_blocks import validate_block_pairs

DEV = pagedkv.default_device()


def make_caches(seed: int, num_layers: int, num_blocks: int, block_size: int, heads: int, dim: int, dtype):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, heads, dim)
    if dtype.is_floating_point:
        make = lambda: torch.randn(shape, generator=g).to(dtype)  # noqa: E731
    else:
        make = lambda: torch.randint(-100, 100, shape, generator=g).to(dtype)  # noqa: E731
    return [(make().to(DEV), make().to(DEV)) for _ in range(num_layers)]


def random_pairs(rng: random.Random, num_blocks: int, n: int) -> list[tuple[int, int]]:
    """n pairs with distinct dsts, none of which is a src (sources may repeat)."""
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    dsts, pool = ids[:n], ids[n:]
    return [(rng.choice(pool), d) for d in dsts]


def oracle(caches, pairs):
    """Per block, in plain Python: after the copy, dst holds what src held before."""
    out = []
    for k, v in caches:
        layer = []
        for t in (k, v):
            blocks = [t[b].cpu().clone() for b in range(t.shape[0])]
            before = list(blocks)
            for s, d in pairs:
                blocks[d] = before[s]
            layer.append(torch.stack(blocks))
        out.append(layer)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """Compare raw bits, so NaNs and signed zeros count as copied only if copied exactly."""
    size = t.element_size()
    return t.cpu().contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("block_size", [1, 16])
def test_kernel_matches_reference_and_oracle(dtype, block_size):
    rng = random.Random(block_size)
    for seed in range(3):
        num_blocks = 12
        caches = make_caches(seed, num_layers=3, num_blocks=num_blocks, block_size=block_size, heads=2, dim=8, dtype=dtype)
        pairs = random_pairs(rng, num_blocks, rng.randint(1, 5))
        want = oracle(caches, pairs)
        ref = [(k.clone(), v.clone()) for k, v in caches]
        copy_blocks(caches, pairs)
        copy_blocks_ref(ref, pairs)
        for (k, v), (rk, rv), (wk, wv) in zip(caches, ref, want):
            assert torch.equal(bits(k), bits(wk)) and torch.equal(bits(v), bits(wv))
            assert torch.equal(bits(rk), bits(wk)) and torch.equal(bits(rv), bits(wv))


def test_odd_block_size_and_flat_cache_list():
    """A block whose element count is not a power of two, and caches passed as a flat list."""
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(7, 3, 5, generator=g).to(DEV) for _ in range(4)]  # 15 elements per block
    before = [c.clone() for c in caches]
    copy_blocks(caches, torch.tensor([[0, 6], [0, 2], [4, 1]]))
    for c, b in zip(caches, before):
        assert torch.equal(c[6], b[0]) and torch.equal(c[2], b[0]) and torch.equal(c[1], b[4])
        untouched = [0, 3, 4, 5]
        assert torch.equal(c[untouched], b[untouched])


def test_nan_payload_copied_bit_exactly():
    cache = torch.zeros(3, 4, dtype=torch.float32)
    cache[0] = torch.tensor([float("nan"), -0.0, float("inf"), 1.5])
    cache = cache.to(DEV)
    copy_blocks([cache], [(0, 2)])
    assert torch.equal(bits(cache[2]), bits(cache[0]))
    assert torch.equal(bits(cache[1]), bits(torch.zeros(4)))


def test_empty_pairs_is_a_no_op():
    caches = make_caches(0, 1, 4, 2, 1, 4, torch.float32)
    before = [(k.clone(), v.clone()) for k, v in caches]
    copy_blocks(caches, [])
    copy_blocks(caches, np.zeros((0, 2), dtype=np.int64))
    assert all(torch.equal(k, bk) and torch.equal(v, bv) for (k, v), (bk, bv) in zip(caches, before))


@pytest.mark.parametrize(
    "pairs, exc, match",
    [
        ([(0, 4)], IndexError, r"block_pairs\[0\] = \(0, 4\): dst 4 is outside \[0, 4\)"),
        ([(1, 2), (-1, 3)], IndexError, r"src -1 is outside"),
        ([(0, 2), (1, 2)], ValueError, "block 2 is a dst more than once"),
        ([(0, 1), (1, 2)], ValueError, "block 1 is both a src and a dst"),
        ([(3, 3)], ValueError, "block 3 is both a src and a dst"),
        ([(0.0, 1.0)], TypeError, "block ids must be integers, got dtype float64"),
        ([0, 1, 2], ValueError, r"shape \[n, 2\]; got shape \(3,\)"),
    ],
)
def test_bad_pairs_raise_before_any_write(pairs, exc, match):
    caches = make_caches(1, 2, 4, 2, 1, 4, torch.float32)
    before = [(k.clone(), v.clone()) for k, v in caches]
    for fn in (copy_blocks, copy_blocks_ref):
        with pytest.raises(exc, match=match):
            fn(caches, pairs)
    assert all(torch.equal(k, bk) and torch.equal(v, bv) for (k, v), (bk, bv) in zip(caches, before))


def test_bad_caches_raise():
    a = torch.zeros(4, 2, 3)
    with pytest.raises(ValueError, match="shape of the first"):
        copy_blocks([a, torch.zeros(5, 2, 3)], [(0, 1)])
    with pytest.raises(TypeError, match="dtype torch.float32; cache 1 has torch.float16"):
        copy_blocks([a, torch.zeros(4, 2, 3, dtype=torch.float16)], [(0, 1)])
    with pytest.raises(ValueError, match="cache 0 must be contiguous"):
        copy_blocks([torch.zeros(3, 4, 2).transpose(0, 2)], [(0, 1)])
    with pytest.raises(TypeError, match="sequence of caches"):
        copy_blocks(a, [(0, 1)])
    with pytest.raises(ValueError, match="kv_caches is empty"):
        copy_blocks([], [(0, 1)])
    with pytest.raises(TypeError, match=r"kv_caches\[0\] must hold torch.Tensors, got str"):
        copy_blocks(["cache"], [(0, 1)])


@pytest.mark.parametrize("fn", [copy_blocks, copy_blocks_ref])
def test_meta_tensors_are_named(fn):
    a = torch.zeros(4, 2, 3, device=pagedkv.default_device())
    before = a.clone()
    with pytest.raises(ValueError, match="^kv_caches cache 1 is on the meta device, which holds no data"):
        fn([a, torch.zeros(4, 2, 3, device="meta")], [(0, 1)])
    with pytest.raises(ValueError, match="^block_pairs is on the meta device"):
        fn([a], torch.tensor([[0, 1]], device="meta"))
    assert torch.equal(a, before)


def test_validate_block_pairs_returns_int64_array():
    arr = validate_block_pairs([(1, 0), (1, 3)], 4)
    assert arr.dtype == np.int64 and arr.tolist() == [[1, 0], [1, 3]]
