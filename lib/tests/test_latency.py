"""The step-time model (engine/latency.py): its constants are the performance model's, its floors
are the roofline's, and LatencyTrace turns an engine run into TTFT and ITL on the model's clock."""

import json
import os
import random

import pytest

from pagedkv.engine import EngineArgs, LLMEngine
from pagedkv.engine.latency import (BANDWIDTH_SHARE, TENSOR_SHARE, LatencyTrace, StepTime,
                                    StepTimeModel)
from pagedkv.model import Model, ModelConfig
from pagedkv.specs import GPUSpec

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_the_constants_are_the_performance_models():
    with open(os.path.join(ROOT, "book", "perf_model.json"), encoding="utf-8") as f:
        c = json.load(f)["constants"]
    assert tuple(c["bandwidth_share"]) == BANDWIDTH_SHARE
    peak = c["device"]["tensor_tflops"]
    assert tuple(t / peak for t in c["tensor_tflops"]) == pytest.approx(TENSOR_SHARE)
    assert StepTimeModel(gpu=c["device"]["name"]).peak_tflops == peak


def test_a_decode_step_is_bound_by_bytes_and_a_long_prefill_by_flops():
    sm = StepTimeModel("Llama-3-8B", "H200")
    decode = sm.step_time({"a": 1}, {"a": 1000})
    assert decode.bound == "memory"
    # Weights (2 bytes a parameter) and 1,001 tokens of KV (128 KiB each) at 92 % of 4,800 GB/s.
    assert decode.fast == pytest.approx((8_030_261_248 * 2 + 1001 * 131072) / (4800e9 * 0.92))
    prefill = sm.step_time({"a": 2048}, {"a": 0})
    assert prefill.bound == "compute"
    assert prefill.fast > 2 * 8_030_261_248 * 2048 / 989e12  # weights' FLOPs plus attention's
    assert 0 < decode.fast < decode.slow and prefill.fast < prefill.slow
    # 64 short decodes cost little more than one: the weights are read once for the whole batch;
    # at long contexts their KV reads add up.
    short = sm.step_time({f"r{i}": 1 for i in range(64)}, {f"r{i}": 100 for i in range(64)})
    assert short.fast < 1.1 * decode.fast
    long = sm.step_time({f"r{i}": 1 for i in range(64)}, {f"r{i}": 1000 for i in range(64)})
    assert long.fast > 1.4 * decode.fast
    assert sm.step_time({}, {}) == StepTime(0.0, 0.0, "memory")


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="no dense bf16 peak is known for 'L4'"):
        StepTimeModel(gpu="L4")
    with pytest.raises(ValueError, match="peak memory bandwidth"):
        StepTimeModel(gpu=GPUSpec.from_mib(81559), peak_tflops=989.0)
    with pytest.raises(TypeError, match="StepTimeModel"):
        LatencyTrace("H200")
    assert StepTimeModel(gpu="L4", peak_tflops=121.0).peak_tflops == 121.0


@pytest.fixture(scope="module")
def model():
    return Model(ModelConfig.preset("tiny"), seed=0)


def run(model, async_scheduling=True, **kw):
    args = dict(block_size=4, kernel_backend="torch", max_model_len=256, max_num_seqs=8,
                max_num_batched_tokens=64, num_gpu_blocks_override=200, async_scheduling=async_scheduling)
    e = LLMEngine(EngineArgs(**{**args, **kw}), model, log_fn=lambda line: None)
    trace = LatencyTrace(StepTimeModel()).attach(e)
    rng = random.Random(0)
    e.add_request("long", [rng.randrange(1, 512) for _ in range(200)], max_tokens=3, ignore_eos=True)
    for i in range(3):
        e.add_request(f"s{i}", [rng.randrange(1, 512) for _ in range(10)], max_tokens=3, ignore_eos=True)
    while e.has_unfinished_requests():
        e.step()
    return trace


def test_ttft_and_itl_come_from_the_steps_that_sample(model):
    trace = run(model, async_scheduling=False)
    # 200 + 30 prompt tokens at 64 a step: the long prompt takes the whole budget for three steps,
    # the short ones finish their prompts in the fourth, beside the long one's last 8 tokens.
    clock = [0.0]
    for t in trace.steps:
        clock.append(clock[-1] + t.fast)
    assert trace.ttft("long")[0] == pytest.approx(clock[4])
    assert trace.ttft("s0")[0] == pytest.approx(clock[4])
    assert len(trace.itl("long")) == 2
    assert trace.itl("long")[0][0] == pytest.approx(trace.steps[4].fast)
    assert all(fast <= slow for fast, slow in trace.itl("s1"))
    summary = trace.summary()
    assert summary["ttft_max"][0] == pytest.approx(clock[4])


def test_async_and_sync_give_the_same_times(model):
    a, s = run(model, True), run(model, False)
    for rid in ("long", "s0", "s1", "s2"):
        assert a.ttft(rid) == pytest.approx(s.ttft(rid))
        assert [g for pair in a.itl(rid) for g in pair] == pytest.approx([g for pair in s.itl(rid) for g in pair])


def test_the_long_prefill_threshold_lets_short_prompts_through(model):
    before = run(model, async_scheduling=True)
    after = run(model, async_scheduling=True, long_prefill_token_threshold=32)
    assert after.ttft("s0")[0] < before.ttft("s0")[0] / 2
    assert after.ttft("long")[0] > before.ttft("long")[0]  # the long prompt pays for it


def test_the_priority_policy_serves_a_smaller_priority_first(model):
    def first_token_order(policy):
        e = LLMEngine(EngineArgs(block_size=4, kernel_backend="torch", max_model_len=64, max_num_seqs=1,
                                 max_num_batched_tokens=64, num_gpu_blocks_override=64,
                                 scheduling_policy=policy), model, log_fn=lambda line: None)
        trace = LatencyTrace(StepTimeModel()).attach(e)
        for i in range(3):
            e.add_request(f"r{i}", [5 + i] * 10, max_tokens=2, ignore_eos=True, priority=1)
        e.add_request("urgent", [9] * 10, max_tokens=2, ignore_eos=True, priority=0)
        while e.has_unfinished_requests():
            e.step()
        return sorted(trace.token_times, key=lambda rid: trace.ttft(rid)[0])
    assert first_token_order("fcfs") == ["r0", "r1", "r2", "urgent"]
    assert first_token_order("priority") == ["urgent", "r0", "r1", "r2"]
    with pytest.raises(TypeError, match="priority"):
        LLMEngine(EngineArgs(kernel_backend="torch", max_model_len=64, num_gpu_blocks_override=64),
                  model).add_request("x", [1, 2], priority=1.5)
