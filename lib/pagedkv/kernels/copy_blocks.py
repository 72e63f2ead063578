"""The block copy: run the scheduler's pending copy-on-write pairs before the forward pass.

A partial prefix hit leaves a request with a private block that must start as
a copy of a shared one. The scheduler only records ``(src, dst)`` block-id
pairs; the worker copies them, in every layer's key and value cache, before
any attention kernel reads the cache. The caches are block-major
(``[num_blocks, ...]``, as the KV write produces them), so block ``b`` of a
cache is one contiguous run of elements and a copy is a plain memcpy of that
run.

One launch does everything: program ``(pair, cache, tile)`` copies one tile of
block ``src`` to block ``dst`` in one cache. The caches are reached through a
table of their base addresses, so a 32-layer model (64 caches) costs one
launch, not 64. Elements are copied as raw bits (a 2-byte cache is moved as
int16), so any dtype is copied exactly.

Two rules on the pairs make the copy order-free, which is what lets every
program run at once: no block is written twice, and no block that is written
is also read. ``copy_blocks`` enforces them before launching.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from .._device import require_kernel_device  # also fixes the Triton mode before @triton.jit
from .tensor_checks import refuse_meta_tensor

__all__ = ["copy_blocks", "copy_blocks_ref", "launch_copy_blocks", "validate_block_pairs", "copy_launches"]

_TILE_MAX = 1024  # elements per program (2048 for 1-byte caches); a power of two (tl.arange)


@triton.jit
def _copy_blocks_kernel(
    cache_ptrs_ptr,  # [num_caches] int64: base address of each cache
    pairs_ptr,  # [num_pairs, 2] int64: (src, dst) block ids
    block_numel,  # elements in one block of one cache
    ELEM_BYTES: tl.constexpr,  # 1, 2, 4 or 8: the cache's element size
    TILE: tl.constexpr,
    ALIGNED: tl.constexpr,  # every cache and every block starts on 16 bytes, TILE fills 16-byte words
):
    pair = tl.program_id(0)
    cache = tl.program_id(1)
    tile = tl.program_id(2)
    base = tl.load(cache_ptrs_ptr + cache)
    # Reinterpret the address as a pointer to same-size integers: a bit-exact copy for any dtype.
    if ELEM_BYTES == 1:
        ptr = base.to(tl.pointer_type(tl.int8))
    elif ELEM_BYTES == 2:
        ptr = base.to(tl.pointer_type(tl.int16))
    elif ELEM_BYTES == 4:
        ptr = base.to(tl.pointer_type(tl.int32))
    else:
        ptr = base.to(tl.pointer_type(tl.int64))
    src = tl.load(pairs_ptr + 2 * pair)  # int64, so src * block_numel cannot overflow
    dst = tl.load(pairs_ptr + 2 * pair + 1)
    cols = tile * TILE + tl.arange(0, TILE)
    mask = cols < block_numel
    src_off = src * block_numel + cols
    dst_off = dst * block_numel + cols
    if ALIGNED:
        # The base comes from a table, so the compiler cannot see its alignment;
        # the launcher checked it. Runs of 16 // ELEM_BYTES elements start on
        # 16 bytes and are masked whole, so each becomes one 16-byte access.
        VEC: tl.constexpr = 16 // ELEM_BYTES
        ptr = tl.multiple_of(ptr, 16)
        src_off = tl.max_contiguous(tl.multiple_of(src_off, VEC), VEC)
        dst_off = tl.max_contiguous(tl.multiple_of(dst_off, VEC), VEC)
    src_ptrs = ptr + src_off
    dst_ptrs = ptr + dst_off
    values = tl.load(src_ptrs, mask=mask)
    tl.store(dst_ptrs, values, mask=mask)


def _flatten_caches(kv_caches) -> list[torch.Tensor]:
    """Accept ``[cache, ...]`` or ``[(key_cache, value_cache), ...]``; return the flat list of tensors."""
    if isinstance(kv_caches, torch.Tensor):
        raise TypeError("kv_caches must be a sequence of caches (one per layer, or (key, value) pairs), got one tensor")
    flat: list[torch.Tensor] = []
    for i, item in enumerate(kv_caches):
        parts = item if isinstance(item, (tuple, list)) else (item,)
        for t in parts:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"kv_caches[{i}] must hold torch.Tensors, got {type(t).__name__}")
            flat.append(t)
    if not flat:
        raise ValueError("kv_caches is empty: there is no cache to copy in")
    first = flat[0]
    for i, t in enumerate(flat):
        refuse_meta_tensor(t, f"kv_caches cache {i}")
    for i, t in enumerate(flat):
        if t.dim() < 1 or t.shape != first.shape:
            raise ValueError(f"every cache must have the shape of the first, {tuple(first.shape)}; cache {i} has {tuple(t.shape)}")
        if t.dtype != first.dtype:
            raise TypeError(f"every cache must have dtype {first.dtype}; cache {i} has {t.dtype}")
        if t.device != first.device:
            raise ValueError(f"every cache must be on {first.device}; cache {i} is on {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"cache {i} must be contiguous (block-major), got strides {t.stride()}")
    if first.element_size() not in (1, 2, 4, 8):
        raise TypeError(f"cache element size must be 1, 2, 4 or 8 bytes, got {first.element_size()} ({first.dtype})")
    return flat


def validate_block_pairs(block_pairs, num_blocks: int) -> np.ndarray:
    """Check ``(src, dst)`` pairs and return them as an ``[n, 2]`` int64 array.

    Raises ``TypeError`` for non-integer ids, ``IndexError`` for an id outside
    ``[0, num_blocks)``, and ``ValueError`` for a block written twice or a block
    both written and read in the same call (either would make the result depend
    on which program runs first).
    """
    if isinstance(block_pairs, torch.Tensor):
        refuse_meta_tensor(block_pairs, "block_pairs")
        block_pairs = block_pairs.detach().cpu().numpy()
    arr = np.asarray(block_pairs)
    if arr.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"block_pairs must be (src, dst) pairs, shape [n, 2]; got shape {arr.shape}")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"block ids must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    out = (arr < 0) | (arr >= num_blocks)
    if out.any():
        i, j = np.argwhere(out)[0]
        raise IndexError(f"block_pairs[{i}] = {tuple(arr[i].tolist())}: {'src' if j == 0 else 'dst'} "
                         f"{arr[i, j]} is outside [0, {num_blocks})")
    dst, counts = np.unique(arr[:, 1], return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"block {int(dst[counts > 1][0])} is a dst more than once in block_pairs")
    both = np.intersect1d(arr[:, 0], arr[:, 1])
    if both.size:
        raise ValueError(f"block {int(both[0])} is both a src and a dst in block_pairs")
    return arr


def copy_blocks(kv_caches: Sequence, block_pairs) -> None:
    """Copy block ``src`` to block ``dst`` for every pair, in every cache, in one launch (in place).

    Args:
        kv_caches: the caches, block-major and contiguous, all of one shape,
            dtype and device: a list of tensors (``[key_0, value_0, key_1, ...]``)
            or of ``(key_cache, value_cache)`` pairs, one per layer.
        block_pairs: ``(src, dst)`` block ids, a list of pairs or an ``[n, 2]``
            integer array or tensor. Empty: nothing to do.

    Raises:
        TypeError / ValueError / IndexError naming the offending value, before any
        write (see :func:`validate_block_pairs`).
    """
    caches = _flatten_caches(kv_caches)
    require_kernel_device(caches[0], "kv_caches")
    pairs = validate_block_pairs(block_pairs, caches[0].shape[0])
    if len(pairs) == 0 or caches[0][0].numel() == 0:
        return
    device = caches[0].device
    cache_ptrs = torch.tensor([t.data_ptr() for t in caches], dtype=torch.int64, device=device)
    launch_copy_blocks(cache_ptrs, torch.from_numpy(pairs).to(device), caches[0])


def launch_copy_blocks(cache_ptrs: torch.Tensor, pairs: torch.Tensor, like: torch.Tensor) -> None:
    """Launch on validated inputs (the benchmark times this alone).

    ``cache_ptrs``: int64 base addresses; ``pairs``: ``[n, 2]`` int64 on the
    caches' device; ``like``: one of the caches (shape and dtype of all).
    """
    for kernel, grid, args, kwargs in copy_launches(cache_ptrs, pairs, like):
        kernel[grid](*args, **kwargs)


def copy_launches(cache_ptrs: torch.Tensor, pairs: torch.Tensor, like: torch.Tensor,
                  aligned: bool | None = None) -> list:
    """The launch of one copy as ``[(kernel, grid, args, kwargs)]``: what
    ``launch_copy_blocks`` runs and ``tools/compile_check.py`` compiles.

    ``aligned=None`` reads the addresses (16-byte aligned caches get 16-byte
    loads and stores); the compile check, which has no addresses, passes True.
    """
    block_numel = like[0].numel()
    elem = like.element_size()
    # At least 16 bytes per thread of the 4 default warps, so that 1-byte caches
    # also move whole 16-byte words.
    tile = min(triton.next_power_of_2(block_numel), max(_TILE_MAX, 16 * 128 // elem))
    num_tiles = triton.cdiv(block_numel, tile)
    if cache_ptrs.numel() > 65535 or num_tiles > 65535:
        raise ValueError(f"too many caches ({cache_ptrs.numel()}) or tiles per block ({num_tiles}) "
                         "for one launch (at most 65535 each)")
    if aligned is None:
        # Every base on 16 bytes (one host read of the small address table),
        # every block a whole number of 16-byte words, every tile too.
        aligned = (block_numel * elem % 16 == 0 and tile * elem % 16 == 0
                   and bool((cache_ptrs % 16 == 0).all()))
    grid = (pairs.shape[0], cache_ptrs.numel(), num_tiles)
    return [(_copy_blocks_kernel, grid, (cache_ptrs, pairs, block_numel),
             dict(ELEM_BYTES=elem, TILE=tile, ALIGNED=aligned))]


def copy_blocks_ref(kv_caches: Sequence, block_pairs) -> None:
    """The same copy with PyTorch indexing, one cache at a time: the reference."""
    caches = _flatten_caches(kv_caches)
    pairs = validate_block_pairs(block_pairs, caches[0].shape[0])
    if len(pairs) == 0:
        return
    src = torch.from_numpy(pairs[:, 0]).to(caches[0].device)
    dst = torch.from_numpy(pairs[:, 1]).to(caches[0].device)
    for cache in caches:
        cache[dst] = cache[src]
