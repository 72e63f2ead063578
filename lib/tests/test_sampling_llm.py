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
