"""The worker-side block table: one fixed-shape int32 row of block ids per request.

The scheduler keeps each request's blocks as a Python list of any length. The
worker cannot hand a list of lists to a GPU kernel, so it keeps a rectangle,
``[max_num_reqs, max_num_blocks_per_req]`` int32, where row ``r`` holds the
physical block ids of the request sitting at batch slot ``r``. Two copies
exist, as in vLLM's ``BlockTable``:

- ``np``: a numpy view of a CPU staging tensor, edited cheaply by the
  scheduler-facing methods (``append_row``, ``move_row``, ...);
- ``tensor``: the device copy the kernels read, refreshed by ``commit``.

Invariants (``check()`` verifies them):

- row ``r`` holds ``num_blocks_per_row[r]`` valid ids at columns
  ``[0, num_blocks_per_row[r])``, in logical-block order;
- every cell past a row's length is 0 (so a picture of the table shows
  exactly the live ids, and a stale id from an earlier tenant never leaks).

The table is append-only in normal operation: a running request only ever
gains blocks at its tail, so ``append_row`` writes only past the row's current
length and never moves an existing entry. The shape never changes, which is
what lets the forward pass be captured once as a CUDA graph and replayed with
new contents. The cost of the fixed shape is small: 4 bytes per logical block,
against the block's whole KV payload (2 MiB across Llama-3-8B's layers at 16
tokens a block).
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

import numpy as np
import torch

from ._device import default_device
from .common import InvariantError, cdiv, check_int, require

__all__ = ["BlockTable"]



def block_table_width(max_model_len: int, block_size: int, token_alignment: int | None = 128) -> int:
    """Columns vLLM 0.33.0 gives a table row: the blocks of ``max_model_len``, aligned.

    ``cdiv(max_model_len, block_size)`` blocks, rounded up so that the row
    covers a multiple of ``token_alignment`` tokens (``get_block_table_width``
    in ``v1/worker/block_table.py``). The spare columns keep a kernel's
    unmasked tile loads inside the row (chapter 7). Our ``BlockTable`` takes
    its width as given and does not align it; ``token_alignment=None`` gives
    the bare count.
    """
    blocks = cdiv(check_int(max_model_len, "max_model_len", 1), check_int(block_size, "block_size", 1))
    if token_alignment is None:
        return blocks
    check_int(token_alignment, "token_alignment", 1)
    step = token_alignment // math.gcd(token_alignment, block_size)
    return cdiv(blocks, step) * step


class BlockTable:
    """``[max_num_reqs, max_num_blocks_per_req]`` int32 block ids, staged in numpy, mirrored on a device.

    Args:
        max_num_reqs: rows, one per batch slot.
        max_num_blocks_per_req: columns, ``max_model_len // block_size`` in vLLM.
        device: where the kernels read the table; ``pagedkv.default_device()`` if None.
    """

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, device: torch.device | str | None = None):
        self.max_num_reqs = check_int(max_num_reqs, "max_num_reqs", 1)
        self.max_num_blocks_per_req = check_int(max_num_blocks_per_req, "max_num_blocks_per_req", 1)
        self.device = torch.device(device) if device is not None else default_device()
        shape = (self.max_num_reqs, self.max_num_blocks_per_req)
        # Pinned staging memory is what a real engine uses for fast host-to-device copies.
        pin = self.device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=torch.int32, pin_memory=pin)
        self.np: np.ndarray = self.cpu.numpy()  # shares memory with self.cpu
        self.tensor = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.num_blocks_per_row = np.zeros(self.max_num_reqs, dtype=np.int32)
        # Row lengths as of the last commit: what the device copy actually holds.
        self._committed_num_blocks = np.zeros(self.max_num_reqs, dtype=np.int32)

    # -- validation -------------------------------------------------------------------------
    def _row(self, row_idx, name: str = "row_idx") -> int:
        if isinstance(row_idx, bool) or not isinstance(row_idx, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(row_idx).__name__} {row_idx!r}")
        if not 0 <= row_idx < self.max_num_reqs:
            raise IndexError(f"{name} {row_idx} is not a row of the table (rows 0..{self.max_num_reqs - 1})")
        return int(row_idx)

    # -- scheduler-facing edits (staging only; call commit() to publish) --------------------
    def append_row(self, block_ids: Sequence[int], row_idx: int) -> None:
        """Append ``block_ids`` at the tail of row ``row_idx``; entries already there never move.

        All ids are checked (a flat sequence of ints in ``0..2**31 - 1``) before
        anything is written: a refused call changes nothing.
        """
        row = self._row(row_idx)
        ids = np.asarray(block_ids)
        if ids.size == 0:
            return
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"block_ids must be a flat sequence of ints, got {block_ids!r}")
        if ids.min() < 0 or ids.max() > np.iinfo(np.int32).max:
            bad = ids[(ids < 0) | (ids > np.iinfo(np.int32).max)][0]
            raise ValueError(f"block id {int(bad)} is not a valid block id (must be in 0..2**31 - 1)")
        start = int(self.num_blocks_per_row[row])
        end = start + ids.size
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"row {row} holds {start} blocks; appending {ids.size} would make {end}, "
                f"past max_num_blocks_per_req = {self.max_num_blocks_per_req}" if start else
                f"{ids.size} blocks do not fit a row of max_num_blocks_per_req = {self.max_num_blocks_per_req}"
            )
        self.np[row, start:end] = ids
        self.num_blocks_per_row[row] = end

    def add_row(self, block_ids: Sequence[int], row_idx: int) -> None:
        """Give row ``row_idx`` to a new (or resumed) request: replace its contents with ``block_ids``.

        As vLLM does it: the row's length drops to 0 and ``append_row`` fills
        it from column 0; then the cells past the new length are zeroed. A
        refused ``append_row`` writes nothing, and the old length comes back.
        """
        row = self._row(row_idx)
        old = int(self.num_blocks_per_row[row])
        self.num_blocks_per_row[row] = 0
        try:
            self.append_row(block_ids, row)
        except BaseException:
            self.num_blocks_per_row[row] = old  # refused: the row is as it was
            raise
        self.np[row, self.num_blocks_per_row[row]:old] = 0  # keep "cells past the length are 0"

    def clear_row(self, row_idx: int) -> None:
        """Empty row ``row_idx`` (its request finished or left the batch)."""
        row = self._row(row_idx)
        self.np[row, : self.num_blocks_per_row[row]] = 0
        self.num_blocks_per_row[row] = 0

    def move_row(self, src: int, tgt: int) -> None:
        """Move row ``src`` into row ``tgt`` (compacting the batch after a request leaves).

        As in vLLM 0.33.0, the vacated row ``src`` is cleared (zeros, length 0):
        a stale row must not keep naming blocks that may be freed and handed to
        another request (vLLM's padded dummy batches read rows past
        ``num_reqs``, and Mamba-style state is even written through them), so
        no ``clear_row(src)`` is needed after a move. ``src == tgt`` is refused: vLLM would clear the row it
        just moved, and a batch never compacts a row onto itself.
        """
        s, t = self._row(src, "src"), self._row(tgt, "tgt")
        if s == t:
            raise ValueError(f"move_row needs two different rows, got src = tgt = {s}")
        n = int(self.num_blocks_per_row[s])
        old = int(self.num_blocks_per_row[t])
        self.np[t, :n] = self.np[s, :n]
        self.np[t, n:old] = 0  # keep "cells past the length are 0"
        self.num_blocks_per_row[t] = n
        self.np[s, :n] = 0
        self.num_blocks_per_row[s] = 0

    def swap_row(self, a: int, b: int) -> None:
        """Exchange rows ``a`` and ``b`` (reordering the batch, e.g. to sort it)."""
        a, b = self._row(a, "a"), self._row(b, "b")
        self.np[[a, b]] = self.np[[b, a]]
        self.num_blocks_per_row[[a, b]] = self.num_blocks_per_row[[b, a]]

    def clear(self) -> None:
        """Empty every row, staging and device copy alike."""
        self.np[:] = 0
        self.num_blocks_per_row[:] = 0
        self.tensor.zero_()
        self._committed_num_blocks[:] = 0

    # -- the device side ----------------------------------------------------------------------
    def commit(self, num_reqs: int) -> None:
        """Copy staged rows ``[0, num_reqs)`` to the device tensor the kernels read."""
        if isinstance(num_reqs, bool) or not isinstance(num_reqs, numbers.Integral):
            raise TypeError(f"num_reqs must be an int, got {type(num_reqs).__name__} {num_reqs!r}")
        if not 0 <= num_reqs <= self.max_num_reqs:
            raise ValueError(f"num_reqs must be in 0..{self.max_num_reqs}, got {num_reqs}")
        n = int(num_reqs)
        # A blocking copy: the staging rows may be edited again right after this returns.
        self.tensor[:n].copy_(self.cpu[:n])
        self._committed_num_blocks[:n] = self.num_blocks_per_row[:n]

    def get_device_tensor(self, num_reqs: int | None = None) -> torch.Tensor:
        """The device table (its first ``num_reqs`` rows), as an attention kernel receives it."""
        return self.tensor if num_reqs is None else self.tensor[:num_reqs]

    def compute_slot_mapping(self, req_indices, positions, block_size: int) -> torch.Tensor:
        """Slots for this step's tokens, from the committed table, by the Triton kernel.

        ``req_indices[i] == -1`` marks a padding token (slot -1). A real token's
        position must fall inside its row's committed blocks: a position past
        them would read a stale or zero cell and write K/V into someone else's
        block, so it is an IndexError here, before the kernel runs.

        The split is per token: each token brings its row in ``req_indices``.
        vLLM 0.33.0's ``BlockTable.compute_slot_mapping`` takes
        ``query_start_loc`` instead, runs one program per request over its
        token range, and has one extra program fill the rest of its
        fixed-size buffer with ``PAD_SLOT_ID`` (-1); padding by row ``-1`` is
        this library's convention. Both give the same slots.
        """
        # Imported here, not at the top: the table itself needs no Triton, and
        # `import pagedkv.block_table` stays cheap on machines without it.
        from ._device import require_kernel_device
        from .kernels.slot_mapping import launch_slot_mapping
        from .kernels.tensor_checks import as_index_tensor

        block_size = check_int(block_size, "block_size", 1)
        req = as_index_tensor(req_indices, "req_indices", torch.device("cpu"))
        pos = as_index_tensor(positions, "positions", torch.device("cpu"))
        if req.shape != pos.shape:
            raise ValueError(
                f"req_indices and positions must have the same length, got {req.numel()} and {pos.numel()}"
            )
        bad = (req < -1) | (req >= self.max_num_reqs)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise IndexError(
                f"req_indices[{i}] = {int(req[i])} is not a row of the table "
                f"(rows 0..{self.max_num_reqs - 1}, or -1 for padding)"
            )
        real = req >= 0
        lengths = torch.from_numpy(self._committed_num_blocks.astype(np.int64))
        limit = lengths[torch.where(real, req, 0).long()] * block_size
        bad = real & ((pos < 0) | (pos >= limit))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            r = int(req[i])
            raise IndexError(
                f"positions[{i}] = {int(pos[i])} is beyond row {r}'s {int(lengths[r])} committed blocks "
                f"of {block_size} tokens (last valid position {int(limit[i]) - 1}); "
                "append the block and commit() first"
            )
        # The checks above subsume the kernel wrapper's: rows are in range, every
        # position lies in its row's committed blocks (so its column is inside the
        # table), and committed cells hold block ids that append_row validated.
        # So the kernel is launched directly, without validating a second time.
        require_kernel_device(self.tensor, "block_table")
        req, pos = req.to(self.device), pos.to(self.device)
        out = torch.empty(req.numel(), dtype=torch.int64, device=self.device)
        return launch_slot_mapping(self.tensor, req, pos, int(block_size), out)

    # -- inspection ---------------------------------------------------------------------------
    def row(self, row_idx: int) -> list[int]:
        """The staged block ids of row ``row_idx``, as the scheduler's list would hold them."""
        r = self._row(row_idx)
        return self.np[r, : self.num_blocks_per_row[r]].tolist()

    @property
    def metadata_bytes(self) -> int:
        """Bytes of the device table: the whole index the kernels read, sized for the worst case."""
        return self.tensor.numel() * self.tensor.element_size()

    def check(self) -> None:
        """Verify the invariants in the module docstring; raise ``InvariantError`` naming the broken one."""
        n = self.num_blocks_per_row
        bad_len = (n < 0) | (n > self.max_num_blocks_per_req)
        require(not bad_len.any(), "row length in range",
                lambda: f"row {int(np.flatnonzero(bad_len)[0])} has length {int(n[bad_len][0])}")
        cols = np.arange(self.max_num_blocks_per_req)

        def first_cell(mask) -> str:
            r, c = map(int, np.argwhere(mask)[0])
            return f"row {r} column {c} holds {int(self.np[r, c])}"

        stale = (cols[None, :] >= n[:, None]) & (self.np != 0)
        require(not stale.any(), "cells past a row's length are 0", lambda: first_cell(stale))
        live = (cols[None, :] < n[:, None]) & (self.np < 0)
        require(not live.any(), "live block ids are >= 0", lambda: first_cell(live))

    def __repr__(self) -> str:
        return (
            f"BlockTable({self.max_num_reqs} rows x {self.max_num_blocks_per_req} blocks, "
            f"{self.metadata_bytes} bytes on {self.device})"
        )
