"""The slot-mapping and KV-write kernels against their PyTorch references and a plain-Python oracle.

On a CPU the kernels run in Triton's interpreter, so shapes stay small.
"""

from __future__ import annotations

import pytest
import torch

import pagedkv
from pagedkv.kernels import (
    compute_slot_mapping,
    compute_slot_mapping_ref,
    reshape_and_cache,
    reshape_and_cache_ref,
)

DEV = pagedkv.default_device()
BLOCK_SIZES = [1, 8, 16, 32, 128]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def slot_oracle(table: list[list[int]], reqs: list[int], positions: list[int], block_size: int) -> list[int]:
    """The formula, one token at a time, on Python lists."""
    return [
        -1 if r == -1 else table[r][p // block_size] * block_size + p % block_size
        for r, p in zip(reqs, positions)
    ]


def random_case(seed: int, block_size: int, num_rows: int = 5, max_blocks: int = 6, num_tokens: int = 24):
    g = torch.Generator().manual_seed(seed)
    num_blocks = num_rows * max_blocks + 3
    # Distinct physical ids per cell, as a real pool would hand out.
    table = torch.randperm(num_blocks, generator=g)[: num_rows * max_blocks].reshape(num_rows, max_blocks)
    table = table.to(torch.int32)
    reqs = torch.randint(-1, num_rows, (num_tokens,), generator=g)
    positions = torch.randint(0, max_blocks * block_size, (num_tokens,), generator=g)
    positions[reqs == -1] = 10**9  # a padding token's position is never used
    return table, reqs, positions, num_blocks


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_slot_mapping_matches_reference_and_oracle(block_size):
    for seed in range(3):
        table, reqs, positions, _ = random_case(seed, block_size)
        want = slot_oracle(table.tolist(), reqs.tolist(), positions.tolist(), block_size)
        got = compute_slot_mapping(table.to(DEV), reqs, positions, block_size)
        ref = compute_slot_mapping_ref(table.to(DEV), reqs, positions, block_size)
        assert got.dtype == torch.int64 and got.device.type == DEV.type
        assert got.cpu().tolist() == want
        assert ref.cpu().tolist() == want


def test_slot_mapping_worked_example():
    # Row 3 holds 256 full blocks, then block 1913; token 4096 lands in column 256, offset 0.
    table = torch.zeros(4, 300, dtype=torch.int32)
    table[3, :256] = torch.arange(256) + 5000
    table[3, 256] = 1913
    got = compute_slot_mapping(table.to(DEV), [3], [4096], 16)
    assert got.cpu().tolist() == [1913 * 16 + 0] == [30608]


def test_slot_mapping_accepts_int32_numpy_and_lists():
    import numpy as np

    table, reqs, positions, _ = random_case(7, 8)
    want = slot_oracle(table.tolist(), reqs.tolist(), positions.tolist(), 8)
    t = table.to(DEV)
    assert compute_slot_mapping(t, reqs.to(torch.int32), positions.to(torch.int32), 8).cpu().tolist() == want
    assert compute_slot_mapping(t, reqs.numpy(), positions.numpy().astype(np.int32), 8).cpu().tolist() == want
    assert compute_slot_mapping(t, reqs.tolist(), positions.tolist(), 8).cpu().tolist() == want


def test_slot_mapping_empty_and_all_padding():
    table = torch.zeros(2, 3, dtype=torch.int32, device=DEV)
    assert compute_slot_mapping(table, [], [], 16).numel() == 0
    assert compute_slot_mapping(table, [-1, -1], [5, 999999], 16).cpu().tolist() == [-1, -1]
    assert compute_slot_mapping_ref(table, [-1, -1], [5, 999999], 16).cpu().tolist() == [-1, -1]


def test_slot_mapping_int64_arithmetic_past_2_31():
    # block id * block_size overflows int32; the kernel must widen before multiplying.
    table = torch.tensor([[2**31 - 1]], dtype=torch.int32, device=DEV)
    got = compute_slot_mapping(table, [0], [3], 128)
    assert got.cpu().tolist() == [(2**31 - 1) * 128 + 3]


@pytest.mark.parametrize(
    "reqs, positions, block_size, exc, words",
    [
        ([0, 7], [0, 0], 4, IndexError, "req_indices[1] = 7"),
        ([0, -2], [0, 0], 4, IndexError, "req_indices[1] = -2"),
        ([1], [12], 4, IndexError, "positions[0] = 12"),
        ([1], [-1], 4, IndexError, "positions[0] = -1"),
        ([0, 1], [0], 4, ValueError, "same length"),
        ([0], [0], 0, ValueError, "block_size"),
        ([0.5], [0], 4, TypeError, "req_indices"),
    ],
)
def test_slot_mapping_rejects_bad_input(reqs, positions, block_size, exc, words):
    table = torch.arange(6, dtype=torch.int32, device=DEV).reshape(2, 3)
    with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]")):
        compute_slot_mapping(table, reqs, positions, block_size)


def test_slot_mapping_rejects_bad_tables():
    with pytest.raises(TypeError, match="int32"):
        compute_slot_mapping(torch.zeros(2, 3, dtype=torch.int64), [0], [0], 4)
    with pytest.raises(ValueError, match="2-D"):
        compute_slot_mapping(torch.zeros(6, dtype=torch.int32), [0], [0], 4)
    with pytest.raises(ValueError, match="contiguous"):
        compute_slot_mapping(torch.zeros(3, 2, dtype=torch.int32).t(), [0], [0], 4)
    table = torch.tensor([[3, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="block id -1"):
        compute_slot_mapping(table, [0, 0], [1, 5], 4)


@pytest.mark.parametrize("fn", [compute_slot_mapping, compute_slot_mapping_ref])
def test_slot_mapping_names_a_meta_tensor(fn):
    table = torch.arange(6, dtype=torch.int32, device=DEV).reshape(2, 3)
    meta = torch.zeros(1, dtype=torch.int64, device="meta")
    for args, name in (((table.to("meta"), [0], [1], 4), "block_table"), ((table, meta, [1], 4), "req_indices"),
                       ((table, [0], meta, 4), "positions")):
        with pytest.raises(ValueError, match=f"^{name} is on the meta device, which holds no data"):
            fn(*args)


@pytest.mark.parametrize("fn", [reshape_and_cache, reshape_and_cache_ref])
def test_reshape_and_cache_names_a_meta_tensor(fn):
    base, _ = _bad_kv_inputs()
    for name in base:
        args = {**base, name: torch.empty_like(base[name], device="meta")}
        before_k, before_v = base["key_cache"].clone(), base["value_cache"].clone()
        with pytest.raises(ValueError, match=f"^{name} is on the meta device"):
            fn(**args)
        assert torch.equal(base["key_cache"], before_k) and torch.equal(base["value_cache"], before_v)


# -- the KV write ----------------------------------------------------------------------------------


def kv_case(seed: int, dtype, block_size: int, num_blocks: int = 4, heads: int = 2, head_dim: int = 4, tokens: int = 6):
    g = torch.Generator().manual_seed(seed)
    num_blocks = max(num_blocks, -(-2 * tokens // block_size))  # room for every token, and spare
    key = torch.randn(tokens, heads, head_dim, generator=g).to(dtype).to(DEV)
    value = torch.randn(tokens, heads, head_dim, generator=g).to(dtype).to(DEV)
    shape = (num_blocks, block_size, heads, head_dim)
    key_cache = torch.randn(shape, generator=g).to(dtype).to(DEV)  # old contents must survive
    value_cache = torch.randn(shape, generator=g).to(dtype).to(DEV)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[torch.randint(0, tokens, (2,), generator=g)] = -1  # some padding
    return key, value, key_cache, value_cache, slots.to(DEV)


def kv_oracle(key, value, key_cache, value_cache, slots):
    kc, vc = key_cache.clone(), value_cache.clone()
    bs = kc.shape[1]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            kc[s // bs, s % bs] = key[t]
            vc[s // bs, s % bs] = value[t]
    return kc, vc


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_reshape_and_cache_matches_reference_and_oracle(dtype, block_size):
    key, value, kc, vc, slots = kv_case(block_size, dtype, block_size)
    want_k, want_v = kv_oracle(key, value, kc, vc, slots)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    reshape_and_cache(key, value, kc, vc, slots)
    reshape_and_cache_ref(key, value, kc_ref, vc_ref, slots)
    # A copy is exact in every dtype: compare bit for bit.
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert torch.equal(kc_ref, want_k) and torch.equal(vc_ref, want_v)


def test_reshape_and_cache_odd_token_width():
    # 3 heads x 5 dims = 15 elements: the kernel's power-of-two tile must mask the rest.
    key, value, kc, vc, slots = kv_case(1, torch.float32, 8, heads=3, head_dim=5)
    want_k, want_v = kv_oracle(key, value, kc, vc, slots)
    reshape_and_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_write_through_slot_mapping_reads_back_dense():
    """Tokens of three requests written through the slot mapping read back, via the table, as a dense cache."""
    g = torch.Generator().manual_seed(3)
    bs, heads, dim, num_blocks = 4, 2, 8, 12
    lens = [5, 9, 3]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.zeros(3, 3, dtype=torch.int32)
    used = 0
    for r, n in enumerate(lens):
        k = -(-n // bs)
        table[r, :k] = torch.tensor(perm[used : used + k])
        used += k
    reqs = torch.tensor([r for r, n in enumerate(lens) for _ in range(n)])
    pos = torch.tensor([p for n in lens for p in range(n)])
    dense_k = torch.randn(len(reqs), heads, dim, generator=g)
    dense_v = torch.randn(len(reqs), heads, dim, generator=g)
    slots = compute_slot_mapping(table.to(DEV), reqs, pos, bs)
    kc = torch.zeros(num_blocks, bs, heads, dim, device=DEV)
    vc = torch.zeros_like(kc)
    reshape_and_cache(dense_k.to(DEV), dense_v.to(DEV), kc, vc, slots)
    start = 0
    for r, n in enumerate(lens):
        blocks = table[r, : -(-n // bs)].long()
        back_k = kc.cpu()[blocks].reshape(-1, heads, dim)[:n]
        back_v = vc.cpu()[blocks].reshape(-1, heads, dim)[:n]
        assert torch.equal(back_k, dense_k[start : start + n])
        assert torch.equal(back_v, dense_v[start : start + n])
        start += n


def _bad_kv_inputs():
    key, value, kc, vc, slots = kv_case(0, torch.float16, 4)
    cases = {
        "slot out of range": (dict(slot_mapping=torch.tensor([16, 0, 1, 2, 3, 5])), IndexError, r"slot_mapping\[0\] = 16"),
        "slot below -1": (dict(slot_mapping=torch.tensor([-2, 0, 1, 2, 3, 5])), IndexError, r"slot_mapping\[0\] = -2"),
        "duplicate slot": (dict(slot_mapping=torch.tensor([7, 0, 1, 7, 3, 5])), ValueError, "slot 7 appears more than once"),
        "int32 slots": (dict(slot_mapping=torch.arange(6, dtype=torch.int32)), TypeError, "int64"),
        "short slots": (dict(slot_mapping=torch.arange(5)), ValueError, "one slot per token"),
        "dtype mismatch": (dict(value=value.float()), TypeError, "share one dtype"),
        "int cache": (dict(key_cache=kc.to(torch.int16), value_cache=vc.to(torch.int16)), TypeError, "dtype must be one of"),
        "non-contiguous key": (dict(key=key.transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "key must be contiguous"),
        "head mismatch": (dict(key=key[:, :1].contiguous(), value=value[:, :1].contiguous()), ValueError, "heads/head_dim"),
        "value shape": (dict(value=value[:5]), ValueError, "value shape"),
        "key rank": (dict(key=key.reshape(6, -1), value=value.reshape(6, -1)), ValueError, "num_tokens, num_kv_heads"),
    }
    base = dict(key=key, value=value, key_cache=kc, value_cache=vc, slot_mapping=slots)
    return base, cases


@pytest.mark.parametrize("fn", [reshape_and_cache, reshape_and_cache_ref])
def test_reshape_and_cache_rejects_bad_input_without_writing(fn):
    base, cases = _bad_kv_inputs()
    for name, (override, exc, words) in cases.items():
        args = {**base, **{k: v.to(DEV) for k, v in override.items()}}
        before_k, before_v = args["key_cache"].clone(), args["value_cache"].clone()
        with pytest.raises(exc, match=words):
            fn(**args)
        assert torch.equal(args["key_cache"], before_k), name
        assert torch.equal(args["value_cache"], before_v), name


def test_benchmark_says_it_needs_a_gpu_on_cpu(capsys):
    if pagedkv.on_gpu():
        pytest.skip("on a GPU the benchmark measures; this test is about the CPU message")
    from pagedkv.bench import slot_mapping as bench

    assert bench.main([]) == 0
    out = capsys.readouterr().out
    assert "need a GPU" in out
    assert "interpreter check: slot mapping and KV write match their references" in out
