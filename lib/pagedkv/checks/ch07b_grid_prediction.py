"""Exercise 7's prediction task: which blocks each split-KV program reads.

Before writing puzzle 8's kernel, the reader predicts its program grid on a
small case (``SPLIT_TRACE``): two requests on a pool of 10 blocks of 4
slots, their table rows, and 3 splits. For every program ``(request,
split)`` (each head reads the same blocks) the reader writes the physical
blocks of the K cache it reads into ``predicted_blocks``, a dict.
``check_split_grid_prediction`` computes the grid from the split rule that
puzzle 8's reference and kernel follow (``split_program_blocks``; the tests
hold it to the trace of the committed kernel), compares, and on a mismatch
draws the grid the rule gives beside the predicted one: the puzzles' own
program-grid picture, a row per program, a column per block. Models of the
usual misreadings name the one a wrong grid points to.
"""

from __future__ import annotations

import html
import numbers

from ..common import cdiv
from ._harness import Mistake, catalogue
from .predict_harness import PredictionReport, check_prediction, side_by_side

__all__ = ["SPLIT_TRACE", "split_program_blocks", "check_split_grid_prediction"]

#: The case, as the notebook shows it (and as the checker reads it).
BLOCK_SIZE = 4
NUM_BLOCKS = 10
NUM_SPLITS = 3
REQUESTS = {"A": (13, [6, 2, 9, 5, 0]), "B": (6, [4, 7, 0, 0, 0])}  # seq_len, table row

SPLIT_TRACE = f"""\
block_size = {BLOCK_SIZE}, a pool of {NUM_BLOCKS} blocks (0 is the null block)
num_splits = {NUM_SPLITS}, seg_len = cdiv(max(seq_lens), num_splits)
request A: seq_len {REQUESTS['A'][0]:>2}, table row {REQUESTS['A'][1]}
request B: seq_len {REQUESTS['B'][0]:>2}, table row {REQUESTS['B'][1]}
grid: one program per (request, head, split); every head reads alike"""


def split_program_blocks(requests: dict, block_size: int, num_splits: int, *, seg_of=None,
                         whole=False, columns=False) -> dict:
    """``{(request, split): [physical blocks read, in order]}`` under puzzle 8's rule.

    Split ``s`` of a request covers positions ``s * seg`` to ``min((s + 1) *
    seg, seq_len) - 1``, ``seg = cdiv(max(seq_lens), num_splits)``; a
    position's block is its table row's entry ``pos // block_size``. The
    keywords model misreadings: ``seg_of(seq_len)`` another segment length,
    ``whole`` every split reading the whole sequence, ``columns`` table
    columns written instead of the blocks they name.
    """
    longest = max(n for n, _ in requests.values())
    out = {}
    for name, (n, row) in requests.items():
        seg = seg_of(n) if seg_of else cdiv(longest, num_splits)
        for s in range(num_splits):
            lo, hi = (0, n) if whole else (s * seg, min((s + 1) * seg, n))
            cols = list(dict.fromkeys(p // block_size for p in range(lo, hi)))
            out[(name, s)] = cols if columns else [row[c] for c in cols]
    return out


def _expected() -> dict:
    return split_program_blocks(REQUESTS, BLOCK_SIZE, NUM_SPLITS)


GRID_MISTAKES = [
    Mistake("every split reads the whole sequence", "split s reads only its own segment, "
            "positions s * seg_len to (s + 1) * seg_len - 1: the splits share the keys out",
            lambda: split_program_blocks(REQUESTS, BLOCK_SIZE, NUM_SPLITS, whole=True)),
    Mistake("each request's own segment length", "seg_len is one number for the whole launch, "
            "cdiv of the longest request's seq_len by num_splits: a shorter request's last "
            "splits can be empty",
            lambda: split_program_blocks(REQUESTS, BLOCK_SIZE, NUM_SPLITS,
                                         seg_of=lambda n: cdiv(n, NUM_SPLITS))),
    Mistake("table columns, not blocks", "a program reads the physical block its table row "
            "names at column pos // block_size, not block number pos // block_size",
            lambda: split_program_blocks(REQUESTS, BLOCK_SIZE, NUM_SPLITS, columns=True)),
]


def _read(predicted) -> dict:
    shape = ("expected a dict {(request, split): [block ids]}, such as {('A', 0): [1, 2], "
             "('A', 1): [], ...}, one entry per program")
    if not isinstance(predicted, dict):
        raise AssertionError(f"{shape}; got {type(predicted).__name__} {predicted!r:.40}")
    out = {}
    for key, blocks in predicted.items():
        if (not isinstance(key, tuple) or len(key) != 2 or key[0] not in REQUESTS
                or isinstance(key[1], bool) or not isinstance(key[1], numbers.Integral)):
            raise AssertionError(f"{shape}; the key {key!r} is not (request, split) with a "
                                 f"request in {sorted(REQUESTS)}")
        if isinstance(blocks, (str, bytes)) or not hasattr(blocks, "__iter__"):
            raise AssertionError(f"{shape}; the blocks of {key!r} are not a list: {blocks!r:.40}")
        ids = list(blocks)
        if any(isinstance(b, bool) or not isinstance(b, numbers.Integral) for b in ids):
            raise AssertionError(f"{shape}; the blocks of {key!r} are not ints: {ids!r:.40}")
        out[(key[0], int(key[1]))] = [int(b) for b in ids]
    return out


def _compare(got: dict, want: dict) -> str | None:
    for key in want:
        if key not in got:
            return f"program {key} is missing: every (request, split) of the grid has an entry"
    for key in got:
        if key not in want:
            return f"there is no program {key}: the grid has splits 0 to {NUM_SPLITS - 1}"
    for key in sorted(want):
        g, w = set(got[key]), set(want[key])
        if g == w:
            continue
        n, row = REQUESTS[key[0]]
        if w - g:
            b = min(w - g)
            return f"program {key} reads block {b} too (you predicted {sorted(g)}, it reads {want[key]})"
        b = min(g - w)
        if not w:
            return f"program {key} reads nothing: its segment starts past seq_len {n} (you predicted {sorted(g)})"
        return f"program {key} does not read block {b} (you predicted {sorted(g)}, it reads {want[key]})"
    return None


def _diagnose(got: dict) -> str | None:
    for m in GRID_MISTAKES:
        model = m.model()
        if all(set(got.get(k, [])) == set(v) for k, v in model.items()) and set(got) == set(model):
            return m.diagnosis()
    return None


def grid_text(blocks: dict, against: dict | None = None) -> str:
    """The program grid: a row per (request, split), a column per physical block.

    ``r``: read. Against the expected grid, ``+`` marks a block predicted
    but not read, ``-`` one read but not predicted.
    """
    header = "          " + " ".join(f"{b}" for b in range(NUM_BLOCKS))
    lines = [header]
    for key in sorted(set(blocks) | set(against or {})):
        have = set(blocks.get(key, []))
        want = set(against[key]) if against is not None and key in against else None
        cells = []
        for b in range(NUM_BLOCKS):
            if want is None:
                cells.append("r" if b in have else ".")
            else:
                cells.append({(True, True): "r", (True, False): "+", (False, True): "-",
                              (False, False): "."}[(b in have, b in want)])
        lines.append(f"({key[0]}, {key[1]})".ljust(10) + " ".join(cells))
    return "\n".join(lines)


def _pre(text: str, legend: str) -> str:
    return (f"<pre style='font-size:12px;line-height:1.3;margin:0'>{html.escape(text)}</pre>"
            f"<div style='font-size:11px'>{html.escape(legend)}</div>")


def check_split_grid_prediction(predicted_blocks) -> PredictionReport:
    """Grade a prediction of the blocks each program (request, split) of ``SPLIT_TRACE`` reads."""
    want = _expected()

    def draw(got):
        got = got if isinstance(got, dict) else {}
        return side_by_side(_pre(grid_text(want), "r read, . not read"),
                            _pre(grid_text(got, want), "r read, as predicted; + predicted, not "
                                 "read; - read, not predicted"), min_px=300)

    return check_prediction(
        "prediction", "predicted_blocks", predicted_blocks, want,
        read=_read, compare=_compare, draw=draw, diagnose=_diagnose,
        name="your program grid is the one the split rule gives",
        hint="for each program, write its segment's positions first, then the table "
             "columns they fall in, then the blocks those columns name")


catalogue(check_split_grid_prediction, GRID_MISTAKES)
