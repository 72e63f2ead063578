"""Sizing a pool for many kinds of layers, as vLLM 0.33.0 plans it at startup.

A model whose layers are not all full attention gets more than one KV-cache
group (``pagedkv.kv_cache_spec``), and the pool is sized by groups, not by
"bytes per token" (``v1/core/kv_cache_planning.py`` and
``get_max_concurrency_for_kv_cache_config`` in ``v1/core/kv_cache_utils.py``):

1. every layer gets a spec from the model's config (:func:`layer_specs_from_config`);
   a hybrid Mamba / linear-attention model first grows the attention block
   size until one attention page holds a whole state, and pads the state's
   page to it (``_align_hybrid_block_size``, ``platforms/interface.py``);
2. pages are unified and layers grouped, each group standing for the same
   number of layers (``get_kv_cache_groups``);
3. one block id means one page in every layer of a group, so a block costs
   ``page_size x layers per group`` bytes and ``num_blocks = pool // that``
   (``get_kv_cache_config_from_groups``);
4. a request of ``max_model_len`` tokens needs, per group,
   ``cdiv(max_memory_usage_bytes, page_size)`` blocks: the whole context for
   full attention and MLA, the window plus the tokens in flight for a
   sliding window (plus one block: the window rarely starts on a boundary),
   a chunk plus the tokens in flight for chunked local attention, one state
   (two in "align" mode) for a Mamba layer. The startup check and the
   "Maximum concurrency" line divide by the sum over groups.

The tokens in flight are ``max_concurrent_batches x max_num_batched_tokens``
(``VllmConfig.max_in_flight_tokens``): two batches under async scheduling
with Model Runner V2, the 0.33.0 default, one with ``--no-async-scheduling``.
What is not modelled: pipeline parallelism, speculative decoding, KV
offloading, quantized KV layouts, the packed-page layouts of models whose
layers have different page sizes that cannot be padded (refused by name).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .common import cdiv, check_int, check_real
from .kv_cache_spec import (AttentionSpec, ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheGroupSpec,
                            KVCacheSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec, get_kv_cache_groups)
from .specs import GiB, ConfigModelSpec, model_spec

#: CacheConfig.DEFAULT_BLOCK_SIZE; FlashAttention's kernels take any multiple of it.
DEFAULT_BLOCK_SIZE = 16
KERNEL_BLOCK_ALIGNMENT = 16

_KV_DTYPES = {"auto": None, "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
              "fp16": "float16", "float32": "float32", "fp32": "float32", "fp8": "fp8",
              "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}


# vLLM 0.33.0's error when nothing is left once the null block is held back
# (``_check_enough_kv_cache_memory``, v1/core/kv_cache_planning.py).
NO_MEMORY_MESSAGE = (
    "No available memory for the cache blocks. "
    "Try increasing `gpu_memory_utilization` when initializing the engine "
    "(this flag also controls CPU memory reservation on the CPU "
    "backend, despite its name). "
    "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ "
    "for more details.")


def format_gib(num_bytes: float) -> str:
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
            f"({format_gib(needed_bytes)} GiB KV cache is needed, which is larger than the available KV cache "
            f"memory ({format_gib(available_bytes)} GiB). {estimate}"
            "Try increasing `gpu_memory_utilization` (which also controls CPU memory on the CPU backend) "
            "or decreasing `max_model_len` when initializing the engine. "
            "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.")



def _kv_dtype(kv_cache_dtype: str, m: ConfigModelSpec) -> str:
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in _KV_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; known: {', '.join(_KV_DTYPES)}")
    return _KV_DTYPES[kv_cache_dtype] or m.torch_dtype


def _config_spec(model) -> ConfigModelSpec:
    m = model_spec(model)
    if not isinstance(m, ConfigModelSpec) or not m.layer_kinds:
        raise ValueError(f"{m.name!r} is a preset without a config.json: give the model's config "
                         "(a dict or budget.model_spec_from_config(...)) to plan its groups")
    return m


def _kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    if tp <= num_kv_heads:
        if num_kv_heads % tp:
            raise ValueError(f"{num_kv_heads} KV heads do not split evenly across tensor_parallel_size={tp}")
        return num_kv_heads // tp
    if tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} is not a multiple of {num_kv_heads} KV heads")
    return 1  # replicated: every rank keeps one whole head


def _divide(value: int, tp: int, what: str) -> int:
    if value % tp:
        raise ValueError(f"{what} ({value}) does not split evenly across tensor_parallel_size={tp}")
    return value // tp


def gated_delta_net_state(config: dict, tensor_parallel_size: int = 1) -> tuple[tuple[int, ...], ...]:
    """Qwen3-Next's linear-attention state per layer and rank: a convolution window
    of ``linear_conv_kernel_dim - 1`` columns over the K, K and V channels, and a
    ``(value heads, value dim, key dim)`` recurrent state
    (``MambaStateShapeCalculator.gated_delta_net_state_shape``,
    ``model_executor/layers/mamba/mamba_utils.py``)."""
    tp = check_int(tensor_parallel_size, "tensor_parallel_size", 1)
    try:
        nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
        hk, hv, kernel = config["linear_key_head_dim"], config["linear_value_head_dim"], \
            config["linear_conv_kernel_dim"]
    except KeyError as missing:
        raise ValueError(f"a linear_attention layer needs config.json {missing.args[0]!r}") from None
    conv_dim = hk * nk * 2 + hv * nv
    return ((_divide(conv_dim, tp, "linear-attention conv channels"), kernel - 1),
            (_divide(nv, tp, "linear_num_value_heads"), hv, hk))


def layer_specs_from_config(model, *, max_model_len: int, block_size: int = DEFAULT_BLOCK_SIZE,
                            kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1,
                            mamba_cache_mode: str = "none") -> dict[str, KVCacheSpec]:
    """One KV-cache spec per layer (named ``model.layers.{i}.<kind>``), on one rank.

    ``model`` is a config.json dict or a :class:`~pagedkv.specs.ConfigModelSpec`.
    Beside a linear-attention (Mamba-style) layer the attention block size is
    raised to the smallest multiple of 16 whose page holds a state, and the
    state's page padded to it, as vLLM's platform hook does with FlashAttention
    (``mamba_cache_mode="align"``, prefix caching on, can raise it further to a
    backend's checkpoint alignment: pass the ``block_size`` the server logged
    in "Setting attention block size to N tokens"). Refused with a
    ``ValueError`` naming the layer: a window or chunk longer than
    ``max_model_len`` (it never slides: the context is mis-set).
    """
    m = _config_spec(model)
    c = m.config
    max_model_len = check_int(max_model_len, "max_model_len", 1)
    block_size = check_int(block_size, "block_size", 1)
    tp = check_int(tensor_parallel_size, "tensor_parallel_size", 1)
    if mamba_cache_mode not in ("none", "align"):
        raise ValueError(f"mamba_cache_mode must be 'none' or 'align', got {mamba_cache_mode!r}")
    dtype = _kv_dtype(kv_cache_dtype, m)
    if "mla" in m.layer_kinds:
        attn_1 = MLAAttentionSpec(block_size=1, num_kv_heads=1, head_size=m.head_dim, dtype=dtype)
    else:
        attn_1 = FullAttentionSpec(block_size=1, num_kv_heads=_kv_heads_per_rank(m.num_kv_heads, tp),
                                   head_size=m.head_dim, dtype=dtype)
    state = None
    if "linear_attention" in m.layer_kinds:
        shapes = gated_delta_net_state(c, tp)
        state = MambaSpec(block_size=1, shapes=shapes, dtypes=(m.torch_dtype,) * len(shapes))
        # The attention page must hold one whole state (_align_hybrid_block_size).
        align = max(KERNEL_BLOCK_ALIGNMENT, block_size)
        needed = align * cdiv(state.page_size_bytes, align * attn_1.page_size_bytes)
        block_size = max(block_size, KERNEL_BLOCK_ALIGNMENT * cdiv(needed, KERNEL_BLOCK_ALIGNMENT))
    attn = attn_1.__class__(block_size=block_size, num_kv_heads=attn_1.num_kv_heads,
                            head_size=attn_1.head_size, dtype=dtype)
    specs: dict[str, KVCacheSpec] = {}
    for i, kind in enumerate(m.layer_kinds):
        if kind in ("full_attention", "mla"):
            specs[f"model.layers.{i}.self_attn"] = attn
        elif kind == "sliding_attention":
            window = check_int(c["sliding_window"], "config.json sliding_window", 1)
            if window > max_model_len:
                raise ValueError(f"layer model.layers.{i}.self_attn: sliding_window={window} is larger than "
                                 f"max_model_len={max_model_len}, so the window never slides")
            specs[f"model.layers.{i}.self_attn"] = SlidingWindowSpec(
                block_size=block_size, num_kv_heads=attn.num_kv_heads, head_size=attn.head_size,
                dtype=dtype, sliding_window=window)
        elif kind == "chunked_attention":
            chunk = check_int(c["attention_chunk_size"], "config.json attention_chunk_size", 1)
            if chunk > max_model_len:
                raise ValueError(f"layer model.layers.{i}.self_attn: attention_chunk_size={chunk} is larger "
                                 f"than max_model_len={max_model_len}, so no chunk ever ends")
            specs[f"model.layers.{i}.self_attn"] = ChunkedLocalAttentionSpec(
                block_size=block_size, num_kv_heads=attn.num_kv_heads, head_size=attn.head_size,
                dtype=dtype, attention_chunk_size=chunk)
        else:  # linear_attention
            padded = attn.page_size_bytes if attn.page_size_bytes > state.page_size_bytes else None
            specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                block_size=block_size if mamba_cache_mode == "align" else max_model_len,
                shapes=state.shapes, dtypes=state.dtypes, page_size_padded=padded,
                mamba_cache_mode=mamba_cache_mode)
    return specs


def _kind(spec: KVCacheSpec) -> str:
    if isinstance(spec, MLAAttentionSpec):
        return "MLA"
    if isinstance(spec, SlidingWindowSpec):
        return f"sliding window {spec.sliding_window:,}"
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return f"chunked local {spec.attention_chunk_size:,}"
    if isinstance(spec, MambaSpec):
        return "linear attention (state)"
    return "full attention"


@dataclass(frozen=True)
class KVCachePlan:
    """The pool of one rank, planned by groups (see the module's docstring)."""

    groups: list[KVCacheGroupSpec]
    pool_bytes: float
    max_model_len: int
    max_in_flight_tokens: int
    bytes_per_block: int
    num_blocks: int
    #: The layer specs the groups were built from (before unification).
    layer_specs: dict[str, KVCacheSpec] = field(repr=False, default_factory=dict)

    @property
    def page_size_bytes(self) -> int:
        """The one page size every layer shares once unified."""
        return self.groups[0].kv_cache_spec.page_size_bytes

    @property
    def padding_layers(self) -> int:
        """Layer slots that hold no layer: groups all stand for as many layers as
        the largest, so a kind whose count does not divide is padded."""
        per_group = max(len(g.layer_names) for g in self.groups)
        return per_group * len(self.groups) - sum(len(g.layer_names) for g in self.groups)

    def blocks_per_request(self, request_len: int | None = None) -> list[int]:
        """Blocks one request of ``request_len`` tokens (default ``max_model_len``)
        holds at most in each group: ``cdiv(max_memory_usage_bytes, page)``."""
        n = self.max_model_len if request_len is None else check_int(request_len, "request_len", 1)
        return [cdiv(g.kv_cache_spec.max_memory_usage_bytes(n, self.max_in_flight_tokens),
                     g.kv_cache_spec.page_size_bytes) for g in self.groups]

    @property
    def max_concurrency(self) -> float:
        """vLLM's "Maximum concurrency": all blocks, the null block included,
        over the sum of every group's blocks for one ``max_model_len`` request."""
        return self.num_blocks / sum(self.blocks_per_request())

    @property
    def kv_cache_tokens(self) -> int:
        """vLLM's "GPU KV cache size: N tokens": ``int(max_concurrency x max_model_len)``."""
        return int(self.max_concurrency * self.max_model_len)

    def requests_that_fit(self, request_len: int) -> int:
        """Requests of ``request_len`` tokens that run together at most: the usable
        blocks (null block held back) over one request's blocks in all groups."""
        return max(self.num_blocks - 1, 0) // sum(self.blocks_per_request(request_len))

    def log_line(self) -> str:
        return (f"GPU KV cache size: {self.kv_cache_tokens:,} tokens, Maximum concurrency for "
                f"{self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x")

    def group_rows(self) -> list[tuple[str, int, int, int]]:
        """(kind, layers, tokens per block, blocks per max_model_len request) per group."""
        return [(_kind(g.kv_cache_spec), len(g.layer_names), g.kv_cache_spec.block_size, need)
                for g, need in zip(self.groups, self.blocks_per_request())]


def max_memory_usage_bytes(groups: list[KVCacheGroupSpec], bytes_per_block: int, max_model_len: int,
                           max_in_flight_tokens: int) -> int:
    """What one ``max_model_len`` request needs across groups, in pool bytes
    (``_max_memory_usage_bytes_from_groups``): a block of every group costs the
    whole ``bytes_per_block``, since all groups draw from one block-id space."""
    return bytes_per_block * sum(
        cdiv(g.kv_cache_spec.max_memory_usage_bytes(max_model_len, max_in_flight_tokens),
             g.kv_cache_spec.page_size_bytes) for g in groups)


def plan_kv_cache(model, pool_bytes: float, *, max_model_len: int, block_size: int = DEFAULT_BLOCK_SIZE,
                  kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1,
                  max_num_batched_tokens: int = 8192, max_concurrent_batches: int = 2,
                  mamba_cache_mode: str = "none", check: bool = True) -> KVCachePlan:
    """Plan one rank's pool of ``pool_bytes`` (the "Available KV cache memory") by groups.

    ``max_num_batched_tokens`` is the scheduler's token budget (8,192 for
    ``vllm serve`` on an H100 or H200 in 0.33.0; 2,048 on smaller GPUs; 16,384
    on a B200) and ``max_concurrent_batches`` 2 under async scheduling, the
    default. With ``check`` the startup check runs: the pool, less the null
    block, must hold one ``max_model_len`` request in every group, else a
    ``ValueError`` with vLLM's wording and the longest length that fits.
    """
    check_real(pool_bytes, "pool_bytes", minimum=0)
    in_flight = (check_int(max_concurrent_batches, "max_concurrent_batches", 1)
                 * check_int(max_num_batched_tokens, "max_num_batched_tokens", 1))
    specs = layer_specs_from_config(model, max_model_len=max_model_len, block_size=block_size,
                                    kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tensor_parallel_size,
                                    mamba_cache_mode=mamba_cache_mode)
    groups = get_kv_cache_groups(specs)
    per_block = max(sum(g.kv_cache_spec.page_size_bytes for _ in g.layer_names) for g in groups)
    plan = KVCachePlan(groups, pool_bytes, max_model_len, in_flight, per_block,
                       int(pool_bytes // per_block), specs)
    if check:
        check_enough_memory(plan)
    return plan


def check_enough_memory(plan: KVCachePlan) -> None:
    """vLLM 0.33.0's startup check over groups (``_check_enough_kv_cache_memory``
    with ``_max_memory_usage_bytes_from_groups``): the null block held back,
    one ``max_model_len`` request must fit every group at once."""
    available = plan.pool_bytes - plan.bytes_per_block
    if available <= 0:
        raise ValueError(NO_MEMORY_MESSAGE)
    needed = max_memory_usage_bytes(plan.groups, plan.bytes_per_block, plan.max_model_len,
                                    plan.max_in_flight_tokens)
    if needed <= available:
        return

    def fits(n: int) -> bool:
        return max_memory_usage_bytes(plan.groups, plan.bytes_per_block, n,
                                      plan.max_in_flight_tokens) <= available

    best, lo, hi = 0, 1, plan.max_model_len
    while lo <= hi:  # vLLM's binary search (_estimate_max_model_len_from_groups)
        mid = (lo + hi) // 2
        if fits(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    raise ValueError(startup_error_message(plan.max_model_len, needed, available, best))
