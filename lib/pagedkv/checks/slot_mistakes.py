"""The slot-mapping mistakes exercise 5 names, in numpy and in Triton.

``SLOT_MISTAKES`` models what a learner who swaps one piece of the formula
``slot = block_table[r, p // B] * B + p % B`` answers; ``diagnose_slots``
names the one that gives a wrong answer.
"""

from __future__ import annotations

import numpy as np

from ..common import cdiv
from ._harness import Mistake, name_mistake

__all__ = ["SLOT_MISTAKES", "diagnose_slots"]


def _wrap32(x: int) -> int:
    return (x + 2**31) % 2**32 - 2**31


def _model(table, reqs, positions, block_size, *, column=None, slot=None,
           padding=None, wrap=False) -> list[int]:
    """The slots a learner computes with one piece of the formula swapped."""
    t = np.asarray(table).tolist()
    out = []
    for r, p in zip(np.asarray(reqs).tolist(), np.asarray(positions).tolist()):
        if r == -1 and padding is None:
            out.append(-1)
            continue
        col = p // block_size if column is None else column(p, block_size)
        if col < 0 or col >= len(t[r]):
            raise IndexError(col)
        block = t[r][col]
        s = block * block_size + p % block_size if slot is None else slot(block, p, block_size, len(t[r]))
        if r == -1:
            s = padding(s)
        out.append(_wrap32(s) if wrap else s)
    return out


SLOT_MISTAKES = [
    Mistake("int32 wrap", "block ids are int32 and block_id x block_size "
            "passes 2**31: an int32 product wraps to a negative slot",
            lambda *a: _model(*a, wrap=True)),
    Mistake("padding looked up in row -1", "a padding token's row is -1: "
            "looking it up reads outside the table (in numpy and PyTorch, "
            "the last row), and its slot must be -1",
            lambda *a: _model(*a, padding=lambda s: s)),
    Mistake("padding given 0", "a padding token's slot is -1, so the KV "
            "write skips it; 0 is a real slot, block 0's first",
            lambda *a: _model(*a, padding=lambda s: 0)),
    Mistake("a ceil where a floor belongs", "position p sits in column "
            "p // block_size: positions 0 .. B-1 are column 0",
            lambda *a: _model(*a, column=lambda p, B: cdiv(p, B))),
    Mistake("column and offset swapped", "the column is p // block_size "
            "and the offset p % block_size",
            lambda *a: _model(*a, column=lambda p, B: p % B,
                              slot=lambda b, p, B, w: b * B + p // B)),
    Mistake("offset forgotten", "a block holds block_size slots, and the "
            "token's place inside it counts too", lambda *a: _model(*a, slot=lambda b, p, B, w: b * B)),
    Mistake("block id not scaled", "a block holds block_size slots: block "
            "b's first slot is not b",
            lambda *a: _model(*a, slot=lambda b, p, B, w: b + p % B)),
    Mistake("scaled by the table width", "multiply the block id by "
            "block_size, not by the number of columns",
            lambda *a: _model(*a, slot=lambda b, p, B, w: b * w + p % B)),
]


def diagnose_slots(got, table, reqs, positions, block_size, extra=()) -> str | None:
    """Name the common mistake that gives ``got`` for this case (numpy or torch inputs)."""
    args = tuple(np.asarray(x.cpu() if hasattr(x, "cpu") else x) for x in (table, reqs, positions))
    got = [int(x) for x in np.asarray(got.cpu() if hasattr(got, "cpu") else got).tolist()]
    return name_mistake(got, (*args, block_size), [*extra, *SLOT_MISTAKES])
