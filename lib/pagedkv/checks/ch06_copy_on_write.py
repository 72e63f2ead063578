"""Checks for exercises/06_copy_on_write.ipynb.

The learner writes the copy-on-write branch of ``PagedKV.append``:

* ``copy_on_write(pool, request_id) -> int``: give ``request_id`` a private
  copy of its partial tail page (shared with another request, or pinned by a
  transfer) and return the new page id. ``MemoryError`` with nothing changed
  when no page is free.

The checker plugs the function into a subclass of
:class:`pagedkv.sim.paged_kv.PagedKV` (it overrides ``copy_on_write``, the one
method ``append`` calls for that branch) and runs the chapter's cases and the
randomized test: seeded random operations compared, after every one, with an
independent oracle of plain Python lists, with ``check()`` after every
mutation and the contents of every pinned page frozen.

The exercise's prediction task (``ch06_copy_prediction``) and design tasks
(``ch06_designs``) are re-exported from here.
"""

from __future__ import annotations


from ..sim.paged_kv_trial import check_after, pool_state, random_trial
from ..sim.paged_kv import PagedKV
from ._harness import Checker, CheckReport, Mistake, WrongAnswer, catalogue, expect_equal, expect_int

from .ch06_copy_prediction import check_copy_prediction
from .ch06_designs import check_block_size_design, check_resume_design

__all__ = ["check_copy_on_write", "check_copy_prediction", "check_resume_design",
           "check_block_size_design"]


def _with_hook(fn) -> type:
    """A PagedKV whose copy-on-write branch is the learner's function."""

    def copy_on_write(self, request_id):
        return fn(self, request_id)

    return type("LearnerPagedKV", (PagedKV,), {"copy_on_write": copy_on_write})


COW_MISTAKES = [
    Mistake("the wrong page copied", "only the partial page may change, and "
            "a table fills in order: the partial page is the request's last"),
    Mistake("written in place", "a page that another request shares (or a "
            "transfer pins) must keep its contents: the request needs a page "
            "of its own, and its table must name it"),
    Mistake("tokens not copied", "a copy is a copy: the new page must hold "
            "the old tail's tokens before the appended one, or the request "
            "reads a prefix with a hole"),
    Mistake("the old owner reference kept", "owners are the requests whose "
            "tables name a page: once the table names the copy, the request "
            "is no owner of the old page, which may then never be freed"),
    Mistake("the new owner missing", "owners are the requests whose tables "
            "name a page: a page named by a table but owned by nobody is "
            "freed (and handed out again) while it is read"),
    Mistake("state changed before allocating", "a refused copy changes "
            "nothing: when no page is free the pool must be exactly as "
            "before the call, so nothing may change before the one step "
            "that can fail"),
]


def _three_pages(cls):
    """a holds five tokens in pages of 2 (the tail partial); b is its fork."""
    pool = cls(capacity=6, block_size=2)
    pool.create("a")
    for t in (1, 2, 3, 4, 5):
        pool.append("a", t)
    pool.fork("a", "b")
    return pool


def _diagnose_cow(fn) -> str | None:
    try:
        pool = _three_pages(PagedKV)
        old_table = list(pool.tables["b"])
        old = old_table[-1]
        got = fn(pool, "b")
        table = pool.tables["b"]
        if table == old_table or got == old:
            return COW_MISTAKES[1].diagnosis()
        if table[-1] == old:
            return COW_MISTAKES[0].diagnosis()
        new = table[-1]
        if pool.pages[new] != [5]:
            return COW_MISTAKES[2].diagnosis()
        if "b" in pool.owners[old]:
            return COW_MISTAKES[3].diagnosis()
        if "b" not in pool.owners[new]:
            return COW_MISTAKES[4].diagnosis()
        pool = PagedKV(capacity=1, block_size=4)
        pool.create("a")
        pool.append("a", 7)
        pool.fork("a", "b")
        before = pool_state(pool)
        try:
            fn(pool, "b")
        except MemoryError:
            if pool_state(pool) != before:
                return COW_MISTAKES[5].diagnosis()
    except Exception:  # noqa: BLE001 -- the property's message says what happened
        return None
    return None


def check_copy_on_write(fn, seeds: int = 25, n_ops: int = 200, timeout: float = 20.0) -> CheckReport:
    """Check ``fn(pool, request_id) -> int``, the copy-on-write branch of ``PagedKV.append``."""
    cls = _with_hook(fn)
    with Checker("copy_on_write", timeout=timeout) as c:
        c.probe(lambda: fn(_three_pages(PagedKV), "b"))
        prop = c.prop
        c.prop = lambda name, body, hint="": prop(name, body, hint, lambda: _diagnose_cow(fn))
        def worked_example():
            pool = cls(capacity=3, block_size=4)
            pool.create("a")
            pool.append("a", 10)
            pool.fork("a", "b")
            (source,) = pool.pin("a", "transfer-1")
            pool.append("b", 20)
            expect_equal(pool.read("a"), [10], "read('a') after b appends")
            expect_equal(pool.read("b"), [10, 20], "read('b') after b appends")
            expect_equal(pool.tables["a"], [source], "a's table (only b's entry may move)")
            check_after(pool, "after b appends")
            pool.release("a")
            pool.unpin("transfer-1")
            expect_equal(source in pool.free, True, "the source page is free once a and the transfer are done")
            pool.release("b")
            expect_equal(len(pool.free), 3, "free pages at the end")

        c.prop("the worked example: b gets a private copy, a and the transfer keep page 0", worked_example,
               "a's page and the transfer's snapshot must not change; only b's table may")

        def three_pages():
            pool = _three_pages(cls)
            a_table = list(pool.tables["a"])
            pool.append("b", 6)
            b_table = pool.tables["b"]
            if b_table[-1] == a_table[-1] or b_table[:-1] != a_table[:-1]:
                changed = [i for i, (x, y) in enumerate(zip(a_table, b_table)) if x != y]
                copied = ", ".join(str(a_table[i]) for i in changed)
                raise WrongAnswer(
                    f"a's pages {a_table}, b's after its append {b_table}: "
                    + (f"page {copied} was copied" if copied else "no page was copied")
                    + f", but the partial page is the tail, {a_table[-1]}",
                    _diagnose_cow(fn))
            expect_equal(pool.read("a"), [1, 2, 3, 4, 5], "read('a')")
            expect_equal(pool.read("b"), [1, 2, 3, 4, 5, 6], "read('b')")
            check_after(pool, "after b appends")

        c.prop("three pages: only the partial tail is copied, the full pages "
               "stay shared", three_pages, "a table fills in order: the partial page is its last")

        def returns_new_page():
            pool = cls(capacity=4, block_size=4)
            pool.create("a")
            pool.append("a", 1)
            pool.fork("a", "b")
            old = pool.tables["b"][-1]
            got = fn(pool, "b")
            page = expect_int(got, "the returned page")
            expect_equal(page != old, True, f"the returned page differs from the old tail {old}")
            expect_equal(pool.tables["b"][-1], page, "b's tail after the copy")
            expect_equal(pool.pages[page], [1], "the new page's contents")
            expect_equal(pool.owners[page], {"b"}, "owners of the new page")
            expect_equal(pool.owners[old], {"a"}, "owners of the old page")
            check_after(pool, "after copy_on_write")

        c.prop("returns the new page id, now b's tail, owned by b alone", returns_new_page,
               "owners follow the tables: b's now names the new page, not the old one")

        def pinned_sole_owner():
            pool = cls(capacity=4, block_size=4)
            pool.create("a")
            pool.append("a", 1)
            pool.append("a", 2)
            (page,) = pool.pin("a", "x")
            pool.append("a", 3)
            expect_equal(pool.pages[page], [1, 2], "the pinned page (a transfer may still read it)")
            expect_equal(pool.read("a"), [1, 2, 3], "read('a')")
            check_after(pool, "after the append")
            pool.unpin("x")
            expect_equal(page in pool.free, True, "the old page is free once the transfer completes")

        c.prop("a sole owner copies a pinned partial tail; the pinned page stays as it was", pinned_sole_owner,
               "a page with no other owner but a pin still must not change")

        def out_of_memory():
            pool = cls(capacity=1, block_size=4)
            pool.create("a")
            pool.append("a", 7)
            pool.fork("a", "b")
            before = pool_state(pool)
            try:
                pool.append("b", 8)
            except MemoryError:
                pass
            else:
                raise AssertionError("append on a full one-page pool did not raise MemoryError")
            if pool_state(pool) != before:
                raise AssertionError("MemoryError was raised, but the pool changed")
            expect_equal((pool.read("a"), pool.read("b")), ([7], [7]), "reads after the failed append")

        c.prop("no free page: MemoryError, and the pool is exactly as before", out_of_memory,
               "the one step that can fail must come before any change")

        def randomized():
            for seed in range(seeds):
                random_trial(cls, seed, n_ops)

        c.prop(f"{seeds} seeds x {n_ops} random operations match a list oracle; check() always holds",
               randomized, "read the message: it names the seed, the operation and what differed")
    return c.report


catalogue(check_copy_on_write, COW_MISTAKES)
