"""The interface every allocator of chapter 2 shares, and where each slot of a pool is.

Memory is counted in **token slots**: one slot holds one token's K and V across
all layers (``budget.kv_bytes_per_token``: 128 KiB for Llama-3-8B in bf16). An
allocator ``admit``s a request (its prompt is written at once), ``grow``s it by
a token, ``finish``es it, reports its ``occupancy`` and ``check()``s its own
invariants; ``allocators.py`` holds the four designs.

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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Hashable

import numpy as np

from ..common import InvariantError, check_int

__all__ = ["PARTS", "Occupancy", "KVAllocator", "check_invariant"]

#: The five states of a slot, in the order the figures stack them.
PARTS = ("live", "over_reserved", "external", "internal", "free")


def check_invariant(condition: bool, invariant: str) -> None:
    """``check()``'s one verb: raise ``InvariantError`` naming the broken invariant (survives ``python -O``)."""
    if not condition:
        raise InvariantError(f"invariant broken: {invariant}")


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


class KVAllocator(ABC):
    """What every allocator of ``allocators.py`` does; subclasses decide where the slots come from.

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
        check_invariant(occ.total == self.capacity, f"parts sum to the pool: {occ} sums to {occ.total}, pool is {self.capacity}")
        return occ

    def check(self) -> None:
        """Verify every invariant; raise InvariantError naming the first broken one."""
        rows = np.flatnonzero(self._active)
        check_invariant(len(rows) == len(self._row_of), "one active row per admitted request")
        for rid, row in self._row_of.items():
            check_invariant(self._active[row] and self._rid_of[row] == rid, f"row {row} belongs to request {rid!r}")
            check_invariant(1 <= self._written[row] <= self._limit[row] <= self.max_model_len,
                     f"1 <= written <= prompt + max_new_tokens <= max_model_len for {rid!r}")
        check_invariant(set(self._free_rows).isdisjoint(rows.tolist()), "a free row is not active")
        check_invariant(len(self._free_rows) + len(rows) == len(self._rid_of), "rows are free or active")
        check_invariant(self._total_written == int(self._written[rows].sum()), "live total equals the sum of written tokens")
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
