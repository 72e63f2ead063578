"""Engine statistics and the periodic log line, as vLLM's ``LoggingStatLogger`` prints it.

Counters accumulate per step; an *interval* runs from one log line to the
next (or from the start, when the engine never logs). Throughputs divide the
interval's tokens by the time its steps took (busy time, so a notebook that
pauses between calls does not dilute them; vLLM divides by wall time between
log lines, which on a busy server is the same thing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from ..common import check_int

__all__ = ["EngineStats", "StatsCollector", "StepListener", "StepRecord", "StepHistory"]


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine.

    Attributes:
        step: steps run so far.
        num_running, num_waiting: requests in each queue.
        kv_cache_usage: fraction of usable blocks in use (0..1).
        num_preemptions: preemptions since the engine started.
        num_preemptions_interval: preemptions in the current interval.
        prefix_cache_hit_rate: cached prompt tokens / prompt tokens looked up,
            over every admission of a never-preempted request since the
            engine started (0..1); None when prefix caching is off. This is
            cumulative: vLLM's log line covers the last 1,000 requests only
            (``CachingMetrics``, ``vllm/v1/metrics/stats.py``), so on a long
            run the two differ.
        prompt_throughput: prompt tokens computed per second in the interval
            (cache hits excluded, recomputation after preemption included).
        generation_throughput: tokens generated per second in the interval.
    """

    step: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    num_preemptions_interval: int
    prefix_cache_hit_rate: float | None
    prompt_throughput: float
    generation_throughput: float

    def log_line(self, kv_cache_device: str = "GPU") -> str:
        """vLLM's log line (``vllm/v1/metrics/loggers.py``), with the step number in the prefix.

        ``kv_cache_device`` names the cache as vLLM does ("GPU" on CUDA).
        """
        parts = [f"Avg prompt throughput: {self.prompt_throughput:.1f} tokens/s",
                 f"Avg generation throughput: {self.generation_throughput:.1f} tokens/s",
                 f"Running: {self.num_running} reqs", f"Waiting: {self.num_waiting} reqs"]
        if self.num_preemptions_interval:
            parts.append(f"Preemptions: {self.num_preemptions_interval}")
        parts.append(f"{kv_cache_device} KV cache usage: {self.kv_cache_usage * 100:.1f}%")
        if self.prefix_cache_hit_rate is not None:
            parts.append(f"Prefix cache hit rate: {self.prefix_cache_hit_rate * 100:.1f}%")
        return f"Engine 000 (step {self.step}): " + ", ".join(parts)


class StatsCollector:
    """Per-step counters for the current interval and in total."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0
        self.total_busy_s = 0.0
        self._reset_interval()

    def _reset_interval(self) -> None:
        self.interval_prompt_tokens = 0
        self.interval_generation_tokens = 0
        self.interval_preemptions = 0
        self.interval_busy_s = 0.0

    def record_step(self, num_prompt_tokens: int, num_generation_tokens: int, num_preemptions: int,
                    seconds: float) -> None:
        self.num_steps += 1
        self.total_prompt_tokens += num_prompt_tokens
        self.total_generation_tokens += num_generation_tokens
        self.total_busy_s += seconds
        self.interval_prompt_tokens += num_prompt_tokens
        self.interval_generation_tokens += num_generation_tokens
        self.interval_preemptions += num_preemptions
        self.interval_busy_s += seconds

    def snapshot(self, *, num_running: int, num_waiting: int, kv_cache_usage: float, num_preemptions: int,
                 prefix_cache_hit_rate: float | None) -> EngineStats:
        t = self.interval_busy_s
        return EngineStats(
            step=self.num_steps, num_running=num_running, num_waiting=num_waiting,
            kv_cache_usage=kv_cache_usage, num_preemptions=num_preemptions,
            num_preemptions_interval=self.interval_preemptions,
            prefix_cache_hit_rate=prefix_cache_hit_rate,
            prompt_throughput=self.interval_prompt_tokens / t if t > 0 else 0.0,
            generation_throughput=self.interval_generation_tokens / t if t > 0 else 0.0,
        )

    def end_interval(self) -> None:
        """Start a new interval (after a log line)."""
        self._reset_interval()


@dataclass(frozen=True)
class StepRecord:
    """What one engine step did to the KV cache (see ``StepHistory``).

    Attributes:
        step: the scheduler's step number (1 for the first).
        kv_cache_usage: fraction of usable blocks in use after the step.
        num_running, num_waiting: queue lengths after the step.
        num_scheduled_tokens: request id -> tokens computed this step.
        preempted: request ids preempted this step, in order.
        resumed: preempted request ids admitted again this step.
        prefix_hit_tokens: admitted request id -> tokens served by the prefix
            cache this step (new and resumed requests; zero hits omitted).
        slots_held: token slots in the blocks the running requests hold
            (a block shared by two requests counts twice).
        tokens_held: tokens whose KV those requests have in the cache.
            ``1 - tokens_held / slots_held`` is the internal fragmentation:
            the unused tail of each request's last block.
    """

    step: int
    kv_cache_usage: float
    num_running: int
    num_waiting: int
    num_scheduled_tokens: dict
    preempted: tuple
    resumed: tuple
    prefix_hit_tokens: dict
    slots_held: int = 0
    tokens_held: int = 0

    @property
    def internal_fragmentation(self) -> float:
        """Share of the running requests' slots that hold no token (0 when none are held)."""
        return 1 - self.tokens_held / self.slots_held if self.slots_held else 0.0


class StepListener:
    """Base of the listeners an engine calls after every step (``engine.add_step_listener``).

    A subclass defines ``__call__(engine, out, outputs)``; this base only
    subscribes and unsubscribes it. Invariant: a listener is subscribed to at
    most one engine, at most once (``_unsubscribe`` is None exactly when it is
    not subscribed), so attaching twice cannot record every step twice.
    """

    _unsubscribe = None  # the engine's undo for our subscription, while attached

    def attach(self, engine) -> Self:
        """Subscribe to ``engine``'s steps (once); returns self."""
        if self._unsubscribe is None:
            self._unsubscribe = engine.add_step_listener(self)
        return self

    def detach(self) -> None:
        """Stop listening (what was recorded stays)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None


class StepHistory(StepListener):
    """A step listener that records every step's KV usage, preemptions, resumes and prefix hits.

    Works with any ``EngineArgs`` and any model: it reads only the
    scheduler's output and the engine's queues. Use it as
    ``history = StepHistory(); history.attach(engine)`` (or pass it to
    ``engine.add_step_listener``), run the engine, then read
    ``history.records`` or draw ``pagedkv.views.kv_usage_figure(history)``.

    Args:
        max_steps: keep at most this many records (the oldest are dropped
            first), so a long run cannot grow without bound; None: keep all.
    """

    def __init__(self, max_steps: int | None = None) -> None:
        if max_steps is not None:
            check_int(max_steps, "max_steps", 1)
        self.max_steps = max_steps
        self.records: list[StepRecord] = []

    def __call__(self, engine, out, outputs) -> None:
        scheduler = engine.scheduler
        hits = {rid: n for rid, n in out.num_prefix_hit_tokens.items() if n}
        manager, block_size = engine.kv_cache_manager, engine.args.block_size
        slots = sum(_blocks_held(manager.get_block_ids(r.request_id)) for r in scheduler.running) * block_size
        tokens = sum(r.num_computed_tokens for r in scheduler.running)
        self.records.append(StepRecord(
            step=out.step, kv_cache_usage=engine.kv_cache_manager.usage,
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
            num_scheduled_tokens=dict(out.num_scheduled_tokens),
            preempted=tuple(out.preempted_req_ids), resumed=tuple(out.scheduled_resumed_reqs),
            prefix_hit_tokens=hits, slots_held=slots, tokens_held=tokens))
        if self.max_steps is not None and len(self.records) > self.max_steps:
            del self.records[0]

    # ------------------------------------------------------------- read-outs
    def __len__(self) -> int:
        return len(self.records)

    @property
    def steps(self) -> list[int]:
        return [r.step for r in self.records]

    @property
    def usage(self) -> list[float]:
        return [r.kv_cache_usage for r in self.records]

    def events(self) -> list[tuple[int, str, str]]:
        """``(step, "preempted" | "resumed", request id)`` in the order they happened."""
        found = []
        for r in self.records:
            found += [(r.step, "preempted", rid) for rid in r.preempted]
            found += [(r.step, "resumed", rid) for rid in r.resumed]
        return found

    def first(self, kind: str) -> tuple[int, str] | None:
        """``(step, request id)`` of the first ``"preempted"`` or ``"resumed"`` event, or None."""
        if kind not in ("preempted", "resumed"):
            raise ValueError(f"kind must be 'preempted' or 'resumed', got {kind!r}")
        for step, k, rid in self.events():
            if k == kind:
                return step, rid
        return None

    @property
    def num_preemptions(self) -> int:
        return sum(len(r.preempted) for r in self.records)

    @property
    def peak_usage(self) -> float:
        return max(self.usage, default=0.0)


def _blocks_held(block_ids) -> int:
    """Blocks one request holds, for the slots-against-tokens figure.

    A one-group manager gives a list of ids; a grouped one gives one list per
    KV-cache group. There the longest list is counted: it is the group that
    keeps every token (full attention), so ``tokens_held / slots_held`` stays
    the internal fragmentation of one table, not a sum over groups.
    """
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return max(len(ids) for ids in block_ids)
    return len(block_ids)

