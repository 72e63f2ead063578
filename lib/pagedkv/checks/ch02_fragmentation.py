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

* ``best_fit_wins() -> (capacity, layout, frees, requests)`` and
  ``first_fit_wins()``, the same shape: a pool of ``capacity`` slots, extents
  of the sizes in ``layout`` admitted from address 0, the extents at the
  indices in ``frees`` finished, then ``requests`` admitted in order. Under
  the winning policy every request is admitted; under the other one at least
  one is refused. Both are replayed on ``VariableExtentAllocator`` with each
  policy.

Each is compared with the library (``pagedkv.sim``) and with an
independent oracle written here (a block count for tail waste, a slot bitmap
for free extents), on known answers and seeded random cases. The block sizes
of the tail-waste cases (1, 2, 8 and so on) are the chapter's arithmetic, not
vLLM's: a residue argument holds for any size. The design task
(``largest_block_size``), where the sizes are vLLM's, is in
``ch02_block_size``; the prediction task in ``ch02_hole_prediction``.
"""

from __future__ import annotations

import math
import numbers
import random
from typing import NamedTuple

import numpy as np

from ..sim.allocators import VariableExtentAllocator
from ..sim.tail_waste import expected_tail_waste
from ._harness import (Checker, CheckReport, Mistake, WrongAnswer, catalogue,
                       expect_equal, expect_int, wrong)

__all__ = ["check_expected_tail_waste", "check_largest_free_extent",
           "check_fragmenting_trace", "check_best_fit_wins",
           "check_first_fit_wins"]


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


def _expect_close(got, want: float, what: str, args=None, fn=None) -> None:
    got = _expect_real(got, what)
    if not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9):
        message = f"{what}: expected {want:.6g}, got {got!r}"
        if args is None:
            raise AssertionError(message)
        raise wrong(message, got, args, TAIL_MISTAKES, fn, _TAIL_PROBES)


# ------------------------------------------------------------------ mistakes
def _weighted(waste):
    return lambda L, P, B: sum(p * waste(n, B) for n, p in zip(L, P))


TAIL_MISTAKES = [
    Mistake("a full last block charged", "a sequence that fills its last "
            "block exactly was charged a whole block of waste: it wastes "
            "nothing",
            _weighted(lambda n, B: B - n % B)),
    Mistake("used slots, not free ones", "this counts the tokens in the "
            "last block: the waste is the slots of it left unwritten",
            _weighted(lambda n, B: n % B)),
    Mistake("a floor where a ceil belongs", "the waste came out negative: "
            "a sequence holds its partial last block whole, so it holds at "
            "least as many slots as tokens",
            _weighted(lambda n, B: (n // B) * B - n)),
    Mistake("probabilities ignored", "a plain average assumes every length "
            "equally likely: an expectation weights each waste by its "
            "probability",
            lambda L, P, B: sum((-n) % B for n in L) / len(L)),
    Mistake("not divided or weighted", "this is the total over the "
            "lengths, not an expectation: each length's waste counts with "
            "its probability",
            lambda L, P, B: float(sum((-n) % B for n in L))),
    Mistake("the uniform shortcut", "(B - 1) / 2 holds only when every "
            "residue mod B is equally likely, which these lengths are not",
            lambda L, P, B: (B - 1) / 2),
]
_TAIL_PROBES = [([1, 15, 16, 17], [0.1, 0.1, 0.7, 0.1], 16), ([5, 40], [0.5, 0.5], 8)]


def _gaps(allocated, capacity, *, sort=True, head=True, tail=True, off=0):
    best, end = 0, 0
    for i, (start, length) in enumerate(sorted(allocated) if sort else allocated):
        if head or i:
            best = max(best, start - end - off)
        end = start + length
    return max(best, capacity - end - off) if tail else (best if allocated else capacity)


EXTENT_MISTAKES = [
    Mistake("total free, not the largest hole", "this adds the holes up: "
            "a request needs its slots in one run",
            lambda A, cap: cap - sum(n for _, n in A)),
    Mistake("the hole after the last extent missed", "the free run from "
            "the last extent's end up to capacity is a hole too",
            lambda A, cap: _gaps(A, cap, tail=False)),
    Mistake("the hole before the first extent missed", "the free run from "
            "slot 0 up to the first extent is a hole too", lambda A, cap: _gaps(A, cap, head=False)),
    Mistake("extents not sorted", "they come in any order: holes lie "
            "between neighbours by address, not by place in the list", lambda A, cap: _gaps(A, cap, sort=False)),
    Mistake("off by one", "every hole came out one slot short: an extent "
            "(start, length) ends just before slot start + length, where the "
            "free run begins", lambda A, cap: _gaps(A, cap, off=1)),
]
_EXTENT_PROBES = [([(70, 10), (0, 10), (30, 10)], 100), ([(10, 5)], 40), ([(20, 5)], 30),
                  ([(30, 30), (90, 10)], 100)]


def _expect_extent(fn, allocated, capacity, want, what: str) -> None:
    got = expect_int(fn(list(allocated), capacity), what)
    if got != want:
        raise wrong(f"{what}: expected {want}, got {got}", got, (list(allocated), capacity),
                    EXTENT_MISTAKES, fn, _EXTENT_PROBES)


# ------------------------------------------------------------------ (a) tail waste
def check_expected_tail_waste(fn, cases: int = 200, seed: int = 0, timeout: float = 20.0) -> CheckReport:
    """Check ``fn(lengths, probs, block_size) -> float``."""
    rng = random.Random(seed)
    with Checker("expected_tail_waste", timeout=timeout) as c:
        c.probe(lambda: fn([1, 15, 16, 17], [0.25] * 4, 16))

        def single_lengths():
            for n, want in ((1, 15), (15, 1), (16, 0), (17, 15), (32, 0), (33, 15)):
                _expect_close(fn([n], [1.0], 16), want, f"one sequence of {n} tokens at block 16",
                              ([n], [1.0], 16), fn)

        c.prop("single lengths 1, 15, 16, 17 waste 15, 1, 0, 15 slots at block 16", single_lengths,
               "the last block holds length mod B tokens -- and a full last block wastes nothing")

        def equal_four():
            _expect_close(fn([1, 15, 16, 17], [0.25] * 4, 16), 7.75, "lengths 1, 15, 16, 17 equally likely",
                          ([1, 15, 16, 17], [0.25] * 4, 16), fn)

        c.prop("lengths 1, 15, 16, 17 equally likely give 7.75", equal_four, "weight each length's waste by its probability")

        def unequal_four():
            probs = [0.1, 0.1, 0.7, 0.1]
            _expect_close(fn([1, 15, 16, 17], probs, 16), expected_tail_waste([1, 15, 16, 17], probs, 16),
                          "lengths 1, 15, 16, 17 with probabilities 0.1, 0.1, 0.7, 0.1",
                          ([1, 15, 16, 17], probs, 16), fn)

        c.prop("the same lengths, not equally likely, are not 7.75 (here 3.1)", unequal_four,
               "use probs; a plain average of the four wastes assumes equal likelihood")

        def uniform():
            for B in (1, 2, 8, 16, 128):
                lengths = list(range(1000, 1000 + B))
                _expect_close(fn(lengths, [1 / B] * B, B), (B - 1) / 2, f"every residue mod {B} equally likely",
                              (lengths, [1 / B] * B, B), fn)

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
                assert math.isclose(want, expected_tail_waste(lengths, probs, B), abs_tol=1e-9)  # checker sanity
                _expect_close(fn(lengths, probs, B), want, f"lengths {lengths}, block {B}",
                              (lengths, probs, B), fn)

        c.prop(f"{cases} random length distributions match an independent count", randomized,
               "the message names the distribution: work its waste out by hand")
    return c.report


catalogue(check_expected_tail_waste, TAIL_MISTAKES)


# ------------------------------------------------------------------ (b) largest free extent
def _random_first_fit_state(rng: random.Random, capacity: int) -> VariableExtentAllocator:
    """A first-fit allocator after a random run of admissions and finishes (holes in odd places)."""
    alloc = VariableExtentAllocator(capacity, capacity, "first-fit")
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
        c.probe(lambda: fn([(30, 30), (90, 10)], 100))

        def empty_and_full():
            _expect_extent(fn, [], 100, 100, "an empty pool of 100 slots")
            _expect_extent(fn, [(0, 100)], 100, 0, "a pool held by one extent")
            _expect_extent(fn, [(0, 40), (40, 60)], 100, 0, "a pool held by two extents")

        c.prop("an empty pool is one hole; a full pool has none", empty_and_full,
               "with nothing allocated, the whole pool is free")

        def chapter_example():
            # Four requests of 30, 30, 30, 10 slots; the 1st and 3rd finished: holes 0-29 and 60-89.
            _expect_extent(fn, [(30, 30), (90, 10)], 100, 30, "holes of 30 and 30")

        c.prop("holes of 30 and 30 slots: the largest is 30, not the 60 free in total", chapter_example,
               "a request needs its slots in one run")

        def edges():
            _expect_extent(fn, [(10, 5)], 40, 25, "extent at 10..14 of 40")
            _expect_extent(fn, [(0, 5), (35, 5)], 40, 30, "extents at both ends")
            _expect_extent(fn, [(20, 5)], 30, 20, "extent at 20..24 of 30")

        c.prop("holes before the first extent and after the last one count", edges,
               "look at the gap from slot 0 and the gap up to capacity too")

        def unsorted():
            _expect_extent(fn, [(70, 10), (0, 10), (30, 10)], 100, 30, "extents given out of address order")

        c.prop("extents listed out of address order", unsorted,
               "in which order do the holes lie in the pool?")

        def randomized():
            for _ in range(cases):
                capacity = rng.choice([16, 100, 1000, 4096])
                alloc = _random_first_fit_state(rng, capacity)
                extents = list(alloc.allocated_extents().values())
                rng.shuffle(extents)
                want = _oracle_largest(extents, capacity)
                assert want == alloc.largest_free_extent()  # checker sanity: library and oracle agree
                _expect_extent(fn, extents, capacity, want, f"pool of {capacity}, extents {sorted(extents)}")

        c.prop(f"{cases} random first-fit states match the allocator and a slot bitmap", randomized,
               "walk the extents by address and measure each gap")
    return c.report


catalogue(check_largest_free_extent, EXTENT_MISTAKES)


# ------------------------------------------------------------------ (b) a trace that fragments
def _replay(ops, capacity: int) -> VariableExtentAllocator:
    """Run the learner's operations on the library's first-fit allocator; AssertionError on a malformed op."""
    if not isinstance(ops, (list, tuple)):
        raise AssertionError(f"ops: expected a list of tuples, got {type(ops).__name__}")
    alloc = VariableExtentAllocator(capacity, capacity, "first-fit")
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
        c.probe(lambda: fn(capacities[0]))
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
                    raise WrongAnswer(f"pool of {cap}: the final request of {need} slots was admitted "
                                      f"(largest hole {alloc.largest_free_extent()})",
                                      TRACE_MISTAKES[1].diagnosis())

        c.prop("the final request is refused", refused, "make every hole smaller than need")

        def enough_free():
            if not replays:
                raise AssertionError("the trace did not replay (see the first line)")
            for cap, (alloc, need) in replays.items():
                if alloc.free_slots < need:
                    raise WrongAnswer(f"pool of {cap}: only {alloc.free_slots} slots are free for a request of "
                                      f"{need}: that is a full pool, not fragmentation",
                                      TRACE_MISTAKES[0].diagnosis())
                if alloc.largest_free_extent() < need:  # checker sanity: the simulator reports this as external
                    assert alloc.occupancy(waiting=(need, 0)).external == alloc.free_slots

        c.prop("...although at least need slots are free in total (external fragmentation)", enough_free,
               "free requests that are not neighbours, so the free slots lie in separate holes")
    return c.report


TRACE_MISTAKES = [
    Mistake("a full pool", "refusing a request because too few slots are "
            "free is shortage, not fragmentation: leave need slots free"),
    Mistake("one big hole", "the freed requests were neighbours (or the "
            "holes add up to need): free requests with a live one between "
            "them, and make every hole smaller than need"),
]
catalogue(check_fragmenting_trace, TRACE_MISTAKES)


# ------------------------------------------- (d) a trace each policy wins
POLICIES = ("first-fit", "best-fit")

POLICY_MISTAKES = [
    Mistake("the policies swapped", "this trace makes the other policy win: "
            "it answers the other function"),
    Mistake("one hole", "with a single hole both policies choose it: free "
            "extents that are not neighbours (a live one between them) so "
            "that two or more holes remain"),
    Mistake("more asked than free", "the requests add up to more than the "
            "free slots, so no policy admits them all: that is shortage, not "
            "placement"),
    Mistake("requests of one size", "requests of one size fill each hole the "
            "same way under both policies: sizes must differ, so that where "
            "one request goes decides whether a later one fits"),
    Mistake("no request refused", "both policies admit every request: let "
            "the losing policy put an early request in the hole that a later, "
            "bigger request needs"),
]


class _Policy(NamedTuple):
    capacity: int
    layout: list
    frees: list
    requests: list


def _unpack_policy_trace(result) -> _Policy:
    """The learner's (capacity, layout, frees, requests), or AssertionError."""
    if not (isinstance(result, tuple) and len(result) == 4):
        raise AssertionError(f"expected (capacity, layout, frees, requests), "
                             f"got {type(result).__name__} {result!r:.80}")
    capacity = expect_int(result[0], "capacity")
    parts = []
    for name, seq in zip(("layout", "frees", "requests"), result[1:]):
        if not isinstance(seq, (list, tuple)):
            raise AssertionError(f"{name}: expected a list of integers, got "
                                 f"{type(seq).__name__} {seq!r:.60}")
        parts.append([expect_int(x, f"{name}[{i}]")
                      for i, x in enumerate(seq)])
    layout, frees, requests = parts
    if capacity < 1 or capacity > 1_000_000:
        raise AssertionError(f"capacity {capacity}: choose 1 to 1,000,000 "
                             "slots")
    if any(size < 1 for size in layout + requests):
        raise AssertionError("every extent and request holds at least one "
                             "slot")
    if sum(layout) > capacity:
        raise AssertionError(f"the layout's extents add up to {sum(layout)} "
                             f"slots, more than the pool's {capacity}")
    if any(not 0 <= i < len(layout) for i in frees) or (
            len(set(frees)) != len(frees)):
        raise AssertionError(f"frees {frees}: each is the index of one "
                             f"extent of the layout (0 to {len(layout) - 1}), "
                             "once")
    if not requests:
        raise AssertionError("requests is empty: nothing to admit")
    return _Policy(capacity, layout, frees, requests)


def _replay_policy(trace: _Policy, policy: str):
    """(holes before the requests, admitted or not for each request)."""
    alloc = VariableExtentAllocator(trace.capacity, trace.capacity, policy)
    for i, size in enumerate(trace.layout):
        assert alloc.admit(("extent", i), size)  # one hole: always fits
    for i in trace.frees:
        alloc.finish(("extent", i))
    holes = alloc.free_extents()
    admitted = [alloc.admit(("request", k), size)
                for k, size in enumerate(trace.requests)]
    return holes, admitted


def _diagnose_policy(trace: _Policy, winner: str) -> str | None:
    loser = POLICIES[0] if winner == POLICIES[1] else POLICIES[1]
    holes, won = _replay_policy(trace, winner)
    _, lost = _replay_policy(trace, loser)
    if all(lost) and not all(won):
        return POLICY_MISTAKES[0].diagnosis()
    if len(holes) < 2:
        return POLICY_MISTAKES[1].diagnosis()
    if sum(trace.requests) > sum(n for _, n in holes):
        return POLICY_MISTAKES[2].diagnosis()
    if len(set(trace.requests)) == 1:
        return POLICY_MISTAKES[3].diagnosis()
    if all(won) and all(lost):
        return POLICY_MISTAKES[4].diagnosis()
    return None


def _check_policy_trace(fn, winner: str, timeout: float) -> CheckReport:
    loser = POLICIES[0] if winner == POLICIES[1] else POLICIES[1]
    title = f"{winner.replace('-', '_')}_wins"
    with Checker(title, timeout=timeout) as c:
        c.probe(fn)
        got: dict[str, _Policy] = {}

        def well_formed():
            got["trace"] = trace = _unpack_policy_trace(fn())
            holes, _ = _replay_policy(trace, winner)
            got["holes"] = holes

        c.prop("(capacity, layout, frees, requests) replays: layout fits, "
               "frees name extents", well_formed,
               "layout and requests are sizes in slots; frees are indices "
               "into layout")

        def outcome(policy: str, want_all: bool):
            def body():
                if "trace" not in got:
                    raise AssertionError("the trace did not replay (see the "
                                         "first line)")
                trace = got["trace"]
                _, admitted = _replay_policy(trace, policy)
                if all(admitted) == want_all:
                    return
                refused = [s for s, ok in zip(trace.requests, admitted)
                           if not ok]
                verdict = (f"refused {refused}" if refused
                           else "admitted every request")
                raise WrongAnswer(
                    f"holes {got['holes']}, requests {trace.requests}: "
                    f"{policy} {verdict}", _diagnose_policy(trace, winner))
            return body

        c.prop(f"{winner} admits every request", outcome(winner, True),
               f"replay it by hand: {winner} takes the "
               + ("smallest hole that fits" if winner == "best-fit"
                  else "lowest-addressed hole that fits"))
        c.prop(f"{loser} refuses at least one", outcome(loser, False),
               "let one policy spend the hole that a later request needs")
    return c.report


def check_best_fit_wins(fn, timeout: float = 20.0) -> CheckReport:
    """Check ``fn() -> (capacity, layout, frees, requests)``: best-fit admits
    every request, first-fit refuses one."""
    return _check_policy_trace(fn, "best-fit", timeout)


def check_first_fit_wins(fn, timeout: float = 20.0) -> CheckReport:
    """Check ``fn() -> (capacity, layout, frees, requests)``: first-fit admits
    every request, best-fit refuses one."""
    return _check_policy_trace(fn, "first-fit", timeout)


catalogue(check_best_fit_wins, POLICY_MISTAKES)
catalogue(check_first_fit_wins, POLICY_MISTAKES)
