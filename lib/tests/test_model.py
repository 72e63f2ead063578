"""pagedkv.model against Hugging Face transformers.

Tiny seeded Llama and Qwen2 checkpoints are built with transformers, saved as
safetensors and read back with ``load_pretrained``; our logits (paged and
dense paths) and greedy tokens must match transformers' in float32. The
tests that need transformers skip where it is absent (the bare GPU machine).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import pagedkv
from pagedkv.model import (
    AttentionMetadata,
    Model,
    ModelConfig,
    dense_logits,
    load_pretrained,
    load_tokenizer,
)

ATOL = 1e-4  # float32 logits of O(1); the paths differ only in summation order

# Three checkpoints between them cover: GQA (4:2) and MQA (4:1), llama3 and plain
# RoPE, tied and untied heads, q/k/v bias (Qwen2) and q/k/v/o bias (Llama),
# head_dim != hidden / heads, one file and a sharded checkpoint.
CASES = {
    "llama-llama3-rope-untied": dict(
        arch="LlamaForCausalLM", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-plain-tied-bias": dict(
        arch="LlamaForCausalLM", hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        tie_word_embeddings=True, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "qwen2-bias-tied-sharded": dict(
        arch="Qwen2ForCausalLM", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}
PROMPT_LENS = (7, 1, 19, 12)


def _build_hf(case: dict, seed: int = 0):
    transformers = pytest.importorskip("transformers")
    kwargs = dict(case)
    arch = kwargs.pop("arch")
    config_cls = {"LlamaForCausalLM": transformers.LlamaConfig, "Qwen2ForCausalLM": transformers.Qwen2Config}[arch]
    config = config_cls(vocab_size=96, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None, **kwargs)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    # Re-draw every weight: norms away from 1 and biases away from 0, so a swapped
    # layernorm or a dropped bias changes the logits; std 0.1 makes logits O(1).
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    """(transformers model, our model loaded from its saved checkpoint, directory)."""
    hf = _build_hf(CASES[request.param])
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, max_shard_size="40KB" if "sharded" in request.param else "50GB")
    assert (path / "model.safetensors.index.json").exists() == ("sharded" in request.param)
    return hf, load_pretrained(path, device="cpu"), path


def _prompts(vocab: int, lens=PROMPT_LENS, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


class PagedRunner:
    """A hand-made engine: scattered block ids, slot mapping, one launch per step."""

    def __init__(self, model: Model, num_reqs: int, max_len: int, block_size: int = 4,
                 kernel_backend: str = "torch"):
        per_req = -(-max_len // block_size)
        num_blocks = num_reqs * per_req + 3  # a few spare blocks that nobody uses
        ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(2))[: num_reqs * per_req]
        self.model, self.block_size, self.backend = model, block_size, kernel_backend
        self.block_table = ids.view(num_reqs, per_req).to(torch.int32)
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)
        self.lens = [0] * num_reqs

    @torch.no_grad()
    def step(self, chunks: list[list[int]]) -> list[torch.Tensor]:
        """Feed each request its next tokens; the logits of those tokens, per request."""
        tokens, positions, slots, qsl = [], [], [], [0]
        for r, chunk in enumerate(chunks):
            pos = torch.arange(self.lens[r], self.lens[r] + len(chunk))
            tokens += chunk
            positions.append(pos)
            slots.append(self.block_table[r, pos // self.block_size].long() * self.block_size
                         + pos % self.block_size)
            qsl.append(qsl[-1] + len(chunk))
            self.lens[r] += len(chunk)
        dev = self.model.device
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(dev),
            block_table=self.block_table.to(dev),
            seq_lens=torch.tensor(self.lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        )
        hidden = self.model(torch.tensor(tokens, device=dev), torch.cat(positions).to(dev), self.kv_caches, meta,
                            kernel_backend=self.backend)
        logits = self.model.compute_logits(hidden).cpu()
        return [logits[qsl[r]: qsl[r + 1]] for r in range(len(chunks))]


@torch.no_grad()
def _hf_logits(hf, prompts):
    return [hf(torch.tensor([p])).logits[0].float() for p in prompts]


def test_paged_and_dense_logits_match_transformers(checkpoint):
    hf, ours, _ = checkpoint
    prompts = _prompts(hf.config.vocab_size)
    ref = _hf_logits(hf, prompts)
    paged = PagedRunner(ours, len(prompts), max(PROMPT_LENS)).step(prompts)  # all prompts, one launch
    dense = dense_logits(ours, prompts)
    for r, p in enumerate(prompts):
        assert paged[r].shape == dense[r].shape == (len(p), hf.config.vocab_size)
        assert ref[r].abs().max() > 1.0  # logits large enough for ATOL to mean something
        torch.testing.assert_close(paged[r], ref[r], atol=ATOL, rtol=0)
        torch.testing.assert_close(dense[r], ref[r], atol=ATOL, rtol=0)


def test_greedy_decode_through_the_cache_matches_generate(checkpoint):
    hf, ours, _ = checkpoint
    new = 6
    prompts = _prompts(hf.config.vocab_size, lens=(5, 9, 14), seed=3)
    expected = []
    for p in prompts:  # one prompt per call: no padding semantics
        out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          do_sample=False, max_new_tokens=new)
        expected.append(out[0, len(p):].tolist())
    runner = PagedRunner(ours, len(prompts), max_len=max(map(len, prompts)) + new, block_size=4)
    # Chunked prefill: the first 3 tokens, then the rest with those 3 as cached context.
    runner.step([p[:3] for p in prompts])
    last = [lg[-1] for lg in runner.step([p[3:] for p in prompts])]
    got = [[] for _ in prompts]
    for _ in range(new):
        nxt = [int(lg.argmax()) for lg in last]
        for g, t in zip(got, nxt):
            g.append(t)
        last = [lg[-1] for lg in runner.step([[t] for t in nxt])]
    assert got == expected


def test_triton_backend_matches_torch_backend():
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = Model(config, seed=0, device=pagedkv.default_device())
    with torch.no_grad():  # norms away from 1, so the layer is not trivially the identity
        model.layers[0].input_layernorm.weight.normal_(1.0, 0.5, generator=torch.Generator().manual_seed(0))
    prompts = _prompts(64, lens=(5, 3))
    runs = {}
    for backend in ("torch", "triton"):
        runner = PagedRunner(model, 2, max_len=8, block_size=2, kernel_backend=backend)
        first = runner.step([p[:2] for p in prompts])
        runs[backend] = first + runner.step([p[2:] for p in prompts])  # second step reads cached context
    for a, b in zip(runs["triton"], runs["torch"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for got, ref in zip(runs["torch"][2:], dense_logits(model, prompts)):
        torch.testing.assert_close(got, ref.cpu()[2:], atol=1e-5, rtol=0)



@pytest.mark.parametrize("backend", ["torch", "triton", "torch-ref"])
def test_a_bad_slot_mapping_is_refused_before_any_layer_writes(backend):
    """The backend checks the step once, before layer 0: a slot used twice changes no cache."""
    from pagedkv.model.paged_attention import attention_backend

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = Model(config, seed=0, device=pagedkv.default_device())
    caches = model.allocate_kv_cache(num_blocks=4, block_size=2)
    dev = model.device
    meta = AttentionMetadata(slot_mapping=torch.tensor([2, 3, 2], device=dev),  # slot 2 twice
                             block_table=torch.tensor([[1, 2]], dtype=torch.int32, device=dev),
                             seq_lens=torch.tensor([3], dtype=torch.int32, device=dev),
                             query_start_loc=torch.tensor([0, 3], dtype=torch.int32, device=dev))
    chosen = attention_backend(backend)
    assert chosen.name == backend and attention_backend(chosen) is chosen
    with pytest.raises(ValueError, match="slot 2 appears more than once in slot_mapping"):
        model(torch.tensor([1, 2, 3], device=dev), torch.arange(3, device=dev), caches, meta, kernel_backend=chosen)
    assert not any(kc.any() or vc.any() for kc, vc in caches)

@pytest.mark.parametrize("backend", ["torch", "torch-ref", "triton"])
def test_every_backend_gathers_the_table_and_computes_the_references_slots(backend):
    """The worker's gathered table and slot mapping, by each backend, equal the kernels' references.

    Rows kept for life (Model Runner V2): the batch names rows in any order,
    and a position past its row's blocks is refused before any slot is computed.
    """
    from pagedkv.block_tables import BlockTables
    from pagedkv.kernels import compute_slot_mapping_ref, gather_block_tables_ref
    from pagedkv.model.paged_attention import attention_backend
    from pagedkv.request_state import RequestState

    states = RequestState(3)
    tables = BlockTables(states, [4], [4], device=pagedkv.default_device())
    a, b = states.add_request("a"), states.add_request("b")  # rows 2 and 1
    tables.append_block_ids(a, [[5, 2]], overwrite=True)
    tables.append_block_ids(b, [[7]], overwrite=True)
    tables.apply_staged_writes()
    idx = [b, a]  # batch entry 0 is b
    qsl, pos = torch.tensor([0, 2, 5]), torch.tensor([1, 3, 0, 4, 7])
    chosen = attention_backend(backend)
    (got_table,), got = chosen.prepare_attn(tables, idx, qsl, pos)
    want_table = gather_block_tables_ref(tables.block_tables[0].gpu, tables.num_blocks_gpu[0], idx)
    assert got_table.tolist() == want_table.tolist() == [[7, 0, 0, 0], [5, 2, 0, 0]]
    want = compute_slot_mapping_ref(want_table, [0, 0, 1, 1, 1], pos, 4)
    assert got[0].tolist() == want.tolist() == [29, 31, 20, 8, 11]
    with pytest.raises(ValueError, match=r"positions\[1\] = 4 is outside row 1"):  # b holds one block
        chosen.prepare_attn(tables, idx, qsl, torch.tensor([1, 4, 0, 4, 7]))


def test_presets():
    tiny = ModelConfig.preset("tiny")
    assert tiny.num_attention_heads // tiny.num_key_value_heads > 1  # GQA
    model = Model(tiny, seed=0, device="cpu")
    assert sum(p.numel() for p in model.parameters()) == tiny.num_parameters
    assert 1_000_000 < tiny.num_parameters < 5_000_000
    big = ModelConfig.preset("llama-3-8b")
    assert big.num_parameters == 8_030_261_248  # Llama 3.1 8B's published count
    shapes_only = Model(big, seed=None, dtype=torch.bfloat16, device="meta")  # no storage anywhere
    assert sum(p.numel() for p in shapes_only.parameters()) == big.num_parameters
    assert (big.num_hidden_layers, big.num_key_value_heads, big.head_dim) == (32, 8, 128)
    assert big.rope_scaling["rope_type"] == "llama3"
    big.rope_scaling["factor"] = 1.0  # a preset hands out a copy
    assert ModelConfig.preset("llama-3-8b").rope_scaling["factor"] == 8.0
    with pytest.raises(ValueError, match="'llama-2'.*tiny.*llama-3-8b"):
        ModelConfig.preset("llama-2")


def test_seeded_weights_are_deterministic_and_dtype_consistent():
    tiny = ModelConfig.preset("tiny")
    a, b, c = (Model(tiny, seed=s, device="cpu") for s in (0, 0, 1))
    bf16 = Model(tiny, seed=0, dtype=torch.bfloat16, device="cpu")
    for (name, pa), pb, pc, ph in zip(a.named_parameters(), b.parameters(), c.parameters(), bf16.parameters()):
        assert torch.equal(pa, pb), name
        assert torch.equal(ph, pa.to(torch.bfloat16)), name  # bf16 model = the fp32 one, rounded
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name
    caches = a.allocate_kv_cache(num_blocks=5, block_size=4)
    assert len(caches) == tiny.num_hidden_layers
    for kc, vc in caches:
        assert kc.shape == vc.shape == (5, 4, tiny.num_key_value_heads, tiny.head_dim)
        assert kc.dtype == torch.float32 and not kc.any() and not vc.any()
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        a.allocate_kv_cache(5, 0)
    with pytest.raises(ValueError, match="kernel_backend.*'cuda'"):
        a(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), caches, None, kernel_backend="cuda")


def _hub_style(config: dict) -> dict:
    """config.json as checkpoints on the hub write it: rope_theta + rope_scaling."""
    out = {k: v for k, v in config.items() if k != "rope_parameters"}
    rope = dict(config["rope_parameters"])
    out["rope_theta"] = rope.pop("rope_theta")
    out["rope_scaling"] = None if rope["rope_type"] == "default" else {"type": rope.pop("rope_type"), **rope}
    return out


def test_both_config_styles(checkpoint, tmp_path):
    hf, ours, path = checkpoint
    v5 = json.loads((path / "config.json").read_text())
    assert "rope_parameters" in v5  # transformers 5 writes this style
    hub = _hub_style(v5)
    assert ModelConfig.from_hf_config(hub) == ModelConfig.from_hf_config(v5)
    # ... and a checkpoint in the hub style loads to the same logits.
    shutil.copytree(path, tmp_path / "hub")
    (tmp_path / "hub" / "config.json").write_text(json.dumps(hub))
    prompt = _prompts(hf.config.vocab_size, lens=(9,))
    torch.testing.assert_close(dense_logits(load_pretrained(tmp_path / "hub", device="cpu"), prompt)[0],
                               _hf_logits(hf, prompt)[0], atol=ATOL, rtol=0)


def test_load_dtype(checkpoint, tmp_path):
    _, ours, path = checkpoint
    bf16 = load_pretrained(path, dtype=torch.bfloat16, device="cpu")
    for (name, p32), p16 in zip(ours.named_parameters(), bf16.parameters()):
        assert p16.dtype == torch.bfloat16 and torch.equal(p16, p32.to(torch.bfloat16)), name
    # Without dtype=, the checkpoint's own dtype (config.json "dtype") is used.
    shutil.copytree(path, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    assert load_pretrained(tmp_path / "ckpt", device="cpu").dtype == torch.bfloat16


def test_config_parsing():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2)
    c = ModelConfig.from_hf_config(base)
    assert (c.num_key_value_heads, c.head_dim, c.rope_scaling, c.rope_theta) == (2, 4, None, 10000.0)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    c = ModelConfig.from_hf_config({**base, "rope_parameters": {**llama3, "rope_theta": 5e5}})
    assert c.rope_theta == 5e5 and c.rope_scaling == llama3
    with pytest.raises(ValueError, match="'yarn'.*llama3"):
        ModelConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="'MistralForCausalLM'.*LlamaForCausalLM, Qwen2ForCausalLM"):
        ModelConfig.from_hf_config({**base, "architectures": ["MistralForCausalLM"]})
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        ModelConfig.from_hf_config({**base, "num_key_value_heads": 3, "num_attention_heads": 4})


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_pretrained(tmp_path)
    config = dict(architectures=["GPT2LMHeadModel"], vocab_size=10, hidden_size=8, intermediate_size=16,
                  num_hidden_layers=1, num_attention_heads=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM"):
        load_pretrained(tmp_path)
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_pretrained(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        load_pretrained(tmp_path)


def test_load_rejects_a_checkpoint_that_does_not_fit(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    config = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
                  num_hidden_layers=1, num_attention_heads=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = {f"model.{k}": v for k, v in Model(ModelConfig.from_hf_config(config), device="cpu").state_dict().items()}
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    safetensors_torch.save_file({**weights, "model.norm.weight": torch.ones(9)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(9,\).*\(8,\)"):
        load_pretrained(tmp_path)
    up = weights.pop("model.layers.0.mlp.up_proj.weight")
    safetensors_torch.save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="config.json describes 824 parameters, the safetensors files hold 776"):
        load_pretrained(tmp_path)  # refused before the model is allocated
    # as many numbers as the model needs, in a tensor old checkpoints carry and loading skips
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = up.flatten()
    safetensors_torch.save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 tensors.*layers.0.mlp.up_proj.weight"):
        load_pretrained(tmp_path)


def test_load_tokenizer(tmp_path):
    assert load_tokenizer(tmp_path) is None
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "paged": 1, "attention": 2, "blocks": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("paged attention blocks kv").ids == [1, 2, 3, 0]


def test_a_config_number_too_large_for_a_tensor_is_a_float_or_refused_by_name():
    """A config.json may hold an int past int64 (the fuzzer wrote rms_norm_eps=1.9e20 as an int):
    eps and theta are kept as floats, so the forward runs; a window that large is refused by name."""
    import dataclasses

    from pagedkv.model import Model, dense_logits
    from pagedkv.model.config import ModelConfig

    cfg = dataclasses.replace(ModelConfig.preset("tiny-hybrid"), rms_norm_eps=193477592318166969906)
    assert isinstance(cfg.rms_norm_eps, float)
    logits = dense_logits(Model(cfg, seed=0), [[0, 1, 2]])[0]
    assert logits.shape[0] == 3
    with pytest.raises(ValueError, match="sliding_window must be at most 2,147,483,647"):
        dataclasses.replace(ModelConfig.preset("tiny-hybrid"), sliding_window=2**70)
