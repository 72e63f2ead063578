"""``ModelConfig``: the shapes of a Llama-family decoder, and its named presets.

Names follow Hugging Face's ``config.json``; ``from_hf_config`` reads one
(both RoPE styles) and rejects what the decoder cannot run, naming the key.
A Qwen2 config may mix sliding-window and full-attention layers
(``layer_types``, ``sliding_window``), as Gemma 3 and gpt-oss do.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from ..common import check_bool, check_int, check_real

__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES", "MODEL_TYPES", "PRESETS"]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
#: ``layer_types`` entries the decoder runs.
LAYER_TYPES = ("full_attention", "sliding_attention")
_ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


# The largest window a layer may have: positions are int32 in the kernels.
_MAX_WINDOW = 2**31 - 1


@dataclass
class ModelConfig:
    """The shapes of a Llama-family decoder, named as in Hugging Face's config.json.

    ``rope_scaling`` is None for plain RoPE, or a dict with ``rope_type``
    "llama3" and that scheme's four parameters. ``attention_bias`` puts a bias
    on q/k/v (Qwen2); a Llama checkpoint with ``attention_bias`` also biases
    o_proj, which ``attention_out_bias`` records.

    ``layer_types`` (None: every layer full attention) names each layer's
    kind, "full_attention" or "sliding_attention"; a sliding layer's query at
    position ``p`` sees the ``sliding_window`` keys ``p - sliding_window + 1 ..
    p``, as transformers' mask and vLLM's kernels do. Only a Qwen2 config may
    have sliding layers: transformers' Llama has none, so no reference would
    check them.
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
    layer_types: list[str] | None = None
    sliding_window: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            check_int(value, f"ModelConfig.{name}", 1)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        # Stored as floats: a config.json may hold a whole number too large for
        # any tensor (an int past int64), which float() still represents.
        self.rms_norm_eps = check_real(self.rms_norm_eps, "ModelConfig.rms_norm_eps", minimum=0, open_min=True)
        self.rope_theta = check_real(self.rope_theta, "ModelConfig.rope_theta", minimum=0, open_min=True)
        for name in ("tie_word_embeddings", "attention_bias", "attention_out_bias"):
            check_bool(getattr(self, name), f"ModelConfig.{name}")
        eos = self.eos_token_id
        for i, t in enumerate(eos if isinstance(eos, list) else [] if eos is None else [eos]):
            check_int(t, "ModelConfig.eos_token_id" + (f"[{i}]" if isinstance(eos, list) else ""), 0)
        if not isinstance(self.architecture, str) or self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict):
                raise TypeError(f"ModelConfig.rope_scaling must be a dict or None, got {self.rope_scaling!r}")
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type != "llama3":
                raise ValueError(f"rope_scaling type {rope_type!r} is not supported; "
                                 f"supported: {', '.join(_ROPE_TYPES)}")
            missing = [k for k in _LLAMA3_KEYS if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"llama3 rope_scaling lacks {missing}: {self.rope_scaling}")
            s = self.rope_scaling  # transformers' _validate_llama3_parameters, which RoPE's formula needs
            check_real(s["factor"], "rope_scaling.factor", minimum=1)
            low = check_real(s["low_freq_factor"], "rope_scaling.low_freq_factor", minimum=0, open_min=True)
            check_real(s["high_freq_factor"], "rope_scaling.high_freq_factor", minimum=low, open_min=True)
            check_int(s["original_max_position_embeddings"], "rope_scaling.original_max_position_embeddings", 1)
        self._check_layer_types()

    def _check_layer_types(self) -> None:
        if self.sliding_window is not None:
            check_int(self.sliding_window, "ModelConfig.sliding_window", 1)
            if self.sliding_window > _MAX_WINDOW:
                raise ValueError(f"ModelConfig.sliding_window must be at most {_MAX_WINDOW:,} (positions are "
                                 f"int32 in the kernels), got {self.sliding_window!r}")
        if self.layer_types is None:
            return
        if not isinstance(self.layer_types, list):
            raise TypeError(f"ModelConfig.layer_types must be a list or None, got {self.layer_types!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries, the model has "
                             f"num_hidden_layers={self.num_hidden_layers}")
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ValueError(f"layer {i}: layer type {kind!r} is not supported; "
                                 f"supported: {', '.join(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types:
            i = self.layer_types.index("sliding_attention")
            if self.sliding_window is None:
                raise ValueError(f"layer {i} is a sliding_attention layer but sliding_window is None")
            if self.architecture != "Qwen2ForCausalLM":
                raise ValueError(f"layer {i}: {self.architecture} has no sliding-window layers in "
                                 "transformers; a config mixing layer types must be a Qwen2ForCausalLM")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window, or None for a full-attention layer."""
        kinds = self.layer_types or ["full_attention"] * self.num_hidden_layers
        return tuple(self.sliding_window if k == "sliding_attention" else None for k in kinds)

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
        """A named configuration: "tiny" (about a million parameters, fast on a CPU),
        "tiny-hybrid" (the same shapes as a Qwen2 mixing sliding-window and full
        attention) or "llama-3-8b" (Llama 3.1 8B's shapes and its llama3 RoPE scaling)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
        preset = PRESETS[name]
        return replace(preset, rope_scaling=preset.rope_scaling and dict(preset.rope_scaling),
                       layer_types=preset.layer_types and list(preset.layer_types))

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelConfig":
        """Read a Hugging Face config.json dict, in either RoPE style.

        transformers 5 writes ``rope_parameters`` (holding ``rope_theta`` and
        ``rope_type``); checkpoints on the hub mostly carry ``rope_theta`` and
        ``rope_scaling`` (whose type key is ``rope_type`` or the older ``type``).
        """
        if not isinstance(config, dict):
            raise TypeError(f"a config must be a JSON object (a dict), got {type(config).__name__}")
        arch = _architecture(config)
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported; the MLP is SwiGLU (silu)")
        if config.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported: the MLP projections have no bias")
        layer_types, window = _layer_types_from_hf(config, arch)
        if arch == "Qwen2ForCausalLM":  # Qwen2 always biases q/k/v, never o_proj
            bias, out_bias = True, False
        else:
            bias = out_bias = bool(config.get("attention_bias", False))
        for key in _REQUIRED:  # checked before any arithmetic on them
            check_int(config[key], key, 1)
        heads = config["num_attention_heads"]
        theta, scaling = _rope_from_hf(config)
        # Defaults for absent keys are transformers' LlamaConfig defaults.
        return cls(
            config["vocab_size"], config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
            heads, config.get("num_key_value_heads") or heads, config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=check_real(theta, "rope_theta"),
            rope_scaling=scaling,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), attention_bias=bias,
            eos_token_id=config.get("eos_token_id"), architecture=arch, attention_out_bias=out_bias,
            layer_types=layer_types, sliding_window=window)


#: architecture -> the ``model_type`` a config.json of it carries.
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _architecture(config: dict) -> str:
    """The architecture a config.json describes, its ``model_type`` and ``architectures`` agreeing."""
    model_type, archs = config.get("model_type"), config.get("architectures")
    if model_type is not None and model_type not in MODEL_TYPES.values():
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(MODEL_TYPES.values())}")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ValueError(f"architectures must be a list of names, got {archs!r}")
    if archs:
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if model_type is not None and MODEL_TYPES[arch] != model_type:
            raise ValueError(f"model_type {model_type!r} disagrees with architectures {archs} "
                             f"(a {arch} has model_type {MODEL_TYPES[arch]!r})")
    else:  # no architectures: the model_type decides (Llama when neither is given)
        arch = {t: a for a, t in MODEL_TYPES.items()}.get(model_type, "LlamaForCausalLM")
    missing = [k for k in _REQUIRED if k not in config]
    if missing:
        raise ValueError(f"the config lacks {', '.join(missing)} (is it a Llama-family config.json?)")
    return arch


def _layer_types_from_hf(config: dict, arch: str) -> tuple[list[str] | None, int | None]:
    """(layer_types, sliding_window) as transformers' ``Qwen2Config`` resolves them.

    Qwen2's window is on only with ``use_sliding_window``; then the config's
    ``layer_types`` or, absent, "sliding_attention" from layer
    ``max_window_layers`` on. Without it every layer is full attention (the
    hub's Qwen2.5 configs carry a ``sliding_window`` that is off). A Llama
    config with a window is refused: transformers' Llama would ignore it.
    """
    types = config.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        raise ValueError(f"layer_types must be a list of names, got {types!r}")
    if arch != "Qwen2ForCausalLM":
        if config.get("use_sliding_window") or (types and "sliding_attention" in types):
            raise ValueError(f"{arch} has no sliding-window layers in transformers (use_sliding_window="
                             f"{config.get('use_sliding_window')!r}, layer_types={types!r}); a config mixing "
                             "layer types must be a Qwen2ForCausalLM")
        return None, None
    if not config.get("use_sliding_window"):
        if types and "sliding_attention" in types:  # transformers would build a window of None
            raise ValueError(f"layer_types has sliding_attention layers but use_sliding_window is "
                             f"{config.get('use_sliding_window')!r}: the window is off")
        return None, None
    window = check_int(config.get("sliding_window", 4096), "sliding_window", 1)
    if types is None:
        first = check_int(config.get("max_window_layers", 28), "max_window_layers", 0)
        types = ["sliding_attention" if i >= first else "full_attention"
                 for i in range(config["num_hidden_layers"])]
    return list(types), window


def _rope_from_hf(config: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either config.json style."""
    params = config.get("rope_parameters")
    for key in ("rope_parameters", "rope_scaling"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise ValueError(f"{key} must be a JSON object or null, got {config[key]!r}")
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
    # "tiny" as a Qwen2 whose layers mix kinds as Gemma 3 does: sliding-window
    # layers with full attention every third layer.
    "tiny-hybrid": ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=6,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                               max_position_embeddings=4096, attention_bias=True,
                               architecture="Qwen2ForCausalLM",
                               layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                               sliding_window=16),
}

