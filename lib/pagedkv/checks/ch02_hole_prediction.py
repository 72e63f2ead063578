"""Exercise 2's prediction task: the holes a best-fit trace leaves.

The notebook shows ``HOLE_TRACE``: five requests fill a contiguous pool of
100 slots, two that are not neighbours finish, two new ones arrive under
best-fit, and a third request finishes next to a hole. The reader writes the
holes, ``(start, length)`` by address, into ``predicted_holes`` before running
anything. ``check_hole_prediction`` runs the trace on the library's
``VariableExtentAllocator``, compares, and on a mismatch draws the pool as
the trace leaves it above the pool as predicted (the book's
``draw_extents``). A small model of the allocator replays the trace with one
rule changed (first-fit, no merging, the largest hole) to name the rule a
wrong answer points to.
"""

from __future__ import annotations

import numbers

from ..sim.allocators import VariableExtentAllocator
from ._harness import Mistake, catalogue
from .predict_harness import PredictionReport, check_prediction

__all__ = ["check_hole_prediction", "HOLE_TRACE", "run_hole_trace"]

CAPACITY = 100

#: The trace, as the notebook shows it (and as the checker runs it).
HOLE_TRACE = """\
pool = sim.VariableExtentAllocator(100, 100, policy="best-fit")
for name, size in [("a", 30), ("b", 10), ("c", 20), ("d", 15), ("e", 25)]:
    pool.admit(name, size)            # a at slot 0, b at 30, ..., e at 75
pool.finish("a")                      # a hole of 30 slots at 0
pool.finish("c")                      # a hole of 20 slots at 40
pool.admit("f", 12)
pool.admit("g", 18)
pool.finish("d")
"""

_OPS = [("admit", "a", 30), ("admit", "b", 10), ("admit", "c", 20), ("admit", "d", 15),
        ("admit", "e", 25), ("finish", "a"), ("finish", "c"), ("admit", "f", 12),
        ("admit", "g", 18), ("finish", "d")]


def run_hole_trace() -> VariableExtentAllocator:
    """Run ``HOLE_TRACE`` on the library's allocator."""
    from .. import sim

    namespace: dict = {"sim": sim}
    exec(HOLE_TRACE, namespace)  # noqa: S102 -- the module's own constant
    return namespace["pool"]


def hole_model(policy: str = "best-fit", *, merge: bool = True) -> list[tuple[int, int]]:
    """The holes after ``_OPS`` under ``policy`` ("first-fit", "best-fit" or
    "largest"), with or without merging a freed extent into its neighbours."""
    holes = [(0, CAPACITY)]
    where: dict[str, tuple[int, int]] = {}
    for op in _OPS:
        if op[0] == "admit":
            _, name, size = op
            fits = [h for h in holes if h[1] >= size]
            if policy == "first-fit":
                hole = fits[0]
            elif policy == "best-fit":
                hole = min(fits, key=lambda h: (h[1], h[0]))
            else:
                hole = max(fits, key=lambda h: (h[1], -h[0]))
            holes.remove(hole)
            if hole[1] > size:
                holes.append((hole[0] + size, hole[1] - size))
            where[name] = (hole[0], size)
        else:
            holes.append(where.pop(op[1]))
        holes.sort()
        if merge:
            merged: list[tuple[int, int]] = []
            for s, n in holes:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((s, n))
            holes = merged
    return holes


HOLE_MISTAKES = [
    Mistake("first-fit's holes", "best-fit puts a request in the smallest "
            "hole that fits it, not the lowest-addressed one: f goes into "
            "c's hole of 20, leaving a's 30 for g",
            lambda: hole_model("first-fit")),
    Mistake("freed neighbours kept apart", "a freed extent merges with the "
            "free slots next to it: no two holes ever touch",
            lambda: hole_model(merge=False)),
    Mistake("the largest hole", "best-fit takes the smallest hole that fits "
            "the request, not the largest", lambda: hole_model("largest")),
]


def _read(predicted) -> list[tuple[int, int]]:
    shape = ("expected the holes as a list of (start, length) pairs by address, "
             "such as [(0, 10), (50, 5)]")
    try:
        holes = [tuple(h) for h in predicted]
    except TypeError:
        raise AssertionError(f"{shape}; got {type(predicted).__name__} {predicted!r:.40}") from None
    if isinstance(predicted, (str, bytes)) or any(
            len(h) != 2 or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in h)
            for h in holes):
        raise AssertionError(f"{shape}; got {predicted!r:.60}")
    return sorted((int(s), int(n)) for s, n in holes)  # in any order: by address


def _compare(got, want) -> str | None:
    if got == want:
        return None
    words = f"you predicted the holes {got}, the trace leaves {want}"
    for s, n in got:
        if n <= 0 or s < 0 or s + n > CAPACITY:
            return f"{words}: ({s}, {n}) is not a hole of a {CAPACITY}-slot pool"
    total = sum(n for _, n in got)
    if total != sum(n for _, n in want):
        return f"{words}: {total} slots free in all, the trace leaves {sum(n for _, n in want)}"
    return words


def _diagnose(got) -> str | None:
    for m in HOLE_MISTAKES:
        if m.model() == got:
            return m.diagnosis()
    return None


class _PredictedPool:
    """The trace's pool as predicted: what ``draw_extents`` reads of an allocator.

    The slots between the predicted holes are drawn held, each run labelled
    with the requests the trace put inside it (or ``?``).
    """

    def __init__(self, actual: VariableExtentAllocator, holes) -> None:
        self.capacity = actual.capacity
        self._holes = sorted(holes)
        self._held: dict[str, tuple[int, int]] = {}
        placed = actual.allocated_extents()
        start = 0
        for s, n in [*self._holes, (self.capacity, 0)]:
            if s > start:
                inside = [rid for rid, (a, m) in sorted(placed.items(), key=lambda kv: kv[1])
                          if a >= start and a + m <= s]
                self._held["+".join(inside) or f"? at {start}"] = (start, s - start)
            start = max(start, s + n)

    def allocated_extents(self):
        return dict(self._held)

    def free_extents(self):
        return list(self._holes)


def _picture(got):
    import matplotlib.pyplot as plt

    from ..views.fragmentation import draw_extents

    actual = run_hole_trace()
    valid = [(s, n) for s, n in got if n > 0 and s >= 0 and s + n <= CAPACITY]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.8, 2.6))
    draw_extents(actual, top, f"the trace: holes {actual.free_extents()}")
    draw_extents(_PredictedPool(actual, valid), bottom, f"your prediction: holes {got}")
    fig.tight_layout()
    plt.close(fig)  # shown once, by the checker, not again at the end of the cell
    return fig


def check_hole_prediction(predicted_holes) -> PredictionReport:
    """Grade a prediction of the holes ``HOLE_TRACE`` leaves: ``[(start, length), ...]`` by address."""
    want = run_hole_trace().free_extents()
    return check_prediction(
        "prediction", "predicted_holes", predicted_holes, want,
        read=_read, compare=_compare, draw=_picture, diagnose=_diagnose,
        name="your holes, by address, are the ones the trace leaves",
        hint="draw the 100 slots and replay the trace: which hole does "
             "each new request take?")


catalogue(check_hole_prediction, HOLE_MISTAKES)
