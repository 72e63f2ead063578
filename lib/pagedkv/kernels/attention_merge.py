"""The merge of split-KV: segment partials weighted by their log-sum-exp.

Split-KV (the flash-decoding idea) cuts one query tile's keys into
``num_splits`` segments, one program each (``attention_kernel``). A segment
``i`` ends with its own normalised output ``o_i = acc_i / l_i`` and its
log-sum-exp ``lse_i = m_i + log(l_i)``, which is the log of the softmax
denominator restricted to its keys: ``sum_j exp(s_j) = exp(lse_i)`` over
segment ``i``. The whole row's output weights each partial by its share of
the denominator,

    o = sum_i exp(lse_i - L) o_i / sum_i exp(lse_i - L),   L = max_i lse_i,

subtracting the largest ``lse`` so that no weight overflows. The kernel works
in base 2 (its scores are multiplied by ``scale * log2(e)``), so it stores
``lse2 = lse * log2(e)`` and the weights are ``exp2(lse2_i - max lse2)``: the
same numbers. A segment that saw no key stores ``-inf`` and weighs nothing.

``merge_launch`` is the launch ``attention_kernel.kernel_launches`` appends
after a split launch; ``merge_partials_ref`` is the same merge in PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["merge_launch", "merge_partials_ref"]


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


def merge_launch(partials, lse, out):
    """The merge's launch, ``(kernel, grid, args, kwargs)``: one program per (token, head).

    ``partials`` is fp32 ``[num_splits, num_tokens, num_heads, head_dim]``,
    ``lse`` fp32 ``[num_splits, num_tokens, num_heads]`` in base 2, and
    ``out`` the ``[num_tokens, num_heads, head_dim]`` output it fills.
    """
    splits, num_tokens, num_heads, head_dim = partials.shape
    return (_merge_splits_kernel, (num_tokens * num_heads,),
            (partials, lse, out, num_tokens, num_heads, splits),
            dict(SPLITS_P2=triton.next_power_of_2(splits), HEAD_DIM=head_dim,
                 HEAD_DIM_P2=triton.next_power_of_2(head_dim)))


def merge_partials_ref(partials: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """The merge in PyTorch, in fp32: ``partials`` and base-2 ``lse2`` as the split kernel writes them.

    Returns ``[num_tokens, num_heads, head_dim]``. Every (token, head) needs
    at least one finite ``lse2`` (every query sees at least its own key).
    """
    w = torch.exp2(lse2 - lse2.max(dim=0, keepdim=True).values)
    return (w[..., None] * partials).sum(0) / w.sum(0)[..., None]
