"""Model Runner V2's block tables: a row per request for its life, gathered per step.

The scheduler keeps each request's block ids as a Python list per KV-cache
group. The worker mirrors them in one ``[max_num_reqs, width]`` int32 table per
group, indexed by the *request row* that ``RequestState`` gave the request
when it arrived. Per step:

1. **Append.** New requests get their blocks written from column 0
   (``overwrite=True``), running ones get the step's new blocks appended at
   their row's tail; the edits are *staged* (``StagedWriteTensor``).
2. **Apply.** ``apply_staged_writes`` copies only the changed entries to the
   device, and the row lengths (``num_blocks``, small) whole.
3. **Gather.** The step's batch is a list of rows, ``idx_mapping``;
   ``gather_block_tables`` copies those rows into the step's input tables
   (one Triton kernel per group, ``pagedkv.kernels.gather_block_tables``), in
   batch order, rows past the batch zeroed.
4. **Slot mapping.** ``compute_slot_mappings`` turns (batch entry, position)
   into a slot, reading the gathered tables with the library's slot-mapping
   kernel.

No row ever moves: a request that leaves frees its row in ``RequestState``,
and the next ``idx_mapping`` simply omits it. That is what replaced the V1
runner's persistent batch, whose ``BlockTable`` (``pagedkv.block_table``)
keeps the running requests in rows ``0..n-1`` and condenses them with
``move_row`` and ``swap_row`` when one leaves.

In vLLM 0.33.0 this is ``BlockTables`` (``v1/worker/gpu/block_table.py:17-271``)
of Model Runner V2, which runs by default: ``use_v2_model_runner``
(``config/vllm.py:731-767``) is True unless Triton is missing, the
environment says otherwise or a feature V2 lacks is asked for. ``append_block_ids``
(``v1/worker/gpu/block_table.py:125-144``) stages the writes and raises when
a row would overflow; ``apply_staged_writes``
(``v1/worker/gpu/block_table.py:146-158``) applies them, one fused Triton
write for several groups; ``gather_block_tables``
(``v1/worker/gpu/block_table.py:160-211``) launches one program per (group,
row) over a pointer table of the groups, and zeroes the rows a larger earlier
batch left behind (``_num_dirty_rows``), as ours does. Where we differ:

- vLLM's gather copies a row's live blocks and leaves the columns past them as
  the last step left them; ours zeroes them, so the gathered table is a
  function of this step alone. vLLM's gather also nulls, in a sliding-window
  group, the entries wholly below the window of a request's first scheduled
  token (``sliding_window_reach``, the window minus one): the manager has
  freed those blocks, and a kernel tile straddling the window's start could
  still load them. Ours does the same as a separate step after the gather
  (``null_below_window``), in PyTorch.
- vLLM's ``_compute_slot_mappings_kernel`` (``v1/worker/gpu/block_table.py:333-414``)
  reads the per-request rows through ``idx_mapping``; ours reads the gathered
  rows (batch entry ``i`` *is* row ``idx_mapping[i]``), which gives the same
  slots, and pads nothing: the result has exactly one slot per token.
- ``BlockTables`` trusts the model runner to pass rows it holds; ours reads
  them from its ``RequestState`` and refuses an ``idx_mapping`` naming a free
  row, a row out of range or a row twice (``ValueError`` naming the row,
  nothing changed), and a gather while writes are still staged.

Invariants (``check()``): the ``RequestState``'s; every row length within
``0..width``; live ids ``>= 0``; with nothing staged, the device tables and
row lengths equal the host's.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ._device import default_device, require_kernel_device
from .common import check_bool, check_int, require
from .kernels.gather_block_tables import check_idx_mapping, gather_block_tables_ref, launch_gather_block_tables
from .kernels.slot_mapping import compute_slot_mapping_ref, launch_slot_mapping
from .kernels.tensor_checks import as_index_tensor
from .request_state import RequestState
from .staged_write import StagedWriteTensor

__all__ = ["BlockTables"]

_MAX_BLOCK_ID = np.iinfo(np.int32).max


class BlockTables:
    """One ``[max_num_reqs, width]`` block table per KV-cache group, rows held for life.

    Args:
        req_states: who holds which row; the tables have ``req_states.max_num_reqs`` rows.
        block_sizes: tokens per block, one per KV-cache group.
        max_num_blocks_per_group: the width of each group's table.
        device: where the kernels read the tables; ``pagedkv.default_device()`` if None.
        sliding_window_reach: per group, the tokens below a request's first
            scheduled position its layers still read (a window minus one), 0
            for full attention (the default for every group).

    Each group's table is its own tensor: an edit of one group's row never
    touches another group's.
    """

    def __init__(self, req_states: RequestState, block_sizes: Sequence[int],
                 max_num_blocks_per_group: Sequence[int], device: torch.device | str | None = None,
                 sliding_window_reach: Sequence[int] | None = None):
        if not isinstance(req_states, RequestState):
            raise TypeError(f"req_states must be a RequestState, got {type(req_states).__name__}")
        self.block_sizes = [check_int(b, "block_sizes", 1) for b in block_sizes]
        widths = [check_int(w, "max_num_blocks_per_group", 1) for w in max_num_blocks_per_group]
        if not self.block_sizes or len(widths) != len(self.block_sizes):
            raise ValueError(f"block_sizes and max_num_blocks_per_group need one entry per group, "
                             f"got {list(block_sizes)} and {list(max_num_blocks_per_group)}")
        reach = [0] * len(widths) if sliding_window_reach is None else [
            check_int(r, "sliding_window_reach", 0) for r in sliding_window_reach]
        if len(reach) != len(widths):
            raise ValueError(f"sliding_window_reach needs one entry per group ({len(widths)}), got {reach}")
        self.sliding_window_reach = reach
        self.has_sliding_window_groups = any(reach)
        self.req_states = req_states
        self.max_num_reqs = req_states.max_num_reqs
        self.num_kv_cache_groups = len(self.block_sizes)
        self.device = torch.device(device) if device is not None else default_device()
        self.block_tables = [StagedWriteTensor((self.max_num_reqs, w), torch.int32, self.device) for w in widths]
        # Row lengths per group: host copy edited by append_block_ids, device copy refreshed by apply.
        self.num_blocks = np.zeros((self.num_kv_cache_groups, self.max_num_reqs), dtype=np.int32)
        self.num_blocks_gpu = torch.zeros(self.num_blocks.shape, dtype=torch.int32, device=self.device)
        self._num_blocks_dirty = False
        # The step's tables the forward pass reads, one per group, rows in batch order.
        self.input_block_tables = [torch.zeros_like(t.gpu) for t in self.block_tables]
        self._num_dirty_rows = 0  # input rows the last gather wrote
        self._last_idx_mapping: torch.Tensor | None = None

    # -- staging ------------------------------------------------------------------------------
    def append_block_ids(self, req_index: int, new_block_ids: Sequence[Sequence[int]], overwrite: bool) -> None:
        """Stage ``new_block_ids[g]`` at the tail of row ``req_index`` of group ``g``'s table.

        ``overwrite=True`` writes from column 0 (a new or resumed request);
        otherwise after the row's blocks. Everything is checked first -- a held
        row, one list per group, ids in ``0..2**31-1``, room in the row -- so a
        refused call (``TypeError``/``ValueError``) stages nothing.
        """
        req_index = self._held_row(req_index, "req_index")
        overwrite = check_bool(overwrite, "overwrite")
        if isinstance(new_block_ids, (str, bytes)) or len(new_block_ids) != self.num_kv_cache_groups:
            raise ValueError(f"new_block_ids must hold one list per KV-cache group "
                             f"({self.num_kv_cache_groups}), got {new_block_ids!r}")
        runs = []
        for g, ids in enumerate(new_block_ids):
            arr = np.asarray(ids)
            if arr.size and (arr.ndim != 1 or arr.dtype.kind not in "iu"):
                raise TypeError(f"new_block_ids[{g}] must be a flat sequence of ints, got {ids!r}")
            if arr.size and (arr.min() < 0 or arr.max() > _MAX_BLOCK_ID):
                bad = arr[(arr < 0) | (arr > _MAX_BLOCK_ID)][0]
                raise ValueError(f"block id {int(bad)} in new_block_ids[{g}] is not a block id (0..2**31-1)")
            start = 0 if overwrite else int(self.num_blocks[g, req_index])
            width = self.block_tables[g].gpu.shape[1]
            if start + arr.size > width:
                raise ValueError(f"row {req_index} of group {g} would hold {start + arr.size} blocks, "
                                 f"past its width {width}")
            runs.append((start, arr.astype(np.int64)))
        for g, (start, arr) in enumerate(runs):
            self.block_tables[g].stage_write(req_index, start, arr)
            self.num_blocks[g, req_index] = start + arr.size
        self._num_blocks_dirty = True

    def apply_staged_writes(self) -> int:
        """Copy the staged entries (and the row lengths) to the device; returns the entries copied."""
        copied = sum(t.apply_write() for t in self.block_tables)
        if self._num_blocks_dirty:
            self.num_blocks_gpu.copy_(torch.from_numpy(self.num_blocks))
            self._num_blocks_dirty = False
        return copied

    @property
    def has_staged_writes(self) -> bool:
        return self._num_blocks_dirty or any(t.num_staged_writes for t in self.block_tables)

    # -- the step -----------------------------------------------------------------------------
    def gather_block_tables(self, idx_mapping, num_reqs_padded: int | None = None, *,
                            reference: bool = False) -> tuple[torch.Tensor, ...]:
        """The step's input tables, ``[num_reqs_padded, width]`` per group: row ``i`` is row ``idx_mapping[i]``.

        ``reference=True`` gathers with the kernel's PyTorch reference
        (``gather_block_tables_ref``) instead of the Triton kernel: the same
        tables, for a CPU engine that does not run Triton's interpreter.
        Refused before anything runs (``ValueError`` naming the entry and the
        row): a row out of range, a row twice, a free row; and
        (``RuntimeError``) writes staged but not applied.
        """
        reference = check_bool(reference, "reference")
        idx = self._check_idx_mapping(idx_mapping)
        num_reqs = idx.numel()
        padded = num_reqs if num_reqs_padded is None else check_int(num_reqs_padded, "num_reqs_padded", num_reqs)
        if padded > self.max_num_reqs:
            raise ValueError(f"num_reqs_padded must be <= max_num_reqs = {self.max_num_reqs}, got {padded}")
        if self.has_staged_writes:
            raise RuntimeError("block ids are staged but not on the device: call apply_staged_writes() first")
        require_kernel_device(self.num_blocks_gpu, "block_tables")
        idx_dev = idx.to(self.device)
        num_rows = max(padded, self._num_dirty_rows)  # also zero rows a larger batch left
        for g, table in enumerate(self.block_tables):
            if reference:
                gather_block_tables_ref(table.gpu, self.num_blocks_gpu[g], idx_dev, num_rows,
                                        out=self.input_block_tables[g])
            else:
                launch_gather_block_tables(table.gpu, self.num_blocks_gpu[g], idx_dev,
                                           self.input_block_tables[g], num_rows)
        self._num_dirty_rows = padded
        self._last_idx_mapping = idx
        return tuple(t[:padded] for t in self.input_block_tables)

    def null_below_window(self, tables: Sequence[torch.Tensor], num_computed_tokens) -> None:
        """In each sliding-window group's gathered table, put the null block (0) in the entries
        wholly below the window of each batch entry's first scheduled token (in place).

        ``tables`` are the ones ``gather_block_tables`` returned; entry ``i``
        of ``num_computed_tokens`` is batch entry ``i``'s first position. Entry
        ``j`` is nulled when ``(j + 1) * block_size <= first - reach``: no
        query of this step reads it (vLLM's ``_gather_block_tables_kernel``,
        ``v1/worker/gpu/block_table.py:275-330``).
        """
        if len(tables) != self.num_kv_cache_groups:
            raise ValueError(f"expected {self.num_kv_cache_groups} gathered tables, got {len(tables)}")
        first = torch.as_tensor(num_computed_tokens, dtype=torch.int64).reshape(-1)
        for g, reach in enumerate(self.sliding_window_reach):
            if not reach:
                continue
            table = tables[g]
            if first.numel() != table.shape[0]:
                raise ValueError(f"num_computed_tokens has {first.numel()} entries for {table.shape[0]} rows")
            num_null = ((first - reach).clamp(min=0) // self.block_sizes[g]).to(table.device)
            cols = torch.arange(table.shape[1], device=table.device)
            table.masked_fill_(cols[None, :] < num_null[:, None], 0)

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, *,
                              reference: bool = False) -> torch.Tensor:
        """``[num_kv_cache_groups, num_tokens]`` int64 slots, read from the gathered tables.

        Batch entry ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i+1]``;
        ``reference=True`` computes with ``compute_slot_mapping_ref`` instead of
        the Triton kernel.
        ``idx_mapping`` must be the one last gathered, and every position must
        fall inside its row's blocks (else a token would write into a zeroed
        cell's block 0): ``ValueError`` otherwise, before any launch.
        """
        reference = check_bool(reference, "reference")
        idx = as_index_tensor(idx_mapping, "idx_mapping", torch.device("cpu"))
        if self._last_idx_mapping is None or not torch.equal(idx.long(), self._last_idx_mapping.long()):
            raise ValueError("idx_mapping is not the one last gathered: call gather_block_tables(idx_mapping) first")
        qsl = as_index_tensor(query_start_loc, "query_start_loc", torch.device("cpu")).long()
        pos = as_index_tensor(positions, "positions", torch.device("cpu")).long()
        num_reqs = idx.numel()
        if qsl.numel() != num_reqs + 1 or int(qsl[0]) != 0 or bool((qsl[1:] < qsl[:-1]).any()) \
                or int(qsl[-1]) != pos.numel():
            raise ValueError(f"query_start_loc must rise from 0 to len(positions) = {pos.numel()} "
                             f"in {num_reqs + 1} entries, got {qsl.tolist()}")
        batch = torch.repeat_interleave(torch.arange(num_reqs), qsl.diff())
        rows = idx.long()[batch]
        for g, block_size in enumerate(self.block_sizes):
            limit = torch.from_numpy(self.num_blocks[g]).long()[rows] * block_size
            bad = (pos < 0) | (pos >= limit)
            if bool(bad.any()):
                t = int(bad.nonzero()[0, 0])
                raise ValueError(f"positions[{t}] = {int(pos[t])} is outside row {int(rows[t])}'s "
                                 f"{int(self.num_blocks[g, rows[t]])} blocks of {block_size} tokens (group {g})")
        out = torch.empty((self.num_kv_cache_groups, pos.numel()), dtype=torch.int64, device=self.device)
        batch_dev, pos_dev = batch.to(self.device), pos.to(self.device)
        for g, block_size in enumerate(self.block_sizes):
            if reference:
                out[g] = compute_slot_mapping_ref(self.input_block_tables[g], batch_dev, pos_dev, block_size)
            else:
                launch_slot_mapping(self.input_block_tables[g], batch_dev, pos_dev, block_size, out[g])
        return out

    # -- validation ---------------------------------------------------------------------------
    def _held_row(self, req_index, name: str) -> int:
        req_index = check_int(req_index, name)
        if not 0 <= req_index < self.max_num_reqs:
            raise ValueError(f"{name} {req_index} is out of range: the tables have rows 0..{self.max_num_reqs - 1}")
        if not self.req_states.is_held(req_index):
            raise ValueError(f"{name} {req_index} is a free row: no request holds it")
        return req_index

    def _check_idx_mapping(self, idx_mapping) -> torch.Tensor:
        idx = as_index_tensor(idx_mapping, "idx_mapping", torch.device("cpu"))
        check_idx_mapping(idx, self.max_num_reqs)
        for i, row in enumerate(idx.tolist()):
            if not self.req_states.is_held(row):
                raise ValueError(f"idx_mapping[{i}] = row {row} is a free row: no request holds it")
        return idx

    # -- inspection ---------------------------------------------------------------------------
    def block_ids(self, req_index: int) -> tuple[list[int], ...]:
        """The block ids of a held row, one list per group (as the scheduler's lists hold them)."""
        r = self._held_row(req_index, "req_index")
        return tuple(t.np[r, : self.num_blocks[g, r]].tolist() for g, t in enumerate(self.block_tables))

    @property
    def metadata_bytes(self) -> int:
        """Bytes of the per-request tables on the device (the input tables are as many again)."""
        return sum(t.gpu.numel() * t.gpu.element_size() for t in self.block_tables)

    def check(self) -> None:
        """Verify the invariants in the module docstring; ``InvariantError`` naming the broken one."""
        self.req_states.check()
        for g, t in enumerate(self.block_tables):
            n, width = self.num_blocks[g], t.gpu.shape[1]
            bad = (n < 0) | (n > width)
            require(not bad.any(), "row length in range",
                    lambda: f"group {g} row {int(np.flatnonzero(bad)[0])} has {int(n[bad][0])} blocks")
            live = (np.arange(width)[None, :] < n[:, None]) & (t.np < 0)
            require(not live.any(), "live block ids are >= 0",
                    lambda: f"group {g} cell {np.argwhere(live)[0].tolist()}")
            t.check()
        if not self._num_blocks_dirty:
            require(np.array_equal(self.num_blocks_gpu.cpu().numpy(), self.num_blocks),
                    "the device row lengths are the host's", "num_blocks differ after apply_staged_writes()")

    def __repr__(self) -> str:
        return (f"BlockTables({self.num_kv_cache_groups} group(s), {self.req_states.num_reqs} of "
                f"{self.max_num_reqs} rows held, {self.metadata_bytes} bytes on {self.device})")
