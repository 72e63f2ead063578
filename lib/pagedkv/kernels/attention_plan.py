"""The plan of one attention launch: the work list, the tiles, the grid, the split count.

Everything here runs on the host, from the step's query and sequence lengths
alone, before anything is launched; a model step plans once and every layer
launches the same plan.

* The *work list*: every (request, query tile) pair that holds new tokens,
  request after request. Program ``i`` along the grid's first axis computes
  pair ``i``, so no request is padded to the longest one's tiles and every
  program launched has work. (vLLM's kernel launches an upper bound of tiles
  instead and finds each program's request by a binary search over
  ``query_start_loc``.)
* The tiles (``_tile_config``): rows per query tile (``BLOCK_M``), keys per
  step (``TILE_N``), warps and pipeline stages, by dtype and head_dim only,
  never by device, so a plan prints the same everywhere.
* The grid: ``(num_work, num_kv_heads, num_splits)``.
* The split count (split-KV): on a GPU, enough segments to fill the programs
  it holds at once (its resident capacity, read from the compiled kernel's
  registers and shared memory), see ``residency.split_rule``; one on a CPU.
  ``split_segments`` gives each split's keys, as the kernel computes them.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field

import torch
import triton

from .._device import on_gpu
from ..common import cdiv
from .attention_kernel import kernel_launches
from .residency import MAX_SPLITS, SM_LIMITS, SMLimits, choose_splits, resident_programs

__all__ = ["AttentionPlan", "plan_attention", "work_list", "split_segments"]


@dataclass(frozen=True)
class AttentionPlan:
    """How one launch is shaped: the tiles, the work list and the grid (see the module docstring).

    ``work`` is the step's work list, int32 ``[num_work, 2]``: row ``i`` is
    the (request, query tile) that the programs with ``program_id(0) == i``
    compute. Only tiles holding new tokens are listed, request after request,
    so ``grid[0] == num_work``. ``plan_attention`` builds it on the CPU;
    ``validated_plan`` moves it to the kernels' device once per step, and
    every layer's launch reads the same tensor.
    """

    block_m: int  # rows per query tile
    block_q: int  # query tokens per tile
    tile_n: int  # key positions per inner iteration
    num_splits: int  # KV segments per tile
    grid: tuple[int, int, int]  # (num_work, num_kv_heads, num_splits)
    num_warps: int = 4  # warps per program
    num_stages: int = 3  # K/V tiles the compiler's pipeliner may keep in flight
    work: torch.Tensor | None = field(default=None, compare=False, repr=False)
    sliding_window: int | None = None  # keys a query sees (itself included); None: all before it

    def work_items(self) -> list[tuple[int, int]]:
        """The work list as (request, query tile) pairs, in launch order."""
        return [] if self.work is None else [tuple(w) for w in self.work.tolist()]


def work_list(q_lens: list[int], block_q: int) -> torch.Tensor:
    """(request, query tile) of every tile with new tokens: int32 [n, 2]."""
    pairs = [(r, t) for r, n in enumerate(q_lens)
             for t in range(cdiv(n, block_q))]
    return torch.tensor(pairs, dtype=torch.int32).reshape(len(pairs), 2)


# Tiles per (decode?, element size, padded head_dim): (rows, tile_n,
# num_warps, num_stages); rows is the least BLOCK_M (a group wider than it
# takes more). Chosen from the compile report (tools/compile_check.py), whose
# figures are the compiler's predictions, not GPU measurements: every entry
# fits the shared memory of an A100 and an H200; 2-byte types up to head_dim
# 128 do not spill on either; the decode loop keeps two K/V tiles in flight.
# A 2-byte tile's rows equal what its tensor-core layout covers: 8 warps
# cover 128 rows (on sm_90 a 64-row tile with 8 warps computed QK^T and the
# softmax twice). 2-byte decode takes 32 keys per step, which keeps its
# registers low enough for several programs per SM (the report gives the
# count). fp32 runs tl.dot on FMA units; wide fp32 tiles only spill more.
def _tile_config(decode: bool, elem_bytes: int, head_dim: int) -> tuple[int, int, int, int]:
    if decode:
        if elem_bytes == 4:
            return (16, 32, 4, 2) if head_dim == 256 else (16, 64, 4, 3)
        return 16, 32, 4, 3
    if elem_bytes == 4:
        return (64, 32, 8, 2) if head_dim == 256 else (64, 64, 8, 2)
    if head_dim == 256:
        return 128, 32, 8, 2
    return 128, 64, 8, 3


@functools.cache
def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def plan_attention(num_heads: int, num_kv_heads: int, q_lens: list[int], seq_lens: list[int],
                   num_splits: int | None = None, *, head_dim: int = 128,
                   dtype: torch.dtype = torch.bfloat16, block_size: int = 16,
                   sliding_window: int | None = None) -> AttentionPlan:
    """The tiles and grid for one launch; ``num_splits=None`` chooses split-KV (see ``split_rule``).

    ``block_size`` is the cache's: a compile-time constant of the kernel, so
    the split rule reads the residency of the kernel compiled for it.
    ``sliding_window`` (a sliding-window layer's) bounds the keys a tile walks,
    which the split rule counts.
    """
    group = num_heads // num_kv_heads
    max_q = max(q_lens, default=0)
    decode = max_q <= 1
    # A decode batch (every q_len 1) needs only the group's rows. Triton accepts
    # a smaller tl.dot (M, N >= 1, K >= 16: min_dot_size in Triton's NVIDIA
    # backend) but pads it to the tensor cores' 16-row MMA fragment, so 16 rows
    # cost no more than 4; a prefill tile takes several tokens, so that one K/V
    # tile serves more queries. The tiles depend on dtype and head_dim only,
    # never on the device, so a plan prints the same everywhere.
    rows, tile_n, num_warps, num_stages = _tile_config(
        decode, torch.empty((), dtype=dtype).element_size(), triton.next_power_of_2(head_dim))
    block_m = max(rows, triton.next_power_of_2(group))
    block_q = block_m // group
    work = work_list(q_lens, block_q)
    if num_splits is None:
        num_splits = 1
        if on_gpu():
            programs = work.shape[0] * num_kv_heads
            try:
                capacity = _resident_capacity(dtype, head_dim, group, block_m, tile_n, num_warps, num_stages,
                                              block_size)
            except Exception as exc:  # never fail a launch over a plan: one program per SM
                warnings.warn(f"split-KV planning could not read the compiled kernel ({exc!r}); "
                              "assuming one resident program per SM", RuntimeWarning, stacklevel=2)
                capacity = _num_sms()
            keys = max(seq_lens, default=0)
            if sliding_window is not None:  # a tile walks its first query's window and its own tokens
                keys = min(keys, sliding_window + block_q - 1)
            num_splits = choose_splits(programs, keys, tile_n, capacity)
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int from 1 to {MAX_SPLITS} or None, got {num_splits!r}")
    grid = (work.shape[0], num_kv_heads, num_splits)
    return AttentionPlan(block_m, block_q, tile_n, num_splits, grid, num_warps, num_stages, work, sliding_window)


@functools.cache
def _resident_capacity(dtype, head_dim, group, block_m, tile_n, num_warps, num_stages, block_size) -> int:
    """Resident programs on this GPU for the split kernel of one tile configuration.

    Compiles (without launching) the kernel a split launch would run and
    reads its registers and shared memory; cached per configuration.
    """
    dev = torch.device("cuda")
    q = torch.empty((1, group, head_dim), dtype=dtype, device=dev)
    cache = torch.empty((1, block_size, 1, head_dim), dtype=dtype, device=dev)
    meta = torch.zeros((2,), dtype=torch.int32, device=dev)
    plan = AttentionPlan(block_m, block_m // group, tile_n, 2, (1, 1, 2), num_warps, num_stages,
                         torch.zeros((1, 2), dtype=torch.int32))
    kernel, grid, args, kwargs = kernel_launches(plan, q, cache, cache, meta.view(1, 2), meta[:1], meta,
                                                 1.0, q)[0]
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    compiled._init_handles()  # fills n_regs from the loaded binary
    props = torch.cuda.get_device_properties(0)
    limits = SM_LIMITS.get(props.major * 10 + props.minor, SMLimits(
        props.regs_per_multiprocessor, props.shared_memory_per_multiprocessor,
        props.shared_memory_per_block_optin, props.max_threads_per_multi_processor, 32))
    per_sm = resident_programs(compiled.n_regs, compiled.metadata.shared, num_warps, limits)
    return max(1, per_sm) * _num_sms()


def split_segments(kv_end: int, num_splits: int, tile_n: int, kv_start: int = 0) -> list[tuple[int, int]]:
    """The keys ``[lo, hi)`` each split of one query tile walks, as the kernel computes them.

    ``kv_end`` is the tile's causal bound (one past the position of its last
    token); ``kv_start`` its first key, 0 unless a sliding window starts the
    walk later. The segment length is ``(kv_end - kv_start) / num_splits``
    rounded up to whole ``tile_n`` tiles, so the last splits may start at or
    past ``kv_end``: such a split is empty (``lo >= hi``), walks nothing and
    weighs nothing in the merge.
    """
    seg = cdiv(cdiv(kv_end - kv_start, num_splits), tile_n) * tile_n
    return [(kv_start + s * seg, min(kv_start + s * seg + seg, kv_end)) for s in range(num_splits)]
