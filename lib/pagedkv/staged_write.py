"""Staged writes: a device tensor that receives only the entries that changed.

The worker's per-request tables are large (``max_num_reqs`` rows, each wide
enough for the longest sequence) and change little per step: a decode step
appends one block id to a few rows, if any. Copying the whole table to the
device every step would move megabytes to change a few bytes. So edits are
*staged* on the host as ``(row, start, values)`` runs, and ``apply_write``
sends only those entries to the device in one scatter.

Ours keeps a host mirror (``cpu``) of what the device holds once the staged
writes land: ``check()`` compares against it, pictures read it, and a cell
written twice before an apply is sent once, with its last value.

Invariant (``check()``): with nothing staged, the device tensor equals the
mirror.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import numpy as np
import torch

from ._device import default_device
from .common import check_int, require

__all__ = ["StagedWriteTensor"]

_DTYPES = (torch.int32, torch.int64, torch.float32)


class StagedWriteTensor:
    """A ``size`` device tensor (1-D or 2-D) written through staged ``(row, start, values)`` runs.

    vLLM 0.33.0's ``StagedWriteTensor`` (``v1/worker/gpu/buffer_utils.py:135-242``)
    stages the same runs (``stage_write``, ``stage_write_elem``) and applies
    them with a Triton kernel, one program per run, reading the values through
    pinned host memory the GPU maps (UVA); it keeps no host mirror. Ours
    applies them with one PyTorch scatter (``index_copy_``) of the distinct
    cells, their values read from the mirror. It has no public
    ``clear_staged_writes``: dropping staged runs would leave the mirror ahead
    of the device.

    Args:
        size: ``num_rows`` or ``(num_rows, row_width)``.
        dtype: int32, int64 or float32, as vLLM allows.
        device: where the kernels read the tensor; ``pagedkv.default_device()`` if None.
    """

    def __init__(self, size: int | Sequence[int], dtype: torch.dtype = torch.int32,
                 device: torch.device | str | None = None):
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype}")
        shape = (size,) if isinstance(size, numbers.Integral) and not isinstance(size, bool) else tuple(size)
        if len(shape) not in (1, 2):
            raise ValueError(f"size must be num_rows or (num_rows, row_width), got {size!r}")
        shape = tuple(check_int(s, "size", 1) for s in shape)
        self.num_rows = shape[0]
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else default_device()
        self.gpu = torch.zeros(shape, dtype=dtype, device=self.device)
        self.cpu = torch.zeros(shape, dtype=dtype)
        self.np: np.ndarray = self.cpu.numpy()
        self._width = shape[1] if len(shape) == 2 else 1
        self._staged: list[tuple[int, int, int]] = []  # (row, start, length) of each staged run
        self.num_copied_elements = 0  # entries sent to the device by every apply_write so far

    # -- staging ------------------------------------------------------------------------------
    def stage_write(self, index: int, start: int, x: Sequence) -> None:
        """Stage ``x`` into row ``index`` from column ``start``; nothing reaches the device yet.

        Checked before anything changes: ``index`` a row, ``start >= 0``, the
        run inside the row, the values numbers that fit the dtype.
        """
        index = check_int(index, "index", 0)
        start = check_int(start, "start", 0)
        if index >= self.num_rows:
            raise ValueError(f"index {index} is not a row (rows 0..{self.num_rows - 1})")
        values = self._values(x)
        if values.size == 0:
            return
        end = start + values.size
        if end > self._width:
            raise ValueError(f"writing {values.size} values at column {start} of row {index} "
                             f"reaches column {end - 1}, past the row's {self._width} columns")
        if self.cpu.dim() == 2:
            self.np[index, start:end] = values
        else:
            self.np[index] = values[0]
        self._staged.append((index, start, int(values.size)))

    def stage_write_elem(self, index: int, x) -> None:
        """Stage one value at column 0 of row ``index`` (for a 1-D tensor: entry ``index``)."""
        self.stage_write(index, 0, [x])

    def _values(self, x) -> np.ndarray:
        values = np.asarray(x)
        if values.ndim != 1:
            raise TypeError(f"the values must be a flat sequence, got {x!r}")
        if values.size == 0:
            return values
        if self.dtype.is_floating_point:
            if values.dtype.kind not in "iuf":
                raise TypeError(f"the values must be numbers, got {x!r}")
            return values.astype(np.float32)
        if values.dtype.kind not in "iu":
            raise TypeError(f"the values must be ints, got {x!r}")
        info = np.iinfo(np.int32 if self.dtype == torch.int32 else np.int64)
        bad = (values < info.min) | (values > info.max)
        if bad.any():
            raise ValueError(f"value {int(values[bad][0])} does not fit {self.dtype}")
        return values

    @property
    def num_staged_writes(self) -> int:
        """Runs staged since the last ``apply_write``."""
        return len(self._staged)

    # -- the device side ----------------------------------------------------------------------
    def apply_write(self) -> int:
        """Send the staged entries to the device; returns how many entries were copied.

        A cell staged twice is copied once, with its last value (the mirror's).
        """
        if not self._staged:
            return 0
        flat = [np.arange(r * self._width + s, r * self._width + s + n) for r, s, n in self._staged]
        cells = np.unique(np.concatenate(flat))
        pos = torch.from_numpy(cells)
        values = self.cpu.view(-1)[pos]
        self.gpu.view(-1).index_copy_(0, pos.to(self.device), values.to(self.device))
        self._staged.clear()
        self.num_copied_elements += int(cells.size)
        return int(cells.size)

    def check(self) -> None:
        """With nothing staged, the device holds exactly the mirror; ``InvariantError`` if not."""
        if self._staged:
            return
        same = torch.equal(self.gpu.cpu(), self.cpu)
        require(same, "the device holds the applied writes",
                lambda: f"first differing cell {np.argwhere(self.gpu.cpu().numpy() != self.np)[0].tolist()}")

    def __repr__(self) -> str:
        return (f"StagedWriteTensor({tuple(self.gpu.shape)}, {self.dtype}, {self.num_staged_writes} staged, "
                f"{self.num_copied_elements} copied)")
