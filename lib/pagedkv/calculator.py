"""Chapter 1's budget calculator: a figure of the HBM budget and an interactive view of it.

``plot_budget(plan)`` draws where a GPU's memory goes. ``BudgetCalculator`` puts
controls (GPU, model, dtype, utilization, ``max_model_len``, block size, request
length) in front of :func:`pagedkv.budget.plan` and redraws on every change. Its
rich display carries a static HTML rendering of the current plan as well as the
live widget, so a page built from the executed notebook shows the table and the
figure rather than an empty box.
"""

from __future__ import annotations

import base64
import html
import io

from . import budget
from .budget import GiB

COLORS = {"weights": "#6c757d", "non-KV allowance": "#f0ad4e", "KV pool": "#2c7fb8", "headroom": "#d9d9d9"}


def budget_parts(p: budget.BudgetPlan) -> dict[str, float]:
    """The four parts of a GPU's memory, in GiB; they sum to the total."""
    return {
        "weights": p.weight_bytes / GiB,
        "non-KV allowance": p.non_kv_bytes / GiB,
        "KV pool": p.pool_bytes / GiB,
        "headroom": p.headroom_bytes / GiB,
    }


def plot_budget(p: budget.BudgetPlan, ax=None):
    """A horizontal stacked bar of the HBM budget, labelled in GiB. Returns the figure."""
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(9, 2.2))
    else:
        fig = ax.figure
    left = 0.0
    for label, gib in budget_parts(p).items():
        ax.barh(0, gib, left=left, color=COLORS[label], edgecolor="white", label=f"{label}: {gib:.2f} GiB")
        if gib > 0.06 * p.total_bytes / GiB:
            ax.text(left + gib / 2, 0, f"{gib:.2f}", ha="center", va="center", fontsize=9,
                    color="white" if label in ("KV pool", "weights") else "black")
        left += gib
    ax.set_xlim(0, p.total_bytes / GiB)
    ax.set_yticks([])
    ax.set_xlabel("GiB of GPU memory")
    ax.set_title(f"{p.model} ({p.dtype}) on {p.gpu}: gpu_memory_utilization={p.gpu_memory_utilization:g}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=4, frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


def _figure_png(p: budget.BudgetPlan) -> str:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig = plot_budget(p)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def plan_html(p: budget.BudgetPlan, with_figure: bool = True) -> str:
    """A self-contained HTML rendering (table plus inline PNG figure): no scripts, no network."""
    rows = "".join(
        f"<tr><td style='padding:2px 12px 2px 0'>{html.escape(k)}</td>"
        f"<td style='text-align:right'><b>{html.escape(v)}</b></td></tr>"
        for k, v in p.rows()
    )
    img = (f"<img alt='HBM budget' style='max-width:100%' src='data:image/png;base64,{_figure_png(p)}'/>"
           if with_figure else "")
    return f"<div class='pagedkv-budget'><table>{rows}</table>{img}</div>"


def plan_error_html(message: str) -> str:
    return f"<div style='color:#b00020'><b>This configuration does not fit:</b> {html.escape(message)}</div>"


try:  # ipywidgets is optional: without it the static renderings above still work
    import ipywidgets as widgets
except ImportError:  # pragma: no cover
    widgets = None


if widgets is None:

    class BudgetCalculator:  # type: ignore[no-redef]
        """Stand-in that explains what is missing (a bare GPU machine has no Jupyter)."""

        def __init__(self, *args, **kwargs):
            raise ImportError("BudgetCalculator needs ipywidgets (pip install ipywidgets); "
                              "plot_budget and plan_html work without it")

else:

    class BudgetCalculator(widgets.VBox):
        """Controls in front of ``budget.plan``; the table and figure redraw on every change."""

        def __init__(self, gpu="H100 SXM 80GB", model="Llama-3-8B", dtype="bf16", gpu_memory_utilization=0.92,
                     non_kv_gib=6.0, max_model_len=32_768, block_size=16, request_len=612, weight_gib=None):
            self._weight_gib = weight_gib
            style = {"description_width": "150px"}
            self.gpu = widgets.Dropdown(options=list(budget.GPUS), value=gpu, description="GPU", style=style)
            self.model = widgets.Dropdown(options=list(budget.MODELS), value=model, description="model", style=style)
            self.dtype = widgets.Dropdown(options=["bf16", "fp16", "fp8", "fp32"], value=dtype,
                                          description="KV dtype", style=style)
            self.util = widgets.FloatSlider(value=gpu_memory_utilization, min=0.5, max=1.0, step=0.01,
                                            description="gpu_memory_utilization", style=style)
            self.non_kv = widgets.FloatSlider(value=non_kv_gib, min=0.0, max=20.0, step=0.5,
                                              description="non-KV GiB", style=style)
            self.max_len = widgets.Dropdown(options=[2**k for k in range(11, 18)], value=max_model_len,
                                            description="max_model_len", style=style)
            self.block = widgets.Dropdown(options=[1, 8, 16, 32, 64, 128], value=block_size,
                                          description="block_size", style=style)
            self.req = widgets.IntSlider(value=request_len, min=1, max=32_768, step=1,
                                         description="request length", style=style)
            self.out = widgets.HTML()
            controls = [self.gpu, self.model, self.dtype, self.util, self.non_kv, self.max_len, self.block, self.req]
            for c in controls:
                c.observe(self._redraw, names="value")
            super().__init__(children=[widgets.HBox([widgets.VBox(controls[:4]), widgets.VBox(controls[4:])]),
                                       self.out])
            self._redraw()

        def current_plan(self) -> budget.BudgetPlan:
            weight = self._weight_gib if self.model.value == "Llama-3-8B" else None
            return budget.plan(gpu=self.gpu.value, model=self.model.value, dtype=self.dtype.value,
                               gpu_memory_utilization=self.util.value, non_kv_gib=self.non_kv.value,
                               max_model_len=self.max_len.value, block_size=self.block.value,
                               request_len=self.req.value, weight_gib=weight)

        def static_html(self) -> str:
            try:
                return plan_html(self.current_plan())
            except ValueError as exc:
                return plan_error_html(str(exc))

        def _redraw(self, change=None) -> None:
            self.out.value = self.static_html()

        def _repr_mimebundle_(self, **kwargs):
            bundle = super()._repr_mimebundle_(**kwargs)
            data = bundle[0] if isinstance(bundle, tuple) else bundle
            data["text/html"] = self.static_html()
            return bundle
