"""The attention backends, and paged attention for the whole batch at once in PyTorch (the CPU's path).

``attention_backend(name)`` turns the user's ``kernel_backend`` choice into
one object, once: ``TritonBackend`` (the kernels), ``TorchBackend`` (the
batched PyTorch path below) or ``ReferenceBackend`` (the kernels'
references). ``Model.forward`` asks it for a plan once per step and runs
every layer through it; the worker takes the step's gathered block table,
its slot mapping and block copies from the same object.

The reference ``kernels.paged_attention_ref`` gathers and attends request by
request (a Python loop per layer) and expands K/V for grouped-query heads
with ``repeat_interleave``. Here one plan per step, shared by every layer,
turns the ragged batch into rectangles:

* **Keys.** Each request's first ``cols`` table entries (enough for the
  longest sequence) are gathered at once: ``key_cache[block_ids]`` is
  ``[num_reqs, cols * block_size, kv_heads, head_dim]``.
* **Queries.** Tokens are scattered into ``[num_reqs, max_query_len]`` rows
  (a decode-only step is already that shape: one token per request).
* **Mask.** Query ``i`` of request ``r`` sees keys ``0 .. seq_len - q_len + i``
  (causal within the chunk, everything before it): one boolean tensor.
* **Window.** A sliding-window layer's plan (``sliding_window=W``) gathers
  each request's columns from its first query's window on, not from 0, and
  masks keys ``W`` or more before a query: the null block a sliding-window
  group leaves in the columns before is never gathered.

Then one ``scaled_dot_product_attention(..., enable_gqa=True)`` per layer:
the query heads of a group share their KV head without a copy. Padding
queries see key 0 only (never an empty row) and are dropped afterwards;
padding keys are masked. A row's columns past its own blocks are gathered as
its last block again (a column index clamped to the row), so nothing outside
a request's blocks is read: no stale block and no null block. Same numbers as
the reference up to summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..common import check_int

__all__ = ["BatchPlan", "plan_batch", "batched_paged_attention", "StepPlan",
           "AttentionBackend", "TritonBackend", "TorchBackend", "ReferenceBackend", "attention_backend"]


@dataclass
class BatchPlan:
    """What every layer of one step shares (built once by ``plan_batch``)."""

    num_reqs: int
    max_query_len: int
    block_ids: torch.Tensor  # int64 [num_reqs, cols], clamped into the pool
    mask: torch.Tensor  # bool [num_reqs, 1, max_query_len, cols * block_size]
    query_index: torch.Tensor | None  # int64 [num_tokens] into the [num_reqs * max_query_len] rows; None: identity
    write_slots: torch.Tensor  # int64 slots of the tokens that write (slot_mapping >= 0)
    write_index: torch.Tensor | None  # int64 positions of those tokens; None: every token writes


def plan_batch(meta, num_blocks: int, block_size: int, num_tokens: int,
               sliding_window: int | None = None) -> BatchPlan:
    """The step's gather indices, query layout and mask from its ``AttentionMetadata``.

    ``sliding_window``: None for a full-attention layer, else the keys a query sees (itself included).
    """
    seq_lens = meta.seq_lens.long()
    qsl = meta.query_start_loc.long()
    num_reqs = seq_lens.shape[0]
    if qsl.shape != (num_reqs + 1,) or meta.block_table.shape[0] < num_reqs:
        raise ValueError(f"metadata disagree: {num_reqs} seq_lens, {qsl.shape[0]} query_start_loc entries, "
                         f"{meta.block_table.shape[0]} table rows")
    q_lens = qsl[1:] - qsl[:-1]
    if int(qsl[-1]) != num_tokens or bool((q_lens < 0).any()) or bool((q_lens > seq_lens).any()):
        raise ValueError(f"query_start_loc {qsl.tolist()} does not split {num_tokens} tokens into queries "
                         f"no longer than seq_lens {seq_lens.tolist()}")
    max_q = int(q_lens.max()) if num_reqs else 0
    needed = (seq_lens + block_size - 1) // block_size  # columns of each row's blocks
    if num_reqs and int(needed.max()) > meta.block_table.shape[1]:
        raise ValueError(f"seq_lens need {int(needed.max())} table columns, the block table has "
                         f"{meta.block_table.shape[1]}")
    device = seq_lens.device
    first = torch.zeros_like(seq_lens)  # each row's first column read: 0, or its first query's window
    if sliding_window is not None:
        first = (seq_lens - q_lens - check_int(sliding_window, "sliding_window", 1) + 1).clamp(min=0) // block_size
    cols = int((needed - first).max()) if num_reqs else 0
    col = first[:, None] + torch.arange(cols, device=device)[None, :]  # [reqs, cols], past a row's end: clamped
    block_ids = meta.block_table[:num_reqs].long().gather(1, torch.minimum(col, needed[:, None] - 1))
    block_ids = block_ids.clamp(0, num_blocks - 1)
    # Query i of request r sees keys j <= seq_len - q_len + i (padding rows: key 0 only),
    # and with a window j > that - W.
    last = (seq_lens - q_lens)[:, None] + torch.arange(max_q, device=device)[None, :]
    key_pos = (col[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)[:, None, :]
    mask = key_pos <= last.clamp(min=0)[:, :, None]
    if sliding_window is not None:
        mask &= key_pos > last[:, :, None] - sliding_window
    query_index = None
    if max_q != 1 or num_tokens != num_reqs:
        req = torch.repeat_interleave(torch.arange(num_reqs, device=device), q_lens)
        query_index = req * max_q + torch.arange(num_tokens, device=device) - qsl[:-1][req]
    real = meta.slot_mapping >= 0
    all_real = bool(real.all())
    return BatchPlan(num_reqs, max_q, block_ids, mask.unsqueeze(1), query_index,
                     meta.slot_mapping if all_real else meta.slot_mapping[real],
                     None if all_real else real.nonzero().squeeze(1))


def batched_paged_attention(q, key_cache, value_cache, plan: BatchPlan, scale: float) -> torch.Tensor:
    """Attention of ``q [num_tokens, heads, head_dim]`` over the paged cache; same shape out."""
    if plan.num_reqs == 0:
        return torch.empty_like(q)
    num_tokens, heads, dim = q.shape
    keys = key_cache[plan.block_ids].flatten(1, 2).transpose(1, 2)  # [reqs, kv_heads, len, dim]
    values = value_cache[plan.block_ids].flatten(1, 2).transpose(1, 2)
    if plan.query_index is None:  # decode only: one query per request, in request order
        rows = q.unsqueeze(2)  # [reqs, heads, 1, dim]
    else:
        rows = q.new_zeros(plan.num_reqs * plan.max_query_len, heads, dim).index_copy_(0, plan.query_index, q)
        rows = rows.unflatten(0, (plan.num_reqs, plan.max_query_len)).transpose(1, 2)
    out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=plan.mask, scale=scale,
                                         enable_gqa=heads != keys.shape[1])
    out = out.transpose(1, 2).flatten(0, 1)  # [reqs * max_query_len, heads, dim]
    return out if plan.query_index is None else out.index_select(0, plan.query_index)


# ------------------------------------------------------------------ backends
@dataclass
class StepPlan:
    """What ``AttentionBackend.build`` hands every layer of one step."""

    meta: object  # the step's AttentionMetadata (of the layers' KV-cache group)
    scale: float
    sliding_window: int | None = None  # the layers' window; None: full attention
    attention: object = None  # the backend's own plan (kernels.attention.AttentionPlan, or a BatchPlan)


class AttentionBackend:
    """How the model writes and reads the paged cache: chosen once, by ``attention_backend(name)``.

    * ``build(meta, key_cache, value_cache, q_shape, scale, sliding_window=None)
      -> plan``, once per step and KV-cache group, before the first layer:
      checks the metadata (slot range and uniqueness, block ids, lengths) and
      plans what the group's layers share, their window included;
    * ``forward(plan, key_cache, value_cache, q, k, v) -> out``, every layer:
      writes this step's K/V into their slots (``reshape_and_cache``), then
      attends through the block table (``paged_attention``), with no further
      check and no host round trip;
    * ``prepare_attn(block_tables, idx_mapping, query_start_loc, positions)``
      and ``copy_blocks(kv_caches, block_pairs)``: what the worker gathers the
      step's block tables, computes the slot mapping and copies with, from the
      same family of kernels.
    """

    name = ""

    def __init__(self, kernels) -> None:
        self.kernels = kernels  # the pagedkv.kernels package (loaded on first use: it imports Triton)

    def build(self, meta, key_cache, value_cache, q_shape, scale: float, sliding_window=None) -> StepPlan:
        raise NotImplementedError

    def forward(self, plan: StepPlan, key_cache, value_cache, q, k, v) -> torch.Tensor:
        raise NotImplementedError

    #: Whether ``prepare_attn`` gathers and maps slots with the kernels' PyTorch references.
    reference_block_tables = True

    def prepare_attn(self, block_tables, idx_mapping, query_start_loc, positions):
        """The step's gathered block tables and slot mappings, as Model Runner V2's ``prepare_attn`` builds them.

        ``block_tables`` is the worker's ``pagedkv.block_tables.BlockTables``;
        batch entry ``i`` is the request at row ``idx_mapping[i]`` and owns
        tokens ``query_start_loc[i]:query_start_loc[i+1]`` at ``positions``.
        Returns ``(tables, slot_mappings)``: one ``[num_reqs, width]`` table
        per KV-cache group, and ``[num_groups, num_tokens]`` slots read from
        those tables. The Triton backend runs the kernels; the others their
        PyTorch references (Triton's interpreter would cost a CPU step more
        than the step itself). A position beyond its row's blocks is refused
        (``ValueError``) before any slot is computed.
        """
        ref = self.reference_block_tables
        tables = block_tables.gather_block_tables(idx_mapping, reference=ref)
        return tables, block_tables.compute_slot_mappings(idx_mapping, query_start_loc, positions, reference=ref)

    def copy_blocks(self, kv_caches, block_pairs) -> None:
        """Copy-on-write copies, every layer, by the PyTorch reference (the Triton backend launches the kernel)."""
        self.kernels.copy_blocks_ref(kv_caches, block_pairs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class TritonBackend(AttentionBackend):
    """The Triton kernels of chapters 5-7: compiled on a GPU, interpreted on a CPU."""

    name = "triton"

    def build(self, meta, key_cache, value_cache, q_shape, scale: float, sliding_window=None) -> StepPlan:
        self.kernels.kv_write.check_slot_mapping(meta.slot_mapping, q_shape[0], key_cache)
        # validated_plan reads q's shape, dtype and device only: an empty tensor stands in.
        q = torch.empty(q_shape, dtype=key_cache.dtype, device=key_cache.device)
        attention = self.kernels.attention.validated_plan(q, key_cache, value_cache, meta.block_table,
                                                          meta.seq_lens, meta.query_start_loc, scale,
                                                          sliding_window=sliding_window)
        return StepPlan(meta, scale, sliding_window, attention)  # the plan carries the window to the launch

    def forward(self, plan: StepPlan, key_cache, value_cache, q, k, v) -> torch.Tensor:
        m = plan.meta  # the kernels take dense tensors
        self.kernels.kv_write.launch_reshape_and_cache(k.contiguous(), v.contiguous(), key_cache, value_cache,
                                                       m.slot_mapping)
        return self.kernels.attention.launch_planned(plan.attention, q.contiguous(), key_cache, value_cache,
                                                     m.block_table, m.seq_lens, m.query_start_loc, plan.scale)

    reference_block_tables = False

    def copy_blocks(self, kv_caches, block_pairs) -> None:
        self.kernels.copy_blocks(kv_caches, block_pairs)


class TorchBackend(AttentionBackend):
    """The whole batch at once in PyTorch (this module's plan): the CPU's path."""

    name = "torch"

    def build(self, meta, key_cache, value_cache, q_shape, scale: float, sliding_window=None) -> StepPlan:
        self.kernels.kv_write.check_slot_mapping(meta.slot_mapping, q_shape[0], key_cache)
        return StepPlan(meta, scale, sliding_window,
                        plan_batch(meta, key_cache.shape[0], key_cache.shape[1], q_shape[0], sliding_window))

    def forward(self, plan: StepPlan, key_cache, value_cache, q, k, v) -> torch.Tensor:
        batch = plan.attention
        if batch.write_index is not None:  # padding tokens write nothing
            k, v = k.index_select(0, batch.write_index), v.index_select(0, batch.write_index)
        heads, dim = k.shape[1:]  # this step's K/V into their slots (strided views welcome)
        key_cache.view(-1, heads, dim).index_copy_(0, batch.write_slots, k)
        value_cache.view(-1, heads, dim).index_copy_(0, batch.write_slots, v)
        return batched_paged_attention(q, key_cache, value_cache, batch, plan.scale)


class ReferenceBackend(AttentionBackend):
    """The kernels' PyTorch references, request by request, each call checked: what the others are tested against."""

    name = "torch-ref"

    def build(self, meta, key_cache, value_cache, q_shape, scale: float, sliding_window=None) -> StepPlan:
        return StepPlan(meta, scale, sliding_window)  # every layer's reference call checks its own arguments

    def forward(self, plan: StepPlan, key_cache, value_cache, q, k, v) -> torch.Tensor:
        m = plan.meta
        self.kernels.reshape_and_cache_ref(k.contiguous(), v.contiguous(), key_cache, value_cache, m.slot_mapping)
        return self.kernels.paged_attention_ref(q.contiguous(), key_cache, value_cache, m.block_table, m.seq_lens,
                                                m.query_start_loc, plan.scale, sliding_window=plan.sliding_window)


_BACKENDS = {b.name: b for b in (TritonBackend, TorchBackend, ReferenceBackend)}


def attention_backend(kernel_backend: "str | AttentionBackend") -> AttentionBackend:
    """The backend a ``kernel_backend`` name chooses ("triton", "torch", "torch-ref"); a backend passes through."""
    if isinstance(kernel_backend, AttentionBackend):
        return kernel_backend
    if kernel_backend not in _BACKENDS:
        raise ValueError(f"kernel_backend must be 'triton', 'torch' or 'torch-ref', got {kernel_backend!r}")
    from .. import kernels  # here, not at the top: it loads Triton, which pagedkv.model's config users never need
    from ..kernels import attention, kv_write  # noqa: F401  -- kernels.attention, kernels.kv_write

    return _BACKENDS[kernel_backend](kernels)
