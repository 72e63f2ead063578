"""Engine statistics and the periodic log line, as vLLM's ``LoggingStatLogger`` prints it.

Counters accumulate per step; an *interval* runs from one log line to the
next (or from the start, when the engine never logs). Throughputs divide the
interval's tokens by the time its steps took (busy time, so a notebook that
pauses between calls does not dilute them; vLLM divides by wall time between
log lines, which on a busy server is the same thing).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineStats", "StatsCollector"]


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
            over every admission of a never-preempted request (0..1); None
            when prefix caching is off.
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

    def log_line(self) -> str:
        """vLLM's log line (``vllm/v1/metrics/loggers.py``), with the step number in the prefix."""
        parts = [f"Avg prompt throughput: {self.prompt_throughput:.1f} tokens/s",
                 f"Avg generation throughput: {self.generation_throughput:.1f} tokens/s",
                 f"Running: {self.num_running} reqs", f"Waiting: {self.num_waiting} reqs"]
        if self.num_preemptions_interval:
            parts.append(f"Preemptions: {self.num_preemptions_interval}")
        parts.append(f"KV cache usage: {self.kv_cache_usage * 100:.1f}%")
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
