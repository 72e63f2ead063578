"""A prefix hit on blocks cached earlier in the same step reads KV written in that step.

The manager caches a request's full blocks while it schedules the step, before
the forward pass has written their keys and values (vLLM 0.33.0 does the same,
``cache_blocks``, ``v1/core/kv_cache_manager.py:625``). So a request admitted
later in the same ``schedule()`` call can hit them: two identical prompts
submitted together are admitted in one step, the second on the first's blocks.
That is safe because, within one forward pass, every layer writes the step's
K and V through the slot mapping before its attention reads the cache; the
second request's tokens then read the first's KV of that very layer.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv.engine import EngineArgs, LLMEngine, SamplingParams
from pagedkv.model import Model, ModelConfig, dense_logits

BLOCK = 4
PROMPT_LEN = 22  # 5 full blocks and 2 tokens; a hit may cover at most 21 tokens: 5 blocks


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(ModelConfig.preset("tiny"), seed=0)


def prompt_tokens() -> list[int]:
    rng = random.Random(42)
    return [rng.randrange(ModelConfig.preset("tiny").vocab_size) for _ in range(PROMPT_LEN)]


def run(model: Model, prompt: list[int], ids: list[str], caching: bool):
    """Submit every request before the first step; return the engine, the steps and the finished outputs.

    Each step also records, for every block a request hit that step, whether
    the block's keys (layer 0) were all zero just before the forward pass and
    just after it.
    """
    engine = LLMEngine(EngineArgs(block_size=BLOCK, num_gpu_blocks_override=32, max_model_len=48,
                                  max_num_batched_tokens=64, max_num_seqs=4, kernel_backend="torch",
                                  enable_prefix_caching=caching), model)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3)
    for rid in ids:
        engine.add_request(rid, prompt, sampling_params=params)
    execute = engine.worker.execute_model
    zero = {}

    def execute_and_watch(out, requests):
        hit_ids = [b for rid, n in out.num_prefix_hit_tokens.items() for b in out.new_block_ids[rid][:n // BLOCK]]
        keys = engine.worker.kv_caches[0][0]
        before = bool((keys[hit_ids] == 0).all()) if hit_ids else None
        result = execute(out, requests)
        after = bool((keys[hit_ids] == 0).all()) if hit_ids else None
        zero[out.step] = (before, after)
        return result

    engine.worker.execute_model = execute_and_watch
    steps, finals = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        steps.append(engine.last_scheduler_output)
        engine.check()
    return engine, steps, finals, zero


def test_same_step_prefix_hit_reads_kv_written_in_that_step(model):
    prompt = prompt_tokens()
    engine, steps, finals, zero = run(model, prompt, ["A", "B"], caching=True)
    first = steps[0]
    # Both are admitted in step 1, B on the 5 blocks A's allocate_slots cached moments before.
    assert first.step == 1 and first.scheduled_new_reqs == ["A", "B"]
    assert first.num_scheduled_tokens == {"A": PROMPT_LEN, "B": PROMPT_LEN - 5 * BLOCK}
    assert first.num_prefix_hit_tokens["B"] == 5 * BLOCK
    assert first.new_block_ids["B"][:5] == first.new_block_ids["A"][:5]
    assert first.summary().startswith(f"step 1: new A:{PROMPT_LEN}, new B:2 (hit 20)")
    # When the step was scheduled, B's hit blocks held no KV yet (all zeros); the
    # forward pass that computed A's prompt filled them, and B read them in it.
    assert zero[1] == (True, False)
    assert engine.stats().prefix_cache_hit_rate == pytest.approx(20 / (2 * PROMPT_LEN))

    # B equals an uncached run of the same prompt, token for token and logprob for logprob.
    _, plain_steps, plain, _ = run(model, prompt, ["B"], caching=False)
    assert plain_steps[0].num_prefix_hit_tokens.get("B", 0) == 0
    assert finals["B"].token_ids == plain["B"].token_ids == finals["A"].token_ids
    for got, want in zip(finals["B"].logprobs, plain["B"].logprobs):
        assert got.keys() == want.keys()
        for tok in want:
            assert got[tok].logprob == pytest.approx(want[tok].logprob, abs=1e-4)

    # And both equal the dense path, which has no cache at all.
    dense = []
    for _ in range(5):
        logits = dense_logits(model, [prompt + dense])[0]
        dense.append(int(torch.argmax(logits[-1])))
    assert finals["B"].token_ids == dense
