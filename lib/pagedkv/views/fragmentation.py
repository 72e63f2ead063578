"""Chapter 2's pictures: the pool's five parts over time, tail residues, concurrency, and an explorer.

Each plot draws for the book's 688-px column at the inline backend's 100 dpi
(at most 6.8 inches wide) and returns the figure; matplotlib is imported only
when one is called. ``FragmentationExplorer`` puts controls in front of
``sim.waste_sim.run_all`` and ``plot_composition`` (it needs ipywidgets).
The simulation itself lives in ``pagedkv.sim``; this module only draws it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..common import cdiv, check_int
from ..sim.allocators import VariableExtentAllocator
from ..sim.kv_allocator import PARTS
from ..sim.tail_waste import expected_tail_waste, unused_tail_slots, uniform_tail_waste
from ..sim.waste_sim import WasteSimResult, run_all
from ..sim.workloads import WORKLOADS, Trace, make_request_trace

__all__ = [
    "FIG_WIDTH_IN",
    "PART_COLORS",
    "PART_LABELS",
    "draw_extents",
    "plot_tail_residues",
    "plot_composition",
    "composition_table",
    "plot_concurrency",
    "plot_block_size_sweep",
    "composition_html",
    "FragmentationExplorer",
]

FIG_WIDTH_IN = 6.8

#: Colours and legend labels of the five parts, in ``PARTS`` order.
PART_COLORS = {"live": "#2c7fb8", "over_reserved": "#f0ad4e", "external": "#d62728",
               "internal": "#9467bd", "free": "#d9d9d9"}
PART_LABELS = {"live": "live KV", "over_reserved": "reserved, unused (over-reservation)",
               "external": "free, unusable (external)", "internal": "unwritten tail (internal)",
               "free": "free"}
_HELD, _HOLE = "#2c7fb8", "#f2f2f2"


def draw_extents(alloc: VariableExtentAllocator, ax, title: str) -> None:
    """One horizontal bar per extent of a contiguous allocator: requests in
    blue, labelled ``id: size``; holes hatched, labelled above."""
    for rid, (start, n) in alloc.allocated_extents().items():
        ax.barh(0, n, left=start, color=_HELD, edgecolor="white")
        ax.text(start + n / 2, 0, f"{rid}: {n}", ha="center", va="center", color="white", fontsize=9)
    for start, n in alloc.free_extents():
        ax.barh(0, n, left=start, color=_HOLE, edgecolor="grey", hatch="//")
        ax.text(start + n / 2, 0.5, f"hole {n}", ha="center", va="bottom", fontsize=8)
    ax.set_xlim(0, alloc.capacity)
    ax.set_ylim(-0.6, 1.1)
    ax.set_yticks([])
    ax.set_title(title, fontsize=10, loc="left")


def plot_tail_residues(traces: dict[str, Trace], block_size: int = 16):
    """Side by side, for each named trace: the share of final lengths leaving
    0 .. B-1 unused slots in the last block, against the uniform 1/B, with the
    trace's expected tail waste and (B - 1)/2 marked."""
    import matplotlib.pyplot as plt

    B = check_int(block_size, "block_size", 1)
    fig, axes = plt.subplots(1, len(traces), figsize=(FIG_WIDTH_IN, 3.0), sharey=True, squeeze=False)
    for ax, (name, trace) in zip(axes[0], traces.items()):
        tails = unused_tail_slots(trace.final_len, B)
        share = np.bincount(tails, minlength=B) / len(tails)
        expected = expected_tail_waste(trace.final_len, None, B)
        ax.bar(np.arange(B), share, color="#9467bd")
        ax.axhline(1 / B, color="grey", ls=":", label=f"uniform: 1/{B} each")
        ax.axvline(expected, color="black", label=f"expected: {expected:.2f}")
        ax.axvline(uniform_tail_waste(B), color="#d62728", ls="--",
                   label=f"(B - 1)/2 = {uniform_tail_waste(B):.1f}")
        ax.set_title(f"{name}\n{len(trace):,} final lengths", fontsize=9)
        ax.set_xticks(range(0, B, max(1, B // 8)))
        ax.set_xlabel(f"unused slots in the last block (B = {B})", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("share of requests", fontsize=8)
    fig.tight_layout()
    return fig


def plot_composition(results: Sequence[WasteSimResult], title: str):
    """The five parts of the pool over time, one stacked panel per allocator,
    in a grid of three columns; the legend takes the last free cell."""
    import matplotlib.pyplot as plt

    cols = 3
    rows = cdiv(len(results) + 1, cols)
    fig, axes = plt.subplots(rows, cols, figsize=(FIG_WIDTH_IN, 2.3 * rows + 0.4), sharey=True)
    axes = np.atleast_1d(axes).ravel()
    for i, (ax, r) in enumerate(zip(axes, results)):
        parts = [100 * getattr(r, p) / r.capacity for p in PARTS]
        ax.stackplot(np.arange(r.steps), *parts, colors=[PART_COLORS[p] for p in PARTS],
                     labels=[PART_LABELS[p] for p in PARTS])
        ax.set_title(r.allocator, fontsize=9)
        ax.set_xlim(0, r.steps)
        ax.set_ylim(0, 100)
        if r.mean_fractions()["live"] > 0.9:  # a paged panel: zoom on its thin top
            inset = ax.inset_axes([0.35, 0.12, 0.6, 0.45])
            inset.stackplot(np.arange(r.steps), *parts, colors=[PART_COLORS[p] for p in PARTS])
            inset.set_xlim(0, r.steps)
            inset.set_ylim(95, 100)
            inset.set_xticks([])
            inset.tick_params(labelsize=6)
            inset.set_title("top 5 %, zoomed", fontsize=6.5, pad=2)
        ax.tick_params(labelsize=8)
        if i % cols == 0:
            ax.set_ylabel("% of the KV pool", fontsize=8)
        if i + cols >= len(results):
            ax.set_xlabel("step", fontsize=8)
    handles, labels = axes[0].get_legend_handles_labels()
    legend_ax = axes[len(results)]
    legend_ax.axis("off")
    legend_ax.legend(handles[::-1], labels[::-1], loc="center", fontsize=7.5, frameon=False)
    for ax in axes[len(results) + 1:]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def composition_table(results: Sequence[WasteSimResult]) -> str:
    """Each allocator's mean parts (% of the pool), mean running requests,
    finished requests and preemptions, as a fixed-width table (78 columns)."""
    head = (f"{'allocator':26s}{'live':>6s}{'over':>6s}{'ext':>6s}{'int':>6s}{'free':>6s}"
            f"{'run':>6s}{'done':>6s}{'preempt':>9s}")
    lines = [head]
    for r in results:
        f = r.mean_fractions()
        lines.append(f"{r.allocator:26s}" + "".join(f"{100 * f[p]:6.1f}" for p in PARTS)
                     + f"{r.running.mean():6.0f}{r.finished:6d}{r.preemptions:9d}")
    return "\n".join(lines)


def plot_concurrency(chat_results: Sequence[WasteSimResult], concurrency: dict[str, Sequence[float]],
                     levels: Sequence[tuple[float, str]] = ()):
    """Two panels, one above the other: running requests per step on the chat
    trace (``levels`` are (value, label) guide lines), and the steady mean per
    allocator and workload on a log scale."""
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(FIG_WIDTH_IN, 6.8))
    # Lines that run on top of each other (first-fit under best-fit, paged
    # beside token-granular) stay apart by style and by sparse markers.
    styles = [("-", "s"), ("--", "o"), (":", "^"), ("-", "D"), ("-.", "v")]
    for r, (ls, marker) in zip(chat_results, styles * len(chat_results)):
        ax0.plot(r.running, label=r.allocator, lw=1.2, ls=ls, marker=marker,
                 markevery=max(1, r.steps // 12), markersize=4)
    for level, text in levels:
        ax0.axhline(level, color="grey", ls=":", lw=1)
        ax0.annotate(text, (1.0, level), xycoords=("axes fraction", "data"),
                     xytext=(4, 0), textcoords="offset points", fontsize=7,
                     color="grey", va="center", annotation_clip=False)
    ax0.set_xlabel("step", fontsize=8)
    ax0.set_ylabel("running requests", fontsize=8)
    ax0.set_title("chat turns (512 + 100): running requests per step", fontsize=9)
    ax0.tick_params(labelsize=8)
    ax0.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0, -0.18), ncol=3, frameon=False)
    x = np.arange(len(chat_results))
    width = 0.8 / max(1, len(concurrency))
    for i, (name, values) in enumerate(concurrency.items()):
        ax1.bar(x + (i - (len(concurrency) - 1) / 2) * width, values, width, label=name)
    ax1.set_xticks(x, [r.allocator.replace(" ", "\n", 1) for r in chat_results], fontsize=7.5)
    ax1.set_yscale("log")
    ax1.set_yticks([10, 30, 100, 300, 1000], ["10", "30", "100", "300", "1000"])
    ax1.minorticks_off()
    ax1.tick_params(axis="y", labelsize=8)
    ax1.set_ylabel("mean running requests (log)", fontsize=8)
    ax1.set_title("admitted concurrency per allocator and workload", fontsize=9)
    ax1.legend(fontsize=7.5)
    fig.tight_layout()
    return fig


def plot_block_size_sweep(sizes: Sequence[int], measured: Sequence[float], bound: Sequence[float],
                          uniform_estimate: Sequence[float], trace_name: str = "heavy-tailed"):
    """Internal fragmentation (% of the pool) against block size: the
    simulator's measurement, the B - 1 bound and the (B - 1)/2 estimate."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, 3.6))
    ax.plot(sizes, bound, "--", color="#d62728", label="bound: B - 1 slots per running request")
    ax.plot(sizes, uniform_estimate, "-", color="grey", lw=1.5, label="(B - 1)/2 slots per running request")
    # Markers only: the measurement sits on the (B - 1)/2 line, which must stay visible.
    ax.plot(sizes, measured, "o", mfc="none", mec="#9467bd", ms=8, mew=1.5, label="measured by the simulator")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(sizes), [str(s) for s in sizes])
    ax.minorticks_off()
    ax.set_xlabel("block_size (tokens)", fontsize=9)
    ax.set_ylabel("internal fragmentation, % of pool", fontsize=9)
    ax.set_title(f"Internal waste against block size ({trace_name} trace)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def composition_html(results: Sequence[WasteSimResult], title: str) -> str:
    """The composition panels as an inline PNG plus the table as text: a
    static rendering that needs no kernel (no scripts, no network)."""
    import base64
    import html
    import io

    import matplotlib.pyplot as plt

    fig = plot_composition(results, title)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    data = base64.b64encode(png.getvalue()).decode()
    return (f"<img style='max-width:100%' alt='{html.escape(title)}' "
            f"src='data:image/png;base64,{data}'/>"
            f"<pre style='font-size:11px'>{html.escape(composition_table(results))}</pre>")


try:  # ipywidgets is optional: the static helpers above work without it
    import ipywidgets as _widgets
except ImportError:  # pragma: no cover
    _widgets = None


if _widgets is None:  # pragma: no cover

    class FragmentationExplorer:  # type: ignore[no-redef]
        """Stand-in that explains what is missing."""

        def __init__(self, *args, **kwargs):
            raise ImportError("FragmentationExplorer needs ipywidgets (pip install ipywidgets); "
                              "run_all, plot_composition and composition_html work without it")

else:

    class FragmentationExplorer(_widgets.VBox):
        """Controls (workload, block size, arrival rate) in front of
        :func:`run_all` and :func:`plot_composition`; the panels and the table
        redraw on every change. Its rich display carries the current run as
        static HTML, so a page without a kernel shows it."""

        def __init__(self, capacity: int, max_model_len: int, workload: str = "heavy-tailed",
                     block_size: int = 16, arrival_rate: float = 10.0, num_requests: int = 4000,
                     steps: int = 1500):
            self.capacity, self.max_model_len = capacity, max_model_len
            self.num_requests, self.steps = num_requests, steps
            kw = {"style": {"description_width": "90px"}, "layout": _widgets.Layout(width="225px")}
            self.workload = _widgets.Dropdown(options=list(WORKLOADS), value=workload,
                                              description="workload", **kw)
            self.block = _widgets.Dropdown(options=[1, 4, 16, 64, 256], value=block_size,
                                           description="block_size", **kw)
            self.rate = _widgets.FloatLogSlider(value=arrival_rate, base=10, min=-0.5, max=1.5,
                                                description="arrivals/step", **kw)
            self.view = _widgets.HTML()
            for control in (self.workload, self.block, self.rate):
                control.observe(self.rerun, names="value")
            super().__init__(children=[_widgets.HBox([self.workload, self.block, self.rate]),
                                       self.view])
            self.rerun()

        def title(self) -> str:
            return (f"{self.workload.value}, block_size {self.block.value}, "
                    f"{self.rate.value:.2g} arrivals/step")

        def rerun(self, change=None) -> None:
            trace = make_request_trace(self.workload.value, self.num_requests,
                                       arrival_rate=self.rate.value, seed=0)
            results = run_all(trace, self.capacity, self.max_model_len, self.block.value, self.steps)
            self.view.value = composition_html(results, self.title())

        def _repr_mimebundle_(self, **kwargs):
            bundle = super()._repr_mimebundle_(**kwargs)
            data = bundle[0] if isinstance(bundle, tuple) else bundle
            data["text/html"] = self.view.value  # the current run, for a page without a kernel
            return bundle
