"""A Llama-family decoder that reads and writes a paged KV cache.

The model the engine serves: token embeddings, ``num_hidden_layers`` decoder
layers (RMSNorm, attention with rotary positions and grouped-query heads,
RMSNorm, SwiGLU MLP, each with a residual), a final RMSNorm and the LM head.
Llama 2/3 and Qwen2 are this one network; Qwen2 adds a bias to the q/k/v
projections. The weights are either seeded random (``ModelConfig.preset``,
enough to exercise the memory system), a local Hugging Face checkpoint
(``checkpoint.load_pretrained``) or a GGUF file (``gguf.load_gguf``), each
checked in the tests against ``transformers``.

Two forward passes share every layer and differ only in attention:

* ``Model.forward`` is the serving path. Tokens of all requests arrive
  concatenated (``[num_tokens]``); each layer writes this step's K/V to their
  slots (``reshape_and_cache``, vLLM's ``reshape_and_cache_flash``) and attends through the block table
  (``paged_attention``). Prefill chunks and decode tokens mix in one launch.
  ``kernel_backend`` chooses how, once (``paged_attention.attention_backend``):
  "triton" (the kernels), "torch" (the whole batch in PyTorch: the CPU path)
  or "torch-ref" (the kernels' references, request by request: what the
  other two are tested against).
* ``Model.forward_dense`` is the reference: a ``[batch, seq]`` rectangle with
  ``scaled_dot_product_attention(is_causal=True)`` on contiguous K/V, no cache.

A config may mix kinds of layers (``ModelConfig.layer_types``): a
sliding-window layer attends to the last ``sliding_window`` positions only.
Layers of one kind form a KV-cache group with its own block table
(``pagedkv.kv_cache_spec``): ``Model.kv_cache_spec`` gives each layer's spec,
``allocate_kv_cache(..., kv_cache_groups)`` lets the groups share tensors, and
``forward`` takes one ``AttentionMetadata`` per layer
(``metadata_by_layer``) where the groups' tables differ. A model of one kind
takes one ``AttentionMetadata`` for every layer, as before.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .._device import default_device
from .config import ModelConfig
from .cpu_linear import PackedLinear, plain_products
from .paged_attention import AttentionBackend, attention_backend
from ..common import check_int
from ..kv_cache_spec import KVCacheGroupSpec, KVCacheSpec, layer_specs_from_types

__all__ = ["AttentionMetadata", "Model", "dense_logits", "rope_inv_freq", "apply_rope", "RMSNorm",
           "metadata_by_layer"]


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


def metadata_by_layer(kv_cache_groups: list[KVCacheGroupSpec], metadata: list[AttentionMetadata]
                      ) -> dict[str, AttentionMetadata]:
    """``{layer name: its group's metadata}``: what ``Model.forward`` takes when groups' tables differ.

    ``metadata[g]`` holds group ``g``'s block table and slot mapping (the
    step's ``seq_lens`` and ``query_start_loc`` are every group's). This is
    vLLM's form: one metadata object per group, named by each of its layers.
    """
    if len(metadata) != len(kv_cache_groups):
        raise ValueError(f"{len(metadata)} AttentionMetadata for {len(kv_cache_groups)} KV-cache groups")
    return {name: meta for group, meta in zip(kv_cache_groups, metadata) for name in group.layer_names}


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
        self.qkv, self.o = PackedLinear(self.q_proj, self.k_proj, self.v_proj), PackedLinear(self.o_proj)

    def forward(self, x, cos, sin, attend):
        h, kv = self.num_heads, self.num_kv_heads
        qkv = self.qkv(x).unflatten(-1, (h + 2 * kv, self.head_dim))  # q, k and v heads side by side
        qk = apply_rope(qkv[..., :h + kv, :], cos, sin)  # RoPE turns q and k alike: one call for both
        q, k, v = qk[..., :h, :], qk[..., h:, :], qkv[..., h + kv:, :]
        return self.o(attend(q, k, v).flatten(-2))  # attend: [..., heads, head_dim] out


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.gate_up, self.down = PackedLinear(self.gate_proj, self.up_proj), PackedLinear(self.down_proj)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


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
        self.head = PackedLinear(self.embed_tokens if self.lm_head is None else self.lm_head, one_row_copy=False)
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

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin of every position's angles, ``[..., head_dim]``: computed in fp32, then rounded to ``dtype``."""
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @property
    def layer_names(self) -> list[str]:
        """Each layer's attention, named as vLLM and ``kv_cache_spec`` name it: ``model.layers.N.self_attn``."""
        return [f"model.layers.{i}.self_attn" for i in range(len(self.layers))]

    def kv_cache_spec(self, block_size: int, max_model_len: int) -> dict[str, KVCacheSpec]:
        """Each layer's KV-cache spec (full attention or sliding window), by layer name, in the model's dtype.

        ``kv_cache_spec.get_kv_cache_groups`` turns it into the groups; a window
        longer than ``max_model_len`` is refused there (``ValueError``).
        """
        c = self.config
        return layer_specs_from_types(c.layer_types or ["full_attention"] * len(self.layers), block_size=block_size,
                                      num_kv_heads=c.num_key_value_heads, head_size=c.head_dim,
                                      max_model_len=max_model_len, sliding_window=c.sliding_window,
                                      dtype=self.dtype)

    def allocate_kv_cache(self, num_blocks: int, block_size: int,
                          kv_cache_groups: list[KVCacheGroupSpec] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One zeroed (key_cache, value_cache) per layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.

        Given ``kv_cache_groups``, layers share tensors as vLLM's do: the
        ``j``-th layer of every group uses tensor pair ``j`` (``KVCacheTensor``'s
        ``shared_by``). It is safe because the groups draw their blocks from
        one pool, so a block id belongs to one group at a time, and a layer
        reads only its own group's blocks. ``len(groups[0].layer_names)``
        pairs then serve every layer.
        """
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            check_int(value, name, 1)
        c = self.config
        shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)

        def pair():
            return (torch.zeros(shape, dtype=self.dtype, device=self.device),
                    torch.zeros(shape, dtype=self.dtype, device=self.device))

        if kv_cache_groups is None:
            return [pair() for _ in self.layers]
        names = [n for g in kv_cache_groups for n in g.layer_names]
        if sorted(names) != sorted(self.layer_names):
            raise ValueError(f"kv_cache_groups must name every layer once ({len(self.layer_names)} layers), "
                             f"got {names}")
        for g, group in enumerate(kv_cache_groups):
            if group.kv_cache_spec.block_size != block_size:
                raise ValueError(f"KV-cache group {g} has block_size {group.kv_cache_spec.block_size}, "
                                 f"the cache is allocated with {block_size}")
        tensors = [pair() for _ in range(max(len(g.layer_names) for g in kv_cache_groups))]
        by_name = {n: tensors[j] for g in kv_cache_groups for j, n in enumerate(g.layer_names)}
        return [by_name[n] for n in self.layer_names]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches,
                attn_metadata: AttentionMetadata | dict[str, AttentionMetadata],
                kernel_backend: str | AttentionBackend = "torch") -> torch.Tensor:
        """One engine step over the concatenated tokens; returns hidden states ``[num_tokens, hidden_size]``.

        ``attn_metadata``: one ``AttentionMetadata`` for every layer, or one
        per layer name (``metadata_by_layer``: each KV-cache group's table).
        The backend checks the metadata and plans once per (metadata, window)
        before any layer runs; then each layer writes this step's K/V to its
        ``slot_mapping`` before reading the cache, so a token attends to itself
        and to every earlier token of its request (a sliding-window layer: the
        last ``sliding_window``), whichever step computed them.
        """
        backend = attention_backend(kernel_backend)
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be [num_tokens], got shapes "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} entries, the model has {len(self.layers)} layers")
        c = self.config
        q_shape = (input_ids.shape[0], c.num_attention_heads, c.head_dim)
        if c.layer_types is None and not isinstance(attn_metadata, dict):  # one kind, one table: one plan
            layer_plans = [backend.build(attn_metadata, *kv_caches[0], q_shape, self.scale)] * len(self.layers)
        else:
            layer_plans = self._plans_per_layer(backend, attn_metadata, kv_caches, q_shape)
        x = self.embed_tokens(input_ids)
        cos, sin = self._rope(positions, x.dtype)
        for layer, plan, (key_cache, value_cache) in zip(self.layers, layer_plans, kv_caches):
            x = layer(x, cos, sin, partial(backend.forward, plan, key_cache, value_cache))
        return self.norm(x)

    def _plans_per_layer(self, backend, attn_metadata, kv_caches, q_shape) -> list:
        """Each layer's plan; layers with the same metadata (a KV-cache group) and window share one."""
        metas = [attn_metadata] * len(self.layers)
        if isinstance(attn_metadata, dict):
            names = self.layer_names
            missing = [n for n in names if n not in attn_metadata]
            unknown = sorted(set(attn_metadata) - set(names))
            if missing or unknown:
                raise ValueError(f"attn_metadata must name every layer of the model: missing {missing}, "
                                 f"unknown {unknown}")
            metas = [attn_metadata[n] for n in names]
        plans, layer_plans = {}, []
        for meta, window, caches in zip(metas, self.config.layer_windows, kv_caches):
            if (id(meta), window) not in plans:
                plans[id(meta), window] = backend.build(meta, *caches, q_shape, self.scale, window)
            layer_plans.append(plans[id(meta), window])
        return layer_plans

    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The reference path: ``[batch, seq]`` token ids (no padding) to hidden ``[batch, seq, hidden_size]``.

        No cache, one causal SDPA per layer. Its products are the CPU's packed
        ones unless run inside ``cpu_linear.plain_products()``, as
        ``dense_logits`` does by default.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        vocab = self.config.vocab_size
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
            bad = int(input_ids[(input_ids < 0) | (input_ids >= vocab)][0])
            raise ValueError(f"input_ids holds {bad}, which is not a token id of the model (0..{vocab - 1})")
        group = self.config.num_attention_heads // self.config.num_key_value_heads
        seq = input_ids.shape[1]
        cos, sin = self._rope(torch.arange(seq, device=input_ids.device), self.dtype)

        def causal(q, k, v, window=None):  # [batch, seq, heads, head_dim]; SDPA wants heads before seq
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            if window is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale).transpose(1, 2)
            # query i sees keys i - window + 1 .. i
            mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril().triu(1 - window)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale).transpose(1, 2)

        x = self.embed_tokens(input_ids)
        for layer, window in zip(self.layers, self.config.layer_windows):
            x = layer(x, cos, sin, partial(causal, window=window))
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[..., hidden_size]`` to float32 logits ``[..., vocab_size]``."""
        return self.head(hidden).float()


@torch.no_grad()
def dense_logits(model: Model, token_lists, plain: bool = True) -> list[torch.Tensor]:
    """Reference logits, one float32 ``[len, vocab]`` per token list (each run alone: no padding).

    ``plain``: transformers' own products, ``F.linear`` (the reference the
    tests hold the engine to); False: the CPU's packed products, as the engine
    serves (``cpu_linear``), which round differently.
    """
    out = []
    for tokens in token_lists:
        ids = torch.as_tensor(list(tokens), dtype=torch.int64, device=model.device)[None]
        with plain_products() if plain else nullcontext():
            out.append(model.compute_logits(model.forward_dense(ids))[0])
    return out
