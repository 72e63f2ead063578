"""The contract every fuzz target enforces, and the limits it runs under.

For every input: it loads (or renders, or generates), or it raises the
documented ``ValueError``/``TypeError`` whose message names the file or the
argument; no other exception escapes; it takes at most ``LIMIT_S`` seconds of
CPU time; and the process stays under ``ADDRESS_SPACE`` bytes of address
space (``RLIMIT_AS``), so an allocation sized from an unchecked header field
fails as a ``MemoryError``, which is a violation like any other escape.

CPU time, not wall-clock time, is measured: the fuzzer shares a 2-core
machine, and a busy neighbour must not turn a fast input into a "hang". A
real hang is also stopped by libFuzzer's wall-clock ``-timeout`` while
fuzzing, and by ``wall_clock_alarm`` when the corpus is replayed.
"""

from __future__ import annotations

import resource
import signal
import time
from contextlib import contextmanager

__all__ = ["LIMIT_S", "ADDRESS_SPACE", "Violation", "limit_address_space", "attempt", "no_exception",
           "timed", "wall_clock_alarm"]

LIMIT_S = 1.0
ADDRESS_SPACE = 2 << 30


class Violation(Exception):
    """An input broke the contract; the message says how (and chains the exception that escaped)."""


def limit_address_space(limit: int = ADDRESS_SPACE) -> None:
    """Cap this process's address space (``RLIMIT_AS``); never raises an existing lower cap."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft > limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def attempt(call, *names: str):
    """``call()``'s result, or None where it raised ValueError/TypeError naming one of ``names``.

    Raises ``Violation`` for any other exception, and for a ValueError/TypeError
    whose message names none of ``names`` (the reader could not tell what to fix).
    """
    try:
        return call()
    except (ValueError, TypeError) as e:
        if not any(n in str(e) for n in names):
            raise Violation(f"{type(e).__name__} names none of {names}: {e}") from e
        return None
    except Violation:
        raise
    except Exception as e:  # MemoryError, RecursionError, KeyError, ...: all escapes
        raise Violation(f"{type(e).__name__} escaped: {e}") from e


@contextmanager
def no_exception(what: str):
    """The body must not raise at all: ``what`` was accepted, so using it must work."""
    try:
        yield
    except Violation:
        raise
    except Exception as e:
        raise Violation(f"{what} raised {type(e).__name__}: {e}") from e


def timed(run, data: bytes, limit_s: float = LIMIT_S) -> float:
    """Run ``run(data)``; its CPU seconds. ``Violation`` past ``limit_s``."""
    start = time.process_time()
    run(data)
    spent = time.process_time() - start
    if spent > limit_s:
        raise Violation(f"the input took {spent:.2f} s of CPU time (the limit is {limit_s:g} s)")
    return spent


class _WallClock(BaseException):
    """Raised by the alarm; a BaseException so that no ``except Exception`` in the code under test eats it."""


@contextmanager
def wall_clock_alarm(seconds: float):
    """Stop the body after ``seconds`` of wall-clock time with a ``Violation`` (main thread only).

    Not used while fuzzing: libFuzzer's own ``-timeout`` uses SIGALRM.
    """
    def ring(signum, frame):
        raise _WallClock()

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _WallClock:
        raise Violation(f"the input ran past {seconds:g} s of wall-clock time (a hang?)") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
