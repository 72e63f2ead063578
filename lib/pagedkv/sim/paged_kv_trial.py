"""A randomized trial of the reference allocator ``PagedKV`` against an oracle of plain Python lists.

``random_trial(cls, seed, n_ops)`` runs seeded create/append/fork/pin/unpin/
release operations on ``cls`` (``PagedKV`` or a subclass with a changed branch)
and, after every one, compares every request's tokens with the oracle, runs
``check()``, and verifies that no pinned page changed. Chapter 6 runs it on
``PagedKV`` and on a broken subclass; exercise 6's checker runs it on the
learner's copy-on-write branch.
"""

from __future__ import annotations

import copy
import random

from ..common import InvariantError
from .paged_kv import PagedKV

__all__ = ["random_trial", "pool_state", "check_after"]


def pool_state(pool: PagedKV):
    """A deep copy of everything ``pool`` holds, to compare before and after a refused call."""
    return copy.deepcopy((pool.pages, sorted(pool.free), pool.tables, pool.owners, pool.pins, pool.transfers))


def check_after(pool: PagedKV, when: str) -> None:
    """``pool.check()``, its failure prefixed with ``when`` (the seed and the operation)."""
    try:
        pool.check()
    except AssertionError as exc:  # InvariantError, or a learner's own assert in an override
        raise InvariantError(f"{when}: {exc}") from None


def random_trial(cls: type, seed: int, n_ops: int) -> None:
    """One seeded run of create/append/fork/pin/unpin/release against a list oracle.

    Raises ``InvariantError`` naming the seed, the operation and what differed;
    returns quietly when every read matched, ``check()`` held after every
    operation and no pinned page changed.
    """
    rng = random.Random(seed)
    block_size = rng.randint(2, 4)  # at least 2, so partial tails exist
    pool = cls(rng.randint(3, 12), block_size)
    seqs: dict[str, list[int]] = {}  # the oracle: each request's tokens
    frozen: dict[str, dict[int, list[int]]] = {}  # live transfer -> its pages' contents at pin time
    n = 0
    for step in range(n_ops):
        live = sorted(seqs)
        ops = ["create"] + (["append"] * 4 + ["fork", "pin", "release"] if live else []) + (["unpin"] if frozen else [])
        op = rng.choice(ops)
        where = f"seed {seed}, operation {step} ({op})"
        n += 1
        before, was_full = pool_state(pool), not pool.free
        try:
            if op == "create":
                pool.create(f"r{n}")
                seqs[f"r{n}"] = []
            elif op == "append":
                rid = rng.choice(live)
                pool.append(rid, n)
                seqs[rid].append(n)
            elif op == "fork":
                parent = rng.choice(live)
                pool.fork(parent, f"r{n}")
                seqs[f"r{n}"] = list(seqs[parent])
            elif op == "pin":
                rid = rng.choice([r for r in live if seqs[r]] or live)
                if not seqs[rid]:
                    continue
                pages = pool.pin(rid, f"t{n}")
                frozen[f"t{n}"] = {p: list(pool.pages[p]) for p in pages}
            elif op == "unpin":
                handle = rng.choice(sorted(frozen))
                pool.unpin(handle)
                del frozen[handle]
            else:
                rid = rng.choice(live)
                pool.release(rid)
                del seqs[rid]
        except MemoryError:
            if not was_full:
                raise InvariantError(f"{where}: MemoryError although {len(before[1])} pages were free") from None
            if pool_state(pool) != before:
                raise InvariantError(f"{where}: MemoryError, but the pool changed; allocate before changing anything") from None
        check_after(pool, where)
        _check_contents(pool, seqs, frozen, where)


def _check_contents(pool: PagedKV, seqs: dict[str, list[int]], frozen: dict[str, dict[int, list[int]]],
                    where: str) -> None:
    """Every request reads back what the oracle holds, and no pinned page changed."""
    for rid, tokens in seqs.items():
        got = pool.read(rid)
        if got != tokens:
            raise InvariantError(f"{where}: read({rid!r}) = {got}, expected {tokens}")
    for handle, pages in frozen.items():
        for page, contents in pages.items():
            if pool.pages.get(page) != contents:
                raise InvariantError(f"{where}: page {page}, pinned by {handle!r}, changed from {contents} "
                                     f"to {pool.pages.get(page)}")
