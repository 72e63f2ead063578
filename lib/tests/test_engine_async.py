"""Async scheduling, vLLM 0.33.0's default: the flag, output placeholders, and the same tokens both ways.

What a placeholder is and what a stop token, an abort and a preemption do
to it are checked here on the library alone; ``test_async_scheduler_vllm``
holds the same steps to vLLM's own ``AsyncScheduler`` read from the wheel.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv.engine import (AsyncScheduler, EngineArgs, LLMEngine, ModelRunnerOutput, SamplingParams,
                            Scheduler)
from pagedkv.engine.request import EngineRequest, RequestStatus
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.model import Model, ModelConfig, load_gguf, smollm2_available, smollm2_path, SMOLLM2_INSTALL


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(ModelConfig.preset("tiny"), seed=0)


def args(**kw) -> EngineArgs:
    base = dict(block_size=4, num_gpu_blocks_override=64, max_model_len=96, max_num_seqs=8,
                max_num_batched_tokens=64, kernel_backend="torch")
    return EngineArgs(**{**base, **kw})


# ------------------------------------------------------------------------------ the flag


def test_async_scheduling_is_vllms_flag_and_default(model):
    a = EngineArgs()
    assert a.async_scheduling is True
    assert "--async-scheduling" in a.to_cli()
    assert "--no-async-scheduling" in a.replace(async_scheduling=False).to_cli()
    assert "async-scheduling" not in EngineArgs(async_scheduling=True).to_cli(only_changed=True)
    assert EngineArgs(async_scheduling=False).to_cli("m", only_changed=True) == \
        "vllm serve m \\\n  --no-async-scheduling"
    assert {f: flag for f, flag, _ in a.cli_table()}["async_scheduling"] == "--async-scheduling"
    with pytest.raises(TypeError, match="async_scheduling"):
        EngineArgs(async_scheduling=1)
    assert type(LLMEngine(args(), model).scheduler) is AsyncScheduler
    assert type(LLMEngine(args(async_scheduling=False), model).scheduler) is Scheduler


# -------------------------------------------------------------------- output placeholders


def test_the_next_step_is_scheduled_and_its_slot_allocated_before_the_token_exists(model):
    engine = LLMEngine(args(), model)
    engine.add_request("A", [1, 2, 3, 4], max_tokens=5, ignore_eos=True)  # one full block of 4
    A = engine.scheduler.requests["A"]
    assert engine.step() == []  # step 1 ran; its token is not applied yet
    assert (A.num_computed_tokens, A.num_output_placeholders, A.num_tokens) == (4, 1, 4)
    assert len(engine.kv_cache_manager.get_block_ids("A")) == 1
    outs = engine.step()  # schedules step 2 first: position 4, the token step 1 is sampling
    out = engine.last_scheduler_output
    assert out.num_computed_tokens == {"A": 4} and out.num_scheduled_tokens == {"A": 1}
    assert len(out.new_block_ids["A"]) == 1  # the block for a token not yet sampled when it was allocated
    assert [o.new_token_ids for o in outs] == [[A.output_token_ids[0]]]  # then step 1's token arrived
    assert (A.num_computed_tokens, A.num_output_placeholders, A.num_tokens) == (5, 1, 5)
    engine.check()


def test_no_step_past_max_tokens_and_one_empty_step_while_the_last_token_is_in_flight(model):
    for max_tokens in (1, 2, 3):
        engine = LLMEngine(args(), model)
        seen = []
        engine.add_step_listener(lambda e, out, outputs: seen.append(out))
        engine.add_request("A", [1, 2, 3], max_tokens=max_tokens, ignore_eos=True)
        while engine.has_unfinished_requests():
            engine.step()
        scheduled = [dict(out.num_scheduled_tokens) for out in seen]
        # The prefill samples token 1; each later step one more; then a step with nothing to run
        # while the last token is in flight (vLLM schedules it too: its batch queue holds two).
        assert scheduled == [{"A": 3}] + [{"A": 1}] * (max_tokens - 1) + [{}], max_tokens


def test_a_stop_token_finishes_the_request_and_drops_the_step_already_scheduled(model):
    ref = LLMEngine(args(async_scheduling=False), model).generate([[1, 2, 3]], max_tokens=6)[0].token_ids
    stop = ref[2]  # the third token becomes a stop token
    assert stop not in ref[:2], ref
    params = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop])
    sync = LLMEngine(args(async_scheduling=False), model)
    engine = LLMEngine(args(), model)
    for e in (sync, engine):
        e.add_request("A", [1, 2, 3], sampling_params=params)
    seen = []
    engine.add_step_listener(lambda e, out, outputs: seen.append((dict(out.num_scheduled_tokens), outputs)))
    finals = {}
    for e in (sync, engine):
        while e.has_unfinished_requests():
            for o in e.step():
                finals.setdefault(id(e), o)
                finals[id(e)] = o
    assert finals[id(sync)].token_ids == finals[id(engine)].token_ids == ref[:3]
    # Step 4 (the fourth token's forward) was scheduled before the stop token arrived with step 3.
    steps = [s for s, _ in seen]
    assert steps[:4] == [{"A": 3}, {"A": 1}, {"A": 1}, {"A": 1}]
    assert seen[3][1][0].finish_reason == "stop" and seen[3][1][0].stop_reason == stop
    assert engine.kv_cache_manager.get_num_free_blocks() == 63
    engine.step()  # the idle step reports A; step 4's token, for a finished request, was dropped
    assert engine.last_scheduler_output.finished_req_ids == ["A"]
    assert finals[id(engine)].token_ids == ref[:3] and not engine.step()
    engine.check()


def test_abort_drops_the_token_in_flight(model):
    engine = LLMEngine(args(), model)
    engine.add_request("A", [1, 2, 3], max_tokens=8, ignore_eos=True)
    engine.step(), engine.step()
    engine.abort_request("A")  # step 2 has run, its token not applied
    assert engine.kv_cache_manager.get_num_free_blocks() == 63
    outs = engine.step()
    assert [(o.finish_reason, len(o.token_ids)) for o in outs] == [("abort", 1)]
    assert engine.last_scheduler_output.finished_req_ids == ["A"] and not engine.step()


def done(sched: Scheduler, out, token: int = 7) -> None:
    """Apply a step's output: ``token`` for every request whose step samples."""
    sampled = {}
    for rid, n in out.num_scheduled_tokens.items():
        r = sched.requests.get(rid)
        if r is not None and out.num_computed_tokens[rid] + n >= r.num_prompt_tokens:
            sampled[rid] = token
    sched.update_from_output(out, ModelRunnerOutput(sampled))
    sched.check()


def test_a_preemption_resets_placeholders_and_makes_the_output_in_flight_stale():
    manager = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable blocks
    sched = AsyncScheduler(manager, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32)
    sched.add_request(EngineRequest("A", [1, 2, 3, 4, 5, 6, 7, 8], 8, ignore_eos=True))
    sched.add_request(EngineRequest("B", [11, 12, 13, 14, 15, 16, 17, 18], 8, ignore_eos=True))
    s1 = sched.schedule()  # A and B: 2 blocks each, the pool is full
    s2 = sched.schedule()  # both need position 8, a third block: B (last) is preempted
    assert s2.preempted_req_ids == ["B"] and s2.num_scheduled_tokens == {"A": 1}
    B = sched.waiting[0]
    assert (B.num_computed_tokens, B.num_output_placeholders, B.num_stale_output_tokens) == (0, 0, 8)
    done(sched, s1)  # step 1's token for B arrives stale: appended, no counter moves
    assert B.output_token_ids == [7] and (B.num_computed_tokens, B.num_stale_output_tokens) == (0, 0)
    A = sched.running[0]
    assert (A.num_computed_tokens, A.num_output_placeholders, A.num_tokens) == (9, 1, 9)
    done(sched, s2)
    s3 = sched.schedule()  # a step that preempted admitted nothing; now A runs on, B still waits
    assert "B" not in s3.num_scheduled_tokens and B.status == RequestStatus.PREEMPTED


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 200) for _ in range(9)]
    return [shared[:rng.randrange(0, 9)] + [rng.randrange(1, 200) for _ in range(rng.randrange(1, 14))]
            for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_tokens_are_the_same_both_ways_under_preemption_and_prefix_hits(model, seed):
    prompts = _prompts(10, seed)
    rng = random.Random(seed)
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 12), ignore_eos=rng.random() < 0.5)
              for _ in prompts]
    tight = dict(num_gpu_blocks_override=14, max_model_len=40, max_num_seqs=6, max_num_batched_tokens=20)
    results, preemptions = {}, {}
    for on in (False, True):
        engine = LLMEngine(args(async_scheduling=on, **tight), model)
        results[on] = [o.token_ids for o in engine.generate(prompts, sampling_params=params)]
        preemptions[on] = engine.stats().num_preemptions
        engine.step(), engine.step()
        engine.check()
        assert engine.kv_cache_manager.get_num_free_blocks() == 13
    assert results[True] == results[False]
    assert preemptions[True] > 0 and preemptions[False] > 0


def test_seeded_sampling_is_the_same_both_ways(model):
    prompts = _prompts(6, 5)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=9)
    out = {on: [o.token_ids for o in LLMEngine(args(async_scheduling=on), model).generate(prompts,
                                                                                      sampling_params=params)]
           for on in (False, True)}
    assert out[True] == out[False]


# ------------------------------------------------------------------------- the real model


@pytest.mark.skipif(not smollm2_available(), reason=f"SmolLM2-135M-Instruct is not installed ({SMOLLM2_INSTALL})")
def test_real_model_greedy_output_is_token_for_token_the_same_both_ways():
    model = load_gguf(smollm2_path(), device="cpu")
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 40))] for _ in range(8)]
    tokens, steps = {}, {}
    for on in (False, True):
        engine = LLMEngine(EngineArgs(num_gpu_blocks_override=12, block_size=16, max_model_len=128,
                                      max_num_seqs=8, max_num_batched_tokens=64, kernel_backend="torch",
                                      async_scheduling=on), model)
        with torch.no_grad():
            tokens[on] = [o.token_ids for o in engine.generate(prompts, max_tokens=20)]
        steps[on] = engine.stats().num_preemptions
    assert tokens[True] == tokens[False]
    assert steps[True] > 0 and steps[False] > 0  # the pool of 11 blocks forced preemptions both ways
