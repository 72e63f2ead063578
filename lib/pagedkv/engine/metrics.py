"""The engine's metrics under vLLM 0.33.0's Prometheus names, through ``prometheus_client``.

``PrometheusMetrics`` is a step listener: attached to an ``LLMEngine``, it
sets vLLM's gauges and counters after every step, in a registry of its own,
and ``exposition()`` returns the text a ``/metrics`` endpoint would serve.
A dashboard built on these names reads a real server, because they are the
names, types and label names ``PrometheusStatLogger`` registers in vLLM
0.33.0 (``v1/metrics/loggers.py``):

========================================  =========  =============================================
name                                      type       what it counts here
========================================  =========  =============================================
``vllm:num_requests_running``             gauge      requests in the running queue
``vllm:num_requests_waiting``             gauge      requests waiting (preempted ones included)
``vllm:kv_cache_usage_perc``              gauge      fraction of usable blocks held (1 = 100 %);
                                                     a cached block nobody holds counts as free
``vllm:num_preemptions``                  counter    preemptions since the start
``vllm:prefix_cache_queries``             counter    prompt tokens looked up, at admission
``vllm:prefix_cache_hits``                counter    of those, tokens found cached
``vllm:kv_block_lifetime_seconds``        histogram  a block's allocation to its reuse
``vllm:kv_block_idle_before_evict_seconds`` histogram  its last access to its reuse
``vllm:kv_block_reuse_gap_seconds``       histogram  gaps between accesses (the last four)
========================================  =========  =============================================

Counters are exposed as prometheus_client exposes vLLM's: the samples carry
``_total`` (``vllm:num_preemptions_total``), histograms ``_bucket``,
``_count`` and ``_sum``. Every sample has vLLM's labels ``model_name`` and
``engine``. The prefix-cache counters count a request the first time it is
admitted; a request admitted again after a preemption is left out, as vLLM
leaves it out (``PrefixCacheStats.record``). So the hit rate a panel computes,
``rate(vllm:prefix_cache_hits_total) / rate(vllm:prefix_cache_queries_total)``,
is that of new requests.

**Block residency.** vLLM samples blocks (``--kv-cache-metrics``, 1 % by
default): a sampled block's clock starts when it is allocated; a prefix hit
is an access; when the block is popped from the free queue again (reused, its
cache entry evicted) its lifetime, its idle time since the last access and
the gaps between its last accesses are observed. Here every block is sampled
unless ``sample_rate`` says otherwise, and the clock is the engine's step
count by default (``clock="steps"``: one "second" is one step, so outputs do
not depend on the machine); ``clock="seconds"`` uses ``time.monotonic`` as
vLLM does. The buckets are vLLM's (``KV_CACHE_RESIDENCY_BUCKETS``).
"""

from __future__ import annotations

import random
import re
import time
from collections import deque

from ..common import check_real

__all__ = ["PrometheusMetrics", "VLLM_METRICS", "KV_CACHE_RESIDENCY_BUCKETS"]

#: (name, type) of every metric exposed, as vLLM 0.33.0 registers it.
VLLM_METRICS: tuple[tuple[str, str], ...] = (
    ("vllm:num_requests_running", "gauge"),
    ("vllm:num_requests_waiting", "gauge"),
    ("vllm:kv_cache_usage_perc", "gauge"),
    ("vllm:num_preemptions", "counter"),
    ("vllm:prefix_cache_queries", "counter"),
    ("vllm:prefix_cache_hits", "counter"),
    ("vllm:kv_block_lifetime_seconds", "histogram"),
    ("vllm:kv_block_idle_before_evict_seconds", "histogram"),
    ("vllm:kv_block_reuse_gap_seconds", "histogram"),
)

#: vLLM 0.33.0's buckets for the three residency histograms (``v1/metrics/buckets.py``).
KV_CACHE_RESIDENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600,
    1200, 1800)

_DOCS = {  # vLLM's help strings
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:num_preemptions": "Cumulative number of preemption from the engine.",
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:kv_block_lifetime_seconds": "Histogram of KV cache block lifetime from allocation to eviction.",
    "vllm:kv_block_idle_before_evict_seconds": "Histogram of idle time before KV cache block eviction.",
    "vllm:kv_block_reuse_gap_seconds": "Histogram of time gaps between consecutive KV cache block accesses.",
}


class _BlockClock:
    """One sampled block's times: born, last accessed, the last four accesses."""

    __slots__ = ("born", "last", "history")

    def __init__(self, now: float):
        self.born = self.last = now
        self.history: deque[float] = deque(maxlen=4)


class PrometheusMetrics:
    """vLLM's Prometheus metrics for one ``LLMEngine``, in a registry of their own.

    Use ``metrics = PrometheusMetrics(model_name="tiny").attach(engine)``, run
    the engine, then ``metrics.exposition()`` (the text format) or
    ``metrics.registry`` (for ``prometheus_client.start_http_server(port,
    registry=metrics.registry)``). Attach before the first step, or the
    residency clocks miss blocks allocated earlier.

    Args:
        model_name: the ``model_name`` label (vLLM: the served model name).
        engine_index: the ``engine`` label (vLLM: the engine core's index).
        clock: ``"steps"`` (default; the engine's step count) or
            ``"seconds"`` (``time.monotonic``).
        sample_rate: share of allocated blocks whose residency is tracked
            (vLLM's ``--kv-cache-metrics-sample``; 1.0: all).
        seed: seeds the sampling.
    """

    def __init__(self, model_name: str = "pagedkv", engine_index: int = 0, clock: str = "steps",
                 sample_rate: float = 1.0, seed: int = 0) -> None:
        import prometheus_client as prom

        if clock not in ("steps", "seconds"):
            raise ValueError(f"clock must be 'steps' or 'seconds', got {clock!r}")
        check_real(sample_rate, "sample_rate", minimum=0, maximum=1, open_min=True)
        self.clock, self.sample_rate = clock, sample_rate
        self._rng = random.Random(seed)
        self.registry = prom.CollectorRegistry()
        labels = self._labels = {"model_name": str(model_name), "engine": str(engine_index)}
        names = ["model_name", "engine"]

        def make(kind, name, **kw):
            cls = {"gauge": prom.Gauge, "counter": prom.Counter, "histogram": prom.Histogram}[kind]
            return cls(name, _DOCS[name], labelnames=names, registry=self.registry, **kw).labels(**labels)

        self.running = make("gauge", "vllm:num_requests_running")
        self.waiting = make("gauge", "vllm:num_requests_waiting")
        self.usage = make("gauge", "vllm:kv_cache_usage_perc")
        self.preemptions = make("counter", "vllm:num_preemptions")
        self.queries = make("counter", "vllm:prefix_cache_queries")
        self.hits = make("counter", "vllm:prefix_cache_hits")
        self.lifetime = make("histogram", "vllm:kv_block_lifetime_seconds", buckets=KV_CACHE_RESIDENCY_BUCKETS)
        self.idle = make("histogram", "vllm:kv_block_idle_before_evict_seconds",
                         buckets=KV_CACHE_RESIDENCY_BUCKETS)
        self.reuse_gap = make("histogram", "vllm:kv_block_reuse_gap_seconds", buckets=KV_CACHE_RESIDENCY_BUCKETS)
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0}
        self._blocks: dict[int, _BlockClock] = {}
        self._engine = None
        self._steps = 0  # steps seen since attached
        self._unsubscribe = []
        #: (lifetime, idle, reuse gaps) of every block observed, in order (what the histograms hold).
        self.evictions: list[tuple[float, float, tuple[float, ...]]] = []

    # ------------------------------------------------------------ wiring
    def attach(self, engine) -> "PrometheusMetrics":
        """Listen to ``engine``'s steps and its block pool's events (once); returns self."""
        if self._engine is not None:
            if self._engine is engine:
                return self
            raise ValueError("these metrics are attached to another engine already")
        self._engine = engine
        self._caching = engine.kv_cache_manager.enable_caching
        self._unsubscribe = [engine.add_step_listener(self),
                             engine.kv_cache_manager.block_pool.subscribe(self._on_pool_event)]
        self._update(engine)
        return self

    def detach(self) -> None:
        """Stop listening (the values stay)."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe, self._engine = [], None

    def _now(self) -> float:
        if self.clock == "seconds":
            return time.monotonic()
        return float(self._steps + 1)  # the step being run: events inside step n happen at time n

    # ------------------------------------------------------------ events
    def _on_pool_event(self, pool, event) -> None:
        if event.kind == "allocate":
            now = self._now()
            for block_id in event.block_ids:
                # vLLM closes a sampled block's record when it is popped again
                # (its cache entry, if any, evicted), then may sample it anew.
                old = self._blocks.pop(block_id, None)
                if old is not None and self._caching:
                    gaps = list(old.history)
                    observed = (now - old.born, now - old.last,
                                tuple(b - a for a, b in zip(gaps, gaps[1:])))
                    self.evictions.append(observed)
                    self.lifetime.observe(observed[0])
                    self.idle.observe(observed[1])
                    for gap in observed[2]:
                        self.reuse_gap.observe(gap)
                if self.sample_rate >= 1 or self._rng.random() < self.sample_rate:
                    self._blocks[block_id] = _BlockClock(now)
        elif event.kind == "touch":
            now = self._now()
            for block_id in event.block_ids:
                clock = self._blocks.get(block_id)
                if clock is not None:
                    clock.last = now
                    clock.history.append(now)
        elif event.kind == "reset":  # vLLM clears its residency state on a cache reset
            self._blocks.clear()

    def __call__(self, engine, out, outputs) -> None:
        self._steps += 1
        self._update(engine)

    def _update(self, engine) -> None:
        scheduler, manager = engine.scheduler, engine.kv_cache_manager
        self.running.set(scheduler.num_running)
        self.waiting.set(scheduler.num_waiting)
        self.usage.set(manager.usage)
        stats = manager.prefix_cache_stats
        for key, counter, value in (("preemptions", self.preemptions, scheduler.num_preemptions),
                                    ("queries", self.queries, stats.queries),
                                    ("hits", self.hits, stats.hits)):
            seen = self._seen[key]
            counter.inc(value - seen if value >= seen else value)  # a reset starts the count afresh
            self._seen[key] = value

    # ------------------------------------------------------------ reading
    def sample(self, name: str) -> float | None:
        """One sample's value by its exposed name (``"vllm:num_preemptions_total"``,
        ``"vllm:kv_block_lifetime_seconds_count"``), for this engine's labels; None if absent."""
        return self.registry.get_sample_value(name, self._labels)

    def exposition(self, created: bool = True) -> str:
        """The Prometheus text format, as ``GET /metrics`` would return it.

        ``created=False`` drops the ``*_created`` samples (the Unix time each
        counter and histogram was made, which prometheus_client adds and vLLM
        keeps), so that the text depends on the run alone.
        """
        import prometheus_client as prom

        text = prom.generate_latest(self.registry).decode("utf-8")
        if created:
            return text
        created_line = re.compile(r"(?:# (?:HELP|TYPE) )?\S+_created[{ ]")
        return "".join(line for line in text.splitlines(keepends=True) if not created_line.match(line))
