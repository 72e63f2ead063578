"""Paged attention: one varlen kernel that reads K/V through the block table.

This is the consumer of everything the earlier chapters build. A step's
scheduled tokens arrive concatenated, request after request (vLLM's
``query_start_loc`` says where each request's tokens start). Request ``r``
has ``seq_lens[r]`` tokens in the cache after this step's KV write; its
``q_len`` new tokens are the *last* ``q_len`` of them, so a decode token
(``q_len == 1``) and a prefill chunk after a prefix hit are the same case:
query ``i`` sits at position ``ctx_len + i`` (``ctx_len = seq_len - q_len``)
and may see keys ``0 .. ctx_len + i``. One launch serves any mix.

The grid, as in vLLM's unified Triton kernel (simplified):

* one program per (query tile, KV head, KV split), where a query tile is one
  (request, tile) pair of the step's *work list*: ``plan_attention`` lists,
  on the host, the tiles that hold new tokens, request after request, and the
  kernel reads its pair from that list. A request is never padded to the
  longest one's tiles, and every program launched has work (vLLM's kernel
  launches an upper bound of tiles instead and finds each program's request
  by a binary search over ``query_start_loc``). The list is built once per
  step and serves every layer;
* a query tile holds ``BLOCK_Q`` tokens x the ``GROUP`` query heads that
  share the KV head, ``BLOCK_M = BLOCK_Q * GROUP`` rows: one K/V load serves
  the whole group (grouped-query attention);
* the program walks the keys it may see in tiles of ``TILE_N`` positions.
  For each position it loads the block id from the table
  (``block_table[r, pos // block_size]``) and reads row ``pos % block_size``
  of that block: the tile size is independent of the block size, which is
  why block size 1 (SGLang's token-level table) and 128 use the same kernel;
* scores, an online softmax in fp32 (running max ``m``, running sum ``l``,
  rescaled accumulator), and the causal mask for the last tile.

head_dim may be any multiple of 8 from 16 to 256: ``HEAD_DIM_P2`` is the next
power of two (``tl.arange`` needs one) and the dimensions past ``HEAD_DIM``
are masked on every load and store, as vLLM pads to ``head_size_padded``.

Split-KV (the flash-decoding idea): one decode token of one request at long
context is a single program that walks the whole sequence while most of the
GPU idles. With ``num_splits > 1`` each program covers one segment of the
keys and writes its partial output and log-sum-exp; a second small kernel
merges the segments, weighting each by ``exp(lse_i - max lse)``. The split
count is a runtime argument, not a constexpr, so one compiled kernel serves
every count (the merge compiles one per power of two up to 64). How many
segments: enough to fill the programs the GPU holds at once (its resident
capacity, from the compiled kernel's registers and shared memory), see
``split_rule``.

The K/V loads can overlap the compute: a tile's block ids are read one
iteration ahead, so the compiler's pipeliner may copy later K/V tiles while
one computes. How many it keeps in flight depends on the configuration
(``tools/compile_check.py`` counts the buffers in the compiled loop: two for
decode and split at three stages, which the check requires of 2-byte types;
one for the fp32 configurations with two stages, every fp32 prefill among
them, so no tile is loaded ahead there; three for 2-byte prefill up to
head_dim 128 on sm_90, two on sm_80). Tiles, warps and pipeline stages
depend on dtype and head_dim (``_tile_config``) so that every configuration
fits the shared memory of an A100 and an H200.

Versions: compiled, the kernel needs triton >= 3.6. Interpreted, Triton 3.6
needs numpy < 2.4 (its interpreter turns the loop bounds, one-element arrays,
into ints in a way numpy 2.4 refuses); Triton 3.7 has no such limit.

Every wrapper validates before launching (see ``pagedkv.kernels``): a block id
out of range is an ``IndexError`` naming the request and the column. Table
columns past a request's ``seq_len`` are never read, so they may hold
anything, as in vLLM.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, field, replace

import torch
import triton
import triton.language as tl

from .._device import INTERPRETED, on_gpu, require_kernel_device
from .residency import MAX_SPLITS, SM_LIMITS, SMLimits, choose_splits, resident_programs, split_rule
from .tensor_checks import check_tensor_args
from ..common import cdiv

__all__ = [
    "paged_attention",
    "paged_attention_ref",
    "dense_attention_ref",
    "AttentionPlan",
    "plan_attention",
    "work_list",
    "paginate",
    "ATTENTION_DTYPES",
    "SMLimits",
    "SM_LIMITS",
    "resident_programs",
    "split_rule",
    "choose_splits",
    "kernel_launches",
    "validated_plan",
    "launch_planned",
]

ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Every multiple of 8 from 16 to 256. A power of two is the kernel's own tile
# width; any other (80, 96, 112: Phi-2, Phi-3, ...) is padded to the next power
# of two with the extra dimensions masked, as vLLM pads to HEAD_SIZE_PADDED.
# A multiple of 8 keeps a row of 2-byte K/V in whole 16-byte copies.
HEAD_DIMS = tuple(range(16, 257, 8))


# The integers that change from step to step are not specialised (Triton would
# compile a kernel for 1, for multiples of 16 and for the rest): a serving run
# compiles one kernel per configuration, whatever its batch or split count.
@triton.jit(do_not_specialize=["num_tokens", "max_blocks", "num_splits"])
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, HEAD_DIM], contiguous
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM], contiguous
    v_cache_ptr,
    block_table_ptr,  # [num_reqs, max_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32: context + new tokens
    query_start_loc_ptr,  # [num_reqs + 1] int32
    work_ptr,  # int32 [num_work, 2]: (request, query tile) of each program along axis 0
    out_ptr,  # not SPLIT: the output, like q; else fp32 partials [num_splits, num_tokens, num_heads, HEAD_DIM]
    lse_ptr,  # SPLIT: fp32 [num_splits, num_tokens, num_heads], log2-domain log-sum-exp
    scale_log2,  # softmax scale * log2(e): the kernel works with exp2
    num_tokens,
    num_heads,
    num_kv_heads,
    max_blocks,
    num_splits,  # KV segments per query tile: a runtime value, one kernel serves every count
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block: a constant divisor, no emulated division
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,  # the model's head_dim (a multiple of 8)
    HEAD_DIM_P2: tl.constexpr,  # HEAD_DIM rounded up to a power of two; dims past HEAD_DIM are masked
    BLOCK_M: tl.constexpr,  # rows of a query tile (power of two >= 16)
    BLOCK_Q: tl.constexpr,  # query tokens of a tile: BLOCK_M // GROUP
    TILE_N: tl.constexpr,  # key positions per inner iteration
    SPLIT: tl.constexpr,  # num_splits > 1: write partials and lse for the merge
    FP32_DOT: tl.constexpr,  # dot in fp32 (interpreter, or fp32 inputs)
):
    work = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # The work list holds only tiles with new tokens: no program returns at once.
    req = tl.load(work_ptr + 2 * work)
    q_tile = tl.load(work_ptr + 2 * work + 1)

    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    # Row r of the tile is query token r // GROUP, query head r % GROUP of the group.
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP  # token index within the request's new tokens
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx_len + q_idx  # its position in the sequence (causal limit)
    token = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dims < HEAD_DIM  # all true unless head_dim is padded (80, 96, 112)
    q_off = (token * num_heads + head)[:, None] * HEAD_DIM + dims[None, :]
    q_ok = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_off, mask=q_ok, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)

    # Keys this tile may see end after its last token; split-KV cuts them
    # into num_splits segments of whole tiles.
    kv_end = ctx_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    seg = tl.cdiv(tl.cdiv(kv_end, num_splits), TILE_N) * TILE_N
    kv_lo = split * seg
    kv_hi = tl.minimum(kv_lo + seg, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    table_row = block_table_ptr + req.to(tl.int64) * max_blocks
    # The block ids of a tile are read one iteration ahead and carried in the
    # loop: a K/V address then depends on no load of its own iteration, so the
    # compiler's pipeliner can issue the next tiles' K/V copies while this one
    # computes (the compile report counts its buffers). Never read the table
    # at or past kv_hi: those columns may be garbage.
    pos = kv_lo + tl.arange(0, TILE_N)
    next_ids = tl.load(table_row + pos // BLOCK_SIZE, mask=pos < kv_hi, other=0)
    for start in range(kv_lo, kv_hi, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        pos_ok = pos < kv_hi
        block_id = next_ids.to(tl.int64)
        ahead = pos + TILE_N
        next_ids = tl.load(table_row + ahead // BLOCK_SIZE, mask=ahead < kv_hi, other=0)
        kv_row = (block_id * BLOCK_SIZE + pos % BLOCK_SIZE) * num_kv_heads + kv_head
        kv_off = kv_row[:, None] * HEAD_DIM + dims[None, :]
        kv_ok = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_ok, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_ok, other=0.0)
        if FP32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

        # Online softmax. A row that has seen no visible key yet keeps m = -inf;
        # m_safe = 0 there so that exp2(-inf - m_safe) = 0 rather than NaN.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if not SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=q_ok)
    else:
        # A segment past this tile's keys saw nothing: lse = -inf, weight 0 in the merge.
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        part = split.to(tl.int64) * num_tokens * num_heads
        tl.store(out_ptr + part * HEAD_DIM + q_off, out, mask=q_ok)
        tl.store(lse_ptr + part + token * num_heads + head, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _merge_splits_kernel(
    partial_ptr,  # fp32 [num_splits, num_tokens, num_heads, HEAD_DIM]
    lse_ptr,  # fp32 [num_splits, num_tokens, num_heads]
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    num_tokens,
    num_heads,
    num_splits,
    SPLITS_P2: tl.constexpr,  # num_splits rounded up to a power of two (tl.arange): 6 kernels for 2..64
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
):
    th = tl.program_id(0).to(tl.int64)  # token * num_heads + head
    s = tl.arange(0, SPLITS_P2).to(tl.int64)  # 64-bit: splits x tokens x heads x head_dim may pass 2**31
    s_ok = s < num_splits
    lse = tl.load(lse_ptr + s * num_tokens * num_heads + th, mask=s_ok, other=float("-inf"))
    # Every token sees at least itself, so at least one segment is finite.
    w = tl.exp2(lse - tl.max(lse, 0))
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dims < HEAD_DIM
    part_off = (s[:, None] * num_tokens * num_heads + th) * HEAD_DIM + dims[None, :]
    o = tl.load(partial_ptr + part_off, mask=s_ok[:, None] & dim_ok[None, :], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + th * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


# ----------------------------------------------------------------- validation

def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _validate(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale):
    """Check everything the kernel trusts; return host copies of the metadata.

    Returns ``(seq_lens, query_start_loc)`` as Python lists (the launch needs the
    longest query to size the grid). First the tensors' shapes and dtypes, then
    the metadata's values: the lengths and every block id a request will read.
    """
    _validate_tensors(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale)
    return _validate_metadata(q.shape[0], key_cache.shape, block_table, seq_lens, query_start_loc)


def _validate_tensors(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale):
    """Types, shapes and dtypes of every argument (nothing read from the device)."""
    named = {"q": q, "key_cache": key_cache, "value_cache": value_cache, "block_table": block_table,
             "seq_lens": seq_lens, "query_start_loc": query_start_loc}
    check_tensor_args(named)
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if key_cache.dim() != 4:
        raise ValueError("key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache shape {tuple(value_cache.shape)} differs from "
                         f"key_cache shape {tuple(key_cache.shape)}")
    for name in ("q", "key_cache", "value_cache"):
        if named[name].dtype not in ATTENTION_DTYPES:
            raise TypeError(f"{name} dtype must be float32, float16 or bfloat16, got {named[name].dtype}")
    if not q.dtype == key_cache.dtype == value_cache.dtype:
        raise TypeError(f"q and the caches must share one dtype, got {q.dtype}, {key_cache.dtype}, "
                        f"{value_cache.dtype}")
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_dim = key_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"q's head_dim {head_dim} differs from the caches' {cache_dim}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {', '.join(map(str, HEAD_DIMS))} (a multiple of 8 "
                         f"from 16 to 256), got {head_dim}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if block_size < 1 or num_blocks < 1:
        raise ValueError(f"the caches hold no slots: shape {tuple(key_cache.shape)}")
    for name in ("block_table", "seq_lens", "query_start_loc"):
        if named[name].dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got dtype {named[name].dtype}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [num_reqs, max_blocks], got shape {tuple(block_table.shape)}")
    num_reqs = block_table.shape[0]
    if seq_lens.shape != (num_reqs,):
        raise ValueError(f"seq_lens must have one length per block-table row ({num_reqs}), "
                         f"got shape {tuple(seq_lens.shape)}")
    if query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(f"query_start_loc must have num_reqs + 1 = {num_reqs + 1} entries, "
                         f"got shape {tuple(query_start_loc.shape)}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float, got {scale!r}")


def _validate_metadata(num_tokens, cache_shape, block_table, seq_lens, query_start_loc):
    """The metadata's values: monotone query starts, lengths that fit the table, valid block ids."""
    num_blocks, block_size = cache_shape[0], cache_shape[1]
    num_reqs = block_table.shape[0]
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if qsl[0] != 0:
        raise ValueError(f"query_start_loc[0] must be 0, got {qsl[0]}")
    if qsl[-1] != num_tokens:
        raise ValueError(f"query_start_loc[-1] = {qsl[-1]} but q has {num_tokens} tokens")
    for r in range(num_reqs):
        q_len = qsl[r + 1] - qsl[r]
        if q_len < 0:
            raise ValueError(f"query_start_loc is not monotone at request {r}: {qsl[r]} then {qsl[r + 1]}")
        if lens[r] < 1:
            raise ValueError(f"seq_lens[{r}] = {lens[r]}: a request must hold at least one token")
        if lens[r] < q_len:
            raise ValueError(f"seq_lens[{r}] = {lens[r]} is shorter than the request's {q_len} new tokens")
    needed = [cdiv(n, block_size) for n in lens]
    if num_reqs and max(needed) > block_table.shape[1]:
        r = needed.index(max(needed))
        raise ValueError(f"request {r} has {lens[r]} tokens = {needed[r]} blocks of {block_size}, "
                         f"but block_table has only {block_table.shape[1]} columns")
    # Only the columns each request will read must hold valid block ids.
    if num_reqs:
        cols = torch.arange(block_table.shape[1], device=block_table.device)
        used = cols[None, :] < torch.tensor(needed, device=block_table.device)[:, None]
        bad = used & ((block_table < 0) | (block_table >= num_blocks))
        if bool(bad.any()):
            r, c = (int(x) for x in bad.nonzero()[0])
            raise IndexError(f"block_table[{r}, {c}] = {int(block_table[r, c])} is not a block of the "
                             f"cache (0..{num_blocks - 1}); request {r} reads column {c} "
                             f"for positions {c * block_size}..{min((c + 1) * block_size, lens[r]) - 1}")
    return lens, qsl


# ----------------------------------------------------------------- planning

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

    def work_items(self) -> list[tuple[int, int]]:
        """The work list as (request, query tile) pairs, in launch order."""
        return [] if self.work is None else [tuple(w) for w in self.work.tolist()]


def work_list(q_lens: list[int], block_q: int) -> torch.Tensor:
    """(request, query tile) for every tile that holds new tokens: int32 ``[num_work, 2]`` on the CPU."""
    pairs = [(r, t) for r, n in enumerate(q_lens) for t in range(cdiv(n, block_q))]
    return torch.tensor(pairs, dtype=torch.int32).reshape(len(pairs), 2)


# Tiles per (decode?, element size, padded head_dim): (rows, tile_n,
# num_warps, num_stages); rows is the least BLOCK_M (a group wider than it
# takes more). Chosen from the compile report (tools/compile_check.py): every
# entry fits the shared memory of an A100 and an H200; 2-byte types up to
# head_dim 128 do not spill on either; the decode loop keeps two K/V tiles in
# flight. A 2-byte tile's rows equal what its tensor-core layout covers: 8
# warps cover 128 rows (on sm_90 a 64-row tile with 8 warps computed QK^T
# and the softmax twice). 2-byte decode takes 32 keys per step: 80 registers
# and 37 KB at head_dim 128, 6 programs per SM on an H200. fp32 runs tl.dot
# on FMA units; wide fp32 tiles only spill more.
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
                   dtype: torch.dtype = torch.bfloat16, block_size: int = 16) -> AttentionPlan:
    """The tiles and grid for one launch; ``num_splits=None`` chooses split-KV (see ``split_rule``).

    ``block_size`` is the cache's: a compile-time constant of the kernel, so
    the split rule reads the residency of the kernel compiled for it.
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
            num_splits = choose_splits(programs, max(seq_lens, default=0), tile_n, capacity)
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int from 1 to {MAX_SPLITS} or None, got {num_splits!r}")
    grid = (work.shape[0], num_kv_heads, num_splits)
    return AttentionPlan(block_m, block_q, tile_n, num_splits, grid, num_warps, num_stages, work)


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


def kernel_launches(plan, q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale, out,
                    *, interpreted: bool = INTERPRETED):
    """The launches of one planned call: ``[(kernel, grid, args, kwargs), ...]``, in order.

    ``launch_planned`` runs exactly these; ``tools/compile_check.py`` compiles them
    ahead of time with Triton's own argument binder, so the check sees the
    specialisation a real launch gets (``interpreted=False``: the arguments of
    a compiled launch). Split-KV's fp32 scratch is allocated here.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    fp32_dot = interpreted or q.dtype == torch.float32  # tl.dot on bf16 is wrong in the interpreter
    splits = plan.num_splits
    if splits == 1:
        part, lse = out, out  # lse_ptr unused
    else:
        part = torch.empty((splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
    work = plan.work.to(q.device)  # a no-op for a plan from validated_plan
    launches = [(
        _paged_attention_kernel, plan.grid,
        (q, key_cache, value_cache, block_table, seq_lens, query_start_loc, work, part, lse,
         float(scale) * math.log2(math.e), num_tokens, num_heads, num_kv_heads, block_table.shape[1], splits),
        dict(BLOCK_SIZE=block_size, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
             HEAD_DIM_P2=triton.next_power_of_2(head_dim), BLOCK_M=plan.block_m,
             BLOCK_Q=plan.block_q, TILE_N=plan.tile_n, SPLIT=splits > 1, FP32_DOT=fp32_dot,
             num_warps=plan.num_warps, num_stages=plan.num_stages),
    )]
    if splits > 1:
        launches.append((
            _merge_splits_kernel, (num_tokens * num_heads,),
            (part, lse, out, num_tokens, num_heads, splits),
            dict(SPLITS_P2=triton.next_power_of_2(splits), HEAD_DIM=head_dim,
                 HEAD_DIM_P2=triton.next_power_of_2(head_dim)),
        ))
    return launches


def paged_attention(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                    *, num_splits=None):
    """Causal attention of this step's queries over the paged KV cache, in one launch.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``, the new tokens of every
            request, concatenated in ``query_start_loc`` order.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads,
            head_dim]`` (what ``reshape_and_cache``, vLLM's ``reshape_and_cache_flash``, writes), q's dtype.
        block_table: int32 ``[num_reqs, max_blocks]``; only the first
            ``cdiv(seq_lens[r], block_size)`` columns of row ``r`` are read.
        seq_lens: int32 ``[num_reqs]``, tokens in the cache after this step.
        query_start_loc: int32 ``[num_reqs + 1]``, cumulative query lengths;
            a request with no new tokens this step produces nothing.
        scale: the softmax scale, usually ``head_dim ** -0.5``.
        num_splits: KV segments per query tile (split-KV); ``None`` chooses.

    Returns a tensor with q's shape, dtype and device. Raises ``TypeError``,
    ``ValueError`` or ``IndexError`` naming the bad value before any launch.
    """
    plan = validated_plan(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                          num_splits=num_splits)
    return launch_planned(plan, q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale)


def validated_plan(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                   *, num_splits=None) -> AttentionPlan:
    """Validate one layer's call and plan its launch, without launching.

    A model step calls attention once per layer with the same metadata and
    caches of the same shape (``Model.allocate_kv_cache`` makes them so), so
    one validation and one plan hold for every layer; ``launch_planned``
    then launches each layer without the host round trips validation costs.
    """
    lens, qsl = _validate(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale)
    require_kernel_device(q, "q")
    plan = plan_attention(q.shape[1], key_cache.shape[2], [b - a for a, b in zip(qsl, qsl[1:])], lens,
                          num_splits, head_dim=q.shape[2], dtype=q.dtype, block_size=key_cache.shape[1])
    return replace(plan, work=plan.work.to(q.device))


def launch_planned(plan, q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale):
    """``paged_attention`` for arguments already validated by ``validated_plan`` (same shapes): the launches alone."""
    out = torch.empty_like(q)
    if plan.grid[0] == 0:  # no request has new tokens
        return out
    for kernel, grid, args, kwargs in kernel_launches(plan, q, key_cache, value_cache, block_table,
                                                      seq_lens, query_start_loc, scale, out):
        kernel[grid](*args, **kwargs)
    return out


# ----------------------------------------------------------------- references

def dense_attention_ref(q, key, value, query_start_loc, kv_start_loc, scale):
    """Attention on contiguous K/V with PyTorch's ``scaled_dot_product_attention``.

    ``key``/``value`` are ``[total_kv_tokens, num_kv_heads, head_dim]``, request
    ``r``'s keys at rows ``kv_start_loc[r]:kv_start_loc[r + 1]``; its queries
    are the last of them (causal, aligned to the end). Computed in fp32 and
    returned in q's dtype. This is the un-paged baseline the kernel must equal.
    """
    out = torch.empty_like(q)
    group = q.shape[1] // key.shape[1]
    qsl, ksl = [int(x) for x in query_start_loc], [int(x) for x in kv_start_loc]
    for r in range(len(qsl) - 1):
        q_len, kv_len = qsl[r + 1] - qsl[r], ksl[r + 1] - ksl[r]
        if q_len == 0:
            continue
        qr = q[qsl[r]:qsl[r + 1]].float().transpose(0, 1)  # [heads, q_len, dim]
        kr = key[ksl[r]:ksl[r + 1]].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vr = value[ksl[r]:ksl[r + 1]].float().repeat_interleave(group, dim=1).transpose(0, 1)
        # Query i sits at position kv_len - q_len + i and sees keys up to it.
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len)
        o = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=scale)
        out[qsl[r]:qsl[r + 1]] = o.transpose(0, 1).to(q.dtype)
    return out


def paged_attention_ref(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                        *, num_splits=None):
    """The kernel's reference: gather each request's K/V through its table row, then dense attention.

    Same signature and validation as ``paged_attention``; ``num_splits`` is
    accepted and ignored (splitting changes the order of sums, not the result).
    """
    lens, qsl = _validate(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale)
    if num_splits is not None:
        plan_attention(q.shape[1], key_cache.shape[2], [1], [1], num_splits)  # same argument check
    block_size = key_cache.shape[1]
    keys, values, kv_start = [], [], [0]
    for r, n in enumerate(lens):
        ids = block_table[r, : cdiv(n, block_size)].long()
        keys.append(key_cache[ids].flatten(0, 1)[:n])
        values.append(value_cache[ids].flatten(0, 1)[:n])
        kv_start.append(kv_start[-1] + n)
    if not keys:
        return torch.empty_like(q)
    return dense_attention_ref(q, torch.cat(keys), torch.cat(values), qsl, kv_start, scale)


def paginate(keys, values, block_size, num_blocks=None, *, seed=0, unused=-1):
    """Scatter contiguous per-request K/V into a paged cache with shuffled blocks.

    ``keys[r]``/``values[r]`` are ``[seq_len_r, num_kv_heads, head_dim]``.
    Returns ``(key_cache, value_cache, block_table, seq_lens)``: each request's
    blocks are drawn from a seeded permutation of the pool (so neighbours in a
    sequence are rarely neighbours in memory), unused cache slots hold random
    values, and table columns past a request's blocks hold ``unused`` (any
    value: the kernel must never read them). Used by the chapter, the tests,
    the exercise checker and the benchmark to build cases.
    """
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} key tensors but {len(values)} value tensors")
    lens = [int(k.shape[0]) for k in keys]
    need = [cdiv(n, block_size) for n in lens]
    num_blocks = sum(need) + 1 if num_blocks is None else num_blocks
    if num_blocks < sum(need):
        raise ValueError(f"{num_blocks} blocks cannot hold {sum(need)} blocks of K/V")
    g = torch.Generator().manual_seed(seed)
    ref = keys[0]
    shape = (num_blocks, block_size, *ref.shape[1:])
    key_cache = torch.randn(shape, generator=g).to(ref.dtype).to(ref.device)
    value_cache = torch.randn(shape, generator=g).to(ref.dtype).to(ref.device)
    order = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(keys), max(need, default=0) + 1), unused, dtype=torch.int32)
    for r, (k, v) in enumerate(zip(keys, values)):
        ids, order = order[: need[r]], order[need[r]:]
        table[r, : need[r]] = torch.tensor(ids, dtype=torch.int32)
        for j, b in enumerate(ids):
            rows = slice(j * block_size, min((j + 1) * block_size, lens[r]))
            n = rows.stop - rows.start
            key_cache[b, :n] = k[rows]
            value_cache[b, :n] = v[rows]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return key_cache, value_cache, table.to(ref.device), seq_lens.to(ref.device)
