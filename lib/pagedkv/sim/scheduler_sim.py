"""The reference allocator ``PagedKV`` and a small admission/cleanup scheduler model.

``PagedKV`` models paged KV memory on the CPU. Each slot holds a token id
where a GPU would hold K and V vectors, so any request's contents can be read
back through its page table and compared with what was appended. It has one
cache group and plain ownership, unlike vLLM's and SGLang's allocators, and
its ``fork`` exists only to create shared prefixes for study.

Two kinds of references keep a physical page alive:

* an **owner reference**: a live request's table names the page;
* a **transfer pin**: an outstanding operation (a KV transfer, a swap-out)
  may still read the page's storage.

Cancelling a request drops its owner references; it cannot revoke a read that
was already issued, so a page returns to the free heap only when it has no
owners *and* no pins. A request may write into its tail page in place only
when it is the sole owner and nobody has pinned it; otherwise the tail is
copied first (copy-on-write). That branch lives in one method,
:meth:`PagedKV.copy_on_write`, so a subclass can supply it.

The second half of the module, :class:`SchedulerSim`, runs a trace of
requests on the same allocator with two safety mechanisms that can be turned
off to see what each protects against: conservative admission credits and
cleanup delays that return credits only when pages are really free.
"""

from __future__ import annotations

import heapq
import numbers
from dataclasses import dataclass, field
from typing import Iterable

from ..common import InvariantError, cdiv, check_int

__all__ = [
    "PagedKV",
    "InvariantError",
    "TailWaste",
    "tail_waste",
    "format_pool",
    "SimRequest",
    "SimResult",
    "SchedulerSim",
    "demo_scheduler",
]



def _require_id(value, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__} {value!r}")
    return value



class PagedKV:
    """Paged KV memory of ``capacity`` pages of ``block_size`` token slots each.

    State (public for inspection; change it only through the methods, or inside
    :meth:`copy_on_write` when overriding it):

    * ``pages``: allocated page id -> the tokens written in it (a list of at
      most ``block_size`` ints). A page is in ``pages`` or in ``free``, never both.
    * ``free``: the free page ids as a min-heap, so the lowest id is reused first
      and runs are reproducible.
    * ``tables``: request id -> its physical pages in logical order.
    * ``owners``: page -> the requests whose table names it.
    * ``pins``: page -> the transfer handles that pin it.
    * ``transfers``: live handle -> the pages it pinned.

    Every method validates its arguments before changing anything: a call that
    raises leaves every structure exactly as it was.
    """

    def __init__(self, capacity: int, block_size: int):
        self.capacity = check_int(capacity, "capacity", 1)
        self.block_size = check_int(block_size, "block_size", 1)
        self.pages: dict[int, list[int]] = {}
        self.free: list[int] = list(range(capacity))  # sorted, hence already a heap
        self.tables: dict[str, list[int]] = {}
        self.owners: dict[int, set[str]] = {}
        self.pins: dict[int, set[str]] = {}
        self.transfers: dict[str, tuple[int, ...]] = {}
        self._completed: set[str] = set()  # handles are unique for the pool's lifetime

    # ------------------------------------------------------------------ queries
    def read(self, request_id: str) -> list[int]:
        """The request's tokens, decoded through its table."""
        table = self._table(request_id)
        return [token for page in table for token in self.pages[page]]

    def __len__(self) -> int:
        """Number of allocated pages."""
        return len(self.pages)

    def must_copy(self, page: int, request_id: str) -> bool:
        """Whether ``request_id`` must copy ``page`` before writing into it.

        Writing in place is safe only for the sole owner of an unpinned page:
        another owner would see the new token, and a pin promises the transfer
        an immutable snapshot.
        """
        return self.owners[page] != {request_id} or bool(self.pins[page])

    # ---------------------------------------------------------------- mutations
    def create(self, request_id: str) -> None:
        """Start an empty sequence (no pages until its first token)."""
        _require_id(request_id, "request_id")
        if request_id in self.tables:
            raise ValueError(f"request {request_id!r} already exists")
        self.tables[request_id] = []

    def append(self, request_id: str, token: int) -> None:
        """Append one token; raises ``MemoryError`` (nothing changed) when a page is needed and none is free.

        Three cases, decided by the tail page:
        no tail or a full tail -> take a fresh page (sharing a full page is harmless,
        nobody writes into it again); a partial tail we may write -> write in place;
        a partial tail that is shared or pinned -> :meth:`copy_on_write`, then write.
        """
        table = self._table(request_id)
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise TypeError(f"token must be an int, got {type(token).__name__} {token!r}")
        token = int(token)
        if not table or len(self.pages[table[-1]]) == self.block_size:
            page = self.allocate_page()  # may raise MemoryError; nothing changed yet
            table.append(page)
            self.owners[page].add(request_id)
        elif self.must_copy(table[-1], request_id):
            self.copy_on_write(request_id)  # may raise MemoryError; nothing changed yet
        self.pages[table[-1]].append(token)

    def copy_on_write(self, request_id: str) -> int:
        """Give ``request_id`` a private copy of its partial tail page; return the new page id.

        Called by :meth:`append` when the tail is shared or pinned. Allocates
        first, so a full heap raises ``MemoryError`` before anything changes;
        then copies the tokens, redirects only this request's table entry, and
        moves its owner reference from the old page to the new one. The old page
        keeps its other owners or pins, so it is never freed here.
        """
        table = self.tables[request_id]
        old = table[-1]
        new = self.allocate_page()
        self.pages[new].extend(self.pages[old])
        table[-1] = new
        self.owners[new].add(request_id)
        self.drop_owner(old, request_id)
        return new

    def fork(self, parent_id: str, child_id: str) -> None:
        """Make ``child_id`` a new request sharing every page of ``parent_id`` (no copy)."""
        table = self._table(parent_id)
        _require_id(child_id, "child_id")
        if child_id in self.tables:
            raise ValueError(f"request {child_id!r} already exists")
        self.tables[child_id] = list(table)
        for page in table:
            self.owners[page].add(child_id)

    def pin(self, request_id: str, handle: str) -> tuple[int, ...]:
        """Pin every page of ``request_id`` for transfer ``handle``; return those pages.

        The pin outlives the request: releasing it later does not free a pinned page.
        """
        table = self._table(request_id)
        _require_id(handle, "handle")
        if handle in self.transfers or handle in self._completed:
            raise ValueError(f"transfer handle {handle!r} was already used; handles are unique")
        if not table:
            raise ValueError(f"request {request_id!r} has no pages to transfer")
        pinned = tuple(table)
        self.transfers[handle] = pinned
        for page in pinned:
            self.pins[page].add(handle)
        return pinned

    def unpin(self, handle: str) -> None:
        """Complete transfer ``handle``: drop its pins, freeing pages nobody else holds."""
        if handle not in self.transfers:
            state = "already completed" if handle in self._completed else "unknown"
            raise KeyError(f"{state} transfer handle {handle!r}")
        for page in self.transfers.pop(handle):
            self.pins[page].discard(handle)
            self._free_if_unreferenced(page)
        self._completed.add(handle)

    def release(self, request_id: str) -> None:
        """End ``request_id`` (finished or cancelled): drop its owner references."""
        table = self._table(request_id)
        del self.tables[request_id]
        for page in table:
            self.drop_owner(page, request_id)

    # ------------------------------------------------------------------ helpers
    def _table(self, request_id: str) -> list[int]:
        _require_id(request_id, "request_id")
        try:
            return self.tables[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    def allocate_page(self) -> int:
        """Pop the lowest free page (``MemoryError`` when none is free).

        A building block of the operations above (and of :meth:`copy_on_write`
        in a subclass): the page comes back empty and with no owner, so the
        caller must attach one before the operation ends, or ``check()`` fails.
        """
        if not self.free:
            raise MemoryError(f"no free page: all {self.capacity} pages are referenced")
        page = heapq.heappop(self.free)
        self.pages[page] = []
        self.owners[page] = set()
        self.pins[page] = set()
        return page

    def drop_owner(self, page: int, request_id: str) -> None:
        """Remove ``request_id``'s owner reference to ``page``; free the page if nothing holds it."""
        self.owners[page].discard(request_id)
        self._free_if_unreferenced(page)

    def _free_if_unreferenced(self, page: int) -> None:
        if not self.owners[page] and not self.pins[page]:
            del self.pages[page], self.owners[page], self.pins[page]
            heapq.heappush(self.free, page)

    # --------------------------------------------------------------- invariants
    def check(self) -> None:
        """Verify every structural invariant; raise :class:`InvariantError` naming the broken one."""

        def require(ok: bool, name: str, detail: str) -> None:
            if not ok:
                raise InvariantError(f"invariant broken: {name}: {detail}")

        B, allocated, free = self.block_size, set(self.pages), set(self.free)
        # 1. Free and allocated pages partition the pool, each page exactly once.
        require(len(free) == len(self.free), "free heap has no duplicates", f"free={sorted(self.free)}")
        require(not (free & allocated), "free and allocated are disjoint", f"both: {sorted(free & allocated)}")
        require(free | allocated == set(range(self.capacity)), "free and allocated cover the pool",
                f"missing {sorted(set(range(self.capacity)) - free - allocated)}, "
                f"foreign {sorted((free | allocated) - set(range(self.capacity)))}")
        require(all(self.free[(i - 1) // 2] <= self.free[i] for i in range(1, len(self.free))),
                "free list is a min-heap", f"free={self.free}")
        require(set(self.owners) == allocated == set(self.pins), "owner and pin records exist exactly for allocated pages",
                f"owners={sorted(self.owners)} pins={sorted(self.pins)} pages={sorted(allocated)}")
        # 2. Tables and owner sets mirror each other.
        for rid, table in self.tables.items():
            for page in table:
                require(page in allocated, "every table page is allocated", f"{rid!r} names page {page}")
                require(rid in self.owners[page], "every table entry has an owner entry", f"page {page} lacks owner {rid!r}")
        for page, owners in self.owners.items():
            for rid in owners:
                require(page in self.tables.get(rid, ()), "every owner entry has a table entry",
                        f"page {page} lists owner {rid!r} whose table does not name it")
        # 3. Every page is retained; pins and transfer records mirror each other.
        for page in allocated:
            require(bool(self.owners[page] or self.pins[page]), "every allocated page has an owner or a pin",
                    f"page {page} is held by nobody")
            for handle in self.pins[page]:
                require(page in self.transfers.get(handle, ()), "every pin has a live transfer record",
                        f"page {page} pinned by {handle!r}")
        for handle, pinned in self.transfers.items():
            require(bool(pinned), "a transfer pins at least one page", f"{handle!r}")
            for page in pinned:
                require(page in allocated and handle in self.pins[page], "every transfer record has its page pins",
                        f"{handle!r} lacks its pin on page {page}")
        # 4. Tables are well formed: distinct pages, full pages except the tail.
        for rid, table in self.tables.items():
            require(len(set(table)) == len(table), "a table has no duplicate pages", f"{rid!r}: {table}")
            for i, page in enumerate(table):
                n = len(self.pages[page])
                if i < len(table) - 1:
                    require(n == B, "every non-tail page is full", f"{rid!r} page {page} holds {n}/{B}")
                else:
                    require(1 <= n <= B, "a tail holds 1..block_size tokens", f"{rid!r} page {page} holds {n}/{B}")
        for page, tokens in self.pages.items():
            require(len(tokens) <= B, "no page overflows", f"page {page} holds {len(tokens)}/{B}")

    def __repr__(self) -> str:
        return (f"PagedKV(capacity={self.capacity}, block_size={self.block_size}, "
                f"requests={len(self.tables)}, allocated={len(self.pages)}, transfers={len(self.transfers)})")


def format_pool(pool: PagedKV) -> str:
    """A plain-text table of every page: its tokens, owners and pins, then each request's table.

    ``.`` marks an empty slot. Deterministic (sorted), so it can sit in a committed notebook.
    """
    B = pool.block_size
    lines = [f"{'page':>4}  {'slots':<{3 * B + 1}} {'owners':<14} pins"]  # a slot is 3 characters wide
    for page in range(pool.capacity):
        if page in pool.pages:
            slots = " ".join([f"{t:>2}" for t in pool.pages[page]] + [" ."] * (B - len(pool.pages[page])))
            owners = ",".join(sorted(pool.owners[page])) or "-"
            pins = ",".join(sorted(pool.pins[page])) or "-"
            lines.append(f"{page:>4}  [{slots}] {owners:<14} {pins}")
        else:
            lines.append(f"{page:>4}  (free)")
    tables = "  ".join(f"{rid}->{pool.tables[rid]}" for rid in sorted(pool.tables)) or "(no requests)"
    lines.append(f"tables: {tables}")
    return "\n".join(lines)


# ----------------------------------------------------------------- tail waste
@dataclass(frozen=True)
class TailWaste:
    """Unwritten slots, counted two ways.

    ``physical`` counts each allocated page once (what the pool really loses);
    ``per_request`` adds up every request's own tail, so a shared tail is counted
    once per sharer and a pinned page nobody owns is not counted at all.
    """

    physical: int
    per_request: int
    allocated_slots: int


def tail_waste(pool: PagedKV) -> TailWaste:
    """Unused token slots of ``pool``, counting shared pages once (``physical``) and per request."""
    B = pool.block_size
    physical = sum(B - len(tokens) for tokens in pool.pages.values())
    per_request = sum((B - len(pool.read(rid)) % B) % B for rid in pool.tables)
    return TailWaste(physical, per_request, B * len(pool.pages))


# ------------------------------------------------------------ scheduler model

@dataclass(frozen=True)
class SimRequest:
    """One request of a trace: it arrives at ``arrival`` with ``prompt_len`` tokens and decodes ``max_new_tokens``."""

    request_id: str
    prompt_len: int
    max_new_tokens: int
    arrival: int = 0

    def __post_init__(self):
        _require_id(self.request_id, "request_id")
        check_int(self.prompt_len, "prompt_len", 1)
        check_int(self.max_new_tokens, "max_new_tokens", 1)
        if isinstance(self.arrival, bool) or not isinstance(self.arrival, int) or self.arrival < 0:
            raise ValueError(f"arrival must be a non-negative int, got {self.arrival!r}")


@dataclass
class SimResult:
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

    def run(self, trace: Iterable[SimRequest]) -> SimResult:
        """Run ``trace`` (an iterable of :class:`SimRequest`) to completion; the pool is checked after every step."""
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
        self.pool = pool = PagedKV(self.capacity, self.block_size)
        B = self.block_size
        result = SimResult(steps=0)
        waiting: list[SimRequest] = []
        pending = list(trace)
        running: dict[str, SimRequest] = {}   # admitted, in admission order
        decoded: dict[str, int] = {}
        reserved = 0                           # credits held by running and cleaning requests
        cleaning: list[tuple[int, str, int]] = []  # (unpin step, handle, credits still held)

        def preempt(r: SimRequest) -> None:
            """An allocation failed: free the request's pages and requeue it to recompute from scratch."""
            nonlocal reserved
            result.out_of_memory.append((step, r.request_id))
            result.recomputed_tokens += len(pool.read(r.request_id))
            pool.release(r.request_id)
            del running[r.request_id]
            if self.credits:
                reserved -= self._need(r)
            waiting.insert(0, r)

        step = 0
        while pending or waiting or running or cleaning:
            if step >= self.max_steps:
                raise RuntimeError(f"no progress after {self.max_steps} steps")
            while pending and pending[0].arrival <= step:
                waiting.append(pending.pop(0))
            # 1. Cleanup transfers that have completed give their pages back.
            for item in [c for c in cleaning if c[0] <= step]:
                cleaning.remove(item)
                pool.unpin(item[1])
                reserved -= item[2]
            # 2. Admission, in arrival order; stop at the first that does not fit (FCFS).
            admitted = []
            while waiting:
                r = waiting[0]
                if self.credits:
                    if self._need(r) > pool.capacity - reserved:
                        break
                    reserved += self._need(r)
                elif cdiv(r.prompt_len, B) > len(pool.free):
                    break
                waiting.pop(0)
                running[r.request_id] = r
                decoded[r.request_id] = 0
                admitted.append(r)
            # 3. Prefill the admitted (token contents are positions, checked at the end),
            #    then 4. decode one token for each request admitted in an earlier step.
            for r in admitted:
                pool.create(r.request_id)
                try:
                    for pos in range(r.prompt_len):
                        pool.append(r.request_id, pos)
                except MemoryError:
                    preempt(r)
            new_ids = {r.request_id for r in admitted}
            for r in [r for r in running.values() if r.request_id not in new_ids]:
                try:
                    pool.append(r.request_id, r.prompt_len + decoded[r.request_id])
                except MemoryError:
                    preempt(r)
                    continue
                decoded[r.request_id] += 1
            result.peak_pages = max(result.peak_pages, len(pool.pages))
            # 5. Retire finished requests: pin for the cleanup transfer, release ownership.
            for r in [r for r in running.values() if decoded[r.request_id] == r.max_new_tokens]:
                total = r.prompt_len + r.max_new_tokens
                if pool.read(r.request_id) != list(range(total)):
                    raise AssertionError(f"request {r.request_id!r} read back wrong contents")
                credit = self._need(r) if self.credits else 0
                if self.cleanup_delay:
                    handle = f"cleanup-{r.request_id}"
                    pool.pin(r.request_id, handle)
                    cleaning.append((step + self.cleanup_delay, handle, credit if self.credits_at_free else 0))
                    if not self.credits_at_free:
                        reserved -= credit
                else:
                    reserved -= credit
                pool.release(r.request_id)
                del running[r.request_id]
                result.finished[r.request_id] = step
            pool.check()
            step += 1
        result.steps = step
        return result


def demo_scheduler(verbose: bool = True) -> dict[str, SimResult]:
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
