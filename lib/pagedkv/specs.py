"""Model and GPU specs: the presets the book sizes, a model's own ``config.json``, KV dtypes.

What :mod:`pagedkv.budget` computes with. A model is its shape -- layers,
attention heads, KV heads, head size, parameters, context -- and a GPU its
memory and bandwidth, taken from a preset by name or, for a model, from a
Hugging Face ``config.json`` (Llama-, Mistral- and Qwen2-shaped; what cannot be
sized from one KV head count and one head size, such as sliding-window or
hybrid models, is refused by name). ``pagedkv.budget`` re-exports every name
here, so ``budget.ModelSpec`` and ``budget.model_spec_from_config`` work too.

Units: GiB = 2**30 bytes, MiB = 2**20 bytes (what nvidia-smi calls "MiB").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .common import check_int, check_real

KiB, MiB, GiB = 2**10, 2**20, 2**30

# Bytes per element of the KV cache for each cache dtype vLLM accepts.
DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "float32": 4,
    "fp16": 2,
    "float16": 2,
    "bf16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}


@dataclass(frozen=True)
class ModelSpec:
    """The facts about a model that KV sizing needs (from each model's config.json)."""

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    native_context: int
    extended_context: int  # with the model's published RoPE scaling; equal to native if none

    #: The checkpoint's dtype; the presets are all bf16 checkpoints.
    torch_dtype = "bfloat16"

    @classmethod
    def from_hf_config(cls, config, name: str | None = None) -> "ConfigModelSpec":
        """A spec from a Hugging Face ``config.json`` (a dict, or the file's path).

        See :func:`model_spec_from_config`.
        """
        return model_spec_from_config(config, name)

    @property
    def attention(self) -> str:
        if self.num_kv_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"


@dataclass(frozen=True)
class ConfigModelSpec(ModelSpec):
    """A :class:`ModelSpec` read from a ``config.json``, with the checkpoint's dtype."""

    torch_dtype: str = "bfloat16"


@dataclass(frozen=True)
class GPUSpec:
    """A GPU as the engine sizes it: its total memory in MiB, and, where known, its peak bandwidth.

    ``total_mib`` is the total nvidia-smi prints (``memory.total``, the
    "Memory-Usage" column's right-hand figure; MiB = 2**20 bytes).
    ``peak_bandwidth_gbs`` is the datasheet's memory bandwidth in GB/s
    (10**9 bytes per second), or ``None`` where it is not known: pool sizing
    never reads it; what does (a benchmark's share of peak, a time model)
    asks :meth:`require_bandwidth`, which refuses by name. ``0`` is accepted
    as an older spelling of "not known" and stored as ``None``.

    ``source`` and ``bandwidth_source`` are where the two figures come from
    (URLs); ``device_names`` the names CUDA gives the card
    (``torch.cuda.get_device_name``, the same string nvidia-smi prints), which
    :func:`gpu_for_device_name` matches exactly.

    Build one from a memory size with :meth:`from_mib`, or pass the size as
    nvidia-smi prints it wherever a GPU is asked for (``"81559MiB"``,
    ``"81559 MiB"``; :func:`gpu_spec`).
    """

    name: str
    total_mib: int
    peak_bandwidth_gbs: float | None = None  # HBM/GDDR bandwidth from the datasheet, GB/s (10**9)
    source: str = ""
    bandwidth_source: str = ""
    device_names: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.strip():
            raise TypeError(f"GPUSpec name must be a non-empty str, got {type(self.name).__name__} "
                            f"{self.name!r}")
        object.__setattr__(self, "total_mib", check_int(self.total_mib, "GPUSpec total_mib", 1))
        bw = self.peak_bandwidth_gbs
        if bw is not None:
            bw = check_real(bw, "GPUSpec peak_bandwidth_gbs", minimum=0)
            object.__setattr__(self, "peak_bandwidth_gbs", bw or None)
        if isinstance(self.device_names, str) or not all(
                isinstance(n, str) for n in self.device_names):
            raise TypeError(f"GPUSpec device_names must be a tuple of str, got {self.device_names!r}")
        object.__setattr__(self, "device_names", tuple(self.device_names))

    @classmethod
    def from_mib(cls, total_mib: int, name: str | None = None,
                 peak_bandwidth_gbs: float | None = None) -> "GPUSpec":
        """A GPU known by its total memory in MiB, as nvidia-smi prints it
        (``GPUSpec.from_mib(81559)``); named ``"a 81,559-MiB GPU"`` unless
        ``name`` is given. The bandwidth stays unknown unless given."""
        mib = check_int(total_mib, "total_mib", 1)
        return cls(f"a {mib:,}-MiB GPU" if name is None else name, mib, peak_bandwidth_gbs)

    @property
    def total_bytes(self) -> int:
        return self.total_mib * MiB

    def require_bandwidth(self, purpose: str = "this figure") -> float:
        """The peak bandwidth in GB/s, or a ``ValueError`` naming the GPU and ``purpose``
        when it is not known (pool sizing never needs it; a share of peak does)."""
        if self.peak_bandwidth_gbs is None:
            raise ValueError(
                f"{purpose} needs the GPU's peak memory bandwidth, and {self.name!r} has none: "
                f"give peak_bandwidth_gbs (GB/s, from the card's datasheet), e.g. "
                f"GPUSpec.from_mib({self.total_mib}, peak_bandwidth_gbs=...)")
        return self.peak_bandwidth_gbs


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec("Llama-3-8B", 32, 32, 8, 128, 8_030_261_248, 8_192, 8_192),
        ModelSpec("Llama-3.1-8B", 32, 32, 8, 128, 8_030_261_248, 131_072, 131_072),
        ModelSpec("Llama-3.1-70B", 80, 64, 8, 128, 70_553_706_496, 131_072, 131_072),
        ModelSpec("Mistral-7B", 32, 32, 8, 128, 7_241_732_096, 32_768, 32_768),
        ModelSpec("Qwen2.5-7B", 28, 28, 4, 128, 7_615_616_512, 32_768, 131_072),
        # The contrast: multi-head attention keeps one KV head per query head.
        ModelSpec("Llama-2-7B", 32, 32, 32, 128, 6_738_415_616, 4_096, 4_096),
    ]
}

# The GPU presets. total_mib is what nvidia-smi prints as the card's total
# memory (memory.total; the "Memory-Usage" column's right-hand figure), each
# from a public nvidia-smi output (``source``); the bandwidth is the vendor's
# datasheet figure (``bandwidth_source``). vLLM itself sizes from
# torch.cuda.mem_get_info()'s total, which the driver can report a little
# lower than nvidia-smi's total (memory it reserves for itself): 40,339 MiB
# against 40,960 on an A100-SXM4-40GB (deviceQuery, bottlerocket-os/bottlerocket
# PR 3873), 178.4 GiB against 179.06 on a B200 (sglang issue 25225). Where
# you have a server's log, "Free memory on device (free/total GiB)" gives
# vLLM's total; ``gpu="<MiB> MiB"`` takes it.
#
# Cards considered and left out, for want of a public nvidia-smi figure that
# can be cited: A10G, H100 PCIe, H100 NVL, H20 (NVIDIA publishes no H20
# datasheet either) and MI300X (the rocm-smi total found came from a
# partition-mode bug report). Give them as "<MiB> MiB".
_MODAL_TABLE = "https://thundergolfer.com/blog/nvidia-gpu-memory-capacity"
_A100_DATASHEET = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                   "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")

GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in [
        GPUSpec("H100 SXM 80GB", 81_559, 3_350.0,
                source="https://github.com/NVIDIA/nccl/issues/1264",
                bandwidth_source="https://www.nvidia.com/en-us/data-center/h100/",
                device_names=("NVIDIA H100 80GB HBM3",)),
        GPUSpec("H200", 143_771, 4_800.0,
                source=_MODAL_TABLE,
                bandwidth_source="https://www.nvidia.com/en-us/data-center/h200/",
                device_names=("NVIDIA H200",)),
        GPUSpec("A100 SXM 80GB", 81_920, 2_039.0,
                source=_MODAL_TABLE,
                bandwidth_source=_A100_DATASHEET,
                device_names=("NVIDIA A100-SXM4-80GB",)),
        GPUSpec("A100 SXM 40GB", 40_960, 1_555.0,
                source="https://github.com/bottlerocket-os/bottlerocket-core-kit/pull/834",
                bandwidth_source=_A100_DATASHEET,
                device_names=("NVIDIA A100-SXM4-40GB",)),
        GPUSpec("L40S", 46_068, 864.0,
                source="https://github.com/akash-network/provider-configs/pull/99",
                bandwidth_source="https://www.nvidia.com/en-us/data-center/l40s/",
                device_names=("NVIDIA L40S",)),
        GPUSpec("L4", 23_034, 300.0,
                source=_MODAL_TABLE,
                bandwidth_source="https://www.nvidia.com/en-us/data-center/l4/",
                device_names=("NVIDIA L4",)),
        GPUSpec("RTX 4090", 24_564, 1_008.0,
                source="https://github.com/RLinf/RLinf/issues/255",
                bandwidth_source=("https://www.nvidia.com/en-us/geforce/graphics-cards/"
                                  "40-series/rtx-4090/"),
                device_names=("NVIDIA GeForce RTX 4090",)),
        # 8 TB/s per GPU is DGX B200's 64 TB/s over its eight GPUs; the
        # memory bus the driver reports now gives about 7.68 TB/s
        # (pytorch/ao PR 4002).
        GPUSpec("B200", 183_359, 8_000.0,
                source="https://github.com/NVIDIA/TensorRT-LLM/issues/10278",
                bandwidth_source="https://www.nvidia.com/en-us/data-center/dgx-b200/",
                device_names=("NVIDIA B200",)),
    ]
}


# The book's reference model. Llama-3.1-8B has Llama-3-8B's shape (and so the
# same KV bytes and weights) but a 131,072-token context, so vLLM accepts the
# reference max_model_len of 32,768 (Llama-3-8B stops at 8,192).
REFERENCE_MODEL = "Llama-3.1-8B"


def _lookup(table: dict, key, kind: str):
    if isinstance(key, (ModelSpec, GPUSpec)):
        return key
    try:
        return table[key]
    except (KeyError, TypeError):
        raise ValueError(f"unknown {kind} {key!r}; known: {', '.join(table)}") from None


def model_spec(model: str | ModelSpec | dict) -> ModelSpec:
    """A preset by name (``"Llama-3-8B"``), a ``ModelSpec`` passed through, or
    a Hugging Face ``config.json`` as a dict (:func:`model_spec_from_config`)."""
    if isinstance(model, dict):
        return model_spec_from_config(model)
    return _lookup(MODELS, model, "model")


_MIB_TEXT = re.compile(r"\s*(\d[\d,_]*)\s*MiB\s*", re.IGNORECASE)


def gpu_spec(gpu: str | GPUSpec) -> GPUSpec:
    """The GPU ``gpu`` names: a preset (``"H100 SXM 80GB"``, one of :data:`GPUS`),
    a ``GPUSpec`` passed through, or a total memory as nvidia-smi prints it,
    ``"81559MiB"`` or ``"81559 MiB"`` (``nvidia-smi --query-gpu=memory.total
    --format=csv,noheader``), which gives :meth:`GPUSpec.from_mib` of it: a
    GPU without a known bandwidth, which sizing never needs.

    A bare number is refused (``TypeError``): MiB or bytes? Write the unit, or
    use ``GPUSpec.from_mib``. An unknown name or a malformed size is a
    ``ValueError`` naming it.
    """
    if isinstance(gpu, GPUSpec):
        return gpu
    if not isinstance(gpu, str):
        hint = (f"; a memory size needs its unit: '{gpu} MiB' as nvidia-smi prints it, or "
                f"GPUSpec.from_mib({gpu})" if isinstance(gpu, (int, float)) and
                not isinstance(gpu, bool) else "")
        raise TypeError(f"gpu must be a preset name, a memory size such as '81559 MiB' or a "
                        f"GPUSpec, got {type(gpu).__name__} {gpu!r}{hint}")
    if gpu in GPUS:
        return GPUS[gpu]
    m = _MIB_TEXT.fullmatch(gpu)
    if m:
        digits = m.group(1).replace(",", "").replace("_", "")
        if int(digits) < 1:
            raise ValueError(f"gpu memory must be at least 1 MiB, got {gpu!r}")
        return GPUSpec.from_mib(int(digits))
    raise ValueError(f"unknown GPU {gpu!r}: give a preset ({', '.join(GPUS)}) or the total "
                     f"memory as nvidia-smi prints it, e.g. '81559 MiB'")


def gpu_for_device_name(device_name: str) -> GPUSpec | None:
    """The preset whose CUDA device name is ``device_name``
    (``torch.cuda.get_device_name()``, e.g. ``"NVIDIA H200"``), or None.

    Used to put a measured bandwidth beside the datasheet peak. The match is
    exact (surrounding spaces aside), so form factors stay apart: an
    ``"NVIDIA H100 PCIe"`` or ``"NVIDIA H100 NVL"`` is not the SXM preset's
    ``"NVIDIA H100 80GB HBM3"``, and a MIG slice (``"... MIG 1g.10gb"``) is
    no preset at all.
    """
    if not isinstance(device_name, str):
        raise TypeError(f"device_name must be a str, got {type(device_name).__name__} "
                        f"{device_name!r}")
    name = device_name.strip()
    for gpu in GPUS.values():
        if name in gpu.device_names:
            return gpu
    return None


def dtype_bytes(dtype: str | torch.dtype) -> int:
    """Bytes per element for a cache dtype name (``"bf16"``, ``"fp8"``...) or a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown KV cache dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


# ------------------------------------------------- a model's own config.json

#: ``model_type`` values whose attention :func:`model_spec_from_config` can
#: size: every layer full attention, one KV head count, one head size.
SIZED_MODEL_TYPES = ("llama", "mistral", "qwen2")

# Hugging Face's dtype names, as KV sizing spells them.
_HF_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32",
              "half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _config_dict(config) -> dict:
    import json
    import os

    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config, encoding="utf-8") as f:
                loaded = json.load(f)
        except OSError as exc:
            raise ValueError(f"cannot read config.json at {config!r}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{config!r} is not JSON: {exc}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"{config!r} holds a {type(loaded).__name__}, not a config object")
        return loaded
    raise TypeError(f"config must be a dict or the path of a config.json, got {type(config).__name__}")


def unsized_reason(config) -> str | None:
    """Why :func:`model_spec_from_config` cannot size this model's KV cache, or None.

    The pool arithmetic of this module assumes one KV-cache group: every layer
    keeps K and V of every token, with the same heads. It refuses, by name:

    * **sliding-window** attention (Mistral-7B-v0.1's ``sliding_window``,
      Qwen2's ``use_sliding_window``, a ``layer_types`` entry
      ``"sliding_attention"``): those layers keep only the window, so vLLM
      puts them in a second KV-cache group with its own block count;
    * **hybrid** models (a ``layer_types`` entry other than full or sliding
      attention, such as Mamba or linear-attention layers, or SSM keys such as
      ``mamba_d_state`` / ``ssm_state_size``): their state is not per-token KV;
    * **MLA** (``kv_lora_rank``, DeepSeek-V2/V3): one compressed latent per
      token instead of K and V per head;
    * any other ``model_type``: its attention is not known here.
    """
    c = _config_dict(config)
    model_type = c.get("model_type")
    layer_types = c.get("layer_types") or []
    other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if other:
        return f"hybrid model: layer_types has {', '.join(map(repr, other))} layers besides attention"
    ssm = [k for k in ("mamba_d_state", "ssm_state_size", "mamba_expand", "linear_num_key_heads",
                       "attn_layer_indices", "hybrid_override_pattern") if k in c]
    if ssm:
        return f"hybrid model: config has {', '.join(ssm)} (state that is not per-token KV)"
    if "kv_lora_rank" in c:
        return "MLA (kv_lora_rank): K and V are one compressed latent per token, not per head"
    if "sliding_attention" in layer_types:
        return "sliding-window model: layer_types has 'sliding_attention' layers"
    if c.get("use_sliding_window") or (model_type != "qwen2" and c.get("sliding_window")):
        return (f"sliding-window model: sliding_window={c.get('sliding_window')!r} "
                "(those layers keep only the window: a second KV-cache group)")
    if model_type not in SIZED_MODEL_TYPES:
        return (f"model_type {model_type!r} is not one this module sizes "
                f"({', '.join(SIZED_MODEL_TYPES)})")
    return None


def model_spec_from_config(config, name: str | None = None) -> ConfigModelSpec:
    """A :class:`ConfigModelSpec` read from a Hugging Face ``config.json``: Llama-, Mistral- or Qwen2-shaped.

    Reads the layers (``num_hidden_layers``), the query and KV heads
    (``num_key_value_heads``, absent meaning one per query head), the head size
    (``head_dim``, else ``hidden_size / num_attention_heads``), the context
    (``max_position_embeddings``; a ``yarn`` ``rope_scaling`` factor gives the
    extended one) and the checkpoint's dtype (``torch_dtype``, or ``dtype`` as
    transformers 5 writes it). The parameter count comes from the shapes
    (embeddings, attention with its biases, the gated MLP, the norms, the LM
    head unless tied), so a quantized checkpoint's weight *bytes* are not
    ``params x dtype``: give the figure the server logged instead
    (``Model loading took ... GiB``).

    Raises ``ValueError`` naming what it cannot size (:func:`unsized_reason`)
    or the key that is missing or wrong.
    """
    c = _config_dict(config)
    reason = unsized_reason(c)
    if reason:
        raise ValueError(f"cannot size the KV cache of this model: {reason}")

    def get(key: str, default=None, minimum: int = 1) -> int:
        value = c.get(key, default)
        if value is None:
            raise ValueError(f"config.json lacks {key!r}")
        return check_int(value, f"config.json {key}", minimum)

    layers = get("num_hidden_layers")
    heads = get("num_attention_heads")
    kv_heads = get("num_key_value_heads", heads)
    hidden = get("hidden_size")
    if heads % kv_heads:
        raise ValueError(f"config.json num_attention_heads ({heads}) is not a multiple of "
                         f"num_key_value_heads ({kv_heads})")
    head_dim = c.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"config.json has no head_dim and hidden_size {hidden} does not split "
                             f"into {heads} heads")
        head_dim = hidden // heads
    head_dim = check_int(head_dim, "config.json head_dim", 1)
    vocab = get("vocab_size")
    inter = get("intermediate_size")
    context = get("max_position_embeddings")
    raw_dtype = c.get("torch_dtype", c.get("dtype", "bfloat16"))
    if raw_dtype not in _HF_DTYPES:
        raise ValueError(f"config.json torch_dtype {raw_dtype!r} is not one of {', '.join(_HF_DTYPES)}")
    q, kv = heads * head_dim, kv_heads * head_dim
    qkv_bias = c.get("model_type") == "qwen2" or bool(c.get("attention_bias"))
    attn = hidden * q + 2 * hidden * kv + q * hidden
    if qkv_bias:
        attn += q + 2 * kv + (hidden if c.get("model_type") != "qwen2" else 0)  # Llama biases o_proj too
    mlp = 3 * hidden * inter + (2 * inter + hidden if c.get("mlp_bias") else 0)
    embed = vocab * hidden
    params = embed + layers * (attn + mlp + 2 * hidden) + hidden
    if not c.get("tie_word_embeddings", False):
        params += embed
    extended = context
    scaling = c.get("rope_scaling") or {}
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "yarn":
        factor = scaling.get("factor", 1)
        original = scaling.get("original_max_position_embeddings", context)
        extended = max(context, int(original * factor))
    if name is None:
        name = str(c.get("_name_or_path") or c.get("model_type"))
    return ConfigModelSpec(name, layers, heads, kv_heads, head_dim, params, context, extended,
                           _HF_DTYPES[raw_dtype])


def resolve_kv_dtype(dtype, m: ModelSpec):
    """``"auto"`` is the checkpoint's dtype (vLLM's ``--kv-cache-dtype auto``)."""
    return m.torch_dtype if isinstance(dtype, str) and dtype == "auto" else dtype
