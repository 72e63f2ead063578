"""Chapter 7's split-KV picture: one query row's segments, their partials and the merge.

``split_merge(...)`` runs the paged-attention kernel's split launch on a
real case and keeps, for one (token, head) row, what the merge sees: each
split's keys, its log-sum-exp, its weight in the merge and its partial
output, read from the kernel's own scratch (``kernels.attention.
attention_partials``), beside the merged row and the unsplit kernel's row.
``split_merge_figure`` draws it: the row's scores over the key positions,
cut into the splits' segments, and under them the partials, the merge and
the unsplit output as rows of numbers. ``split_merge_table`` prints the
same figures as text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure

from ..common import cdiv
from ..kernels.attention import (attention_partials, merge_partials_ref, paged_attention,
                                 split_segments, validated_plan)

__all__ = ["SplitMerge", "split_merge", "split_merge_figure", "split_merge_table"]

_PALETTE = ["#2c7fb8", "#41ab5d", "#8856a7", "#e6550d", "#c51b8a", "#636363"]
_EMPTY = "#9e9e9e"


@dataclass(frozen=True)
class SplitMerge:
    """One (token, head) row of a split launch, as the merge sees it (CPU tensors, fp32)."""

    token: int  # the row's token in q
    head: int  # its query head
    request: int  # the request the token belongs to
    position: int  # the token's position in its sequence (its causal limit)
    scores: torch.Tensor  # [position + 1]: scale * q . k for every key it may see
    segments: list[tuple[int, int]]  # each split's keys [lo, hi); lo >= hi: empty
    lse: torch.Tensor  # [num_splits] natural log-sum-exp of each segment (-inf: no key)
    weights: torch.Tensor  # [num_splits] exp(lse_i - max lse), normalised
    partials: torch.Tensor  # [num_splits, head_dim] each split's acc / l
    merged: torch.Tensor  # [head_dim] the weighted sum of the partials (PyTorch)
    kernel: torch.Tensor  # [head_dim] the kernel's output with these splits (its merge kernel)
    unsplit: torch.Tensor  # [head_dim] the kernel's output with one split

    @property
    def num_splits(self) -> int:
        return len(self.segments)


def split_merge(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale, *,
                num_splits: int, token: int = 0, head: int = 0) -> SplitMerge:
    """Run ``paged_attention``'s split launch and keep row (``token``, ``head``) of it."""
    num_tokens, num_heads, _ = q.shape
    for name, value, bound in (("token", token, num_tokens), ("head", head, num_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < bound:
            raise ValueError(f"{name} must be an int from 0 to {bound - 1}, got {value!r}")
    args = (q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale)
    plan = validated_plan(*args, num_splits=num_splits)
    partials, lse2 = attention_partials(*args, num_splits=num_splits)
    partials, lse2 = partials.cpu(), lse2.cpu()
    merged = merge_partials_ref(partials, lse2)[token, head]
    with_splits = paged_attention(*args, num_splits=num_splits)[token, head].float().cpu()
    unsplit = paged_attention(*args, num_splits=1)[token, head].float().cpu()

    qsl = [int(x) for x in query_start_loc.tolist()]
    request = next(r for r in range(len(qsl) - 1) if qsl[r] <= token < qsl[r + 1])
    q_len, seq_len = qsl[request + 1] - qsl[request], int(seq_lens[request])
    q_idx = token - qsl[request]
    position = seq_len - q_len + q_idx
    block_size = key_cache.shape[1]
    ids = block_table[request, : cdiv(seq_len, block_size)].long()
    kv_head = head // (num_heads // key_cache.shape[2])
    keys = key_cache[ids].flatten(0, 1)[: position + 1, kv_head].float().cpu()
    scores = keys @ q[token, head].float().cpu() * scale

    q_tile = q_idx // plan.block_q
    kv_end = seq_len - q_len + min((q_tile + 1) * plan.block_q, q_len)
    lse = lse2[:, token, head] * math.log(2.0)
    weights = torch.exp(lse - lse.max())
    return SplitMerge(token, head, request, position, scores,
                      split_segments(kv_end, num_splits, plan.tile_n), lse, weights / weights.sum(),
                      partials[:, token, head], merged, with_splits, unsplit)


def split_merge_table(sm: SplitMerge) -> str:
    """Each split's keys, the largest score among them, its lse and its weight, one line each."""
    lines = [f"{'split':>5}  {'keys':<11} {'max score':>9} {'lse':>7} {'weight':>7}"]
    for i, (lo, hi) in enumerate(sm.segments):
        hi = min(hi, sm.position + 1)
        if lo >= hi:
            lines.append(f"{i:>5}  {'none':<11} {'-':>9} {'-inf':>7} {0:>7.3f}")
            continue
        top = sm.scores[lo:hi].max().item()
        lines.append(f"{i:>5}  {f'{lo}..{hi - 1}':<11} {top:>9.2f} {sm.lse[i].item():>7.2f} "
                     f"{sm.weights[i].item():>7.3f}")
    return "\n".join(lines)


def split_merge_figure(sm: SplitMerge, dims: int = 8, title: str = "") -> Figure:
    """Top: the row's scores by key position, one colour per split. Bottom: partials, merge, unsplit.

    Each segment is shaded and labelled with its lse and its weight in the
    merge; a split whose segment starts past the row's keys is drawn hatched,
    "no keys". The bottom panel shows the first ``dims`` dimensions of each
    split's partial output, of their weighted sum and of the kernel's unsplit
    output, as numbers on a diverging colour scale.
    """
    n = sm.num_splits
    seg_len = max(hi - lo for lo, hi in sm.segments if hi > lo)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.8, 4.6), height_ratios=[1.15, 1],
                                      constrained_layout=True)
    colour = [_PALETTE[i % len(_PALETTE)] for i in range(n)]
    low, peak = sm.scores.min().item(), sm.scores.max().item()
    label_y = peak + 0.7 * (peak - low)  # the labels sit above the highest score
    for i, (lo, hi) in enumerate(sm.segments):
        hi = min(hi, sm.position + 1)
        if lo >= hi:
            top.axvspan(lo, lo + seg_len, facecolor="none", edgecolor=_EMPTY, hatch="///", lw=0)
            top.text(lo + seg_len / 2, label_y, f"split {i}\nno keys\nweight 0", ha="center", va="top",
                     fontsize=7, color="#424242")
            continue
        pos = torch.arange(lo, hi)
        top.axvspan(lo, hi, color=colour[i], alpha=0.10, lw=0)
        top.scatter(pos, sm.scores[lo:hi], s=3, color=colour[i])
        top.text((lo + hi) / 2, label_y, f"split {i}\nlse {sm.lse[i].item():.2f}\n"
                 f"weight {sm.weights[i].item():.2f}", ha="center", va="top", fontsize=7,
                 color=colour[i])
    lows = [lo for lo, _ in sm.segments]
    top.set_xlim(0, max(lows[-1] + seg_len, sm.position + 1))
    top.set_ylim(low - 0.05 * (peak - low), label_y + 0.03 * (peak - low))
    top.set_xlabel("key position", fontsize=8)
    top.set_ylabel("score", fontsize=8)
    top.tick_params(labelsize=7)
    top.set_title(title or f"token {sm.token}, head {sm.head}: {n} splits of its "
                  f"{sm.position + 1:,} keys", fontsize=9)

    rows = torch.cat([sm.partials[:, :dims], sm.merged[None, :dims], sm.unsplit[None, :dims]])
    labels = [f"split {i}, weight {sm.weights[i].item():.2f}" for i in range(n)]
    labels += ["merged: sum of weight x partial", "the kernel, one split"]
    bound = max(rows.abs().max().item(), 1e-6)
    bottom.imshow(rows.numpy(), cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
    for r in range(rows.shape[0]):
        empty = r < n and sm.weights[r].item() == 0.0
        for c in range(rows.shape[1]):
            text = "-" if empty else f"{rows[r, c].item():.2f}"
            bottom.text(c, r, text, ha="center", va="center", fontsize=6.5,
                        color="white" if abs(rows[r, c].item()) > 0.6 * bound else "black")
    bottom.axhline(n - 0.5, color="black", lw=1.0)
    bottom.set_yticks(range(len(labels)), labels, fontsize=7)
    for tick, c in zip(bottom.get_yticklabels(), colour + ["black", "black"]):
        tick.set_color(c)
    bottom.set_xticks(range(rows.shape[1]), [str(d) for d in range(rows.shape[1])], fontsize=7)
    bottom.set_xlabel(f"output dimension (first {rows.shape[1]})", fontsize=8)
    plt.close(fig)
    return fig
