"""Sampling (vLLM's ``SamplingParams``), the batched torch paged attention, vLLM's ``LLM`` API, bad inputs.

Everything here runs on the tiny seeded model (fast on a CPU); the real
model's ``LLM.chat`` is tested in test_model_gguf.py, beside its oracle.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from pagedkv.engine import LLM, EngineArgs, LLMEngine, SamplingParams
from pagedkv.engine.sampling import exponential_noise, sample
from pagedkv.model import Model, ModelConfig, dense_logits, load_pretrained


@pytest.fixture(scope="module")
def model():
    return Model(ModelConfig.preset("tiny"), seed=0, device="cpu")


def _prompts(n, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _args(**kw):
    base = dict(block_size=4, num_gpu_blocks_override=64, max_model_len=96, max_num_seqs=8,
                max_num_batched_tokens=64, kernel_backend="torch")
    return EngineArgs(**{**base, **kw})


# --------------------------------------------------------------------------- SamplingParams
def test_sampling_params_defaults_are_vllms():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.max_tokens) == (1.0, 1.0, 0, 0.0, None, 16)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.skip_special_tokens) == ([], [], False, True)
    assert not p.greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0, top_k=5, top_p=0.5).top_k == 0  # greedy resets the cuts, as vLLM
    assert (p.n, p.min_tokens, p.logprobs) == (1, 0, None)
    assert SamplingParams(logprobs=True).logprobs == 1  # as vLLM reads it


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(temperature=-0.1), ValueError, "temperature must be a finite number >= 0, got -0.1"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_k=-2), ValueError, "top_k must be -1 or 0"),
    (dict(min_p=1.5), ValueError, r"min_p must be in \[0, 1\], got 1.5"),
    (dict(max_tokens=0), ValueError, "max_tokens must be at least 1, got 0"),
    (dict(top_k=2.5), TypeError, "top_k must be an int, got float 2.5"),
    (dict(seed="1"), TypeError, "seed must be an int or None"),
    (dict(stop=[""]), TypeError, "stop must be a str or a list of non-empty str"),
    (dict(ignore_eos=1), TypeError, "ignore_eos must be True or False"),
    (dict(min_tokens=-1), ValueError, "min_tokens must be >= 0, got -1"),
    (dict(min_tokens=5, max_tokens=4), ValueError, "min_tokens must be <= max_tokens=4, got 5"),
    (dict(min_tokens=1.5), TypeError, "min_tokens must be an int, got float 1.5"),
    (dict(logprobs=-2), ValueError, r"logprobs must be >= 0, or -1 \(the whole vocabulary\), got -2"),
    (dict(logprobs="3"), TypeError, "logprobs must be an int or None, got str '3'"),
    (dict(n=0), ValueError, "n must be at least 1, got 0"),
    (dict(n=2.0), TypeError, "n must be an int, got float 2.0"),
    (dict(n=2, temperature=0), ValueError, "n must be 1 when using greedy sampling"),
])
def test_sampling_params_reject_bad_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


# --------------------------------------------------------------------------- the sampler
def _rows(n, **kw):
    cols = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0)
    cols.update(kw)
    return (torch.full((n,), float(cols["temperature"])), torch.full((n,), float(cols["top_p"])),
            torch.full((n,), int(cols["top_k"]), dtype=torch.int64), torch.full((n,), float(cols["min_p"])),
            torch.arange(n), torch.zeros(n, dtype=torch.int64))


@pytest.mark.parametrize("cut, expected", [
    (dict(), [0.5, 0.3, 0.2]),
    (dict(top_p=0.6), [0.625, 0.375, 0.0]),  # 0.5 before the 2nd token < 0.6: two kept
    (dict(top_k=1), [1.0, 0.0, 0.0]),
    (dict(min_p=0.5), [0.625, 0.375, 0.0]),  # 0.2 < 0.5 x 0.5
    (dict(temperature=0.5), [25 / 38, 9 / 38, 4 / 38]),  # p^2 renormalised
])
def test_sampler_draws_the_cut_distribution(cut, expected):
    n = 20000
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).expand(n, 3).contiguous()
    freq = torch.bincount(sample(logits, *_rows(n, **cut)), minlength=3).float() / n
    torch.testing.assert_close(freq, torch.tensor(expected), atol=0.015, rtol=0)  # 4+ sigma at n=20,000


def test_noise_is_exponential_and_a_function_of_seed_and_counter():
    a = exponential_noise(torch.tensor([7, 7, 8]), torch.tensor([0, 1, 0]), 50000)
    assert torch.equal(a, exponential_noise(torch.tensor([7, 7, 8]), torch.tensor([0, 1, 0]), 50000))
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert (a > 0).all() and abs(a.mean().item() - 1) < 0.02 and abs(a.std().item() - 1) < 0.02


def test_greedy_rows_take_the_argmax_among_sampled_rows():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    temps = torch.tensor([0.0, 1.0, 0.0, 2.0, 0.0, 0.7])
    rows = list(_rows(6))
    rows[0] = temps
    got = sample(logits, *rows)
    assert torch.equal(got[temps == 0], logits.argmax(-1)[temps == 0])


# --------------------------------------------------------------------------- the engine with sampling
def test_seeded_requests_are_reproducible_whatever_their_batch(model):
    prompts = _prompts(5, seed=1)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=12, ignore_eos=True)
              for i in range(5)]
    together = LLMEngine(_args(), model).generate(prompts, sampling_params=params)
    alone = [LLMEngine(_args(), model).generate([p], sampling_params=[sp])[0] for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    # Preemption recomputes: a pool of 12 blocks of 4 forces it, and the draws stay the same.
    small = LLMEngine(_args(num_gpu_blocks_override=12, max_model_len=44), model)
    squeezed = small.generate(prompts, sampling_params=params)
    assert small.stats().num_preemptions > 0
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in together]
    unseeded = LLMEngine(_args(), model).generate(prompts, sampling_params=SamplingParams(max_tokens=12))
    assert [o.token_ids for o in unseeded] != [o.token_ids for o in together]


def test_temperature_zero_is_the_greedy_engine(model):
    prompts = _prompts(4, seed=2)
    greedy = LLMEngine(_args(), model).generate(prompts, max_tokens=8, ignore_eos=True)
    zero = LLMEngine(_args(), model).generate(
        prompts, sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in zero]


def test_stop_token_ids_and_max_tokens_none(model):
    prompt = _prompts(1, seed=3)[0]
    full = LLMEngine(_args(), model).generate([prompt], max_tokens=10, ignore_eos=True)[0].token_ids
    stop = full[4]
    out = LLMEngine(_args(), model).generate(
        [prompt], sampling_params=SamplingParams(temperature=0, stop_token_ids=[stop], max_tokens=10))[0]
    assert out.token_ids == full[:full.index(stop) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    to_the_end = LLMEngine(_args(), model).generate(
        [prompt], sampling_params=SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(prompt) + len(to_the_end.token_ids) == 96 and to_the_end.finish_reason == "length"


def test_stop_strings_need_a_tokenizer(model):
    engine = LLMEngine(_args(), model)
    with pytest.raises(ValueError, match="stop needs a tokenizer"):
        engine.add_request("a", [1, 2], sampling_params=SamplingParams(stop=["."]))
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams"):
        engine.add_request("a", [1, 2], sampling_params={"temperature": 0})
    assert not engine.has_unfinished_requests()


# --------------------------------------------------------------------------- batched paged attention
def test_batched_torch_path_matches_the_reference_and_dense(model):
    """Mixed steps (chunked prefill beside decodes, preemption) give the reference's tokens and dense logits."""
    prompts = _prompts(8, seed=4)
    runs = {}
    for backend in ("torch", "torch-ref"):
        engine = LLMEngine(_args(num_gpu_blocks_override=20, max_model_len=64, max_num_batched_tokens=16), model)
        engine.kernel_backend = engine.worker.kernel_backend = backend
        runs[backend] = [o.token_ids for o in engine.generate(prompts, max_tokens=10, ignore_eos=True)]
        assert engine.stats().num_preemptions > 0
    assert runs["torch"] == runs["torch-ref"]
    for p, out in zip(prompts, runs["torch"]):
        seq = p + out
        logits = dense_logits(model, [seq[:-1]])[0][len(p) - 1:]
        assert logits.argmax(-1).tolist() == out


# --------------------------------------------------------------------------- bad inputs
def test_dense_forward_rejects_an_out_of_range_token(model):
    with pytest.raises(ValueError, match=r"input_ids holds 512, which is not a token id of the model \(0..511\)"):
        model.forward_dense(torch.tensor([[1, 512, 3]]))
    with pytest.raises(ValueError, match="input_ids holds -1"):
        model.forward_dense(torch.tensor([[-1]]))


def test_pool_too_small_says_blocks_and_tokens(model):
    with pytest.raises(ValueError, match=r"one 96-token request needs 24 blocks of 4 tokens; the pool has 7 "
                                         r"usable blocks besides the null block. Raise num_gpu_blocks_override "
                                         r"to at least 25, or lower max_model_len to at most 28"):
        LLMEngine(_args(num_gpu_blocks_override=8), model)


CONFIG = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)


@pytest.mark.parametrize("config, match", [
    (dict(CONFIG, model_type="gpt2", architectures=["LlamaForCausalLM"]),
     r"config.json: model_type 'gpt2' is not supported; supported: llama, qwen2"),
    (dict(CONFIG, model_type="qwen2", architectures=["LlamaForCausalLM"]),
     r"config.json: model_type 'qwen2' disagrees with architectures \['LlamaForCausalLM'\]"),
    (dict(model_type="llama", vocab_size=10, n_embd=8, n_head=2, n_layer=1),
     r"config.json: the config lacks hidden_size, intermediate_size, num_hidden_layers, num_attention_heads"),
])
def test_bad_config_json(tmp_path, config, match):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        load_pretrained(tmp_path)


def test_truncated_safetensors_names_the_file(tmp_path, model):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    small = Model(ModelConfig.from_hf_config(dict(CONFIG, architectures=["LlamaForCausalLM"])), device="cpu")
    (tmp_path / "config.json").write_text(json.dumps(dict(CONFIG, architectures=["LlamaForCausalLM"])))
    file = tmp_path / "model.safetensors"
    safetensors_torch.save_file({f"model.{k}": v for k, v in small.state_dict().items()}, str(file))
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        load_pretrained(tmp_path)


# --------------------------------------------------------------------------- vLLM's LLM API
def test_llm_api_on_a_model_object(model):
    llm = LLM(model, block_size=4, num_gpu_blocks_override=64, max_model_len=96, kernel_backend="torch")
    prompts = _prompts(3, seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    ref = LLMEngine(_args(), model).generate(prompts, max_tokens=5, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(o.outputs[0].finish_reason == "length" and o.finished for o in outs)
    one = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0, max_tokens=5,
                                                                          ignore_eos=True))
    assert len(one) == 1 and one[0].outputs[0].token_ids == ref[0].token_ids
    with pytest.raises(TypeError, match=r"unknown engine arguments \['gpu_blocks'\]"):
        LLM(model, gpu_blocks=3)
    with pytest.raises(ValueError, match="chat needs a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(FileNotFoundError, match="neither a .gguf file"):
        LLM("no/such/model")


# --------------------------------------------------------------------------- min_tokens
def test_min_tokens_masks_stop_tokens_for_greedy_and_sampled_rows_only(model):
    prompt = _prompts(1, seed=6)[0]
    allowed = set(range(10))
    stop = [t for t in range(512) if t not in allowed]  # nearly every token ends the output
    rows = [SamplingParams(temperature=0, stop_token_ids=stop, min_tokens=4, max_tokens=8),
            SamplingParams(temperature=1.0, seed=1, stop_token_ids=stop, min_tokens=4, max_tokens=8),
            SamplingParams(temperature=1.0, seed=2, stop_token_ids=stop, max_tokens=8)]
    greedy, sampled, free = LLMEngine(_args(), model).generate([prompt] * 3, sampling_params=rows)
    for out in (greedy, sampled):  # the first 4 tokens could only be the 10 allowed ones
        assert len(out.token_ids) >= 4 and set(out.token_ids[:4]) <= allowed
    assert len(free.token_ids) == 1 and free.finish_reason == "stop"  # the mask stays on its rows
    # EOS is masked too, even with ignore_eos (vLLM masks every stop id, EOS included).
    m = Model(ModelConfig.preset("tiny"), seed=0, device="cpu")
    first = LLMEngine(_args(), m).generate([prompt], max_tokens=1)[0].token_ids[0]
    m.config.eos_token_id = first
    engine = LLMEngine(_args(), m)
    assert engine.generate([prompt], max_tokens=5)[0].token_ids == [first]
    for ignore_eos in (False, True):
        out = engine.generate([prompt], sampling_params=SamplingParams(
            temperature=0, min_tokens=3, max_tokens=5, ignore_eos=ignore_eos))[0]
        assert len(out.token_ids) >= 3 and first not in out.token_ids[:3]


def test_min_tokens_stop_strings_count_only_after_the_minimum(model):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {w: i for i, w in enumerate(["[UNK]"] + [f"w{i}" for i in range(511)])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece()
    engine = LLMEngine(_args(), model, tokenizer=tok)
    prompt = _prompts(1, seed=7)[0]
    full = engine.generate([prompt], max_tokens=6, ignore_eos=True)[0]
    word = full.text.split()[1]  # the second token's text
    early = engine.generate([prompt], sampling_params=SamplingParams(temperature=0, stop=word, max_tokens=6))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) <= 2
    late = engine.generate([prompt], sampling_params=SamplingParams(temperature=0, stop=word, min_tokens=2,
                                                                      max_tokens=6, ignore_eos=True))[0]
    assert len(late.token_ids) > 2 and late.token_ids == full.token_ids[:len(late.token_ids)]
    assert late.text.startswith(tok.decode(full.token_ids[:2]))  # not cut at the early occurrence


def test_min_tokens_must_fit_max_model_len_when_max_tokens_is_none(model):
    engine = LLMEngine(_args(), model)
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens=86 .* got 90"):
        engine.add_request("a", list(range(10)), sampling_params=SamplingParams(max_tokens=None, min_tokens=90))
    assert not engine.has_unfinished_requests()


# --------------------------------------------------------------------------- logprobs
def test_logprobs_are_the_raw_distribution_top_k_and_the_sampled_token(model):
    prompt = _prompts(1, seed=8)[0]
    first = LLMEngine(_args(), model).generate([prompt], max_tokens=1)[0].token_ids[0]
    rows = [SamplingParams(temperature=0.7, seed=3, logprobs=3, max_tokens=5, ignore_eos=True),
            SamplingParams(temperature=0, logprobs=0, max_tokens=5, ignore_eos=True),
            SamplingParams(temperature=0, logprobs=1, stop_token_ids=[first], min_tokens=1, max_tokens=5),
            SamplingParams(temperature=0.7, seed=4, max_tokens=5, ignore_eos=True),
            SamplingParams(temperature=0.7, seed=5, logprobs=-1, max_tokens=2, ignore_eos=True)]
    outs = LLMEngine(_args(), model).generate([prompt] * 5, sampling_params=rows)
    for out, sp in zip(outs, rows):
        if sp.logprobs is None:
            assert out.logprobs is None and out.outputs[0].cumulative_logprob is None
            continue
        assert out.outputs[0].logprobs == out.logprobs and len(out.logprobs) == len(out.token_ids)
        seq = prompt + out.token_ids
        # raw logits, before temperature and the min_tokens mask (vLLM's raw_logprobs)
        ref = dense_logits(model, [seq[:-1]])[0][len(prompt) - 1:].log_softmax(-1)
        k = 512 if sp.logprobs == -1 else sp.logprobs
        for token, entry, lp in zip(out.token_ids, out.logprobs, ref):
            assert all(abs(v.logprob - lp[t].item()) < 1e-4 for t, v in entry.items())
            by_rank = sorted(entry, key=lambda t: entry[t].rank)
            if k < 512:  # the top k in order (the whole vocabulary has near-ties between the two paths)
                assert by_rank[:k] == lp.topk(k).indices.tolist()
                assert [entry[t].rank for t in by_rank[:k]] == list(range(1, k + 1))
                assert set(entry) == {token, *by_rank[:k]}
            else:
                assert sorted(v.rank for v in entry.values()) == list(range(1, 513))
            if token not in by_rank[:k]:
                assert entry[token].rank == int((lp >= lp[token]).sum())
            assert all(v.decoded_token is None for v in entry.values())
        assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids,
                                                                                         out.logprobs)))
    masked = outs[2]
    assert masked.token_ids[0] != first and masked.logprobs[0][first].rank == 1  # the raw top-1, masked out


def test_no_logprobs_no_extra_work(model, monkeypatch):
    import pagedkv.engine.worker as worker

    def fail(*a, **k):
        raise AssertionError("gather_logprobs ran with no request asking for logprobs")

    monkeypatch.setattr(worker, "gather_logprobs", fail)
    engine = LLMEngine(_args(), model)
    outs = engine.generate(_prompts(3, seed=9), sampling_params=SamplingParams(max_tokens=3, seed=0))
    assert all(o.logprobs is None for o in outs)


# --------------------------------------------------------------------------- n > 1
def test_n_gives_one_output_with_n_completions_seeded_as_vllm(model):
    llm = LLM(model, block_size=4, num_gpu_blocks_override=64, max_model_len=96, kernel_backend="torch")
    prompt = _prompts(1, seed=10)[0]
    params = SamplingParams(n=3, seed=7, max_tokens=6, ignore_eos=True, logprobs=0)
    out, = llm.generate(prompt, params)
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished and out.prompt_token_ids == prompt
    texts = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(texts)) == 3 and all(len(c.logprobs) == 6 for c in out.outputs)
    again = LLM(model, block_size=4, num_gpu_blocks_override=64, max_model_len=96, kernel_backend="torch")
    assert [tuple(c.token_ids) for c in again.generate(prompt, params)[0].outputs] == texts
    # child i is an n=1 request with seed + i (vLLM's parallel_sampling)
    alone = [llm.generate(prompt, dataclasses.replace(params, n=1, seed=7 + i))[0].token_ids for i in range(3)]
    assert [list(t) for t in texts] == alone
    mixed = llm.llm_engine.generate([prompt, prompt], sampling_params=[SamplingParams(max_tokens=2),
                                                                       SamplingParams(n=2, max_tokens=2)])
    assert [len(o.outputs) for o in mixed] == [1, 2]


def test_n_through_step_and_abort(model):
    engine = LLMEngine(_args(), model)
    engine.add_request("A", [1, 2, 3], sampling_params=SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    engine.add_request("B", [4, 5, 6], sampling_params=SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    assert sorted(engine.scheduler.requests) == ["0_A", "0_B", "1_A", "1_B", "2_B"]
    seen = []
    for _ in range(4):  # async scheduling: a step's tokens arrive with the next step() call
        seen += engine.step()
    assert [(o.request_id, len(o.outputs)) for o in seen] == [("A", 2)]  # children only as one aggregate
    engine.abort_request("B")
    outs = engine.step()
    assert [o.request_id for o in outs] == ["B"] and {c.finish_reason for c in outs[0].outputs} == {"abort"}
    assert not engine.has_unfinished_requests() and engine.kv_cache_manager.get_num_free_blocks() == 63
    engine.add_request("A", [1], sampling_params=SamplingParams(n=2))  # a finished id may be reused


def test_n_rejected_requests_leave_nothing_behind(model):
    engine = LLMEngine(_args(), model)
    engine.add_request("1_A", [1, 2], max_tokens=4)
    engine.add_request("C", [1, 2], sampling_params=SamplingParams(n=2))
    with pytest.raises(ValueError, match="'1_A' is already in use"):
        engine.add_request("A", [1, 2], sampling_params=SamplingParams(n=2))
    with pytest.raises(ValueError, match="'C' is already in use"):
        engine.add_request("C", [1, 2])
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling"):
        engine.add_request("D", [1, 2], sampling_params=SamplingParams(n=2, temperature=0))
    assert sorted(engine.scheduler.requests) == ["0_C", "1_A", "1_C"] and sorted(engine._parents) == ["C"]
