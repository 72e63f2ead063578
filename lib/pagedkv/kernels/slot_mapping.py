"""The slot mapping: where each of this step's tokens writes its K and V.

The block table says which physical block holds each logical block of a
request. The slot mapping turns (request row, token position) into one flat
index into the block-major KV cache::

    slot = block_table[req, pos // block_size] * block_size + pos % block_size

Block-major means block ``b`` owns the contiguous rows ``[b * block_size,
(b + 1) * block_size)`` of the cache viewed as ``[num_blocks * block_size,
...]``, so that one integer per token is all the write kernel needs. Tokens
that only pad a batch (``req_indices == -1``) get slot ``-1``, which the write
kernel skips. vLLM recomputes this every step with a small Triton kernel; so
do we.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._device import require_kernel_device  # also fixes the Triton mode before @triton.jit
from .tensor_checks import as_index_tensor, refuse_meta_tensor

PAD_SLOT_ID = -1  # the slot of a padding token; every writer skips it

__all__ = ["PAD_SLOT_ID", "compute_slot_mapping", "compute_slot_mapping_ref", "launch_slot_mapping"]

@triton.jit
def _slot_mapping_kernel(
    block_table_ptr,  # [num_rows, max_blocks] int32, row-major
    row_stride,  # elements between consecutive rows of the table
    req_indices_ptr,  # [num_tokens] row of each token, -1 for padding
    positions_ptr,  # [num_tokens] position of each token in its sequence
    slot_mapping_ptr,  # [num_tokens] int64 output
    num_tokens,
    block_size,
    TOKENS_PER_PROGRAM: tl.constexpr,
):
    pid = tl.program_id(0)
    offsets = pid * TOKENS_PER_PROGRAM + tl.arange(0, TOKENS_PER_PROGRAM)
    in_range = offsets < num_tokens

    req = tl.load(req_indices_ptr + offsets, mask=in_range, other=-1)
    req = req.to(tl.int64)
    pos = tl.load(positions_ptr + offsets, mask=in_range, other=0).to(tl.int64)
    is_real = req >= 0  # padding tokens never touch the table

    block_col = pos // block_size
    block_number = tl.load(
        block_table_ptr + req * row_stride + block_col,
        mask=in_range & is_real,
        other=0,
    )
    # int64 before the multiply: block * block_size can pass 2**31
    block_number = block_number.to(tl.int64)
    slot = block_number * block_size + pos % block_size
    slot = tl.where(is_real, slot, -1)
    tl.store(slot_mapping_ptr + offsets, slot, mask=in_range)


def _validate(block_table, req_indices, positions, block_size):
    """Check everything the kernel would trust; return the index tensors on the table's device.

    Raises before any launch: in the interpreter an out-of-range load kills
    the process, and on a GPU it reads some other tensor's memory.
    """
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be a torch.Tensor, got {type(block_table).__name__}")
    refuse_meta_tensor(block_table, "block_table")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got dtype {block_table.dtype}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be 2-D [num_rows, max_blocks], got shape {tuple(block_table.shape)}")
    if block_table.stride(1) != 1:
        raise ValueError(f"block_table rows must be contiguous, got strides {block_table.stride()}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")

    device = block_table.device
    req = as_index_tensor(req_indices, "req_indices", device)
    pos = as_index_tensor(positions, "positions", device)
    if req.shape != pos.shape:
        raise ValueError(
            f"req_indices and positions must have the same length, got {req.numel()} and {pos.numel()}"
        )

    num_rows, max_blocks = block_table.shape
    bad = (req < -1) | (req >= num_rows)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise IndexError(
            f"req_indices[{i}] = {int(req[i])} is not a row of the block table "
            f"(rows 0..{num_rows - 1}, or -1 for padding)"
        )
    real = req >= 0
    col = torch.div(pos, block_size, rounding_mode="floor")
    bad = real & ((pos < 0) | (col >= max_blocks))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise IndexError(
            f"positions[{i}] = {int(pos[i])} is outside the block table: with block_size "
            f"{block_size} and {max_blocks} blocks per row the last position is {max_blocks * block_size - 1}"
        )
    if bool(real.any()):
        ids = block_table[req[real].long(), col[real].long()]
        bad_ids = ids < 0
        if bool(bad_ids.any()):
            j = int(bad_ids.nonzero()[0, 0])
            i = int(real.nonzero()[j, 0])
            raise ValueError(
                f"token {i} (row {int(req[i])}, position {int(pos[i])}) maps to block id {int(ids[j])}; "
                "block ids must be >= 0"
            )
    return req, pos


def launch_slot_mapping(block_table, req, pos, block_size, out) -> torch.Tensor:
    """Launch the kernel on already-validated tensors (the benchmark times this alone)."""
    num_tokens = req.numel()
    if num_tokens == 0:
        return out
    tokens_per_program = 256
    grid = (triton.cdiv(num_tokens, tokens_per_program),)
    _slot_mapping_kernel[grid](
        block_table, block_table.stride(0), req, pos, out, num_tokens, block_size,
        TOKENS_PER_PROGRAM=tokens_per_program,
    )
    return out


def compute_slot_mapping(block_table, req_indices, positions, block_size: int) -> torch.Tensor:
    """Slot of every token, computed by the Triton kernel.

    Args:
        block_table: ``[num_rows, max_blocks]`` int32 tensor of physical block ids.
        req_indices: ``[num_tokens]`` row of each token; ``-1`` marks a padding token.
        positions: ``[num_tokens]`` position of each token within its sequence.
        block_size: tokens per block.

    Returns:
        ``[num_tokens]`` int64 tensor on the table's device; padding tokens get ``-1``.

    Raises:
        TypeError / ValueError / IndexError naming the offending value, before launching.
    """
    req, pos = _validate(block_table, req_indices, positions, block_size)
    require_kernel_device(block_table, "block_table")
    out = torch.empty(req.numel(), dtype=torch.int64, device=block_table.device)
    return launch_slot_mapping(block_table, req, pos, block_size, out)


def compute_slot_mapping_ref(block_table, req_indices, positions, block_size: int) -> torch.Tensor:
    """The same mapping with PyTorch indexing: the reference the kernel is tested against."""
    req, pos = _validate(block_table, req_indices, positions, block_size)
    real = req >= 0
    if not bool(real.any()):
        return torch.full((req.numel(),), PAD_SLOT_ID, dtype=torch.int64, device=block_table.device)
    row = torch.where(real, req, 0).long()
    pos = torch.where(real, pos, 0).long()  # padding positions may be anything
    block_number = block_table[row, pos // block_size].long()
    slot = block_number * block_size + pos % block_size
    return torch.where(real, slot, torch.full_like(slot, PAD_SLOT_ID))
