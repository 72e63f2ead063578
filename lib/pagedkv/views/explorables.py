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

from .. import budget, sim
from .calculator import COLORS as BUDGET_COLORS
from .calculator import budget_parts, startup_error

__all__ = ["Control", "Explorable", "KINDS", "budget_explorer", "budget_figures", "module_script",
           "tail_explorer", "tail_figures"]

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
        numbers = [self.value, *(self.range or ())]
        kind = ("str" if isinstance(self.value, str)
                else "float" if any(isinstance(x, float) for x in numbers) else "int")
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
.pkv-explorable .pkv-slots{display:flex;flex-wrap:wrap;gap:2px;margin:4px 0}
.pkv-explorable .pkv-slots span{flex:0 0 auto;width:14px;height:14px;box-sizing:border-box}
.pkv-explorable .pkv-slots:has(span[style]) span{flex-basis:0;min-width:1px}
.pkv-explorable .pkv-w{background:#2c7fb8;border:1px solid #2c7fb8}
.pkv-explorable .pkv-u{border:1px dashed rgba(128,128,128,.9);
 background:repeating-linear-gradient(45deg,transparent 0 3px,rgba(128,128,128,.55) 3px 4px)}
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
                range=(0.5, 1.0, 0.01)),
        Control("max_model_len", "max_model_len", max_model_len, options=BUDGET_MAX_MODEL_LENS),
        Control("block_size", "block_size", block_size, options=[1, 8, 16, 32, 64, 128]),
    ]
    return Explorable("budget", "Memory budget: move the controls", controls,
                      budget_config(non_kv_gib, request_len, weights))


# ---------------------------------------------------------------- chapter 2: tail waste


def tail_inputs(values: dict, config: dict) -> dict:
    return {**config["fixed"], **values}


def tail_figures(inputs: dict) -> dict:
    """The library's figures for one request's last block: its unused tail, in slots and bytes."""
    L, B, model, dtype = inputs["length"], inputs["block_size"], inputs["model"], inputs["dtype"]
    per_token = budget.kv_bytes_per_token(model, dtype)
    blocks = budget.blocks_per_request(L, B)
    tail = int(sim.unused_tail_slots(L, B))
    slots = budget.token_slots(blocks, B)
    return {"written": B - tail, "tail": tail, "block_size": B, "rows": [
        [f"blocks of {B}", f"{blocks:,}"],
        ["slots held", f"{slots:,}"],
        ["unused slots in the last block", f"{tail:,}"],
        ["share of the slots held", f"{100 * tail / slots:.2f} %"],
        [f"unused KV ({model}, {dtype})", f"{tail * per_token / budget.MiB:,.2f} MiB"],
        ["worst case, B - 1 slots", f"{(B - 1) * per_token / budget.MiB:,.2f} MiB"],
        ["mean if lengths mod B are uniform", f"{sim.uniform_tail_waste(B):.1f} slots"],
    ]}


def render_tail(f: dict, config: dict | None = None) -> str:
    """The tail explorable's output, exactly as the module's ``render`` draws it."""
    if f["block_size"] <= 64:
        cells = "".join(f"<span class='{'pkv-w' if i < f['written'] else 'pkv-u'}'></span>"
                        for i in range(f["block_size"]))
    else:
        cells = (f"<span class='pkv-w' style='flex-grow:{f['written']}'></span>"
                 f"<span class='pkv-u' style='flex-grow:{f['tail']}'></span>")
    return (f"<div class='pkv-caption'>the last block: {f['written']} written, {f['tail']} unused</div>"
            f"<div class='pkv-slots'>{cells}</div><table class='pkv-table'>"
            + "".join(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in f["rows"]) + "</table>")


def tail_config(model: str = budget.REFERENCE_MODEL, dtype: str = "bf16") -> dict:
    return {"models": {name: dataclasses.asdict(m) for name, m in budget.MODELS.items()},
            "dtype_bytes": dict(budget.DTYPE_BYTES), "fixed": {"model": model, "dtype": dtype}}


def tail_explorer(length: int = 612, block_size: int = 16, model: str = budget.REFERENCE_MODEL,
                  dtype: str = "bf16", max_length: int = 2048) -> Explorable:
    """Chapter 2's tail waste: a request's length and the block size -> its last block's
    unused slots, their share and their bytes, against the worst case and the mean."""
    controls = [
        Control("length", "request length", length, range=(1, max_length, 1)),
        Control("block_size", "block_size", block_size, options=[1, 2, 4, 8, 16, 32, 64, 128, 256]),
    ]
    return Explorable("tail", "Tail waste: move the length and the block size", controls,
                      tail_config(model, dtype))


KINDS: dict[str, Kind] = {
    "budget": Kind(budget_inputs, budget_figures, render_budget),
    "tail": Kind(tail_inputs, tail_figures, render_tail),
}
