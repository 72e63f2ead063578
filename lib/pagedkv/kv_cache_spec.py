"""The KV-cache spec of a layer, and how layers of one kind form a KV-cache group.

A model with several kinds of layers (Gemma 3 and gpt-oss mix sliding-window
with full attention) cannot give every layer the same block table: a
sliding-window layer forgets keys older than its window, a full-attention
layer never does. vLLM 0.33.0 describes each layer by a *spec* (what one block
of that layer holds and how long the layer needs it), puts layers with equal
specs into *groups*, and gives each group its own block table over one shared
pool (``pagedkv.kv_cache_coordinator``). This module is the spec half, with
vLLM's names (``KVCacheSpec``, ``v1/kv_cache_interface.py:202-346``):

- ``FullAttentionSpec``, ``SlidingWindowSpec``, ``MLAAttentionSpec``: frozen
  dataclasses; ``page_size_bytes`` is one block of one layer,
  ``max_memory_usage_bytes(max_model_len, max_in_flight_tokens)`` the most one
  request can hold in that layer;
- ``KVCacheGroupSpec``: layer names and the spec they share;
- ``layer_specs_from_types``: HF-style ``layer_types`` to one spec per layer,
  refusing what cannot be grouped;
- ``unify_kv_cache_spec_page_size`` and ``get_kv_cache_groups``: one page
  size for every layer, then the groups.

Where vLLM takes a ``VllmConfig``, we take the two numbers it reads from it:
``max_model_len`` and ``max_in_flight_tokens`` (``max_concurrent_batches *
max_num_batched_tokens``, ``max_in_flight_tokens``, ``config/vllm.py:601-609``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .common import cdiv, check_int

__all__ = ["DTYPE_SIZES", "KVCacheSpec", "AttentionSpec", "FullAttentionSpec", "SlidingWindowSpec",
           "MLAAttentionSpec", "MambaSpec", "KVCacheGroupSpec", "LAYER_TYPES", "layer_specs_from_types",
           "unify_kv_cache_spec_page_size", "get_kv_cache_groups"]

#: Bytes per element of the KV-cache dtypes we size (vLLM reads them off a torch dtype).
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def _dtype_size(dtype, name: str) -> int:
    if isinstance(dtype, str):
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"{name} must be one of {sorted(DTYPE_SIZES)}, got {dtype!r}")
        return DTYPE_SIZES[dtype]
    size = getattr(dtype, "itemsize", None)  # a torch or numpy dtype
    if type(size) is not int or size < 1:
        raise TypeError(f"{name} must be a dtype name or a torch/numpy dtype, got {type(dtype).__name__} {dtype!r}")
    return size


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """What one block of one layer holds (``KVCacheSpec``, ``v1/kv_cache_interface.py:202-216``).

    Equal specs mean interchangeable layers: they can share a group, so one
    block table serves them all. Frozen, so a spec is a dict key.
    """

    block_size: int

    def __post_init__(self):
        check_int(self.block_size, "block_size", 1)

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    def max_memory_usage_bytes(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        raise NotImplementedError

    def max_num_blocks_per_req(self, max_len: int) -> int:
        """Block-table width for this group: entries one request may need (``max_num_blocks_per_req``,
        ``v1/kv_cache_interface.py:290-300``)."""
        return cdiv(check_int(max_len, "max_len", 0), self.block_size)


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """An attention layer: ``num_kv_heads`` heads of ``head_size`` (K) and ``head_size_v`` (V) per token.

    ``page_size_bytes = block_size * num_kv_heads * (head_size + head_size_v) * dtype size``,
    or ``page_size_padded`` when the planner padded the page (``page_size_bytes``,
    ``v1/kv_cache_interface.py:586-602``).
    """

    num_kv_heads: int
    head_size: int
    dtype: object = "float16"
    head_size_v: int | None = None
    page_size_padded: int | None = None

    def __post_init__(self):
        super().__post_init__()
        check_int(self.num_kv_heads, "num_kv_heads", 1)
        check_int(self.head_size, "head_size", 1)
        _dtype_size(self.dtype, "dtype")
        if self.head_size_v is None:  # V as wide as K unless told (MLA sets 0)
            object.__setattr__(self, "head_size_v", self.head_size)
        check_int(self.head_size_v, "head_size_v", 0)
        if self.page_size_padded is not None:
            check_int(self.page_size_padded, "page_size_padded", 1)
            if self.page_size_padded < self.unpadded_page_size_bytes:
                raise ValueError(f"page_size_padded={self.page_size_padded} is smaller than the page it pads "
                                 f"({self.unpadded_page_size_bytes} bytes)")

    @property
    def unpadded_page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * (self.head_size + self.head_size_v) * _dtype_size(self.dtype, "dtype")

    @property
    def page_size_bytes(self) -> int:
        return self.unpadded_page_size_bytes if self.page_size_padded is None else self.page_size_padded


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Every token stays attended until the request ends: a request may fill ``max_model_len``.

    ``max_memory_usage_bytes = cdiv(max_model_len, block_size) * page_size_bytes``
    (``FullAttentionSpec.max_memory_usage_bytes``, ``v1/kv_cache_interface.py:643-648``).
    """

    def max_memory_usage_bytes(self, max_model_len: int, max_in_flight_tokens: int = 0) -> int:
        return cdiv(check_int(max_model_len, "max_model_len", 1), self.block_size) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (DeepSeek): one latent vector per token, no separate V.

    Here for the planner's one refusal: its page cannot be padded to another
    group's (``MLAAttentionSpec``, ``v1/kv_cache_interface.py:728-745``).
    """

    head_size_v: int = 0


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """A token attends to the ``sliding_window`` tokens ending at itself; older keys are never read.

    A running request therefore holds only the window's blocks plus what is
    in flight, and vLLM sizes the group by that, not by ``max_model_len``
    (``SlidingWindowSpec``, ``v1/kv_cache_interface.py:900-955``).
    """

    sliding_window: int

    def __post_init__(self):
        super().__post_init__()
        check_int(self.sliding_window, "sliding_window", 1)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """The most blocks one request holds at once, also the admission cap.

        While a chunk is in flight the request keeps the last ``sliding_window - 1``
        computed tokens (freeing follows *processed* tokens) plus the tokens in
        flight, never more than ``max_model_len``; one more block because the
        window rarely starts on a block boundary (4-token blocks, window 6:
        ``[xxCD][EFGH]`` holds ``CDEFGH``).
        """
        max_in_flight_tokens = check_int(max_in_flight_tokens, "max_in_flight_tokens", 0)
        max_model_len = check_int(max_model_len, "max_model_len", 1)
        num_tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size) + 1

    def max_memory_usage_bytes(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        return self.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Chunked local attention (Llama 4): a token attends only within its own
    ``attention_chunk_size``-aligned chunk, so whole earlier chunks are never read.

    A running request holds at most one chunk plus the tokens in flight,
    never more than ``max_model_len``; chunks start on block boundaries
    whenever the chunk size is a multiple of the block size, so there is no
    extra block as for a sliding window (``ChunkedLocalAttentionSpec``,
    ``v1/kv_cache_interface.py:860-881``).
    """

    attention_chunk_size: int

    def __post_init__(self):
        super().__post_init__()
        check_int(self.attention_chunk_size, "attention_chunk_size", 1)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        max_in_flight_tokens = check_int(max_in_flight_tokens, "max_in_flight_tokens", 0)
        max_model_len = check_int(max_model_len, "max_model_len", 1)
        return cdiv(min(self.attention_chunk_size + max_in_flight_tokens, max_model_len), self.block_size)

    def max_memory_usage_bytes(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        return self.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """A Mamba / linear-attention layer: one fixed-size *state* per request, not a KV per token.

    ``shapes`` and ``dtypes`` describe the state tensors (conv and SSM state);
    one block holds one state, so ``page_size_bytes`` is their total size
    whatever ``block_size`` says (``MambaSpec``, ``v1/kv_cache_interface.py:1094-1166``).
    ``block_size`` is how many tokens a state advances per block: in "align"
    mode a state is saved at every ``block_size`` boundary, which is what
    prefix caching can hit. A request holds two states at once (the one it
    reads, the one it writes), so ``max_memory_usage_bytes`` is two pages in
    "align" mode and one otherwise. Speculative and prefill-checkpoint blocks
    are not modelled: they are refused if non-zero.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple = ("float16",)
    page_size_padded: int | None = None
    mamba_cache_mode: str = "align"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0

    def __post_init__(self):
        super().__post_init__()
        if (not isinstance(self.shapes, tuple) or not self.shapes
                or not all(isinstance(t, tuple) and t for t in self.shapes)):
            raise TypeError(f"shapes must be a non-empty tuple of shape tuples, got {self.shapes!r}")
        for shape in self.shapes:
            for d in shape:
                check_int(d, "shapes entry", 1)
        if not isinstance(self.dtypes, tuple) or len(self.dtypes) != len(self.shapes):
            raise ValueError(f"dtypes must be a tuple with one dtype per shape ({len(self.shapes)}), "
                             f"got {self.dtypes!r}")
        for d in self.dtypes:
            _dtype_size(d, "dtypes entry")
        if self.mamba_cache_mode not in ("align", "none"):
            raise ValueError(f"mamba_cache_mode must be 'align' or 'none', got {self.mamba_cache_mode!r}")
        for name in ("num_speculative_blocks", "num_prefill_checkpoint_blocks"):
            if check_int(getattr(self, name), name, 0):
                raise ValueError(f"{name}={getattr(self, name)}: speculative and checkpoint state blocks "
                                 "are not modelled here; only 0 is accepted")
        if self.page_size_padded is not None:
            check_int(self.page_size_padded, "page_size_padded", 1)
            if self.page_size_padded < self.real_page_size_bytes:
                raise ValueError(f"page_size_padded={self.page_size_padded} is smaller than the state it pads "
                                 f"({self.real_page_size_bytes} bytes)")

    @property
    def real_page_size_bytes(self) -> int:
        total = 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            n = 1
            for d in shape:
                n *= d
            total += n * _dtype_size(dtype, "dtypes entry")
        return total

    @property
    def page_size_bytes(self) -> int:
        return self.real_page_size_bytes if self.page_size_padded is None else self.page_size_padded

    def max_memory_usage_bytes(self, max_model_len: int = 0, max_in_flight_tokens: int = 0) -> int:
        return self.page_size_bytes * (2 if self.mamba_cache_mode == "align" else 1)

    def max_num_blocks_per_req(self, max_len: int) -> int:
        """In "align" mode the table is indexed by position over the whole sequence
        (earlier states are null); otherwise one state."""
        if self.mamba_cache_mode == "align":
            return super().max_num_blocks_per_req(max_len)
        return 1


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table, and their common spec (``KVCacheGroupSpec``,
    ``v1/kv_cache_interface.py:1504-1522``)."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


#: The ``layer_types`` entries of a Hugging Face config that we can group.
LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_specs_from_types(layer_types, *, block_size: int, num_kv_heads: int, head_size: int,
                           max_model_len: int, sliding_window: int | None = None,
                           dtype="float16", prefix: str = "model.layers") -> dict[str, KVCacheSpec]:
    """One spec per layer, from a config's ``layer_types`` (Gemma 3, gpt-oss).

    Layer ``i`` is named ``f"{prefix}.{i}.self_attn"``. Refused, with the
    layer's name and the reason, before anything is built: a type we cannot
    group; a sliding layer without ``sliding_window``; a window longer than
    ``max_model_len`` (it never slides: the layer is full attention and
    should say so, or the context is mis-set).
    """
    if isinstance(layer_types, (str, bytes)) or not hasattr(layer_types, "__iter__"):
        raise TypeError(f"layer_types must be a list of layer type names, got {type(layer_types).__name__} "
                        f"{layer_types!r}")
    layer_types = list(layer_types)
    if not layer_types:
        raise ValueError("layer_types is empty: a model with no attention layer has no KV cache to group")
    max_model_len = check_int(max_model_len, "max_model_len", 1)
    if sliding_window is not None:
        sliding_window = check_int(sliding_window, "sliding_window", 1)
    specs: dict[str, KVCacheSpec] = {}
    common = dict(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype)
    for i, kind in enumerate(layer_types):
        name = f"{prefix}.{i}.self_attn"
        if kind not in LAYER_TYPES:
            raise ValueError(f"layer {name}: unknown layer type {kind!r} (known: {', '.join(LAYER_TYPES)})")
        if kind == "full_attention":
            specs[name] = FullAttentionSpec(**common)
            continue
        if sliding_window is None:
            raise ValueError(f"layer {name}: a sliding_attention layer needs sliding_window, got None")
        if sliding_window > max_model_len:
            raise ValueError(f"layer {name}: sliding_window={sliding_window} is larger than "
                             f"max_model_len={max_model_len}, so the window never slides")
        specs[name] = SlidingWindowSpec(sliding_window=sliding_window, **common)
    return specs


def unify_kv_cache_spec_page_size(kv_cache_spec: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Give every layer the largest page size, so one block id means one page in every group.

    vLLM's rules (``unify_kv_cache_spec_page_size``, ``v1/core/kv_cache_planning.py:346-408``):
    a layer whose page divides the largest grows its ``block_size`` by the
    ratio (more tokens per block, same bytes); an attention layer whose page
    does not divide it keeps its block size and pads its page; an MLA layer
    can do neither and is refused (vLLM raises ``NotImplementedError`` and may
    fall back to one full-attention group; we refuse with a ``ValueError``
    naming the layer). A new dict; the input is left as it was.
    """
    if not isinstance(kv_cache_spec, dict) or not all(isinstance(s, KVCacheSpec) for s in kv_cache_spec.values()):
        raise TypeError(f"kv_cache_spec must be a dict of layer name -> KVCacheSpec, got {kv_cache_spec!r}")
    page_sizes = {spec.page_size_bytes for spec in kv_cache_spec.values()}
    if len(page_sizes) <= 1:
        return dict(kv_cache_spec)
    max_page_size = max(page_sizes)
    unified = {}
    for name, spec in kv_cache_spec.items():
        page = spec.page_size_bytes
        if page == max_page_size:
            unified[name] = spec
        elif max_page_size % page == 0:
            unified[name] = replace(spec, block_size=spec.block_size * (max_page_size // page))
        elif isinstance(spec, AttentionSpec) and not isinstance(spec, MLAAttentionSpec):
            unified[name] = replace(spec, page_size_padded=max_page_size)
        else:
            raise ValueError(f"layer {name}: its page of {page} bytes does not divide the largest page "
                             f"({max_page_size} bytes) and an MLA page cannot be padded, so the page sizes "
                             "cannot be unified")
    return unified


def get_kv_cache_groups(kv_cache_spec: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Group layers with equal specs; then split each kind into groups of the same number of layers.

    The split is vLLM's (``_get_kv_cache_groups_uniform_page_size``,
    ``v1/core/kv_cache_planning.py:416-556``): the group size is the smallest
    kind's layer count (or the largest, when the largest is under 1.5 times
    the smallest), and kind ``k``'s layers go round-robin, ``layers[i::n]``,
    so every group stands for the same number of layers and one block id
    means the same bytes in every group. 10 full + 20 sliding layers give
    three groups of 10. Pages are unified first. One kind gives one group.
    """
    specs = unify_kv_cache_spec_page_size(kv_cache_spec)
    if not specs:
        raise ValueError("kv_cache_spec is empty: no layer to group")
    same_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        same_spec.setdefault(spec, []).append(name)
    if len(same_spec) == 1:
        (spec, names), = same_spec.items()
        return [KVCacheGroupSpec(names, spec)]
    counts = [len(names) for names in same_spec.values()]
    group_size = max(counts) if max(counts) < min(counts) * 1.5 else min(counts)
    groups = []
    for spec, names in same_spec.items():
        num_groups = cdiv(len(names), group_size)
        groups += [KVCacheGroupSpec(names[i::num_groups], spec) for i in range(num_groups)]
    return groups
