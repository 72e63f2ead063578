"""The waste simulator of chapter 2: replay a request trace on one allocator, step by step.

One step: (1) every running request decodes a token -- when a paged pool has
no block for that, the newest running request is preempted (freed and put
back at the head of the queue, to be recomputed later, as vLLM does); (2)
requests that wrote their last token finish and free their memory; (3)
arrivals join the queue; (4) the queue is admitted first come first served
until the head does not fit; (5) the five parts of the pool
(``kv_allocator.PARTS``) are recorded, checked to sum to the pool.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..common import check_int
from .allocators import ALLOCATOR_KINDS, make_allocator
from .kv_allocator import PARTS, KVAllocator, Occupancy, check_invariant
from .workloads import Trace

__all__ = ["WasteSimResult", "simulate", "run_all", "steady_running"]


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
        check_invariant(occ.total == self.capacity, f"parts sum to the pool: {occ} vs {self.capacity}")
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
        check_invariant(bool((cols[1] >= 0).all() and (cols[:5].sum(axis=0) == self.capacity).all()),
                 "parts sum to the pool over a quiet span")
        self.n += k


@dataclass
class WasteSimResult:
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


def _check_fits(allocator: KVAllocator, trace: Trace, max_steps: int | None) -> None:
    """Refuse a busy allocator, an empty trace, or a request longer than ``max_model_len``."""
    if allocator.num_requests:
        raise ValueError(f"simulate needs an empty allocator; this one holds {allocator.num_requests} requests")
    if max_steps is not None:
        check_int(max_steps, "max_steps", 1)
    if len(trace) == 0:
        raise ValueError("the trace holds no requests")
    too_long = trace.prompt_len + trace.max_new_tokens > allocator.max_model_len
    if too_long.any():
        i = int(too_long.argmax())
        raise ValueError(f"request {i} needs {int(trace.prompt_len[i] + trace.max_new_tokens[i])} tokens, "
                         f"more than max_model_len = {allocator.max_model_len}")


class _Replay:
    """The state of one ``simulate`` run, one method per phase of a step."""

    def __init__(self, allocator: KVAllocator, trace: Trace, log_events: bool) -> None:
        n = len(trace)
        self.allocator, self.n, self.log_events = allocator, n, log_events
        self.arrival = trace.arrival
        self.prompt, self.output, self.max_new = (
            a.tolist() for a in (trace.prompt_len, trace.output_len, trace.max_new_tokens))
        self.final_len = np.zeros(n, np.int64)
        self.events: list[tuple[int, str, int]] = []
        self.generated = [0] * n  # tokens decoded before the latest admission (kept across a preemption)
        self.admitted_at = [0] * n
        self.running: dict[int, None] = {}  # admission order: the last is the newest
        self.finishing: list[tuple[int, int]] = []  # heap of (finish step, request); stale entries are skipped
        self.waiting: deque[int] = deque()
        self.rec = _Recorder(allocator.capacity)
        self.next_arrival = self.finished = self.preemptions = self.t = 0

    def _log(self, kind: str, rid: int) -> None:
        if self.log_events:
            self.events.append((self.t, kind, rid))

    def _finish_step(self, rid: int) -> int:
        return self.admitted_at[rid] + self.output[rid] - self.generated[rid]

    def decode(self) -> None:
        """Every running request writes a token; preempt the newest while the pool cannot serve that."""
        alloc = self.allocator
        while self.running and not alloc.grow_all():
            victim, _ = self.running.popitem()
            self.generated[victim] = alloc.written(victim) - self.prompt[victim]  # recomputed on return
            alloc.finish(victim)
            self._log("preempt", victim)
            self.waiting.appendleft(victim)
            self.preemptions += 1

    def finish(self) -> None:
        """Free the requests that wrote their last token by now."""
        while self.finishing and self.finishing[0][0] <= self.t:
            step, rid = heapq.heappop(self.finishing)
            if rid in self.running and self._finish_step(rid) == step:
                self.final_len[rid] = self.allocator.written(rid)
                self.allocator.finish(rid)
                self._log("finish", rid)
                del self.running[rid]
                self.finished += 1

    def arrive(self) -> None:
        while self.next_arrival < self.n and self.arrival[self.next_arrival] <= self.t:
            self.waiting.append(self.next_arrival)
            self.next_arrival += 1

    def admit(self) -> tuple[int, int] | None:
        """First come first served: the head blocks everyone behind it. Returns the refused head's need."""
        while self.waiting:
            rid = self.waiting[0]
            head = (self.prompt[rid] + self.generated[rid], self.max_new[rid] - self.generated[rid])
            if not self.allocator.admit(rid, *head):
                return head
            self.waiting.popleft()
            self.running[rid] = None
            self.admitted_at[rid] = self.t
            heapq.heappush(self.finishing, (self._finish_step(rid), rid))
            self._log("admit", rid)
        return None

    def skip_quiet_steps(self, occ: Occupancy, max_steps: int | None) -> None:
        """Contiguous allocators change state only at a finish or an admission: jump over the
        quiet steps in between, recording them arithmetically."""
        if not (self.allocator.reserves_growth and self.running):
            return
        nxt = self.finishing[0][0]  # a stale entry only makes the jump shorter
        if not self.waiting and self.next_arrival < self.n:
            nxt = min(nxt, int(self.arrival[self.next_arrival]))
        if max_steps is not None:
            nxt = min(nxt, max_steps)
        if nxt > self.t:
            arrived = np.searchsorted(self.arrival, np.arange(self.t, nxt), side="right") - self.next_arrival
            self.allocator.grow_all(nxt - self.t)
            self.rec.span(occ, len(self.running), len(self.waiting) + np.maximum(arrived, 0))
            self.t = nxt


def simulate(allocator: KVAllocator, trace: Trace, *, max_steps: int | None = None,
             log_events: bool = False) -> WasteSimResult:
    """Replay ``trace`` on ``allocator`` until every request finishes (or ``max_steps``).

    The steps are the module's (1)-(5). ``log_events`` keeps every admission,
    preemption and finish in ``events``.
    """
    _check_fits(allocator, trace, max_steps)
    run = _Replay(allocator, trace, log_events)
    while run.finished < run.n and (max_steps is None or run.t < max_steps):
        run.decode()
        run.finish()
        run.arrive()
        head = run.admit()
        occ = allocator.occupancy(head)
        run.rec.step(occ, len(run.running), len(run.waiting))
        run.t += 1
        run.skip_quiet_steps(occ, max_steps)
    return WasteSimResult(allocator.name, allocator.capacity, run.rec.data[:, : run.rec.n].copy(), run.finished,
                          run.preemptions, run.final_len, run.events)


def run_all(trace: Trace, capacity: int, max_model_len: int, block_size: int = 16,
            steps: int | None = 1500) -> list[WasteSimResult]:
    """``simulate`` the trace on one fresh allocator of every kind in
    ``ALLOCATOR_KINDS``, all with the same pool."""
    return [simulate(make_allocator(k, capacity, max_model_len, block_size), trace, max_steps=steps)
            for k in ALLOCATOR_KINDS]


def steady_running(r: WasteSimResult) -> float:
    """Mean running requests over the second half of a run (past the ramp-up)."""
    return float(r.running[r.steps // 2:].mean())
