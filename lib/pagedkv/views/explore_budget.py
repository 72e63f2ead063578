"""Chapter 1's in-page budget calculator, the ``budget`` explorable (``explore_budget.js``).

The controls are a GPU, a model, the KV dtype, ``tensor_parallel_size``,
``gpu_memory_utilization``, ``max_model_len``, the block size and the figures a
reader types from their own server: the non-KV GiB it logged, the GPU's memory
in MiB, a custom model's shape. The figures are :func:`pagedkv.budget.plan`'s.

A custom model may have local-attention layers beside its full-attention
ones: ``custom_sliding_layers`` of its layers attend to a window of
``custom_window`` tokens (gpt-oss, Gemma 3), or ``custom_chunked_layers`` of
them to their own chunk of ``custom_chunk`` tokens (Llama 4's chunked local
attention, ``attention_chunk_size``). One local kind at a time: a model with
both is refused by name, which keeps the grouping to two kinds, the local one
first (layer 0 is local, as in those models). The pool is planned by KV-cache
groups as vLLM 0.33.0 plans it (:func:`pagedkv.kv_cache_planning.plan_kv_cache`,
with ``vllm serve``'s scheduler budget on an H100: 8,192 batched tokens, two
batches in flight). Linear-attention (Mamba) state and MLA are not offered
here; ``budget.plan`` sizes them from a config.json.
"""

from __future__ import annotations

import dataclasses
import math

from .. import budget
from .calculator import COLORS as BUDGET_COLORS
from .calculator import budget_parts, startup_error
from .explorable_core import KINDS, Control, Explorable, Kind, esc


# The figures a reader types: (input, label, min, max, whole number). ``gpu_mib``
# 0 keeps the chosen GPU's memory; the ``custom_*`` fields shape the model
# "custom" (its query heads taken as its KV heads, which KV sizing never reads).
BUDGET_FIELDS = [("non_kv_gib", "non-KV GiB", 0, 40, False),
                 ("gpu_mib", "GPU MiB (0: preset)", 0, 1_000_000, True),
                 ("custom_layers", "custom layers", 1, 1_000, True),
                 ("custom_kv_heads", "custom KV heads", 1, 1_000, True),
                 ("custom_head_dim", "custom head_dim", 1, 4_096, True),
                 ("custom_params_b", "custom params (B)", 0, 2_000, False),
                 ("custom_sliding_layers", "custom sliding layers", 0, 1_000, True),
                 ("custom_window", "custom sliding window", 1, 131_072, True),
                 ("custom_chunked_layers", "custom chunked layers", 0, 1_000, True),
                 ("custom_chunk", "custom chunk size", 1, 131_072, True)]
CUSTOM = "custom"
CUSTOM_CONTEXT = 131_072  # the custom model's context: the largest max_model_len offered
BUDGET_DEFAULTS = {"non_kv_gib": 6.0, "gpu_mib": 0, "custom_layers": 32, "custom_kv_heads": 8,
                   "custom_head_dim": 128, "custom_params_b": 8.0, "custom_sliding_layers": 0,
                   "custom_window": 128, "custom_chunked_layers": 0, "custom_chunk": 8_192}
# vllm serve's scheduler budget on an H100 or H200 in 0.33.0: what a sliding
# window's or a chunk's group holds beyond its window or chunk
# (max_concurrent_batches x tokens).
SCHEDULER = {"max_num_batched_tokens": 8192, "max_concurrent_batches": 2}


def budget_config(non_kv_gib: float = 6.0, request_len: int = 612,
                  weights: dict[str, float] | None = None) -> dict:
    """What the budget module needs besides the controls: the library's tables and the fixed inputs
    (the typed fields' defaults, for a setting that leaves them out)."""
    return {
        "models": {name: dataclasses.asdict(m) for name, m in budget.MODELS.items()},
        "gpus": {name: g.total_mib for name, g in budget.GPUS.items()},
        "dtype_bytes": dict(budget.DTYPE_BYTES),
        "colors": dict(BUDGET_COLORS),
        "fixed": {**BUDGET_DEFAULTS, **SCHEDULER, "non_kv_gib": non_kv_gib, "request_len": request_len},
        "weights": dict(weights or {}),
        "fields": [list(f) for f in BUDGET_FIELDS],
        "custom_context": CUSTOM_CONTEXT,
    }


def budget_inputs(values: dict, config: dict) -> dict:
    """The controls' values with the fixed inputs, and a logged weight figure for its own model."""
    inputs = {**config["fixed"], **values}
    inputs["weight_gib"] = config["weights"].get(inputs["model"])
    return inputs


def budget_refusal(inputs: dict) -> str | None:
    """Why a typed figure cannot be used (not a number, or out of its bounds), or None.
    The custom model's fields count only when the model is "custom"."""
    for name, label, lo, hi, whole in BUDGET_FIELDS:
        if name.startswith("custom_") and inputs["model"] != CUSTOM:
            continue
        v = inputs.get(name)
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                or not lo <= v <= hi or (whole and not float(v).is_integer())):
            return f"{label} must be a {'whole ' if whole else ''}number from {lo:,} to {hi:,}"
    if inputs["model"] != CUSTOM:
        return None
    layers = int(inputs["custom_layers"])
    for name, label in (("custom_sliding_layers", "custom sliding layers"),
                        ("custom_chunked_layers", "custom chunked layers")):
        if inputs[name] > layers:
            return f"{label} ({int(inputs[name]):,}) must be at most custom layers ({layers:,})"
    if inputs["custom_sliding_layers"] and inputs["custom_chunked_layers"]:
        return (f"custom sliding layers ({int(inputs['custom_sliding_layers']):,}) and custom chunked "
                f"layers ({int(inputs['custom_chunked_layers']):,}) cannot both be set: the custom "
                "model has one kind of local attention beside its full-attention layers")
    return None


def custom_layer_kinds(layers: int, local: int, kind: str = "sliding_attention") -> tuple[str, ...]:
    """The custom model's layers, its full-attention ones spread evenly among
    the ``local`` ones of ``kind`` and layer 0 local, as in gpt-oss
    (alternating), Gemma 3 (five sliding, then one full) and Llama 4 (three
    chunked, then one full)."""
    full = layers - local
    return tuple("full_attention" if (i + 1) * full // layers > i * full // layers
                 else kind for i in range(layers))


def budget_specs(inputs: dict) -> tuple:
    """The GPU and the model the setting names: a preset, or one built from the typed figures."""
    gpu = inputs["gpu"]
    if inputs["gpu_mib"]:
        mib = int(inputs["gpu_mib"])
        gpu = budget.GPUSpec.from_mib(mib, f"{mib:,} MiB")
    model = inputs["model"]
    if model == CUSTOM:
        heads, layers = int(inputs["custom_kv_heads"]), int(inputs["custom_layers"])
        shape = ("the custom model", layers, heads, heads, int(inputs["custom_head_dim"]),
                 int(inputs["custom_params_b"] * 1e9), CUSTOM_CONTEXT, CUSTOM_CONTEXT)
        # budget_refusal has made sure at most one local kind is set
        sliding = int(inputs["custom_sliding_layers"])
        chunked = int(inputs.get("custom_chunked_layers", 0))
        if sliding:
            model = budget.ConfigModelSpec(*shape, layer_kinds=custom_layer_kinds(layers, sliding),
                                           config={"sliding_window": int(inputs["custom_window"])})
        elif chunked:
            model = budget.ConfigModelSpec(
                *shape, layer_kinds=custom_layer_kinds(layers, chunked, "chunked_attention"),
                config={"attention_chunk_size": int(inputs["custom_chunk"])})
        else:
            model = budget.ModelSpec(*shape)
    return gpu, model


def budget_figures(inputs: dict) -> dict:
    """The library's figures for one setting of the calculator: the plan, the startup check, the log."""
    refusal = budget_refusal(inputs)
    if refusal:
        return {"verdict": "invalid", "message": refusal, "rows": [], "log": [], "parts": [], "groups": []}
    gpu, model = budget_specs(inputs)
    dtype = inputs["dtype"]
    if getattr(model, "grouped", False):  # the group planner spells fp32 "float32"
        dtype = {"fp32": "float32"}.get(dtype, dtype)
    try:
        p = budget.plan(gpu=gpu, model=model, dtype=dtype,
                        gpu_memory_utilization=inputs["gpu_memory_utilization"],
                        non_kv_gib=inputs["non_kv_gib"], max_model_len=inputs["max_model_len"],
                        block_size=inputs["block_size"], request_len=inputs["request_len"],
                        weight_gib=inputs["weight_gib"],
                        tensor_parallel_size=inputs["tensor_parallel_size"],
                        max_num_batched_tokens=inputs["max_num_batched_tokens"],
                        max_concurrent_batches=inputs["max_concurrent_batches"])
    except ValueError as exc:
        return {"verdict": "invalid", "message": str(exc), "rows": [], "log": [], "parts": [], "groups": []}
    error = startup_error(p)
    return {
        "verdict": "refused" if error else "ok",
        "message": error or f"one request of max_model_len={p.max_model_len:,} fits.",
        "rows": [list(r) for r in p.rows()],
        "log": budget.startup_log_lines(p),
        "parts": [[k, f"{v:.2f}"] for k, v in budget_parts(p).items()],
        # (kind, layers, tokens per block, blocks per max_model_len request), by group
        "groups": [] if p.kv_plan is None else [list(g) for g in p.kv_plan.group_rows()],
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
    if f["groups"]:
        out += ("<table class='pkv-table'><tr><th>group</th><th>layers</th><th>tokens per block</th>"
                "<th>blocks per request</th></tr>" + "".join(
                    f"<tr><td>{i}: {esc(kind)}</td><td>{n:,}</td><td>{bs:,}</td><td>{need:,}</td></tr>"
                    for i, (kind, n, bs, need) in enumerate(f["groups"])) + "</table>")
    if f["log"]:
        out += "<div class='pkv-log'>" + "".join(f"<div>INFO {esc(line)}</div>" for line in f["log"]) + "</div>"
    return out


BUDGET_MAX_MODEL_LENS = [2**k for k in range(11, 18)]


def budget_explorer(gpu: str = "H100 SXM 80GB", model: str = budget.REFERENCE_MODEL, dtype: str = "bf16",
                    tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.92,
                    max_model_len: int = 32_768, block_size: int = 16, non_kv_gib: float = 6.0,
                    request_len: int = 612, weight_gib: float | None = None) -> Explorable:
    """Chapter 1's calculator in the page: GPU, model, KV dtype, tensor parallel size,
    utilization, ``max_model_len``, block size and the non-KV allowance -> the
    pool, its blocks, the concurrency vLLM logs and the startup check's verdict
    in vLLM's words.

    ``weight_gib`` (a logged figure, as ``BudgetCalculator`` takes it) belongs
    to ``model``; other models' weights come from their parameter counts.
    The reader may type the non-KV GiB a server logged, a GPU's memory in MiB
    (0: the chosen GPU's), and a model's shape (model "custom").
    """
    weights = {} if weight_gib is None else {model: weight_gib}
    typed = {name: Control(name, label, BUDGET_DEFAULTS[name], number=True,
                           range=(float(lo), float(hi), 0.1) if not whole else (lo, hi, 1))
             for name, label, lo, hi, whole in BUDGET_FIELDS}
    typed["non_kv_gib"] = dataclasses.replace(typed["non_kv_gib"], value=float(non_kv_gib))
    controls = [
        Control("gpu", "GPU", gpu, options=list(budget.GPUS)),
        typed["gpu_mib"],
        Control("model", "model", model, options=[*budget.MODELS, CUSTOM]),
        *(typed[n] for n in ("custom_layers", "custom_kv_heads", "custom_head_dim", "custom_params_b",
                                             "custom_sliding_layers", "custom_window",
                                             "custom_chunked_layers", "custom_chunk")),
        Control("dtype", "KV dtype", dtype, options=["bf16", "fp16", "fp8", "fp32"]),
        Control("tensor_parallel_size", "tensor_parallel_size", tensor_parallel_size, options=[1, 2, 4, 8]),
        Control("gpu_memory_utilization", "gpu_memory_utilization", gpu_memory_utilization,
                range=(0.5, 1.0, 0.01)),
        Control("max_model_len", "max_model_len", max_model_len, options=BUDGET_MAX_MODEL_LENS),
        Control("block_size", "block_size", block_size, options=[1, 8, 16, 32, 64, 128]),
        typed["non_kv_gib"],
    ]
    return Explorable("budget", "Memory budget: move the controls", controls,
                      budget_config(non_kv_gib, request_len, weights))




KINDS["budget"] = Kind(budget_inputs, budget_figures, render_budget)
