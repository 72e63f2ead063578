"""Exercise 8, "find the bug": a longest-first preemption loop that keeps its victim's progress.

The notebook builds ``make_room_longest``: preempt the running request that
has computed the most, and, since prefix caching keeps a freed full block's
contents, let the victim keep the tokens of its full blocks
(``victim.num_computed_tokens = kept`` after ``scheduler.preempt``). That
line is the planted bug: a waiting request holds no blocks, so it has
computed nothing (``Scheduler.check``), and what a resumed request may skip
is decided at its admission by the prefix cache, from blocks that may have
been evicted since. ``PLANTED`` is the same loop, the source of truth: the
check drives it on exercise 8's victim workload (``ch08_victims``) and
derives the step, the request and the invariant from what ``check()`` says,
never from typed answers.
"""

from __future__ import annotations

import re

from ._harness import Checker, CheckReport, Mistake, WrongAnswer
from .ch08_victims import VICTIM_WORKLOAD, drive

__all__ = ["PLANTED", "planted_failure", "check_keep_progress_bug"]


def PLANTED(scheduler, request, num_new_tokens):  # noqa: N802 -- the planted loop, named as a constant
    """Preempt the running request that has computed the most."""
    manager = scheduler.kv_cache_manager
    while True:
        blocks = manager.allocate_slots(request, num_new_tokens)
        if blocks is not None:
            return blocks
        victim = max(scheduler.running, key=lambda r: r.num_computed_tokens)
        size = manager.block_size
        kept = victim.num_computed_tokens // size * size
        scheduler.preempt(victim)
        victim.num_computed_tokens = kept  # its full blocks stay cached
        if victim is request:
            return None


def planted_failure() -> dict:
    """The first ``check()`` failure of the planted loop: step, request, invariant."""
    run = drive(PLANTED)
    if run.broke is None:
        raise RuntimeError("the planted loop broke no invariant on the workload")
    step, message = run.broke
    invariant = re.search(r"invariant '([^']+)'", message).group(1)
    request = re.search(r"EngineRequest\('([^']+)'", message).group(1)
    return dict(step=step, request=request, invariant=invariant)


WRONG_STEP = Mistake("check() only at the end", "call scheduler.check() after every step: the first "
                     "step it raises at is the step the bug struck")
WRONG_INVARIANT = Mistake("another invariant", "copy the name check() gives, between the quotes of "
                          "\"invariant '...' broken\"")
WRONG_REQUEST = Mistake("another request", "check()'s message ends with the request it found breaking "
                        "the invariant")


def _located(found) -> None:
    if not isinstance(found, dict) or set(found) != {"step", "request", "invariant"}:
        raise AssertionError(f'found must be a dict with keys "step", "request" and "invariant", got {found!r}')
    truth = planted_failure()
    wrong = []
    if found["step"] != truth["step"]:
        wrong.append((f"check() first fails at another step than {found['step']!r}", WRONG_STEP))
    if found["invariant"] != truth["invariant"]:
        wrong.append((f"the invariant {found['invariant']!r} holds there", WRONG_INVARIANT))
    if found["request"] != truth["request"]:
        wrong.append((f"request {found['request']!r} breaks nothing there", WRONG_REQUEST))
    if wrong:
        raise WrongAnswer("; ".join(w for w, _ in wrong), wrong[0][1].diagnosis())


def _fixed(loop) -> None:
    run = drive(loop)
    if run.broke:
        raise AssertionError(f"step {run.broke[0]}: {run.broke[1]}")
    if len(run.ttft) != len(VICTIM_WORKLOAD):
        raise AssertionError(f"after {run.steps} steps only {sorted(run.ttft)} had sampled a token")
    for step, victim, computed, running in run.victims:
        most = max(running.values())
        if computed != most:
            raise WrongAnswer(
                f"step {step}: it preempted {victim} ({computed} tokens computed) while "
                f"{max(running, key=running.get)} had computed {most}",
                "the fix keeps the policy: the victim is the running request that has computed the most")
    if not run.victims:
        raise AssertionError("it never preempted on a workload that needs it")


def check_keep_progress_bug(found, make_room_fixed, timeout: float = 60.0) -> CheckReport:
    """Grade where the planted loop breaks (``found``) and the fixed loop (longest first, invariants held)."""
    with Checker("find the bug: the loop that keeps progress", timeout=timeout) as c:
        if found is None:
            c.probe(_stub)
        c.prop("found: the first step check() fails, the request and the invariant", lambda: _located(found))
        c.prop("the fixed loop: check() holds after every step, and the victim is still the longest",
               lambda: _fixed(make_room_fixed))
    return c.report


def _stub():
    raise NotImplementedError
