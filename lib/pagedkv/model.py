"""A Llama-family decoder that reads and writes a paged KV cache.

The model the engine serves: token embeddings, ``num_hidden_layers`` decoder
layers (RMSNorm, attention with rotary positions and grouped-query heads,
RMSNorm, SwiGLU MLP, each with a residual), a final RMSNorm and the LM head.
Llama 2/3 and Qwen2 are this one network; Qwen2 adds a bias to the q/k/v
projections. The weights are either seeded random (``ModelConfig.preset``,
enough to exercise the memory system) or a local Hugging Face checkpoint
(``load_pretrained``), checked in the tests against ``transformers``.

Two forward passes share every layer and differ only in attention:

* ``Model.forward`` is the serving path. Tokens of all requests arrive
  concatenated (``[num_tokens]``); each layer writes this step's K/V to their
  slots (``reshape_and_cache``) and attends through the block table
  (``paged_attention``). Prefill chunks and decode tokens mix in one launch.
* ``Model.forward_dense`` is the reference: a ``[batch, seq]`` rectangle with
  ``scaled_dot_product_attention(is_causal=True)`` on contiguous K/V, no cache.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ._device import default_device

__all__ = ["ModelConfig", "AttentionMetadata", "Model", "dense_logits", "load_pretrained",
           "load_tokenizer", "SUPPORTED_ARCHITECTURES", "PRESETS"]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
_ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class ModelConfig:
    """The shapes of a Llama-family decoder, named as in Hugging Face's config.json.

    ``rope_scaling`` is None for plain RoPE, or a dict with ``rope_type``
    "llama3" and that scheme's four parameters. ``attention_bias`` puts a bias
    on q/k/v (Qwen2); a Llama checkpoint with ``attention_bias`` also biases
    o_proj, which ``attention_out_bias`` records.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_id: int | list[int] | None = None
    architecture: str = "LlamaForCausalLM"
    attention_out_bias: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type != "llama3":
                raise ValueError(f"rope_scaling type {rope_type!r} is not supported; "
                                 f"supported: {', '.join(_ROPE_TYPES)}")
            missing = [k for k in _LLAMA3_KEYS if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"llama3 rope_scaling lacks {missing}: {self.rope_scaling}")

    @property
    def num_parameters(self) -> int:
        """Parameter count (the tied LM head counted once)."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + self.attention_bias * (q + 2 * kv) + self.attention_out_bias * h
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * layer + h + head

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """A named configuration: "tiny" (about a million parameters, fast on a CPU)
        or "llama-3-8b" (Llama 3.1 8B's shapes and its llama3 RoPE scaling)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
        preset = PRESETS[name]
        return replace(preset, rope_scaling=preset.rope_scaling and dict(preset.rope_scaling))

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelConfig":
        """Read a Hugging Face config.json dict, in either RoPE style.

        transformers 5 writes ``rope_parameters`` (holding ``rope_theta`` and
        ``rope_type``); checkpoints on the hub mostly carry ``rope_theta`` and
        ``rope_scaling`` (whose type key is ``rope_type`` or the older ``type``).
        """
        arch = (config.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported; the MLP is SwiGLU (silu)")
        if config.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported: the MLP projections have no bias")
        if config.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported: every layer attends to the full context")
        if arch == "Qwen2ForCausalLM":  # Qwen2 always biases q/k/v, never o_proj
            bias, out_bias = True, False
        else:
            bias = out_bias = bool(config.get("attention_bias", False))
        heads = config["num_attention_heads"]
        theta, scaling = _rope_from_hf(config)
        # Defaults for absent keys are transformers' LlamaConfig defaults.
        return cls(
            config["vocab_size"], config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
            heads, config.get("num_key_value_heads") or heads, config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), attention_bias=bias,
            eos_token_id=config.get("eos_token_id"), architecture=arch, attention_out_bias=out_bias)


def _rope_from_hf(config: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either config.json style."""
    params = config.get("rope_parameters")
    if params is not None:
        if "rope_theta" not in params and params and all(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"per-layer-type rope_parameters are not supported: {params}")
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = dict(params)
    else:
        theta = config.get("rope_theta", 10000.0)
        scaling = dict(config.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    if scaling.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported: RoPE rotates the whole head")
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(_ROPE_TYPES)}")
    return theta, (None if rope_type == "default" else {"rope_type": rope_type, **scaling})


PRESETS = {
    # GQA ratio 2 (4 query heads share 2 KV heads); 1.1 M parameters.
    "tiny": ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        max_position_embeddings=4096),
    # meta-llama/Llama-3.1-8B: Llama 3 8B's shapes (the KV budget is the same as
    # 3.0's) with 3.1's llama3 RoPE scaling to a 128k context.
    "llama-3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                              head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                              max_position_embeddings=131072, eos_token_id=128001),
}


@dataclass
class AttentionMetadata:
    """Where this step's tokens go and what they may see (built by the engine).

    Tokens are concatenated in request order; request ``r`` owns tokens
    ``query_start_loc[r]:query_start_loc[r+1]``, which are the *last* tokens of
    its ``seq_lens[r]``-token sequence.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1 = padding (write nothing)
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_reqs], each request's total length after this step
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], cumulative query lengths


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE's per-pair angular frequencies, fp32 [head_dim // 2], as transformers computes them.

    Llama 3's scaling keeps high frequencies (wavelength below
    ``original_max / high_freq_factor``), divides low ones by ``factor``, and
    blends linearly in between, so short-range order survives a longer context.
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if config.rope_scaling is None:
        return inv_freq
    s = config.rope_scaling
    old_len, factor = s["original_max_position_embeddings"], s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., heads, head_dim]`` by position (the "rotate half" layout of Llama's weights)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistics in fp32 whatever the model dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    """q/k/v projections and RoPE; *how* q attends to k/v is passed in (paged or dense)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_out_bias)

    def forward(self, x, cos, sin, attend):
        q = apply_rope(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)), cos, sin)
        k = apply_rope(self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return self.o_proj(attend(q, k, v).flatten(-2))  # attend: [..., heads, head_dim] out


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, attend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


def _kernel_ops(kernel_backend: str):
    from . import kernels  # imported here: it loads Triton, which pagedkv.model's config users never need

    if kernel_backend == "triton":
        return kernels.reshape_and_cache, kernels.paged_attention
    if kernel_backend == "torch":
        return kernels.reshape_and_cache_ref, kernels.paged_attention_ref
    raise ValueError(f"kernel_backend must be 'triton' or 'torch', got {kernel_backend!r}")


_DRAW_ON_DEVICE_ABOVE = 10**9  # parameters; smaller models are drawn on the CPU, identical everywhere


class Model(nn.Module):
    """The decoder. Module names follow Hugging Face's (``embed_tokens``,
    ``layers.N.self_attn.q_proj``, ...), so a checkpoint name maps to ours by
    dropping its ``model.`` prefix.

    Args:
        config: the shapes.
        seed: weights ~ N(0, 0.02) (norms 1, biases 0), drawn tensor by tensor on
            the CPU from one seeded generator and then moved, so every machine
            builds the same model and the float32 model rounds to the bf16 one
            (models over a billion parameters on a GPU draw there instead).
            Only one tensor is ever staged on the CPU: Llama-3-8B builds on a GPU
            in bf16 without a CPU copy of the model. ``None`` leaves the weights
            uninitialised (``load_pretrained`` fills them).
        dtype: parameter and KV-cache dtype.
        device: ``pagedkv.default_device()`` if None.
    """

    def __init__(self, config: ModelConfig, seed: int | None = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        super().__init__()
        self.config = config
        with torch.device("meta"):  # shapes only; storage is allocated once, on the target device
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = (None if config.tie_word_embeddings
                            else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.to(dtype).to_empty(device=default_device() if device is None else device)
        self.scale = config.head_dim ** -0.5
        self.inv_freq = rope_inv_freq(config)  # fp32 on the CPU; a plain attribute, so .to(bf16) cannot round it
        if seed is not None:
            self._init_weights(seed)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        # Large models on a GPU draw on the GPU: eight billion values from a CPU
        # generator take most of a minute, and nothing compares such a model's
        # outputs across machines (it exists for memory and speed runs).
        on_device = self.device.type == "cuda" and self.config.num_parameters > _DRAW_ON_DEVICE_ABOVE
        gen = torch.Generator(device=self.device if on_device else "cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif on_device:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.copy_(torch.empty(p.shape).normal_(0.0, 0.02, generator=gen))

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def _rope(self, positions: torch.Tensor):
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One zeroed (key_cache, value_cache) per layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        c = self.config
        shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, attn_metadata: AttentionMetadata,
                kernel_backend: str = "torch") -> torch.Tensor:
        """One engine step over the concatenated tokens; returns hidden states ``[num_tokens, hidden_size]``.

        Each layer writes this step's K/V to ``slot_mapping`` before reading the
        cache, so a token attends to itself and to every earlier token of its
        request, whichever step computed them.
        """
        write, attend = _kernel_ops(kernel_backend)
        if kernel_backend == "triton":
            from .kernels.attention import launch_planned, validated_plan
            from .kernels.kv_write import launch_reshape_and_cache
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be [num_tokens], got shapes "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} entries, the model has {len(self.layers)} layers")
        m = attn_metadata
        cos, sin = self._rope(positions)
        plan = None  # Triton: the first layer validates; the others share its checks (same shapes, same metadata)

        def paged(key_cache, value_cache, q, k, v):  # [num_tokens, heads, head_dim] each
            nonlocal plan
            k, v, q = k.contiguous(), v.contiguous(), q.contiguous()
            args = (key_cache, value_cache, m.block_table, m.seq_lens, m.query_start_loc, self.scale)
            if kernel_backend != "triton":
                write(k, v, key_cache, value_cache, m.slot_mapping)
                return attend(q, *args)
            if plan is None:
                write(k, v, key_cache, value_cache, m.slot_mapping)  # validates the slot mapping
                plan = validated_plan(q, *args)
            else:
                launch_reshape_and_cache(k, v, key_cache, value_cache, m.slot_mapping)
            return launch_planned(plan, q, *args)

        x = self.embed_tokens(input_ids)
        for layer, (key_cache, value_cache) in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, partial(paged, key_cache, value_cache))
        return self.norm(x)

    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The reference path: ``[batch, seq]`` token ids (no padding) to hidden ``[batch, seq, hidden_size]``."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        group = self.config.num_attention_heads // self.config.num_key_value_heads
        cos, sin = self._rope(torch.arange(input_ids.shape[1], device=input_ids.device))

        def causal(q, k, v):  # [batch, seq, heads, head_dim]; SDPA wants heads before seq
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale).transpose(1, 2)

        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, causal)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[..., hidden_size]`` to float32 logits ``[..., vocab_size]``."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()


@torch.no_grad()
def dense_logits(model: Model, token_lists) -> list[torch.Tensor]:
    """Reference logits, one float32 ``[len, vocab]`` per token list (each run alone: no padding)."""
    out = []
    for tokens in token_lists:
        ids = torch.as_tensor(list(tokens), dtype=torch.int64, device=model.device)[None]
        out.append(model.compute_logits(model.forward_dense(ids))[0])
    return out


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    elif (path / "model.safetensors").exists():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no model.safetensors, model.safetensors.index.json or *.safetensors in {path}")
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"shard {f.name} listed in model.safetensors.index.json is missing from {path}")
    return files


def load_pretrained(path, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> Model:
    """A ``Model`` with the weights of a local Hugging Face checkpoint directory.

    Reads ``config.json`` and the safetensors file(s), one or sharded; nothing
    is downloaded. ``dtype`` defaults to the checkpoint's. The LM head is tied
    to the embeddings when the config says so or the checkpoint has none.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    hf = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_hf_config(hf)  # ValueError for an unsupported architecture
    generation = path / "generation_config.json"
    if generation.is_file():  # what generate() stops on, where a model sets it
        config.eos_token_id = json.loads(generation.read_text()).get("eos_token_id", config.eos_token_id)
    if dtype is None:
        dtype = _DTYPES.get(hf.get("dtype") or hf.get("torch_dtype"), torch.float32)

    files = _safetensors_files(path)
    from safetensors import safe_open  # imported here: only loading needs it

    names = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            names.update((n, f) for n in st.keys())
    if "lm_head.weight" not in names:
        config.tie_word_embeddings = True
    model = Model(config, seed=None, dtype=dtype, device=device)

    ours = dict(model.named_parameters())  # HF name = "model." + ours, except lm_head
    missing = set(ours)
    unexpected = [n for n in names if n.removeprefix("model.") not in ours
                  and n != "lm_head.weight" and not n.endswith("rotary_emb.inv_freq")]  # old checkpoints kept it
    if unexpected:
        raise ValueError(f"{len(unexpected)} checkpoint tensors have no place in the model, e.g. {unexpected[:3]}")
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    key = name.removeprefix("model.")
                    if key not in ours:  # lm_head.weight of a tied model (the embedding is the head)
                        continue
                    tensor = st.get_tensor(name)
                    if tensor.shape != ours[key].shape:
                        raise ValueError(f"{name} has shape {tuple(tensor.shape)} in {f.name}, "
                                         f"the config implies {tuple(ours[key].shape)}")
                    ours[key].copy_(tensor)
                    missing.discard(key)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    return model.eval()


def load_tokenizer(path):
    """The ``tokenizers.Tokenizer`` in ``path/tokenizer.json``, or None when there is none."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))
