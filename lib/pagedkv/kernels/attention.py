"""Paged attention: one varlen kernel that reads K/V through the block table.

This is the consumer of everything the earlier chapters build. The library
keeps it in four modules, one concept each, which chapter 7 prints in turn:

* ``attention_plan``: the plan of one launch, on the host: the step's work
  list of (request, query tile) pairs, the tile sizes, the grid and the
  split-KV count;
* ``attention_kernel``: the Triton kernel (one program per query tile, KV
  head and split; the gather through the block table, the online softmax,
  the causal mask) and ``kernel_launches``, a plan turned into launches;
* ``attention_merge``: split-KV's merge of segment partials by their
  log-sum-exp;
* this module: the entry points (``paged_attention``, ``validated_plan``,
  ``launch_planned``), the argument checks they run before any launch, and
  the references the kernel must equal (``paged_attention_ref``,
  ``dense_attention_ref``), with ``paginate`` to build cases.

Every wrapper validates before launching (see ``pagedkv.kernels``): a block id
out of range is an ``IndexError`` naming the request and the column. Table
columns past a request's ``seq_len`` are never read, so they may hold
anything, as in vLLM. With ``sliding_window=W`` (a sliding-window layer)
query ``p`` sees keys ``p - W + 1 .. p``, and the columns wholly before the
first query's window are never read either: a sliding-window group puts the
null block there in place of the blocks it has released. The names of the other three modules are re-exported
here.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .._device import require_kernel_device
from ..common import cdiv, check_int
from .attention_kernel import kernel_launches
from .attention_merge import merge_partials_ref
from .attention_plan import AttentionPlan, plan_attention, split_segments, work_list
from .residency import SM_LIMITS, SMLimits, choose_splits, resident_programs, split_rule
from .tensor_checks import check_tensor_args

__all__ = [
    "paged_attention",
    "paged_attention_ref",
    "dense_attention_ref",
    "attention_partials",
    "AttentionPlan",
    "plan_attention",
    "work_list",
    "split_segments",
    "merge_partials_ref",
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
    "first_columns",
]

ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Every multiple of 8 from 16 to 256. A power of two is the kernel's own tile
# width; any other (80, 96, 112: Phi-2, Phi-3, ...) is padded to the next power
# of two with the extra dimensions masked, as vLLM pads to HEAD_SIZE_PADDED.
# A multiple of 8 keeps a row of 2-byte K/V in whole 16-byte copies.
HEAD_DIMS = tuple(range(16, 257, 8))


# ----------------------------------------------------------------- validation

def _validate(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale, sliding_window=None):
    """Check everything the kernel trusts; return host copies of the metadata.

    Returns ``(seq_lens, query_start_loc)`` as Python lists (the launch needs the
    longest query to size the grid). First the tensors' shapes and dtypes, then
    the metadata's values: the lengths and every block id a request will read.
    """
    _validate_tensors(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale)
    if sliding_window is not None:
        check_int(sliding_window, "sliding_window", 1)
    return _validate_metadata(q.shape[0], key_cache.shape, block_table, seq_lens, query_start_loc,
                              sliding_window)


def first_columns(seq_lens, q_lens, block_size: int, sliding_window: int | None) -> list[int]:
    """Each request's first table column that attention reads: 0, or with a window the
    column of its first query's first key, ``max(0, seq_len - q_len - W + 1) // block_size``."""
    if sliding_window is None:
        return [0] * len(seq_lens)
    return [max(0, n - q - sliding_window + 1) // block_size for n, q in zip(seq_lens, q_lens)]


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


def _validate_metadata(num_tokens, cache_shape, block_table, seq_lens, query_start_loc, sliding_window=None):
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
        first = first_columns(lens, [b - a for a, b in zip(qsl, qsl[1:])], block_size, sliding_window)
        cols = torch.arange(block_table.shape[1], device=block_table.device)
        used = cols[None, :] < torch.tensor(needed, device=block_table.device)[:, None]
        if sliding_window is not None:
            used &= cols[None, :] >= torch.tensor(first, device=block_table.device)[:, None]
        bad = used & ((block_table < 0) | (block_table >= num_blocks))
        if bool(bad.any()):
            r, c = (int(x) for x in bad.nonzero()[0])
            raise IndexError(f"block_table[{r}, {c}] = {int(block_table[r, c])} is not a block of the "
                             f"cache (0..{num_blocks - 1}); request {r} reads column {c} "
                             f"for positions {c * block_size}..{min((c + 1) * block_size, lens[r]) - 1}")
    return lens, qsl


# ----------------------------------------------------------------- entry points

def paged_attention(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                    *, num_splits=None, sliding_window=None):
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
        sliding_window: ``None`` (full attention) or ``W >= 1``: query ``p``
            sees keys ``p - W + 1 .. p``; row ``r``'s columns before
            ``first_columns(...)[r]`` are never read (they may hold the null
            block or anything else).

    Returns a tensor with q's shape, dtype and device. Raises ``TypeError``,
    ``ValueError`` or ``IndexError`` naming the bad value before any launch.
    """
    plan = validated_plan(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                          num_splits=num_splits, sliding_window=sliding_window)
    return launch_planned(plan, q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale)


def validated_plan(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                   *, num_splits=None, sliding_window=None) -> AttentionPlan:
    """Validate one layer's call and plan its launch, without launching.

    A model step calls attention once per layer with the same metadata and
    caches of the same shape (``Model.allocate_kv_cache`` makes them so), so
    one validation and one plan hold for every layer; ``launch_planned``
    then launches each layer without the host round trips validation costs.
    The plan carries ``sliding_window``, so the launch applies it.
    """
    lens, qsl = _validate(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                          sliding_window)
    require_kernel_device(q, "q")
    plan = plan_attention(q.shape[1], key_cache.shape[2], [b - a for a, b in zip(qsl, qsl[1:])], lens,
                          num_splits, head_dim=q.shape[2], dtype=q.dtype, block_size=key_cache.shape[1],
                          sliding_window=sliding_window)
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


def attention_partials(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                       *, num_splits, sliding_window=None):
    """What the split kernel writes before the merge: ``(partials, lse2)``, both fp32.

    ``partials`` is ``[num_splits, num_tokens, num_heads, head_dim]``, each
    split's normalised output ``acc / l`` over its segment of the keys;
    ``lse2`` is ``[num_splits, num_tokens, num_heads]``, each segment's
    log-sum-exp in base 2 (``-inf`` for a segment that saw no key). The same
    validation and plan as ``paged_attention(..., num_splits=num_splits)``,
    whose merge of these tensors is its output; ``num_splits`` must be 2 or
    more. For pictures and tests: a step never needs them.
    """
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 2:
        raise ValueError(f"num_splits must be an int of at least 2 (there is nothing to merge "
                         f"otherwise), got {num_splits!r}")
    plan = validated_plan(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                          num_splits=num_splits, sliding_window=sliding_window)
    if plan.grid[0] == 0:
        raise ValueError("no request has new tokens: there are no partials")
    out = torch.empty_like(q)
    (kernel, grid, args, kwargs), _merge = kernel_launches(plan, q, key_cache, value_cache, block_table,
                                                           seq_lens, query_start_loc, scale, out)
    kernel[grid](*args, **kwargs)
    return args[7], args[8]  # the kernel's out_ptr and lse_ptr: the split scratch


# ----------------------------------------------------------------- references

def dense_attention_ref(q, key, value, query_start_loc, kv_start_loc, scale, sliding_window=None):
    """Attention on contiguous K/V with PyTorch's ``scaled_dot_product_attention``.

    ``key``/``value`` are ``[total_kv_tokens, num_kv_heads, head_dim]``, request
    ``r``'s keys at rows ``kv_start_loc[r]:kv_start_loc[r + 1]``; its queries
    are the last of them (causal, aligned to the end). With
    ``sliding_window=W`` query ``i`` also sees no key ``W`` or more before
    itself. Computed in fp32 and returned in q's dtype. This is the un-paged
    baseline the kernel must equal.
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
        if sliding_window is not None:  # and keys j > i + kv_len - q_len - W
            mask = mask.triu(kv_len - q_len - sliding_window + 1)
        o = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=scale)
        out[qsl[r]:qsl[r + 1]] = o.transpose(0, 1).to(q.dtype)
    return out


def paged_attention_ref(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                        *, num_splits=None, sliding_window=None):
    """The kernel's reference: gather each request's K/V through its table row, then dense attention.

    Same signature and validation as ``paged_attention``; ``num_splits`` is
    accepted and ignored (splitting changes the order of sums, not the result).
    With a window, the gather starts at the request's first column read
    (``first_columns``), so the null block before it is never touched either.
    """
    lens, qsl = _validate(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                          sliding_window)
    if num_splits is not None:
        plan_attention(q.shape[1], key_cache.shape[2], [1], [1], num_splits)  # same argument check
    block_size = key_cache.shape[1]
    first = first_columns(lens, [b - a for a, b in zip(qsl, qsl[1:])], block_size, sliding_window)
    keys, values, kv_start = [], [], [0]
    for r, n in enumerate(lens):
        ids = block_table[r, first[r]: cdiv(n, block_size)].long()
        n -= first[r] * block_size  # the keys from the first column read on: the same mask, shifted
        keys.append(key_cache[ids].flatten(0, 1)[:n])
        values.append(value_cache[ids].flatten(0, 1)[:n])
        kv_start.append(kv_start[-1] + n)
    if not keys:
        return torch.empty_like(q)
    return dense_attention_ref(q, torch.cat(keys), torch.cat(values), qsl, kv_start, scale, sliding_window)


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
