"""How many KV blocks the engine gets, and the startup check that one max-length request fits.

Three ways to size the pool, in vLLM's order of precedence:

1. ``num_gpu_blocks_override``: that many blocks, the null block included.
2. ``kv_cache_memory_bytes`` (the flag ``--kv-cache-memory-bytes``), or on a
   machine without a GPU 1 GiB, divided into blocks as ``pagedkv.budget``
   does (one floor, by one block's bytes across all layers).
3. On a GPU, profiling, as vLLM 0.33.0's worker does: the instance's budget
   is ``requested = ceil(total x gpu_memory_utilization)``, a share of the
   *total*; it refuses to start when less than that was free before its
   weights were loaded; the pool is ``requested`` minus what this instance
   itself uses: its weights and the activation peak of a forward pass at
   ``max_num_batched_tokens``. Memory other processes hold is not subtracted
   (vLLM measures its own use as differences from a startup snapshot); it
   only has to fit beside the budget. ``pagedkv.budget.pool_from_free_memory``
   is the same rule with estimated sizes.

A model with several kinds of layers (``kv_cache_groups_of``) has one block
id space for all its groups, and layers of different groups share tensors,
so one block costs one page in each *shared* tensor: the page times the
number of layers in a group, as vLLM's planner counts it. Its startup check
is the groups': one ``max_model_len`` request needs, per group, the blocks
its spec's ``max_memory_usage_bytes`` says (a sliding window only its window
and the tokens of one step), and the sum must fit the usable pool.

The startup check is chapter 1's (``pagedkv.budget.check_enough_kv_cache_memory``),
given the whole pool; it holds the null block back, as vLLM 0.33.0 does, so
2,048 blocks of 16 hold one request of at most 2,047 x 16 = 32,752 tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import budget
from ..common import cdiv
from ..kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec, get_kv_cache_groups
from .args import EngineArgs

__all__ = ["model_spec_of", "PoolSize", "determine_num_blocks", "check_startup", "dummy_batch",
           "profile_activation_bytes", "kv_cache_groups_of"]

CPU_KV_CACHE_MEMORY = budget.GiB  # what a machine without a GPU gets when nothing is said


def model_spec_of(config, name: str = "model") -> budget.ModelSpec:
    """A ``pagedkv.budget.ModelSpec`` for a ``pagedkv.model.ModelConfig`` (what KV sizing needs)."""
    return budget.ModelSpec(name, config.num_hidden_layers, config.num_attention_heads,
                            config.num_key_value_heads, config.head_dim, config.num_parameters,
                            config.max_position_embeddings, config.max_position_embeddings)


@dataclass(frozen=True)
class PoolSize:
    """The pool the engine built, and where the number came from."""

    num_blocks: int  # including the null block
    block_size: int
    block_bytes: int  # one block across all layers
    source: str  # "override" | "kv_cache_memory_bytes" | "cpu default" | "profiled"
    pool_bytes: float  # what the source offered (override: num_blocks x block_bytes)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def token_slots(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        return (f"KV pool: {self.num_blocks:,} blocks of {self.block_size} tokens ({self.source}), "
                f"{self.num_usable_blocks:,} usable + the null block; {self.token_slots:,} token slots; "
                f"{self.num_blocks * self.block_bytes / budget.MiB:,.1f} MiB")


def dummy_batch(model, args: EngineArgs, max_model_len: int):
    """A profiling batch: ``max_num_batched_tokens`` tokens in requests of at most ``max_model_len - 1``.

    Returns ``(input_ids, positions, kv_caches, attn_metadata)`` on the model's
    device, over a throwaway cache just large enough (at most ``max_num_seqs``
    requests).
    """
    from ..model import AttentionMetadata

    device, B = model.device, args.block_size
    per_req = max_model_len - 1  # the longest prompt the engine accepts
    total = min(args.max_num_batched_tokens, args.max_num_seqs * per_req)
    lens = [per_req] * (total // per_req) + ([total % per_req] if total % per_req else [])
    blocks = [cdiv(n, B) for n in lens]
    caches = model.allocate_kv_cache(sum(blocks) + 1, B)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    start = 1
    for r, nb in enumerate(blocks):
        table[r, :nb] = torch.arange(start, start + nb, dtype=torch.int32)
        start += nb
    positions = torch.cat([torch.arange(n) for n in lens])
    req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    slots = table[req, positions // B].long() * B + positions % B
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(lens), 0)
    meta = AttentionMetadata(slots.to(device), table.to(device),
                             torch.tensor(lens, dtype=torch.int32).to(device), qsl.to(device))
    ids = torch.zeros(total, dtype=torch.int64, device=device)
    return ids, positions.to(device), caches, meta


def profile_activation_bytes(model, args: EngineArgs, max_model_len: int, kernel_backend: str) -> int:
    """Peak bytes a forward pass over ``dummy_batch`` allocates beyond what it started with (CUDA only)."""
    ids, positions, caches, meta = dummy_batch(model, args, max_model_len)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.inference_mode():
        hidden = model.forward(ids, positions, caches, meta, kernel_backend=kernel_backend)
        model.compute_logits(hidden[meta.query_start_loc[1:].long() - 1])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del caches, hidden
    torch.cuda.empty_cache()
    return max(0, peak)


def kv_cache_groups_of(model, block_size: int, max_model_len: int) -> list[KVCacheGroupSpec] | None:
    """The model's KV-cache groups, or None when every layer is full attention (one group: the book's path).

    Refused with ``ValueError`` naming the layer and the reason, before
    anything is built: a layer type the library cannot group, a window
    longer than ``max_model_len`` (``kv_cache_spec.layer_specs_from_types``),
    page sizes that cannot be unified, or unified ones that change a group's
    block size (this engine runs one block size for every group).
    """
    spec_of = getattr(model, "kv_cache_spec", None)
    if spec_of is None:
        return None
    specs = spec_of(block_size, max_model_len)
    groups = get_kv_cache_groups(specs)
    if len(groups) == 1 and type(groups[0].kv_cache_spec) is FullAttentionSpec:
        return None
    for g in groups:
        if g.kv_cache_spec.block_size != block_size:
            raise ValueError(f"layer {g.layer_names[0]}: its page size differs from the others', so its "
                             f"group's blocks would hold {g.kv_cache_spec.block_size} tokens; this engine "
                             f"runs every group at block_size={block_size}")
    return groups


def _group_block_bytes(groups: list[KVCacheGroupSpec]) -> int:
    # One block id: one page in each of the tensors the groups share (a group's layer count of them).
    return groups[0].kv_cache_spec.page_size_bytes * max(len(g.layer_names) for g in groups)


def determine_num_blocks(args: EngineArgs, model, max_model_len: int, kernel_backend: str,
                         kv_cache_groups: list[KVCacheGroupSpec] | None = None) -> PoolSize:
    """Size the pool (see the module docstring); ``kv_cache_groups`` when the model has several kinds of layers."""
    spec = model_spec_of(model.config)
    dtype, B = model.dtype, args.block_size
    block_bytes = budget.block_bytes(spec, B, dtype) if not kv_cache_groups else _group_block_bytes(kv_cache_groups)
    if args.num_gpu_blocks_override is not None:
        n = args.num_gpu_blocks_override
        return PoolSize(n, B, block_bytes, "override", float(n * block_bytes))
    if args.kv_cache_memory_bytes is not None or model.device.type != "cuda":
        pool = args.kv_cache_memory_bytes if args.kv_cache_memory_bytes is not None else CPU_KV_CACHE_MEMORY
        source = "kv_cache_memory_bytes" if args.kv_cache_memory_bytes is not None else "cpu default"
    else:
        torch.cuda.synchronize(model.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(model.device)
        weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        requested = math.ceil(total * args.gpu_memory_utilization)
        if free + weights < requested:  # what was free before the weights were loaded
            raise ValueError(
                f"Free memory on device {model.device} ({(free + weights) / budget.GiB:.2f}/{total / budget.GiB:.2f} GiB) "
                f"on startup is less than desired GPU memory utilization ({args.gpu_memory_utilization}, "
                f"{requested / budget.GiB:.2f} GiB). Decrease GPU memory utilization or reduce GPU memory "
                "used by other processes.")
        activation = profile_activation_bytes(model, args, max_model_len, kernel_backend)
        # Only this instance's own use counts against its budget (vLLM 0.33.0).
        pool = budget.kv_pool_bytes(total, args.gpu_memory_utilization, weights, activation)
        source = "profiled"
    n = budget.num_gpu_blocks(pool, spec, B, dtype) if not kv_cache_groups else int(pool // block_bytes)
    if n < 2:
        raise ValueError(f"the KV pool ({pool / budget.MiB:.2f} MiB, {source}) holds {n} blocks of "
                         f"{block_bytes / budget.KiB:.1f} KiB; the engine needs at least 2 (one is the null block)")
    return PoolSize(n, B, block_bytes, source, float(pool))


def check_startup(pool: PoolSize, model, max_model_len: int,
                  kv_cache_groups: list[KVCacheGroupSpec] | None = None, max_in_flight_tokens: int = 0) -> None:
    """Chapter 1's startup error if one ``max_model_len`` request cannot fit the usable pool.

    The message is vLLM 0.33.0's, word for word; a second line of ours says
    in blocks what it said in GiB. With KV-cache groups, each group counts
    the blocks its spec's ``max_memory_usage_bytes`` says one request needs.
    """
    if kv_cache_groups:
        needed = sum(cdiv(g.kv_cache_spec.max_memory_usage_bytes(max_model_len, max_in_flight_tokens),
                          g.kv_cache_spec.page_size_bytes) for g in kv_cache_groups)
        if needed > pool.num_usable_blocks:
            raise ValueError(f"one {max_model_len}-token request needs {needed:,} blocks across "
                             f"{len(kv_cache_groups)} KV-cache groups; the pool has {pool.num_usable_blocks:,} "
                             "usable blocks besides the null block. Enlarge the pool or lower max_model_len.")
        return
    try:
        # vLLM checks the memory it would allocate (the profiled bytes, or
        # override x one block's bytes); the check holds back the null block.
        budget.check_enough_kv_cache_memory(pool.pool_bytes, model_spec_of(model.config), max_model_len,
                                            pool.block_size, model.dtype)
    except ValueError as error:
        needed, usable = cdiv(max_model_len, pool.block_size), pool.num_usable_blocks
        hint = ""
        if pool.source == "override":  # a pool given in blocks: GiB would round a small one to 0.00
            hint = (f" Raise num_gpu_blocks_override to at least {needed + 1:,}, or lower max_model_len "
                    f"to at most {usable * pool.block_size:,}.")
        raise ValueError(
            f"{error}\n(pagedkv: one {max_model_len}-token request needs {needed:,} blocks of "
            f"{pool.block_size} tokens; the pool has {usable:,} usable blocks "
            f"besides the null block.{hint})") from None
