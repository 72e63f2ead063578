"""Fragmentation: the allocators paging replaced, and a simulator that measures their waste.

Memory is counted in **token slots**: one slot holds one token's K and V across
all layers (``budget.kv_bytes_per_token``: 128 KiB for Llama-3-8B in bf16).
Four allocators share one small interface -- ``admit`` a request (its prompt
is written at once), ``grow`` it by a token, ``finish`` it, report its
``occupancy`` -- and each ``check()``s its own invariants. What an admitted
request holds, and the waste that follows:

- ``MaxLengthAllocator``: one extent of ``max_model_len`` slots -- over-reservation,
  and a remainder of the pool too short for another extent;
- ``VariableExtentAllocator``: one extent of prompt + max_new_tokens slots,
  placed first-fit or best-fit -- over-reservation and external fragmentation;
- ``PagedAllocator``: ceil(written / block_size) blocks, anywhere -- internal
  fragmentation (the unwritten tail of its last block);
- ``TokenGranularAllocator``: one slot per written token (page size 1) -- none.

At every moment each slot of a pool is in exactly one of five states, and
:class:`Occupancy` counts them; the five counts sum to the pool, always:

``live``
    holds a written token's KV.
``over_reserved``
    promised to a request at admission but not written (yet, or ever): the
    contiguous designs reserve for the future.
``external``
    free but unusable. For the variable-extent allocator: the free slots at a
    moment when the request waiting at the head of the queue is refused
    although the free total would hold it -- no single hole is big enough.
    For the max-length allocator: the remainder of the pool too short for one
    more ``max_model_len`` extent, which no request can ever use.
``internal``
    the unwritten tail of a request's last block (paged designs).
``free``
    free and usable.

:func:`simulate` replays a :class:`Trace` (from :func:`make_trace`) on one
allocator step by step -- decode, finish, arrive, admit first come first
served, preempt the newest request when a paged pool runs dry -- and records
the five parts at every step, asserting that they sum to the pool.
"""

from __future__ import annotations

import bisect
import heapq
import math
import numbers
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Sequence

import numpy as np

from ..common import cdiv, check_int

__all__ = [
    "Occupancy",
    "KVAllocator",
    "MaxLengthAllocator",
    "VariableExtentAllocator",
    "PagedAllocator",
    "TokenGranularAllocator",
    "make_allocator",
    "ALLOCATOR_KINDS",
    "Dist",
    "Component",
    "Workload",
    "WORKLOADS",
    "workload",
    "Trace",
    "make_trace",
    "SimResult",
    "simulate",
    "unused_tail_slots",
    "expected_tail_waste",
    "uniform_tail_waste",
    "over_reservation_waste",
    "largest_free_extent",
    "PARTS",
    "PART_COLORS",
    "PART_LABELS",
    "draw_extents",
    "plot_tail_residues",
    "run_all",
    "plot_composition",
    "composition_table",
    "steady_running",
    "plot_concurrency",
    "plot_block_size_sweep",
    "composition_html",
    "FragmentationExplorer",
]

#: The five states of a slot, in the order the figures stack them.
PARTS = ("live", "over_reserved", "external", "internal", "free")


# ------------------------------------------------------------------ validation

def _require(condition: bool, invariant: str) -> None:
    """``check()``'s one verb: raise AssertionError naming the broken invariant (survives ``python -O``)."""
    if not condition:
        raise AssertionError(f"invariant broken: {invariant}")


# ------------------------------------------------------------------ occupancy
@dataclass(frozen=True)
class Occupancy:
    """Where every slot of a pool is, at one moment (counts of token slots)."""

    live: int
    over_reserved: int
    external: int
    internal: int
    free: int

    @property
    def total(self) -> int:
        return self.live + self.over_reserved + self.external + self.internal + self.free

    def as_dict(self) -> dict[str, int]:
        return {p: getattr(self, p) for p in PARTS}

    def fractions(self) -> dict[str, float]:
        """Each part as a fraction of the pool."""
        return {p: v / self.total for p, v in self.as_dict().items()}


# ------------------------------------------------------------------ the interface
class KVAllocator(ABC):
    """What every allocator in this module does; subclasses decide where the slots come from.

    Request state lives in numpy rows (``_written``, ``_limit``) so that the
    simulator can grow every running request with one vectorised call
    (:meth:`grow_all`); ``admit``/``grow``/``finish`` are the per-request verbs.

    Every method validates its input *before* changing anything: a refused or
    invalid call leaves the allocator exactly as it was.
    """

    name: str = "allocator"
    #: True when admission already reserved every slot a request may write, so
    #: growing never allocates (the simulator may then skip quiet steps).
    reserves_growth: bool = False

    def __init__(self, capacity: int, max_model_len: int):
        self.capacity = check_int(capacity, "capacity", 1)
        self.max_model_len = check_int(max_model_len, "max_model_len", 1)
        self._row_of: dict[Hashable, int] = {}
        self._rid_of: list[Hashable | None] = []
        self._handle: list[object] = []  # per row: where the request's memory is
        self._free_rows: list[int] = []
        self._written = np.zeros(0, np.int64)  # tokens written per row
        self._limit = np.zeros(0, np.int64)  # prompt + max_new_tokens per row
        self._active = np.zeros(0, bool)
        self._total_written = 0

    # -- the per-request verbs -------------------------------------------------
    def admit(self, rid: Hashable, prompt_len: int, max_new_tokens: int = 0) -> bool:
        """Admit request ``rid`` and write its prompt; False (nothing changed) if memory is short.

        ``max_new_tokens`` is the most tokens it may decode; prompt + max_new_tokens
        must not exceed ``max_model_len`` (ValueError otherwise).
        """
        prompt = check_int(prompt_len, "prompt_len", 1)
        max_new = check_int(max_new_tokens, "max_new_tokens", 0)
        if prompt + max_new > self.max_model_len:
            raise ValueError(
                f"request {rid!r} asks for prompt_len + max_new_tokens = {prompt} + {max_new} = "
                f"{prompt + max_new} tokens, more than max_model_len = {self.max_model_len}"
            )
        try:
            known = rid in self._row_of
        except TypeError:
            raise TypeError(f"request id must be hashable, got {type(rid).__name__}") from None
        if known:
            raise ValueError(f"request {rid!r} is already admitted")
        handle = self._reserve(prompt, max_new)
        if handle is None:
            return False
        row = self._take_row()
        self._row_of[rid] = row
        self._rid_of[row] = rid
        self._handle[row] = handle
        self._written[row] = prompt
        self._limit[row] = prompt + max_new
        self._active[row] = True
        self._total_written += prompt
        self._after_admit(row)
        return True

    def grow(self, rid: Hashable) -> bool:
        """Write one more token of ``rid``; False (nothing changed) if it needs memory there is none of."""
        row = self._row(rid)
        if self._written[row] >= self._limit[row]:
            raise ValueError(f"request {rid!r} already wrote its prompt + max_new_tokens = {int(self._limit[row])} tokens")
        rows = np.array([row])
        if not self._grow_rows(rows, 1):
            return False
        self._written[row] += 1
        self._total_written += 1
        return True

    def grow_all(self, steps: int = 1) -> bool:
        """Every admitted request writes ``steps`` more tokens; all or nothing (False: nothing changed)."""
        steps = check_int(steps, "steps", 1)
        rows = np.flatnonzero(self._active)
        if rows.size == 0:
            return True
        over = self._written[rows] + steps > self._limit[rows]
        if over.any():
            row = int(rows[over.argmax()])
            raise ValueError(
                f"request {self._rid_of[row]!r} cannot grow by {steps}: it has written "
                f"{int(self._written[row])} of its {int(self._limit[row])} tokens"
            )
        if not self._grow_rows(rows, steps):
            return False
        self._written[rows] += steps
        self._total_written += steps * rows.size
        return True

    def finish(self, rid: Hashable) -> None:
        """Free everything ``rid`` holds (a finished or preempted request)."""
        row = self._row(rid)
        self._release(row, self._handle[row])
        self._total_written -= int(self._written[row])
        del self._row_of[rid]
        self._rid_of[row] = None
        self._handle[row] = None
        self._written[row] = 0
        self._limit[row] = 0
        self._active[row] = False
        self._free_rows.append(row)

    # -- what the simulator and the reader ask ---------------------------------
    @property
    def num_requests(self) -> int:
        return len(self._row_of)

    def requests(self) -> list[Hashable]:
        return list(self._row_of)

    def written(self, rid: Hashable) -> int:
        """Tokens ``rid`` has written (prompt plus decoded)."""
        return int(self._written[self._row(rid)])

    @property
    def live(self) -> int:
        return self._total_written

    def occupancy(self, waiting: tuple[int, int] | None = None) -> Occupancy:
        """The pool split into the five parts.

        ``waiting`` is (prompt_len, max_new_tokens) of the request at the head
        of the queue, if one waits; only it can make free slots "unusable".
        """
        over, external, internal, free = self._parts(waiting)
        occ = Occupancy(self._total_written, over, external, internal, free)
        _require(occ.total == self.capacity, f"parts sum to the pool: {occ} sums to {occ.total}, pool is {self.capacity}")
        return occ

    def check(self) -> None:
        """Verify every invariant; raise AssertionError naming the first broken one."""
        rows = np.flatnonzero(self._active)
        _require(len(rows) == len(self._row_of), "one active row per admitted request")
        for rid, row in self._row_of.items():
            _require(self._active[row] and self._rid_of[row] == rid, f"row {row} belongs to request {rid!r}")
            _require(1 <= self._written[row] <= self._limit[row] <= self.max_model_len,
                     f"1 <= written <= prompt + max_new_tokens <= max_model_len for {rid!r}")
        _require(set(self._free_rows).isdisjoint(rows.tolist()), "a free row is not active")
        _require(len(self._free_rows) + len(rows) == len(self._rid_of), "rows are free or active")
        _require(self._total_written == int(self._written[rows].sum()), "live total equals the sum of written tokens")
        self._check_layout(rows)
        self.occupancy()  # conservation

    # -- for subclasses --------------------------------------------------------
    @abstractmethod
    def _reserve(self, prompt: int, max_new: int) -> object | None:
        """Take the memory admission needs and return where it is, or None and change nothing."""

    @abstractmethod
    def _release(self, row: int, handle: object) -> None:
        """Give back everything ``handle`` names."""

    def _grow_rows(self, rows: np.ndarray, steps: int) -> bool:
        """Take the memory ``rows`` need to write ``steps`` more tokens; False and no change if short."""
        return True  # contiguous designs reserved it at admission

    def _after_admit(self, row: int) -> None:
        pass

    @abstractmethod
    def _parts(self, waiting: tuple[int, int] | None) -> tuple[int, int, int, int]:
        """(over_reserved, external, internal, free)."""

    @abstractmethod
    def _check_layout(self, rows: np.ndarray) -> None:
        """The allocator's own invariants: every slot owned exactly once."""

    # -- rows --------------------------------------------------------------------
    def _row(self, rid: Hashable) -> int:
        try:
            return self._row_of[rid]
        except (KeyError, TypeError):
            raise KeyError(f"unknown request {rid!r}: it was never admitted or has finished") from None

    def _take_row(self) -> int:
        if not self._free_rows:
            old = len(self._rid_of)
            new = max(64, 2 * old)
            for name in ("_written", "_limit"):
                grown = np.zeros(new, np.int64)
                grown[:old] = getattr(self, name)
                setattr(self, name, grown)
            active = np.zeros(new, bool)
            active[:old] = self._active
            self._active = active
            self._rid_of.extend([None] * (new - old))
            self._handle.extend([None] * (new - old))
            self._free_rows.extend(range(new - 1, old - 1, -1))  # pop() hands out low rows first
        return self._free_rows.pop()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity={self.capacity}, requests={self.num_requests}, live={self.live})"


# ------------------------------------------------------------------ contiguous
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
        _require(every == list(range(self.num_extents)), "each extent is free or held by exactly one request")


class VariableExtentAllocator(KVAllocator):
    """Each request reserves prompt + max_new_tokens contiguous slots in one address range.

    Free memory is a sorted list of holes. ``policy`` picks the hole:
    ``"first-fit"`` the lowest-addressed hole big enough, ``"best-fit"`` the
    smallest big enough (lowest address on ties). A freed extent merges with
    free neighbours, so no two holes ever touch. Admission can fail while the
    holes add up to more than the request needs: external fragmentation.
    """

    reserves_growth = True
    POLICIES = ("first-fit", "best-fit")

    def __init__(self, capacity: int, max_model_len: int, policy: str = "first-fit"):
        super().__init__(capacity, max_model_len)
        if policy not in self.POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(self.POLICIES)}")
        if self.capacity < self.max_model_len:
            raise ValueError(
                f"a pool of {self.capacity} slots cannot hold one max_model_len = {self.max_model_len} request"
            )
        self.policy = policy
        self.name = f"variable-extent {policy}"
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
        if self.policy == "first-fit":
            for s in self._hole_starts:
                if self._hole_len[s] >= need:
                    return s
            return None
        fits = [(n, s) for s, n in self._hole_len.items() if n >= need]
        return min(fits)[1] if fits else None

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
        _require(self._hole_starts == sorted(self._hole_len), "hole list is sorted and matches the hole table")
        _require(all(n > 0 for n in self._hole_len.values()), "holes are non-empty")
        pieces = sorted([(s, n, "free") for s, n in self.free_extents()]
                        + [(*self._handle[r], "held") for r in rows.tolist()])
        end, previous = 0, None
        for s, n, kind in pieces:
            _require(s == end, f"extents tile the pool without gap or overlap (at slot {end})")
            _require(not (kind == previous == "free"), f"adjacent holes are merged (at slot {s})")
            end, previous = s + n, kind
        _require(end == self.capacity, "extents cover the whole pool")
        for r in rows.tolist():
            _require(self._handle[r][1] == self._limit[r], "a request's extent holds prompt + max_new_tokens")
        _require(self._free_total == sum(self._hole_len.values()), "free total equals the holes' sum")
        _require(self._reserved_total == sum(self._handle[r][1] for r in rows.tolist()), "reserved total matches")


# ------------------------------------------------------------------ paged
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
        _require(int(n.sum()) == self._blocks_held, "held-block count matches the block table")
        _require(np.array_equal(n, cdiv(self._written[rows], self.block_size)),
                 "each request holds ceil(written / block_size) blocks, no more")
        held = self._table[rows][np.arange(self._table.shape[1]) < n[:, None]]
        every = np.sort(np.concatenate([held, self._free[: self._num_free]]))
        _require(np.array_equal(every, np.arange(self.num_blocks)), "each block is free or held by exactly one request")
        idle = np.ones(self._nblocks.size, bool)
        idle[rows] = False
        _require(not self._nblocks[idle].any(), "rows without a request hold no blocks")


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


# ------------------------------------------------------------------ tail waste
def unused_tail_slots(length, block_size: int):
    """Unwritten slots in the last block of a sequence of ``length`` tokens: (B - length mod B) mod B.

    Works on an int or, vectorised, on an array of lengths.
    """
    B = check_int(block_size, "block_size", 1)
    if isinstance(length, numbers.Integral) and not isinstance(length, (bool, np.bool_)):
        return (-check_int(length, "length", 1)) % B
    arr = np.asarray(length)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"lengths must be integers, got dtype {arr.dtype}")
    if arr.size and arr.min() < 1:
        raise ValueError(f"lengths must be >= 1, got {int(arr.min())}")
    return (-arr) % B


def expected_tail_waste(lengths: Sequence[int], probs: Sequence[float] | None, block_size: int) -> float:
    """E[unused tail slots] = sum over lengths of P(length) * ((B - length mod B) mod B).

    ``probs=None`` weighs every listed length equally (an empirical sample).
    """
    L = np.asarray(lengths)
    if L.ndim != 1 or L.size == 0:
        raise ValueError(f"lengths must be a non-empty 1-D sequence, got shape {L.shape}")
    tails = unused_tail_slots(L, block_size)
    if probs is None:
        return float(tails.mean())
    P = np.asarray(probs, dtype=float)
    if P.shape != L.shape:
        raise ValueError(f"probs must match lengths: {P.shape} vs {L.shape}")
    if not np.isfinite(P).all() or (P < 0).any():
        raise ValueError(f"probabilities must be finite and >= 0, got {P.tolist()}")
    if not math.isclose(P.sum(), 1.0, abs_tol=1e-9):
        raise ValueError(f"probabilities must sum to 1, got {P.sum():.12g}")
    return float(P @ tails)


def uniform_tail_waste(block_size: int) -> float:
    """The expectation when residues mod B are uniform: the mean of 0..B-1 = (B - 1) / 2."""
    return (check_int(block_size, "block_size", 1) - 1) / 2


def over_reservation_waste(used_tokens: int, reserved_tokens: int) -> float:
    """Fraction of a reservation never written: 1 - used / reserved."""
    used = check_int(used_tokens, "used_tokens", 0)
    reserved = check_int(reserved_tokens, "reserved_tokens", 1)
    if used > reserved:
        raise ValueError(f"used_tokens {used} exceeds reserved_tokens {reserved}")
    return 1 - used / reserved


# ------------------------------------------------------------------ workloads
@dataclass(frozen=True)
class Dist:
    """A named token-length distribution: ``constant`` a, ``lognormal`` median a / sigma b, ``uniform`` [a, b]."""

    kind: str
    a: float
    b: float = 0.0

    def __post_init__(self):
        if self.kind not in ("constant", "lognormal", "uniform"):
            raise ValueError(f"unknown distribution {self.kind!r}; choose constant, lognormal or uniform")
        if self.a < 1 or (self.kind == "uniform" and self.b < self.a) or (self.kind == "lognormal" and self.b < 0):
            raise ValueError(f"bad parameters for {self.kind}: a={self.a}, b={self.b}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "constant":
            x = np.full(n, self.a)
        elif self.kind == "lognormal":
            x = rng.lognormal(math.log(self.a), self.b, n)
        else:
            x = rng.integers(int(self.a), int(self.b) + 1, n)
        return np.maximum(np.rint(x), 1).astype(np.int64)

    def __str__(self) -> str:
        if self.kind == "constant":
            return f"constant {self.a:g}"
        if self.kind == "lognormal":
            return f"lognormal(median {self.a:g}, sigma {self.b:g})"
        return f"uniform[{self.a:g}, {self.b:g}]"


@dataclass(frozen=True)
class Component:
    """One kind of request in a mixture: its share, and its prompt and output length laws."""

    label: str
    weight: float
    prompt: Dist
    output: Dist


@dataclass(frozen=True)
class Workload:
    """A mixture of request kinds.

    ``max_new_tokens`` is what every client asks for (the reservation a
    variable-extent allocator must honour); None means each request asks for
    exactly the tokens it will produce. Outputs are clipped to it, prompts to
    ``max_model_len - max_new_tokens``.
    """

    name: str
    components: tuple[Component, ...]
    max_new_tokens: int | None = None

    def describe(self) -> str:
        cap = "= its output length" if self.max_new_tokens is None else f"{self.max_new_tokens}"
        lines = [f"workload {self.name!r}: max_new_tokens {cap}"]
        for c in self.components:
            lines.append(f"  {c.weight:.0%} {c.label}: prompt {c.prompt}, output {c.output}")
        return "\n".join(lines)

    def sample(self, rng: np.random.Generator, n: int, max_model_len: int) -> tuple[np.ndarray, ...]:
        """(prompt_len, output_len, max_new_tokens), n of each."""
        weights = np.array([c.weight for c in self.components], float)
        kind = rng.choice(len(self.components), size=n, p=weights / weights.sum())
        prompt = np.empty(n, np.int64)
        output = np.empty(n, np.int64)
        for i, c in enumerate(self.components):  # vectorised per component
            idx = np.flatnonzero(kind == i)
            prompt[idx] = c.prompt.sample(rng, idx.size)
            output[idx] = c.output.sample(rng, idx.size)
        if self.max_new_tokens is None:
            max_new = output.copy()
        else:
            if self.max_new_tokens >= max_model_len:
                raise ValueError(f"max_new_tokens {self.max_new_tokens} leaves no room for a prompt in {max_model_len}")
            max_new = np.full(n, self.max_new_tokens, np.int64)
            output = np.minimum(output, max_new)
        prompt = np.minimum(prompt, max_model_len - max_new)
        if (prompt < 1).any():
            raise ValueError(f"outputs of up to {int(max_new.max())} tokens leave no room for a prompt in {max_model_len}")
        return prompt, output, max_new


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        # The book's running chat turn: a 512-token prompt and 100 generated tokens, every time.
        Workload("chat", (Component("chat turn", 1.0, Dist("constant", 512), Dist("constant", 100)),)),
        # Mostly short requests and a heavy tail of long ones; clients ask for up to 2,048 tokens.
        Workload(
            "heavy-tailed",
            (
                Component("short", 0.85, Dist("lognormal", 400, 0.8), Dist("lognormal", 120, 0.9)),
                Component("long", 0.15, Dist("lognormal", 3000, 0.7), Dist("lognormal", 500, 0.8)),
            ),
            max_new_tokens=2048,
        ),
        # Chat turns mixed with documents of 8k-30k tokens to summarise.
        Workload(
            "long-context",
            (
                Component("chat", 0.7, Dist("lognormal", 600, 0.6), Dist("lognormal", 150, 0.7)),
                Component("document", 0.3, Dist("uniform", 8192, 30000), Dist("lognormal", 300, 0.5)),
            ),
            max_new_tokens=1024,
        ),
    ]
}


def workload(name: str | Workload) -> Workload:
    """A named workload (``"chat"``, ``"heavy-tailed"``, ``"long-context"``) or a Workload passed through."""
    if isinstance(name, Workload):
        return name
    try:
        return WORKLOADS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}") from None


@dataclass(frozen=True)
class Trace:
    """Requests sorted by arrival step; request ``i`` is row ``i`` of every array."""

    arrival: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    max_new_tokens: np.ndarray
    description: str = ""

    def __post_init__(self):
        for name in ("arrival", "prompt_len", "output_len", "max_new_tokens"):
            arr = np.asarray(getattr(self, name))
            if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
                raise ValueError(f"{name} must be a 1-D array of integers, got {arr.dtype} of shape {arr.shape}")
            object.__setattr__(self, name, arr.astype(np.int64))
        n = len(self.arrival)
        for name in ("prompt_len", "output_len", "max_new_tokens"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, arrival has {n}")
        if n and ((self.prompt_len < 1).any() or (self.output_len < 1).any()):
            raise ValueError("every request needs prompt_len >= 1 and output_len >= 1")
        if n and ((self.output_len > self.max_new_tokens).any() or (np.diff(self.arrival) < 0).any()
                  or self.arrival[0] < 0):
            raise ValueError("outputs must fit max_new_tokens and arrivals must be sorted and >= 0")

    def __len__(self) -> int:
        return len(self.arrival)

    @property
    def final_len(self) -> np.ndarray:
        """Tokens each request holds when it finishes."""
        return self.prompt_len + self.output_len

    def describe(self) -> str:
        return (f"{self.description}\n{len(self)} requests: mean prompt {self.prompt_len.mean():.0f}, "
                f"mean output {self.output_len.mean():.0f}, mean final length {self.final_len.mean():.0f} tokens")


def make_trace(workload_name: str | Workload = "chat", num_requests: int = 1000, *, arrival_rate: float | None = 8.0,
               seed: int = 0, max_model_len: int = 32_768) -> Trace:
    """A seeded trace: Poisson arrivals at ``arrival_rate`` requests per step (None: all at step 0)."""
    w = workload(workload_name)
    n = check_int(num_requests, "num_requests", 1)
    check_int(seed, "seed", 0)
    max_model_len = check_int(max_model_len, "max_model_len", 2)
    if arrival_rate is not None and not (isinstance(arrival_rate, (int, float)) and arrival_rate > 0):
        raise ValueError(f"arrival_rate must be a positive number or None, got {arrival_rate!r}")
    rng = np.random.default_rng(seed)
    prompt, output, max_new = w.sample(rng, n, max_model_len)
    if arrival_rate is None:
        arrival = np.zeros(n, np.int64)
        rate = "all at step 0"
    else:
        arrival = np.floor(np.cumsum(rng.exponential(1 / arrival_rate, n))).astype(np.int64)
        rate = f"Poisson arrivals, {arrival_rate:g} per step"
    desc = f"{w.describe()}\n{rate}; seed {seed}; max_model_len {max_model_len}"
    return Trace(arrival, prompt, output, max_new, desc)


# ------------------------------------------------------------------ the simulator
class _Recorder:
    """Per-step columns, grown by doubling; every row must sum to the pool."""

    COLUMNS = (*PARTS, "running", "waiting")

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.n = 0
        self.data = np.zeros((len(self.COLUMNS), 1024), np.int64)

    def _room(self, k: int) -> None:
        if self.n + k > self.data.shape[1]:
            grown = np.zeros((self.data.shape[0], max(2 * self.data.shape[1], self.n + k)), np.int64)
            grown[:, : self.n] = self.data[:, : self.n]
            self.data = grown

    def step(self, occ: Occupancy, running: int, waiting: int) -> None:
        _require(occ.total == self.capacity, f"parts sum to the pool: {occ} vs {self.capacity}")
        self._room(1)
        self.data[:, self.n] = (*occ.as_dict().values(), running, waiting)
        self.n += 1

    def span(self, occ: Occupancy, running: int, waiting: np.ndarray) -> None:
        """Quiet steps after ``occ``: each of ``running`` requests writes a token per step, nothing else moves."""
        k = len(waiting)
        self._room(k)
        j = np.arange(1, k + 1) * running
        cols = self.data[:, self.n : self.n + k]
        cols[0] = occ.live + j  # live grows...
        cols[1] = occ.over_reserved - j  # ...into slots reserved for it
        cols[2], cols[3], cols[4] = occ.external, occ.internal, occ.free
        cols[5], cols[6] = running, waiting
        _require(bool((cols[1] >= 0).all() and (cols[:5].sum(axis=0) == self.capacity).all()),
                 "parts sum to the pool over a quiet span")
        self.n += k


@dataclass
class SimResult:
    """What :func:`simulate` measured: the five parts and the queue at every step."""

    allocator: str
    capacity: int
    columns: np.ndarray  # (7, steps): live, over_reserved, external, internal, free, running, waiting
    finished: int
    preemptions: int
    final_len: np.ndarray  # tokens each request held when it finished (0: not finished)
    events: list[tuple[int, str, int]] = field(default_factory=list)  # (step, "admit"/"preempt"/"finish", request)

    def column(self, name: str) -> np.ndarray:
        """One recorded column by name (see ``_Recorder.COLUMNS``)."""
        return self.columns[_Recorder.COLUMNS.index(name)]

    live = property(lambda self: self.column("live"))
    over_reserved = property(lambda self: self.column("over_reserved"))
    external = property(lambda self: self.column("external"))
    internal = property(lambda self: self.column("internal"))
    free = property(lambda self: self.column("free"))
    running = property(lambda self: self.column("running"))
    waiting = property(lambda self: self.column("waiting"))

    @property
    def steps(self) -> int:
        return self.columns.shape[1]

    def mean_fractions(self) -> dict[str, float]:
        """Each part's share of the pool, averaged over the steps."""
        return {p: float(getattr(self, p).mean() / self.capacity) for p in PARTS}

    def summary(self) -> str:
        f = self.mean_fractions()
        parts = ", ".join(f"{p} {100 * v:.1f}%" for p, v in f.items())
        return (f"{self.allocator}: {self.steps} steps, {self.finished} finished, mean running "
                f"{self.running.mean():.1f} (peak {int(self.running.max())}), preemptions {self.preemptions}; {parts}")


def simulate(allocator: KVAllocator, trace: Trace, *, max_steps: int | None = None,
             log_events: bool = False) -> SimResult:
    """Replay ``trace`` on ``allocator`` until every request finishes (or ``max_steps``).

    One step: (1) every running request decodes a token -- when a paged pool
    has no block for that, the newest running request is preempted (freed and
    put back at the head of the queue, to be recomputed later, as vLLM does);
    (2) requests that wrote their last token finish and free their memory;
    (3) arrivals join the queue; (4) the queue is admitted first come first
    served until the head does not fit; (5) the five parts are recorded.
    ``log_events`` keeps every admission, preemption and finish in ``events``.
    """
    if allocator.num_requests:
        raise ValueError(f"simulate needs an empty allocator; this one holds {allocator.num_requests} requests")
    if max_steps is not None:
        check_int(max_steps, "max_steps", 1)
    n = len(trace)
    if n == 0:
        raise ValueError("the trace holds no requests")
    too_long = trace.prompt_len + trace.max_new_tokens > allocator.max_model_len
    if too_long.any():
        i = int(too_long.argmax())
        raise ValueError(f"request {i} needs {int(trace.prompt_len[i] + trace.max_new_tokens[i])} tokens, "
                         f"more than max_model_len = {allocator.max_model_len}")
    arrival = trace.arrival
    prompt, output, max_new = (a.tolist() for a in (trace.prompt_len, trace.output_len, trace.max_new_tokens))
    final_len = np.zeros(n, np.int64)
    events: list[tuple[int, str, int]] = []
    generated = [0] * n  # tokens decoded before the latest admission (kept across a preemption)
    admitted_at = [0] * n
    running: dict[int, None] = {}  # admission order: the last is the newest
    finishing: list[tuple[int, int]] = []  # heap of (finish step, request); stale entries are skipped
    waiting: deque[int] = deque()
    rec = _Recorder(allocator.capacity)
    next_arrival = finished = preemptions = t = 0

    def finish_step(rid: int) -> int:
        return admitted_at[rid] + output[rid] - generated[rid]

    while finished < n and (max_steps is None or t < max_steps):
        # 1. decode one token each; preempt the newest while the pool cannot serve the growth
        if running:
            while not allocator.grow_all():
                victim, _ = running.popitem()
                generated[victim] = allocator.written(victim) - prompt[victim]  # recomputed on return
                allocator.finish(victim)
                if log_events:
                    events.append((t, "preempt", victim))
                waiting.appendleft(victim)
                preemptions += 1
        # 2. finish
        while finishing and finishing[0][0] <= t:
            step, rid = heapq.heappop(finishing)
            if rid in running and finish_step(rid) == step:
                final_len[rid] = allocator.written(rid)
                allocator.finish(rid)
                if log_events:
                    events.append((t, "finish", rid))
                del running[rid]
                finished += 1
        # 3. arrive
        while next_arrival < n and arrival[next_arrival] <= t:
            waiting.append(next_arrival)
            next_arrival += 1
        # 4. admit, first come first served: the head blocks everyone behind it
        head = None
        while waiting:
            rid = waiting[0]
            head = (prompt[rid] + generated[rid], max_new[rid] - generated[rid])
            if not allocator.admit(rid, *head):
                break
            waiting.popleft()
            head = None
            running[rid] = None
            admitted_at[rid] = t
            heapq.heappush(finishing, (finish_step(rid), rid))
            if log_events:
                events.append((t, "admit", rid))
        # 5. record
        occ = allocator.occupancy(head)
        rec.step(occ, len(running), len(waiting))
        t += 1
        # Contiguous allocators change state only at a finish or an admission:
        # jump over the quiet steps in between, recording them arithmetically.
        if allocator.reserves_growth and running:
            nxt = finishing[0][0]  # a stale entry only makes the jump shorter
            if not waiting and next_arrival < n:
                nxt = min(nxt, int(arrival[next_arrival]))
            if max_steps is not None:
                nxt = min(nxt, max_steps)
            if nxt > t:
                steps = np.arange(t, nxt)
                arrived = np.searchsorted(arrival, steps, side="right") - next_arrival
                allocator.grow_all(nxt - t)
                rec.span(occ, len(running), len(waiting) + np.maximum(arrived, 0))
                t = nxt
    return SimResult(allocator.name, allocator.capacity, rec.data[:, : rec.n].copy(), finished, preemptions, final_len,
                     events)


# ---------------------------------------------------------------------------
# Plotting helpers for chapter 2. Each draws for the book's 688-px column at
# the inline backend's 100 dpi (at most 6.8 inches wide) and returns the
# figure; matplotlib is imported only when one is called.

FIG_WIDTH_IN = 6.8

#: Colours and legend labels of the five parts, in ``PARTS`` order.
PART_COLORS = {"live": "#2c7fb8", "over_reserved": "#f0ad4e", "external": "#d62728",
               "internal": "#9467bd", "free": "#d9d9d9"}
PART_LABELS = {"live": "live KV", "over_reserved": "reserved, unused (over-reservation)",
               "external": "free, unusable (external)", "internal": "unwritten tail (internal)",
               "free": "free"}
_HELD, _HOLE = "#2c7fb8", "#f2f2f2"


def draw_extents(alloc: "VariableExtentAllocator", ax, title: str) -> None:
    """One horizontal bar per extent of a contiguous allocator: requests in
    blue, labelled ``id: size``; holes hatched, labelled above."""
    for rid, (start, n) in alloc.allocated_extents().items():
        ax.barh(0, n, left=start, color=_HELD, edgecolor="white")
        ax.text(start + n / 2, 0, f"{rid}: {n}", ha="center", va="center", color="white", fontsize=9)
    for start, n in alloc.free_extents():
        ax.barh(0, n, left=start, color=_HOLE, edgecolor="grey", hatch="//")
        ax.text(start + n / 2, 0.5, f"hole {n}", ha="center", va="bottom", fontsize=8)
    ax.set_xlim(0, alloc.capacity)
    ax.set_ylim(-0.6, 1.1)
    ax.set_yticks([])
    ax.set_title(title, fontsize=10, loc="left")


def plot_tail_residues(traces: dict[str, "Trace"], block_size: int = 16):
    """Side by side, for each named trace: the share of final lengths leaving
    0 .. B-1 unused slots in the last block, against the uniform 1/B, with the
    trace's expected tail waste and (B - 1)/2 marked."""
    import matplotlib.pyplot as plt

    B = check_int(block_size, "block_size", 1)
    fig, axes = plt.subplots(1, len(traces), figsize=(FIG_WIDTH_IN, 3.0), sharey=True, squeeze=False)
    for ax, (name, trace) in zip(axes[0], traces.items()):
        tails = unused_tail_slots(trace.final_len, B)
        share = np.bincount(tails, minlength=B) / len(tails)
        expected = expected_tail_waste(trace.final_len, None, B)
        ax.bar(np.arange(B), share, color="#9467bd")
        ax.axhline(1 / B, color="grey", ls=":", label=f"uniform: 1/{B} each")
        ax.axvline(expected, color="black", label=f"expected: {expected:.2f}")
        ax.axvline(uniform_tail_waste(B), color="#d62728", ls="--",
                   label=f"(B - 1)/2 = {uniform_tail_waste(B):.1f}")
        ax.set_title(f"{name}\n{len(trace):,} final lengths", fontsize=9)
        ax.set_xticks(range(0, B, max(1, B // 8)))
        ax.set_xlabel(f"unused slots in the last block (B = {B})", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("share of requests", fontsize=8)
    fig.tight_layout()
    return fig


def run_all(trace: "Trace", capacity: int, max_model_len: int, block_size: int = 16,
            steps: int | None = 1500) -> list["SimResult"]:
    """``simulate`` the trace on one fresh allocator of every kind in
    ``ALLOCATOR_KINDS``, all with the same pool."""
    return [simulate(make_allocator(k, capacity, max_model_len, block_size), trace, max_steps=steps)
            for k in ALLOCATOR_KINDS]


def plot_composition(results: Sequence["SimResult"], title: str):
    """The five parts of the pool over time, one stacked panel per allocator,
    in a grid of three columns; the legend takes the last free cell."""
    import matplotlib.pyplot as plt

    cols = 3
    rows = cdiv(len(results) + 1, cols)
    fig, axes = plt.subplots(rows, cols, figsize=(FIG_WIDTH_IN, 2.3 * rows + 0.4), sharey=True)
    axes = np.atleast_1d(axes).ravel()
    for i, (ax, r) in enumerate(zip(axes, results)):
        parts = [100 * getattr(r, p) / r.capacity for p in PARTS]
        ax.stackplot(np.arange(r.steps), *parts, colors=[PART_COLORS[p] for p in PARTS],
                     labels=[PART_LABELS[p] for p in PARTS])
        ax.set_title(r.allocator, fontsize=9)
        ax.set_xlim(0, r.steps)
        ax.set_ylim(0, 100)
        ax.tick_params(labelsize=8)
        if i % cols == 0:
            ax.set_ylabel("% of the KV pool", fontsize=8)
        if i + cols >= len(results):
            ax.set_xlabel("step", fontsize=8)
    handles, labels = axes[0].get_legend_handles_labels()
    legend_ax = axes[len(results)]
    legend_ax.axis("off")
    legend_ax.legend(handles[::-1], labels[::-1], loc="center", fontsize=7.5, frameon=False)
    for ax in axes[len(results) + 1:]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def composition_table(results: Sequence["SimResult"]) -> str:
    """Each allocator's mean parts (% of the pool), mean running requests,
    finished requests and preemptions, as a fixed-width table (78 columns)."""
    head = (f"{'allocator':26s}{'live':>6s}{'over':>6s}{'ext':>6s}{'int':>6s}{'free':>6s}"
            f"{'run':>6s}{'done':>6s}{'preempt':>9s}")
    lines = [head]
    for r in results:
        f = r.mean_fractions()
        lines.append(f"{r.allocator:26s}" + "".join(f"{100 * f[p]:6.1f}" for p in PARTS)
                     + f"{r.running.mean():6.0f}{r.finished:6d}{r.preemptions:9d}")
    return "\n".join(lines)


def steady_running(r: "SimResult") -> float:
    """Mean running requests over the second half of a run (past the ramp-up)."""
    return float(r.running[r.steps // 2:].mean())


def plot_concurrency(chat_results: Sequence["SimResult"], concurrency: dict[str, Sequence[float]],
                     levels: Sequence[tuple[float, str]] = ()):
    """Two panels, one above the other: running requests per step on the chat
    trace (``levels`` are (value, label) guide lines), and the steady mean per
    allocator and workload on a log scale."""
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(FIG_WIDTH_IN, 6.0))
    for r in chat_results:
        ax0.plot(r.running, label=r.allocator, lw=1)
    for level, text in levels:
        ax0.axhline(level, color="grey", ls=":", lw=1)
        ax0.text(5, level * 1.02, text, fontsize=8, color="grey")
    ax0.set_xlabel("step", fontsize=8)
    ax0.set_ylabel("running requests", fontsize=8)
    ax0.set_title("chat turns (512 + 100): running requests per step", fontsize=9)
    ax0.tick_params(labelsize=8)
    ax0.legend(fontsize=7, loc="center right")
    x = np.arange(len(chat_results))
    width = 0.8 / max(1, len(concurrency))
    for i, (name, values) in enumerate(concurrency.items()):
        ax1.bar(x + (i - (len(concurrency) - 1) / 2) * width, values, width, label=name)
    ax1.set_xticks(x, [r.allocator.replace(" ", "\n", 1) for r in chat_results], fontsize=7.5)
    ax1.set_yscale("log")
    ax1.set_yticks([10, 30, 100, 300, 1000], ["10", "30", "100", "300", "1000"])
    ax1.minorticks_off()
    ax1.tick_params(axis="y", labelsize=8)
    ax1.set_ylabel("mean running requests (log)", fontsize=8)
    ax1.set_title("admitted concurrency per allocator and workload", fontsize=9)
    ax1.legend(fontsize=7.5)
    fig.tight_layout()
    return fig


def plot_block_size_sweep(sizes: Sequence[int], measured: Sequence[float], bound: Sequence[float],
                          uniform_estimate: Sequence[float], trace_name: str = "heavy-tailed"):
    """Internal fragmentation (% of the pool) against block size: the
    simulator's measurement, the B - 1 bound and the (B - 1)/2 estimate."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, 3.6))
    ax.plot(sizes, bound, "--", color="#d62728", label="bound: B - 1 slots per running request")
    ax.plot(sizes, uniform_estimate, ":", color="grey", label="(B - 1)/2 slots per running request")
    ax.plot(sizes, measured, "o-", color="#9467bd", label="measured by the simulator")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(sizes), [str(s) for s in sizes])
    ax.minorticks_off()
    ax.set_xlabel("block_size (tokens)", fontsize=9)
    ax.set_ylabel("internal fragmentation, % of pool", fontsize=9)
    ax.set_title(f"Internal waste against block size ({trace_name} trace)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def composition_html(results: Sequence["SimResult"], title: str) -> str:
    """The composition panels as an inline PNG plus the table as text: a
    static rendering that needs no kernel (no scripts, no network)."""
    import base64
    import html
    import io

    import matplotlib.pyplot as plt

    fig = plot_composition(results, title)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    data = base64.b64encode(png.getvalue()).decode()
    return (f"<img style='max-width:100%' alt='{html.escape(title)}' "
            f"src='data:image/png;base64,{data}'/>"
            f"<pre style='font-size:11px'>{html.escape(composition_table(results))}</pre>")


try:  # ipywidgets is optional: the static helpers above work without it
    import ipywidgets as _widgets
except ImportError:  # pragma: no cover
    _widgets = None


if _widgets is None:  # pragma: no cover

    class FragmentationExplorer:  # type: ignore[no-redef]
        """Stand-in that explains what is missing."""

        def __init__(self, *args, **kwargs):
            raise ImportError("FragmentationExplorer needs ipywidgets (pip install ipywidgets); "
                              "run_all, plot_composition and composition_html work without it")

else:

    class FragmentationExplorer(_widgets.VBox):
        """Controls (workload, block size, arrival rate) in front of
        :func:`run_all` and :func:`plot_composition`; the panels and the table
        redraw on every change. Its rich display carries the current run as
        static HTML, so a page without a kernel shows it."""

        def __init__(self, capacity: int, max_model_len: int, workload: str = "heavy-tailed",
                     block_size: int = 16, arrival_rate: float = 10.0, num_requests: int = 4000,
                     steps: int = 1500):
            self.capacity, self.max_model_len = capacity, max_model_len
            self.num_requests, self.steps = num_requests, steps
            kw = {"style": {"description_width": "90px"}, "layout": _widgets.Layout(width="225px")}
            self.workload = _widgets.Dropdown(options=list(WORKLOADS), value=workload,
                                              description="workload", **kw)
            self.block = _widgets.Dropdown(options=[1, 4, 16, 64, 256], value=block_size,
                                           description="block_size", **kw)
            self.rate = _widgets.FloatLogSlider(value=arrival_rate, base=10, min=-0.5, max=1.5,
                                                description="arrivals/step", **kw)
            self.view = _widgets.HTML()
            for control in (self.workload, self.block, self.rate):
                control.observe(self.rerun, names="value")
            super().__init__(children=[_widgets.HBox([self.workload, self.block, self.rate]),
                                       self.view])
            self.rerun()

        def title(self) -> str:
            return (f"{self.workload.value}, block_size {self.block.value}, "
                    f"{self.rate.value:.2g} arrivals/step")

        def rerun(self, change=None) -> None:
            trace = make_trace(self.workload.value, self.num_requests,
                               arrival_rate=self.rate.value, seed=0)
            results = run_all(trace, self.capacity, self.max_model_len, self.block.value, self.steps)
            self.view.value = composition_html(results, self.title())

        def _repr_mimebundle_(self, **kwargs):
            bundle = super()._repr_mimebundle_(**kwargs)
            data = bundle[0] if isinstance(bundle, tuple) else bundle
            data["text/html"] = self.view.value  # the current run, for a page without a kernel
            return bundle
