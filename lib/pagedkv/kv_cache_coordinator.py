"""The coordinator: one block pool, one manager per KV-cache group, one answer per question.

vLLM 0.33.0's ``KVCacheManager`` never talks to a group directly; it asks a
coordinator (``v1/core/kv_cache_coordinator.py``), which asks every group's
manager (``pagedkv.single_type_managers``) and combines the answers:

- how many blocks a step needs: the sum over groups, checked against the one
  pool's free count (``get_num_blocks_to_allocate``);
- a new request's prefix hit: ``UnitaryKVCacheCoordinator`` (one group) asks
  its manager; ``HybridKVCacheCoordinator`` asks each kind of group in turn,
  full attention first, and shortens the candidate length until every kind
  accepts it (``find_longest_cache_hit``);
- allocation, caching, freeing and the sliding window's early frees: each
  group in turn, in group order (which fixes the free-queue order).

Every group draws from one ``BlockPool``, so one block id means one page in
every group's buffer (``kv_cache_spec.unify_kv_cache_spec_page_size`` makes
the page sizes equal); a block belongs to one group at a time.

Bad input is refused before anything changes, in every group: a step that
the pool cannot hold raises ``ValueError`` without any group having taken a
block. ``check()`` verifies the pool, every manager, and that the tables of
all groups together account for every block's reference count.

``pagedkv.grouped_kv_cache_manager.GroupedKVCacheManager`` is the
``KVCacheManager`` over a coordinator built on its pool (``block_pool=``);
the book's ``KVCacheManager`` folds the unitary coordinator over one
``FullAttentionManager`` into itself. Both answer in ``KVCacheBlocks``
(below), one block list per group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from .block_pool import BlockPool
from .common import cdiv, check_int, require
from .free_queue import KVCacheBlock
from .kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec, MambaSpec
from .mamba_manager import MANAGERS_WITH_MAMBA
from .single_type_managers import SingleTypeKVCacheManager, get_manager_for_kv_cache_spec

__all__ = ["KVCacheBlocks", "PrefixCacheStats", "KVCacheCoordinator", "UnitaryKVCacheCoordinator", "HybridKVCacheCoordinator",
           "get_kv_cache_coordinator"]


@dataclass(eq=False)
class KVCacheBlocks:
    """Blocks per KV-cache group: ``blocks[g][j]`` is group ``g``'s ``j``-th block
    (vLLM's ``KVCacheBlocks``, ``v1/core/kv_cache_manager.py:34-128``): what
    ``KVCacheManager.get_computed_blocks`` and ``allocate_slots`` return.

    With one group it also reads as that group's list (``len``, iteration,
    indexing, ``==`` a list), which is how chapters 3-6 use a manager's
    answers; with several, those are refused (``TypeError``): say which
    group, ``blocks[g]``, or ask ``get_block_ids()`` for one list per group.
    """

    #: ``blocks[g]``: group ``g``'s blocks (a tuple, one entry per group).
    blocks: tuple[Sequence[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        """One list of block ids per group."""
        return tuple([b.block_id for b in group] for group in self.blocks)

    def __add__(self, other: "KVCacheBlocks") -> "KVCacheBlocks":
        if not isinstance(other, KVCacheBlocks) or len(other.blocks) != len(self.blocks):
            return NotImplemented
        return KVCacheBlocks(tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks)))

    def new_empty(self) -> "KVCacheBlocks":
        return KVCacheBlocks(tuple([] for _ in self.blocks))

    def _only_group(self) -> list[KVCacheBlock]:
        if len(self.blocks) != 1:
            raise TypeError(f"these blocks span {len(self.blocks)} KV-cache groups: take one, "
                            "blocks[g], or get_block_ids() for one list per group")
        return self.blocks[0]

    def __len__(self) -> int:
        return len(self._only_group())

    def __iter__(self):
        return iter(self._only_group())

    def __getitem__(self, index):
        return self._only_group()[index]

    def __bool__(self) -> bool:
        return any(self.blocks)

    def __eq__(self, other) -> bool:
        if isinstance(other, KVCacheBlocks):
            return [list(g) for g in self.blocks] == [list(g) for g in other.blocks]
        if isinstance(other, (list, tuple)) and len(self.blocks) == 1:
            return list(self.blocks[0]) == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"KVCacheBlocks({list(self.get_block_ids())})"


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache lookups of admitted requests since the last reset (vLLM's ``PrefixCacheStats``).

    ``requests``, ``queries`` (tokens looked up) and ``hits`` (tokens found)
    count requests admitted for the first time; a preempted request admitted
    again counts in the ``preempted_*`` fields instead, as in vLLM, so the
    hit rate is that of new requests.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> "PrefixCacheStats":
        """These statistics with one more admitted request (vLLM's ``record``; ours returns a new object)."""
        if preempted:
            return replace(self, preempted_requests=self.preempted_requests + 1,
                           preempted_queries=self.preempted_queries + num_tokens,
                           preempted_hits=self.preempted_hits + num_hits)
        return replace(self, requests=self.requests + 1, queries=self.queries + num_tokens,
                       hits=self.hits + num_hits)


class KVCacheCoordinator:
    """What every coordinator shares (``KVCacheCoordinator``, ``v1/core/kv_cache_coordinator.py:89-192``).

    Args:
        kv_cache_groups: the groups, in order; group ``i`` tags its hashes with ``i``.
        num_blocks: blocks in the shared pool, the null block included.
        max_model_len, max_in_flight_tokens: what sizes a sliding window's
            admission cap (``SlidingWindowSpec.max_admission_blocks_per_request``).
        enable_caching: prefix caching on or off.
        hash_block_size: tokens per request hash (default: the smallest block size).
        block_pool: an existing pool to share instead of a new one.
    """

    def __init__(self, kv_cache_groups: Sequence[KVCacheGroupSpec], num_blocks: int, max_model_len: int,
                 max_in_flight_tokens: int, enable_caching: bool = True, hash_block_size: int | None = None,
                 block_pool: BlockPool | None = None) -> None:
        groups = list(kv_cache_groups)
        if not groups or not all(isinstance(g, KVCacheGroupSpec) for g in groups):
            raise TypeError(f"kv_cache_groups must be a non-empty list of KVCacheGroupSpec, got {kv_cache_groups!r}")
        sizes = [g.kv_cache_spec.block_size for g in groups]
        hash_block_size = min(sizes) if hash_block_size is None else check_int(hash_block_size, "hash_block_size", 1)
        for g, size in zip(groups, sizes):
            if size % hash_block_size:
                raise ValueError(f"group of layers {g.layer_names[:2]}...: block_size={size} is not a multiple "
                                 f"of hash_block_size={hash_block_size}")
        # The scheduling unit: every group's blocks end on its multiples.
        self.scheduler_block_size = math.lcm(*sizes)
        self.hash_block_size = hash_block_size
        self.kv_cache_groups = groups
        if block_pool is None:
            block_pool = BlockPool(check_int(num_blocks, "num_blocks", 2), enable_caching)
        elif not isinstance(block_pool, BlockPool):
            raise TypeError(f"block_pool must be a BlockPool, got {type(block_pool).__name__}")
        self.block_pool = block_pool
        self.enable_caching = bool(enable_caching)
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(g.kv_cache_spec, max_in_flight_tokens, max_model_len,
                                          managers=MANAGERS_WITH_MAMBA,
                                          block_pool=block_pool, enable_caching=enable_caching,
                                          kv_cache_group_id=i, hash_block_size=hash_block_size)
            for i, g in enumerate(groups))
        # Hits (and so cached blocks) land on scheduler-block boundaries.
        self.cache_hit_alignment_tokens = self.scheduler_block_size

    # -------------------------------------------------------------- sizing
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
                                   total_computed_tokens: int, apply_admission_cap: bool = False) -> int:
        """The sum over groups (``get_num_blocks_to_allocate``, ``v1/core/kv_cache_coordinator.py:194-263``)."""
        self._check_request(request_id, num_tokens, new_computed_blocks)
        return sum(m.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks[i],
                                                total_computed_tokens, apply_admission_cap)
                   for i, m in enumerate(self.single_type_managers))

    def _check_request(self, request_id, num_tokens, new_computed_blocks=None) -> None:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}")
        check_int(num_tokens, "num_tokens", 0)
        if new_computed_blocks is not None and (not isinstance(new_computed_blocks, tuple)
                                                or len(new_computed_blocks) != len(self.single_type_managers)):
            raise ValueError(f"new_computed_blocks must be a tuple of one block list per group "
                             f"({len(self.single_type_managers)}), got {new_computed_blocks!r}")

    # ---------------------------------------------------------- allocation
    def allocate_new_computed_blocks(self, request_id: str, new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
                                     num_local_computed_tokens: int) -> None:
        """A new request's hit enters every group's table; a no-op for a running request
        (``allocate_new_computed_blocks``, ``v1/core/kv_cache_coordinator.py:265-313``)."""
        self._check_request(request_id, num_local_computed_tokens, new_computed_blocks)
        if any(request_id in m.num_cached_block for m in self.single_type_managers):
            if any(new_computed_blocks):
                raise ValueError(f"request {request_id!r} is running: it takes no new prefix hit")
            return
        for blocks in new_computed_blocks:  # touched below: nothing may be foreign
            for b in blocks:
                if not self.block_pool.owns(b):
                    raise ValueError(f"hit block {b!r} is not a block of this pool")
        for i, manager in enumerate(self.single_type_managers):
            manager.add_local_computed_blocks(request_id, new_computed_blocks[i], num_local_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """Give the request ``num_tokens`` slots in every group; the new blocks per group
        (``allocate_new_blocks``, ``v1/core/kv_cache_coordinator.py:315-348``).

        All or nothing: when the groups together need more blocks than are
        free, ``ValueError`` before any group has taken one (vLLM's caller
        checks ``get_num_blocks_to_allocate`` first and never gets here).
        """
        self._check_request(request_id, num_tokens)
        need = sum(m.get_num_new_blocks(request_id, num_tokens) for m in self.single_type_managers)
        if need > self.block_pool.get_num_free_blocks():
            raise ValueError(f"request {request_id!r} needs {need} new blocks for {num_tokens} tokens across "
                             f"{len(self.single_type_managers)} groups; only {self.block_pool.get_num_free_blocks()} are free")
        return tuple(m.allocate_new_blocks(request_id, num_tokens) for m in self.single_type_managers)

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        """Every group files its newly full blocks; a hybrid caches only up to a
        scheduler-block boundary, where a later hit can end
        (``cache_blocks``, ``v1/core/kv_cache_coordinator.py:358-381``)."""
        num_tokens = self.get_num_cacheable_tokens(check_int(num_computed_tokens, "num_computed_tokens", 0))
        for manager in self.single_type_managers:
            if manager.enable_caching:
                manager.cache_blocks(request, num_tokens, self.cache_hit_alignment_tokens)

    def get_num_cacheable_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens

    def new_step_starts(self) -> None:
        """A scheduling step begins (``new_step_starts``, ``v1/core/kv_cache_coordinator.py:474-477``)."""
        for manager in self.single_type_managers:
            manager.new_step_starts()

    def take_kv_cache_block_copies(self) -> tuple[list[tuple[int, int]], list[KVCacheBlock]]:
        """The step's copy-on-write copies as ``(src_block_id, dst_block_id)``, and the
        blocks they keep held: both ends of each, to free once the copies have run
        (vLLM's ``KVCacheManager.take_kv_cache_block_copies``,
        ``v1/core/kv_cache_manager.py:863-878``; its scheduler frees them when the
        step that runs the copies is done)."""
        pending = [pair for m in self.single_type_managers for pair in m.take_pending_cow_copies()]
        return [(src.block_id, dst.block_id) for src, dst in pending], [b for pair in pending for b in pair]

    # ------------------------------------------------------------- freeing
    def free(self, request_id: str) -> None:
        """Every group frees the request's table, group 0 first (``free``,
        ``v1/core/kv_cache_coordinator.py:404-412``)."""
        self._check_request(request_id, 0)
        for manager in self.single_type_managers:
            manager.free(request_id)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Every group drops what its layers will not read again (``remove_skipped_blocks``,
        ``v1/core/kv_cache_coordinator.py:433-454``)."""
        self._check_request(request_id, num_computed_tokens)
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        """The request's table in every group (a copy: editing it changes nothing)."""
        return tuple(list(m.req_to_blocks.get(request_id, ())) for m in self.single_type_managers)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in blocks] for blocks in self.get_blocks(request_id))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               max_cache_hit_length: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        raise NotImplementedError

    # ---------------------------------------------------------- invariants
    def check(self) -> None:
        """The pool's invariants, each group's, and one across them: a block's
        ``ref_cnt`` is the number of table entries, over all groups, that hold it."""
        pool = self.block_pool
        pool.check()
        expected = [0] * pool.num_gpu_blocks
        for manager in self.single_type_managers:
            require(manager.block_pool is pool, "one pool for all groups",
                    f"group {manager.kv_cache_group_id} has its own pool")
            manager.check()
            for blocks in manager.req_to_blocks.values():
                for b in blocks:
                    if not b.is_null:
                        expected[b.block_id] += 1
            for pair in manager.pending_cow_copies:  # both ends held until the copy has run
                for b in pair:
                    expected[b.block_id] += 1
        for b in pool.blocks[1:]:
            require(b.ref_cnt == expected[b.block_id], "ref_cnt = table entries over all groups",
                    f"block {b.block_id} has ref_cnt {b.ref_cnt}, the tables hold it {expected[b.block_id]} times")


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One group: its manager's hit is the hit (``UnitaryKVCacheCoordinator``,
    ``v1/core/kv_cache_coordinator.py:530-599``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if len(self.kv_cache_groups) != 1:
            raise ValueError(f"UnitaryKVCacheCoordinator takes one group, got {len(self.kv_cache_groups)}")
        self.kv_cache_spec = self.kv_cache_groups[0].kv_cache_spec
        self.block_size = self.kv_cache_spec.block_size

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        max_cache_hit_length = check_int(max_cache_hit_length, "max_cache_hit_length", 0)
        if not self.enable_caching:
            return ([],), 0
        manager = self.single_type_managers[0]
        return manager.find_longest_cache_hit(block_hashes, max_cache_hit_length, [0], self.block_pool,
                                              self.kv_cache_spec, self.block_size, self.hash_block_size)


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several kinds of groups over one pool (``HybridKVCacheCoordinator``,
    ``v1/core/kv_cache_coordinator.py:617-988``).

    Groups with equal specs are looked up together (``attention_groups``: one
    lookup returns a block per group), full attention first.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Group ids by spec: groups of one kind are looked up in one pass.
        by_spec: dict = {}
        for i, g in enumerate(self.kv_cache_groups):
            by_spec.setdefault((g.kv_cache_spec, type(self.single_type_managers[i])), []).append(i)
        # Full attention first: its left-to-right scan gives the tightest first bound.
        self.attention_groups = sorted(((spec, ids, cls) for (spec, cls), ids in by_spec.items()),
                                       key=lambda g: not isinstance(g[0], FullAttentionSpec))
        # Partial (sub-block) hits: only beside a Mamba group in "align" mode whose
        # state block is longer than the hash block, and only when every other
        # group can look up at hash-block granularity (or hashes whole blocks)
        # (``partial_hash_hits_enabled``, ``v1/core/kv_cache_utils.py:762-801``).
        # Then hits and cached prefixes end on any hash-block boundary.
        h = self.hash_block_size
        self.enable_partial_hash_hits = any(
            isinstance(g.kv_cache_spec, MambaSpec) and g.kv_cache_spec.mamba_cache_mode == "align"
            and g.kv_cache_spec.block_size > h for g in self.kv_cache_groups) and all(
            m.supports_fine_grained_hash_lookup or m.block_size == h for m in self.single_type_managers)
        if self.enable_partial_hash_hits:
            self.cache_hit_alignment_tokens = h
        for manager in self.single_type_managers:
            manager.cache_hit_alignment_tokens = self.cache_hit_alignment_tokens

    def get_num_cacheable_tokens(self, num_computed_tokens: int) -> int:
        # A hit ends on a scheduler-block boundary; nothing past the last one can be hit.
        # With partial hits any boundary may be hit: nothing is rounded
        # (``_align_cacheable``, ``v1/core/kv_cache_coordinator.py:777-788``).
        if self.enable_partial_hash_hits:
            return num_computed_tokens
        return num_computed_tokens - num_computed_tokens % self.scheduler_block_size

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        """The longest prefix every kind of group has cached, found by shrinking a
        candidate to a fixed point (``HybridKVCacheCoordinator.find_longest_cache_hit``,
        ``v1/core/kv_cache_coordinator.py:806-941``).

        Each kind either accepts the candidate length or answers with a
        shorter one; a shorter answer restarts the round. The length only
        shrinks, so it stops. Full attention answers once: its hits are
        closed downwards (a prefix of a hit is a hit), so later rounds only
        trim its list. A sliding window is not closed downwards (a shorter
        prefix needs blocks further left, which may be gone), so it is asked
        again at every shorter candidate. With one full-attention kind and
        one other, one round suffices.
        """
        max_cache_hit_length = check_int(max_cache_hit_length, "max_cache_hit_length", 0)
        n = len(self.kv_cache_groups)
        if not self.enable_caching:
            return tuple([] for _ in range(n)), 0
        hit_length = max_cache_hit_length
        hit_blocks: list[list[KVCacheBlock] | None] = [None] * n
        hit_lengths = [0] * n
        simple = len(self.attention_groups) == 2 and isinstance(self.attention_groups[0][0], FullAttentionSpec)
        while True:
            curr = hit_length
            for spec, group_ids, manager_cls in self.attention_groups:
                first = group_ids[0]
                if isinstance(spec, FullAttentionSpec) and hit_blocks[first] is not None:
                    curr = min(curr, hit_lengths[first])
                    continue
                blocks, length = manager_cls.find_longest_cache_hit(
                    block_hashes, curr, group_ids, self.block_pool, spec,
                    self.cache_hit_alignment_tokens, self.hash_block_size)
                curr = length
                for gid, group_blocks in zip(group_ids, blocks):
                    hit_blocks[gid], hit_lengths[gid] = group_blocks, length
            if curr >= hit_length:
                break
            hit_length = curr
            if simple:
                break
        # Full-attention lists may be longer than the agreed length: trim them.
        for spec, group_ids, _ in self.attention_groups:
            if isinstance(spec, FullAttentionSpec):
                for gid in group_ids:
                    del hit_blocks[gid][cdiv(hit_length, spec.block_size):]
        return tuple(b if b is not None else [] for b in hit_blocks), hit_length


def get_kv_cache_coordinator(kv_cache_groups: Sequence[KVCacheGroupSpec], num_blocks: int, max_model_len: int,
                             max_in_flight_tokens: int, enable_caching: bool = True,
                             hash_block_size: int | None = None, block_pool: BlockPool | None = None) -> KVCacheCoordinator:
    """Unitary for one group, hybrid for several (``get_kv_cache_coordinator``,
    ``v1/core/kv_cache_coordinator.py:990-1052``)."""
    cls = UnitaryKVCacheCoordinator if len(list(kv_cache_groups)) == 1 else HybridKVCacheCoordinator
    return cls(kv_cache_groups, num_blocks, max_model_len, max_in_flight_tokens, enable_caching,
               hash_block_size, block_pool)
