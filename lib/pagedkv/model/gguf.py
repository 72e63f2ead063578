"""``load_gguf``: a ``Model`` from a llama.cpp GGUF file (Llama or Qwen2 architecture).

Three things differ from a Hugging Face checkpoint:

* **Names.** ``blk.N.attn_q.weight`` is ``layers.N.self_attn.q_proj.weight``,
  ``token_embd`` the embedding, ``output`` the LM head (absent: tied).
* **Shapes and numbers from metadata** (``llama.block_count``,
  ``llama.rope.freq_base``, ...), prefixed by the architecture's name.
* **Llama's Q/K rows are permuted.** llama.cpp rotates adjacent pairs
  (x0, x1), (x2, x3), ...; Hugging Face rotates halves (x0, x_d/2), ...
  Its converter reorders each head's rows of ``q_proj``/``k_proj`` from
  halves to interleaved; we reorder them back. (Qwen2 files keep the halves
  layout, so nothing is undone there.)

Quantized tensors (Q4_1, Q8_0, Q6_K, ...) are dequantized to the requested
dtype: the model computes in floating point, as transformers does with
``gguf_file=``. Everything is checked before a weight is copied.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch

from .config import ModelConfig
from .decoder import Model
from .gguf_file import GGUFFile, read_gguf

__all__ = ["load_gguf", "config_from_gguf", "GGUF_ARCHITECTURES"]

#: GGUF ``general.architecture`` -> ours.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_TOP_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
              "output.weight": "lm_head.weight"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _our_name(name: str) -> str | None:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _LAYER.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def config_from_gguf(file: GGUFFile) -> ModelConfig:
    """The ``ModelConfig`` a GGUF file's metadata describes (ValueError naming the file if unsupported).

    Every value is checked for its type and range before it is used: the
    metadata comes from an untrusted file.
    """
    md, path = file.metadata, file.path
    arch = md.get("general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}")

    def get(key, kind, default=None):
        """``{arch}.{key}`` (or ``default``), an int or (kind float) a finite real, never a bool."""
        value = md.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: metadata {arch}.{key} is missing")
        ok = type(value) is int or (kind is float and type(value) is float and math.isfinite(value))
        if not ok:
            raise ValueError(f"{path}: metadata {arch}.{key} must be {'an integer' if kind is int else 'a number'}, "
                             f"got {type(value).__name__} {value!r}")
        return kind(value)

    heads = get("attention.head_count", int)
    hidden = get("embedding_length", int)
    if heads < 1:
        raise ValueError(f"{path}: metadata {arch}.attention.head_count must be >= 1, got {heads}")
    head_dim = get("attention.key_length", int, hidden // heads)
    if get("rope.dimension_count", int, head_dim) != head_dim:
        raise ValueError(f"{path}: partial RoPE ({arch}.rope.dimension_count != head_dim {head_dim}) "
                         f"is not supported")
    scaling = md.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"{path}: {arch}.rope.scaling.type {scaling!r} is not supported")
    tokens = md.get("tokenizer.ggml.tokens")
    if f"{arch}.vocab_size" in md:
        vocab = get("vocab_size", int)
    elif isinstance(tokens, list) and tokens:
        vocab = len(tokens)
    elif "token_embd.weight" in file.tensors:
        vocab = file.tensors["token_embd.weight"].shape[0]
    else:
        raise ValueError(f"{path}: the vocabulary size is unknown (no {arch}.vocab_size, tokens or token_embd)")
    eos = md.get("tokenizer.ggml.eos_token_id")
    if eos is not None and (type(eos) is not int or not 0 <= eos < vocab):
        raise ValueError(f"{path}: tokenizer.ggml.eos_token_id {eos!r} is not a token id (0..{vocab - 1})")
    try:
        return ModelConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=get("feed_forward_length", int),
            num_hidden_layers=get("block_count", int), num_attention_heads=heads,
            num_key_value_heads=get("attention.head_count_kv", int, heads), head_dim=head_dim,
            rms_norm_eps=get("attention.layer_norm_rms_epsilon", float, 1e-5),
            rope_theta=get("rope.freq_base", float, 10000.0),
            max_position_embeddings=get("context_length", int, 2048),
            tie_word_embeddings="output.weight" not in file.tensors,
            attention_bias=arch == "qwen2", eos_token_id=eos, architecture=GGUF_ARCHITECTURES[arch])
    except (TypeError, ValueError) as e:  # a value in range for its type, not for a model
        raise ValueError(f"{path}: {e}") from None


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: each head's rows from interleaved pairs back to halves.

    Rows ``[h, 2*j + s]`` of the file (pair j, member s) become rows ``[h, s*d/2 + j]``.
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_size(file: GGUFFile, config: ModelConfig) -> None:
    """The metadata's model must fit the file's tensors, checked before the model is allocated.

    Every tensor was checked to lie inside the file, so this bounds what
    ``Model(config)`` allocates by the file's size: a header that claims a
    billion layers fails here, not in the allocator.
    """
    tensors_needed = config.num_hidden_layers * 9 + 2  # 9 weights a layer, the embedding, the final norm
    if len(file.tensors) < tensors_needed:
        raise ValueError(f"{file.path}: the metadata describes {config.num_hidden_layers} layers (at least "
                         f"{tensors_needed} tensors), the file has {len(file.tensors)} tensors")
    held = sum(math.prod(t.shape) for t in file.tensors.values())
    if config.num_parameters > held:
        raise ValueError(f"{file.path}: the metadata describes {config.num_parameters:,} parameters, the file's "
                         f"tensors hold {held:,}")
    freqs = file.tensors.get("rope_freqs.weight")
    if freqs is not None and freqs.shape != (config.head_dim // 2,):
        raise ValueError(f"{file.path}: tensor 'rope_freqs.weight' has shape {freqs.shape}, the metadata implies "
                         f"{(config.head_dim // 2,)}")


def _check_names_and_shapes(file: GGUFFile, ours: dict) -> dict[str, str]:
    """GGUF name -> our name for every tensor; ValueError for a tensor with no place or a wrong shape."""
    mapping, path = {}, file.path
    for name, info in file.tensors.items():
        if name == "rope_freqs.weight":
            continue  # Llama 3.1's per-pair RoPE divisors, applied to inv_freq
        key = _our_name(name)
        if key is None or (key not in ours and key != "lm_head.weight"):
            raise ValueError(f"{path}: tensor {name!r} has no place in a {file.metadata['general.architecture']} "
                             f"model of this config")
        expected = tuple(ours[key].shape) if key in ours else info.shape
        if info.shape != expected:
            raise ValueError(f"{path}: tensor {name!r} has shape {info.shape}, the metadata implies {expected}")
        mapping[name] = key
    missing = set(ours) - set(mapping.values())
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    return mapping


def load_gguf(path, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> Model:
    """A ``Model`` with the (dequantized) weights of the GGUF file at ``path`` (or a parsed ``GGUFFile``).

    The tokenizer of the same file: ``pagedkv.model.load_gguf_tokenizer``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not GGUF, truncated, malformed, an unsupported architecture
            or tensor type, metadata of the wrong type, or tensors that do not
            fit the metadata (each names the file). The metadata's model is
            checked against the file's tensors before it is allocated.
    """
    file = path if isinstance(path, GGUFFile) else read_gguf(Path(path))
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    config = config_from_gguf(file)
    _check_size(file, config)
    model = Model(config, seed=None, dtype=dtype, device=device)
    ours = dict(model.named_parameters())
    mapping = _check_names_and_shapes(file, ours)
    heads = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
    with torch.no_grad():
        for name, key in mapping.items():
            if key not in ours:
                continue  # an output.weight of a tied model
            w = file.tensor(name)
            proj = key.split(".", 2)[-1].rsplit(".", 1)[0]
            if config.architecture == "LlamaForCausalLM" and proj in heads:
                w = unpermute_rows(w, heads[proj])
            ours[key].copy_(torch.from_numpy(np.array(w, dtype=np.float32, copy=True)))
    if "rope_freqs.weight" in file.tensors:
        factors = torch.from_numpy(file.tensor("rope_freqs.weight").copy()).float()
        model.inv_freq = model.inv_freq / factors
    return model.eval()
