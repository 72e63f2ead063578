"""The KV write: store this step's keys and values at their slots.

Every attention layer runs this once per step, before attention reads the
cache. The caches are block-major, ``[num_blocks, block_size, num_kv_heads,
head_dim]``, so viewed flat as ``[num_blocks * block_size, num_kv_heads,
head_dim]`` a slot is simply a row index: token ``t`` copies its
``[num_kv_heads, head_dim]`` key and value into row ``slot_mapping[t]``. All
layers share one slot mapping; only the cache tensors differ. In vLLM 0.33.0
the op that writes this block-major layout is ``reshape_and_cache_flash``
(``_custom_ops.py``; the Triton backend's twin is
``triton_reshape_and_cache_flash``); vLLM's plain ``reshape_and_cache`` writes
ROCm's older split layout. Ours takes the same argument order, under the
shorter name ``reshape_and_cache`` and under vLLM's, ``reshape_and_cache_flash``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._device import require_kernel_device  # also fixes the Triton mode before @triton.jit
from .tensor_checks import check_tensor_args

__all__ = ["reshape_and_cache", "reshape_and_cache_flash", "reshape_and_cache_ref", "launch_reshape_and_cache",
           "check_slot_mapping", "KV_DTYPES"]

KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads * head_dim], contiguous
    value_ptr,
    key_cache_ptr,  # [num_blocks * block_size, num_kv_heads * head_dim], contiguous
    value_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64, -1 = padding
    token_width,  # num_kv_heads * head_dim
    CHUNK: tl.constexpr,  # elements of one token copied by one program (power of two)
):
    token = tl.program_id(0)
    chunk = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)  # int64: slot * token_width can pass 2**31
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = (cols < token_width) & (slot >= 0)  # padding tokens write nothing

    src = token.to(tl.int64) * token_width + cols
    dst = slot * token_width + cols
    k = tl.load(key_ptr + src, mask=mask)
    v = tl.load(value_ptr + src, mask=mask)
    tl.store(key_cache_ptr + dst, k, mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)


def _validate(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Check everything the kernel trusts, before it runs (see the package docstring)."""
    named = {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache,
             "slot_mapping": slot_mapping}
    check_tensor_args(named)
    if key.dim() != 3:
        raise ValueError(f"key must be [num_tokens, num_kv_heads, head_dim], got shape {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} differs from key shape {tuple(key.shape)}")
    if key_cache.dim() != 4:
        raise ValueError(
            f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache shape {tuple(value_cache.shape)} differs from key_cache shape {tuple(key_cache.shape)}"
        )
    if key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"cache heads/head_dim {tuple(key_cache.shape[2:])} differ from key's {tuple(key.shape[1:])}"
        )
    for name in ("key", "value", "key_cache", "value_cache"):
        if named[name].dtype not in KV_DTYPES:
            raise TypeError(f"{name} dtype must be one of float32, float16, bfloat16, got {named[name].dtype}")
    if not (key.dtype == value.dtype == key_cache.dtype == value_cache.dtype):
        raise TypeError(
            "key, value and both caches must share one dtype, got "
            f"{key.dtype}, {value.dtype}, {key_cache.dtype}, {value_cache.dtype}"
        )
    check_slot_mapping(slot_mapping, key.shape[0], key_cache)


def check_slot_mapping(slot_mapping, num_tokens: int, key_cache: torch.Tensor) -> None:
    """The slot rules the kernel trusts: int64, one per token, each a slot of the cache or -1, none twice.

    ``reshape_and_cache`` checks them on every call; a model step checks them
    once for all its layers (``pagedkv.model.paged_attention``), before any
    layer writes. A refusal names the value.
    """
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype != torch.int64:
        raise TypeError(f"slot_mapping must be an int64 tensor, got {getattr(slot_mapping, 'dtype', slot_mapping)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"slot_mapping must have one slot per token ({num_tokens}), got shape {tuple(slot_mapping.shape)}"
        )
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    bad = (slot_mapping < -1) | (slot_mapping >= num_slots)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise IndexError(
            f"slot_mapping[{i}] = {int(slot_mapping[i])} is outside the cache's {num_slots} slots "
            f"({key_cache.shape[0]} blocks x {key_cache.shape[1]}); -1 marks padding"
        )
    real = slot_mapping[slot_mapping >= 0]
    if real.numel() != torch.unique(real).numel():  # two tokens would race for one slot
        values, counts = torch.unique(real, return_counts=True)
        dup = int(values[counts > 1][0])
        raise ValueError(f"slot {dup} appears more than once in slot_mapping: two tokens would race for it")


def launch_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Launch on tensors ``reshape_and_cache`` has validated (the model's later layers and the benchmark)."""
    num_tokens = key.shape[0]
    token_width = key.shape[1] * key.shape[2]
    if num_tokens == 0 or token_width == 0:
        return
    chunk = min(triton.next_power_of_2(token_width), 1024)
    grid = (num_tokens, triton.cdiv(token_width, chunk))
    _reshape_and_cache_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping, token_width, CHUNK=chunk
    )


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Write each token's K and V into the block-major caches at its slot (in place).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, contiguous.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            contiguous, same dtype as ``key`` (float32, float16 or bfloat16).
        slot_mapping: ``[num_tokens]`` int64; ``-1`` skips the token (padding).

    Raises:
        TypeError / ValueError / IndexError naming the offending value, before any
        write: a slot out of range, a slot used twice, or mismatched shapes.
    """
    _validate(key, value, key_cache, value_cache, slot_mapping)
    require_kernel_device(key_cache, "key_cache")
    launch_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping) -> None:
    """The same write with PyTorch indexing: the reference the kernel is tested against."""
    _validate(key, value, key_cache, value_cache, slot_mapping)
    heads, dim = key.shape[1:]
    real = slot_mapping >= 0
    key_cache.view(-1, heads, dim)[slot_mapping[real]] = key[real]
    value_cache.view(-1, heads, dim)[slot_mapping[real]] = value[real]


# vLLM's name for the block-major write (the layout this book uses).
reshape_and_cache_flash = reshape_and_cache
