"""An estimate of the memory that is not KV cache, before any server has started.

vLLM 0.33.0 *measures* everything it subtracts from the budget before the
pool (``Worker.determine_available_memory``, ``v1/worker/gpu_worker.py``):

1. the weights, as loaded ("Model loading took W GiB");
2. the activation peak of one dummy forward pass over
   ``max_num_batched_tokens`` tokens, attention skipped, followed by two
   sampler passes over ``min(max_num_batched_tokens, max_num_seqs)`` rows
   (``profile_run`` and ``_dummy_sampler_run``, ``v1/worker/gpu/model_runner.py``),
   plus the memory outside torch's allocator that the pass adds;
3. the CUDA graphs, captured once into a throwaway pool with a tiny KV cache
   (``profile_cudagraph_memory``, ``v1/worker/gpu/cudagraph_utils.py``): the
   first full graph's pool plus a per-graph cost, at least 1 MiB, for each of
   the others.

Before a start none of that can be measured, so this module *models* the
dominant terms, and says it is an estimate:

* weights: parameters x bytes, split over tensor-parallel ranks (or the
  figure a loader logged);
* activations: the larger of one decoder layer's live tensors at
  ``T = max_num_batched_tokens`` (the residual stream and the normed input,
  ``2 T H``, with the MLP's gate-and-up output and its activation,
  ``3 T I / tp``, or the attention projections) and the sampler's logits
  (``rows x vocab`` in the model's dtype, their float32 copy and one float32
  working tensor) beside the ``T x H`` hidden states it samples from;
* CUDA graphs: one layer's live tensors at the largest captured batch (the
  first graph's pool, which later graphs reuse) plus 1 MiB for each further
  full decode graph (vLLM's floor).

What it leaves out: memory outside torch (NCCL buffers under tensor
parallelism, the CUDA context; PR 10511's log shows 1.79 GiB on one H100),
MoE and quantized layers' workspaces, multimodal encoders. The true figure
comes from a short dry run (see the operator's page): ``vllm serve`` with the
real flags, ``VLLM_LOGGING_LEVEL=DEBUG``, stopped once "Available KV cache
memory" is printed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .budget import weight_bytes
from .common import cdiv, check_int, check_real
from .specs import GiB, dtype_bytes, model_spec, resolve_kv_dtype

#: vLLM 0.33.0's floor for one further CUDA graph (``_MIN_PER_GRAPH_BYTES``).
MIN_PER_GRAPH_BYTES = 1 << 20


def cudagraph_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int,
                            data_center_blackwell: bool = False) -> list[int]:
    """The batch sizes 0.33.0 captures by default (``_set_cudagraph_sizes``,
    ``config/vllm.py``): 1, 2, 4, multiples of 8 below 256, multiples of 16 up
    to ``min(2 x max_num_seqs, 512)`` (1,024 on a B200-class GPU), and
    ``max_num_batched_tokens`` itself when it fits under that cap."""
    seqs = check_int(max_num_seqs, "max_num_seqs", 1)
    tokens = check_int(max_num_batched_tokens, "max_num_batched_tokens", 1)
    cap = min(2 * seqs, 1024 if data_center_blackwell else 512)
    sizes = [s for s in [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, cap + 1, 16)) if s <= cap]
    if tokens <= cap and tokens not in sizes:
        sizes.append(tokens)
    return sorted(s for s in sizes if s <= tokens)


def layer_peak_bytes(model, num_tokens: int, tensor_parallel_size: int = 1, dtype="auto") -> int:
    """One decoder layer's live tensors for ``num_tokens`` tokens, the larger of its two halves:

    * MLP: residual and normed input ``2 T H`` plus gate-and-up ``2 T I / tp``
      and the activation ``T I / tp``;
    * attention: ``2 T H`` plus the QKV projection ``T (q + 2 kv) / tp`` and
      its output ``T q / tp``.

    Times the model's bytes per element. Needs ``intermediate_size`` and
    ``hidden_size``: a preset or a Llama-shaped config.
    """
    m = model_spec(model)
    t = check_int(num_tokens, "num_tokens", 1)
    tp = check_int(tensor_parallel_size, "tensor_parallel_size", 1)
    hidden, inter = _hidden_and_intermediate(m)
    q = m.num_attention_heads * m.head_dim
    kv = m.num_kv_heads * m.head_dim
    mlp = 2 * t * hidden + cdiv(3 * t * inter, tp)
    attn = 2 * t * hidden + cdiv(t * (2 * q + 2 * kv), tp)
    return max(mlp, attn) * dtype_bytes(resolve_kv_dtype(dtype, m))


# The presets' hidden and MLP widths (from each model's config.json).
_PRESET_WIDTHS = {"Llama-3-8B": (4096, 14336, 128256), "Llama-3.1-8B": (4096, 14336, 128256),
                  "Llama-3.1-70B": (8192, 28672, 128256), "Mistral-7B": (4096, 14336, 32768),
                  "Qwen2.5-7B": (3584, 18944, 152064), "Llama-2-7B": (4096, 11008, 32000)}


def _hidden_and_intermediate(m) -> tuple[int, int]:
    return _widths(m)[:2]


def _widths(m) -> tuple[int, int, int]:
    config = getattr(m, "config", None) or {}
    if {"hidden_size", "intermediate_size", "vocab_size"} <= set(config):
        return config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    if m.name in _PRESET_WIDTHS:
        return _PRESET_WIDTHS[m.name]
    raise ValueError(f"{m.name!r}: the estimate needs hidden_size, intermediate_size and vocab_size "
                     "(a preset, or a config.json that has them)")


def sampler_bytes(model, num_rows: int, dtype="auto") -> int:
    """The sampler pass's logits: ``rows x vocab`` in the model's dtype, their
    float32 copy, and one float32 working tensor (top-k/top-p, softmax)."""
    m = model_spec(model)
    rows = check_int(num_rows, "num_rows", 1)
    vocab = _widths(m)[2]
    return rows * vocab * (dtype_bytes(resolve_kv_dtype(dtype, m)) + 4 + 4)


@dataclass(frozen=True)
class NonKVEstimate:
    """The memory besides the KV pool, estimated before a start (one rank's)."""

    model: str
    max_num_batched_tokens: int
    max_num_seqs: int
    tensor_parallel_size: int
    weight_bytes: float
    layer_peak_bytes: int
    sampler_bytes: int
    activation_bytes: int
    cudagraph_bytes: int
    num_cudagraph_sizes: int

    @property
    def allowance_bytes(self) -> int:
        """What ``budget.plan(non_kv_gib=...)`` takes (weights excluded):
        activations and CUDA graphs. Memory outside torch is not in it."""
        return self.activation_bytes + self.cudagraph_bytes

    @property
    def total_bytes(self) -> float:
        """Weights included, comparable with requested minus "Available KV cache memory"."""
        return self.weight_bytes + self.allowance_bytes

    def rows(self) -> list[tuple[str, str]]:
        per = " per GPU" if self.tensor_parallel_size > 1 else ""
        return [(f"weights{per}", f"{self.weight_bytes / GiB:.2f} GiB"),
                (f"one layer at {self.max_num_batched_tokens:,} tokens", f"{self.layer_peak_bytes / GiB:.2f} GiB"),
                (f"sampler, {min(self.max_num_batched_tokens, self.max_num_seqs):,} rows",
                 f"{self.sampler_bytes / GiB:.2f} GiB"),
                ("activation peak (estimate)", f"{self.activation_bytes / GiB:.2f} GiB"),
                (f"CUDA graphs, {self.num_cudagraph_sizes} sizes (estimate)",
                 f"{self.cudagraph_bytes / GiB:.2f} GiB"),
                ("non-KV allowance, weights excluded (estimate)", f"{self.allowance_bytes / GiB:.2f} GiB")]


def estimate_non_kv(model, *, max_num_batched_tokens: int = 8192, max_num_seqs: int = 1024,
                    tensor_parallel_size: int = 1, weight_gib: float | None = None,
                    weight_dtype: str = "auto", enforce_eager: bool = False,
                    data_center_blackwell: bool = False) -> NonKVEstimate:
    """Estimate one rank's non-KV memory for a server not yet started.

    The defaults are ``vllm serve``'s on an H100 or H200 in 0.33.0
    (``max_num_batched_tokens`` 8,192, ``max_num_seqs`` 1,024); smaller GPUs
    get 2,048 and 256. ``weight_gib`` (the whole model's, as a loader logs it
    times the ranks) replaces parameters x bytes. ``enforce_eager`` drops the
    CUDA graphs. See the module's docstring for what is modelled and what is not.
    """
    m = model_spec(model)
    t = check_int(max_num_batched_tokens, "max_num_batched_tokens", 1)
    seqs = check_int(max_num_seqs, "max_num_seqs", 1)
    tp = check_int(tensor_parallel_size, "tensor_parallel_size", 1)
    if weight_gib is None:
        w = weight_bytes(m, resolve_kv_dtype(weight_dtype, m), tp)
    else:
        w = check_real(weight_gib, "weight_gib", minimum=0) * GiB / tp
    layer = layer_peak_bytes(m, t, tp)
    hidden = _widths(m)[0]
    sampler = sampler_bytes(m, min(t, seqs))
    activation = max(layer, t * hidden * dtype_bytes(resolve_kv_dtype("auto", m)) + sampler)
    sizes = [] if enforce_eager else cudagraph_capture_sizes(seqs, t, data_center_blackwell)
    graphs = 0
    if sizes:
        full_decode = [s for s in sizes if s <= seqs]  # FULL graphs for uniform decode batches
        graphs = layer_peak_bytes(m, sizes[-1], tp) + max(len(full_decode) - 1, 0) * MIN_PER_GRAPH_BYTES
    return NonKVEstimate(m.name, t, seqs, tp, w, layer, sampler, activation, graphs, len(sizes))


def compare_with_log(estimate: NonKVEstimate, log) -> list[tuple[str, float, float | None]]:
    """(figure, estimated GiB, logged GiB or None) for a dry run's log read by
    ``server_log.read_startup_log``: "Model loading took", and the "Actual
    usage is ... GiB for peak activation, and ... GiB for CUDAGraph memory"
    line, whose peak activation includes the CUDA-graph estimate vLLM
    subtracted (``peak_activation_memory``, ``v1/worker/gpu_worker.py``) and
    whose CUDAGraph figure is the pool actually captured."""
    return [("weights", estimate.weight_bytes / GiB, getattr(log, "model_loading_gib", None)),
            ("activation peak + graph estimate", estimate.allowance_bytes / GiB,
             getattr(log, "activation_gib", None)),
            ("CUDA graphs captured", estimate.cudagraph_bytes / GiB, getattr(log, "cudagraph_gib", None))]


#: Logged figures the estimate is checked against, each with its source: the
#: model, the GPU, the flags that set the profiled batch, and what the log says.
LOGGED_FIGURES = [
    {"source": "https://github.com/vllm-project/vllm/pull/10511",
     "what": "vllm serve meta-llama/Meta-Llama-3-8B on an H100 (V0 engine, Dec 2024)",
     "model": "Llama-3-8B", "tensor_parallel_size": 1, "max_num_batched_tokens": 8192, "max_num_seqs": 256,
     "weights_gib": 14.96, "activation_gib": 1.26, "non_torch_gib": 1.79},
    {"source": "https://github.com/vllm-project/vllm/pull/10511",
     "what": "the same with -tp 2", "model": "Llama-3-8B", "tensor_parallel_size": 2,
     "max_num_batched_tokens": 8192, "max_num_seqs": 256,
     "weights_gib": 7.48, "activation_gib": 1.26, "non_torch_gib": 3.58},
    {"source": "https://github.com/vllm-project/vllm/pull/17122",
     "what": "meta-llama/Llama-3.1-8B-Instruct on an L40S (V1 engine, Apr 2025): weights only",
     "model": "Llama-3.1-8B", "tensor_parallel_size": 1, "weights_gib": 14.9889},
]


def estimate_errors() -> list[dict]:
    """The estimate beside each of :data:`LOGGED_FIGURES`: the logged and
    estimated weights and activation peak (GiB) and the relative error."""
    out = []
    for f in LOGGED_FIGURES:
        e = estimate_non_kv(f["model"], tensor_parallel_size=f["tensor_parallel_size"],
                            max_num_batched_tokens=f.get("max_num_batched_tokens", 8192),
                            max_num_seqs=f.get("max_num_seqs", 256))
        row = dict(f, est_weights_gib=e.weight_bytes / GiB,
                   weights_error=e.weight_bytes / GiB / f["weights_gib"] - 1)
        if "activation_gib" in f:
            row.update(est_activation_gib=e.activation_bytes / GiB,
                       activation_error=e.activation_bytes / GiB / f["activation_gib"] - 1)
        out.append(row)
    return out


__all__ = ["MIN_PER_GRAPH_BYTES", "NonKVEstimate", "LOGGED_FIGURES", "compare_with_log", "cudagraph_capture_sizes",
           "estimate_errors", "estimate_non_kv", "layer_peak_bytes", "sampler_bytes"]
