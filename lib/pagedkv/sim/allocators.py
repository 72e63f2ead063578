"""The four allocators of chapter 2: the contiguous designs paging replaced, and paging.

What an admitted request holds, and the waste that follows:

- ``MaxLengthAllocator``: one extent of ``max_model_len`` slots -- over-reservation,
  and a remainder of the pool too short for another extent;
- ``VariableExtentAllocator``: one extent of prompt + max_new_tokens slots,
  placed first-fit or best-fit -- over-reservation and external fragmentation;
- ``PagedAllocator``: ceil(written / block_size) blocks, anywhere -- internal
  fragmentation (the unwritten tail of its last block);
- ``TokenGranularAllocator``: one slot per written token (page size 1) -- none.

Each implements ``kv_allocator.KVAllocator`` and checks its own layout;
``make_allocator(kind, ...)`` builds one by name (``ALLOCATOR_KINDS``).
"""

from __future__ import annotations

import bisect
import heapq
from typing import Hashable, Iterable

import numpy as np

from ..common import cdiv, check_int
from .kv_allocator import KVAllocator, check_invariant

__all__ = [
    "MaxLengthAllocator",
    "VariableExtentAllocator",
    "PagedAllocator",
    "TokenGranularAllocator",
    "ALLOCATOR_KINDS",
    "make_allocator",
    "largest_free_extent",
]


class MaxLengthAllocator(KVAllocator):
    """Every request reserves ``max_model_len`` contiguous slots at admission.

    The pool is cut into ``capacity // max_model_len`` equal extents; a request
    takes one whole, whatever its length. The remainder, shorter than one
    extent, can never hold a request: it is reported as ``external``.
    """

    name = "max-length contiguous"
    reserves_growth = True

    def __init__(self, capacity: int, max_model_len: int):
        super().__init__(capacity, max_model_len)
        if self.capacity < self.max_model_len:
            raise ValueError(
                f"a pool of {self.capacity} slots cannot hold one max_model_len = {self.max_model_len} reservation"
            )
        self.num_extents = self.capacity // self.max_model_len
        self._free_extents = list(range(self.num_extents))  # a heap: the lowest free extent goes first

    def _reserve(self, prompt, max_new):
        return heapq.heappop(self._free_extents) if self._free_extents else None

    def _release(self, row, handle):
        heapq.heappush(self._free_extents, handle)

    def _parts(self, waiting):
        reserved = (self.num_extents - len(self._free_extents)) * self.max_model_len
        remainder = self.capacity - self.num_extents * self.max_model_len
        return reserved - self._total_written, remainder, 0, len(self._free_extents) * self.max_model_len

    def extent_of(self, rid: Hashable) -> tuple[int, int]:
        """(start slot, length) of ``rid``'s reservation."""
        return self._handle[self._row(rid)] * self.max_model_len, self.max_model_len

    def _check_layout(self, rows):
        held = [self._handle[r] for r in rows.tolist()]
        every = sorted(held + self._free_extents)
        check_invariant(every == list(range(self.num_extents)), "each extent is free or held by exactly one request")


class VariableExtentAllocator(KVAllocator):
    """Each request reserves prompt + max_new_tokens contiguous slots in one address range.

    Free memory is a sorted list of holes. ``policy`` picks the hole:
    ``"first-fit"`` the lowest-addressed hole big enough, ``"best-fit"`` the
    smallest big enough (lowest address on ties). A freed extent merges with
    free neighbours, so no two holes ever touch. Admission can fail while the
    holes add up to more than the request needs: external fragmentation.

    An extension point: ``policy`` may also be a function
    ``choose(holes, need) -> start | None``, handed the holes as
    ``(start, length)`` pairs by address and the slots a request needs. It
    returns the start of a hole of at least ``need`` slots, or ``None`` to
    refuse; any other answer is a ``ValueError`` naming it, nothing changed.
    The request always takes the front of the chosen hole.
    """

    reserves_growth = True
    POLICIES = ("first-fit", "best-fit")

    def __init__(self, capacity: int, max_model_len: int, policy: str = "first-fit"):
        super().__init__(capacity, max_model_len)
        if not callable(policy) and policy not in self.POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(self.POLICIES)} "
                             "or pass a function choose(holes, need) -> start | None")
        if self.capacity < self.max_model_len:
            raise ValueError(
                f"a pool of {self.capacity} slots cannot hold one max_model_len = {self.max_model_len} request"
            )
        self.policy = policy
        label = policy if isinstance(policy, str) else getattr(policy, "__name__", "custom")
        self.name = f"variable-extent {label}"
        self._hole_starts: list[int] = [0]  # sorted; invariant: holes never touch
        self._hole_len: dict[int, int] = {0: self.capacity}
        self._free_total = self.capacity
        self._reserved_total = 0

    # -- holes -----------------------------------------------------------------
    def free_extents(self) -> list[tuple[int, int]]:
        """(start, length) of every hole, by address."""
        return [(s, self._hole_len[s]) for s in self._hole_starts]

    def allocated_extents(self) -> dict[Hashable, tuple[int, int]]:
        """(start, length) of every request's reservation."""
        return {rid: self._handle[row] for rid, row in self._row_of.items()}

    def largest_free_extent(self) -> int:
        """The biggest request this allocator could admit right now."""
        return max(self._hole_len.values(), default=0)

    @property
    def free_slots(self) -> int:
        return self._free_total

    def _find_hole(self, need: int) -> int | None:
        if callable(self.policy):
            return self._chosen_hole(need)
        if self.policy == "first-fit":
            for s in self._hole_starts:
                if self._hole_len[s] >= need:
                    return s
            return None
        fits = [(n, s) for s, n in self._hole_len.items() if n >= need]
        return min(fits)[1] if fits else None

    def _chosen_hole(self, need: int) -> int | None:
        """The hole a function policy picks, checked: a start of a hole that fits, or None."""
        start = self.policy(self.free_extents(), need)
        if start is None:
            return None
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)):
            raise ValueError(f"the policy must return a hole's start (an int) or None, got "
                             f"{type(start).__name__} {start!r}")
        start = int(start)
        if start not in self._hole_len:
            raise ValueError(f"the policy returned {start}, which is not the start of a hole "
                             f"(holes: {self.free_extents()})")
        if self._hole_len[start] < need:
            raise ValueError(f"the policy returned the hole at {start} of {self._hole_len[start]} "
                             f"slots for a request of {need}")
        return start

    def _reserve(self, prompt, max_new):
        need = prompt + max_new
        start = self._find_hole(need)
        if start is None:
            return None
        length = self._hole_len.pop(start)
        i = bisect.bisect_left(self._hole_starts, start)
        if length > need:  # the rest of the hole stays free, just after the new extent
            self._hole_starts[i] = start + need
            self._hole_len[start + need] = length - need
        else:
            del self._hole_starts[i]
        self._free_total -= need
        self._reserved_total += need
        return (start, need)

    def _release(self, row, handle):
        start, length = handle
        i = bisect.bisect_left(self._hole_starts, start)
        # Merge with the hole that ends where we start, and the one that starts where we end.
        if i > 0:
            left = self._hole_starts[i - 1]
            if left + self._hole_len[left] == start:
                start, length = left, length + self._hole_len.pop(left)
                i -= 1
                del self._hole_starts[i]
        if i < len(self._hole_starts) and self._hole_starts[i] == start + length:
            length += self._hole_len.pop(self._hole_starts[i])
            del self._hole_starts[i]
        self._hole_starts.insert(i, start)
        self._hole_len[start] = length
        self._free_total += handle[1]
        self._reserved_total -= handle[1]

    def _parts(self, waiting):
        external = 0
        if waiting is not None:
            need = waiting[0] + waiting[1]
            if need <= self._free_total and self.largest_free_extent() < need:
                external = self._free_total  # enough in total, but in pieces too small
        over = self._reserved_total - self._total_written
        return over, external, 0, self._free_total - external

    def _check_layout(self, rows):
        check_invariant(self._hole_starts == sorted(self._hole_len), "hole list is sorted and matches the hole table")
        check_invariant(all(n > 0 for n in self._hole_len.values()), "holes are non-empty")
        pieces = sorted([(s, n, "free") for s, n in self.free_extents()]
                        + [(*self._handle[r], "held") for r in rows.tolist()])
        end, previous = 0, None
        for s, n, kind in pieces:
            check_invariant(s == end, f"extents tile the pool without gap or overlap (at slot {end})")
            check_invariant(not (kind == previous == "free"), f"adjacent holes are merged (at slot {s})")
            end, previous = s + n, kind
        check_invariant(end == self.capacity, "extents cover the whole pool")
        for r in rows.tolist():
            check_invariant(self._handle[r][1] == self._limit[r], "a request's extent holds prompt + max_new_tokens")
        check_invariant(self._free_total == sum(self._hole_len.values()), "free total equals the holes' sum")
        check_invariant(self._reserved_total == sum(self._handle[r][1] for r in rows.tolist()), "reserved total matches")


class PagedAllocator(KVAllocator):
    """Fixed-size blocks, handed out only when the previous block fills (vLLM's design).

    A request holding ``w`` tokens owns exactly ``ceil(w / block_size)`` blocks,
    in any order anywhere in the pool: any free block serves any request, so
    there is no external fragmentation, and nothing is reserved ahead. What is
    left is the unwritten tail of the last block: fewer than ``block_size``
    slots per request. The pool holds ``capacity // block_size`` whole blocks
    (vLLM sizes it that way); ``self.capacity`` is their slots.

    Two numpy arrays hold the state, so growing hundreds of requests is a few
    array operations: a free stack of block ids, and a block table whose row
    ``r`` lists request ``r``'s blocks in logical order (like vLLM's worker-side
    ``BlockTable``; it only ever grows at a row's end).
    """

    def __init__(self, capacity: int, block_size: int = 16, max_model_len: int = 32_768):
        block_size = check_int(block_size, "block_size", 1)
        capacity = check_int(capacity, "capacity", 1)
        if capacity < block_size:
            raise ValueError(f"a pool of {capacity} slots is smaller than one block of {block_size}")
        self.block_size = block_size
        self.num_blocks = capacity // block_size
        super().__init__(self.num_blocks * block_size, max_model_len)
        self.max_blocks_per_req = cdiv(self.max_model_len, block_size)
        if self.max_blocks_per_req > self.num_blocks:
            raise ValueError(
                f"{self.num_blocks} blocks of {block_size} cannot hold one max_model_len = "
                f"{self.max_model_len} request ({self.max_blocks_per_req} blocks)"
            )
        self.name = "token-granular" if block_size == 1 else f"paged (block {block_size})"
        # Free stack: _free[:_num_free], top at the end. The last freed block is
        # the next handed out (vLLM puts freed blocks at the head of its queue).
        self._free = np.arange(self.num_blocks - 1, -1, -1, dtype=np.int64)
        self._num_free = self.num_blocks
        self._table = np.zeros((0, min(self.max_blocks_per_req, 64)), np.int64)
        self._nblocks = np.zeros(0, np.int64)  # blocks held per row: row r's table is _table[r, :_nblocks[r]]
        self._blocks_held = 0

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def free_block_ids(self) -> list[int]:
        """The free stack, bottom to top (the top is handed out next)."""
        return self._free[: self._num_free].tolist()

    def blocks_of(self, rid: Hashable) -> list[int]:
        """The physical blocks of ``rid``, in logical order (its block table row)."""
        row = self._row(rid)
        return self._table[row, : self._nblocks[row]].tolist()

    def _take_row(self):
        row = super()._take_row()
        rows = len(self._rid_of)
        if self._table.shape[0] < rows:  # the row arrays grew: follow
            table = np.zeros((rows, self._table.shape[1]), np.int64)
            table[: self._table.shape[0]] = self._table
            nblocks = np.zeros(rows, np.int64)
            nblocks[: self._nblocks.size] = self._nblocks
            self._table, self._nblocks = table, nblocks
        return row

    def _widen(self, blocks: int) -> None:
        """Make room for ``blocks`` columns (doubling, up to max_blocks_per_req)."""
        if blocks > self._table.shape[1]:
            cols = min(self.max_blocks_per_req, max(blocks, 2 * self._table.shape[1]))
            table = np.zeros((self._table.shape[0], cols), np.int64)
            table[:, : self._table.shape[1]] = self._table
            self._table = table

    def _pop(self, n: int) -> np.ndarray:
        """The top ``n`` free blocks, top first."""
        self._num_free -= n
        return self._free[self._num_free : self._num_free + n][::-1].copy()

    def _reserve(self, prompt, max_new):
        need = cdiv(prompt, self.block_size)
        if need > self._num_free:
            return None
        return self._pop(need)  # written into the table once the request has a row

    def _after_admit(self, row):
        blocks = self._handle[row]
        self._handle[row] = None
        self._widen(blocks.size)
        self._table[row, : blocks.size] = blocks
        self._nblocks[row] = blocks.size
        self._blocks_held += blocks.size

    def _release(self, row, handle):
        n = int(self._nblocks[row])
        # Back in logical order: the tail block ends on top of the stack and is handed out next.
        self._free[self._num_free : self._num_free + n] = self._table[row, :n]
        self._num_free += n
        self._blocks_held -= n
        self._nblocks[row] = 0

    def _grow_rows(self, rows, steps):
        have = self._nblocks[rows]
        need = cdiv((self._written[rows] + steps), self.block_size) - have
        total = int(need.sum())
        if total > self._num_free:
            return False
        if total:
            takers = need > 0
            rows, have, need = rows[takers], have[takers], need[takers]
            # Row r gets need[r] new blocks at columns have[r], have[r] + 1, ...
            owner = np.repeat(rows, need)
            column = np.repeat(have - np.cumsum(need) + need, need) + np.arange(total)
            self._widen(int(column.max()) + 1)
            self._table[owner, column] = self._pop(total)
            self._nblocks[rows] += need
            self._blocks_held += total
        return True

    def _parts(self, waiting):
        internal = self._blocks_held * self.block_size - self._total_written
        return 0, 0, internal, self._num_free * self.block_size

    def internal_waste(self) -> dict[Hashable, int]:
        """Unwritten slots in each request's last block."""
        return {rid: int(self._nblocks[row]) * self.block_size - int(self._written[row])
                for rid, row in self._row_of.items()}

    def _check_layout(self, rows):
        n = self._nblocks[rows]
        check_invariant(int(n.sum()) == self._blocks_held, "held-block count matches the block table")
        check_invariant(np.array_equal(n, cdiv(self._written[rows], self.block_size)),
                 "each request holds ceil(written / block_size) blocks, no more")
        held = self._table[rows][np.arange(self._table.shape[1]) < n[:, None]]
        every = np.sort(np.concatenate([held, self._free[: self._num_free]]))
        check_invariant(np.array_equal(every, np.arange(self.num_blocks)), "each block is free or held by exactly one request")
        idle = np.ones(self._nblocks.size, bool)
        idle[rows] = False
        check_invariant(not self._nblocks[idle].any(), "rows without a request hold no blocks")


class TokenGranularAllocator(PagedAllocator):
    """Page size 1, SGLang's default: a slot per token, so no tail is ever wasted."""

    def __init__(self, capacity: int, max_model_len: int = 32_768):
        super().__init__(capacity, 1, max_model_len)


ALLOCATOR_KINDS = ("max-length", "first-fit", "best-fit", "paged", "token")


def make_allocator(kind: str, capacity: int, max_model_len: int = 32_768, block_size: int = 16) -> KVAllocator:
    """One of ``ALLOCATOR_KINDS`` over a pool of ``capacity`` slots."""
    if kind == "max-length":
        return MaxLengthAllocator(capacity, max_model_len)
    if kind in ("first-fit", "best-fit"):
        return VariableExtentAllocator(capacity, max_model_len, policy=kind)
    if kind == "paged":
        return PagedAllocator(capacity, block_size, max_model_len)
    if kind == "token":
        return TokenGranularAllocator(capacity, max_model_len)
    raise ValueError(f"unknown allocator kind {kind!r}; choose one of {', '.join(ALLOCATOR_KINDS)}")


def largest_free_extent(allocated: Iterable[tuple[int, int]], capacity: int) -> int:
    """The longest run of free slots in a pool of ``capacity`` given its allocated (start, length) extents."""
    capacity = check_int(capacity, "capacity", 0)
    best, end = 0, 0
    for start, length in sorted(allocated):
        if start < end or length < 1 or start + length > capacity:
            raise ValueError(f"extent ({start}, {length}) overlaps another or leaves the pool of {capacity}")
        best, end = max(best, start - end), start + length
    return max(best, capacity - end)
