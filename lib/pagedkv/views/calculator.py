"""Chapter 1's budget calculator: a figure of the HBM budget and an interactive view of it.

``plot_budget(plan)`` draws where a GPU's memory goes. ``BudgetCalculator`` puts
controls (GPU or a GPU's memory in MiB, model or a config.json, KV dtype,
tensor-parallel size, utilization, non-KV allowance, ``max_model_len``, block
size, request length) in front of
:func:`pagedkv.budget.plan` and redraws on every change. Like vLLM at startup it
runs the startup check (:func:`pagedkv.budget.check_enough_kv_cache_memory`)
and shows its message in red when one ``max_model_len`` request does not fit.
Its rich display carries a static HTML rendering of the current plan as well as
the live widget, so a page built from the executed notebook shows the settings,
the table and the figure rather than an empty box.

A ``config.json`` whose layers are not all full attention (Gemma 3, gpt-oss,
Llama 4, Qwen3-Next, DeepSeek's MLA, Mistral's window) is planned by KV-cache
groups (``BudgetPlan.kv_plan``), and the rendering adds the groups' table and
the line vLLM would log. What it does not take: the scheduler's token budget
is fixed at ``vllm serve``'s 8,192 with two batches in flight (call
``budget.plan`` for others); a hybrid's Mamba state is planned without prefix
caching ("none" mode); a mixture of experts or hybrid needs its weights typed
(``weight_gib``), the parameter count not being read from its config.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io

from .. import budget
from ..budget import GiB
from ..kv_cache_planning import check_enough_memory

COLORS = {"weights": "#6c757d", "non-KV allowance": "#f0ad4e",
          "KV pool": "#2c7fb8", "headroom": "#d9d9d9"}

# Figures are drawn for the book's 688-px column at the inline backend's
# 100 dpi; the static rendering uses the same size.
FIG_WIDTH_IN = 6.8
FIG_DPI = 100


def fmt_fraction(x: float) -> str:
    """A utilization as a reader would type it: 0.92, not 0.9199999999999999."""
    return f"{round(float(x), 4):g}"


def budget_parts(p: budget.BudgetPlan) -> dict[str, float]:
    """The four parts of a GPU's memory, in GiB; they sum to the total."""
    return {
        "weights": p.weight_bytes / GiB,
        "non-KV allowance": p.non_kv_bytes / GiB,
        "KV pool": p.pool_bytes / GiB,
        "headroom": p.headroom_bytes / GiB,
    }


def plan_title(p: budget.BudgetPlan) -> str:
    """One short line naming the configuration (TP shown only when > 1)."""
    tp = (f", tensor_parallel_size={p.tensor_parallel_size}"
          if p.tensor_parallel_size > 1 else "")
    return f"{p.model} ({p.dtype}) on {p.gpu}{tp}"


def plot_budget(p: budget.BudgetPlan, ax=None):
    """A horizontal stacked bar of one GPU's memory, labelled in GiB.

    The legend sits between the title and the bar, so nothing below the axis
    competes with its label. Returns the figure.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, 2.3))
    else:
        fig = ax.figure
    left = 0.0
    total = p.total_bytes / GiB
    for label, gib in budget_parts(p).items():
        ax.barh(0, gib, left=left, color=COLORS[label], edgecolor="white",
                label=f"{label}: {gib:.2f} GiB")
        if gib > 0.06 * total:
            ax.text(left + gib / 2, 0, f"{gib:.2f}", ha="center",
                    va="center", fontsize=9,
                    color="white" if label in ("KV pool", "weights")
                    else "black")
        left += gib
    ax.set_xlim(0, total)
    ax.set_yticks([])
    per = (f" (each of {p.tensor_parallel_size} GPUs)"
           if p.tensor_parallel_size > 1 else "")
    ax.set_xlabel(f"GiB of GPU memory{per}", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    util = fmt_fraction(p.gpu_memory_utilization)
    ax.set_title(f"{plan_title(p)}\ngpu_memory_utilization={util}",
                 fontsize=10, pad=28)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4,
              frameon=False, fontsize=7.5, handlelength=1.2,
              columnspacing=1.0)
    fig.tight_layout()
    return fig


INSTANCE_COLORS = {"other processes": "#8c564b", "another instance": "#9467bd",
                   "free, outside the budget": "#f7f7f7"}


def plot_shared_card(total_bytes: float, rows: dict[str, list[tuple[str, float]]]):
    """One horizontal bar per scenario: a card's memory split into labelled parts.

    ``rows`` maps a scenario to ``(part, bytes)`` pairs from the left; what the
    parts leave of ``total_bytes`` is drawn as free memory outside every budget.
    Parts are coloured as in :func:`plot_budget` (weights, non-KV, KV pool) or
    by ``INSTANCE_COLORS``. Returns the figure.
    """
    import matplotlib.pyplot as plt

    colors = {**COLORS, **INSTANCE_COLORS}
    total = total_bytes / GiB
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, 0.8 + 0.7 * len(rows)))
    seen = set()
    for y, (scenario, parts) in enumerate(rows.items()):
        used = sum(b for _, b in parts)
        left = 0.0
        for label, num_bytes in [*parts, ("free, outside the budget", total_bytes - used)]:
            gib = num_bytes / GiB
            ax.barh(y, gib, left=left, color=colors[label], edgecolor="black", linewidth=0.4,
                    label=None if label in seen else label)
            seen.add(label)
            if gib > 0.07 * total:
                dark = label in ("KV pool", "weights", "other processes", "another instance")
                ax.text(left + gib / 2, y, f"{gib:.1f}", ha="center", va="center", fontsize=8,
                        color="white" if dark else "black")
            left += gib
    ax.set_yticks(range(len(rows)), list(rows), fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, total)
    ax.set_xlabel("GiB of GPU memory", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(loc="lower center", bbox_to_anchor=(0.4, 1.0), ncol=3, frameon=False,
              fontsize=7.5, handlelength=1.2, columnspacing=1.0)
    fig.tight_layout()
    return fig


def _figure_png(p: budget.BudgetPlan) -> str:
    # A Figure outside pyplot: rendering the static PNG must not switch the
    # session's backend (matplotlib.use("Agg") did, and later cells' plt.show()
    # then drew nothing in a notebook).
    from matplotlib.figure import Figure

    fig = Figure(figsize=(FIG_WIDTH_IN, 2.3))
    plot_budget(p, ax=fig.add_subplot())
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=FIG_DPI)
    return base64.b64encode(buf.getvalue()).decode()


def rank_model_spec(p: budget.BudgetPlan) -> budget.ModelSpec:
    """The model as ONE tensor-parallel rank stores its KV: its share of heads.

    vLLM runs the startup check on each worker's own KV spec, so under
    tensor parallelism the needed bytes are one rank's.
    """
    m = p.spec or budget.model_spec(p.model)
    tp = p.tensor_parallel_size
    return dataclasses.replace(
        m, num_kv_heads=budget.kv_heads_per_rank(m, tp),
        num_attention_heads=max(1, m.num_attention_heads // tp))


def startup_error(p: budget.BudgetPlan) -> str | None:
    """vLLM's startup message if the plan would not start, else ``None``: a
    ``max_model_len`` beyond the model's context, or one such request that does
    not fit the plan's pool (per rank, null block held back)."""
    try:
        budget.check_max_model_len(p.spec or p.model, p.max_model_len)
        if p.kv_plan is not None:  # by groups, on this rank's specs
            check_enough_memory(p.kv_plan)
            return None
        budget.check_enough_kv_cache_memory(
            p.pool_bytes, rank_model_spec(p), p.max_model_len,
            p.block_size, p.dtype)
    except ValueError as exc:
        return str(exc)
    return None


def settings_line(p: budget.BudgetPlan) -> str:
    """The controls' values in one line (what the static page was drawn for)."""
    return (f"{p.gpu} · {p.model} · KV {p.dtype} · "
            f"tensor_parallel_size {p.tensor_parallel_size} · "
            f"gpu_memory_utilization {fmt_fraction(p.gpu_memory_utilization)}"
            f" · non-KV {p.non_kv_bytes / GiB:g} GiB · "
            f"max_model_len {p.max_model_len:,} · block_size {p.block_size}"
            f" · request {p.request_len:,} tokens")


def _red(title: str, message: str) -> str:
    return (f"<div style='color:#b00020;margin:4px 0'><b>{html.escape(title)}"
            f"</b> {html.escape(message)}</div>")


def plan_html(p: budget.BudgetPlan, with_figure: bool = True) -> str:
    """A self-contained HTML rendering: the settings, the startup check's
    verdict (red when ``max_model_len`` does not fit), the table and an inline
    PNG figure. No scripts, no network."""
    rows = "".join(
        f"<tr><td style='padding:2px 12px 2px 0'>{html.escape(k)}</td>"
        f"<td style='text-align:right'><b>{html.escape(v)}</b></td></tr>"
        for k, v in p.rows()
    )
    error = startup_error(p)
    verdict = (_red("vLLM would refuse to start:", error) if error else
               "<div style='color:#1b7837;margin:4px 0'>startup check: one "
               f"request of max_model_len={p.max_model_len:,} fits.</div>")
    img = ("<img alt='HBM budget' style='max-width:100%' "
           f"src='data:image/png;base64,{_figure_png(p)}'/>"
           if with_figure else "")
    settings = (f"<div style='font-size:90%;color:#555'>"
                f"{html.escape(settings_line(p))}</div>")
    return (f"<div class='pagedkv-budget'>{settings}{verdict}"
            f"<table>{rows}</table>{groups_html(p)}{img}</div>")


def groups_html(p: budget.BudgetPlan) -> str:
    """The KV-cache groups of a plan that has several (else ""): one row per
    group, and the capacity line vLLM 0.33.0 would log."""
    if p.kv_plan is None:
        return ""
    head = ("<tr><th style='text-align:left;padding:2px 12px 2px 0'>group</th><th>layers</th>"
            "<th>tokens per block</th><th>blocks per request</th></tr>")
    body = "".join(
        f"<tr><td style='padding:2px 12px 2px 0'>{i}: {html.escape(kind)}</td>"
        f"<td style='text-align:right'>{n}</td><td style='text-align:right'>{bs}</td>"
        f"<td style='text-align:right'>{need:,}</td></tr>"
        for i, (kind, n, bs, need) in enumerate(p.kv_plan.group_rows()))
    line = html.escape(budget.startup_log_lines(p)[1])
    return (f"<table style='font-size:90%'>{head}{body}</table>"
            f"<div style='font-size:90%'><code>{line}</code></div>")


def plan_error_html(message: str) -> str:
    return _red("This configuration does not fit:", message)


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
        """Controls in front of ``budget.plan``; the table and figure redraw on every change.

        Every number can be one's own: ``gpu`` is a preset name, a
        ``GPUSpec`` or a GPU's total memory in MiB as nvidia-smi prints it
        (``"81559 MiB"``, or the number ``81_559`` as the "GPU MiB" field takes it);
        ``model`` a preset name, a ``ModelSpec`` or a Hugging Face
        ``config.json`` (a dict or its path, :func:`pagedkv.budget.model_spec_from_config`);
        ``non_kv_gib`` and ``weight_gib`` the figures a server logged
        (:func:`pagedkv.server_log.read_startup_log`). In the widget, "GPU MiB"
        and "non-KV GiB" take typed numbers; typing a GPU's memory selects
        "custom".

        Two columns of controls, each 340 px wide, fit the book's column; the
        labels get 170 px so ``gpu_memory_utilization`` is not cut off.
        """

        CUSTOM_GPU = "custom"

        def __init__(self, gpu="H100 SXM 80GB", model=budget.REFERENCE_MODEL, dtype="bf16",
                     gpu_memory_utilization=0.92, non_kv_gib=6.0, max_model_len=32_768,
                     block_size=16, request_len=612, weight_gib=None,
                     tensor_parallel_size=1):
            self._models = dict(budget.MODELS)
            if isinstance(model, str) and model in budget.MODELS:
                spec = budget.MODELS[model]
            elif isinstance(model, budget.ModelSpec):
                spec = model
            else:  # a config.json, as a dict or a path
                spec = budget.model_spec_from_config(model)
            self._models[spec.name] = spec
            self._custom_mib = 81_559
            if isinstance(gpu, (int, float)) and not isinstance(gpu, bool):
                gpu = budget.GPUSpec.from_mib(int(gpu))  # the widget's "GPU MiB" field
            g = budget.gpu_spec(gpu)  # a preset, a GPUSpec or "81559 MiB"
            if budget.GPUS.get(g.name) == g:
                gpu_name = g.name
            else:
                self._custom_mib, gpu_name = g.total_mib, self.CUSTOM_GPU
            # weight_gib (a logged figure) belongs to the model it came with.
            self._weight_gib, self._weight_model = weight_gib, spec.name
            style = {"description_width": "170px"}
            layout = widgets.Layout(width="340px")
            kw = {"style": style, "layout": layout}
            self.gpu = widgets.Dropdown(options=[*budget.GPUS, self.CUSTOM_GPU], value=gpu_name,
                                        description="GPU", **kw)
            self.gpu_mib = widgets.BoundedIntText(
                value=self._gpu_total_mib(gpu_name), min=1, max=10**7, description="GPU MiB",
                tooltip="total memory as nvidia-smi reports it; typing selects 'custom'", **kw)
            self.model = widgets.Dropdown(options=list(self._models), value=spec.name,
                                          description="model", **kw)
            self.dtype = widgets.Dropdown(options=["bf16", "fp16", "fp8", "fp32"],
                                          value=dtype, description="KV dtype", **kw)
            self.tp = widgets.Dropdown(
                options=[1, 2, 4, 8, 16], value=tensor_parallel_size,
                description="tensor_parallel_size",
                tooltip="GPUs the model is split across; figures are per GPU", **kw)
            self.util = widgets.FloatSlider(
                value=gpu_memory_utilization, min=0.5, max=1.0, step=0.01,
                readout_format=".2f", description="gpu_memory_utilization",
                tooltip="share of each GPU's total memory the engine may use", **kw)
            self.non_kv = widgets.BoundedFloatText(
                value=non_kv_gib, min=0.0, max=10_000.0, step=0.01, description="non-KV GiB",
                tooltip="activations and CUDA graphs per GPU, weights excluded: "
                        "your server's figure (StartupLog.allowance_gib)", **kw)
            self.max_len = widgets.BoundedIntText(value=max_model_len, min=2, max=1 << 24,
                                                  description="max_model_len", **kw)
            self.block = widgets.Dropdown(options=[1, 8, 16, 32, 64, 128],
                                          value=block_size, description="block_size", **kw)
            self.req = widgets.BoundedIntText(value=request_len, min=1, max=1 << 24,
                                              description="request length", **kw)
            self.out = widgets.HTML()
            controls = [self.gpu, self.gpu_mib, self.model, self.dtype, self.tp, self.util,
                        self.non_kv, self.max_len, self.block, self.req]
            self.gpu.observe(self._gpu_chosen, names="value")
            self.gpu_mib.observe(self._mib_typed, names="value")
            for c in controls:
                c.observe(self._redraw, names="value")
            super().__init__(children=[widgets.HBox([widgets.VBox(controls[:5]),
                                                     widgets.VBox(controls[5:])]),
                                       self.out])
            self._redraw()

        def _gpu_total_mib(self, name: str) -> int:
            return self._custom_mib if name == self.CUSTOM_GPU else budget.GPUS[name].total_mib

        def _gpu_chosen(self, change) -> None:
            if change["new"] != self.CUSTOM_GPU:
                self.gpu_mib.value = budget.GPUS[change["new"]].total_mib

        def _mib_typed(self, change) -> None:
            name = self.gpu.value
            if name != self.CUSTOM_GPU and change["new"] != budget.GPUS[name].total_mib:
                self._custom_mib = change["new"]
                self.gpu.value = self.CUSTOM_GPU
            elif name == self.CUSTOM_GPU:
                self._custom_mib = change["new"]

        def current_gpu(self) -> budget.GPUSpec:
            if self.gpu.value == self.CUSTOM_GPU:
                return budget.GPUSpec.from_mib(self._custom_mib)
            return budget.GPUS[self.gpu.value]

        def current_plan(self) -> budget.BudgetPlan:
            weight = (self._weight_gib
                      if self.model.value == self._weight_model else None)
            return budget.plan(gpu=self.current_gpu(), model=self._models[self.model.value],
                               dtype=self.dtype.value,
                               gpu_memory_utilization=round(self.util.value, 4),
                               non_kv_gib=self.non_kv.value,
                               max_model_len=self.max_len.value,
                               block_size=self.block.value,
                               request_len=self.req.value, weight_gib=weight,
                               tensor_parallel_size=self.tp.value)

        def static_html(self) -> str:
            try:
                return plan_html(self.current_plan())
            except ValueError as exc:
                settings = (f"{self.current_gpu().name} · {self.model.value} · KV "
                            f"{self.dtype.value} · tensor_parallel_size "
                            f"{self.tp.value} · gpu_memory_utilization "
                            f"{fmt_fraction(self.util.value)}")
                return (f"<div style='font-size:90%;color:#555'>"
                        f"{html.escape(settings)}</div>"
                        + plan_error_html(str(exc)))

        def _redraw(self, change=None) -> None:
            self.out.value = self.static_html()

        def _repr_mimebundle_(self, **kwargs):
            bundle = super()._repr_mimebundle_(**kwargs)
            data = bundle[0] if isinstance(bundle, tuple) else bundle
            data["text/html"] = self.static_html()
            return bundle
