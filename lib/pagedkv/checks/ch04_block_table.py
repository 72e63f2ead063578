"""Checks for exercises/04_block_table.ipynb.

The learner practises chapter 4's table. Model Runner V2's pieces, what
vLLM 0.33.0 runs by default, have modules of their own: the request rows
(``ch04_rows``), the staged append (``ch04_staged``) and the prediction of a
step's rows (``ch04_row_prediction``). This module keeps:

* ``condense(table, num_reqs, finished_rows) -> list[(src, tgt)]``, the
  exercise's optional task on the V1 runner (the fallback): remove
  the finished requests from a ``BlockTable`` whose rows ``0 ..
  num_reqs - 1`` hold the batch, and close the holes as vLLM 0.33.0's
  ``InputBatch.condense`` does: clear the finished rows (its
  ``remove_request`` does), then move the last live row into the lowest
  hole with ``move_row``, until no hole lies below a live row. The return
  value lists the moves in order (vLLM records them for its logits
  processors).
* ``table_bytes(max_num_seqs, max_model_len, block_size) -> (vllm, sglang)``:
  the bytes of vLLM's block table, its width aligned to 128 tokens
  (``block_table_width``), and of SGLang's ``req_to_token`` with its padding
  row, for the same batch.

``condense`` runs on random batches, on a real ``BlockTable``, and is compared
with a reference written here (vLLM's loop) and with the library's own
``move_row``/``clear_row``; the table is read through its public ``np``,
``num_blocks_per_row`` and ``check()``. Half the random batches list their
finished rows out of order, as a set would. A difference is compared with
models of the common mistakes (moves in the wrong direction, finished rows
left stale, lengths not moved, the order kept, a finished row moved, the
finished rows taken as sorted). The byte counts are compared with
``block_table_width`` and ``ReqToTokenPool`` and with an oracle, on block
sizes that are multiples of 16 (vLLM's CUDA backends accept no others), and
a wrong count with the mistakes' counts (no alignment, the window rounded to
128 tokens before it is cut into blocks, floor for cdiv, no padding row...).

The prediction task of the exercise (the rows a scripted trace leaves) is
``ch04_table_prediction``.
"""

from __future__ import annotations

import math

import numpy as np

from ..block_table import BlockTable, block_table_width
from ..common import InvariantError, cdiv
from ..token_pool import ReqToTokenPool
from ._harness import (Checker, CheckReport, Mistake, WrongAnswer,
                       catalogue, expect_int, name_mistake)

from .ch04_rows import check_request_rows  # noqa: E402 -- Model Runner V2's rows
from .ch04_staged import check_staged_append  # noqa: E402 -- and its staged appends
from .ch04_row_prediction import check_row_prediction  # noqa: E402 -- the prediction

__all__ = ["check_request_rows", "check_staged_append", "check_row_prediction",
           "check_condense", "check_table_bytes"]


# ------------------------------------------------------------------ condense
# A batch is modelled as a plain (cells, lengths) pair of numpy arrays, so the
# reference and the mistakes never write into a library object.

def _state(table: BlockTable) -> tuple[list[list[int]], list[int]]:
    """What the kernels would read: every cell, and every row's length."""
    return np.array(table.np).tolist(), table.num_blocks_per_row.tolist()


def _model_condense(cells, lengths, num_reqs, finished, *, clear=True,
                    reverse=False, lengths_move=True, stable=False,
                    skip_finished=True, stop=True, sort=True):
    """The table after condensing, and the moves, with one piece changed."""
    cells = np.array(cells)
    lengths = np.array(lengths)
    width = cells.shape[1]

    def move(src, tgt):
        n = int(lengths[src])
        if lengths_move:
            cells[tgt, :n] = cells[src, :n]
            cells[tgt, n:] = 0
            lengths[tgt] = n
            cells[src, :] = 0
            lengths[src] = 0
        else:  # whole rows of cells copied, lengths left where they were
            cells[tgt, :width] = cells[src, :width]
            cells[src, :] = 0

    if clear:
        for r in finished:
            cells[r, :] = 0
            lengths[r] = 0
    moves = []
    if stable:
        live = [r for r in range(num_reqs) if r not in finished]
        for tgt, src in enumerate(live):
            if src != tgt:
                move(src, tgt)
                moves.append((src, tgt))
        return cells.tolist(), lengths.tolist(), moves
    holes = sorted(set(finished)) if sort else list(finished)
    last = num_reqs - 1
    while holes:
        while skip_finished and last in holes:
            last -= 1
        hole = holes[0]
        if stop and hole >= last:
            break
        if last < 0:
            break
        holes.pop(0)
        if reverse:
            move(hole, last)
            moves.append((hole, last))
        else:
            move(last, hole)
            moves.append((last, hole))
        last -= 1
    return cells.tolist(), lengths.tolist(), moves


def condense_reference(cells, lengths, num_reqs, finished):
    """vLLM 0.33.0's condense on (cells, lengths): the table and the moves."""
    return _model_condense(cells, lengths, num_reqs, finished)


CONDENSE_MISTAKES = [
    Mistake("moved the wrong way", "the moves copy a hole into a live row: "
            "a move takes the last live row into the lowest hole, so the "
            "live requests end up in rows 0 .. n - 1",
            lambda *a: _model_condense(*a, reverse=True)),
    Mistake("stale rows left", "a finished row still names its blocks: "
            "they are freed, and a row past the new end that is never moved "
            "into would keep pointing at blocks other requests now hold",
            lambda *a: _model_condense(*a, clear=False)),
    Mistake("num_blocks_per_row not moved", "the cells moved but the "
            "lengths stayed behind: a row is its cells and its length, and "
            "the kernels read exactly num_blocks_per_row[r] cells of row r",
            lambda *a: _model_condense(*a, lengths_move=False)),
    Mistake("the order kept", "every live row was shifted down: vLLM moves "
            "only the last live row into each hole, one move per hole below "
            "the new end, so the batch order changes",
            lambda *a: _model_condense(*a, stable=True)),
    Mistake("a finished row moved", "a finished request was moved into a "
            "hole: the row moved in must be the last one still live, so the "
            "search for it steps over finished rows",
            lambda *a: _model_condense(*a, skip_finished=False)),
    Mistake("a row moved up", "a move went to a higher row: once the lowest "
            "hole is not below the last live row the batch is dense",
            lambda *a: _model_condense(*a, stop=False)),
    Mistake("finished rows taken as sorted", "finished_rows comes in any "
            "order ([5, 0, 2]): the lowest hole is the smallest of them, not "
            "the first listed", lambda *a: _model_condense(*a, sort=False)),
]


def _build(rows: int, width: int, blocks: list[list[int]]) -> BlockTable:
    table = BlockTable(max_num_reqs=rows, max_num_blocks_per_req=width,
                       device="cpu")
    for r, ids in enumerate(blocks):
        table.add_row(ids, r)
    return table


def _random_batch(rng: np.random.Generator):
    """(rows, width, blocks per live row, num_reqs, finished rows)."""
    rows, width = int(rng.integers(2, 9)), int(rng.integers(1, 5))
    num_reqs = int(rng.integers(1, rows + 1))
    ids = iter(rng.permutation(np.arange(1, rows * width + 1)).tolist())
    blocks = [[next(ids) for _ in range(int(rng.integers(1, width + 1)))]
              for _ in range(num_reqs)]
    k = int(rng.integers(0, num_reqs + 1))
    finished = sorted(rng.choice(num_reqs, size=k, replace=False).tolist())
    if rng.random() < 0.5:  # the caller's order: vLLM's removed set has none
        finished = rng.permutation(finished).tolist()
    return rows, width, blocks, num_reqs, finished


def _moves(result) -> list[tuple[int, int]]:
    try:
        return [(int(s), int(t)) for s, t in result]
    except Exception:  # noqa: BLE001 -- say what came back
        raise AssertionError(
            f"expected the list of moves [(src, tgt), ...], got "
            f"{type(result).__name__} {result!r:.60}") from None


def _run_condense(fn, case):
    """Run the learner's condense on a fresh table; return all we compare."""
    rows, width, blocks, num_reqs, finished = case
    table = _build(rows, width, blocks)
    before = _state(table)
    moves = _moves(fn(table, num_reqs, list(finished)))
    cells, lengths = _state(table)
    try:
        table.check()
        broken = None
    except InvariantError as err:
        broken = str(err)
    want = condense_reference(*before, num_reqs, finished)
    return before, (cells, lengths, moves), want, broken


def _diagnose_condense(fn, cases) -> str | None:
    """The first mistake whose model gives the learner's answer on every
    case the answer is wrong on."""
    candidates = list(CONDENSE_MISTAKES)
    wrong_somewhere = False
    for case in cases:
        try:
            before, got, want, _ = _run_condense(fn, case)
        except Exception:  # noqa: BLE001 -- no diagnosis then
            return None
        if got == want:
            continue
        wrong_somewhere = True
        args = (*before, case[3], case[4])
        candidates = [m for m in candidates if m.model(*args) == got]
        if not candidates:
            return None
    return candidates[0].diagnosis() if wrong_somewhere else None


def _show(cells, lengths, rows) -> str:
    """Rows as the kernels see them: cells up to the last non-zero one."""
    def cells_of(r):
        nonzero = [c for c, v in enumerate(cells[r]) if v]
        return cells[r][:nonzero[-1] + 1] if nonzero else []

    return "; ".join(f"row {r}: {cells_of(r)} len {lengths[r]}"
                     for r in rows)


def check_condense(fn, cases: int = 150, seed: int = 0) -> CheckReport:
    """Check ``condense(table, num_reqs, finished_rows) -> [(src, tgt)]``."""
    rng = np.random.default_rng(seed)
    batches = [_random_batch(rng) for _ in range(cases)]
    chapter = (5, 3, [[1, 2], [3], [4, 5, 6], [7], [8, 9]], 5, [1, 3])
    with Checker("condense") as c:
        c.probe(lambda: fn(_build(2, 1, [[1], [2]]), 2, [0]))

        def diagnose():
            return _diagnose_condense(fn, [chapter, *batches])

        def worked_example():
            before, got, want, _ = _run_condense(fn, chapter)
            if got != want:
                raise WrongAnswer(
                    f"rows p, q, r, s, t = {chapter[2]}, q (row 1) and s "
                    f"(row 3) finish: expected moves {want[2]} and "
                    f"{_show(want[0], want[1], range(5))}; got moves "
                    f"{got[2]} and {_show(got[0], got[1], range(5))}",
                    diagnose())

        c.prop("the chapter's batch: q and s finish, t moves into q's row",
               worked_example,
               "which row is the lowest hole, which the last live row, and "
               "when is the batch dense?", diagnose)

        unsorted = (8, 3, [[1, 2], [3], [4, 5, 6], [7], [8, 9], [10], [11]],
                    7, [5, 0, 2])

        def any_order():
            before, got, want, _ = _run_condense(fn, unsorted)
            if got != want:
                raise WrongAnswer(
                    f"7 requests, finished_rows [5, 0, 2] (in that order): "
                    f"expected moves {want[2]} giving "
                    f"{_show(want[0], want[1], range(7))}; got moves "
                    f"{got[2]} giving {_show(got[0], got[1], range(7))}",
                    _diagnose_condense(fn, [unsorted]) or diagnose())

        c.prop("finished rows in any order: [5, 0, 2] is rows 0, 2 and 5",
               any_order, "which hole is filled first?", diagnose)

        def no_stale_rows():
            for case in batches:
                _, (cells, lengths, _), _, _ = _run_condense(fn, case)
                new_end = case[3] - len(case[4])
                for r in range(new_end, case[0]):
                    if lengths[r] or any(cells[r]):
                        end = (f"rows 0-{new_end - 1}" if new_end
                               else "no row")
                        raise WrongAnswer(
                            f"{case[3]} requests, rows {case[4]} finish: "
                            f"the batch is now {end}, but row {r} still "
                            f"holds {cells[r]} (length {lengths[r]})",
                            diagnose())

        c.prop("every row past the condensed batch is empty: no stale row",
               no_stale_rows,
               "which call empties a finished row that no move reaches, and "
               "what happens to the row a move vacates?", diagnose)

        def lengths_follow():
            for case in batches:
                _, (cells, lengths, _), want, broken = _run_condense(fn, case)
                if broken or lengths != want[1]:
                    raise WrongAnswer(
                        f"{case[3]} requests, rows {case[4]} finish: "
                        f"num_blocks_per_row is {lengths}, expected "
                        f"{want[1]}" + (f" ({broken})" if broken else ""),
                        diagnose())

        c.prop("num_blocks_per_row moves with the blocks (table.check() "
               "holds)", lengths_follow,
               "a row is its cells and its length: which of the table's "
               "methods keep both in step?", diagnose)

        def randomized():
            for k, case in enumerate(batches):
                _, got, want, _ = _run_condense(fn, case)
                if got != want:
                    n = case[3]
                    raise WrongAnswer(
                        f"random batch {k}: {n} requests in a "
                        f"{case[0]}-row table, rows {case[4]} finish: "
                        f"expected moves {want[2]} giving "
                        f"{_show(want[0], want[1], range(n))}; got "
                        f"{got[2]} giving {_show(got[0], got[1], range(n))}",
                        diagnose())

        c.prop(f"{cases} random batches match vLLM's condense, rows and "
               "moves", randomized,
               "the message lists the rows before and after: replay the "
               "moves by hand", diagnose)
    return c.report


catalogue(check_condense, CONDENSE_MISTAKES)


# --------------------------------------------------------------- table_bytes
def _width(max_model_len, block_size, *, blocks="cdiv", step="gcd"):
    if blocks == "window":  # the window rounded up to 128 tokens, then cut in blocks
        return cdiv(cdiv(max_model_len, 128) * 128, block_size)
    n = (cdiv(max_model_len, block_size) if blocks == "cdiv"
         else max_model_len // block_size)
    if step == "none":
        return n
    if step == "gcd":
        s = 128 // math.gcd(128, block_size)
    elif step == "floor":
        s = 128 // block_size  # 0 past 128: the model raises, never matches
    else:  # 128 blocks
        s = 128
    return cdiv(n, s) * s


def _model_bytes(max_num_seqs, max_model_len, block_size, *, blocks="cdiv",
                 step="gcd", pad=1, cell=4):
    vllm = max_num_seqs * _width(max_model_len, block_size, blocks=blocks,
                                 step=step) * cell
    sglang = (max_num_seqs + pad) * max_model_len * cell
    return vllm, sglang


def table_bytes_reference(max_num_seqs, max_model_len, block_size):
    """vLLM's aligned table and SGLang's req_to_token, in bytes."""
    return _model_bytes(max_num_seqs, max_model_len, block_size)


BYTES_MISTAKES = [
    Mistake("no alignment", "the row has just the blocks the window needs: "
            "vLLM 0.33.0 widens it so that it covers a whole multiple of 128 "
            "tokens", lambda *a: _model_bytes(*a, step="none")),
    Mistake("window rounded to 128 tokens first", "the row was cut from "
            "the window rounded up to 128 tokens: vLLM rounds the block "
            "count instead, up to a count whose tokens are a multiple of "
            "128; the two agree only when the block size divides 128 (at 48 "
            "tokens a block, 192 tokens need 4 blocks, widened to 8, not 6)",
            lambda *a: _model_bytes(*a, blocks="window", step="none")),
    Mistake("floor instead of cdiv", "the window's last tokens have no "
            "column: a window that ends inside a block still needs that "
            "block", lambda *a: _model_bytes(*a, blocks="floor")),
    Mistake("floor and no alignment", "the row neither holds the window's "
            "last partial block nor covers a multiple of 128 tokens",
            lambda *a: _model_bytes(*a, blocks="floor", step="none")),
    Mistake("alignment step 128 // block_size", "the row was widened in "
            "steps of 128 // block_size blocks: for a block size that does "
            "not divide 128 those steps are not whole multiples of 128 "
            "tokens (at 48 tokens a block, 2 blocks are 96 tokens; the first "
            "whole multiple is 8 blocks, 384 tokens)",
            lambda *a: _model_bytes(*a, step="floor")),
    Mistake("aligned to 128 blocks", "the row was widened to a multiple of "
            "128 blocks: the alignment is 128 tokens",
            lambda *a: _model_bytes(*a, step="blocks")),
    Mistake("SGLang's padding row forgotten", "req_to_token has one row "
            "more than requests: row 0 is a padding row, never handed out",
            lambda *a: _model_bytes(*a, pad=0)),
    Mistake("int64 cells", "both tables hold int32 cells, 4 bytes each",
            lambda *a: _model_bytes(*a, cell=8)),
]


def _bytes_answer(fn, args) -> tuple[int, int]:
    got = fn(*args)
    if not (isinstance(got, tuple) and len(got) == 2):
        raise AssertionError(f"expected (vllm_bytes, sglang_bytes), got "
                             f"{type(got).__name__} {got!r:.60}")
    return (expect_int(got[0], "vllm_bytes"),
            expect_int(got[1], "sglang_bytes"))


def _library_bytes(max_num_seqs, max_model_len, block_size):
    """The same two sizes, measured on the library's tables (small only)."""
    width = block_table_width(max_model_len, block_size)
    vllm = BlockTable(max_num_seqs, width, device="cpu").metadata_bytes
    sglang = ReqToTokenPool(size=max_num_seqs, max_context_len=max_model_len,
                            device="cpu").metadata_bytes
    return vllm, sglang


#: Cases on which the mistakes' answers differ from each other. Every block
#: size is a multiple of 16, as vLLM's CUDA attention backends require.
_PROBES = [(4, 200, 48), (3, 129, 16), (2, 1000, 96), (5, 300, 256),
           (1, 100, 48), (1, 129, 96), (1, 100, 160), (1, 400, 256)]


def _bytes_case(fn, args, what, only=None) -> None:
    """Compare one answer (``only``: 0 vLLM, 1 SGLang, None both)."""
    got = _bytes_answer(fn, args)
    want = table_bytes_reference(*args)
    parts = (0, 1) if only is None else (only,)
    if any(got[i] != want[i] for i in parts):
        raise WrongAnswer(
            f"{what} (max_num_seqs={args[0]}, max_model_len={args[1]:,}, "
            f"block_size={args[2]}): expected ({want[0]:,}, {want[1]:,}) "
            f"bytes, got ({got[0]:,}, {got[1]:,})",
            name_mistake(got, args, BYTES_MISTAKES, fn, _PROBES))


def check_table_bytes(fn, cases: int = 40, seed: int = 0) -> CheckReport:
    """Check ``table_bytes(max_num_seqs, max_model_len, block_size)``."""
    rng = np.random.default_rng(seed)
    with Checker("table_bytes") as c:
        c.probe(lambda: fn(1, 16, 16))

        c.prop("256 x 32,768 tokens at B=16: 2,097,152 and 33,685,504 bytes",
               lambda: _bytes_case(fn, (256, 32_768, 16),
                                   "the chapter's setup"),
               "how many int32 cells does each table hold, and SGLang's "
               "rows: how many?")

        def aligned():
            for args in ((4, 192, 16), (4, 192, 48), (4, 1_000, 48),
                         (2, 4_096, 96), (3, 1_000, 256)):
                _bytes_case(fn, args, "vLLM's width", only=0)

        c.prop("vLLM's row covers a multiple of 128 tokens (192 at B=16: 16 "
               "columns)", aligned,
               "the row's blocks times the block size must be a multiple of "
               "128: for which block counts is that so?")

        def partial_block():
            for args in ((4, 129, 16), (2, 1_025, 128), (1, 400, 256)):
                _bytes_case(fn, args, "a partial last block", only=0)

        c.prop("a window that ends inside a block gets that block's column",
               partial_block, "where do the window's last tokens go?")

        def padding_row():
            for args in ((1, 16, 16), (7, 300, 32)):
                _bytes_case(fn, args, "SGLang's req_to_token", only=1)

        c.prop("SGLang's req_to_token has max_num_seqs + 1 rows", padding_row,
               "which row does SGLang never hand out?")

        def randomized():
            # Multiples of 16, the block sizes vLLM's CUDA backends accept.
            sizes = (16, 32, 48, 64, 80, 96, 128, 160, 256, 544, 1_024)
            for k in range(cases):
                bs = sizes[k % len(sizes)]
                args = (int(rng.integers(1, 65)),
                        int(rng.integers(1, 4_097)), bs)
                assert _library_bytes(*args) == table_bytes_reference(*args), (
                    "the library and the oracle disagree (a bug in pagedkv, "
                    "not in your code)")
                _bytes_case(fn, args, f"random case {k}")

        c.prop(f"{cases} random setups match block_table_width and "
               "ReqToTokenPool", randomized,
               "the message names the setup: work its width out by hand")
    return c.report


catalogue(check_table_bytes, BYTES_MISTAKES)
