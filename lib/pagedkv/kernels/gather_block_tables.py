"""The step's block table, gathered from the rows requests keep for life.

Under Model Runner V2 a request holds one row of the per-request block table
from admission to exit, and the batch of a step is just a list of those rows,
``idx_mapping``: entry ``i`` of the step is the request at row
``idx_mapping[i]``. Attention wants the batch's rows side by side, so every
step a small kernel copies them into the step's input table::

    out[i, :num_blocks[r]] = block_table[r, :num_blocks[r]]   with r = idx_mapping[i]
    out[i, num_blocks[r]:] = 0
    out[i, :]              = 0                               for padding rows i >= len(idx_mapping)

One program per output row walks the row in power-of-two chunks (``tl.arange``
needs a power of two), copying the live prefix and zeroing the rest. Nothing
moves in the per-request table, so there is no condensing and no row swapping
when a request leaves: the next step's ``idx_mapping`` simply omits its row.

The wrapper validates before launching (an out-of-range load kills Triton's
interpreter and corrupts memory on a GPU): every entry of ``idx_mapping`` must
be a row of the table, and no row may appear twice -- two batch entries for
one request would run its tokens twice and write its KV twice. A refused call
raises ``ValueError`` naming the row and writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._device import require_kernel_device  # also fixes the Triton mode before @triton.jit
from ..common import check_int
from .tensor_checks import as_index_tensor, refuse_meta_tensor

__all__ = ["gather_block_tables", "gather_block_tables_ref", "launch_gather_block_tables",
           "check_idx_mapping"]

MAX_CHUNK = 1024  # columns one program copies per iteration (a power of two)


@triton.jit(do_not_specialize=["num_reqs"])
def _gather_block_tables_kernel(
    idx_mapping_ptr,  # [num_reqs] request row of each batch entry
    src_ptr,  # [max_num_reqs, width] int32, the rows kept for life
    src_stride,  # elements between consecutive source rows
    num_blocks_ptr,  # [max_num_reqs] int32, live blocks in each source row
    dst_ptr,  # [>= grid, width] int32, the step's input table
    dst_stride,  # elements between consecutive output rows
    num_reqs,  # batch entries; programs past it are padding rows
    width,  # columns of both tables
    CHUNK: tl.constexpr,
):
    batch_idx = tl.program_id(0)
    dst_row = dst_ptr + batch_idx.to(tl.int64) * dst_stride
    if batch_idx >= num_reqs:  # a padding row: all zeros (the null block)
        for start in tl.range(0, width, CHUNK):
            cols = start + tl.arange(0, CHUNK)
            tl.store(dst_row + cols, 0, mask=cols < width)
        return
    row = tl.load(idx_mapping_ptr + batch_idx).to(tl.int64)
    num_blocks = tl.load(num_blocks_ptr + row)
    src_row = src_ptr + row * src_stride
    for start in tl.range(0, width, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        ids = tl.load(src_row + cols, mask=cols < num_blocks, other=0)
        tl.store(dst_row + cols, ids, mask=cols < width)


def check_idx_mapping(idx: torch.Tensor, num_rows: int) -> None:
    """Refuse an ``idx_mapping`` (1-D, on the CPU) naming a row out of range or a row twice.

    ``ValueError`` naming the first offending entry and its row.
    """
    bad = (idx < 0) | (idx >= num_rows)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"idx_mapping[{i}] = row {int(idx[i])} is out of range: "
                         f"the table has rows 0..{num_rows - 1}")
    if idx.numel() > 1:
        order = torch.argsort(idx, stable=True)
        s = idx[order]
        dup = (s[1:] == s[:-1]).nonzero()
        if dup.numel():
            j = int(dup[0, 0])
            first, second = sorted((int(order[j]), int(order[j + 1])))
            raise ValueError(f"row {int(s[j])} appears twice in idx_mapping (entries {first} and {second}): "
                             "a request is gathered once per step")


def _validate(block_table, num_blocks, idx_mapping, num_reqs_padded, out):
    """Everything the kernel would trust; returns (idx on the table's device, num_reqs_padded)."""
    for name, t in (("block_table", block_table), ("num_blocks", num_blocks)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        refuse_meta_tensor(t, name)
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got dtype {t.dtype}")
    if block_table.dim() != 2 or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be 2-D [max_num_reqs, width] with contiguous rows, "
                         f"got shape {tuple(block_table.shape)} strides {block_table.stride()}")
    num_rows, width = block_table.shape
    if num_blocks.shape != (num_rows,) or num_blocks.device != block_table.device:
        raise ValueError(f"num_blocks must be [{num_rows}] on {block_table.device}, "
                         f"got shape {tuple(num_blocks.shape)} on {num_blocks.device}")
    idx = as_index_tensor(idx_mapping, "idx_mapping", torch.device("cpu"))
    check_idx_mapping(idx, num_rows)
    n = num_blocks.cpu()
    bad = (n < 0) | (n > width)
    if bool(bad.any()):
        r = int(bad.nonzero()[0, 0])
        raise ValueError(f"num_blocks[{r}] = {int(n[r])} is not a row length (0..{width})")
    padded = idx.numel() if num_reqs_padded is None else check_int(num_reqs_padded, "num_reqs_padded", idx.numel())
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        refuse_meta_tensor(out, "out")
        if (out.dtype != torch.int32 or out.dim() != 2 or out.shape[0] < padded or out.shape[1] != width
                or out.stride(1) != 1 or out.device != block_table.device):
            raise ValueError(f"out must be int32 [>= {padded}, {width}] with contiguous rows on "
                             f"{block_table.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    return idx.to(block_table.device), padded


def launch_gather_block_tables(block_table, num_blocks, idx, out, num_rows: int) -> torch.Tensor:
    """Launch the kernel on already-validated tensors: rows ``[0, num_rows)`` of ``out`` are written."""
    if num_rows == 0:
        return out
    width = block_table.shape[1]
    chunk = min(MAX_CHUNK, triton.next_power_of_2(width))
    _gather_block_tables_kernel[(num_rows,)](
        idx, block_table, block_table.stride(0), num_blocks, out, out.stride(0), idx.numel(), width,
        CHUNK=chunk,
    )
    return out


def gather_block_tables(block_table, num_blocks, idx_mapping, num_reqs_padded: int | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """The step's input block table, gathered by the Triton kernel.

    Args:
        block_table: ``[max_num_reqs, width]`` int32, one row per request for its life.
        num_blocks: ``[max_num_reqs]`` int32, the live blocks of each row.
        idx_mapping: ``[num_reqs]`` the row of each batch entry; rows distinct and in range.
        num_reqs_padded: rows to return (>= ``num_reqs``); rows past ``num_reqs`` are zeros.
        out: where to write (at least ``num_reqs_padded`` rows); a new tensor if None.

    Returns:
        ``[num_reqs_padded, width]`` int32 on the table's device.

    Raises:
        TypeError / ValueError naming the argument, the entry and the row, before launching.
    """
    idx, padded = _validate(block_table, num_blocks, idx_mapping, num_reqs_padded, out)
    require_kernel_device(block_table, "block_table")
    if out is None:
        out = torch.empty((padded, block_table.shape[1]), dtype=torch.int32, device=block_table.device)
    launch_gather_block_tables(block_table, num_blocks, idx, out, padded)
    return out[:padded]


def gather_block_tables_ref(block_table, num_blocks, idx_mapping, num_reqs_padded: int | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """The same gather with PyTorch indexing: the reference the kernel is tested against."""
    idx, padded = _validate(block_table, num_blocks, idx_mapping, num_reqs_padded, out)
    width = block_table.shape[1]
    rows = idx.long()
    live = torch.arange(width, device=block_table.device)[None, :] < num_blocks[rows].long()[:, None]
    result = torch.zeros((padded, width), dtype=torch.int32, device=block_table.device)
    result[: rows.numel()] = torch.where(live, block_table[rows], 0)
    if out is None:
        return result
    out[:padded] = result
    return out[:padded]
