"""The serving engine: tokens equal the dense reference's, whatever the scheduling; vLLM V1's decisions.

Greedy decoding is deterministic, so every configuration (block size, prefix
caching, chunked prefill, preemption, kernel backend) must produce the tokens
of the model's dense path (``Model.forward_dense``, no cache at all). The
scheduler's decisions are checked step by step against vLLM V1's rules, and a
randomized run checks every invariant after every step.
"""

from __future__ import annotations

import dataclasses
import random
import re

import pytest
import torch

from pagedkv import budget
from pagedkv.engine import (EngineArgs, EngineStats, LLMEngine, ModelRunnerOutput, RequestOutput, RequestStatus,
                            Scheduler, SchedulerOutput, preempt_last_running)
from pagedkv.engine.request import EngineRequest
from pagedkv.engine.sizing import dummy_batch, model_spec_of
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.common import cdiv
from pagedkv.model import Model, ModelConfig, dense_logits
from pagedkv.views.engine_trace import EngineTrace

VOCAB = ModelConfig.preset("tiny").vocab_size


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(ModelConfig.preset("tiny"), seed=0)


_REF: dict[tuple, list[int]] = {}


def dense_greedy(model: Model, prompt, n: int) -> list[int]:
    """Greedy tokens from the dense path (the whole sequence re-run for every token; cached per prompt)."""
    done = _REF.setdefault((id(model), tuple(prompt)), [])
    while len(done) < n:
        logits = dense_logits(model, [list(prompt) + done])[0]
        done.append(int(torch.argmax(logits[-1])))
    return done[:n]


def prompts_with_shared_prefixes(seed: int, n: int, prefix_len: int = 24, max_suffix: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(prefix_len)] for _ in range(2)]
    return [rng.choice(prefixes)[: rng.randrange(0, prefix_len + 1)]
            + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, max_suffix))] for _ in range(n)]


def tiny_args(**kw) -> EngineArgs:
    base = dict(block_size=4, num_gpu_blocks_override=64, max_model_len=96, max_num_seqs=8,
                max_num_batched_tokens=64, kernel_backend="torch")
    base.update(kw)
    return EngineArgs(**base)


def run_all(engine: LLMEngine, check: bool = True) -> list[SchedulerOutput]:
    decisions = []
    while engine.has_unfinished_requests():
        engine.step()
        decisions.append(engine.last_scheduler_output)
        if check:
            engine.check()
    return decisions


# ---------------------------------------------------------------------------- EngineArgs


def test_engine_args_defaults_are_vllms_and_map_to_cli_flags():
    a = EngineArgs()
    assert (a.block_size, a.num_gpu_blocks_override, a.gpu_memory_utilization, a.max_model_len) == \
        (16, None, 0.92, None)
    assert (a.max_num_seqs, a.max_num_batched_tokens, a.enable_prefix_caching, a.enable_chunked_prefill) == \
        (256, 8192, True, True)
    assert (a.watermark, a.kernel_backend, a.seed) == (0.0, "auto", 0)
    cli = EngineArgs(num_gpu_blocks_override=2048, max_model_len=32768, max_num_seqs=64,
                     enable_prefix_caching=False).to_cli("meta-llama/Llama-3.1-8B-Instruct")
    for flag in ("vllm serve meta-llama/Llama-3.1-8B-Instruct", "--max-model-len 32768", "--block-size 16",
                 "--num-gpu-blocks-override 2048", "--max-num-seqs 64", "--no-enable-prefix-caching",
                 "--enable-chunked-prefill", "--gpu-memory-utilization 0.92", "--watermark 0.0"):
        assert flag in cli
    assert "kernel" not in cli and "None" not in cli
    table = {f: flag for f, flag, _ in a.cli_table()}
    assert table["num_gpu_blocks_override"] == "--num-gpu-blocks-override"
    assert table["kv_cache_memory_bytes"] == "--kv-cache-memory-bytes" and table["kernel_backend"] == "-"
    assert len(table) == len(dataclasses.fields(EngineArgs))


@pytest.mark.parametrize("field, value, exc", [
    ("block_size", 0, ValueError), ("block_size", 16.0, TypeError), ("block_size", True, TypeError),
    ("num_gpu_blocks_override", 1, ValueError), ("num_gpu_blocks_override", "2048", TypeError),
    ("gpu_memory_utilization", 0, ValueError), ("gpu_memory_utilization", 1.5, ValueError),
    ("gpu_memory_utilization", "0.9", TypeError), ("max_model_len", 1, ValueError),
    ("max_num_seqs", 0, ValueError), ("max_num_batched_tokens", -5, ValueError),
    ("enable_prefix_caching", 1, TypeError), ("enable_chunked_prefill", "yes", TypeError),
    ("watermark", 1.0, ValueError), ("watermark", float("nan"), ValueError), ("kv_cache_memory_bytes", 0, ValueError),
    ("prefix_match_unit", 5, ValueError), ("kernel_backend", "cuda", ValueError), ("kernel_backend", None, TypeError),
    ("seed", -1, ValueError), ("log_stats_interval", 1.5, TypeError),
])
def test_engine_args_reject_bad_values_naming_field_and_value(field, value, exc):
    with pytest.raises(exc, match=re.escape(field)) as info:
        EngineArgs(**{field: value})
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_engine_args_cross_checks():
    with pytest.raises(ValueError, match="max_num_batched_tokens \\(100\\) must be >= max_num_seqs \\(256\\)"):
        EngineArgs(max_num_batched_tokens=100)
    with pytest.raises(ValueError, match="chunked prefill disabled"):
        EngineArgs(enable_chunked_prefill=False, max_num_batched_tokens=1024, max_model_len=2048)
    assert EngineArgs(kernel_backend="torch").resolved_kernel_backend() == "torch"
    assert EngineArgs(block_size=16, prefix_match_unit=4).hash_block_size == 4


# ---------------------------------------------------------------------- the 2,048-block experiment


def test_the_2048_block_experiment_pool_admits_two_4000_token_prompts():
    # The block accounting is the point, not the model: one layer and two heads keep 8,000 tokens of
    # prefill attention (quadratic, on a CPU) to about a second.
    config = dataclasses.replace(ModelConfig.preset("tiny"), num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1)
    engine = LLMEngine(EngineArgs(num_gpu_blocks_override=2048, block_size=16, max_model_len=4096,
                                  max_num_seqs=64, enable_prefix_caching=False, kernel_backend="torch"),
                       Model(config, seed=0))
    pool = engine.kv_cache_manager.block_pool
    assert engine.pool.num_blocks == pool.num_gpu_blocks == 2048  # the override counts the null block
    assert engine.pool.token_slots == 32_768 and engine.kv_cache_manager.get_num_free_blocks() == 2047
    rng = random.Random(0)
    for rid in ("A", "B"):
        engine.add_request(rid, [rng.randrange(VOCAB) for _ in range(4000)], max_tokens=2, ignore_eos=True)
    engine.step()
    out = engine.last_scheduler_output
    assert out.scheduled_new_reqs == ["A", "B"] and out.num_scheduled_tokens == {"A": 4000, "B": 4000}
    assert [len(out.new_block_ids[r]) for r in "AB"] == [250, 250]
    assert engine.kv_cache_manager.get_num_free_blocks() == 2047 - 500
    engine.check()
    run_all(engine)
    assert engine.kv_cache_manager.get_num_free_blocks() == 2047


def test_startup_check_is_chapter_ones_error_on_the_usable_pool():
    long_ctx = Model(dataclasses.replace(ModelConfig.preset("tiny"), max_position_embeddings=131072), seed=0)
    args = EngineArgs(num_gpu_blocks_override=2048, block_size=16, kernel_backend="torch")
    # 2,047 usable blocks (vLLM 0.33 holds the null block back in this check) hold 32,752 tokens.
    engine = LLMEngine(args.replace(max_model_len=32752), long_ctx)
    assert engine.block_tables.block_tables[0].gpu.shape == (args.max_num_seqs, 2047)  # a row per request
    for max_model_len in (32768, 131072):
        with pytest.raises(ValueError) as info:
            LLMEngine(args.replace(max_model_len=max_model_len), long_ctx)
        msg = str(info.value)
        assert f"max seq len ({max_model_len})" in msg
        assert "the estimated maximum model length is 32752" in msg
        assert "`gpu_memory_utilization`" in msg and "`max_model_len`" in msg
    with pytest.raises(ValueError, match="max_position_embeddings=4096"):
        LLMEngine(args.replace(max_model_len=8192), Model(ModelConfig.preset("tiny"), seed=0))


@pytest.mark.parametrize("override,max_model_len", [(2048, 32768), (2048, 32752), (2049, 32768),
                                                    (2048, 131072), (3, 33), (3, 32), (2, 16)])
def test_chapters_one_and_eight_give_one_answer(override, max_model_len):
    """Chapter 1's budget check and chapter 8's engine agree, message and all, on the same inputs."""
    long_ctx = Model(dataclasses.replace(ModelConfig.preset("tiny"), max_position_embeddings=131072), seed=0)
    spec = model_spec_of(long_ctx.config)
    pool = override * budget.block_bytes(spec, 16, long_ctx.dtype)
    try:
        budget.check_enough_kv_cache_memory(pool, spec, max_model_len, 16, long_ctx.dtype)
        chapter_one = None
    except ValueError as error:
        chapter_one = str(error)
    args = EngineArgs(num_gpu_blocks_override=override, block_size=16, kernel_backend="torch",
                      max_model_len=max_model_len)
    try:
        LLMEngine(args, long_ctx)
        chapter_eight = None
    except ValueError as error:
        chapter_eight = str(error).split("\n")[0]  # the engine adds a line of its own in blocks
    assert chapter_one == chapter_eight
    assert (chapter_one is None) == (cdiv(max_model_len, 16) <= override - 1)


def test_pool_sizing_from_kv_cache_memory_on_cpu(model):
    spec = model_spec_of(model.config)
    engine = LLMEngine(tiny_args(num_gpu_blocks_override=None, kv_cache_memory_bytes=3 * 2**20), model)
    assert engine.pool.source == "kv_cache_memory_bytes"
    assert engine.pool.num_blocks == budget.num_gpu_blocks(3 * 2**20, spec, 4, torch.float32) == 3 * 2**20 // (
        2 * 4 * 2 * 32 * 4 * 4)
    ids, positions, caches, meta = dummy_batch(model, EngineArgs(max_num_batched_tokens=300, max_num_seqs=4), 128)
    assert ids.numel() == 300 and meta.seq_lens.tolist() == [127, 127, 46]
    with torch.inference_mode():
        assert model.forward(ids, positions, caches, meta, "torch").shape == (300, model.config.hidden_size)


# ------------------------------------------------------------------------- tokens are right


def test_paged_engine_matches_dense_reference_for_a_batch(model):
    prompts = prompts_with_shared_prefixes(1, 6)
    engine = LLMEngine(tiny_args(max_num_batched_tokens=32), model)
    outs = engine.generate(prompts, max_tokens=10, ignore_eos=True)
    assert [o.request_id for o in outs] == [f"generate-{i}" for i in range(6)]
    for p, o in zip(prompts, outs):
        assert o.finished and o.finish_reason == "length"
        assert o.token_ids == dense_greedy(model, p, 10)
    assert engine.kv_cache_manager.get_num_free_blocks() == 63


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("caching, chunked", [(True, True), (False, True), (True, False), (False, False)])
def test_block_size_prefix_caching_and_chunked_prefill_do_not_change_tokens(model, block_size, caching, chunked):
    prompts = prompts_with_shared_prefixes(2, 5)
    args = tiny_args(block_size=block_size, num_gpu_blocks_override=max(2, 1536 // block_size) + 1,
                     enable_prefix_caching=caching, enable_chunked_prefill=chunked,
                     max_num_batched_tokens=24 if chunked else 96)
    engine = LLMEngine(args, model)
    outs = engine.generate(prompts[:2], max_tokens=6, ignore_eos=True)  # first wave fills the cache ...
    outs += engine.generate(prompts[2:], max_tokens=6, ignore_eos=True)  # ... the second can hit it
    assert [o.token_ids for o in outs] == [dense_greedy(model, p, 6) for p in prompts]
    hit_rate = engine.stats().prefix_cache_hit_rate
    if not caching:
        assert hit_rate is None
    elif block_size == 32:  # 32-token blocks: no two prompts share a full block
        assert hit_rate == 0
    else:
        assert hit_rate > 0


def test_copy_on_write_of_partial_prefix_hits_keeps_tokens(model):
    # Match unit 2 inside blocks of 8: hits end inside a block, served by a private copy.
    prompts = prompts_with_shared_prefixes(3, 6, prefix_len=21)
    engine = LLMEngine(tiny_args(block_size=8, prefix_match_unit=2, num_gpu_blocks_override=40), model)
    copies = []
    engine.add_step_listener(lambda e, out, outputs: copies.extend(out.cow_pairs))
    outs = engine.generate(prompts[:2], max_tokens=5, ignore_eos=True)
    outs += engine.generate(prompts[2:], max_tokens=5, ignore_eos=True)
    assert copies, "a partial hit must have been served by copy-on-write"
    assert [o.token_ids for o in outs] == [dense_greedy(model, p, 5) for p in prompts]
    assert engine.kv_cache_manager.outstanding_copies == []


def test_preempted_and_resumed_request_produces_the_uninterrupted_tokens(model):
    prompts = [p[:12] for p in prompts_with_shared_prefixes(4, 3, max_suffix=20)]
    # 8 usable blocks of 4 tokens; three requests growing to 12 + 12 tokens need 18: preemption is forced.
    engine = LLMEngine(tiny_args(num_gpu_blocks_override=9, max_model_len=32, enable_prefix_caching=False,
                                 watermark=0.0), model)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, max_tokens=12, ignore_eos=True)
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o.token_ids
        engine.check()
    assert engine.stats().num_preemptions > 0
    assert [finals[f"r{i}"] for i in range(3)] == [dense_greedy(model, p, 12) for p in prompts]


def test_triton_backend_gives_the_torch_backends_tokens(model):
    prompts = [[5, 17, 300, 2, 99, 250, 7], list(range(40, 60))]
    outs = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine(tiny_args(kernel_backend=backend, num_gpu_blocks_override=16, max_model_len=48), model)
        outs[backend] = [o.token_ids for o in engine.generate(prompts, max_tokens=3, ignore_eos=True)]
    assert outs["triton"] == outs["torch"] == [dense_greedy(model, p, 3) for p in prompts]


def test_stops_at_eos_unless_ignored_and_at_max_model_len():
    config = dataclasses.replace(ModelConfig.preset("tiny"))
    m = Model(config, seed=0)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = dense_greedy(m, prompt, 8)
    eos = ref[2]
    m.config.eos_token_id = [eos, 9999]
    engine = LLMEngine(tiny_args(max_model_len=16), m)
    stop, ignored, capped = engine.generate([prompt], max_tokens=8)[0], \
        engine.generate([prompt], max_tokens=8, ignore_eos=True)[0], \
        engine.generate([prompt + [7]], max_tokens=20, ignore_eos=True)[0]
    first = ref.index(eos)
    assert stop.token_ids == ref[: first + 1] and stop.finish_reason == "stop"
    assert ignored.token_ids == ref and ignored.finish_reason == "length"
    assert len(capped.token_ids) == 16 - 9 and capped.finish_reason == "length"  # total reaches max_model_len


def test_text_prompts_with_a_tokenizer(model):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {w: i for i, w in enumerate(["[UNK]"] + [f"w{i}" for i in range(VOCAB - 1)])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece()
    engine = LLMEngine(tiny_args(), model, tokenizer=tok)
    out = engine.generate(["w4 w9 w100 w7"], max_tokens=4, ignore_eos=True)[0]
    assert out.token_ids == dense_greedy(model, [5, 10, 101, 8], 4)
    assert out.text == " ".join(f"w{t - 1}" for t in out.token_ids)


# ------------------------------------------------------------------------ scheduler decisions


def fake_step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    """Schedule, then 'sample' ``token`` for every request whose sequence is complete after the step."""
    out = sched.schedule()
    sampled = {rid: token for rid, n in out.num_scheduled_tokens.items()
               if out.num_computed_tokens[rid] + n == sched.requests[rid].num_tokens}
    sched.update_from_output(out, ModelRunnerOutput(sampled))
    sched.check()
    return out


def make_scheduler(num_blocks=9, block_size=4, max_num_seqs=8, budget=64, max_model_len=64, chunked=True,
                   caching=False, hook=None, reserve_full_isl=True) -> Scheduler:
    manager = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(manager, max_num_seqs, budget, max_model_len, chunked, hook,
                     scheduler_reserve_full_isl=reserve_full_isl)


def add(sched: Scheduler, rid: str, n: int, max_tokens: int = 50) -> EngineRequest:
    req = EngineRequest(rid, list(range(1, n + 1)), max_tokens, ignore_eos=True)
    sched.add_request(req)
    return req


def test_preemption_takes_the_last_running_request_and_requeues_it_at_the_front():
    sched = make_scheduler(num_blocks=9, max_model_len=32)  # 8 usable blocks of 4 tokens
    a, b, c = add(sched, "A", 7), add(sched, "B", 7), add(sched, "C", 7)
    first = fake_step(sched)  # 2 blocks each, A then B then C
    assert first.scheduled_new_reqs == ["A", "B", "C"] and sched.kv_cache_manager.get_num_free_blocks() == 2
    add(sched, "D", 3)
    # Step 2: the decodes write position 7, still in their second block; D takes 1 of the 2 free blocks.
    out = fake_step(sched)
    assert out.scheduled_running_reqs == ["A", "B", "C"] and out.scheduled_new_reqs == ["D"]
    # Step 3: position 8 needs a third block each. A takes the last free one; B preempts D (the last
    # running request) and takes its block; C finds none and, being last now, preempts itself.
    out = fake_step(sched)
    assert out.preempted_req_ids == ["D", "C"]
    assert out.scheduled_running_reqs == ["A", "B"] and not out.scheduled_new_reqs  # no admission this step
    assert [r.request_id for r in sched.waiting] == ["C", "D"]  # front of the queue, in preemption order
    assert c.num_computed_tokens == 0 and c.num_output_tokens == 2 and c.status == RequestStatus.PREEMPTED
    assert c.num_preemptions == 1 and sched.num_preemptions == 2
    # C resumes later, recomputing prompt and outputs, and rejoins at the end of the running list.
    for _ in range(100):
        fake_step(sched)
        if c in sched.running:
            break
    assert c.status == RequestStatus.RUNNING and c in sched.running[-2:] and sched.running[0] is not c


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_last():
    sched = make_scheduler(num_blocks=5)  # 4 usable blocks
    add(sched, "A", 8), add(sched, "B", 8)
    fake_step(sched)
    out = fake_step(sched)  # both need a third block; none free: B (last) goes, A gets one
    assert out.preempted_req_ids == ["B"] and out.scheduled_running_reqs == ["A"]
    # A alone: 4 blocks = 16 tokens; at 17 tokens it must preempt itself.
    for _ in range(20):
        out = fake_step(sched)
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids == ["A"] and out.num_scheduled_tokens == {}
    assert [r.request_id for r in sched.waiting] == ["A", "B"]


def test_no_admission_in_a_step_that_preempted():
    # Admission by the chunk alone (scheduler_reserve_full_isl off): C's 12 tokens (3 blocks) do
    # not fit the 2 free blocks whole, so with vLLM's default C would wait here.
    sched = make_scheduler(num_blocks=5, budget=9, max_model_len=32,  # 4 usable blocks, 9-token steps
                           reserve_full_isl=False)
    add(sched, "A", 4), add(sched, "C", 12)
    assert fake_step(sched).num_scheduled_tokens == {"A": 4, "C": 5}  # C's prompt is chunked
    out = fake_step(sched)  # A's decode takes the last block; C's next chunk finds none: C preempts itself
    assert out.preempted_req_ids == ["C"] and out.num_scheduled_tokens == {"A": 1}
    # A first chunk of C (8 tokens, 2 blocks) would fit the 2 free blocks now, but vLLM V1 admits
    # nobody in a step that preempted: the pool just proved too small.
    assert sched.kv_cache_manager.get_num_free_blocks() == 2 and [r.request_id for r in sched.waiting] == ["C"]
    out = fake_step(sched)
    assert out.scheduled_resumed_reqs == ["C"] and out.num_scheduled_tokens == {"A": 1, "C": 8}


def test_chunked_prefill_splits_and_disabled_prefill_waits():
    sched = make_scheduler(num_blocks=64, budget=16, max_model_len=64)
    add(sched, "A", 40)
    assert [fake_step(sched).num_scheduled_tokens["A"] for _ in range(3)] == [16, 16, 8]
    assert sched.requests["A"].num_output_tokens == 1  # sampled once, after the last chunk only

    sched = make_scheduler(num_blocks=64, budget=40, max_model_len=40, chunked=False)
    add(sched, "A", 30), add(sched, "B", 20), add(sched, "C", 5)
    out = fake_step(sched)  # B does not fit the 10 tokens left: it waits, and so does C behind it
    assert out.num_scheduled_tokens == {"A": 30}
    out = fake_step(sched)
    assert out.num_scheduled_tokens == {"A": 1, "B": 20, "C": 5}


def test_admission_respects_max_num_seqs_and_the_token_budget():
    sched = make_scheduler(num_blocks=64, max_num_seqs=2, budget=20, max_model_len=64)
    for rid in "ABC":
        add(sched, rid, 8)
    out = fake_step(sched)
    assert out.scheduled_new_reqs == ["A", "B"] and "C" in sched.waiting
    assert fake_step(sched).num_scheduled_tokens == {"A": 1, "B": 1}


def test_the_preemption_loop_is_replaceable_and_the_default_is_vllms():
    calls = []

    def traced(scheduler, request, n):
        calls.append((request.request_id, n))
        return preempt_last_running(scheduler, request, n)

    def lifo_victims_first(scheduler, request, n):  # a different policy: preempt the first running request
        while (blocks := scheduler.kv_cache_manager.allocate_slots(request, n)) is None:
            victim = scheduler.running[0]
            scheduler.preempt(victim)
            if victim is request:
                return None
        return blocks

    runs = {}
    for name, hook in (("default", None), ("traced", traced), ("first", lifo_victims_first)):
        sched = make_scheduler(num_blocks=9, hook=hook)
        for rid in "ABC":
            add(sched, rid, 7, max_tokens=8)
        runs[name] = [fake_step(sched).decisions() for _ in range(12)]
    assert runs["traced"] == runs["default"] and calls
    assert runs["first"] != runs["default"]


def test_scheduler_output_describes_the_step():
    sched = make_scheduler(num_blocks=64)
    add(sched, "A", 6)
    out = fake_step(sched)
    assert out.summary() == "step 1: new A:6"
    text = out.describe()
    assert "new     A: positions 0..5 (6 tokens), blocks [1, 2]" in text


# ------------------------------------------------------------------------------- bad input


def engine_state(engine: LLMEngine):
    m = engine.kv_cache_manager
    return ([r.request_id for r in engine.scheduler.running], [r.request_id for r in engine.scheduler.waiting],
            sorted(engine.scheduler.requests), m.get_num_free_blocks(),
            {k: [b.block_id for b in v] for k, v in m.req_to_blocks.items()}, engine.worker.rows())


def test_bad_requests_raise_clear_errors_and_leave_the_engine_untouched(model):
    engine = LLMEngine(tiny_args(max_model_len=32), model)
    engine.add_request("A", [1, 2, 3], max_tokens=4)
    engine.step()
    before = engine_state(engine)
    cases = [
        (dict(request_id="B", prompt=[]), ValueError, "empty"),
        (dict(request_id="B", prompt=list(range(32))), ValueError, "max_model_len=32"),
        (dict(request_id="B", prompt=[1], max_tokens=0), ValueError, "max_tokens"),
        (dict(request_id="B", prompt=[1], max_tokens=2.5), TypeError, "max_tokens"),
        (dict(request_id="A", prompt=[1]), ValueError, "'A' is already in use"),
        (dict(request_id=7, prompt=[1]), TypeError, "request_id"),
        (dict(request_id="B", prompt=[1, "x"]), TypeError, "prompt\\[1\\]"),
        (dict(request_id="B", prompt=[1, VOCAB]), ValueError, f"prompt\\[1\\] = {VOCAB}"),
        (dict(request_id="B", prompt="hello"), TypeError, "tokenizer"),
        (dict(request_id="B", prompt=[1], ignore_eos=1), TypeError, "ignore_eos"),
    ]
    for kwargs, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            engine.add_request(**kwargs)
        assert engine_state(engine) == before
    with pytest.raises(KeyError, match="'nope'"):
        engine.abort_request("nope")
    with pytest.raises(TypeError, match="prompts\\[1\\]"):
        engine.generate([[1, 2], [1, "x"]])
    assert engine_state(engine) == before
    run_all(engine)
    with pytest.raises(KeyError, match="'A'"):  # finished: no longer abortable
        engine.abort_request("A")
    engine.add_request("A", [1, 2], max_tokens=1)  # a finished id may be reused


def test_abort_frees_blocks_and_reports_abort(model):
    engine = LLMEngine(tiny_args(), model)
    engine.add_request("A", list(range(1, 20)), max_tokens=50, ignore_eos=True)
    engine.add_request("B", list(range(5, 9)), max_tokens=50, ignore_eos=True)
    engine.add_request("C", list(range(1, 5)), max_tokens=50, ignore_eos=True)
    engine.step()
    engine.step()
    engine.abort_request("B")  # running
    engine.check()
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "B"]
    assert aborted == [RequestOutput("B", [], aborted[0].token_ids, True, "abort",
                                     prompt_token_ids=list(range(5, 9)))]
    # Async scheduling: step 2's token was still in flight when B was aborted, and is dropped.
    assert len(aborted[0].token_ids) == 1
    assert engine.last_scheduler_output.finished_req_ids == ["B"]
    engine.abort_request("A"), engine.abort_request("C")
    engine.check()
    assert engine.kv_cache_manager.get_num_free_blocks() == 63 and not engine.has_unfinished_requests()
    assert {o.finish_reason for o in engine.step()} == {"abort"}


def test_n_children_share_the_prompt_blocks_through_the_prefix_cache(model):
    """n=4 samples of one prompt hold its full blocks once (ref_cnt 4) plus a tail block each.

    The last prompt token is always recomputed (a hit stops at num_tokens - 1, as vLLM's
    ``max_cache_hit_length``), so a 64-token prompt at block size 16 shares 3 blocks and each
    child recomputes the 4th into its own; a 65-token prompt shares all 4.
    """
    from pagedkv.engine import SamplingParams

    for prompt_len, shared in ((64, 3), (65, 4)):
        engine = LLMEngine(tiny_args(block_size=16, num_gpu_blocks_override=64, max_model_len=128,
                                     max_num_batched_tokens=512), model)
        engine.add_request("P", list(range(1, prompt_len + 1)),
                           sampling_params=SamplingParams(n=4, seed=0, max_tokens=4, ignore_eos=True))
        engine.step()  # all four children admitted in one step, one after the other
        manager = engine.kv_cache_manager
        rows = [manager.get_block_ids(f"{i}_P") for i in range(4)]
        assert all(r[:shared] == rows[0][:shared] for r in rows)
        assert [manager.block_pool.blocks[b].ref_cnt for b in rows[0][:shared]] == [4] * shared
        tails = [b for r in rows for b in r[shared:]]
        assert len(tails) == 4 and len(set(tails)) == 4  # one block of its own per child
        assert all(manager.block_pool.blocks[b].ref_cnt == 1 for b in tails)
        assert manager.get_num_free_blocks() == 63 - shared - 4
        run_all(engine)
        assert manager.get_num_free_blocks() == 63


# --------------------------------------------------------------------------- randomized run


@pytest.mark.parametrize("seed", [0, 1])
def test_randomized_run_keeps_every_invariant_and_returns_every_block(model, seed):
    rng = random.Random(seed)
    prompts = prompts_with_shared_prefixes(100 + seed, 24, prefix_len=16, max_suffix=14)
    chunked = seed % 2 == 0
    args = tiny_args(num_gpu_blocks_override=14, max_model_len=40, max_num_seqs=6,
                     max_num_batched_tokens=20 if chunked else 40, prefix_match_unit=2, watermark=0.0,
                     enable_chunked_prefill=chunked)
    engine = LLMEngine(args, model)
    pending = list(enumerate(prompts))
    finals: dict[str, RequestOutput] = {}
    aborted: set[str] = set()
    max_tokens = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                i, p = pending.pop(0)
                max_tokens[f"q{i}"] = rng.randrange(1, 9)
                engine.add_request(f"q{i}", p, max_tokens[f"q{i}"], ignore_eos=True)
        if engine.scheduler.requests and rng.random() < 0.08:
            victim = rng.choice(sorted(engine.scheduler.requests))
            engine.abort_request(victim)
            aborted.add(victim)
            engine.check()
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
        engine.check()
    assert engine.stats().num_preemptions > 0
    assert engine.kv_cache_manager.get_num_free_blocks() == 13  # every block back in the pool
    assert engine.kv_cache_manager.outstanding_copies == []
    # The last requests' rows go in the idle step, when the worker hears they finished (Model Runner V2).
    assert not engine.step() and engine.worker.num_reqs == 0
    assert set(finals) == {f"q{i}" for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        o = finals[f"q{i}"]
        if o.request_id in aborted:
            assert o.finish_reason == "abort"
            assert o.token_ids == dense_greedy(model, p, len(o.token_ids))
        else:
            assert o.finish_reason == "length" and o.token_ids == dense_greedy(model, p, max_tokens[o.request_id])


# ---------------------------------------------------------------------- stats, logs, views


def test_stats_and_the_periodic_log_line(model):
    lines = []
    engine = LLMEngine(tiny_args(log_stats_interval=3, num_gpu_blocks_override=9, max_model_len=32,
                                 watermark=0.0), model, log_fn=lines.append)
    prompts = prompts_with_shared_prefixes(5, 4, prefix_len=12, max_suffix=6)
    engine.generate(prompts, max_tokens=10, ignore_eos=True)
    s = engine.stats()
    assert isinstance(s, EngineStats) and s.num_running == s.num_waiting == 0 and s.kv_cache_usage == 0.0
    assert len(lines) == s.step // 3 and s.num_preemptions > 0
    assert all(line.startswith("Engine 000 (step ") and "Avg prompt throughput:" in line
               and "GPU KV cache usage:" in line and "Prefix cache hit rate:" in line for line in lines)
    assert sum(int(m.group(1)) for line in lines for m in [re.search(r"Preemptions: (\d+)", line)] if m) \
        + s.num_preemptions_interval == s.num_preemptions
    assert 0 < s.prefix_cache_hit_rate < 1


def test_trace_replays_one_frame_per_step(model):
    engine = LLMEngine(tiny_args(num_gpu_blocks_override=12, max_model_len=40), model)
    trace = EngineTrace(engine, title="engine").start()
    engine.generate([[1, 2, 3, 4, 5], [9, 8, 7]], max_tokens=3, ignore_eos=True)
    trace.stop()
    engine.generate([[1, 2]], max_tokens=1)
    # Start, then one frame per step: the prefill samples the first token; under async scheduling a
    # fourth step runs nothing while the third's tokens (the last) are in flight.
    assert len(trace) == 1 + 4 and trace.captions()[-2] == "+generate-0:1, +generate-1:1"
    assert trace.captions()[1] == "new generate-0:5, new generate-1:3"
    assert "finished generate-0 (length), generate-1 (length)" in trace.captions()[-1]
    html = trace.replay()._repr_html_()
    assert html.count("class='pkv-frame'") == 5 and "<svg" in html and "block table" in html


def test_live_views_follow_the_engine_throttled(model):
    from pagedkv.views import BlockPoolView, BlockTableView

    engine = LLMEngine(tiny_args(num_gpu_blocks_override=12, max_model_len=40), model)
    pool_view = BlockPoolView(engine.kv_cache_manager.block_pool, min_interval=0)
    table_view = BlockTableView({})
    table_view.min_interval = 0
    pool_view.max_overhead = table_view.max_overhead = float("inf")  # redraw after every step
    pool_view.attach(engine)
    table_view.attach(engine)
    engine.add_request("r0", [1, 2, 3, 4, 5], max_tokens=4, ignore_eos=True)
    engine.step()
    assert pool_view.redraws >= 2 and table_view.redraws >= 2  # attach draws once, steps redraw
    # Model Runner V2: the first request takes the last free row, and keeps it.
    row = engine.worker.req_states.req_id_to_index["r0"]
    assert row == engine.args.max_num_seqs - 1
    assert "r0" in pool_view.static_html() and table_view.rows == {"r0": engine.worker.block_tables.block_ids(row)[0]}
    slow = BlockPoolView(engine.kv_cache_manager.block_pool, min_interval=3600)
    slow.attach(engine)
    before = slow.redraws
    run_all(engine)
    assert slow.redraws == before  # throttled: no redraw within the interval
    for v in (pool_view, table_view, slow):
        v.close()
    n = pool_view.redraws
    engine.generate([[1, 2]], max_tokens=1)
    assert pool_view.redraws == n
    with pytest.raises(ValueError, match="engine's pool"):
        BlockPoolView(KVCacheManager(4, 4).block_pool).attach(engine)


def test_to_cli_refuses_what_vllm_would_refuse_and_names_the_rule():
    with pytest.warns(UserWarning, match="with a single KV cache group"):
        args = EngineArgs(block_size=16, prefix_match_unit=4)
    with pytest.raises(ValueError, match=r"Invalid prefix_match_unit=4; with a single KV cache group, "
                                         r"prefix-cache hits land on the block size \(16\)"):
        args.to_cli("meta-llama/Llama-3.1-8B")
    with pytest.raises(ValueError, match="block_size=8: .* multiples of 16"):
        EngineArgs(block_size=8).to_cli()
    assert EngineArgs(block_size=16, prefix_match_unit=16).vllm_refusals() == []
    assert EngineArgs(block_size=32).to_cli().startswith("vllm serve MODEL")
