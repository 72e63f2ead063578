"""What every module of the core shares: argument checks, ceiling division, InvariantError.

One convention for bad arguments, everywhere in the library:

* ``TypeError`` when the value has the wrong type. ``bool`` (and numpy's
  ``bool_``) is refused where an integer belongs although Python counts it as
  one: ``block_size=True`` is a bug, not a block size of 1. Floats are refused
  too, even integral ones: ``16.0`` blocks hints at a computation that went
  wrong upstream.
* ``ValueError`` when the type is right and the value is not (below a minimum,
  outside an interval, NaN).

Every message names the argument and the value, so that a learner's traceback
says what to fix without reading our code. The checks run before any state
changes: a refused call leaves every structure as it was.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = ["InvariantError", "require", "cdiv", "check_int", "check_real", "check_bool"]


class InvariantError(AssertionError):
    """A ``check()`` found a broken invariant; the message names it.

    It subclasses ``AssertionError`` so that a test framework reports it as a
    failed check, but it is raised explicitly, so ``python -O`` keeps it.
    """


def require(ok, name: str, detail) -> None:
    """One law of a ``check()``: nothing if ``ok``, else ``InvariantError("invariant '<name>' broken: <detail>")``.

    Every ``check()`` in the core states its invariants this way, never with a
    bare ``assert``. ``detail`` is a string, or a function returning one when
    the message is costly or only makes sense once the law is broken.
    """
    if not ok:
        raise InvariantError(f"invariant '{name}' broken: {detail() if callable(detail) else detail}")


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers: how many blocks of ``b`` hold ``a`` tokens."""
    return -(-a // b)


def check_int(value, name: str, minimum: int | None = None) -> int:
    """``value`` as a Python int, if it is an integer (Python or numpy, never a bool) >= ``minimum``."""
    if type(value) is int:  # the fast path: most calls pass a plain int
        if minimum is not None and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_real(value, name: str, *, minimum: float | None = None, maximum: float | None = None,
               open_min: bool = False, open_max: bool = False) -> float:
    """``value`` as a float, if it is a finite real number (not a bool) in the given interval.

    ``open_min``/``open_max`` exclude the end itself; the message shows the
    interval in the usual notation, e.g. ``(0, 1]``.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    v = float(value)
    low_ok = minimum is None or (v > minimum if open_min else v >= minimum)
    high_ok = maximum is None or (v < maximum if open_max else v <= maximum)
    if not (math.isfinite(v) and low_ok and high_ok):
        lo = "-inf" if minimum is None else f"{minimum:g}"
        hi = "inf" if maximum is None else f"{maximum:g}"
        interval = f"{'(' if open_min or minimum is None else '['}{lo}, {hi}{')' if open_max or maximum is None else ']'}"
        raise ValueError(f"{name} must be a finite number in {interval}, got {value!r}")
    return v


def check_bool(value, name: str) -> bool:
    """``value`` if it is exactly True or False (not 0/1, not None)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value
