"""Checks for exercises/07b_kernel_puzzles.ipynb: a ladder of Triton puzzles.

Each puzzle is one small kernel behind a wrapper, one idea more than the
last, from vLLM's per-request slot mapping to split-KV. Every puzzle has a
PyTorch reference (``reference_*``), seeded cases with poison (NaN) in
every element the kernel must not read, and the common mistakes it names:
puzzles 1-4 in ``ch07b_first_kernels``, 5-11 in ``ch07b_paged_kernels``,
what they share in ``puzzle_cases``. This module is the ladder.
``check_kernel_puzzle(n, fn)`` prints one line per property;
``trace_kernel_puzzle(n, fn)`` draws what each program read and wrote on a
small case and scores the bytes it moved against the minimum (in Triton's
interpreter; the machinery is ``puzzle_harness``).
"""

from __future__ import annotations

from ._harness import CheckReport, catalogue
from .puzzle_harness import (CHEAT_MISTAKE, COPIED_MISTAKE, INT32_INDEX_MISTAKE, LAUNCH_MISTAKE,
                             SMALL_DOT_MISTAKE, UNMASKED_MISTAKE, Puzzle, check_puzzle, trace_report)
# Names from the puzzle modules, not the modules through the package (``from . import``
# would read pagedkv.checks while its __init__ is still importing this one).
# The references, importable from the ladder as the notebook's text names them.
from .ch07b_first_kernels import (BUILDERS as FIRST_BUILDERS, MISTAKES as FIRST_MISTAKES,
                                  PICTURES as FIRST_PICTURES, REFERENCES as FIRST_REFERENCES,
                                  reference_attend, reference_logsumexp,  # noqa: F401
                                  reference_slots_per_request)
from .ch07b_paged_kernels import (BUILDERS as PAGED_BUILDERS, MISTAKES as PAGED_MISTAKES,
                                  PICTURES as PAGED_PICTURES, REFERENCES as PAGED_REFERENCES,
                                  reference_copy_blocks, reference_merge,  # noqa: F401
                                  reference_split_partials, reference_table_width)
from .puzzle_cases import reference_gather, reference_paged_attention  # noqa: F401

__all__ = ["check_kernel_puzzle", "trace_kernel_puzzle", "show_reference", "print_puzzle_mistakes",
           "PUZZLES", "puzzle", "MISTAKES"]


# ----------------------------------------------------------------- the ladder

_BUILDERS = {**FIRST_BUILDERS, **PAGED_BUILDERS}
PUZZLES = tuple(sorted(_BUILDERS))
_built: dict = {}

_PICTURE = {**FIRST_PICTURES, **PAGED_PICTURES}


def puzzle(n: int) -> Puzzle:
    """Puzzle ``n``'s spec (built once)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be an int, got {type(n).__name__} {n!r}")
    if n not in _BUILDERS:
        raise ValueError(f"there is no puzzle {n}: the puzzles are {list(PUZZLES)}")
    if n not in _built:
        _built[n] = _BUILDERS[n]()
    return _built[n]


def check_kernel_puzzle(n: int, fn, timeout: float = 60.0) -> CheckReport:
    """Check your wrapper for puzzle ``n``: one line per property."""
    return check_puzzle(puzzle(n), fn, timeout)


_REFERENCES = {**FIRST_REFERENCES, **PAGED_REFERENCES}


def show_reference(n: int) -> None:
    """Print the PyTorch reference puzzle ``n``'s kernel must equal (its source)."""
    import inspect

    puzzle(n)  # the same argument check
    print(inspect.getsource(_REFERENCES[n]).rstrip())


def trace_kernel_puzzle(n: int, fn) -> None:
    """Print what each program of your kernel read and wrote, and the bytes it moved."""
    puzzle(n)
    print(trace_report(puzzle(n), fn, _PICTURE[n]()))


#: The mistakes each puzzle's check names, in the order it tries them.
MISTAKES = {**FIRST_MISTAKES, **PAGED_MISTAKES}


def print_puzzle_mistakes(width: int = 79) -> None:
    """Print, puzzle by puzzle, the mistakes its check names (and those every puzzle's names)."""
    import textwrap

    for n, mistakes in MISTAKES.items():
        print(f"puzzle {n}:")
        for m in mistakes:
            print(textwrap.fill(m.diagnosis(), width, initial_indent="- ", subsequent_indent="  "))
    print("every puzzle:")
    for m in EVERY_PUZZLE:
        print(textwrap.fill(m.diagnosis(), width, initial_indent="- ", subsequent_indent="  "))


#: The mistakes any puzzle's check can name.
EVERY_PUZZLE = [UNMASKED_MISTAKE, SMALL_DOT_MISTAKE, INT32_INDEX_MISTAKE, LAUNCH_MISTAKE, CHEAT_MISTAKE,
                COPIED_MISTAKE]

catalogue(check_kernel_puzzle, *MISTAKES.values(), EVERY_PUZZLE)
