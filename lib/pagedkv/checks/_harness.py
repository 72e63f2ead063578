"""The machinery every exercise checker shares.

A checker runs a learner's function on randomized cases and compares it with
the library's implementation and with an independent oracle. It must survive
the learner's bugs: an exception, a wrong type or shape, or a hang becomes a
red line with a hint, never a crashed notebook. Each property prints exactly
one line, so a committed notebook shows a stable, readable verdict.
"""

from __future__ import annotations

import signal
import threading
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

PASS, FAIL = "\u2705", "\u274c"  # the two marks a reader scans for


class CheckTimeout(Exception):
    """The learner's code ran past the checker's time limit."""


@dataclass
class PropertyResult:
    name: str
    passed: bool
    detail: str = ""

    def line(self) -> str:
        mark = PASS if self.passed else FAIL
        return f"{mark} {self.name}" + ("" if self.passed else f" -- {self.detail}")


@dataclass
class CheckReport:
    """The verdict of one checker: one result per property; truthy when all passed."""

    title: str
    results: list[PropertyResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    def __bool__(self) -> bool:
        return self.passed

    def summary(self) -> str:
        n_ok = sum(r.passed for r in self.results)
        return f"{self.title}: {n_ok}/{len(self.results)} properties hold"

    def __str__(self) -> str:
        return "\n".join([*(r.line() for r in self.results), self.summary()])

    def __repr__(self) -> str:
        return f"<CheckReport {self.summary()}>"

    def _ipython_display_(self) -> None:
        """Show nothing more in a notebook: the checker already printed one line per property.

        (A trailing ``;`` is not a reliable way to hide the value: nbval runs cells
        without storing history, and IPython then reads the wrong cell's ``;``.)
        """


@contextmanager
def _time_limit(seconds: float):
    """Raise CheckTimeout in the main thread after ``seconds`` (a learner's infinite loop).

    Jupyter runs cells in the main thread, where SIGALRM is available on Unix.
    Elsewhere (Windows, worker threads) the limit is not enforced.
    """
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def _raise(signum, frame):
        raise CheckTimeout(f"no answer within {seconds:g} s (an infinite loop?)")

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, NotImplementedError):
        return "not implemented yet (the stub still raises NotImplementedError)"
    if isinstance(exc, CheckTimeout):
        return str(exc)
    if isinstance(exc, AssertionError):
        return str(exc) or "assertion failed"
    # Name the exception and where in the learner's code it came from, briefly.
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (line {tb[-1].lineno} in {tb[-1].name})" if tb else ""
    return f"raised {type(exc).__name__}: {exc}{where}"


class Checker:
    """Collects properties; use as ``with Checker("title") as c: c.prop(...)``.

    ``prop(name, body, hint)`` runs ``body()``; the property holds when it
    returns without raising. ``body`` signals a wrong answer with
    ``AssertionError(message)``; any other exception is the learner's crash.
    The hint is shown only on failure.
    """

    def __init__(self, title: str, timeout: float = 20.0, verbose: bool = True):
        self.report = CheckReport(title)
        self.timeout = timeout
        self.verbose = verbose

    def __enter__(self) -> "Checker":
        return self

    def __exit__(self, *exc) -> bool:
        if self.verbose:
            print(self.report.summary())
        return False  # checker bugs propagate; learner bugs never reach here

    def prop(self, name: str, body: Callable[[], None], hint: str = "") -> bool:
        try:
            with _time_limit(self.timeout):
                body()
            result = PropertyResult(name, True)
        except Exception as exc:  # noqa: BLE001 -- every learner bug becomes a red line
            detail = _describe(exc)
            if hint:
                detail += f". Hint: {hint}"
            result = PropertyResult(name, False, detail)
        self.report.results.append(result)
        if self.verbose:
            print(result.line())
        return result.passed


def expect_equal(got, want, what: str) -> None:
    """Assert equality with a message naming what differed and both values.

    Booleans are ints in Python; ``True`` never passes for ``1`` here.
    """
    if isinstance(got, bool) != isinstance(want, bool) or got != want:
        raise AssertionError(f"{what}: expected {want!r}, got {got!r}")


def expect_int(value, what: str) -> int:
    """Accept Python and numpy integers (not bools, not floats); say so otherwise."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise AssertionError(f"{what}: expected an integer, got {type(value).__name__} {value!r}")
    return int(value)
