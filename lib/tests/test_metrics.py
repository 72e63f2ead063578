"""The engine's Prometheus metrics: vLLM 0.33.0's names and types, values equal to the engine's own (issue 39 §4)."""

import random

import pytest

prom = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pagedkv.engine import EngineArgs, LLMEngine  # noqa: E402
from pagedkv.engine.metrics import KV_CACHE_RESIDENCY_BUCKETS, VLLM_METRICS, PrometheusMetrics  # noqa: E402


@pytest.fixture(scope="module")
def model():
    from pagedkv.model import Model, ModelConfig

    return Model(ModelConfig.preset("tiny"), seed=0)


def scrape(metrics):
    """{(family name, type)}, and {sample name: value} for the engine label 0."""
    families = list(text_string_to_metric_families(metrics.exposition()))
    kinds = {(f.name, f.type) for f in families if not f.name.endswith("_created")}
    values = {}
    for f in families:
        for s in f.samples:
            assert s.labels.get("engine") == "0" and s.labels.get("model_name") == "tiny"
            key = s.name if "le" not in s.labels else (s.name, s.labels["le"])
            values[key] = s.value
    return kinds, values


def busy_engine(model, **kw):
    args = dict(block_size=4, num_gpu_blocks_override=24, max_model_len=64, kernel_backend="torch",
                max_num_seqs=8, max_num_batched_tokens=64)
    args.update(kw)
    engine = LLMEngine(EngineArgs(**args), model)
    rng = random.Random(0)
    system = [rng.randrange(1, 512) for _ in range(12)]
    for i in range(6):
        engine.add_request(f"r{i}", system + [rng.randrange(1, 512) for _ in range(6)], max_tokens=20,
                           ignore_eos=True)
    return engine


def test_the_scrape_has_vllms_names_types_and_the_engines_values_at_every_step(model):
    engine = busy_engine(model)
    metrics = PrometheusMetrics(model_name="tiny").attach(engine)
    checked = []

    def compare(engine, out, outputs):
        kinds, v = scrape(metrics)
        assert kinds == set(VLLM_METRICS)
        stats = engine.stats()
        assert v["vllm:num_requests_running"] == stats.num_running
        assert v["vllm:num_requests_waiting"] == stats.num_waiting
        assert v["vllm:kv_cache_usage_perc"] == pytest.approx(stats.kv_cache_usage)
        assert v["vllm:num_preemptions_total"] == stats.num_preemptions
        prefix = engine.kv_cache_manager.prefix_cache_stats
        assert (v["vllm:prefix_cache_queries_total"], v["vllm:prefix_cache_hits_total"]) == \
            (prefix.queries, prefix.hits)
        n = len(metrics.evictions)
        assert v["vllm:kv_block_lifetime_seconds_count"] == v["vllm:kv_block_idle_before_evict_seconds_count"] == n
        assert v["vllm:kv_block_lifetime_seconds_sum"] == pytest.approx(sum(e[0] for e in metrics.evictions))
        assert v[("vllm:kv_block_lifetime_seconds_bucket", "+Inf")] == n
        assert v["vllm:kv_block_reuse_gap_seconds_count"] == sum(len(e[2]) for e in metrics.evictions)
        assert metrics.sample("vllm:num_requests_waiting") == stats.num_waiting
        assert metrics.sample("vllm:num_preemptions_total") == stats.num_preemptions
        assert metrics.sample("vllm:no_such_metric") is None
        checked.append(stats.num_running)

    engine.add_step_listener(compare)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(checked) > 10 and max(checked) > 1
    _, v = scrape(metrics)
    # The run preempted, hit the shared prefix and reused blocks: every counter moved.
    assert v["vllm:num_preemptions_total"] > 0 and v["vllm:prefix_cache_hits_total"] > 0
    assert v["vllm:kv_block_lifetime_seconds_count"] > 0
    # The hit rate a panel computes is the engine's own (new requests only).
    assert v["vllm:prefix_cache_hits_total"] / v["vllm:prefix_cache_queries_total"] == \
        pytest.approx(engine.stats().prefix_cache_hit_rate)


def test_histograms_use_vllms_buckets_and_created_samples_can_go(model):
    engine = busy_engine(model)
    metrics = PrometheusMetrics(model_name="tiny").attach(engine)
    text = metrics.exposition()
    assert "vllm:num_preemptions_created" in text
    quiet = metrics.exposition(created=False)
    assert "_created" not in quiet and "vllm:num_preemptions_total" in quiet
    _, v = scrape(metrics)
    les = sorted(float(k[1]) for k in v if isinstance(k, tuple) and k[0] == "vllm:kv_block_lifetime_seconds_bucket")
    assert les == sorted([float(b) for b in KV_CACHE_RESIDENCY_BUCKETS] + [float("inf")])


# The clock is the engine's step count. A request with max_tokens=1 spans P steps: synchronously, the step
# that computes its prompt and samples its token, then the idle step that reports it finished (P = 2).
# Under async scheduling (the default), its token is applied by the next step, scheduled while the first
# runs and empty (nothing is scheduled past a step that samples the last token), then comes the idle step
# (P = 3): vLLM's engine core calls schedule() the same three times (EngineCore.step_with_batch_queue),
# and the scheduler's decisions in each are held to vLLM's by test_scheduler_async_vs_vllm.py.
@pytest.mark.parametrize("async_scheduling, P", [(True, 3), (False, 2)], ids=["async", "sync"])
def test_residency_in_steps_by_hand(model, async_scheduling, P):
    # Blocks of 4, a 9-token prompt: blocks 1 and 2 full (cached), 3 partial.
    engine = LLMEngine(EngineArgs(block_size=4, num_gpu_blocks_override=5, max_model_len=16,
                                  kernel_backend="torch", max_num_seqs=1, max_num_batched_tokens=16,
                                  async_scheduling=async_scheduling), model)
    metrics = PrometheusMetrics(model_name="tiny").attach(engine)
    steps = []
    engine.add_step_listener(lambda engine, out, outputs: steps.append(out.total_num_scheduled_tokens))

    def run(rid, prompt):
        engine.add_request(rid, prompt, max_tokens=1, ignore_eos=True)
        while engine.has_unfinished_requests():
            engine.step()

    prompt = list(range(1, 10))
    run("a", prompt)  # step 1 allocates 1, 2, 3; P - 1 steps schedule nothing (the idle one when b arrives)
    run("b", prompt)  # step P + 1 hits 1 and 2 (an access) and pops 3 again: 3 lived P steps, idle P
    assert steps == [9] + [0] * (P - 1) + [1] + [0] * (P - 2)  # b's idle step comes with c's arrival
    assert metrics.evictions == [(P, P, ())]
    run("c", list(range(100, 113)))  # step 2P + 1 needs 4 blocks: pops 3, 4, 2, 1
    assert metrics.evictions[1:] == [(P, P, ()), (2 * P, P, ()), (2 * P, P, ())]
    _, v = scrape(metrics)
    assert v["vllm:kv_block_lifetime_seconds_sum"] == 6 * P
    assert v["vllm:kv_block_idle_before_evict_seconds_sum"] == 4 * P


@pytest.mark.parametrize("async_scheduling, P", [(True, 3), (False, 2)], ids=["async", "sync"])
def test_reuse_gaps_are_the_last_four_accesses(model, async_scheduling, P):
    engine = LLMEngine(EngineArgs(block_size=4, num_gpu_blocks_override=8, max_model_len=28,
                                  kernel_backend="torch", max_num_seqs=1, max_num_batched_tokens=16,
                                  async_scheduling=async_scheduling), model)
    metrics = PrometheusMetrics(model_name="tiny").attach(engine)
    shared = list(range(1, 9))
    for i in range(7):  # each request hits block 1 (the num_tokens - 1 cap keeps block 2 out)
        engine.add_request(f"r{i}", shared + [50 + i], max_tokens=1, ignore_eos=True)
        while engine.has_unfinished_requests():
            engine.step()
    engine.add_request("big", list(range(100, 127)), max_tokens=1, ignore_eos=True)  # evicts everything
    while engine.has_unfinished_requests():
        engine.step()
    gaps = [e[2] for e in metrics.evictions if len(e[2]) == 3]
    assert gaps and all(g == (P, P, P) for g in gaps)  # touched every P steps (one request each), last four kept


def test_bad_arguments_and_one_engine_only(model):
    with pytest.raises(ValueError, match="clock"):
        PrometheusMetrics(clock="ms")
    with pytest.raises(ValueError, match="sample_rate"):
        PrometheusMetrics(sample_rate=0)
    m = PrometheusMetrics().attach(busy_engine(model))
    with pytest.raises(ValueError, match="another engine"):
        m.attach(busy_engine(model))
    m.detach()
