"""Explorables: a chapter's figures recomputed in the page as the reader moves the controls.

Each explorable is a small JavaScript module shipped as package data
(``explore_<kind>.js``, on the shared ``explore.js``) and inlined into one
self-contained HTML string: the controls, the output drawn for the default
settings, and the script. No kernel, no network: the built site runs it, and
so does JupyterLab for a trusted notebook (its output's script runs there, as
the replay's does). Where no script runs, the controls stay hidden and the
output drawn here, for the settings named under it, remains.

For every kind the library computes the same figures in Python
(``KINDS[kind].figures(inputs)``): the agreement test runs the module in
node on generated inputs, and the site check moves the controls in Chromium,
and both compare with these, string for string.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.resources
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .. import budget
from .calculator import COLORS as BUDGET_COLORS
from .calculator import budget_parts, startup_error

__all__ = ["Control", "Explorable", "KINDS", "budget_explorer", "budget_figures", "module_script"]

_counter = itertools.count(1)


@functools.cache
def _source(name: str) -> str:
    """A package-data script without its header comment (documentation, not emitted)."""
    text = importlib.resources.files(__package__).joinpath(name).read_text(encoding="utf-8")
    if text.startswith("/*"):
        text = text[text.index("*/\n") + 3:]
    return text.strip("\n") + "\n"


def module_script(kind: str) -> str:
    """The JavaScript of one explorable: the shared part, then its own module."""
    return _source("explore.js") + _source(f"explore_{kind}.js")


def esc(text) -> str:
    """HTML escaping, character for character as ``pkvExplore.esc`` does it."""
    table = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}
    return "".join(table.get(c, c) for c in str(text))


@dataclass(frozen=True)
class Control:
    """One input: a ``<select>`` of ``options``, or a range ``(min, max, step)``."""

    name: str
    label: str
    value: object
    options: Sequence | None = None
    range: tuple[float, float, float] | None = None

    def html(self, dom_id: str) -> str:
        kind = ("float" if self.range is not None or isinstance(self.value, float)
                else "str" if isinstance(self.value, str) else "int")
        cid = f"{dom_id}-{self.name}"
        attrs = f"id='{cid}' data-input='{self.name}' data-type='{kind}'"
        if self.options is not None:
            opts = "".join(f"<option{' selected' if o == self.value else ''}>{esc(o)}</option>"
                           for o in self.options)
            field = f"<select {attrs}>{opts}</select>"
        else:
            lo, hi, step = self.range
            field = (f"<input type='range' {attrs} min='{lo}' max='{hi}' step='{step}' "
                     f"value='{self.value}'/><output for='{cid}'>{self.value}</output>")
        return f"<label for='{cid}'>{esc(self.label)}</label><span>{field}</span>"


@dataclass(frozen=True)
class Kind:
    """What the library knows of one explorable: the same three functions as its module."""

    inputs: Callable[[dict, dict], dict]  # controls' values + config -> inputs
    figures: Callable[[dict], dict]  # inputs -> figures (computed by the library)
    render: Callable[[dict, dict], str]  # figures + config -> the output's HTML


STYLE = """<style>
.pkv-explorable{border:1px solid rgba(128,128,128,.45);border-radius:6px;padding:8px 10px;margin:8px 0;
 font-size:14px;max-width:100%;box-sizing:border-box;overflow-wrap:anywhere}
.pkv-explorable .pkv-title{font-weight:bold;margin-bottom:4px}
.pkv-explorable .pkv-controls{display:grid;grid-template-columns:max-content minmax(0,1fr);gap:4px 10px;
 align-items:center;margin-bottom:8px}
.pkv-explorable .pkv-controls[hidden]{display:none}
.pkv-explorable select,.pkv-explorable input{max-width:100%;font:inherit;color:inherit;background:transparent}
.pkv-explorable select option{color:#000;background:#fff}
.pkv-explorable label{font-family:monospace;font-size:13px}
.pkv-explorable output{font-family:monospace;margin-left:6px}
.pkv-explorable input[type=range]{vertical-align:middle;width:60%}
.pkv-explorable select{width:auto}
.pkv-explorable .pkv-verdict{margin:4px 0;padding:4px 6px;border-left:4px solid}
.pkv-explorable .pkv-ok{border-color:#1b9e5a}
.pkv-explorable .pkv-refused,.pkv-explorable .pkv-invalid{border-color:#d6336c;border-left-style:double;
 border-left-width:6px}
.pkv-explorable .pkv-bar{display:flex;height:18px;margin:6px 0;border:1px solid rgba(128,128,128,.6)}
.pkv-explorable .pkv-bar span{min-width:1px}
.pkv-explorable .pkv-legend{font-size:12px}
.pkv-explorable .pkv-legend span{display:inline-block;margin-right:10px}
.pkv-explorable .pkv-legend i{display:inline-block;width:10px;height:10px;margin-right:4px}
.pkv-explorable table.pkv-table{margin:6px 0;border-collapse:collapse}
.pkv-explorable table.pkv-table td{padding:1px 12px 1px 0;border:0}
.pkv-explorable table.pkv-table td+td{text-align:right;font-weight:bold;white-space:nowrap}
.pkv-explorable .pkv-log{font-family:monospace;font-size:12px;margin-top:4px}
.pkv-explorable .pkv-note{font-size:12px;opacity:.8}
</style>"""


@dataclass
class Explorable:
    """One explorable, ready to display: ``_repr_html_`` is the whole self-contained HTML."""

    kind: str
    title: str
    controls: list[Control]
    config: dict

    def values(self) -> dict:
        return {c.name: c.value for c in self.controls}

    def figures(self) -> dict:
        k = KINDS[self.kind]
        return k.figures(k.inputs(self.values(), self.config))

    def html(self) -> str:
        config = json.dumps(self.config, sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha1(f"{self.kind}{config}{self.values()}".encode()).hexdigest()[:10]
        dom_id = f"pkv-{self.kind}-{next(_counter)}-{digest}"
        controls = "".join(c.html(dom_id) for c in self.controls)
        settings = " \u00b7 ".join(f"{c.name} {c.value}" for c in self.controls)
        return (
            f"{STYLE}<div class='pkv-explorable pagedkv-explorable' id='{dom_id}' data-kind='{self.kind}' "
            f"data-config='{esc(config)}'><div class='pkv-title'>{esc(self.title)}</div>"
            f"<div class='pkv-controls' hidden>{controls}</div>"
            f"<div class='pkv-out'>{KINDS[self.kind].render(self.figures(), self.config)}</div>"
            f"<div class='pkv-note pkv-static'>drawn for {esc(settings)}</div></div>"
            f"<script>{module_script(self.kind)}pkvExplore.mount('{dom_id}');</script>")

    def _repr_html_(self) -> str:
        return self.html()

    def __repr__(self) -> str:
        return f"{self.title} ({self.kind} explorable: {', '.join(c.name for c in self.controls)})"


# ---------------------------------------------------------------- chapter 1: the budget


def budget_config(non_kv_gib: float = 6.0, request_len: int = 612,
                  weights: dict[str, float] | None = None) -> dict:
    """What the budget module needs besides the controls: the library's tables and the fixed inputs."""
    return {
        "models": {name: dataclasses.asdict(m) for name, m in budget.MODELS.items()},
        "gpus": {name: g.total_mib for name, g in budget.GPUS.items()},
        "dtype_bytes": dict(budget.DTYPE_BYTES),
        "colors": dict(BUDGET_COLORS),
        "fixed": {"non_kv_gib": non_kv_gib, "request_len": request_len},
        "weights": dict(weights or {}),
    }


def budget_inputs(values: dict, config: dict) -> dict:
    """The controls' values with the fixed inputs, and a logged weight figure for its own model."""
    inputs = {**config["fixed"], **values}
    inputs["weight_gib"] = config["weights"].get(inputs["model"])
    return inputs


def budget_figures(inputs: dict) -> dict:
    """The library's figures for one setting of the calculator: the plan, the startup check, the log."""
    try:
        p = budget.plan(gpu=inputs["gpu"], model=inputs["model"], dtype=inputs["dtype"],
                        gpu_memory_utilization=inputs["gpu_memory_utilization"],
                        non_kv_gib=inputs["non_kv_gib"], max_model_len=inputs["max_model_len"],
                        block_size=inputs["block_size"], request_len=inputs["request_len"],
                        weight_gib=inputs["weight_gib"],
                        tensor_parallel_size=inputs["tensor_parallel_size"])
    except ValueError as exc:
        return {"verdict": "invalid", "message": str(exc), "rows": [], "log": [], "parts": []}
    error = startup_error(p)
    return {
        "verdict": "refused" if error else "ok",
        "message": error or f"one request of max_model_len={p.max_model_len:,} fits.",
        "rows": [list(r) for r in p.rows()],
        "log": budget.startup_log_lines(p),
        "parts": [[k, f"{v:.2f}"] for k, v in budget_parts(p).items()],
    }


_HEAD = {"ok": "\u2714 startup check passes: ", "refused": "\u2718 vLLM would refuse to start: ",
         "invalid": "\u2718 this configuration does not fit: "}


def render_budget(f: dict, config: dict) -> str:
    """The calculator's output, exactly as the module's ``render`` draws it."""
    out = (f"<div class='pkv-verdict pkv-{f['verdict']}' data-verdict='{f['verdict']}'><b>"
           f"{_HEAD[f['verdict']]}</b><span class='pkv-message'>{esc(f['message'])}</span></div>")
    colors = config["colors"]
    if f["parts"]:
        out += "<div class='pkv-bar'>" + "".join(
            f"<span style='flex-grow:{v};background:{colors[k]}' title='{esc(f'{k}: {v} GiB')}'></span>"
            for k, v in f["parts"]) + "</div><div class='pkv-legend'>" + " ".join(
            f"<span><i style='background:{colors[k]}'></i>{esc(k)}: {v} GiB</span>"
            for k, v in f["parts"]) + "</div>"
    if f["rows"]:
        out += "<table class='pkv-table'>" + "".join(
            f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in f["rows"]) + "</table>"
    if f["log"]:
        out += "<div class='pkv-log'>" + "".join(f"<div>INFO {esc(line)}</div>" for line in f["log"]) + "</div>"
    return out


BUDGET_MAX_MODEL_LENS = [2**k for k in range(11, 18)]


def budget_explorer(gpu: str = "H100 SXM 80GB", model: str = budget.REFERENCE_MODEL, dtype: str = "bf16",
                    tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.92,
                    max_model_len: int = 32_768, block_size: int = 16, non_kv_gib: float = 6.0,
                    request_len: int = 612, weight_gib: float | None = None) -> Explorable:
    """Chapter 1's calculator in the page: GPU, model, KV dtype, tensor parallel size,
    utilization, ``max_model_len`` and block size -> the pool, its blocks, the
    concurrency vLLM logs and the startup check's verdict in vLLM's words.

    ``weight_gib`` (a logged figure, as ``BudgetCalculator`` takes it) belongs
    to ``model``; other models' weights come from their parameter counts.
    """
    weights = {} if weight_gib is None else {model: weight_gib}
    controls = [
        Control("gpu", "GPU", gpu, options=list(budget.GPUS)),
        Control("model", "model", model, options=list(budget.MODELS)),
        Control("dtype", "KV dtype", dtype, options=["bf16", "fp16", "fp8", "fp32"]),
        Control("tensor_parallel_size", "tensor_parallel_size", tensor_parallel_size, options=[1, 2, 4, 8]),
        Control("gpu_memory_utilization", "gpu_memory_utilization", gpu_memory_utilization,
                range=(0.5, 1, 0.01)),
        Control("max_model_len", "max_model_len", max_model_len, options=BUDGET_MAX_MODEL_LENS),
        Control("block_size", "block_size", block_size, options=[1, 8, 16, 32, 64, 128]),
    ]
    return Explorable("budget", "Memory budget: move the controls", controls,
                      budget_config(non_kv_gib, request_len, weights))


KINDS: dict[str, Kind] = {
    "budget": Kind(budget_inputs, budget_figures, render_budget),
}
