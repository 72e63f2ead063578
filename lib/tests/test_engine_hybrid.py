"""The engine serves a model with two kinds of layers: a full-attention group and sliding-window groups.

Greedy decoding is deterministic, so the engine's tokens must equal those of
the model's dense path (``Model.forward_dense``: no cache, each layer's
window applied as a mask), whatever the scheduling: chunked prefill, prefix
hits across groups, preemption. Along the way the runs must show what
groups are for: a window group's manager returns blocks that left the window
while the request runs (null entries in its table), the worker's gathered
table for that group holds the null block below the window, and every
invariant holds after every step (``LLMEngine.check``: the manager's, the
coordinator's, and each group's worker row against the manager's table).
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv.engine import EngineArgs, LLMEngine
from pagedkv.grouped_kv_cache_manager import GroupedKVCacheManager
from pagedkv.kv_cache_spec import SlidingWindowSpec
from pagedkv.model import Model, ModelConfig, dense_logits

CONFIG = ModelConfig.preset("tiny-hybrid")


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(CONFIG, seed=0)


_REF: dict[tuple, list[int]] = {}


def dense_greedy(model: Model, prompt, n: int) -> list[int]:
    done = _REF.setdefault(tuple(prompt), [])
    while len(done) < n:
        logits = dense_logits(model, [list(prompt) + done])[0]
        done.append(int(torch.argmax(logits[-1])))
    return done[:n]


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(CONFIG.vocab_size) for _ in range(28)]
    return [prefix[:rng.choice([0, 12, 28])] + [rng.randrange(CONFIG.vocab_size) for _ in range(rng.randrange(6, 30))]
            for _ in range(n)]


def serve(model, prompt_list, max_tokens, **kw):
    base = dict(block_size=4, num_gpu_blocks_override=160, max_model_len=128, max_num_seqs=4,
                max_num_batched_tokens=24, kernel_backend="torch")
    base.update(kw)
    engine = LLMEngine(EngineArgs(**base), model)
    manager = engine.kv_cache_manager
    assert isinstance(manager, GroupedKVCacheManager) and manager.num_kv_cache_groups == 3
    windows = [g for g, grp in enumerate(engine.kv_cache_groups) if isinstance(grp.kv_cache_spec, SlidingWindowSpec)]
    seen = dict(null_entries=0, gathered_nulls=0, hits=0, preempted=0)
    for i, p in enumerate(prompt_list):
        engine.add_request(f"r{i}", p, max_tokens=max_tokens)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                tokens[o.request_id] = list(o.token_ids)
        engine.check()
        out = engine.last_scheduler_output
        seen["hits"] += sum(n > 0 for n in out.num_prefix_hit_tokens.values())
        seen["preempted"] += len(out.preempted_req_ids)
        for r in engine.scheduler.running:
            ids = manager.get_block_ids(r.request_id)
            seen["null_entries"] += sum(ids[g].count(0) for g in windows)
        metas = engine.worker.last_metadata_by_group
        if metas is not None and out.total_num_scheduled_tokens:
            for g in windows:
                seen["gathered_nulls"] += int((metas[g].block_table[:, :1] == 0).sum())
    engine.check()
    assert manager.get_num_free_blocks() == engine.pool.num_blocks - 1  # every block back (cached or not)
    return tokens, seen


@pytest.mark.parametrize("kw", [
    dict(),                                                   # chunked prefill, prefix caching, async
    dict(async_scheduling=False, enable_prefix_caching=False),
    dict(max_num_batched_tokens=64, async_scheduling=False),   # whole prompts in one step
])
def test_greedy_tokens_equal_the_dense_windowed_reference(model, kw):
    ps = prompts(1, 5)
    tokens, seen = serve(model, ps, 20, **kw)
    for i, p in enumerate(ps):
        assert tokens[f"r{i}"] == dense_greedy(model, p, 20), f"request r{i} ({len(p)}-token prompt), {kw}"
    assert seen["null_entries"] > 0, "no window group released a block while its request ran"
    assert seen["gathered_nulls"] > 0, "no gathered window table held the null block below the window"
    if kw.get("enable_prefix_caching", True):
        assert seen["hits"] > 0, "no prefix hit across groups"


def test_preemption_and_recompute_keep_the_tokens(model):
    ps = [p[:40] for p in prompts(2, 4)]
    tokens, seen = serve(model, ps, 20, num_gpu_blocks_override=40, max_model_len=64, max_num_batched_tokens=16)
    assert seen["preempted"] > 0, "the pool was meant to be too small for two requests as they decode"
    for i, p in enumerate(ps):
        assert tokens[f"r{i}"] == dense_greedy(model, p, 20), f"request r{i}"


def test_the_window_matters_for_these_prompts(model):
    """The reference is not blind to the window: without it, some tokens change (so a worker that
    read skipped blocks, or ignored the window, could not pass the tests above)."""
    ps = prompts(1, 5)
    windowless = Model(ModelConfig(**{**CONFIG.__dict__, "layer_types": None, "sliding_window": None}), seed=0)
    windowless.load_state_dict(model.state_dict())
    differ = [p for p in ps if dense_greedy(model, p, 20) != _greedy(windowless, p, 20)]
    assert differ


def _greedy(m, prompt, n):
    done = []
    for _ in range(n):
        done.append(int(torch.argmax(dense_logits(m, [list(prompt) + done])[0][-1])))
    return done


def test_step_history_counts_one_table_of_slots_on_a_grouped_engine(model):
    """slots_held counts the full-attention table's blocks, not the number of groups."""
    from pagedkv.engine.stats import StepHistory

    engine = LLMEngine(EngineArgs(block_size=4, num_gpu_blocks_override=160, max_model_len=128,
                                  max_num_seqs=4, max_num_batched_tokens=24, kernel_backend="torch"), model)
    history = StepHistory().attach(engine)
    for i, p in enumerate(prompts(3, 3)):
        engine.add_request(f"r{i}", p, max_tokens=8)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        record = history.records[-1]
        longest = sum(max(len(ids) for ids in engine.kv_cache_manager.get_block_ids(r.request_id))
                      for r in engine.scheduler.running)
        assert record.slots_held == longest * 4
        assert record.slots_held >= record.tokens_held
        checked += bool(engine.scheduler.running)
    assert checked > 0
