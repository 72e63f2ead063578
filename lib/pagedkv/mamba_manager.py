"""A Mamba (linear-attention) group in "align" mode: state blocks, and the one copy vLLM still makes.

A Mamba layer keeps no key or value per token: it carries one fixed-size
*state* forward, token after token. vLLM 0.33.0 still gives such a group a
block table over the shared pool (``MambaManager``,
``v1/core/single_type_kv_cache_manager.py:1428-2135``), and in "align" mode
the table is indexed by position like an attention table, one entry per
``block_size`` tokens, but almost every entry is the null block:

- a running request holds two real blocks: the state it reads (saved at the
  end of the previous step) and the state it writes in this step. When the
  request passes the next ``block_size`` boundary, a fresh block takes the
  new state and the older one goes back to the pool at the next
  ``remove_skipped_blocks`` (``last_state_block_idx``);
- prefix caching files the state saved at a full block's end under that
  block's hash; a hit is *one* block, the state at the hit's end, found right
  to left, with the null block standing in for everything before it;
- when the state block is longer than the hash block, the prompt's last
  hash-block boundary (``(num_prompt_tokens - 1)`` rounded down) is also
  filed, on the state block that holds it (``_cache_partial_tail_block``),
  and a later request may hit it *inside* a block. The state in that block
  keeps changing as its owner runs, so the hit is copied before anyone writes:
  the hitting request gets a private copy in the table (``_apply_cow``); if the
  owner itself is still running, the cache entry moves to a copy instead and
  the owner keeps its block (its worker-side table is append-only).

Both copies are queued as ``(source, copy)`` pairs for the worker
(``take_pending_cow_copies``), and both ends hold one extra reference until
the copy has run. Blocks cached during a step cannot be hit by another request
in the same step (their state is written by that step's forward):
``get_num_blocks_to_allocate`` answers "more than the pool" for such a hit,
which defers the request (``cached_blocks_this_step``).

Not modelled: speculative blocks (MTP/EAGLE), prefill checkpoint blocks,
sparse retention, boundary-state offloads for KV connectors, and "none" mode
(no prefix caching, one state block).

Invariants (``check()``, besides the base manager's): a request holds at most
two real blocks plus one awaiting its copy; a pending partial hit names a
block in the request's table.
"""

from __future__ import annotations

from typing import Sequence

from .common import cdiv, require
from .free_queue import KVCacheBlock
from .kv_cache_spec import KVCacheSpec, MambaSpec
from .single_type_managers import (MANAGER_FOR_SPEC, SingleTypeKVCacheManager, cache_block_under,
                                   make_block_hash_with_group_id, uncache_block)

__all__ = ["MambaManager", "get_mamba_prefill_checkpoint_position", "MANAGERS_WITH_MAMBA"]


def get_mamba_prefill_checkpoint_position(num_tokens: int, hash_block_size: int) -> int:
    """The last hash-block boundary a resend of a ``num_tokens`` prompt can hit: one token
    is always recomputed for its logits (``get_mamba_prefill_checkpoint_position``,
    ``v1/kv_cache_interface.py:1169-1186``, without EAGLE or lookahead)."""
    return max((num_tokens - 1) // hash_block_size * hash_block_size, 0)


class MambaManager(SingleTypeKVCacheManager):
    """A Mamba group in "align" mode (``MambaManager``, ``v1/core/single_type_kv_cache_manager.py:1428-2135``)."""

    spec_class = MambaSpec
    supports_fine_grained_hash_lookup = True
    null_entries = "anywhere"

    def __init__(self, kv_cache_spec: MambaSpec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        if kv_cache_spec.mamba_cache_mode != "align":
            raise ValueError(f"MambaManager models mamba_cache_mode='align' only, got "
                             f"{kv_cache_spec.mamba_cache_mode!r}")
        # Hashes filed during the current step: not hittable until it ends.
        self.cached_blocks_this_step: set[bytes] = set()
        # request id -> table index of the state read by the step being scheduled
        # (written two steps ago): freed once computing has moved past it.
        self.last_state_block_idx: dict[str, int] = {}
        # request id -> table entries below this index are already null or freed.
        self._num_retired_blocks: dict[str, int] = {}
        # Requests that have been through allocate_new_blocks at least once.
        self._allocated_block_reqs: set[str] = set()

    # ---------------------------------------------------------------- lookup
    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                               alignment_tokens, hash_block_size):
        """Right to left, the first cached state is the hit: one block, null before it
        (``MambaManager.find_longest_cache_hit``, ``v1/core/single_type_kv_cache_manager.py:1470-1547``).

        With partial hits on (``alignment_tokens`` is the hash block, shorter
        than a state block) every hash-block boundary is tried, so a hit may
        end inside a block; otherwise only block ends on an alignment boundary."""
        block_size = kv_cache_spec.block_size
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        if alignment_tokens < block_size and block_size % alignment_tokens == 0:
            scale = block_size // alignment_tokens
            for fine_idx in range(min(max_length // alignment_tokens, len(block_hashes)) - 1, -1, -1):
                cached = cls._cached(block_pool, block_hashes[fine_idx], kv_cache_group_ids)
                if cached is not None:
                    for blocks, block in zip(computed, cached):
                        blocks.extend([block_pool.null_block] * (fine_idx // scale))
                        blocks.append(block)
                    return computed, (fine_idx + 1) * alignment_tokens
            return computed, 0
        r = block_size // hash_block_size
        for i in range(max_length // block_size - 1, -1, -1):
            cached = cls._cached(block_pool, block_hashes[(i + 1) * r - 1], kv_cache_group_ids)
            if cached is None:
                continue
            if block_size != alignment_tokens and (i + 1) * block_size % alignment_tokens:
                continue
            for blocks, block in zip(computed, cached):
                blocks.extend([block_pool.null_block] * i)
                blocks.append(block)
            return computed, (i + 1) * block_size
        return computed, 0

    # ---------------------------------------------------------------- sizing
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Only the state after the last computed token is needed (``get_num_skipped_tokens``,
        ``v1/core/single_type_kv_cache_manager.py:1971-1976``)."""
        return num_computed_tokens - 1

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, apply_admission_cap: bool = False) -> int:
        """At most one new state block per step, plus one for a partial hit's copy
        (``MambaManager.get_num_blocks_to_allocate``, ``v1/core/single_type_kv_cache_manager.py:1692-1795``).

        A hit on a state cached in this step answers ``num_gpu_blocks + 1``:
        "does not fit", so the request waits a step. The count is vLLM's to the
        letter, including a negative one for a running request whose table
        already covers ``num_tokens`` (the coordinator sums the groups)."""
        if new_computed_blocks and new_computed_blocks[-1].block_hash in self.cached_blocks_this_step:
            return self.block_pool.num_gpu_blocks + 1
        num_new_blocks = (cdiv(num_tokens, self.block_size) - len(new_computed_blocks)
                          - len(self.req_to_blocks.get(request_id, ())))
        has_partial_hit = (self._has_partial_local_hit(new_computed_blocks, total_computed_tokens)
                           or request_id in self._partial_hit_reqs)
        if has_partial_hit:
            num_new_blocks = max(num_new_blocks, 0) + 1
        if num_new_blocks > 0:
            num_new_blocks = min(num_new_blocks, 1 + int(has_partial_hit))
        return num_new_blocks + sum(b.ref_cnt == 0 and not b.is_null for b in new_computed_blocks)

    def get_num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        req_blocks = self.req_to_blocks.get(request_id, ())
        has_partial_hit = request_id in self._partial_hit_reqs
        if cdiv(num_tokens, self.block_size) <= len(req_blocks) and not has_partial_hit:
            return 0
        # allocate_new_blocks pads with nulls up to the last entry, then takes that one.
        num_required_blocks = cdiv(num_tokens, self.block_size)
        return max(num_required_blocks - max(len(req_blocks), num_required_blocks - 1), 0) + has_partial_hit

    # ------------------------------------------------------------ allocation
    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """The state block for the step's last token, nulls before it, and the copy of a
        partial hit (``MambaManager.allocate_new_blocks``, ``v1/core/single_type_kv_cache_manager.py:1797-1923``).

        The table grows to ``cdiv(num_tokens, block_size)`` entries, all null
        but the last. The block that held the state so far is remembered
        (``last_state_block_idx``): this step reads it, and it is freed once
        computing has moved past it. Returns what entered the table."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_required_blocks = cdiv(num_tokens, self.block_size)
        partial_hit = self._partial_hit_reqs.get(request_id)
        if num_required_blocks <= len(req_blocks) and partial_hit is None:
            self._allocated_block_reqs.add(request_id)
            return []
        prev_block_len = len(req_blocks)
        blocks_allocated = request_id in self._allocated_block_reqs
        if blocks_allocated or prev_block_len > 0:
            # The running state (or a new request's hit state) is the last entry.
            self.last_state_block_idx[request_id] = prev_block_len - 1
        if prev_block_len < num_required_blocks - 1:
            req_blocks.extend([self._null_block] * (num_required_blocks - 1 - prev_block_len))
        num_new_blocks = max(num_required_blocks - len(req_blocks), 0) + (partial_hit is not None)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        returned = req_blocks[prev_block_len:]
        if partial_hit is not None:
            block_idx, source_block = partial_hit
            cow_block, new_blocks = new_blocks[0], new_blocks[1:]
            if blocks_allocated:
                # The owner of the partial entry is still running and will
                # overwrite its state: the entry moves to the copy, the owner
                # keeps its block (vLLM's ``move_block_hashes``).
                require(req_blocks[block_idx] is source_block, "a partial entry's block is in its owner's table",
                        f"{request_id!r} entry {block_idx}")
                key = source_block.block_hash
                uncache_block(self.block_pool, source_block)
                if key is not None:
                    cache_block_under(self.block_pool, cow_block, key)
                    self.cached_blocks_this_step.add(key)
                self._pending_cow_copies.append((source_block, cow_block))
                source_block.ref_cnt += 1
            else:
                self._apply_cow(request_id, block_idx, source_block, cow_block)
                returned = [cow_block] + returned
        req_blocks.extend(new_blocks)
        self._allocated_block_reqs.add(request_id)
        self._partial_hit_reqs.pop(request_id, None)
        return returned + new_blocks

    # --------------------------------------------------------------- freeing
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free every state before the last computed token's, and the state read two
        steps ago (``MambaManager.remove_skipped_blocks``, ``v1/core/single_type_kv_cache_manager.py:1608-1657``).

        Entries below ``_num_retired_blocks`` were handled by an earlier call;
        the rest are freed right to left, nulls passed over."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        num_skipped_tokens = self.get_num_skipped_tokens(num_computed_tokens)
        if num_skipped_tokens > 0:
            first = self._num_retired_blocks.get(request_id, 0)
            last = min(num_skipped_tokens // self.block_size, len(blocks))
            if first < last:
                freed = []
                for i in range(last - 1, first - 1, -1):
                    if not blocks[i].is_null:
                        freed.append(blocks[i])
                        blocks[i] = self._null_block
                if freed:
                    self.block_pool.free_blocks(freed)
                self._num_retired_blocks[request_id] = last
        idx = self.last_state_block_idx.get(request_id)
        if idx is not None and idx < cdiv(num_computed_tokens, self.block_size) - 1 and not blocks[idx].is_null:
            self.block_pool.free_blocks([blocks[idx]])
            blocks[idx] = self._null_block

    def free(self, request_id: str) -> None:
        self._allocated_block_reqs.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        self._num_retired_blocks.pop(request_id, None)
        super().free(request_id)

    # ---------------------------------------------------------------- caching
    def cache_blocks(self, request, num_tokens: int, alignment_tokens: int | None = None) -> None:
        """File the states at full block ends, then the prompt's last hash-block boundary
        (``MambaManager.cache_blocks``, ``v1/core/single_type_kv_cache_manager.py:1978-2023``);
        both become unhittable until the next step."""
        rid = request.request_id
        before = self.num_cached_block.get(rid, 0)
        super().cache_blocks(request, num_tokens, alignment_tokens)
        after = self.num_cached_block.get(rid, 0)
        partial_hash = self._cache_partial_tail_block(request, num_tokens)
        if partial_hash is not None:
            self.cached_blocks_this_step.add(partial_hash)
        blocks = self.req_to_blocks.get(rid, [])
        for block in blocks[before:after]:
            if not block.is_null and block.block_hash is not None:
                self.cached_blocks_this_step.add(block.block_hash)

    def _cache_partial_tail_block(self, request, num_tokens: int) -> bytes | None:
        """When ``num_tokens`` is the prompt's last hash-block boundary, file the state
        block holding it under that boundary's hash; if the boundary is inside the
        block, the owner becomes the source of a copy at its next allocation
        (``MambaManager._cache_partial_tail_block``, ``v1/core/single_type_kv_cache_manager.py:2028-2135``)."""
        h = self.hash_block_size
        if num_tokens <= 0 or num_tokens % h:
            return None
        if num_tokens != get_mamba_prefill_checkpoint_position(len(request.prompt_token_ids), h):
            return None
        rid = request.request_id
        block_idx = cdiv(num_tokens, self.block_size) - 1
        blocks = self.req_to_blocks.get(rid, [])
        if block_idx >= len(blocks) or blocks[block_idx].is_null:
            return None
        source_block = blocks[block_idx]
        key = make_block_hash_with_group_id(request.block_hashes[num_tokens // h - 1], self.kv_cache_group_id)
        if source_block.block_hash == key:  # already filed here, by a hit or an earlier step
            return None
        if source_block.block_hash is not None:
            # An entry for fewer tokens is replaced; one for more is never made
            # here (this block has not filled past the prompt's boundary).
            uncache_block(self.block_pool, source_block)
        cache_block_under(self.block_pool, source_block, key)
        if num_tokens % self.block_size:
            self._partial_hit_reqs[rid] = (block_idx, source_block)
            self.num_cached_block[rid] = block_idx
        return key

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()

    # ------------------------------------------------------------ invariants
    def check(self) -> None:
        super().check()
        for rid, blocks in self.req_to_blocks.items():
            real = [b.block_id for b in blocks if not b.is_null]
            require(len(real) <= 2 + (rid in self._partial_hit_reqs), "a Mamba request holds two states",
                    f"group {self.kv_cache_group_id}, {rid!r} holds {real}")
        for rid, (idx, block) in self._partial_hit_reqs.items():
            table = self.req_to_blocks.get(rid, [])
            require(idx < len(table) and table[idx] is block, "a pending partial hit names its table entry",
                    f"group {self.kv_cache_group_id}, {rid!r} entry {idx}")


#: The manager registry with the Mamba kind added (pass as ``managers=`` to
#: ``get_manager_for_kv_cache_spec``).
MANAGERS_WITH_MAMBA: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    **MANAGER_FOR_SPEC, MambaSpec: MambaManager}
