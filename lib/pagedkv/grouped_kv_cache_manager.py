"""``KVCacheManager`` over a coordinator: a model whose layers form several KV-cache groups.

vLLM 0.33.0's ``KVCacheManager`` (``v1/core/kv_cache_manager.py:131-931``)
never touches a table itself: it asks its coordinator
(``pagedkv.kv_cache_coordinator``), which asks one manager per group. The
book's ``KVCacheManager`` (``pagedkv.kv_cache_manager``) folds the unitary
coordinator and its one full-attention manager into one class, because that
is the path chapters 3-6 read; ``GroupedKVCacheManager`` is the same
interface over a real coordinator, for every other layout (a sliding-window
group beside full attention, a Mamba group, or a sliding window alone):

- ``get_computed_blocks(request)`` -> ``(KVCacheBlocks, num_tokens)``: the
  hit every group accepts (``find_longest_cache_hit``), one list per group;
- ``allocate_slots(...)`` -> ``KVCacheBlocks`` of new blocks per group, or
  ``None`` when the step does not fit. In vLLM's order: the window's blocks
  that no later token reads go back first (``remove_skipped_blocks``, counted
  on tokens whose step has run, so a block a running step still reads stays),
  then the sum over groups is compared with the free count (plus the
  watermark), then the hit enters every table, new blocks are appended, and
  the newly full blocks are cached;
- ``free``, ``cache_blocks``, ``get_blocks`` (``KVCacheBlocks``),
  ``get_block_ids`` (one list per group, vLLM's shape), the copy-on-write
  pairs of a partial hit (``take_pending_copies``/``acknowledge_copies``, as
  the book's manager hands them to the engine) and ``check()``.

``get_kv_cache_manager`` picks the class: the book's ``KVCacheManager`` for
one full-attention group, this one otherwise.

Where ours differs from vLLM's: a ``None`` from ``allocate_slots`` leaves
everything as it was *except* the window's early frees, which vLLM also makes
before it knows whether the step fits ("we can do this even if we cannot
schedule this request"); bad arguments raise before anything changes.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from .common import check_int, check_real, require
from .free_queue import KVCacheBlock
from .kv_cache_coordinator import KVCacheBlocks, PrefixCacheStats, get_kv_cache_coordinator
from .kv_cache_manager import KVCacheManager
from .kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec
from .request import Request
from .step_tokens import check_step_tokens

__all__ = ["GroupedKVCacheManager", "get_kv_cache_manager"]


class GroupedKVCacheManager(KVCacheManager):
    """Blocks for requests of a model with several KV-cache groups, over one shared pool.

    Args:
        kv_cache_groups: the groups (``pagedkv.kv_cache_spec.get_kv_cache_groups``), in order.
        num_blocks: blocks in the pool, including the null block 0.
        max_model_len: the context window (it caps slots and sizes a window's admission).
        enable_caching, watermark: as for ``KVCacheManager``.
        hash_block_size: tokens per request hash (default: the smallest group block size).
        max_in_flight_tokens: tokens one step may schedule (``max_num_batched_tokens``);
            sizes a sliding window's admission cap. Default: ``max_model_len``.

    ``block_size`` is the scheduler's block (the lcm of the groups'),
    ``block_sizes`` each group's; ``req_to_blocks`` is group 0's tables (the
    same request ids as every group's).
    """

    def __init__(self, kv_cache_groups: Sequence[KVCacheGroupSpec], num_blocks: int, max_model_len: int, *,
                 enable_caching: bool = True, hash_block_size: int | None = None, watermark: float = 0.0,
                 max_in_flight_tokens: int | None = None):
        max_model_len = check_int(max_model_len, "max_model_len", 1)
        in_flight = max_model_len if max_in_flight_tokens is None else check_int(
            max_in_flight_tokens, "max_in_flight_tokens", 1)
        watermark = check_real(watermark, "watermark", minimum=0, maximum=1, open_max=True)
        pool_class = self.block_pool_class
        pool = pool_class(check_int(num_blocks, "num_blocks", 2), enable_caching)
        self.coordinator = get_kv_cache_coordinator(kv_cache_groups, num_blocks, max_model_len, in_flight,
                                                    enable_caching, hash_block_size, block_pool=pool)
        self.block_pool = pool
        self.max_model_len = max_model_len
        self.enable_caching = bool(enable_caching)
        self.hash_block_size = self.coordinator.hash_block_size
        self.block_size = self.coordinator.scheduler_block_size
        self.block_sizes = [m.block_size for m in self.coordinator.single_type_managers]
        self.num_kv_cache_groups = len(self.block_sizes)
        self.hashes_per_block = self.block_size // self.hash_block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self._holders: dict[str, Request] = {}
        # Copies handed to the worker: (src id, dst id) -> the two blocks they keep held.
        self._inflight_copies: dict[tuple[int, int], tuple[KVCacheBlock, KVCacheBlock]] = {}
        self._stats = PrefixCacheStats()

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        return self.coordinator.single_type_managers[0].req_to_blocks

    @property
    def kv_cache_groups(self) -> list[KVCacheGroupSpec]:
        return self.coordinator.kv_cache_groups

    # ------------------------------------------------------------- queries
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks, one list per group (copies: editing them changes nothing)."""
        self._held(request_id)
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """One list of block ids per group (vLLM's ``get_block_ids``); a window's skipped entries are 0."""
        return self.get_blocks(request_id).get_block_ids()

    def _held(self, request_id) -> None:
        if not isinstance(request_id, str):
            raise TypeError(f"expected a request id, got {type(request_id).__name__} {request_id!r}")
        if request_id not in self._holders:
            raise KeyError(f"request {request_id!r} holds no blocks (never allocated, or already freed)")

    # ------------------------------------------------------- prefix lookup
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest prefix every group has cached, capped at ``num_tokens - 1``; changes nothing."""
        self._bind(request)
        if request.request_id in self._holders:
            raise ValueError(f"request {request.request_id!r} already holds blocks; look up new requests only")
        blocks, num_tokens = self.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
        return KVCacheBlocks(blocks), num_tokens

    # ---------------------------------------------------------- allocation
    def _hit_per_group(self, new_computed_blocks) -> tuple[Sequence[KVCacheBlock], ...]:
        n = self.num_kv_cache_groups
        if new_computed_blocks is None:
            return tuple(() for _ in range(n))
        if not isinstance(new_computed_blocks, KVCacheBlocks) or len(new_computed_blocks.blocks) != n:
            raise ValueError(f"new_computed_blocks must be the KVCacheBlocks get_computed_blocks returned "
                             f"(one list per group, {n}), got {new_computed_blocks!r}")
        return new_computed_blocks.blocks

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0, *,
                       has_scheduled_reqs: bool | None = None) -> KVCacheBlocks | None:
        """Slots for ``num_new_tokens`` more tokens in every group: the new blocks per group, or ``None``.

        Arguments as ``KVCacheManager.allocate_slots``'s, ``new_computed_blocks``
        a ``KVCacheBlocks`` from ``get_computed_blocks``.
        """
        self._bind(request)
        rid = request.request_id
        num_new_tokens = check_int(num_new_tokens, "num_new_tokens", 1)
        num_new_computed_tokens = check_int(num_new_computed_tokens, "num_new_computed_tokens", 0)
        num_lookahead_tokens = check_int(num_lookahead_tokens, "num_lookahead_tokens", 0)
        hit = self._hit_per_group(new_computed_blocks)
        held = rid in self._holders
        if held and (num_new_computed_tokens or any(hit)):
            raise ValueError(f"request {rid!r} already holds blocks; a prefix hit applies to a new request only")
        if not held and request.num_computed_tokens:
            raise ValueError(f"request {rid!r} holds no blocks but says num_computed_tokens="
                             f"{request.num_computed_tokens} (reset it to 0 after preemption)")
        if has_scheduled_reqs is not None and not isinstance(has_scheduled_reqs, bool):
            raise TypeError(f"has_scheduled_reqs must be a bool or None, got {has_scheduled_reqs!r}")
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        # Past num_tokens (and async placeholders) only by the request's drafts, which are never cached.
        if num_computed + num_new_tokens > request.num_tokens + getattr(request, "num_output_placeholders", 0):
            check_step_tokens(request, num_computed, num_new_tokens)
        total = min(num_computed, self.max_model_len)
        num_need_slot = min(total + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        coordinator = self.coordinator
        if has_scheduled_reqs is None:  # as vLLM's scheduler computes it: another request holds blocks
            has_scheduled_reqs = any(other != rid for other in self._holders)
        watermark = self.watermark_blocks if not held and has_scheduled_reqs else 0
        with self.block_pool.deferred_events():
            # Blocks no later token reads go back first, counted on tokens whose step has run.
            if held:
                coordinator.remove_skipped_blocks(rid, max(0, total - getattr(request, "num_in_flight_tokens", 0)))
            need = coordinator.get_num_blocks_to_allocate(rid, num_need_slot, hit, num_computed)
            if need + watermark > self.block_pool.get_num_free_blocks():
                return None
            if any(hit):  # as vLLM: only a request with a hit (a new one) takes it into its tables
                coordinator.allocate_new_computed_blocks(rid, hit, num_computed)
            new_blocks = coordinator.allocate_new_blocks(rid, num_need_slot)
            self._holders[rid] = request
            coordinator.cache_blocks(request, min(total + num_new_tokens, request.num_tokens))
        return KVCacheBlocks(new_blocks)

    def whole_sequence_fits(self, request: Request, hit_blocks: KVCacheBlocks | None, num_hit: int,
                            max_model_len: int, *, has_scheduled_reqs: bool) -> bool:
        """vLLM's admission gate (``allocate_slots(..., full_sequence_must_fit=True)``): do the free
        blocks hold all of the request's tokens past its hit, each window counted at its admission cap?"""
        num_tokens = min(request.num_tokens, max_model_len)
        need = self.coordinator.get_num_blocks_to_allocate(request.request_id, num_tokens,
                                                           self._hit_per_group(hit_blocks), num_hit,
                                                           apply_admission_cap=True)
        watermark = self.watermark_blocks if has_scheduled_reqs else 0
        return need + watermark <= self.block_pool.get_num_free_blocks()

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the blocks the first ``num_computed_tokens`` known tokens fill, in every group."""
        check_int(num_computed_tokens, "num_computed_tokens", 0)
        self._held(request.request_id)
        with self.block_pool.deferred_events():
            self.coordinator.cache_blocks(request, min(num_computed_tokens, request.num_tokens))

    # ---------------------------------------------------------- copy-on-write
    def take_pending_copies(self) -> list[tuple[int, int]]:
        """This step's copy-on-write pairs ``(src, dst)``; both ends stay held until acknowledged."""
        pairs, held = self.coordinator.take_kv_cache_block_copies()
        for k, pair in enumerate(pairs):
            self._inflight_copies[pair] = (held[2 * k], held[2 * k + 1])
        return pairs

    def acknowledge_copies(self, block_pairs: Iterable[tuple[int, int]]) -> None:
        """The worker has run these copies: free the ends they kept held."""
        pairs = [tuple(p) for p in block_pairs]
        for p in pairs:
            if p not in self._inflight_copies or pairs.count(p) > 1:
                raise ValueError(f"copy {p} is not an outstanding copy (or is acknowledged twice)")
        self.block_pool.free_blocks([b for p in pairs for b in self._inflight_copies.pop(p)])

    @property
    def outstanding_copies(self) -> list[tuple[int, int]]:
        pending = [(s.block_id, d.block_id) for m in self.coordinator.single_type_managers
                   for s, d in m.pending_cow_copies]
        return pending + list(self._inflight_copies)

    # --------------------------------------------------------------- freeing
    def free(self, request: Request | str) -> None:
        """Free the request's blocks in every group, group 0 first, each tail first; a no-op if it holds none."""
        rid = request.request_id if isinstance(request, Request) else request
        if not isinstance(rid, str):
            raise TypeError(f"expected a Request or a request id, got {type(rid).__name__} {rid!r}")
        if rid not in self._holders:
            return
        if isinstance(request, Request):
            self._bind(request)
        with self.block_pool.deferred_events():
            del self._holders[rid]
            self.coordinator.free(rid)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Every group drops the blocks its layers will not read again (the window's early free)."""
        with self.block_pool.deferred_events():
            self.coordinator.remove_skipped_blocks(request_id, num_computed_tokens)

    def reset_prefix_cache(self) -> bool:
        with self.block_pool.deferred_events():
            return self.coordinator.reset_prefix_cache()

    # ------------------------------------------------------------ invariants
    def check(self) -> None:
        """The coordinator's invariants (with copies in flight counted) and one holder per table."""
        if not self._inflight_copies:
            self.coordinator.check()
        else:  # the coordinator no longer sees handed-over copies: count them here
            self.block_pool.check()
            for m in self.coordinator.single_type_managers:
                m.check()
        for m in self.coordinator.single_type_managers:
            require(m.req_to_blocks.keys() == self._holders.keys(), "one holder per table in every group",
                    f"group {m.kv_cache_group_id}: tables {sorted(m.req_to_blocks)}, holders {sorted(self._holders)}")


def get_kv_cache_manager(kv_cache_groups: Sequence[KVCacheGroupSpec], num_blocks: int, max_model_len: int, *,
                         enable_caching: bool = True, hash_block_size: int | None = None, watermark: float = 0.0,
                         max_in_flight_tokens: int | None = None) -> KVCacheManager:
    """The book's ``KVCacheManager`` for one full-attention group; a ``GroupedKVCacheManager`` otherwise."""
    groups = list(kv_cache_groups)
    if not groups or not all(isinstance(g, KVCacheGroupSpec) for g in groups):
        raise TypeError(f"kv_cache_groups must be a non-empty list of KVCacheGroupSpec, got {kv_cache_groups!r}")
    spec = groups[0].kv_cache_spec
    if len(groups) == 1 and type(spec) is FullAttentionSpec:
        return KVCacheManager(num_blocks, spec.block_size, enable_caching=enable_caching,
                              hash_block_size=hash_block_size, watermark=watermark)
    return GroupedKVCacheManager(groups, num_blocks, max_model_len, enable_caching=enable_caching,
                                 hash_block_size=hash_block_size, watermark=watermark,
                                 max_in_flight_tokens=max_in_flight_tokens)
