"""The paged-attention kernel: one program per (query tile, KV head, KV split).

A step's scheduled tokens arrive concatenated, request after request
(``query_start_loc`` says where each request's tokens start). Request ``r``
has ``seq_lens[r]`` tokens in the cache after this step's KV write; its
``q_len`` new tokens are the *last* ``q_len`` of them, so a decode token
(``q_len == 1``) and a prefill chunk after a prefix hit are the same case:
query ``i`` sits at position ``ctx_len + i`` (``ctx_len = seq_len - q_len``)
and may see keys ``0 .. ctx_len + i``. One launch serves any mix.

What one program does (``attention_plan`` chooses the shapes):

* it reads its (request, query tile) pair from the step's *work list*;
* its tile holds ``BLOCK_Q`` tokens x the ``GROUP`` query heads that share
  the KV head, ``BLOCK_M = BLOCK_Q * GROUP`` rows: one K/V load serves the
  whole group (grouped-query attention);
* it walks the keys it may see in tiles of ``TILE_N`` positions. For each
  position it loads the block id from the table
  (``block_table[r, pos // block_size]``) and reads row ``pos % block_size``
  of that block: the tile size is independent of the block size, which is
  why block size 1 (SGLang's token-level table) and 128 use the same kernel;
* scores, an online softmax in fp32 and base 2 (running max ``m``, running
  sum ``l``, rescaled accumulator), and the causal mask;
* with a sliding window ``W`` (``SLIDING``), query ``p`` sees keys
  ``p - W + 1 .. p`` only: the walk starts at the tile's first query's
  window, ``ctx_len + first - W + 1``, so the table columns before it are
  never read. A sliding-window group puts the null block there in place of
  the blocks it released (they may hold anything, another group's data
  included); the ids from that column on are the request's own blocks,
  since a request keeps every block from its first query's window on;
* without splits it stores ``acc / l``; with splits, its segment's partial
  and log-sum-exp, which ``attention_merge`` combines.

head_dim may be any multiple of 8 from 16 to 256: ``HEAD_DIM_P2`` is the next
power of two (``tl.arange`` needs one) and the dimensions past ``HEAD_DIM``
are masked on every load and store.

The K/V loads can overlap the compute: a tile's block ids are read one
iteration ahead, so the compiler's pipeliner may copy later K/V tiles while
one computes. How many it keeps in flight depends on the configuration
(``tools/compile_check.py`` counts the buffers in the compiled loop: two for
decode and split at three stages, which the check requires of 2-byte types;
one for the fp32 configurations with two stages, every fp32 prefill among
them, so no tile is loaded ahead there; three for 2-byte prefill up to
head_dim 128 on sm_90, two on sm_80). These are predictions of the compiler,
not measurements.

Versions: compiled, the kernel needs triton >= 3.6. Interpreted, Triton 3.6
needs numpy < 2.4 (its interpreter turns the loop bounds, one-element arrays,
into ints in a way numpy 2.4 refuses); Triton 3.7 has no such limit.

The kernel trusts its arguments: ``attention.validated_plan`` checks them
first. Table columns past a request's ``seq_len`` are never read, so they
may hold anything; with a window, neither are those before it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._device import INTERPRETED
from .attention_merge import merge_launch

__all__ = ["kernel_launches"]


# The integers that change from step to step are not specialised (Triton would
# compile a kernel for 1, for multiples of 16 and for the rest): a serving run
# compiles one kernel per configuration, whatever its batch or split count.
@triton.jit(do_not_specialize=["num_tokens", "max_blocks", "num_splits", "sliding_window"])
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
    sliding_window,  # SLIDING only: keys a query sees, itself included
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block: a constant divisor, no emulated division
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,  # the model's head_dim (a multiple of 8)
    HEAD_DIM_P2: tl.constexpr,  # HEAD_DIM rounded up to a power of two; dims past HEAD_DIM are masked
    BLOCK_M: tl.constexpr,  # rows of a query tile (power of two >= 16)
    BLOCK_Q: tl.constexpr,  # query tokens of a tile: BLOCK_M // GROUP
    TILE_N: tl.constexpr,  # key positions per inner iteration
    SPLIT: tl.constexpr,  # num_splits > 1: write partials and lse for the merge
    FP32_DOT: tl.constexpr,  # dot in fp32 (interpreter, or fp32 inputs)
    SLIDING: tl.constexpr,  # a sliding-window layer: older keys masked
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
    if SLIDING:  # keys before the first query's window: no row sees them, none is read
        kv_start = tl.maximum(ctx_len + q_tile * BLOCK_Q - sliding_window + 1, 0)
        seg = tl.cdiv(tl.cdiv(kv_end - kv_start, num_splits), TILE_N) * TILE_N
        kv_lo = kv_start + split * seg
    else:
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
        if SLIDING:
            visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
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


def kernel_launches(plan, q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale, out,
                    *, interpreted: bool = INTERPRETED):
    """The launches of one planned call: ``[(kernel, grid, args, kwargs), ...]``, in order.

    ``plan`` is an ``attention_plan.AttentionPlan``. ``attention.launch_planned``
    runs exactly these; ``tools/compile_check.py`` compiles them ahead of time
    with Triton's own argument binder, so the check sees the specialisation a
    real launch gets (``interpreted=False``: the arguments of a compiled
    launch). Split-KV's fp32 scratch is allocated here, and a split launch is
    followed by the merge (``attention_merge.merge_launch``).
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
         float(scale) * math.log2(math.e), num_tokens, num_heads, num_kv_heads, block_table.shape[1], splits,
         plan.sliding_window or 0),
        dict(BLOCK_SIZE=block_size, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
             HEAD_DIM_P2=triton.next_power_of_2(head_dim), BLOCK_M=plan.block_m,
             BLOCK_Q=plan.block_q, TILE_N=plan.tile_n, SPLIT=splits > 1, FP32_DOT=fp32_dot,
             SLIDING=plan.sliding_window is not None, num_warps=plan.num_warps, num_stages=plan.num_stages),
    )]
    if splits > 1:
        launches.append(merge_launch(part, lse, out))
    return launches
