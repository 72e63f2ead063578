"""Seconds from steps: a step-time model that turns the engine's trace into TTFT and ITL.

The engine counts steps; an operator tunes time to first token (TTFT) and
inter-token latency (ITL) in seconds. A step's time on a GPU is, to first
order, the larger of two floors (a roofline):

* **compute**: every scheduled token multiplies through every weight (2
  FLOPs per parameter), and its attention reads its context (QK^T and PV,
  2 x 2 FLOPs per layer, head and head dimension, for every key it sees;
  causal within the chunk). A prefill chunk of thousands of tokens is
  bound here.
* **memory**: the step reads every weight once, whatever the batch, and
  every scheduled request's KV cache up to its last new token. A step of
  decodes (one token each) is bound here.

The constants are the library's performance model's (``tools/perf_model.py``,
``book/perf_model.json``): the share of the datasheet bandwidth a kernel
reaches, 92 % (fast) to 70 % (slow), and the tensor-core throughput it
reaches, the datasheet's dense bf16 peak (fast) to 600/989 of it (slow).
So every figure is a *range*, ``(fast, slow)``, and a **prediction**: no
GPU run has checked it yet. What it leaves out is said where it matters: the
CPU's scheduling and sampling time, kernel launches (CUDA graphs hide most
in vLLM), the LM head computed only for sampled tokens, communication
under tensor parallelism (one rank here).

``LatencyTrace`` is a step listener: attached to an ``LLMEngine`` it costs
each step with a ``StepTimeModel`` and keeps, per request, the clock when it
arrived (the start of the first step that saw it) and when each of its
tokens was sampled (the end of the step that computed it). The schedule is
the engine's own, decided by token and block counts alone, so a run with a
small model on a CPU gives the schedule a real model would get; the model
named in ``StepTimeModel`` prices it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..budget import kv_bytes_per_token, weight_bytes
from ..common import check_real
from ..specs import GPUSpec, ModelSpec, gpu_spec, model_spec
from .stats import StepListener

__all__ = ["BANDWIDTH_SHARE", "TENSOR_SHARE", "DENSE_BF16_TFLOPS", "StepTime", "StepTimeModel",
           "LatencyTrace"]

#: Share of the datasheet bandwidth reached, (fast, slow): the performance model's ``bandwidth_share``.
BANDWIDTH_SHARE = (0.92, 0.70)
#: Share of the dense bf16 peak reached, (fast, slow): the performance model's ``tensor_tflops``
#: for the H200, 989 and 600 TFLOP/s, as shares of its peak.
TENSOR_SHARE = (1.0, 600.0 / 989.0)

#: Dense (no sparsity) bf16 tensor-core peak, TFLOP/s, from each datasheet (which print the
#: sparse figure, twice these). Other GPUs: ``StepTimeModel(..., peak_tflops=...)``.
DENSE_BF16_TFLOPS = {
    "H100 SXM 80GB": 989.0,  # https://www.nvidia.com/en-us/data-center/h100/ (1,979 with sparsity)
    "H200": 989.0,  # https://www.nvidia.com/en-us/data-center/h200/ (1,979 with sparsity)
    "A100 SXM 80GB": 312.0,  # https://www.nvidia.com/en-us/data-center/a100/ (624 with sparsity)
    "A100 SXM 40GB": 312.0,
}


@dataclass(frozen=True)
class StepTime:
    """One step's predicted seconds, ``fast`` and ``slow`` ends of the range, and what bounds it."""

    fast: float
    slow: float
    bound: str  # "compute" or "memory", at the fast end


class StepTimeModel:
    """Predicted seconds of one engine step for ``model`` on ``gpu`` (one rank, bf16 weights and KV).

    Args:
        model: a ``ModelSpec`` or preset name (``"Llama-3-8B"``).
        gpu: a ``GPUSpec`` or preset name; it needs a bandwidth.
        peak_tflops: the dense bf16 peak; default from ``DENSE_BF16_TFLOPS``.
    """

    def __init__(self, model: str | ModelSpec = "Llama-3-8B", gpu: str | GPUSpec = "H200",
                 peak_tflops: float | None = None) -> None:
        self.model = model_spec(model)
        self.gpu = gpu_spec(gpu)
        self.bandwidth_gbs = self.gpu.require_bandwidth("the step-time model")
        if peak_tflops is None:
            if self.gpu.name not in DENSE_BF16_TFLOPS:
                raise ValueError(f"no dense bf16 peak is known for {self.gpu.name!r}: give peak_tflops "
                                 f"(TFLOP/s, from its datasheet); known: {', '.join(DENSE_BF16_TFLOPS)}")
            peak_tflops = DENSE_BF16_TFLOPS[self.gpu.name]
        self.peak_tflops = check_real(peak_tflops, "peak_tflops", minimum=0, open_min=True)
        self.weight_bytes = weight_bytes(self.model)
        self.kv_bytes_per_token = kv_bytes_per_token(self.model)
        m = self.model
        # Attention FLOPs per (query, key) pair: QK^T and PV, a multiply-add each, every layer and head.
        self.attention_flops_per_pair = 2 * 2 * m.num_layers * m.num_attention_heads * m.head_dim

    def flops(self, num_new: int, num_computed: int) -> float:
        """FLOPs of one request's ``num_new`` tokens after ``num_computed`` in the cache."""
        pairs = num_new * num_computed + num_new * (num_new + 1) // 2  # causal within the chunk
        return 2 * self.model.num_params * num_new + self.attention_flops_per_pair * pairs

    def step_time(self, num_scheduled_tokens: dict[str, int], num_computed_tokens: dict[str, int]) -> StepTime:
        """A step from its ``SchedulerOutput``'s two maps (request id -> new tokens, tokens before).

        An empty step (nothing scheduled) takes no time.
        """
        if not num_scheduled_tokens:
            return StepTime(0.0, 0.0, "memory")
        flops = sum(self.flops(n, num_computed_tokens[rid]) for rid, n in num_scheduled_tokens.items())
        kv_tokens = sum(num_computed_tokens[rid] + n for rid, n in num_scheduled_tokens.items())
        nbytes = self.weight_bytes + kv_tokens * self.kv_bytes_per_token
        times = []
        for i in (0, 1):
            compute = flops / (self.peak_tflops * 1e12 * TENSOR_SHARE[i])
            memory = nbytes / (self.bandwidth_gbs * 1e9 * BANDWIDTH_SHARE[i])
            times.append((max(compute, memory), "compute" if compute >= memory else "memory"))
        return StepTime(times[0][0], times[1][0], times[0][1])

    def __repr__(self) -> str:
        return f"StepTimeModel({self.model.name} on {self.gpu.name}, prediction)"


class LatencyTrace(StepListener):
    """A step listener: each step's predicted time, and every request's arrival and token times.

    ``attach(engine)``, run the engine, then read ``ttft(rid)``,
    ``itl(rid)`` or ``summary()``. Times are ``(fast, slow)`` pairs in
    seconds on the model's clock, which starts at 0 with the first step seen
    and advances only by the steps' predicted times (an idle engine's clock
    stands still). A request arrives at the start of the first step that
    sees it waiting or scheduled; a token is sampled at the end of the step
    that computed the last position before it.
    """

    def __init__(self, step_model: StepTimeModel) -> None:
        if not isinstance(step_model, StepTimeModel):
            raise TypeError(f"step_model must be a StepTimeModel, got {type(step_model).__name__}")
        self.step_model = step_model
        self.clock = (0.0, 0.0)
        self.steps: list[StepTime] = []
        self.arrival: dict[str, tuple[float, float]] = {}
        self.token_times: dict[str, list[tuple[float, float]]] = {}
        self._requests: dict = {}  # id -> the engine's request object (its final output length)

    def __call__(self, engine, out, outputs) -> None:
        scheduler = engine.scheduler
        start = self.clock
        for rid in list(out.num_scheduled_tokens) + [r.request_id for r in scheduler.waiting]:
            if rid not in self.arrival:
                self.arrival[rid] = start
                self.token_times[rid] = []
        for rid in out.num_scheduled_tokens:
            if rid in scheduler.requests:
                self._requests.setdefault(rid, scheduler.requests[rid])
        t = self.step_model.step_time(out.num_scheduled_tokens, out.num_computed_tokens)
        self.steps.append(t)
        self.clock = end = (start[0] + t.fast, start[1] + t.slow)
        for rid, n in out.num_scheduled_tokens.items():
            request = self._requests.get(rid)
            if request is None:
                continue
            # A step samples when it reaches the request's known length: its prompt plus the tokens
            # sampled by earlier steps (counted here, so under async scheduling before they arrive).
            if out.num_computed_tokens[rid] + n >= request.num_prompt_tokens + len(self.token_times[rid]):
                self.token_times[rid].append(end)

    def _tokens(self, rid: str) -> list[tuple[float, float]]:
        if rid not in self.token_times:
            raise KeyError(f"request {rid!r} was never seen by this trace")
        times = self.token_times[rid]
        request = self._requests.get(rid)
        # Under async scheduling a step may be scheduled past a stop token; its token is dropped.
        return times if request is None else times[:len(request.output_token_ids)]

    def ttft(self, rid: str) -> tuple[float, float] | None:
        """Time to first token, ``(fast, slow)`` seconds; None if it has none yet."""
        times = self._tokens(rid)
        if not times:
            return None
        return (times[0][0] - self.arrival[rid][0], times[0][1] - self.arrival[rid][1])

    def itl(self, rid: str) -> list[tuple[float, float]]:
        """The gaps between its consecutive tokens, ``(fast, slow)`` seconds each."""
        times = self._tokens(rid)
        return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(times, times[1:])]

    def summary(self, rids=None) -> dict[str, tuple[float, float]]:
        """Worst and mean TTFT and mean and worst ITL over ``rids`` (default: every request with a token)."""
        rids = [r for r in (self.token_times if rids is None else rids) if self._tokens(r)]
        if not rids:
            raise ValueError("no request in this trace has a token yet")
        ttfts = [self.ttft(r) for r in rids]
        gaps = [g for r in rids for g in self.itl(r)]

        def pick(values, f):
            return (f([v[0] for v in values]), f([v[1] for v in values])) if values else (0.0, 0.0)

        def mean(xs):
            return sum(xs) / len(xs)
        return {"ttft_mean": pick(ttfts, mean), "ttft_max": pick(ttfts, max),
                "itl_mean": pick(gaps, mean), "itl_max": pick(gaps, max)}
