"""The reference allocator ``PagedKV``: paged KV memory on the CPU, with owners and pins.

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

``format_pool`` prints its pages; ``tail_waste`` counts its unwritten slots.
"""

from __future__ import annotations

import heapq
import numbers
from dataclasses import dataclass

from ..common import InvariantError, check_int

__all__ = ["PagedKV", "format_pool", "TailWaste", "tail_waste", "check_id"]


def check_id(value, what: str) -> str:
    """``value`` if it is a str (request ids and transfer handles are); TypeError naming ``what`` otherwise."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__} {value!r}")
    return value


class PagedKV:
    """Paged KV memory of ``capacity`` pages of ``block_size`` token slots each.

    State (public for inspection; change it only through the methods, or inside
    :meth:`copy_on_write` or :meth:`fork` when overriding them -- the two
    extension points, the second for a policy that copies at the fork):

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
        check_id(request_id, "request_id")
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
        check_id(child_id, "child_id")
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
        check_id(handle, "handle")
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
        check_id(request_id, "request_id")
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
