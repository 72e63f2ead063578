"""Static matplotlib pictures for the chapters: the chapter shows the call.

Each function draws one picture and returns its ``Figure``, already closed
with ``pyplot.close`` so that a notebook shows it once: as the value of the
cell's last expression (Jupyter renders a ``Figure`` as a PNG). Sizes fit the
book's 688-pixel column; text is 8-9 pt.

- ``block_table_figure``: a worker-side ``BlockTable`` as a grid of block ids
  (chapter 4);
- ``pool_snapshot`` and ``pool_history_figure``: the pages of a
  ``sim.paged_kv.PagedKV``, step by step, with owners and pins (chapter 6);
- ``attention_grid_figure``: the paged-attention launch grid and its tiles
  (chapter 7);
- ``kv_usage_figure``: KV usage over engine steps with preemptions and
  resumes marked, from one or more ``engine.stats.StepHistory`` (chapter 8).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from ..common import cdiv

__all__ = ["allocation_layout", "attention_grid_figure", "block_table_figure",
           "kv_usage_figure", "pool_history_figure", "pool_snapshot"]

_EMPTY = "#eeeeee"


def block_table_figure(table, row_names: Mapping[int, str],
                       title: str) -> Figure:
    """The staged rows of ``table`` (a ``BlockTable``) as a grid.

    One row per table row, one cell per column; a live cell (column below the
    row's ``num_blocks_per_row``) shows its block id in the colour of the
    request named by ``row_names[row]``; cells past a row's length are grey.
    A request keeps its colour from one picture to the next (it is chosen by
    the name's first character: ``a`` is the first colour of ``tab10``, ``b``
    the second, ...). Rows missing from ``row_names`` are labelled ``-``.
    """
    rows, cols = table.np.shape
    palette = plt.get_cmap("tab10")
    colour_of = {name: palette((ord(name[:1] or "a") - ord("a")) % 10)
                 for name in row_names.values()}
    fig, ax = plt.subplots(figsize=(min(1.0 + 0.7 * cols, 9.0),
                                    0.8 + 0.5 * rows))
    for r in range(rows):
        n = int(table.num_blocks_per_row[r])
        for c in range(cols):
            live = c < n and r in row_names
            colour = colour_of[row_names[r]] if live else _EMPTY
            ax.add_patch(plt.Rectangle(
                (c, r), 1, 1, facecolor=colour, alpha=0.55 if live else 1.0,
                edgecolor="white", linewidth=2))
            if c < n:
                ax.text(c + 0.5, r + 0.5, str(table.np[r, c]),
                        ha="center", va="center", fontsize=9)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_xticks(np.arange(cols) + 0.5, [str(c) for c in range(cols)])
    ax.set_yticks(np.arange(rows) + 0.5,
                  [f"row {r}: {row_names.get(r, '-')}" for r in range(rows)])
    ax.set_xlabel("logical block (column)")
    ax.set_title(title)
    fig.tight_layout()
    plt.close(fig)
    return fig


def pool_snapshot(pool) -> dict[int, tuple[list[int], set[str], set[str]]]:
    """Each allocated page of a ``PagedKV``: ``(tokens, owners, pins)``."""
    return {page: (list(tokens), set(pool.owners[page]), set(pool.pins[page]))
            for page, tokens in pool.pages.items()}


_STATE_COLOURS = {"owned": "#8fc1e3", "owned + pinned": "#f5b971",
                  "pinned only": "#e8836f", "free": _EMPTY}


def _state(page: int, pages) -> str:
    if page not in pages:
        return "free"
    _, owners, pins = pages[page]
    if owners and pins:
        return "owned + pinned"
    return "owned" if owners else "pinned only"


def pool_history_figure(history: Sequence[tuple[str, Mapping]],
                        num_pages: int, title: str) -> Figure:
    """One row per step of ``history``: ``(label, pool_snapshot(pool))`` pairs.

    Each page is a cell coloured by its state (owned, owned and pinned, pinned
    only, free) and labelled ``tokens`` over ``owners | pins``.
    """
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(history) + 0.6))
    for row, (_, pages) in enumerate(history):
        for page in range(num_pages):
            state = _state(page, pages)
            ax.add_patch(plt.Rectangle((page, -row - 0.9), 0.95, 0.8,
                                       color=_STATE_COLOURS[state]))
            if state == "free":
                text = "free"
            else:
                tokens, owners, pins = pages[page]
                text = (f"{tokens}\n{','.join(sorted(owners)) or '-'}"
                        f" | {','.join(sorted(pins)) or '-'}")
            ax.text(page + 0.475, -row - 0.5, text,
                    ha="center", va="center", fontsize=8)
    ax.set_xlim(0, num_pages)
    ax.set_ylim(-len(history), 0)
    ax.set_xticks([p + 0.475 for p in range(num_pages)],
                  [f"page {p}" for p in range(num_pages)])
    ax.set_yticks([-r - 0.5 for r in range(len(history))],
                  [label for label, _ in history])
    ax.set_title(title)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c)
                       for c in _STATE_COLOURS.values()],
              labels=list(_STATE_COLOURS), loc="upper center",
              bbox_to_anchor=(0.5, -0.08), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    plt.close(fig)
    return fig


_RANGES = (("c", "comp", "computed before this step"),
           ("h", "new_comp", "prefix-cache hit: touched, not computed"),
           ("n", "new", "computed this step"),
           ("l", "lookahead", "slots past this step, never cached"))


def allocation_layout(comp: int, new_comp: int, new: int, lookahead: int,
                      block_size: int) -> str:
    """``allocate_slots``' token ranges as text, block by block.

    The ranges are vLLM's (``comp | new_comp | new | lookahead``, in that
    order from position 0). Each block is drawn as 8 characters (one per
    ``block_size // 8`` tokens, or one per token for blocks under 8 tokens);
    a character shows the range of the last token it covers, ``.`` marks
    slots past the last token, and ``|`` ends a block. A legend and the
    block count follow.
    """
    sizes = (comp, new_comp, new, lookahead)
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0
           for n in sizes) or sum(sizes) == 0:
        raise ValueError(f"token counts must be ints >= 0, not all 0: {sizes}")
    total = sum(sizes)
    num_blocks = cdiv(total, block_size)
    per_char = max(1, block_size // 8)
    bounds = np.cumsum(sizes)

    def letter(first: int) -> str:
        if first >= total:
            return "."
        last = min(first + per_char, total) - 1
        return _RANGES[int(np.searchsorted(bounds, last, side="right"))][0]

    cells = [["".join(letter(b * block_size + i)
                      for i in range(0, block_size, per_char))]
             for b in range(num_blocks)]
    bar = "".join(c[0] + "|" for c in cells)
    width = len(bar) // num_blocks
    header = "".join(f"{b:<{width}}" for b in range(num_blocks)).rstrip()
    lines = [f"block   {header}", f"tokens  {bar}"]
    lines += [f"  {key} {name:<10}{n:>6}  {what}"
              for (key, name, what), n in zip(_RANGES, sizes)]
    lines.append(f"  (one character = {per_char} token{'s' * (per_char > 1)};"
                 f" {total} tokens -> {num_blocks} blocks of {block_size})")
    return "\n".join(lines)


def attention_grid_figure(plan, q_lens: Sequence[int], seq_lens: Sequence[int],
                          group: int, title: str = "", request: int | None = None) -> Figure:
    """One KV head's slice of a paged-attention launch, and one tile's rows.

    Left: the programs of ``plan`` (an ``AttentionPlan``) for KV head 0 and
    split 0, one box per entry of the step's work list (``program_id(0)``),
    coloured by request and labelled with the request's new tokens it
    computes. Right: the first query tile of ``request`` (default: the
    request with the longest sequence), outlined on the left. Its rows are
    query token ``r // group`` times query head ``r % group``, each labelled
    with its position in the sequence; rows past the request's new tokens
    are padding, masked. Beside them, the key tiles it walks in steps of
    ``plan.tile_n``, up to its causal limit.
    """
    if len(q_lens) != len(seq_lens) or list(plan.work_items()) != [
            (r, t) for r, n in enumerate(q_lens) for t in range(cdiv(n, plan.block_q))]:
        raise ValueError(f"q_lens {list(q_lens)} and seq_lens {list(seq_lens)} are not the batch "
                         f"this plan was made for (work list {plan.work_items()})")
    if request is None:
        request = max(range(len(seq_lens)), key=lambda r: seq_lens[r])
    if isinstance(request, bool) or not isinstance(request, int) or not 0 <= request < len(q_lens):
        raise ValueError(f"request must be an int from 0 to {len(q_lens) - 1}, got {request!r}")
    if q_lens[request] == 0:
        raise ValueError(f"request {request} has no new tokens this step: it has no tile to show")
    fig, (grid_ax, tile_ax) = plt.subplots(1, 2, figsize=(6.8, 3.0), width_ratios=[1.25, 1],
                                           constrained_layout=True)
    work = plan.work_items()
    palette = ["#2c7fb8", "#41ab5d", "#8856a7", "#e6550d", "#636363"]
    for i, (r, t) in enumerate(work):
        lo = t * plan.block_q
        top = len(work) - 1 - i
        grid_ax.add_patch(plt.Rectangle((0, top), 0.96, 0.9, color=palette[r % len(palette)]))
        grid_ax.text(0.48, top + 0.45, f"request {r}: tokens {lo}..{min(q_lens[r], lo + plan.block_q) - 1}",
                     ha="center", va="center", fontsize=7, color="white")
        if (r, t) == (request, 0):
            grid_ax.add_patch(plt.Rectangle((0, top), 0.96, 0.9, fill=False, lw=2, edgecolor="#d7191c"))
    grid_ax.set(xlim=(0, 1), ylim=(0, len(work)), xticks=[], ylabel="program_id(0): work item")
    grid_ax.set_title(title or f"grid {plan.grid} (KV head 0)", fontsize=9)
    grid_ax.set_yticks([len(work) - 0.55 - i for i in range(len(work))], [str(i) for i in range(len(work))],
                       fontsize=7)
    q_len, ctx = q_lens[request], seq_lens[request] - q_lens[request]
    rows = min(plan.block_m, 16)
    tokens = np.array([r // group for r in range(rows)])
    live = tokens < min(q_len, plan.block_q)
    shade = np.where(live, tokens, -1)[:, None]
    tile_ax.imshow(shade, aspect="auto", cmap="Blues", vmin=-1, vmax=max(1, tokens.max() + 1),
                   extent=(0, 1, rows, 0))
    for r in range(rows):
        label = f"pos {ctx + tokens[r]}, head {r % group}" if live[r] else "padding (masked)"
        tile_ax.text(0.5, r + 0.5, label, ha="center", va="center", fontsize=6.5,
                     color="black" if live[r] else "#555555")
    kv_end = ctx + min(plan.block_q, q_len)  # the tile's causal limit
    steps = max(1, cdiv(kv_end, plan.tile_n))
    for j in range(min(steps, 4)):
        lo, hi = j * plan.tile_n, min((j + 1) * plan.tile_n, kv_end) - 1
        tile_ax.add_patch(plt.Rectangle((1.15 + j * 0.45, 0), 0.4, rows, color="#fdae61"))
        tile_ax.text(1.35 + j * 0.45, rows / 2, f"keys {lo}..{hi}", rotation=90,
                     ha="center", va="center", fontsize=7)
    shown = "" if rows == plan.block_m else f" (first {rows} of {plan.block_m})"
    tile_ax.set(xlim=(0, 1.15 + min(steps, 4) * 0.45), ylim=(rows, 0), xticks=[],
                ylabel=f"row of the tile{shown}")
    tile_ax.set_title(f"request {request}'s tile 0: {plan.tile_n} keys a step", fontsize=9)
    tile_ax.tick_params(labelsize=7)
    plt.close(fig)
    return fig


def kv_usage_figure(history, labels: Sequence[str] | None = None, title: str = "KV cache usage",
                    mark: bool | str = True) -> Figure:
    """KV usage (%) against engine step, one line per run, preemptions and resumes marked.

    Args:
        history: a ``pagedkv.engine.stats.StepHistory``, or a sequence of them
            (one line each: a sweep over concurrency, block sizes, ...).
        labels: one legend label per history (default ``run 1``, ``run 2``, ...).
        title: the axes title.
        mark: mark the first preemption (red triangle) and the first resume
            (green circle) of each run, with the step number beside it;
            ``"all"``: mark every preemption and every resume, unlabelled (a
            key says which is which); ``False``: no marks.
    """
    if mark not in (True, False, "all"):
        raise ValueError(f"mark must be True, False or 'all', got {mark!r}")
    runs = [history] if hasattr(history, "records") else list(history)
    if not runs:
        raise ValueError("history must hold at least one StepHistory, got an empty sequence")
    labels = list(labels) if labels is not None else [f"run {i + 1}" for i in range(len(runs))]
    if len(labels) != len(runs):
        raise ValueError(f"labels must have one entry per history ({len(runs)}), got {len(labels)}")
    fig, ax = plt.subplots(figsize=(6.8, 3.0), constrained_layout=True)
    for run, label in zip(runs, labels):
        line, = ax.plot(run.steps, [u * 100 for u in run.usage], label=label, lw=1.2)
        if not mark:
            continue
        usage = dict(zip(run.steps, run.usage))
        if mark == "all":
            for kind, marker, colour in (("preempted", "v", "#d7191c"), ("resumed", "o", "#1a9641")):
                steps = [step for step, k, _ in run.events() if k == kind]
                ax.plot(steps, [usage[s] * 100 for s in steps], marker, color=colour, ms=6, ls="none",
                        label=f"{kind} ({len(steps)})")
            continue
        for kind, marker, colour in (("preempted", "v", "#d7191c"), ("resumed", "o", "#1a9641")):
            first = run.first(kind)
            if first is not None:
                step, rid = first
                ax.plot([step], [usage[step] * 100], marker, color=colour, ms=7)
                ax.annotate(f"{kind} {rid} (step {step})", (step, usage[step] * 100),
                            textcoords="offset points", xytext=(4, -12 if kind == "resumed" else 4),
                            fontsize=7, color=colour)
    ax.set(xlabel="engine step", ylabel="KV cache usage (%)", ylim=(0, 108), title=title)
    # Outside the axes, to the right: inside, the key would hide a run's tail.
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)
    ax.grid(alpha=0.3)
    plt.close(fig)
    return fig
