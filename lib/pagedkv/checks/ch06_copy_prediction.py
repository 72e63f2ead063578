"""Exercise 6's prediction task: the tables and the copy list of three partial hits.

The notebook shows ``COPY_TRACE``: request A computes 11 tokens on a
``KVCacheManager`` with blocks of 4 and a match unit of 2; then B, C and D
are admitted, each sharing a different part of A's tokens. The reader
writes, before running anything, the block table each of B, C and D is left
with (``predicted_tables``) and the copy-on-write pairs the manager records,
``(source, destination)`` in order (``predicted_copies``).
``check_copy_prediction`` runs the trace on the library, compares, and on a
mismatch draws PagedAttention's picture of the four requests as the trace
leaves them beside the one predicted (the book's ``render_paged_layout``).
A small list model of the manager's rules replays the trace with one rule
changed, to name the misunderstanding a wrong answer points to.
"""

from __future__ import annotations

import numbers

from ..common import cdiv
from ..kv_cache_manager import KVCacheManager
from ..request import Request
from ..views.paged_layout import render_paged_layout
from ._harness import Mistake, catalogue
from .predict_harness import PredictionReport, check_prediction, side_by_side

__all__ = ["check_copy_prediction", "COPY_TRACE", "run_copy_trace"]

#: The trace, as the notebook shows it (and as the checker runs it).
COPY_TRACE = """\
m = KVCacheManager(12, block_size=4, hash_block_size=2)  # queue [1, ..., 11]
a = list(range(100, 110))                    # A's 10 prompt tokens
A = Request("A", a, hash_block_size=2)
m.allocate_slots(A, 10)                      # A's prefill: blocks [1, 2, 3]
A.num_computed_tokens = 10
A.append_output_token_ids(7)                 # A samples token 7 ...
m.allocate_slots(A, 1)                       # ... and computes it
A.num_computed_tokens = 11


def admit(request_id, tokens):               # as the scheduler admits
    r = Request(request_id, tokens, hash_block_size=2)
    hit_blocks, hit = m.get_computed_blocks(r)
    m.allocate_slots(r, len(tokens) - hit, hit, hit_blocks)
    r.num_computed_tokens = len(tokens)
    return r


B = admit("B", a[:7] + [1, 2, 3])            # shares A's first 7 tokens
C = admit("C", a)                            # A's whole prompt, no more
D = admit("D", a + [5, 6])                   # A's prompt, then its own
copies = m.outstanding_copies                # (source, destination) pairs
"""

#: What the trace admits, as data for the list model: (id, tokens, shared with A).
_ADMISSIONS = [("B", 10, 7), ("C", 10, 10), ("D", 12, 10)]
_A_BLOCKS, _FIRST_FREE, _NUM_BLOCKS, _B, _UNIT = [1, 2, 3], 4, 12, 4, 2


def run_copy_trace():
    """Run ``COPY_TRACE`` on the library: the manager, the four requests, the copies."""
    namespace: dict = {"KVCacheManager": KVCacheManager, "Request": Request}
    exec(COPY_TRACE, namespace)  # noqa: S102 -- the module's own constant
    requests = [namespace[n] for n in "ABCD"]
    return namespace["m"], requests, list(namespace["copies"])


def copy_model(*, cap=1, unit=_UNIT, pop_tail=False, cow_last=False,
               swapped=False, boundary_copy=False):
    """Tables of B, C, D and the copies under the manager's rules, one of them changed.

    ``cap``: tokens a hit must leave to compute (1; 0 is no cap); ``unit``:
    where a hit may end (the match unit; the block size, or 1);
    ``pop_tail``: new blocks from the queue's tail; ``cow_last``: the private
    copy is the last new block, not the first; ``swapped``: pairs written
    (destination, source); ``boundary_copy``: a hit on a block boundary
    copies its last block too.
    """
    queue = list(range(_FIRST_FREE, _NUM_BLOCKS))
    tables, copies = {}, []
    for rid, n, shared in _ADMISSIONS:
        hit = min(shared, n - cap) // unit * unit
        hit_blocks = _A_BLOCKS[:cdiv(hit, _B)]
        partial = hit % _B != 0 or (boundary_copy and hit > 0)
        count = cdiv(n, _B) - len(hit_blocks) + partial
        new = queue[-count:][::-1] if pop_tail else queue[:count]
        queue = [b for b in queue if b not in new]
        table = list(hit_blocks)
        if partial:
            cow = new[-1] if cow_last else new[0]
            rest = [b for b in new if b != cow]
            copies.append((cow, table[-1]) if swapped else (table[-1], cow))
            table[-1] = cow
            table += rest
        else:
            table += new
        tables[rid] = table
    return tables, copies


COPY_MISTAKES = [
    Mistake("C's hit not capped", "a hit leaves the last prompt token to "
            "compute (its logits choose the first output token): C's 10 "
            "tokens hit at most 9, which the match unit of 2 makes 8, a "
            "block boundary: C shares A's two full blocks and copies nothing",
            lambda: copy_model(cap=0)),
    Mistake("hits ended on block boundaries", "the match unit is 2, not the "
            "block: a hit may end inside a block, and the request then "
            "shares that partly valid block until its private copy is made",
            lambda: copy_model(unit=_B)),
    Mistake("new blocks from the tail", "allocate_slots pops the free "
            "queue's head, here the lowest free ids in order",
            lambda: copy_model(pop_tail=True)),
    Mistake("the private copy placed last", "the copy replaces the hit's "
            "partly valid block at its place in the table, and it is the "
            "first block allocate_slots takes",
            lambda: copy_model(cow_last=True)),
    Mistake("pairs written (destination, source)", "a copy pair reads "
            "(source, destination): from A's shared block to the private one",
            lambda: copy_model(swapped=True)),
    Mistake("a copy on a block boundary", "a hit that ends on a block "
            "boundary shares whole blocks only; the next token starts a "
            "fresh block, and there is nothing to copy",
            lambda: copy_model(boundary_copy=True)),
]


# ------------------------------------------------------------------- reading
_SHAPE = ("expected predicted_tables as a dict {'B': [block ids], 'C': [...], "
          "'D': [...]} and predicted_copies as a list of (source, "
          "destination) pairs")


def _ints(value, what: str) -> list[int]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise AssertionError(f"{_SHAPE}; {what} is {type(value).__name__} {value!r:.40}")
    ids = list(value)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise AssertionError(f"{_SHAPE}; {what} holds {i!r:.20}, not a block id")
    return [int(i) for i in ids]


def _read(predicted) -> tuple[dict, list]:
    tables, copies = predicted
    if tables is None or copies is None:
        missing = "predicted_tables" if tables is None else "predicted_copies"
        raise AssertionError(f"{missing} is still None: predict both")
    if not isinstance(tables, dict):
        raise AssertionError(f"{_SHAPE}; predicted_tables is {type(tables).__name__}")
    if sorted(tables) != ["B", "C", "D"]:
        raise AssertionError(f"{_SHAPE}; predicted_tables names {sorted(tables)!r:.40}")
    read_tables = {rid: _ints(tables[rid], f"predicted_tables[{rid!r}]") for rid in "BCD"}
    pairs = []
    for k, pair in enumerate(_ints_list(copies)):
        pair = _ints(pair, f"predicted_copies[{k}]")
        if len(pair) != 2:
            raise AssertionError(f"{_SHAPE}; predicted_copies[{k}] has {len(pair)} ids")
        pairs.append(tuple(pair))
    return read_tables, pairs


def _ints_list(copies) -> list:
    if isinstance(copies, (str, bytes, dict)) or not hasattr(copies, "__iter__"):
        raise AssertionError(f"{_SHAPE}; predicted_copies is {type(copies).__name__}")
    return list(copies)


def _compare(got, want) -> str | None:
    (tables, copies), (want_tables, want_copies) = got, want
    for rid in "BCD":
        if tables[rid] != want_tables[rid]:
            return (f"{rid}'s table: you predicted {tables[rid]}, the trace "
                    f"leaves {want_tables[rid]}")
    if copies != want_copies:
        return (f"the copies: you predicted {copies}, the trace records "
                f"{want_copies}")
    return None


def _diagnose(got) -> str | None:
    for m in COPY_MISTAKES:
        if m.model() == got:
            return m.diagnosis()
    tables, copies = got
    for m in COPY_MISTAKES:  # a mistake that explains one of the two parts
        model_tables, model_copies = m.model()
        want_tables, want_copies = copy_model()
        if model_tables != want_tables and model_tables == tables:
            return m.diagnosis()
        if model_copies != want_copies and model_copies == copies:
            return m.diagnosis()
    return None


def check_copy_prediction(predicted_tables, predicted_copies) -> PredictionReport:
    """Grade a prediction of B's, C's and D's tables and the copy pairs ``COPY_TRACE`` leaves."""
    manager, requests, copies = run_copy_trace()
    want = ({r.request_id: manager.get_block_ids(r.request_id) for r in requests[1:]},
            copies)
    assert want == copy_model(), "the list model and the library disagree (a bug in pagedkv)"
    tokens = {r.request_id: r.num_tokens for r in requests}

    def draw(got):
        tables, pairs = got
        rows = {"A": _A_BLOCKS, **{rid: list(tables[rid]) for rid in "BCD"}}
        n = {rid: min(tokens[rid], len(rows[rid]) * _B) for rid in rows}
        return side_by_side(
            render_paged_layout(manager, requests, title=f"the trace: copies {copies}"),
            render_paged_layout(rows, num_tokens=n, block_size=_B,
                                title=f"your prediction: copies {pairs}"),
            min_px=480)

    predicted = (predicted_tables, predicted_copies)
    return check_prediction(
        "prediction", "predicted_tables and predicted_copies",
        None if predicted_tables is None and predicted_copies is None else predicted,
        want, read=_read, compare=_compare, draw=draw, diagnose=_diagnose,
        name="your tables of B, C and D and your copy pairs are the trace's",
        hint="for each admission: how many tokens does the hit cover (the cap, "
             "then the match unit), does it end inside a block, and which "
             "blocks does the free queue give?")


catalogue(check_copy_prediction, COPY_MISTAKES)
