"""How much of a block a sequence leaves unwritten, and how much of a reservation is never used.

The closed forms chapter 2 checks the simulator against: the unused tail of
a sequence's last block, ``(B - length mod B) mod B``; its expectation over a
length distribution; ``(B - 1) / 2`` when residues are uniform; and the
unwritten fraction of a reservation.
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

import numpy as np

from ..common import check_int

__all__ = ["unused_tail_slots", "expected_tail_waste", "uniform_tail_waste", "over_reservation_waste"]


def unused_tail_slots(length, block_size: int):
    """Unwritten slots in the last block of a sequence of ``length`` tokens: (B - length mod B) mod B.

    Works on an int or, vectorised, on an array of lengths.
    """
    B = check_int(block_size, "block_size", 1)
    if isinstance(length, numbers.Integral) and not isinstance(length, (bool, np.bool_)):
        return (-check_int(length, "length", 1)) % B
    arr = np.asarray(length)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"lengths must be integers, got dtype {arr.dtype}")
    if arr.size and arr.min() < 1:
        raise ValueError(f"lengths must be >= 1, got {int(arr.min())}")
    return (-arr) % B


def expected_tail_waste(lengths: Sequence[int], probs: Sequence[float] | None, block_size: int) -> float:
    """E[unused tail slots] = sum over lengths of P(length) * ((B - length mod B) mod B).

    ``probs=None`` weighs every listed length equally (an empirical sample).
    """
    L = np.asarray(lengths)
    if L.ndim != 1 or L.size == 0:
        raise ValueError(f"lengths must be a non-empty 1-D sequence, got shape {L.shape}")
    tails = unused_tail_slots(L, block_size)
    if probs is None:
        return float(tails.mean())
    P = np.asarray(probs, dtype=float)
    if P.shape != L.shape:
        raise ValueError(f"probs must match lengths: {P.shape} vs {L.shape}")
    if not np.isfinite(P).all() or (P < 0).any():
        raise ValueError(f"probabilities must be finite and >= 0, got {P.tolist()}")
    if not math.isclose(P.sum(), 1.0, abs_tol=1e-9):
        raise ValueError(f"probabilities must sum to 1, got {P.sum():.12g}")
    return float(P @ tails)


def uniform_tail_waste(block_size: int) -> float:
    """The expectation when residues mod B are uniform: the mean of 0..B-1 = (B - 1) / 2."""
    return (check_int(block_size, "block_size", 1) - 1) / 2


def over_reservation_waste(used_tokens: int, reserved_tokens: int) -> float:
    """Fraction of a reservation never written: 1 - used / reserved."""
    used = check_int(used_tokens, "used_tokens", 0)
    reserved = check_int(reserved_tokens, "reserved_tokens", 1)
    if used > reserved:
        raise ValueError(f"used_tokens {used} exceeds reserved_tokens {reserved}")
    return 1 - used / reserved
