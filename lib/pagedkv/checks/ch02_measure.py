"""Exercise 2, modify and measure: a worst-fit hole policy on a contiguous pool.

The reader writes ``worst_fit(holes, need) -> start | None`` and hands it to
``sim.VariableExtentAllocator(..., policy=worst_fit)`` (the allocator's
documented extension point), predicts the mean share of the pool lost to
external fragmentation over the notebook's trace, then measures it with
``sim.simulate``. The checker replays the same trace with the reader's
policy, so a measurement is graded against *that* policy, right or wrong.
"""

from __future__ import annotations

import functools
import random

from ..sim.allocators import VariableExtentAllocator
from ..sim.waste_sim import simulate
from ..sim.workloads import make_request_trace
from ._harness import Mistake, WrongAnswer, catalogue, name_mistake
from .measure_harness import Experiment, check_experiment, percent_mistake

__all__ = ["check_worst_fit_experiment", "FIT_EXPERIMENT"]

#: The notebook's workload: heavy-tailed requests reserving prompt +
#: max_new_tokens contiguous slots, in a pool of 32,768 slots.
FIT_EXPERIMENT = dict(workload="heavy-tailed", num_requests=300, arrival_rate=0.1, seed=3,
                      capacity=32_768, max_model_len=8_192, max_steps=3_000)


def _trace():
    e = FIT_EXPERIMENT
    return make_request_trace(e["workload"], e["num_requests"], arrival_rate=e["arrival_rate"],
                              seed=e["seed"], max_model_len=e["max_model_len"])


def external_share(policy) -> float:
    """The mean share of the pool that is external fragmentation, over the notebook's trace."""
    if isinstance(policy, str):
        return _library_share(policy)
    e = FIT_EXPERIMENT
    pool = VariableExtentAllocator(e["capacity"], e["max_model_len"], policy)
    return simulate(pool, _trace(), max_steps=e["max_steps"]).mean_fractions()["external"]


@functools.lru_cache(maxsize=None)
def _library_share(policy: str) -> float:
    e = FIT_EXPERIMENT
    pool = VariableExtentAllocator(e["capacity"], e["max_model_len"], policy)
    return simulate(pool, _trace(), max_steps=e["max_steps"]).mean_fractions()["external"]


def _worst(holes, need):
    fits = [(n, -s) for s, n in holes if n >= need]
    return -max(fits)[1] if fits else None


def _first(holes, need):
    return next((s for s, n in holes if n >= need), None)


def _best(holes, need):
    fits = [(n, s) for s, n in holes if n >= need]
    return min(fits)[1] if fits else None


def _worst_high(holes, need):
    fits = [(n, s) for s, n in holes if n >= need]
    return max(fits)[1] if fits else None


def _largest_unchecked(holes, need):
    return max(holes, key=lambda h: (h[1], -h[0]))[0] if holes else None


def _length(holes, need):
    fits = [(n, -s) for s, n in holes if n >= need]
    return max(fits)[0] if fits else None


RULE_MISTAKES = [
    Mistake("first-fit", "that is the lowest-addressed hole that fits; worst-fit takes the "
            "largest", _first),
    Mistake("best-fit", "that is the smallest hole that fits; worst-fit takes the largest", _best),
    Mistake("ties to the highest address", "among holes of equal length take the lowest "
            "address, as the library's policies do", _worst_high),
    Mistake("a hole too small", "the largest hole may still be smaller than the request: "
            "return None then (refuse), or the allocator raises", _largest_unchecked),
    Mistake("the length, not the start", "return the hole's start address; the allocator "
            "places the request at the front of that hole", _length),
]

MEASUREMENT_MISTAKES = [
    Mistake("the library's first-fit measured", "your allocator was built without your "
            "policy: pass policy=worst_fit", lambda true: external_share("first-fit")),
    Mistake("the library's best-fit measured", "pass policy=worst_fit, your function",
            lambda true: external_share("best-fit")),
    percent_mistake("share"),
]


def _holes_case(rng: random.Random):
    holes, at = [], rng.randrange(0, 5)
    for _ in range(rng.randrange(0, 7)):
        n = rng.choice([rng.randrange(1, 40), rng.randrange(1, 6)])
        holes.append((at, n))
        at += n + rng.randrange(1, 20)  # a held extent between two holes
    need = rng.randrange(1, 45)
    return holes, need


def _fixed_cases():
    return [([(0, 30), (40, 20)], 12),      # the largest comes first
            ([(0, 10), (15, 30), (50, 30)], 5),  # equal largest: the lower address
            ([(0, 10), (20, 8)], 11),        # nothing fits
            ([], 3),                         # no hole at all
            ([(5, 4), (12, 9), (30, 6)], 9)]  # only one fits, exactly


def check_worst_fit_experiment(worst_fit, predicted_external=None, measured_external=None,
                               verbose: bool = True):
    """Grade exercise 2's experiment: the policy, the measurement, the prediction."""

    def check_rule():
        rng = random.Random(2)
        cases = _fixed_cases() + [_holes_case(rng) for _ in range(300)]
        for holes, need in cases:
            got = worst_fit([tuple(h) for h in holes], need)
            want = _worst(holes, need)
            if got != want:
                raise WrongAnswer(f"holes {holes}, need {need}: expected {want!r}, got {got!r}",
                                  name_mistake(got, (holes, need), RULE_MISTAKES, worst_fit,
                                               probes=cases[:12]))

    def lesson(pred, true):
        first = external_share("first-fit")
        if abs(pred - first) < abs(pred - true) and pred > true:
            return (f"first-fit loses {first:.1%} here, worst-fit {true:.1%}: the fit rule moves "
                    "external fragmentation by a few points at most. What strands memory is the "
                    "head of the queue reserving its whole max_new_tokens in one piece, which "
                    "no choice of hole removes -- only paging does")
        if pred > true:
            return ("worst-fit keeps the remainders of holes large, so the next request often "
                    "still fits one: it strands less than the textbook warning suggests on "
                    "requests this varied")
        return ("external fragmentation here is not a rare event: the request waiting at the "
                f"head reserves prompt + max_new_tokens (up to {FIT_EXPERIMENT['max_model_len']:,} "
                "slots) and waits whenever no single hole holds that, whatever rule placed the "
                "others")

    def probe():
        return worst_fit([(0, 8), (10, 4)], 3)

    e = Experiment(
        title="experiment: worst-fit", rule="worst_fit takes the largest hole that fits",
        check_rule=check_rule, probe=probe,
        remeasure=lambda: external_share(worst_fit),
        what="the mean external share of the pool", measured=measured_external,
        predicted=predicted_external, measured_name="measured_external",
        predicted_name="predicted_external", lesson=lesson, fmt=lambda v: f"{v:.2%}",
        tolerance=5e-4, prediction_tolerance=0.05, measurement_mistakes=MEASUREMENT_MISTAKES,
        rule_hint="sort nothing: scan the holes once, keep the largest that fits",
        measure_hint="simulate the trace on VariableExtentAllocator(32_768, 8_192, worst_fit) "
                     "and read mean_fractions()['external']")
    if isinstance(worst_fit, str) or not callable(worst_fit):
        report = check_experiment(
            Experiment(**{**e.__dict__, "check_rule": _refuse_name(worst_fit),
                          "remeasure": _refuse_name(worst_fit), "stub_policy": False}), verbose)
        return report
    return check_experiment(e, verbose)


def _refuse_name(policy):
    def body():
        if isinstance(policy, str):
            raise WrongAnswer(f"worst_fit is the string {policy!r}",
                              "the library's own rule -- a name the allocator already knows is "
                              "its answer, not yours: write a function choose(holes, need)")
        raise WrongAnswer(f"worst_fit is {type(policy).__name__} {policy!r}, not a function",
                          "the extension point takes a function choose(holes, need) -> "
                          "start | None")
    return body


catalogue(check_worst_fit_experiment, RULE_MISTAKES, MEASUREMENT_MISTAKES)
