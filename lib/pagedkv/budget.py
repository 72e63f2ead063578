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
from dataclasses import dataclass, field

import torch

from .common import cdiv, check_int, check_real
# The specs the arithmetic below runs on live in pagedkv.specs; they are
# re-exported here, where the chapters look for them.
from .specs import (DTYPE_BYTES, GPUS, MODELS, REFERENCE_MODEL, SIZED_MODEL_TYPES, ConfigModelSpec,  # noqa: F401
                    GiB, GPUSpec, KiB, MiB, ModelSpec, dtype_bytes, gpu_for_device_name, gpu_spec,
                    model_spec, model_spec_from_config, resolve_kv_dtype, unsized_reason)
# vLLM's startup messages live beside the group planner, which raises them too.
from .kv_cache_planning import NO_MEMORY_MESSAGE, format_gib, startup_error_message  # noqa: F401
from .kv_cache_planning import KVCachePlan, plan_kv_cache


def _grouped(m: ModelSpec) -> bool:
    """A model read from a config.json whose layers are not all full attention:
    its pool is planned by KV-cache groups (``pagedkv.kv_cache_planning``)."""
    return isinstance(m, ConfigModelSpec) and m.grouped


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

    For a model with several kinds of layers it is what one token costs when
    it is written, summed over the layers that keep per-token KV (every
    attention layer, windowed or not; a linear-attention layer keeps a state
    instead); an MLA layer keeps one latent, not K and V.
    """
    m = model_spec(model)
    dtype = resolve_kv_dtype(dtype, m)
    per_layer = 2 * kv_heads_per_rank(m, tensor_parallel_size) * m.head_dim * dtype_bytes(dtype)
    if not _grouped(m):
        return m.num_layers * per_layer
    kinds = m.layer_kinds
    if "mla" in kinds:
        return len(kinds) * m.head_dim * dtype_bytes(dtype)
    return sum(k != "linear_attention" for k in kinds) * per_layer


def weight_bytes(model: str | ModelSpec, dtype: str | torch.dtype = "bf16", tensor_parallel_size: int = 1) -> int:
    """Parameter bytes per rank (weights split evenly across tensor-parallel ranks)."""
    m = model_spec(model)
    tp = check_int(tensor_parallel_size, "tensor_parallel_size", 1)
    if isinstance(m, ConfigModelSpec) and not m.params_counted:
        raise ValueError(f"the parameter count of {m.name!r} is not known from its config (a mixture "
                         "of experts, a hybrid or a quantized checkpoint): give the weights as the "
                         "server logs them, weight_gib=<'Model loading took' GiB x tensor_parallel_size>")
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
    dtype = resolve_kv_dtype(dtype, m)
    return block_size * 2 * kv_heads_per_rank(m, tensor_parallel_size) * m.head_dim * dtype_bytes(dtype)


def block_bytes(model: str | ModelSpec, block_size: int = 16, dtype: str | torch.dtype = "bf16",
                tensor_parallel_size: int = 1) -> int:
    """One block across all layers (what one block id really costs).

    With several KV-cache groups a block id is one page in each layer of a
    group, so it costs a page times the layers per group
    (``KVCachePlan.bytes_per_block``).
    """
    m = model_spec(model)
    if _grouped(m):
        return _group_plan(m, 0, m.native_context, block_size, dtype, tensor_parallel_size).bytes_per_block
    return page_bytes_per_layer(m, block_size, dtype, tensor_parallel_size) * m.num_layers


def _group_plan(m: ModelSpec, pool_bytes: float, max_model_len: int, block_size: int, dtype,
                tensor_parallel_size: int = 1, **scheduler) -> KVCachePlan:
    kv = resolve_kv_dtype(dtype, m)
    if not isinstance(kv, str):
        kv = str(kv).removeprefix("torch.")
    return plan_kv_cache(m, pool_bytes, max_model_len=max_model_len, block_size=block_size,
                         kv_cache_dtype=kv, tensor_parallel_size=tensor_parallel_size, check=False,
                         **scheduler)


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
    """Requests of ``request_len`` tokens that fit at once: what actually runs.

    ``num_blocks`` is the pool's count as vLLM allocates it, the null block
    included (:func:`num_gpu_blocks`); the null block never holds a token, so
    ``(num_blocks - 1) // cdiv(request_len, block_size)`` requests run at
    full length together. vLLM's own "Maximum concurrency" line divides all
    ``num_blocks`` instead (:func:`logged_max_concurrency`) and can say one
    more: 3,675 blocks and 8,400-token requests log 7.00x while 6 fit.
    """
    usable = max(check_int(num_blocks, "num_blocks", 0) - 1, 0)
    return usable // blocks_per_request(request_len, block_size)


def logged_max_concurrency(num_blocks: int, max_model_len: int, block_size: int) -> float:
    """What vLLM 0.33.0 logs as "Maximum concurrency for L tokens per request".

    ``num_blocks / cdiv(max_model_len, block_size)``, a float, with every
    block counted, the null block included
    (``get_max_concurrency_for_kv_cache_config`` in
    ``v1/core/kv_cache_utils.py``, one KV-cache group). It is the log's
    figure, not a count of requests: :func:`paged_ceiling` is what fits.
    """
    check_int(num_blocks, "num_blocks", 0)
    return num_blocks / blocks_per_request(check_int(max_model_len, "max_model_len", 1), block_size)


def logged_kv_cache_tokens(num_blocks: int, max_model_len: int, block_size: int) -> int:
    """The "GPU KV cache size: N tokens" that vLLM 0.33.0 logs.

    ``int(num_blocks / cdiv(L, B) * L)`` for ``L = max_model_len``: the
    logged concurrency times the length, truncated. It equals ``num_blocks x
    block_size`` only when ``L`` is a multiple of ``B``: 2,000 blocks at
    ``max_model_len`` 32,760 print 31,992 tokens, not 32,000.
    """
    return int(logged_max_concurrency(num_blocks, max_model_len, block_size) * max_model_len)


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
    m = model_spec(model)
    if _grouped(m):  # by groups, with the default scheduler budget
        from .kv_cache_planning import check_enough_memory
        return check_enough_memory(_group_plan(m, pool_bytes, max_model_len, block_size, dtype))
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
    #: The plan by KV-cache groups, for a model whose layers are not all full
    #: attention (None otherwise): groups, page size, blocks per request.
    kv_plan: KVCachePlan | None = field(default=None, repr=False, compare=False)

    @property
    def logged_max_concurrency(self) -> float:
        """vLLM's "Maximum concurrency for ``max_model_len`` tokens per
        request" (all blocks, the null block included); ``paged_ceiling`` is
        what fits. By groups where there are several."""
        if self.kv_plan is not None:
            return self.kv_plan.max_concurrency
        return logged_max_concurrency(self.num_blocks, self.max_model_len, self.block_size)

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
        if self.kv_plan is not None:
            kinds = sorted({kind for kind, *_ in self.kv_plan.group_rows()})
            rows.append(("KV-cache groups", f"{len(self.kv_plan.groups)} ({', '.join(kinds)})"))
            rows.append(("page per layer", f"{self.kv_plan.page_size_bytes / KiB:,.0f} KiB"))
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
    concurrency = p.logged_max_concurrency
    tokens = (p.kv_plan.kv_cache_tokens if p.kv_plan is not None
              else logged_kv_cache_tokens(p.num_blocks, p.max_model_len, p.block_size))
    return [f"Available KV cache memory: {format_gib(p.pool_bytes)} GiB",
            f"GPU KV cache size: {tokens:,} tokens, "
            f"Maximum concurrency for {p.max_model_len:,} tokens per request: {concurrency:.2f}x"]


def plan(gpu: str | GPUSpec = "H100 SXM 80GB",
         model: str | ModelSpec = REFERENCE_MODEL, dtype: str = "bf16",
         gpu_memory_utilization: float = 0.92, non_kv_gib: float | None = None,
         max_model_len: int = 32_768, block_size: int = 16,
         request_len: int = 612, weight_gib: float | None = None,
         weight_dtype: str = "bf16",
         tensor_parallel_size: int = 1, *,
         logged_non_kv_gib: float | None = None,
         max_num_batched_tokens: int = 8192, max_concurrent_batches: int = 2) -> BudgetPlan:
    """Size a pool end to end: one GPU's, for ``tensor_parallel_size`` GPUs.

    ``weight_gib`` overrides the whole model's weights computed from the
    parameter count. With tensor parallelism each rank holds 1/tp of the
    weights and its share of the KV heads (:func:`kv_heads_per_rank`: split,
    or replicated once there are more ranks than KV heads), and sizes its own
    pool from its own GPU as below; every figure of the plan is per rank.
    The memory that is not the pool comes in one of two forms, never both:

    * ``non_kv_gib`` (default 6.0): each rank's *allowance*, weights
      excluded: activation peak, non-torch memory, CUDA graphs. The pool is
      ``total x utilization - weights - non_kv_gib``. From a server's log:
      :attr:`StartupLog.allowance_gib`.
    * ``logged_non_kv_gib``: everything the budget gave besides the pool,
      *weights included*, as a server logs it:
      :attr:`StartupLog.derived_non_kv_gib`, which is the requested memory
      minus "Available KV cache memory", or the DEBUG line "Total non KV
      cache memory" plus the CUDA-graph estimate (that line leaves the
      estimate out). The pool is ``total x utilization -
      logged_non_kv_gib``: the weights are not subtracted again; the plan's
      allowance is that figure minus the weights, and a figure below the
      weights is refused (it cannot hold them).

    ``model`` may be a Hugging Face ``config.json`` dict; ``dtype`` (the KV
    cache's) and ``weight_dtype`` may be ``"auto"``, the checkpoint's dtype.

    A model whose layers are not all full attention (sliding windows, chunked
    local attention, linear-attention state, MLA) is planned by KV-cache
    groups (:func:`pagedkv.kv_cache_planning.plan_kv_cache`, kept as
    ``kv_plan``): a block costs a page times the layers per group, and a
    request's blocks are summed over groups, the windowed ones holding the
    window plus ``max_concurrent_batches x max_num_batched_tokens`` tokens in
    flight. Its parameters are not counted from the config: give ``weight_gib``.
    """
    g, m = gpu_spec(gpu), model_spec(model)
    dtype, weight_dtype = resolve_kv_dtype(dtype, m), resolve_kv_dtype(weight_dtype, m)
    tp = check_int(tensor_parallel_size, "tensor_parallel_size", 1)
    if weight_gib is None:
        w = weight_bytes(m, weight_dtype, tp)
    else:
        w = check_real(weight_gib, "weight_gib", minimum=0) * GiB / tp
    non_kv = non_kv_allowance_bytes(w, non_kv_gib, logged_non_kv_gib)
    pool = kv_pool_bytes(g.total_bytes, gpu_memory_utilization, w, non_kv)
    per_token = kv_bytes_per_token(m, dtype, tp)
    reservation = check_int(max_model_len, "max_model_len", 1) * per_token
    kv_plan = None
    if _grouped(m):
        kv_plan = _group_plan(m, pool, max_model_len, block_size, dtype, tp,
                              max_num_batched_tokens=max_num_batched_tokens,
                              max_concurrent_batches=max_concurrent_batches)
        blocks = kv_plan.num_blocks
        per_request = sum(kv_plan.blocks_per_request(request_len))
        ceiling = kv_plan.requests_that_fit(request_len)
    else:
        blocks = num_gpu_blocks(pool, m, block_size, dtype, tp)
        per_request = blocks_per_request(request_len, block_size)
        ceiling = paged_ceiling(blocks, request_len, block_size)
    return BudgetPlan(
        gpu=g.name, model=m.name, dtype=str(dtype), total_bytes=g.total_bytes,
        weight_bytes=w, non_kv_bytes=non_kv,
        gpu_memory_utilization=gpu_memory_utilization, pool_bytes=pool,
        bytes_per_token=per_token, block_size=block_size, num_blocks=blocks,
        token_slots=token_slots(blocks, block_size),
        max_model_len=max_model_len,
        contiguous_reservations=int(pool // reservation),
        request_len=request_len,
        blocks_per_request=per_request,
        paged_ceiling=ceiling,
        tensor_parallel_size=tp, spec=m, kv_plan=kv_plan,
    )


def non_kv_allowance_bytes(weight_bytes: float, non_kv_gib: float | None = None,
                           logged_non_kv_gib: float | None = None) -> float:
    """The non-KV allowance in bytes, weights excluded, from one of the two
    figures :func:`plan` takes (``non_kv_gib`` as an allowance, default 6.0;
    ``logged_non_kv_gib`` as a server logged it, weights included)."""
    if non_kv_gib is not None and logged_non_kv_gib is not None:
        raise ValueError(
            f"give non_kv_gib (weights excluded) or logged_non_kv_gib (weights included, as "
            f"logged), not both: got non_kv_gib={non_kv_gib!r} and "
            f"logged_non_kv_gib={logged_non_kv_gib!r}")
    if logged_non_kv_gib is None:
        return check_real(6.0 if non_kv_gib is None else non_kv_gib, "non_kv_gib", minimum=0) * GiB
    logged = check_real(logged_non_kv_gib, "logged_non_kv_gib", minimum=0) * GiB
    if logged < weight_bytes:
        raise ValueError(
            f"logged_non_kv_gib must hold the weights ({weight_bytes / GiB:.2f} GiB per GPU), got "
            f"{logged_non_kv_gib!r}: the logged figure includes them; an allowance without the "
            f"weights goes in non_kv_gib")
    return logged - weight_bytes


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
            f"Free memory on device cuda:{device} ({format_gib(free)}/{format_gib(total)} GiB)"
            f" on startup is less than desired GPU memory utilization "
            f"({gpu_memory_utilization}, {format_gib(requested)} GiB). "
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
