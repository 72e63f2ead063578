"""Model and GPU specs: the presets the book sizes, a model's own ``config.json``, KV dtypes.

What :mod:`pagedkv.budget` computes with. A model is its shape -- layers,
attention heads, KV heads, head size, parameters, context -- and a GPU its
memory and bandwidth, taken from a preset by name or, for a model, from a
Hugging Face ``config.json`` (Llama-, Mistral- and Qwen2-shaped, and the
windowed and hybrid families vLLM 0.33.0 groups: Gemma 3, gpt-oss, Llama 4,
Qwen3-Next, DeepSeek's MLA; each layer's kind is read by :func:`layer_kinds`). ``pagedkv.budget`` re-exports every name
here, so ``budget.ModelSpec`` and ``budget.model_spec_from_config`` work too.

Units: GiB = 2**30 bytes, MiB = 2**20 bytes (what nvidia-smi calls "MiB").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

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
    """A :class:`ModelSpec` read from a ``config.json``, with the checkpoint's dtype.

    ``layer_kinds`` has one :data:`LAYER_KINDS` entry per layer
    (:func:`layer_kinds`); ``config`` is the language model's config as read,
    which ``pagedkv.kv_cache_planning`` turns into per-layer KV-cache specs.
    ``num_params`` is 0 where the shapes do not give it (see
    :func:`model_spec_from_config`).
    """

    torch_dtype: str = "bfloat16"
    layer_kinds: tuple[str, ...] = ()
    config: dict = field(default_factory=dict, repr=False, compare=False, hash=False)

    @property
    def params_counted(self) -> bool:
        """Whether ``num_params`` was counted from the shapes (Llama-, Mistral-
        and Qwen2-shaped models); otherwise sizing asks for the logged weights."""
        return self.config.get("model_type", "llama") in SIZED_MODEL_TYPES

    @property
    def grouped(self) -> bool:
        """True unless every layer is full attention: vLLM then plans more
        than one kind of KV-cache group (or one windowed group), and
        ``pagedkv.kv_cache_planning`` sizes the pool."""
        return any(k != "full_attention" for k in self.layer_kinds)


@dataclass(frozen=True)
class GPUSpec:
    """A GPU as the engine sizes it: its total memory in MiB, and, where known, its peak bandwidth.

    ``total_mib`` is the total nvidia-smi prints (``memory.total``, the
    "Memory-Usage" column's right-hand figure; MiB = 2**20 bytes; for an AMD
    card, rocm-smi's VRAM total in MiB).
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
# The MI300X has no nvidia-smi: its total is the device memory pool rocminfo
# prints for an unpartitioned card (201,310,208 KiB = 196,592 MiB,
# ROCm/rocm-examples issue 187), the same byte count rocm-smi prints as
# "VRAM Total Memory (B): 206141652992" (ROCm/ROCm issue 4750). The A10G is
# AWS's variant of the A10 and has no NVIDIA datasheet, so its bandwidth is
# left unknown (sizing never reads it).
#
# The H100 PCIe prints the same total as the SXM card (81,559 MiB, in
# NVIDIA's own TensorRT-LLM backend guide) but is a different card: HBM2e at
# 2,000 GB/s (NVIDIA product brief PB-11133-001) against HBM3 at 3,350, so
# it has its own preset and its own device name.
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
        GPUSpec("H100 PCIe", 81_559, 2_000.0,
                source=("https://github.com/triton-inference-server/tensorrtllm_backend/blob/"
                        "05ea856307b3eb4b71e199222e8e2dda7ea35c89/docs/llama.md"),
                bandwidth_source=("https://www.nvidia.com/content/dam/en-zz/Solutions/gtcs22/"
                                  "data-center/h100/PB-11133-001_v01.pdf"),
                device_names=("NVIDIA H100 PCIe",)),
        GPUSpec("H100 NVL", 95_830, 3_900.0,
                source="https://github.com/NVIDIA/gpu-admin-tools/issues/4",
                bandwidth_source="https://www.nvidia.com/en-us/data-center/h100/",
                device_names=("NVIDIA H100 NVL",)),
        # NVIDIA publishes no H20 datasheet: its bandwidth is left unknown.
        GPUSpec("H20", 97_871, None,
                source="https://github.com/NVIDIA/nvtrust/issues/128",
                device_names=("NVIDIA H20",)),
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
        GPUSpec("A10G", 23_028, None,
                source="https://github.com/NVIDIA/DCGM/issues/232",
                device_names=("NVIDIA A10G",)),
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
        GPUSpec("MI300X", 196_592, 5_300.0,
                source="https://github.com/ROCm/rocm-examples/issues/187",
                bandwidth_source=("https://www.amd.com/content/dam/amd/en/documents/"
                                  "instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf"),
                device_names=("AMD Instinct MI300X",)),
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
    ``"NVIDIA H100 PCIe"`` (the same 81,559 MiB, two thirds of the bandwidth)
    or ``"NVIDIA H100 NVL"`` is not the SXM preset's
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

#: ``model_type`` values whose every layer is full attention (or, for Mistral,
#: every layer one sliding window) and whose parameters this module counts.
SIZED_MODEL_TYPES = ("llama", "mistral", "qwen2")

#: The kinds of layer :func:`layer_kinds` names, one per KV-cache spec of
#: ``pagedkv.kv_cache_spec``: full attention, a sliding window, chunked local
#: attention (Llama 4), a linear-attention state (Qwen3-Next's Gated DeltaNet,
#: a Mamba-style state), and multi-head latent attention (DeepSeek).
LAYER_KINDS = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention", "mla")

#: The hybrid and windowed families :func:`layer_kinds` reads, besides
#: :data:`SIZED_MODEL_TYPES` (their parameters are not counted: give the
#: weights as the server logs them).
GROUPED_MODEL_TYPES = ("gemma3", "gemma3_text", "gpt_oss", "llama4", "llama4_text", "qwen3_next",
                       "deepseek_v2", "deepseek_v3")

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


def text_config(config) -> dict:
    """The language model's part of a config: ``text_config`` where a
    multimodal checkpoint (Gemma 3, Llama 4) nests it, with the outer
    ``torch_dtype`` as a default; else the config itself."""
    c = _config_dict(config)
    inner = c.get("text_config")
    if not isinstance(inner, dict):
        return c
    merged = dict(inner)
    for key in ("torch_dtype", "dtype", "_name_or_path"):
        if key in c and key not in merged:
            merged[key] = c[key]
    return merged


def layer_kinds(config) -> list[str]:
    """One entry of :data:`LAYER_KINDS` per decoder layer, read as vLLM 0.33.0's model code reads it.

    ``layer_types`` wins where the config has it (gpt-oss, recent Gemma 3 and
    Qwen3-Next files); otherwise Gemma 3 slides on every layer but each
    ``sliding_window_pattern``-th (default 6), Llama 4 attends to its chunk
    on every layer that keeps RoPE (``no_rope_layers``, empty meaning every
    ``no_rope_layer_interval``-th layer, default 4, is global), Qwen3-Next has
    full attention every ``full_attention_interval``-th layer (default 4) and
    linear attention elsewhere, an MLA config (``kv_lora_rank``) is MLA on
    every layer, and a Mistral-style ``sliding_window`` slides on every layer.

    Raises ``ValueError`` naming the layer and the reason for a kind that
    cannot be sized (an unknown ``layer_types`` entry, a sliding layer without
    ``sliding_window``, a chunked one without ``attention_chunk_size``) and
    for a ``model_type`` that is not read here.
    """
    c = text_config(config)
    model_type = c.get("model_type")
    if c.get("num_hidden_layers") is None:
        raise ValueError("config.json lacks 'num_hidden_layers'")
    n = check_int(c["num_hidden_layers"], "config.json num_hidden_layers", 1)
    aliases = {"full_attention": "full_attention", "sliding_attention": "sliding_attention",
               "chunked_attention": "chunked_attention", "linear_attention": "linear_attention"}
    if "kv_lora_rank" in c:
        kinds = ["mla"] * n
    elif c.get("layer_types"):
        types = c["layer_types"]
        if not isinstance(types, list) or len(types) != n:
            raise ValueError(f"config.json layer_types must list {n} layers (num_hidden_layers), "
                             f"got {types!r:.80}")
        kinds = []
        for i, t in enumerate(types):
            if t not in aliases:
                raise ValueError(f"layer model.layers.{i}: unknown layer type {t!r} "
                                 f"(known: {', '.join(aliases)})")
            kinds.append(aliases[t])
    elif model_type in ("gemma3", "gemma3_text"):
        pattern = check_int(c.get("sliding_window_pattern", 6), "config.json sliding_window_pattern", 1)
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    elif model_type in ("llama4", "llama4_text"):
        interval = check_int(c.get("no_rope_layer_interval", 4), "config.json no_rope_layer_interval", 1)
        rope = c.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
        if len(rope) != n:
            raise ValueError(f"config.json no_rope_layers must list {n} layers, got {len(rope)}")
        chunked = c.get("attention_chunk_size") is not None
        kinds = ["chunked_attention" if rope[i] and chunked else "full_attention" for i in range(n)]
    elif model_type == "qwen3_next":
        interval = check_int(c.get("full_attention_interval", 4), "config.json full_attention_interval", 1)
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    elif model_type in SIZED_MODEL_TYPES:
        if model_type == "qwen2" and c.get("use_sliding_window"):
            raise ValueError("Qwen2 with use_sliding_window=true (windows only above max_window_layers) "
                             "is not modelled here")
        window = c.get("sliding_window") if model_type != "qwen2" else None
        kinds = ["sliding_attention" if window else "full_attention"] * n
    else:
        known = ", ".join(SIZED_MODEL_TYPES + GROUPED_MODEL_TYPES)
        raise ValueError(f"model_type {model_type!r} is not one this module sizes ({known})")
    for i, kind in enumerate(kinds):
        if kind == "sliding_attention" and not c.get("sliding_window"):
            raise ValueError(f"layer model.layers.{i}: a sliding_attention layer needs sliding_window, "
                             f"got {c.get('sliding_window')!r}")
        if kind == "chunked_attention" and not c.get("attention_chunk_size"):
            raise ValueError(f"layer model.layers.{i}: a chunked_attention layer needs "
                             f"attention_chunk_size, got {c.get('attention_chunk_size')!r}")
    return kinds


def unsized_reason(config) -> str | None:
    """Why :func:`model_spec_from_config` cannot size this model's KV cache, or None.

    Full attention, sliding windows, chunked local attention, Qwen3-Next's
    linear-attention state and MLA are all sized (:func:`layer_kinds` names
    each layer's kind, ``pagedkv.kv_cache_planning`` groups them as vLLM
    0.33.0 does). What is left is refused by name: an unknown layer type, a
    ``model_type`` whose layers are not read here (Nemotron-H's and Jamba's
    Mamba layers among them), a window or chunk size that is missing.
    """
    try:
        layer_kinds(config)
    except ValueError as error:
        return str(error)
    return None


def model_spec_from_config(config, name: str | None = None) -> ConfigModelSpec:
    """A :class:`ConfigModelSpec` read from a Hugging Face ``config.json``.

    Reads the layers (``num_hidden_layers``), the query and KV heads
    (``num_key_value_heads``, absent meaning one per query head), the head size
    (``head_dim``, else ``hidden_size / num_attention_heads``), the context
    (``max_position_embeddings``; a ``yarn`` ``rope_scaling`` factor gives the
    extended one), the checkpoint's dtype (``torch_dtype``, or ``dtype`` as
    transformers 5 writes it) and each layer's kind (:func:`layer_kinds`).
    A multimodal file's ``text_config`` is what is read. MLA (DeepSeek) keeps
    one latent of ``kv_lora_rank + qk_rope_head_dim`` per token and layer:
    one "KV head" of that size, with no separate V.

    For Llama-, Mistral- and Qwen2-shaped models the parameter count comes
    from the shapes (embeddings, attention with its biases, the gated MLP, the
    norms, the LM head unless tied); for the others (mixtures of experts,
    hybrids, quantized checkpoints) it is left at 0, which sizing refuses:
    give the weights the server logged (``Model loading took ... GiB``) as
    ``weight_gib``.

    Raises ``ValueError`` naming what it cannot size (:func:`unsized_reason`)
    or the key that is missing or wrong.
    """
    raw = _config_dict(config)
    c = text_config(raw)
    kinds = layer_kinds(c)

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
    if "kv_lora_rank" in c:  # MLA: one latent (and its RoPE part) per token
        kv_heads, head_dim = 1, get("kv_lora_rank") + get("qk_rope_head_dim")
    context = get("max_position_embeddings")
    raw_dtype = c.get("torch_dtype", c.get("dtype", "bfloat16"))
    if raw_dtype not in _HF_DTYPES:
        raise ValueError(f"config.json torch_dtype {raw_dtype!r} is not one of {', '.join(_HF_DTYPES)}")
    params = 0
    if c.get("model_type") in SIZED_MODEL_TYPES:
        vocab = get("vocab_size")
        inter = get("intermediate_size")
        q, kv = heads * head_dim, kv_heads * head_dim
        qkv_bias = c.get("model_type") == "qwen2" or bool(c.get("attention_bias"))
        attn = hidden * q + 2 * hidden * kv + q * hidden
        if qkv_bias:
            attn += q + 2 * kv + (hidden if c.get("model_type") != "qwen2" else 0)  # Llama biases o_proj too
        mlp = 3 * hidden * inter + (2 * inter + hidden if c.get("mlp_bias") else 0)
        embed = vocab * hidden
        params = embed + layers * (attn + mlp + 2 * hidden) + hidden
        if not c.get("tie_word_embeddings", raw.get("tie_word_embeddings", False)):
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
                           _HF_DTYPES[raw_dtype], tuple(kinds), c)


def resolve_kv_dtype(dtype, m: ModelSpec):
    """``"auto"`` is the checkpoint's dtype (vLLM's ``--kv-cache-dtype auto``)."""
    return m.torch_dtype if isinstance(dtype, str) and dtype == "auto" else dtype
