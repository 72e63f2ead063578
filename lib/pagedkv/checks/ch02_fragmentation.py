"""Checks for exercises/02_fragmentation.ipynb.

The learner writes three functions:

* ``expected_tail_waste(lengths, probs, block_size) -> float``: the expected
  number of unwritten slots in a sequence's last block, when a sequence has
  ``lengths[i]`` tokens with probability ``probs[i]``.
* ``largest_free_extent(allocated, capacity) -> int``: given the (start,
  length) extents a contiguous allocator has handed out in a pool of
  ``capacity`` slots, the longest run of free slots -- the largest request it
  could still admit.
* ``fragmenting_trace(capacity) -> (ops, need)``: a list of operations,
  ``("admit", name, size)`` and ``("finish", name)``, that leaves a first-fit
  allocator of ``capacity`` slots unable to admit one more request of ``need``
  slots although at least ``need`` slots are free.

Each is compared with the library (``pagedkv.fragmentation``) and with an
independent oracle written here (a block count for tail waste, a slot bitmap
for free extents), on known answers and seeded random cases.
"""

from __future__ import annotations

import math
import numbers
import random

import numpy as np

from .. import fragmentation as fr
from ._harness import Checker, CheckReport, expect_equal, expect_int

__all__ = ["check_expected_tail_waste", "check_largest_free_extent", "check_fragmenting_trace"]


# ------------------------------------------------------------------ oracles
def _oracle_tail(lengths, probs, block_size) -> float:
    # Count it the long way: blocks held, times their size, minus the tokens in them.
    total = 0.0
    for n, p in zip(lengths, probs):
        blocks = (n + block_size - 1) // block_size
        total += p * (blocks * block_size - n)
    return total


def _oracle_largest(allocated, capacity) -> int:
    used = np.zeros(capacity + 2, bool)
    used[0] = used[-1] = True  # sentinels around the pool
    for s, n in allocated:
        used[s + 1 : s + 1 + n] = True
    edges = np.flatnonzero(np.diff(used.astype(np.int8)))  # where runs of free slots start and stop
    starts, stops = edges[0::2], edges[1::2]
    return int((stops - starts).max()) if starts.size else 0


def _expect_real(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise AssertionError(f"{what}: expected a number, got {type(value).__name__} {value!r}")
    return float(value)


def _expect_close(got, want: float, what: str) -> None:
    got = _expect_real(got, what)
    if not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9):
        raise AssertionError(f"{what}: expected {want:.6g}, got {got!r}")


# ------------------------------------------------------------------ (a) tail waste
def check_expected_tail_waste(fn, cases: int = 200, seed: int = 0, timeout: float = 20.0) -> CheckReport:
    """Check ``fn(lengths, probs, block_size) -> float``."""
    rng = random.Random(seed)
    with Checker("expected_tail_waste", timeout=timeout) as c:
        def single_lengths():
            for n, want in ((1, 15), (15, 1), (16, 0), (17, 15), (32, 0), (33, 15)):
                _expect_close(fn([n], [1.0], 16), want, f"one sequence of {n} tokens at block 16")

        c.prop("single lengths 1, 15, 16, 17 waste 15, 1, 0, 15 slots at block 16", single_lengths,
               "the last block holds length mod B tokens -- and a full last block wastes nothing")

        def equal_four():
            _expect_close(fn([1, 15, 16, 17], [0.25] * 4, 16), 7.75, "lengths 1, 15, 16, 17 equally likely")

        c.prop("lengths 1, 15, 16, 17 equally likely give 7.75", equal_four, "weight each length's waste by its probability")

        def unequal_four():
            probs = [0.1, 0.1, 0.7, 0.1]
            _expect_close(fn([1, 15, 16, 17], probs, 16), fr.expected_tail_waste([1, 15, 16, 17], probs, 16),
                          "lengths 1, 15, 16, 17 with probabilities 0.1, 0.1, 0.7, 0.1")

        c.prop("the same lengths, not equally likely, are not 7.75 (here 3.1)", unequal_four,
               "use probs; a plain average of the four wastes assumes equal likelihood")

        def uniform():
            for B in (1, 2, 8, 16, 128):
                lengths = list(range(1000, 1000 + B))
                _expect_close(fn(lengths, [1 / B] * B, B), (B - 1) / 2, f"every residue mod {B} equally likely")

        c.prop("uniform residues give (B - 1) / 2 for B = 1, 2, 8, 16, 128", uniform,
               "block size 1 never wastes a slot")

        def randomized():
            for _ in range(cases):
                k = rng.randint(1, 12)
                lengths = [rng.randint(1, 40_000) for _ in range(k)]
                w = [rng.random() for _ in range(k)]
                probs = [x / sum(w) for x in w]
                B = rng.choice([1, 2, 4, 16, 32, 64, 128, 256])
                want = _oracle_tail(lengths, probs, B)
                assert math.isclose(want, fr.expected_tail_waste(lengths, probs, B), abs_tol=1e-9)  # checker sanity
                _expect_close(fn(lengths, probs, B), want, f"lengths {lengths}, block {B}")

        c.prop(f"{cases} random length distributions match an independent count", randomized,
               "sum over lengths of P(length) x ((B - length mod B) mod B)")
    return c.report


# ------------------------------------------------------------------ (b) largest free extent
def _random_first_fit_state(rng: random.Random, capacity: int) -> fr.VariableExtentAllocator:
    """A first-fit allocator after a random run of admissions and finishes (holes in odd places)."""
    alloc = fr.VariableExtentAllocator(capacity, capacity, "first-fit")
    for i in range(rng.randint(0, 60)):
        if alloc.num_requests and rng.random() < 0.4:
            alloc.finish(rng.choice(alloc.requests()))
        else:
            alloc.admit(i, rng.randint(1, max(1, capacity // 6)))
    return alloc


def check_largest_free_extent(fn, cases: int = 200, seed: int = 0, timeout: float = 20.0) -> CheckReport:
    """Check ``fn(allocated: list[tuple[int, int]], capacity: int) -> int``."""
    rng = random.Random(seed)
    with Checker("largest_free_extent", timeout=timeout) as c:
        def empty_and_full():
            expect_equal(expect_int(fn([], 100), "empty pool"), 100, "an empty pool of 100 slots")
            expect_equal(expect_int(fn([(0, 100)], 100), "full pool"), 0, "a pool held by one extent")
            expect_equal(expect_int(fn([(0, 40), (40, 60)], 100), "full pool"), 0, "a pool held by two extents")

        c.prop("an empty pool is one hole; a full pool has none", empty_and_full,
               "with nothing allocated, the whole pool is free")

        def chapter_example():
            # Four requests of 30, 30, 30, 10 slots; the 1st and 3rd finished: holes 0-29 and 60-89.
            expect_equal(expect_int(fn([(30, 30), (90, 10)], 100), "two holes of 30"), 30, "holes of 30 and 30")

        c.prop("holes of 30 and 30 slots: the largest is 30, not the 60 free in total", chapter_example,
               "a request needs its slots in one run")

        def edges():
            expect_equal(expect_int(fn([(10, 5)], 40), "hole at the end"), 25, "extent at 10..14 of 40")
            expect_equal(expect_int(fn([(0, 5), (35, 5)], 40), "hole in the middle"), 30, "extents at both ends")
            expect_equal(expect_int(fn([(20, 5)], 30), "hole at the start"), 20, "extent at 20..24 of 30")

        c.prop("holes before the first extent and after the last one count", edges,
               "look at the gap from slot 0 and the gap up to capacity too")

        def unsorted():
            expect_equal(expect_int(fn([(70, 10), (0, 10), (30, 10)], 100), "unsorted extents"), 30,
                         "extents given out of address order")

        c.prop("extents listed out of address order", unsorted, "sort the extents by start first")

        def randomized():
            for _ in range(cases):
                capacity = rng.choice([16, 100, 1000, 4096])
                alloc = _random_first_fit_state(rng, capacity)
                extents = list(alloc.allocated_extents().values())
                rng.shuffle(extents)
                want = _oracle_largest(extents, capacity)
                assert want == alloc.largest_free_extent()  # checker sanity: library and oracle agree
                got = expect_int(fn(list(extents), capacity), "random state")
                if got != want:
                    raise AssertionError(f"pool of {capacity}, extents {sorted(extents)}: expected {want}, got {got}")

        c.prop(f"{cases} random first-fit states match the allocator and a slot bitmap", randomized,
               "walk the extents by address and measure each gap")
    return c.report


# ------------------------------------------------------------------ (b) a trace that fragments
def _replay(ops, capacity: int) -> fr.VariableExtentAllocator:
    """Run the learner's operations on the library's first-fit allocator; AssertionError on a malformed op."""
    if not isinstance(ops, (list, tuple)):
        raise AssertionError(f"ops: expected a list of tuples, got {type(ops).__name__}")
    alloc = fr.VariableExtentAllocator(capacity, capacity, "first-fit")
    for i, op in enumerate(ops):
        if not isinstance(op, tuple) or not op or op[0] not in ("admit", "finish"):
            raise AssertionError(f"op {i} is {op!r}: expected ('admit', name, size) or ('finish', name)")
        if op[0] == "admit":
            if len(op) != 3:
                raise AssertionError(f"op {i} is {op!r}: an admit is ('admit', name, size)")
            size = expect_int(op[2], f"size in op {i}")
            if size < 1 or size > capacity:
                raise AssertionError(f"op {i} admits {size} slots; sizes run from 1 to the pool's {capacity}")
            if op[1] in alloc.requests():
                raise AssertionError(f"op {i} admits {op[1]!r}, which is already admitted")
            if not alloc.admit(op[1], size):
                raise AssertionError(f"op {i}: first-fit refused {op!r} ({alloc.largest_free_extent()} slots in the "
                                     "largest hole); every admission in the trace must succeed")
        else:
            if len(op) != 2 or op[1] not in alloc.requests():
                raise AssertionError(f"op {i} is {op!r}: finish a request that is admitted, as ('finish', name)")
            alloc.finish(op[1])
    return alloc


def _unpack(result):
    if not (isinstance(result, tuple) and len(result) == 2):
        raise AssertionError(f"expected (ops, need), got {type(result).__name__} {result!r:.80}")
    return result[0], expect_int(result[1], "need")


def check_fragmenting_trace(fn, capacities: tuple[int, ...] = (100, 64, 1000, 4096),
                            timeout: float = 20.0) -> CheckReport:
    """Check ``fn(capacity) -> (ops, need)``: first-fit refuses ``need`` although ``need`` slots are free."""
    with Checker("fragmenting_trace", timeout=timeout) as c:
        replays = {}

        def well_formed():
            for cap in capacities:
                ops, need = _unpack(fn(cap))
                if need < 1:
                    raise AssertionError(f"pool of {cap}: need must be at least 1 slot, got {need}")
                replays[cap] = (_replay(ops, cap), need)

        c.prop("the operations replay on a first-fit allocator, every admission succeeding", well_formed,
               "admit with ('admit', name, size), free with ('finish', name); names unique while admitted")

        def refused():
            if not replays:
                raise AssertionError("the trace did not replay (see the first line)")
            for cap, (alloc, need) in replays.items():
                if need > cap:
                    raise AssertionError(f"pool of {cap}: a request of {need} slots could never fit, fragmented or not")
                final = object()  # a name no learner's request can have
                if alloc.admit(final, need, 0):
                    alloc.finish(final)
                    raise AssertionError(f"pool of {cap}: the final request of {need} slots was admitted "
                                         f"(largest hole {alloc.largest_free_extent()})")

        c.prop("the final request is refused", refused, "make every hole smaller than need")

        def enough_free():
            if not replays:
                raise AssertionError("the trace did not replay (see the first line)")
            for cap, (alloc, need) in replays.items():
                if alloc.free_slots < need:
                    raise AssertionError(f"pool of {cap}: only {alloc.free_slots} slots are free for a request of "
                                         f"{need}: that is a full pool, not fragmentation")
                if alloc.largest_free_extent() < need:  # checker sanity: the simulator reports this as external
                    assert alloc.occupancy(waiting=(need, 0)).external == alloc.free_slots

        c.prop("...although at least need slots are free in total (external fragmentation)", enough_free,
               "free requests that are not neighbours, so the free slots lie in separate holes")
    return c.report
