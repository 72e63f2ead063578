"""The seed inputs of the corpus: small valid files, written the way the tests write them.

``python -m tools.fuzz seeds`` rewrites every ``seed-*`` and ``hostile-*``
file (the fuzzer's finds, ``crash-*``, are kept). ``hostile-*`` are
hand-written GGUF headers, one per check of the reader (``hostile()``). The seeds cover, for the GGUF reader, both architectures,
with and without a tokenizer and a chat template, tied and untied heads,
``rope_freqs``, and every tensor type the ``gguf`` package dequantizes (one
small single-tensor file each); for ``load_pretrained``, a Llama and a tied
Qwen2 checkpoint; for the tokenizer, metadata-only GGUF files and bare
templates; for the sampling target, a few fixed byte strings.
"""

from __future__ import annotations

import json
import random
import struct
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from . import tiny
from .targets import SEPARATOR

# ----------------------------------------------------------------------------- a model as GGUF
# Shared with lib/tests/test_model_gguf.py, which writes its synthetic files with these, so the
# corpus's seeds and the loader's tests agree on what a converter's file looks like.
_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
_TOP = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def gguf_name(ours: str) -> str:
    """The GGUF tensor name of one of ``Model``'s parameters (``layers.0.mlp.up_proj.weight``)."""
    if ours in _TOP:
        return _TOP[ours]
    _, n, rest = ours.split(".", 2)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{n}.{_GGUF_NAMES[module]}.{kind}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's Q/K rows from halves (HF) to interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_hparams(w, config) -> None:
    """The hyperparameters llama.cpp's converter writes, added to the ``gguf.GGUFWriter`` ``w``."""
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_theta)


def model_tensors(model, arch: str, skip=()):
    """``(GGUF name, float32 array)`` of every parameter of ``model`` not named in ``skip``.

    For ``arch == "llama"`` the Q and K rows are permuted as llama.cpp's
    converter does (a loader must undo it); Qwen2 files keep the HF layout.
    """
    c = model.config
    for name, p in model.named_parameters():
        if name in skip:
            continue
        arr = p.detach().float().numpy().copy()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = _permute(arr, c.num_attention_heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = _permute(arr, c.num_key_value_heads)
        yield gguf_name(name), arr


def write_out(w) -> None:
    """Write the ``gguf.GGUFWriter`` ``w``'s header, metadata and tensors, and close the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gguf_bytes(write) -> bytes:
    """The bytes of a GGUF file that ``write(path)`` writes."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "seed.gguf"
        write(path)
        return path.read_bytes()


def _model_gguf(model, qtype_name: str, arch: str, tokenizer: bool, template: str | None, *,
                tied: bool = False, rope_freqs: bool = False) -> bytes:
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]

    def write(path):
        c = model.config
        w = gguf.GGUFWriter(str(path), arch)
        add_hparams(w, c)
        if tokenizer:
            w.add_tokenizer_model("gpt2")
            w.add_tokenizer_pre("smollm")
            w.add_token_list(tiny.TOKENS)
            w.add_token_types(tiny.TOKEN_TYPES)
            w.add_token_merges(tiny.MERGES)
            w.add_bos_token_id(62)
            w.add_eos_token_id(tiny.EOS)
            if template is not None:
                w.add_chat_template(template)
        for name, arr in model_tensors(model, arch, skip=("lm_head.weight",) if tied else ()):
            if arr.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
                w.add_tensor(name, arr)
            elif qtype == gguf.GGMLQuantizationType.F16:
                w.add_tensor(name, arr.astype(np.float16))
            else:
                w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        if rope_freqs:
            w.add_tensor("rope_freqs.weight", np.linspace(1, 4, c.head_dim // 2, dtype=np.float32))
        write_out(w)

    return _gguf_bytes(write)


def _one_tensor_gguf(qtype) -> bytes:
    """A file holding one [2, block] tensor of ``qtype`` (random bits, finite fp16 scales not needed)."""
    import gguf

    block, size = gguf.constants.GGML_QUANT_SIZES[qtype]

    def write(path):
        w = gguf.GGUFWriter(str(path), "llama")
        raw = np.random.default_rng(int(qtype)).integers(0, 256, (2, size), dtype=np.uint8)
        w.add_tensor("token_embd.weight", raw, raw_dtype=qtype)
        write_out(w)

    return _gguf_bytes(write)


def _dequantizable() -> list:
    import gguf
    from gguf.quants import dequantize

    kinds = []
    for qtype, (block, size) in gguf.constants.GGML_QUANT_SIZES.items():
        try:
            dequantize(np.zeros((1, size), dtype=np.uint8), qtype)
        except (NotImplementedError, ValueError, KeyError):
            continue
        kinds.append(qtype)
    return kinds


def _tokenizer_gguf(template: str | None, pre: str) -> bytes:
    import gguf

    def write(path):
        w = gguf.GGUFWriter(str(path), "llama")
        for key, value in tiny.tokenizer_metadata(template, pre).items():
            if isinstance(value, str):
                w.add_string(key, value)
            elif isinstance(value, list) and isinstance(value[0], str):
                w.add_array(key, value)
            elif isinstance(value, list):
                w.add_array(key, [int(v) for v in value])
            else:
                w.add_uint32(key, value)
        write_out(w)

    return _gguf_bytes(write)


def _checkpoint(model, hf_config: dict, dtype: torch.dtype, tied: bool) -> bytes:
    from safetensors.torch import save

    tensors = {("model." + n if n != "lm_head.weight" else n): p.detach().to(dtype).contiguous()
               for n, p in model.named_parameters() if not (tied and n == "lm_head.weight")}
    return json.dumps(hf_config, indent=1).encode() + SEPARATOR + save(tensors)


def seeds() -> dict[str, dict[str, bytes]]:
    """target -> {file name: bytes} of every seed."""
    from pagedkv.model import Model

    c = tiny.CONFIG
    llama = Model(c, seed=0, device="cpu")
    wide = Model(replace(c, hidden_size=32, intermediate_size=32, head_dim=16), seed=1, device="cpu")
    qwen = Model(replace(c, attention_bias=True, architecture="Qwen2ForCausalLM", tie_word_embeddings=True),
                 seed=2, device="cpu")
    out = {"gguf": {}, "pretrained": {}, "tokenizer": {}, "sampling": {}}
    g = out["gguf"]
    g["seed-llama-f32-tokenizer-template.gguf"] = _model_gguf(llama, "F32", "llama", True, tiny.TEMPLATES["plain"])
    g["seed-llama-f16-tokenizer-no-template.gguf"] = _model_gguf(llama, "F16", "llama", True, None)
    g["seed-llama-q8_0-tied-rope-freqs.gguf"] = _model_gguf(wide, "Q8_0", "llama", False, None, tied=True,
                                                            rope_freqs=True)
    g["seed-qwen2-f32-tied-no-tokenizer.gguf"] = _model_gguf(qwen, "F32", "qwen2", False, None, tied=True)
    g["seed-qwen2-f16-tokenizer-chatml.gguf"] = _model_gguf(qwen, "F16", "qwen2", True, tiny.TEMPLATES["chatml"],
                                                           tied=True)
    for qtype in _dequantizable():
        g[f"seed-type-{qtype.name.lower()}.gguf"] = _one_tensor_gguf(qtype)

    p = out["pretrained"]
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": False,
            "eos_token_id": tiny.EOS, "torch_dtype": "float32"}
    p["seed-llama-f32.bin"] = _checkpoint(llama, base, torch.float32, tied=False)
    qwen_config = dict(base, architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True,
                       torch_dtype="bfloat16", rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    del qwen_config["rope_theta"]
    p["seed-qwen2-bf16-tied.bin"] = _checkpoint(qwen, qwen_config, torch.bfloat16, tied=True)
    llama3 = dict(base, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    p["seed-llama3-rope-f16.bin"] = _checkpoint(llama, llama3, torch.float16, tied=False)

    for i in range(4):  # the structured half of the target: a zero byte, then the choices
        p[f"seed-structured-{i}.bin"] = b"\0" + bytes(random.Random(i).randrange(256) for _ in range(48))

    t = out["tokenizer"]
    t["seed-metadata-plain.gguf"] = _tokenizer_gguf(tiny.TEMPLATES["plain"], "smollm")
    t["seed-metadata-llama3-pre-roles.gguf"] = _tokenizer_gguf(tiny.TEMPLATES["roles"], "llama-bpe")
    t["seed-metadata-qwen2-no-template.gguf"] = _tokenizer_gguf(None, "qwen2")
    for name, template in tiny.TEMPLATES.items():
        t[f"seed-template-{name}.jinja"] = template.encode()

    rng = random.Random(0)
    for i in range(4):
        out["sampling"][f"seed-bytes-{i}"] = bytes(rng.randrange(256) for _ in range(64 * (i + 1)))
    return out


def write_seeds(corpus: Path) -> list[str]:
    """Replace every ``seed-*`` file under ``corpus``; one line per target saying what was written."""
    lines = []
    for target, files in seeds().items():
        d = corpus / target
        d.mkdir(parents=True, exist_ok=True)
        for old in [*d.glob("seed-*"), *d.glob("hostile-*")]:
            old.unlink()
        for name, data in files.items():
            (d / name).write_bytes(data)
        lines.append(f"{target}: {len(files)} seeds, {sum(map(len, files.values())):,} bytes")
    for name, data in hostile().items():
        (corpus / "gguf" / name).write_bytes(data)
    return lines


# ----------------------------------------------------------------------------- hostile headers
def _kv(key: str, type_id: int, payload: bytes) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", type_id) + payload


def _str(s: str) -> bytes:
    return struct.pack("<Q", len(s.encode())) + s.encode()


def _u32(key: str, v: int) -> bytes:
    return _kv(key, 4, struct.pack("<I", v))


def _tensor(name: str, dims, type_id: int = 0, offset: int = 0) -> bytes:
    return _str(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<II", type_id, 0)[:4] + struct.pack("<Q", offset)


def _raw_gguf(kvs: list[bytes], tensors: list[bytes] = (), data: bytes = b"\0" * 64) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)
    return head + b"\0" * (-len(head) % 32) + data


def hostile() -> dict[str, bytes]:
    """Hand-written hostile GGUF headers (file name -> bytes): each must be refused with a ValueError."""
    arch = _kv("general.architecture", 8, _str("llama"))
    nested = struct.pack("<IQ", 9, 1) * 3000 + struct.pack("<IQ", 4, 0)  # arrays of arrays, 3000 deep
    f32 = lambda name, dims, offset=0: _tensor(name, dims, 0, offset)  # noqa: E731
    return {
        "hostile-alignment-zero.gguf": _raw_gguf([_u32("general.alignment", 0)]),
        "hostile-alignment-string.gguf": _raw_gguf([_kv("general.alignment", 8, _str("32"))]),
        "hostile-alignment-not-power-of-two.gguf": _raw_gguf([_u32("general.alignment", 24)]),
        "hostile-arrays-nested-3000-deep.gguf": _raw_gguf([_kv("x", 9, nested)]),
        "hostile-string-array-claims-2-60.gguf": _raw_gguf([_kv("tokenizer.ggml.tokens", 9,
                                                                 struct.pack("<IQ", 8, 1 << 60))]),
        "hostile-key-twice.gguf": _raw_gguf([arch, arch]),
        "hostile-tensor-twice.gguf": _raw_gguf([arch], [f32("token_embd.weight", [4]), f32("token_embd.weight", [4])]),
        "hostile-tensor-five-dims.gguf": _raw_gguf([arch], [f32("token_embd.weight", [1, 1, 1, 1, 1])]),
        "hostile-tensor-zero-dim.gguf": _raw_gguf([arch], [f32("token_embd.weight", [4, 0])]),
        "hostile-tensor-shape-overflows.gguf": _raw_gguf([arch], [f32("token_embd.weight", [1 << 32, 1 << 32])]),
        "hostile-tensor-offset-misaligned.gguf": _raw_gguf([arch], [f32("token_embd.weight", [4], offset=4)]),
        "hostile-head-count-zero.gguf": _raw_gguf([arch, _u32("llama.attention.head_count", 0),
                                                   _u32("llama.embedding_length", 16)]),
        "hostile-block-count-string.gguf": _raw_gguf([arch, _u32("llama.attention.head_count", 2),
                                                      _u32("llama.embedding_length", 16),
                                                      _kv("llama.block_count", 8, _str("two"))]),
        "hostile-architecture-array.gguf": _raw_gguf([_kv("general.architecture", 9, struct.pack("<IQ", 4, 0))]),
        "hostile-tokenizer-pre-array.gguf": _raw_gguf([_kv("tokenizer.ggml.model", 8, _str("gpt2")),
                                                       _kv("tokenizer.ggml.pre", 9, struct.pack("<IQ", 4, 0))]),
        "hostile-merges-numbers.gguf": _raw_gguf([
            _kv("tokenizer.ggml.model", 8, _str("gpt2")),
            _kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2) + _str("A") + _str("B")),
            _kv("tokenizer.ggml.merges", 9, struct.pack("<IQ", 4, 1) + struct.pack("<I", 7))]),
        "hostile-eos-not-a-token.gguf": _raw_gguf([
            _kv("tokenizer.ggml.model", 8, _str("gpt2")),
            _kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2) + _str("A") + _str("B")),
            _u32("tokenizer.ggml.eos_token_id", 7)]),
    }
