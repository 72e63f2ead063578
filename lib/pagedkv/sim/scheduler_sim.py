"""A small admission and cleanup scheduler on the reference allocator ``PagedKV`` (chapter 6).

:class:`SchedulerSim` runs a trace of requests on ``paged_kv.PagedKV`` with
two safety mechanisms that can be turned off to see what each protects
against: conservative admission credits, and cleanup delays that return
credits only when pages are really free. ``demo_scheduler`` runs the book's
small trace under each policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from ..common import InvariantError, cdiv, check_int
from .paged_kv import PagedKV, check_id

__all__ = ["SimRequest", "SchedulerSimResult", "SchedulerSim", "demo_scheduler"]


@dataclass(frozen=True)
class SimRequest:
    """One request of a trace: it arrives at ``arrival`` with ``prompt_len`` tokens and decodes ``max_new_tokens``."""

    request_id: str
    prompt_len: int
    max_new_tokens: int
    arrival: int = 0

    def __post_init__(self):
        check_id(self.request_id, "request_id")
        check_int(self.prompt_len, "prompt_len", 1)
        check_int(self.max_new_tokens, "max_new_tokens", 1)
        if isinstance(self.arrival, bool) or not isinstance(self.arrival, int) or self.arrival < 0:
            raise ValueError(f"arrival must be a non-negative int, got {self.arrival!r}")


@dataclass
class SchedulerSimResult:
    """What a run did: when each request finished, and every allocation that failed."""

    steps: int
    finished: dict[str, int] = field(default_factory=dict)   # request -> step it finished
    out_of_memory: list[tuple[int, str]] = field(default_factory=list)  # (step, request): allocation failed, request preempted
    recomputed_tokens: int = 0  # tokens written by preempted requests, thrown away and computed again
    peak_pages: int = 0


class SchedulerSim:
    """A step-by-step scheduler on :class:`PagedKV` with private pages (no prefix sharing).

    Each step: complete cleanup transfers whose delay has passed; admit waiting
    requests in arrival order; prefill the newly admitted; decode one token for
    every running request; retire the finished.

    ``credits`` -- conservative admission. Admitting a request reserves
    ``cdiv(prompt_len + max_new_tokens, block_size)`` pages of credit, the most it
    can ever hold, and a request is admitted only when that many credits are
    unreserved. A running request then never meets an empty heap. Without
    credits, a request is admitted when its prompt fits in the free pages now,
    and decode may run out later (an out-of-memory event: the request is
    preempted, its pages freed and its work recomputed from the start).

    ``cleanup_delay`` -- a terminal request's pages may still be read for this
    many steps (a KV transfer to another instance, a final stream). The model
    pins them with a transfer handle, releases the request, and unpins after the
    delay. ``credits_at_free`` returns the request's credits only then, when the
    pages are really free; returning them at termination lets admission hand out
    pages that are still pinned.

    Its reservations have no shared-prefix discount: every request is charged
    for all of its pages.
    """

    def __init__(self, capacity: int, block_size: int, *, credits: bool = True,
                 cleanup_delay: int = 0, credits_at_free: bool = True, max_steps: int = 10_000):
        if isinstance(cleanup_delay, bool) or not isinstance(cleanup_delay, int) or cleanup_delay < 0:
            raise ValueError(f"cleanup_delay must be a non-negative int, got {cleanup_delay!r}")
        self.capacity = check_int(capacity, "capacity", 1)
        self.block_size = check_int(block_size, "block_size", 1)
        self.pool = PagedKV(capacity, block_size)  # replaced by a fresh pool at each run()
        self.credits = credits
        self.cleanup_delay = cleanup_delay
        self.credits_at_free = credits_at_free
        self.max_steps = check_int(max_steps, "max_steps", 1)

    def _need(self, r: SimRequest) -> int:
        return cdiv(r.prompt_len + r.max_new_tokens, self.block_size)

    def _validated(self, trace: Iterable[SimRequest]) -> list[SimRequest]:
        """``trace`` as a list sorted by arrival, after checking its type, ids and sizes."""
        if isinstance(trace, (str, bytes, SimRequest)):
            raise TypeError(f"trace must be an iterable of SimRequest, got {type(trace).__name__} {trace!r}")
        try:
            trace = list(trace)
        except TypeError:
            raise TypeError(f"trace must be an iterable of SimRequest, got {type(trace).__name__} {trace!r}") from None
        for i, r in enumerate(trace):
            if not isinstance(r, SimRequest):
                raise TypeError(f"trace[{i}] must be a SimRequest, got {type(r).__name__} {r!r}")
        trace = sorted(trace, key=lambda r: r.arrival)  # stable: ties keep trace order
        ids = [r.request_id for r in trace]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate request ids in trace: {sorted({i for i in ids if ids.count(i) > 1})}")
        for r in trace:
            if self._need(r) > self.capacity:
                raise ValueError(f"request {r.request_id!r} needs {self._need(r)} pages; the pool has {self.capacity}")
        return trace

    def run(self, trace: Iterable[SimRequest]) -> SchedulerSimResult:
        """Run ``trace`` (an iterable of :class:`SimRequest`) to completion; the pool is checked after every step."""
        run = _SchedulerRun(self, self._validated(trace))
        self.pool = run.pool
        while run.pending or run.waiting or run.running or run.cleaning:
            if run.step >= self.max_steps:
                raise RuntimeError(f"no progress after {self.max_steps} steps")
            run.arrive()
            run.complete_cleanups()  # 1.
            admitted = run.admit()  # 2.
            run.prefill(admitted)  # 3.
            run.decode({r.request_id for r in admitted})  # 4.
            run.result.peak_pages = max(run.result.peak_pages, len(run.pool.pages))
            run.retire()  # 5.
            run.pool.check()
            run.step += 1
        run.result.steps = run.step
        return run.result


class _SchedulerRun:
    """The state of one ``SchedulerSim.run``, one method per phase of a step."""

    def __init__(self, sim: SchedulerSim, trace: list[SimRequest]) -> None:
        self.sim = sim
        self.pool = PagedKV(sim.capacity, sim.block_size)
        self.result = SchedulerSimResult(steps=0)
        self.pending = list(trace)
        self.waiting: list[SimRequest] = []
        self.running: dict[str, SimRequest] = {}  # admitted, in admission order
        self.decoded: dict[str, int] = {}
        self.reserved = 0  # credits held by running and cleaning requests
        self.cleaning: list[tuple[int, str, int]] = []  # (unpin step, handle, credits still held)
        self.step = 0

    def arrive(self) -> None:
        while self.pending and self.pending[0].arrival <= self.step:
            self.waiting.append(self.pending.pop(0))

    def complete_cleanups(self) -> None:
        """Cleanup transfers that have completed give their pages (and credits) back."""
        for item in [c for c in self.cleaning if c[0] <= self.step]:
            self.cleaning.remove(item)
            self.pool.unpin(item[1])
            self.reserved -= item[2]

    def admit(self) -> list[SimRequest]:
        """Admission in arrival order; stop at the first that does not fit (FCFS)."""
        sim, admitted = self.sim, []
        while self.waiting:
            r = self.waiting[0]
            if sim.credits:
                if sim._need(r) > self.pool.capacity - self.reserved:
                    break
                self.reserved += sim._need(r)
            elif cdiv(r.prompt_len, sim.block_size) > len(self.pool.free):
                break
            self.waiting.pop(0)
            self.running[r.request_id] = r
            self.decoded[r.request_id] = 0
            admitted.append(r)
        return admitted

    def preempt(self, r: SimRequest) -> None:
        """An allocation failed: free the request's pages and requeue it to recompute from scratch."""
        self.result.out_of_memory.append((self.step, r.request_id))
        self.result.recomputed_tokens += len(self.pool.read(r.request_id))
        self.pool.release(r.request_id)
        del self.running[r.request_id]
        if self.sim.credits:
            self.reserved -= self.sim._need(r)
        self.waiting.insert(0, r)

    def prefill(self, admitted: list[SimRequest]) -> None:
        """Write the admitted requests' prompts (token contents are positions, checked at retirement)."""
        for r in admitted:
            self.pool.create(r.request_id)
            try:
                for pos in range(r.prompt_len):
                    self.pool.append(r.request_id, pos)
            except MemoryError:
                self.preempt(r)

    def decode(self, new_ids: set[str]) -> None:
        """One token for each request admitted in an earlier step."""
        for r in [r for r in self.running.values() if r.request_id not in new_ids]:
            try:
                self.pool.append(r.request_id, r.prompt_len + self.decoded[r.request_id])
            except MemoryError:
                self.preempt(r)
                continue
            self.decoded[r.request_id] += 1

    def retire(self) -> None:
        """Retire finished requests: pin for the cleanup transfer, release ownership."""
        sim, pool = self.sim, self.pool
        for r in [r for r in self.running.values() if self.decoded[r.request_id] == r.max_new_tokens]:
            if pool.read(r.request_id) != list(range(r.prompt_len + r.max_new_tokens)):
                raise InvariantError(f"invariant broken: request {r.request_id!r} reads back what it wrote")
            credit = sim._need(r) if sim.credits else 0
            if sim.cleanup_delay:
                handle = f"cleanup-{r.request_id}"
                pool.pin(r.request_id, handle)
                self.cleaning.append((self.step + sim.cleanup_delay, handle, credit if sim.credits_at_free else 0))
                if not sim.credits_at_free:
                    self.reserved -= credit
            else:
                self.reserved -= credit
            pool.release(r.request_id)
            del self.running[r.request_id]
            self.result.finished[r.request_id] = self.step


def demo_scheduler(verbose: bool = True) -> dict[str, SchedulerSimResult]:
    """Run one small trace under four policies and show what each mechanism protects against.

    The trace: three requests of 6 prompt + 10 output tokens (4 pages each at
    block size 4) arrive together on an 8-page pool, and each terminal request's
    pages stay pinned for 3 steps by a cleanup transfer.
    """
    capacity, block_size, delay = 8, 4, 3
    trace = [SimRequest(f"r{i}", prompt_len=6, max_new_tokens=10) for i in range(3)]
    policies = {
        "credits, returned when pages free": dict(credits=True, credits_at_free=True),
        "credits, returned at termination": dict(credits=True, credits_at_free=False),
        "no credits (admit if the prompt fits)": dict(credits=False, credits_at_free=True),
    }
    results = {name: SchedulerSim(capacity, block_size, cleanup_delay=delay, **kw).run(trace)
               for name, kw in policies.items()}
    if verbose:
        r = trace[0]
        print(f"trace: {len(trace)} requests of {r.prompt_len} prompt + {r.max_new_tokens} output tokens "
              f"= {cdiv(r.prompt_len + r.max_new_tokens, block_size)} pages each at block size {block_size}; "
              f"{capacity}-page pool; cleanup transfers pin pages for {delay} steps")
        print(f"{'policy':40s} {'steps':>5s} {'out-of-memory':>13s} {'recomputed':>10s} {'peak pages':>10s}")
        for name, res in results.items():
            print(f"{name:40s} {res.steps:5d} {len(res.out_of_memory):13d} {res.recomputed_tokens:10d} {res.peak_pages:10d}")
    return results
