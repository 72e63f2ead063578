"""The memory budget: how many bytes a token of KV costs, and how many blocks a GPU holds.

Everything here is arithmetic on published specs, done the way vLLM 0.33.0 does
it at startup (``determine_available_memory``, then ``get_kv_cache_configs``):

1. The engine may use ``total_memory * gpu_memory_utilization`` bytes.
2. From that it subtracts the model weights and a measured non-KV allowance
   (activation peak, CUDA-graph pools, workspace). What is left is the KV pool.
3. One block's bytes are its pages (``block_size`` tokens of K and V) summed
   over the layers of the KV-cache group, and the pool is divided by them once,
   rounding down (``_get_kv_cache_bytes_per_block`` and ``num_blocks =
   available_memory // bytes_per_block`` in ``v1/core/kv_cache_planning.py``).
   The layers' caches are views into one allocation, so every layer has the
   same number of blocks.
4. The startup check plans against the *usable* blocks: the null block that
   the block pool holds back is subtracted first (:func:`check_enough_kv_cache_memory`).

Units: GiB = 2**30 bytes, MiB = 2**20 bytes (what nvidia-smi calls "MiB").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from .common import cdiv, check_int, check_real

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
    """A GPU as the engine sees it: total memory as nvidia-smi reports it, and peak bandwidth."""

    name: str
    total_mib: int
    peak_bandwidth_gbs: float  # HBM/GDDR bandwidth from the datasheet, GB/s (10**9)

    @property
    def total_bytes(self) -> int:
        return self.total_mib * MiB


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

GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in [
        GPUSpec("H100 SXM 80GB", 81_559, 3_350.0),
        GPUSpec("H200", 143_771, 4_800.0),
        GPUSpec("A100 SXM 80GB", 81_920, 2_039.0),
        GPUSpec("L4", 23_034, 300.0),
        GPUSpec("RTX 4090", 24_564, 1_008.0),
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


def gpu_spec(gpu: str | GPUSpec) -> GPUSpec:
    """A preset by name (``"H100 SXM 80GB"``), or a ``GPUSpec`` passed through."""
    return _lookup(GPUS, gpu, "GPU")


def gpu_for_device_name(device_name: str) -> GPUSpec | None:
    """The preset whose model words all appear in a CUDA device name, e.g. ``"NVIDIA H200"``.

    Used to put a measured bandwidth beside the datasheet peak. Form factors are
    not told apart: an H100 PCIe would be matched to the SXM preset.
    """
    import re

    for key, gpu in GPUS.items():
        words = [w for w in key.split() if w != "SXM" and not w.endswith("GB")]
        if all(re.search(rf"(?<![A-Za-z0-9]){re.escape(w)}(?![A-Za-z0-9])", device_name) for w in words):
            return gpu
    return None


def dtype_bytes(dtype: str | torch.dtype) -> int:
    """Bytes per element for a cache dtype name (``"bf16"``, ``"fp8"``...) or a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown KV cache dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]





def kv_heads_per_rank(model: str | ModelSpec, tensor_parallel_size: int = 1) -> int:
    """KV heads each tensor-parallel rank stores.

    Heads are split across ranks. With more ranks than KV heads, vLLM replicates
    them: each rank still keeps one full KV head, so per-rank KV stops shrinking.
    """
    m = model_spec(model)
    tp = check_int(tensor_parallel_size, "tensor_parallel_size", 1)
    if tp <= m.num_kv_heads:
        if m.num_kv_heads % tp:
            raise ValueError(f"{m.num_kv_heads} KV heads of {m.name} do not split evenly across tensor_parallel_size={tp}")
        return m.num_kv_heads // tp
    if tp % m.num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} is not a multiple of {m.name}'s {m.num_kv_heads} KV heads")
    return 1


def kv_bytes_per_token(model: str | ModelSpec, dtype: str | torch.dtype = "bf16", tensor_parallel_size: int = 1) -> int:
    """K and V for one token across all layers: 2 * layers * kv_heads * head_dim * bytes (per rank).

    ``dtype`` ``"auto"`` is the checkpoint's (``ModelSpec.torch_dtype``), as
    vLLM's ``--kv-cache-dtype auto``.
    """
    m = model_spec(model)
    dtype = _resolve_dtype(dtype, m)
    return 2 * m.num_layers * kv_heads_per_rank(m, tensor_parallel_size) * m.head_dim * dtype_bytes(dtype)


def weight_bytes(model: str | ModelSpec, dtype: str | torch.dtype = "bf16", tensor_parallel_size: int = 1) -> int:
    """Parameter bytes per rank (weights split evenly across tensor-parallel ranks)."""
    m = model_spec(model)
    tp = check_int(tensor_parallel_size, "tensor_parallel_size", 1)
    return m.num_params * dtype_bytes(dtype) // tp


def kv_pool_bytes(total_bytes: float, gpu_memory_utilization: float, weight_bytes: float, non_kv_bytes: float) -> float:
    """The KV pool as vLLM sizes it: total * utilization - weights - non-KV allowance."""
    check_real(total_bytes, "total_bytes", minimum=0)
    check_real(weight_bytes, "weight_bytes", minimum=0)
    check_real(non_kv_bytes, "non_kv_bytes", minimum=0)
    if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)) \
            or not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    pool = total_bytes * gpu_memory_utilization - weight_bytes - non_kv_bytes
    if pool <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {total_bytes / GiB:.2f} GiB x {gpu_memory_utilization} "
            f"- {weight_bytes / GiB:.2f} GiB weights - {non_kv_bytes / GiB:.2f} GiB non-KV = {pool / GiB:.2f} GiB"
        )
    return pool


def page_bytes_per_layer(model: str | ModelSpec, block_size: int = 16, dtype: str | torch.dtype = "bf16",
                         tensor_parallel_size: int = 1) -> int:
    """One block's K and V in ONE layer: block_size * 2 * kv_heads * head_dim * bytes."""
    m = model_spec(model)
    check_int(block_size, "block_size", 1)
    dtype = _resolve_dtype(dtype, m)
    return block_size * 2 * kv_heads_per_rank(m, tensor_parallel_size) * m.head_dim * dtype_bytes(dtype)


def block_bytes(model: str | ModelSpec, block_size: int = 16, dtype: str | torch.dtype = "bf16",
                tensor_parallel_size: int = 1) -> int:
    """One block across all layers (what one block id really costs)."""
    return page_bytes_per_layer(model, block_size, dtype, tensor_parallel_size) * model_spec(model).num_layers


def num_gpu_blocks(pool_bytes: float, model: str | ModelSpec, block_size: int = 16,
                   dtype: str | torch.dtype = "bf16", tensor_parallel_size: int = 1) -> int:
    """Blocks as vLLM 0.33.0 computes them: one floor, pool // one block's bytes across all layers.

    The count includes the null block (block 0), which the block pool holds
    back; ``num_gpu_blocks - 1`` blocks can hold tokens.
    """
    check_real(pool_bytes, "pool_bytes", minimum=0)
    return int(pool_bytes // block_bytes(model, block_size, dtype, tensor_parallel_size))


def token_slots(num_blocks: int, block_size: int) -> int:
    """Tokens the pool can hold when every block is full (both counts are integers)."""
    return check_int(num_blocks, "num_blocks", 0) * check_int(block_size, "block_size", 1)



def contiguous_reservations(pool_bytes: float, model: str | ModelSpec, max_model_len: int,
                            dtype: str | torch.dtype = "bf16") -> int:
    """How many max-length contiguous reservations fit: each reserves max_model_len tokens of KV."""
    check_real(pool_bytes, "pool_bytes", minimum=0)
    reservation = check_int(max_model_len, "max_model_len", 1) * kv_bytes_per_token(model, dtype)
    return int(pool_bytes // reservation)


def blocks_per_request(request_len: int, block_size: int) -> int:
    """Blocks a request of ``request_len`` tokens holds under paging: ceil(len / block_size)."""
    return cdiv(check_int(request_len, "request_len", 1), check_int(block_size, "block_size", 1))


def paged_ceiling(num_blocks: int, request_len: int, block_size: int) -> int:
    """Concurrent requests of ``request_len`` tokens a paged pool of ``num_blocks`` can hold."""
    return check_int(num_blocks, "num_blocks", 0) // blocks_per_request(request_len, block_size)


def check_enough_kv_cache_memory(pool_bytes: float, model: str | ModelSpec, max_model_len: int,
                                 block_size: int = 16, dtype: str | torch.dtype = "bf16") -> None:
    """The startup check: refuse a pool that cannot hold ONE request of ``max_model_len`` tokens.

    ``pool_bytes`` is the whole KV pool, null block included: the profiled
    pool, or ``num_gpu_blocks_override x`` one block's bytes. As in vLLM 0.33.0
    (``check_enough_kv_cache_memory`` and ``get_kv_cache_configs`` in
    ``v1/core/kv_cache_planning.py``), one block's bytes are held back for the
    null block before the check, so 2,048 blocks of 16 hold one request of at
    most 2,047 x 16 = 32,752 tokens, not 32,768.

    Like vLLM's, the error states the GiB needed, the GiB available (after the
    null block), the largest ``max_model_len`` that would fit, and the two knobs
    that fix it. Paging removes over-reservation at run time, but the engine
    still promises that its longest allowed request can run alone.

    ``pool_bytes`` must be a finite number >= 0 (a NaN or negative pool is a
    ``ValueError`` naming it, not a misleading "needed vs available" message).
    """
    check_real(pool_bytes, "pool_bytes", minimum=0)
    check_int(max_model_len, "max_model_len", 1)
    per_block = block_bytes(model, block_size, dtype)
    usable_bytes = pool_bytes - per_block  # the null block never holds a token
    if usable_bytes <= 0:
        raise ValueError(NO_MEMORY_MESSAGE)
    needed = blocks_per_request(max_model_len, block_size) * per_block
    if needed <= usable_bytes:
        return
    # vLLM binary-searches the longest length whose blocks fit; with one
    # group that is the usable blocks times the block size.
    fits = min(int(usable_bytes // per_block) * block_size, max_model_len)
    raise ValueError(startup_error_message(max_model_len, needed, usable_bytes, fits))


def usable_max_model_len(pool_bytes: float, model: str | ModelSpec, block_size: int = 16,
                         dtype: str | torch.dtype = "bf16") -> int:
    """The longest request the startup check admits: the usable blocks (null block held back) x block size."""
    check_real(pool_bytes, "pool_bytes", minimum=0)
    return max(num_gpu_blocks(pool_bytes, model, block_size, dtype) - 1, 0) * block_size


# vLLM 0.33.0's error when nothing is left once the null block is held back
# (``_check_enough_kv_cache_memory``, v1/core/kv_cache_planning.py).
NO_MEMORY_MESSAGE = (
    "No available memory for the cache blocks. "
    "Try increasing `gpu_memory_utilization` when initializing the engine "
    "(this flag also controls CPU memory reservation on the CPU "
    "backend, despite its name). "
    "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ "
    "for more details.")


def check_max_model_len(model: str | ModelSpec, max_model_len: int) -> int:
    """Refuse a ``max_model_len`` beyond the model's own context, as vLLM 0.33.0 does.

    vLLM derives the limit from the checkpoint's ``max_position_embeddings``
    (``_get_and_verify_max_len`` in ``config/model.py``) and raises unless the
    environment variable ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` is set. Llama-3-8B
    stops at 8,192 tokens; Llama-3.1-8B, the same shape, at 131,072. The message
    is vLLM's first two sentences (its warning about RoPE positions follows them).
    Returns ``max_model_len``.
    """
    m = model_spec(model)
    check_int(max_model_len, "max_model_len", 1)
    if max_model_len > m.native_context:
        raise ValueError(
            f"User-specified max_model_len ({max_model_len}) is greater than the derived "
            f"max_model_len (max_position_embeddings={m.native_context} or model_max_length=None "
            f"in model's config.json). To allow overriding this maximum, set the env var "
            f"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.")
    return max_model_len


def _gib(num_bytes: float) -> str:
    # vLLM's format_gib (vllm/utils/mem_utils.py): GiB rounded to 2 places.
    return f"{round(num_bytes / GiB, 2)}"


def startup_error_message(max_model_len: int, needed_bytes: float, available_bytes: float,
                          estimated_max_len: int) -> str:
    """vLLM 0.33.0's startup error, word for word.

    The text is vLLM's (``ValueError``, ``v1/core/kv_cache_planning.py:68-86``),
    including its unbalanced parenthesis before the GiB needed, so that a
    reader can search a real server's log for it. The estimate sentence
    appears only when some length fits, as in vLLM.
    """
    estimate = ""
    if estimated_max_len > 0:
        estimate = ("Based on the available memory, "
                    f"the estimated maximum model length is {estimated_max_len}. ")
    return (f"To serve at least one request with the model's max seq len ({max_model_len}), "
            f"({_gib(needed_bytes)} GiB KV cache is needed, which is larger than the available KV cache "
            f"memory ({_gib(available_bytes)} GiB). {estimate}"
            "Try increasing `gpu_memory_utilization` (which also controls CPU memory on the CPU backend) "
            "or decreasing `max_model_len` when initializing the engine. "
            "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.")


@dataclass(frozen=True)
class BudgetPlan:
    """One configuration's numbers, as the chapter's calculator shows them.

    With ``tensor_parallel_size`` > 1 every size is one GPU's (one rank's):
    its share of the weights, its pool, its blocks.
    """

    gpu: str
    model: str
    dtype: str
    total_bytes: int
    weight_bytes: float
    non_kv_bytes: float
    gpu_memory_utilization: float
    pool_bytes: float
    bytes_per_token: int
    block_size: int
    num_blocks: int
    token_slots: int
    max_model_len: int
    contiguous_reservations: int
    request_len: int
    blocks_per_request: int
    paged_ceiling: int
    tensor_parallel_size: int = 1
    #: The model itself (a preset or one read from a config.json).
    spec: ModelSpec | None = field(default=None, repr=False, compare=False)

    @property
    def headroom_bytes(self) -> float:
        """Memory the engine leaves alone: total * (1 - utilization)."""
        return self.total_bytes * (1 - self.gpu_memory_utilization)

    def rows(self) -> list[tuple[str, str]]:
        """The plan as (label, value) rows, rounded for display."""
        tp = self.tensor_parallel_size
        per = " per GPU" if tp > 1 else ""
        rows = [("GPU memory", f"{self.total_bytes / GiB:.2f} GiB")]
        if tp > 1:
            rows.append(("tensor_parallel_size", f"{tp}"))
        return rows + [
            (f"KV bytes per token{per}",
             f"{self.bytes_per_token / KiB:,.0f} KiB"),
            (f"weights{per}", f"{self.weight_bytes / GiB:.2f} GiB"),
            ("non-KV allowance", f"{self.non_kv_bytes / GiB:.2f} GiB"),
            (f"KV pool{per}", f"{self.pool_bytes / GiB:.2f} GiB"),
            (f"blocks of {self.block_size}", f"{self.num_blocks:,}"),
            ("token slots", f"{self.token_slots:,}"),
            (f"contiguous reservations of {self.max_model_len:,}",
             f"{self.contiguous_reservations:,}"),
            (f"paged ceiling at {self.request_len:,} tokens",
             f"{self.paged_ceiling:,}"),
        ]


def startup_log_lines(p: BudgetPlan) -> list[str]:
    """The two INFO lines vLLM 0.33.0 logs once the pool is sized, for a plan.

    ``Available KV cache memory`` is the pool (``v1/worker/gpu_worker.py``);
    the capacity line divides the blocks, null block included, by the blocks
    one ``max_model_len`` request needs (``get_max_concurrency_for_kv_cache_config``
    and ``update_kv_cache_capacity`` in ``v1/core/kv_cache_utils.py``).
    Compare them with a real server's log.
    """
    concurrency = p.num_blocks / cdiv(p.max_model_len, p.block_size)
    return [f"Available KV cache memory: {_gib(p.pool_bytes)} GiB",
            f"GPU KV cache size: {int(concurrency * p.max_model_len):,} tokens, "
            f"Maximum concurrency for {p.max_model_len:,} tokens per request: {concurrency:.2f}x"]


def plan(gpu: str | GPUSpec = "H100 SXM 80GB",
         model: str | ModelSpec = REFERENCE_MODEL, dtype: str = "bf16",
         gpu_memory_utilization: float = 0.92, non_kv_gib: float = 6.0,
         max_model_len: int = 32_768, block_size: int = 16,
         request_len: int = 612, weight_gib: float | None = None,
         weight_dtype: str = "bf16",
         tensor_parallel_size: int = 1) -> BudgetPlan:
    """Size a pool end to end: one GPU's, for ``tensor_parallel_size`` GPUs.

    ``weight_gib`` overrides the whole model's weights computed from the
    parameter count. With tensor parallelism each rank holds 1/tp of the
    weights and its share of the KV heads (:func:`kv_heads_per_rank`: split,
    or replicated once there are more ranks than KV heads), and sizes its own
    pool from its own GPU as below; every figure of the plan is per rank.
    ``non_kv_gib`` is each rank's allowance: activations and CUDA graphs,
    weights excluded (from a server's log: :attr:`StartupLog.allowance_gib`).
    ``model`` may be a Hugging Face ``config.json`` dict; ``dtype`` (the KV
    cache's) and ``weight_dtype`` may be ``"auto"``, the checkpoint's dtype.
    """
    g, m = gpu_spec(gpu), model_spec(model)
    dtype, weight_dtype = _resolve_dtype(dtype, m), _resolve_dtype(weight_dtype, m)
    tp = check_int(tensor_parallel_size, "tensor_parallel_size", 1)
    if weight_gib is None:
        w = weight_bytes(m, weight_dtype, tp)
    else:
        w = check_real(weight_gib, "weight_gib", minimum=0) * GiB / tp
    non_kv = check_real(non_kv_gib, "non_kv_gib", minimum=0) * GiB
    pool = kv_pool_bytes(g.total_bytes, gpu_memory_utilization, w, non_kv)
    blocks = num_gpu_blocks(pool, m, block_size, dtype, tp)
    per_token = kv_bytes_per_token(m, dtype, tp)
    reservation = check_int(max_model_len, "max_model_len", 1) * per_token
    return BudgetPlan(
        gpu=g.name, model=m.name, dtype=str(dtype), total_bytes=g.total_bytes,
        weight_bytes=w, non_kv_bytes=non_kv,
        gpu_memory_utilization=gpu_memory_utilization, pool_bytes=pool,
        bytes_per_token=per_token, block_size=block_size, num_blocks=blocks,
        token_slots=token_slots(blocks, block_size),
        max_model_len=max_model_len,
        contiguous_reservations=int(pool // reservation),
        request_len=request_len,
        blocks_per_request=blocks_per_request(request_len, block_size),
        paged_ceiling=paged_ceiling(blocks, request_len, block_size),
        tensor_parallel_size=tp, spec=m,
    )


def pool_from_free_memory(model: str | ModelSpec = REFERENCE_MODEL,
                          dtype: str = "bf16",
                          gpu_memory_utilization: float = 0.92,
                          non_kv_gib: float = 6.0, block_size: int = 16,
                          device: int = 0,
                          free_and_total: tuple[int, int] | None = None,
                          weight_gib: float | None = None,
                          ) -> dict:
    """Size a pool from a GPU's real memory, with vLLM 0.33.0's V1 rules.

    ``torch.cuda.mem_get_info(device)`` gives (free, total) bytes, or pass
    ``free_and_total`` to ask "what if". As vLLM's worker does at startup
    (``request_memory`` after the memory snapshot in ``init_device``, then
    ``determine_available_memory``):

    1. The instance asks for ``requested = ceil(total x utilization)``. The
       budget is per instance and is a share of the *total*, not of what is
       free.
    2. If ``free < requested`` it refuses to start (a ``ValueError`` with
       vLLM's wording: decrease the utilization or free the GPU).
    3. Otherwise the pool is ``requested - weights - non-KV``. vLLM measures
       what *this* instance consumes (weights, its non-torch memory, the
       activation peak, the CUDA-graph estimate) as differences from the
       snapshot, so memory other processes held before it started is never
       subtracted from the budget: it only has to leave room for it.

    Two instances at 0.5 each can share one GPU; a second one at 0.92 cannot.
    ``weight_gib`` replaces the weights computed from the parameter count (for
    example with the figure a loader logged). ``num_blocks`` includes the null
    block; ``usable_blocks`` does not.
    """
    if free_and_total is None:
        if not torch.cuda.is_available():
            raise RuntimeError("pool_from_free_memory needs a CUDA GPU; "
                               "this machine has none (or pass free_and_total)")
        free, total = torch.cuda.mem_get_info(device)
        name = torch.cuda.get_device_name(device)
    else:
        free, total = free_and_total
        name = "given"
    check_real(free, "free memory", minimum=0)
    check_real(total, "total memory", minimum=0)
    if free > total:
        raise ValueError(f"free memory ({free}) exceeds total ({total})")
    if weight_gib is None:
        w = weight_bytes(model, dtype)
    else:
        w = check_real(weight_gib, "weight_gib", minimum=0) * GiB
    non_kv = check_real(non_kv_gib, "non_kv_gib", minimum=0) * GiB
    # Validates the utilization and refuses a budget the weights fill.
    kv_pool_bytes(total, gpu_memory_utilization, w, non_kv)
    requested = math.ceil(total * gpu_memory_utilization)
    if free < requested:
        # vLLM 0.33.0's words ("is less than desired GPU memory utilization",
        # ``v1/worker/utils.py:761-769``).
        raise ValueError(
            f"Free memory on device cuda:{device} ({_gib(free)}/{_gib(total)} GiB)"
            f" on startup is less than desired GPU memory utilization "
            f"({gpu_memory_utilization}, {_gib(requested)} GiB). "
            f"Decrease GPU memory utilization or reduce GPU memory used by "
            f"other processes.")
    pool = requested - w - non_kv
    blocks = num_gpu_blocks(pool, model, block_size, dtype)
    return {
        "device": name,
        "total_gib": total / GiB,
        "free_gib": free / GiB,
        "in_use_gib": (total - free) / GiB,  # not subtracted
        "requested_gib": requested / GiB,
        "pool_gib": pool / GiB,
        "num_blocks": blocks,
        "usable_blocks": max(blocks - 1, 0),
        "token_slots": token_slots(blocks, block_size),
    }


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


def _resolve_dtype(dtype, m: ModelSpec):
    """``"auto"`` is the checkpoint's dtype (vLLM's ``--kv-cache-dtype auto``)."""
    return m.torch_dtype if isinstance(dtype, str) and dtype == "auto" else dtype


# ------------------------------------------------- a server's own startup log

_NUM = r"([0-9][0-9,]*(?:\.[0-9]+)?)"
_LOG_PATTERNS = {
    "model_loading_gib": re.compile(r"Model loading took " + _NUM + r" ?GiB"),
    "non_kv_gib": re.compile(r"Total non KV cache memory: " + _NUM + r" ?GiB"),
    "available_kv_gib": re.compile(r"Available KV cache memory: " + _NUM + r" ?GiB"),
    "kv_cache_tokens": re.compile(r"KV cache size: " + _NUM + r" tokens"),
    "concurrency": re.compile(r"Maximum concurrency for " + _NUM + r" tokens per request: " + _NUM + r"x"),
    "free_total": re.compile(r"Free memory on device[^(]*\(" + _NUM + "/" + _NUM + r" GiB\) on startup"),
    "utilization": re.compile(r"Desired GPU memory utilization is \(" + _NUM + ", " + _NUM + " GiB\\)"),
    "actual_usage": re.compile(r"Actual usage is " + _NUM + r" GiB for consumed memory \(weights \+ "
                               r"non-torch\), " + _NUM + r" GiB for peak activation, and " + _NUM
                               + r" GiB for CUDAGraph memory"),
}


def _number(text: str) -> float:
    return float(text.replace(",", ""))


@dataclass(frozen=True)
class StartupLog:
    """The sizing figures a vLLM 0.33.0 server printed at startup (None: the line was not there).

    All GiB figures are vLLM's, rounded to two decimals (``format_gib``):

    * ``model_loading_gib``: "Model loading took X GiB memory" (INFO): the
      weights on this rank.
    * ``non_kv_gib``: "Total non KV cache memory: X GiB" (DEBUG: only with
      ``VLLM_LOGGING_LEVEL=DEBUG``): weights, non-torch memory and the
      activation peak of the profiling pass.
    * ``available_kv_gib``: "Available KV cache memory: X GiB" (INFO): the pool.
    * ``kv_cache_tokens``, ``max_model_len``, ``max_concurrency``: "GPU KV cache
      size: N tokens, Maximum concurrency for L tokens per request: C x" (INFO).
    * ``free_gib``, ``total_gib``, ``gpu_memory_utilization``,
      ``requested_gib``, ``consumed_gib``, ``activation_gib``,
      ``cudagraph_gib``: the INFO message after CUDA graphs are captured
      ("Free memory on device (F/T GiB) on startup. Desired GPU memory
      utilization is (U, R GiB). Actual usage is ...").
    """

    model_loading_gib: float | None = None
    non_kv_gib: float | None = None
    available_kv_gib: float | None = None
    kv_cache_tokens: int | None = None
    max_model_len: int | None = None
    max_concurrency: float | None = None
    free_gib: float | None = None
    total_gib: float | None = None
    gpu_memory_utilization: float | None = None
    requested_gib: float | None = None
    consumed_gib: float | None = None
    activation_gib: float | None = None
    cudagraph_gib: float | None = None

    @property
    def derived_non_kv_gib(self) -> float | None:
        """What the budget gave everything but the pool: the DEBUG line's
        figure, else requested - available (both INFO), else None."""
        if self.non_kv_gib is not None:
            return self.non_kv_gib
        if self.requested_gib is not None and self.available_kv_gib is not None:
            return round(self.requested_gib - self.available_kv_gib, 2)
        return None

    @property
    def allowance_gib(self) -> float | None:
        """Non-KV memory without the weights: what :func:`plan` calls
        ``non_kv_gib`` (activation peak, non-torch memory, CUDA graphs)."""
        total = self.derived_non_kv_gib
        if total is None or self.model_loading_gib is None:
            return None
        return round(total - self.model_loading_gib, 2)


def read_startup_log(text: str) -> StartupLog:
    """The sizing figures in a server's startup log (any prefix, any order; the last of each wins).

    ``ValueError`` when the text holds none of them, or "Available KV cache
    memory" is missing (without the pool there is nothing to size).
    """
    if not isinstance(text, str):
        raise TypeError(f"the log must be a str, got {type(text).__name__}")
    found: dict = {}
    for key, pattern in _LOG_PATTERNS.items():
        matches = pattern.findall(text)
        if not matches:
            continue
        last = matches[-1]
        if key == "concurrency":
            found["max_model_len"], found["max_concurrency"] = int(_number(last[0])), _number(last[1])
        elif key == "free_total":
            found["free_gib"], found["total_gib"] = _number(last[0]), _number(last[1])
        elif key == "utilization":
            found["gpu_memory_utilization"], found["requested_gib"] = _number(last[0]), _number(last[1])
        elif key == "actual_usage":
            found["consumed_gib"], found["activation_gib"], found["cudagraph_gib"] = map(_number, last)
        elif key == "kv_cache_tokens":
            found[key] = int(_number(last))
        else:
            found[key] = _number(last)
    if "available_kv_gib" not in found:
        raise ValueError("the log has no 'Available KV cache memory: X GiB' line (vLLM prints it at INFO "
                         "once the pool is sized); without the pool there is nothing to size")
    return StartupLog(**found)


def blocks_from_log_tokens(kv_cache_tokens: int, max_model_len: int, block_size: int) -> int:
    """The pool's blocks (null block included) behind "GPU KV cache size: N tokens".

    vLLM prints ``int(num_blocks / cdiv(L, B) * L)`` for ``L = max_model_len``
    (one KV-cache group); this inverts it exactly, float rounding included.
    """
    check_int(kv_cache_tokens, "kv_cache_tokens", 0)
    per_request = cdiv(check_int(max_model_len, "max_model_len", 1), check_int(block_size, "block_size", 1))
    guess = kv_cache_tokens * per_request // max_model_len
    for n in range(max(guess - 2, 0), guess + 4):
        if int(n / per_request * max_model_len) == kv_cache_tokens:
            return n
    raise ValueError(f"no block count prints {kv_cache_tokens:,} tokens at max_model_len={max_model_len:,} "
                     f"and block_size={block_size}: is block_size the server's?")


@dataclass(frozen=True)
class LogSizing:
    """Pool, blocks and concurrency for one workload, read from a server's startup log.

    ``num_blocks`` includes the null block; ``usable_blocks`` does not. When
    the log has the capacity line, ``num_blocks`` comes from it exactly and
    ``blocks_from_pool`` (the pool's GiB, rounded by the log, divided by one
    block's bytes) is a cross-check: a mismatch of more than a few blocks
    means the model, dtype, block size or TP given here is not the server's.
    """

    model: str
    kv_cache_dtype: str
    tensor_parallel_size: int
    block_size: int
    pool_bytes: float
    block_bytes: int
    num_blocks: int
    blocks_from_pool: int
    request_len: int
    blocks_per_request: int
    concurrency: int
    non_kv_gib: float | None
    log: StartupLog

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def consistent(self) -> bool:
        """The capacity line's blocks agree with the pool's within the log's rounding (0.005 GiB)."""
        slack = math.ceil(0.005 * GiB / self.block_bytes) + 1
        return abs(self.num_blocks - self.blocks_from_pool) <= slack

    def rows(self) -> list[tuple[str, str]]:
        rows = [("KV pool per GPU (Available KV cache memory)", f"{self.pool_bytes / GiB:.2f} GiB"),
                ("one block, all layers", f"{self.block_bytes / KiB:,.0f} KiB"),
                ("blocks (null block included)", f"{self.num_blocks:,}"),
                (f"blocks per {self.request_len:,}-token request", f"{self.blocks_per_request:,}"),
                ("requests at full length, at once", f"{self.concurrency:,}")]
        if self.non_kv_gib is not None:
            rows.insert(1, ("non-KV memory (weights, activations, graphs)", f"{self.non_kv_gib:.2f} GiB"))
        return rows


def size_from_log(log: str | StartupLog, model: str | ModelSpec, request_len: int, block_size: int = 16,
                  kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1) -> LogSizing:
    """The sizing procedure, from a server's own startup lines.

    1. The pool is "Available KV cache memory" (per GPU: each rank sizes
       its own).
    2. One block costs ``block_size x 2 x kv_heads_per_rank x head_dim x
       bytes x layers`` (:func:`block_bytes`).
    3. The blocks are the capacity line's tokens turned back into blocks
       (:func:`blocks_from_log_tokens`), or, without it, the pool divided by
       one block.
    4. A request of ``request_len`` tokens (prompt + output) holds
       ``cdiv(request_len, block_size)`` blocks at its end; the usable blocks
       (the null block held back) over that is how many run at full length
       at once. More are admitted (admission looks at the prompt), and then
       preempted as they grow.
    """
    entry = log if isinstance(log, StartupLog) else read_startup_log(log)
    m = model_spec(model)
    dtype = _resolve_dtype(kv_cache_dtype, m)
    tp = check_int(tensor_parallel_size, "tensor_parallel_size", 1)
    per_block = block_bytes(m, block_size, dtype, tp)
    pool = entry.available_kv_gib * GiB
    from_pool = int(pool // per_block)
    if entry.kv_cache_tokens is not None and entry.max_model_len is not None:
        blocks = blocks_from_log_tokens(entry.kv_cache_tokens, entry.max_model_len, block_size)
    else:
        blocks = from_pool
    per_request = blocks_per_request(request_len, block_size)
    return LogSizing(model=m.name, kv_cache_dtype=str(dtype), tensor_parallel_size=tp, block_size=block_size,
                     pool_bytes=pool, block_bytes=per_block, num_blocks=blocks, blocks_from_pool=from_pool,
                     request_len=request_len, blocks_per_request=per_request,
                     concurrency=max(blocks - 1, 0) // per_request, non_kv_gib=entry.derived_non_kv_gib,
                     log=entry)


def server_log_lines(p: BudgetPlan, load_seconds: float = 0.0, profile_seconds: float = 0.0,
                     kv_cache_device: str = "GPU") -> list[str]:
    """The startup lines vLLM 0.33.0 prints for a plan, as :func:`read_startup_log` reads them.

    The model-loading line (INFO), the profiling result (DEBUG; its other
    figures, which this module does not model, are left out), the pool
    (INFO) and the capacity line (INFO), in the order a server prints them.
    The non-KV allowance is modelled as the torch peak increase alone.
    These are *our* arithmetic in vLLM's words: on a real server, read its
    own lines instead.
    """
    w, a = _gib(p.weight_bytes), _gib(p.non_kv_bytes)
    lines = [f"Model loading took {w} GiB memory and {load_seconds:.6f} seconds",
             f"Memory profiling takes {profile_seconds:.2f} seconds. Total non KV cache memory: "
             f"{_gib(p.weight_bytes + p.non_kv_bytes)}GiB; torch peak memory increase: {a}GiB; "
             f"total consumed (from mem_get_info): {w}GiB; weights memory: {w}GiB.",
             *startup_log_lines(p)]
    if kv_cache_device != "GPU":
        lines[-1] = lines[-1].replace("GPU KV cache size", f"{kv_cache_device} KV cache size", 1)
    return lines
