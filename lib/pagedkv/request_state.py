"""Request rows kept for life: the worker's row bookkeeping under Model Runner V2.

Every per-request tensor on the worker (the block tables, token ids, sampling
parameters) has ``max_num_reqs`` rows. A request takes a free row when it
arrives and keeps it until it finishes, is aborted or is preempted; then the
row goes back to the free pool. Nothing else ever moves: a request that sits
a step out keeps its row, and one that leaves leaves a hole that the next
arrival may fill. A step's batch is a list of rows, ``idx_mapping``, built
fresh each step from ``req_id_to_index``.

vLLM 0.33.0 keeps exactly this in ``RequestState`` (``req_id_to_index``,
``v1/worker/gpu/states.py:28-30``): ``add_request`` pops the *last* free row
(``free_indices.pop()``, ``v1/worker/gpu/states.py:99-102``), so the first
request of a fresh worker gets row ``max_num_reqs - 1``; ``remove_request``
(``v1/worker/gpu/states.py:127-134``) appends the row back and returns it, or
None for an unknown request. Its ``RequestState`` also holds each
row's tokens and lengths; ours holds the rows alone.

Invariants (``check()``):

- ``req_id_to_index`` and ``index_to_req_id`` are inverse maps;
- a row is never handed out twice: no row is both held and free, and no row
  appears twice in the free pool;
- held and free rows together are exactly ``0..max_num_reqs-1``.
"""

from __future__ import annotations

from collections import Counter

from .common import check_int, require

__all__ = ["RequestState"]


class RequestState:
    """Which request holds which row, and the pool of free rows.

    Args:
        max_num_reqs: rows of every per-request tensor (vLLM's ``max_num_seqs``).
    """

    def __init__(self, max_num_reqs: int):
        self.max_num_reqs = check_int(max_num_reqs, "max_num_reqs", 1)
        self.req_id_to_index: dict[str, int] = {}
        self.index_to_req_id: dict[int, str] = {}
        self.free_indices: list[int] = list(range(self.max_num_reqs))

    @property
    def num_reqs(self) -> int:
        """Requests holding a row."""
        return len(self.req_id_to_index)

    def add_request(self, req_id: str) -> int:
        """Give ``req_id`` the last free row and return it.

        Refused, changing nothing: a ``req_id`` that is not a string
        (``TypeError``), one that already holds a row (``ValueError``: vLLM's
        model runner first removes a request it is re-adding), or no free row
        left (``ValueError``: the scheduler never runs more than
        ``max_num_reqs`` requests).
        """
        if not isinstance(req_id, str):
            raise TypeError(f"req_id must be a str, got {type(req_id).__name__} {req_id!r}")
        if req_id in self.req_id_to_index:
            raise ValueError(f"request {req_id!r} already holds row {self.req_id_to_index[req_id]}")
        if not self.free_indices:
            raise ValueError(f"no free row for request {req_id!r}: all {self.max_num_reqs} rows are held")
        req_idx = self.free_indices.pop()
        self.req_id_to_index[req_id] = req_idx
        self.index_to_req_id[req_idx] = req_id
        return req_idx

    def remove_request(self, req_id: str) -> int | None:
        """Free ``req_id``'s row and return it; None if ``req_id`` holds no row (as vLLM does)."""
        req_idx = self.req_id_to_index.pop(req_id, None)
        if req_idx is None:
            return None
        del self.index_to_req_id[req_idx]
        self.free_indices.append(req_idx)
        return req_idx

    def is_held(self, req_idx: int) -> bool:
        """Whether a request holds row ``req_idx``."""
        return req_idx in self.index_to_req_id

    def idx_mapping(self, req_ids) -> list[int]:
        """The rows of ``req_ids``, in order: a step's ``idx_mapping``; ``ValueError`` naming an unknown request."""
        rows = []
        for rid in req_ids:
            row = self.req_id_to_index.get(rid)
            if row is None:
                raise ValueError(f"request {rid!r} holds no row")
            rows.append(row)
        return rows

    def check(self) -> None:
        """Verify the invariants in the module docstring; ``InvariantError`` naming the broken one."""
        require(len(self.req_id_to_index) == len(self.index_to_req_id)
                and all(self.index_to_req_id.get(i) == r for r, i in self.req_id_to_index.items()),
                "row maps are inverse", lambda: f"{self.req_id_to_index} vs {self.index_to_req_id}")
        twice = [r for r, c in Counter(self.free_indices).items() if c > 1]
        require(not twice, "a row is never handed out twice",
                lambda: f"row {twice[0]} is in the free pool twice")
        both = sorted(set(self.free_indices) & set(self.index_to_req_id))
        require(not both, "a row is never handed out twice",
                lambda: f"row {both[0]} is free and held by {self.index_to_req_id[both[0]]!r}")
        every = sorted([*self.free_indices, *self.index_to_req_id])
        require(every == list(range(self.max_num_reqs)), "held and free rows are all the rows",
                lambda: f"rows {every}, expected 0..{self.max_num_reqs - 1}")

    def __repr__(self) -> str:
        return f"RequestState({self.num_reqs} of {self.max_num_reqs} rows held)"
