"""Exercise 4's first task: the worker's request rows, kept for life (Model Runner V2).

The learner writes a class ``RequestRows(max_num_reqs)`` with three methods,
as vLLM 0.33.0's ``RequestState`` keeps them (``v1/worker/gpu/states.py``):

* ``add_request(req_id) -> int``: the *last* free row (``free_indices.pop()``);
  ``ValueError`` for a request that already holds a row or when every row is
  held, changing nothing;
* ``remove_request(req_id) -> int | None``: the freed row, back in the free
  pool; ``None`` for a request that holds no row;
* ``idx_mapping(req_ids) -> list[int]``: the rows of a step's batch, in the
  batch's order.

``check_request_rows`` replays scripted and random traces of adds and
removes on the learner's class, on the library's ``RequestState`` and on an
oracle written here (a list of free rows, a dict of held ones), and compares
every answer. A wrong trace is compared with models of the common mistakes
(the first free row, a freed row queued at the wrong end, a row never freed,
rows counted from the number held as the V1 runner's dense batch has them,
rows sorted or batch positions for ``idx_mapping``). A class that runs the
library's ``RequestState`` is told that the task is to write it.
"""

from __future__ import annotations

import numpy as np

from ..request_state import RequestState
from ._harness import Checker, CheckReport, Mistake, WrongAnswer, catalogue

__all__ = ["check_request_rows", "RowsOracle"]

REFUSED = "refused"  # what a trace records for a ValueError


class RowsOracle:
    """The rows as vLLM keeps them, with one rule changeable (the mistakes' models)."""

    def __init__(self, max_num_reqs: int, *, take: str = "last", give_back: str = "end",
                 free_on_remove: bool = True, dense: bool = False, unknown: str = "none",
                 batch: str = "rows"):
        self.max_num_reqs = max_num_reqs
        self.held: dict[str, int] = {}
        self.free = list(range(max_num_reqs))
        self.take, self.give_back, self.free_on_remove = take, give_back, free_on_remove
        self.dense, self.unknown, self.batch = dense, unknown, batch

    def add_request(self, req_id):
        if req_id in self.held:
            raise ValueError(req_id)
        if self.dense:  # rows 0..n-1 as the V1 runner's batch: the next row is the count held
            if len(self.held) >= self.max_num_reqs:
                raise ValueError(req_id)
            row = len(self.held)
        else:
            if not self.free:
                raise ValueError(req_id)
            if self.take == "last":
                row = self.free.pop()
            elif self.take == "first":
                row = self.free.pop(0)
            else:  # the lowest free row
                row = min(self.free)
                self.free.remove(row)
        self.held[req_id] = row
        return row

    def remove_request(self, req_id):
        if req_id not in self.held:
            if self.unknown == "raise":
                raise KeyError(req_id)
            return None
        row = self.held.pop(req_id)
        if self.free_on_remove and not self.dense:
            if self.give_back == "end":
                self.free.append(row)
            else:
                self.free.insert(0, row)
        return row

    def idx_mapping(self, req_ids):
        rows = [self.held[r] for r in req_ids]
        if self.batch == "sorted":
            return sorted(rows)
        if self.batch == "positions":
            return list(range(len(rows)))
        return rows


def _model(**rule):
    return lambda n: RowsOracle(n, **rule)


ROW_MISTAKES = [
    Mistake("the first free row instead of the last", "vLLM's add_request "
            "pops the last free row, so a fresh worker's first request gets "
            "row max_num_reqs - 1, the next one row max_num_reqs - 2",
            _model(take="first")),
    Mistake("the lowest free row instead of the last", "vLLM takes the row "
            "at the end of its free list, not the smallest number: a fresh "
            "worker hands out its top row first, and a freed row is the next "
            "one handed out", _model(take="lowest")),
    Mistake("a freed row queued behind the others", "remove_request puts "
            "the row back at the end the next add_request takes from: the "
            "row freed last is the first one handed out again",
            _model(give_back="front")),
    Mistake("a row never freed", "a finished request's row must go back to "
            "the free pool, or the worker runs out of rows while most of "
            "them are idle", _model(free_on_remove=False)),
    Mistake("a row handed out twice", "the next row is not the number of "
            "requests held (the V1 runner's dense batch): once a request "
            "in the middle leaves, that row is still held by someone else. "
            "A row comes from the free pool only", _model(dense=True)),
]

BATCH_MISTAKES = [
    Mistake("the rows sorted", "idx_mapping keeps the batch's order: entry "
            "i is the row of the i-th request named, whatever its number",
            _model(batch="sorted")),
    Mistake("batch positions instead of rows", "entry i of idx_mapping is "
            "the row the request holds, not i: rows stay put for life, the "
            "batch is just a list of them", _model(batch="positions")),
]

UNKNOWN_MISTAKE = Mistake(
    "an unknown request refused with an exception", "vLLM's remove_request "
    "returns None for a request that holds no row (an abort of one that never "
    "reached the worker, say): a worker must not crash on it")


def _replay(obj, ops, strict: bool = True) -> list:
    """The answers ``obj`` gives to ``ops`` (("add"|"remove", req_id) or ("batch", ids)).

    A ``ValueError`` is recorded as ``REFUSED``; with ``strict=False`` any
    other exception is recorded by its type's name (a model that refused an
    add earlier cannot map that request in a later batch).
    """
    out = []
    for op, arg in ops:
        try:
            if op == "add":
                out.append(obj.add_request(arg))
            elif op == "remove":
                out.append(obj.remove_request(arg))
            else:
                out.append(list(obj.idx_mapping(arg)))
        except ValueError:
            out.append(REFUSED)
        except Exception as exc:  # noqa: BLE001 -- only when asked
            if strict:
                raise
            out.append(type(exc).__name__)
    return out


def _normal(answers) -> list:
    def one(a):
        if isinstance(a, list):
            return [int(x) for x in a]
        if a is None or isinstance(a, str):
            return a
        return int(a)
    return [one(a) for a in answers]


def _run(cls, n, ops, strict: bool = True) -> list:
    """The learner's answers, checked for type."""
    obj = cls(n)
    got = []
    for (op, arg), a in zip(ops, _replay(obj, ops, strict)):
        if op == "add" and not isinstance(a, str) and (isinstance(a, bool) or not isinstance(a, (int, np.integer))):
            raise AssertionError(f"add_request({arg!r}) returned {type(a).__name__} {a!r:.40}, expected the row "
                                 "(an int)")
        got.append(a)
    return _normal(got)


def _describe(ops, got, want) -> str:
    for k, ((op, arg), g, w) in enumerate(zip(ops, got, want)):
        if g != w:
            done = "; ".join(f"{o} {a}" for o, a in ops[:k]) or "nothing yet"
            call = {"add": "add_request", "remove": "remove_request", "batch": "idx_mapping"}[op]
            return (f"after [{done}], {call}({arg!r}) answered {g!r}, vLLM's RequestState answers {w!r}")
    return "the answers differ in length"


def _random_trace(rng: np.random.Generator):
    """A worker of 1-8 rows and 4-29 calls: arrivals, finishes, batches, unknown removes."""
    n = int(rng.integers(1, 9))
    ops, k, lib = [], 0, RequestState(n)
    for _ in range(int(rng.integers(4, 30))):
        held = list(lib.req_id_to_index)
        u = rng.random()
        if u < 0.5:
            op = ("add", f"r{k}")
            k += 1
        elif u < 0.8 and held:
            op = ("remove", held[int(rng.integers(0, len(held)))])
        elif u < 0.9 and held:
            op = ("batch", [held[i] for i in rng.permutation(len(held))])
        else:
            op = ("remove", f"gone{k}")
        _replay(lib, [op])
        ops.append(op)
    return n, ops


#: The scripted traces: a fresh worker, a freed row reused, a full worker, a batch.
FRESH = (4, [("add", "a"), ("add", "b"), ("add", "c")])
REUSE = (5, [("add", "a"), ("add", "b"), ("add", "c"), ("add", "d"), ("remove", "b"),
             ("remove", "d"), ("add", "e"), ("add", "f"), ("add", "g")])
FULL = (3, [("add", "a"), ("add", "b"), ("add", "c"), ("add", "d"), ("add", "b"),
            ("remove", "a"), ("add", "d"), ("add", "e")])
CYCLE = (2, [op for k in range(6) for op in (("add", f"x{k}"), ("remove", f"x{k}"))] + [("add", "y"),
                                                                                        ("add", "z")])
BATCH = (6, [("add", n) for n in "pqrst"] + [("remove", "s"), ("remove", "q"), ("add", "u"),
                                                ("batch", ["t", "p", "u", "r"])])


def _diagnose(cls, cases) -> str | None:
    """The first mistake whose model answers as the learner on every case."""
    candidates = [*ROW_MISTAKES, *BATCH_MISTAKES]
    wrong_somewhere = False
    for n, ops in cases:
        try:
            got = _run(cls, n, ops, strict=False)
        except Exception:  # noqa: BLE001 -- no diagnosis then
            return None
        want = _normal(_replay(RowsOracle(n), ops))
        if got == want:
            continue
        wrong_somewhere = True
        candidates = [m for m in candidates if _normal(_replay(m.model(n), ops, strict=False)) == got]
        if not candidates:
            return None
    return candidates[0].diagnosis() if wrong_somewhere else None


def check_request_rows(cls, cases: int = 150, seed: int = 0, timeout: float = 20.0) -> CheckReport:
    """Check a ``RequestRows(max_num_reqs)`` class: ``add_request``, ``remove_request``, ``idx_mapping``."""
    rng = np.random.default_rng(seed)
    traces = [_random_trace(rng) for _ in range(cases)]
    scripted = [FRESH, REUSE, FULL, CYCLE, BATCH]
    with Checker("RequestRows", timeout=timeout) as c:
        def probe():
            stubs = 0
            for call in (lambda o: o.add_request("a"), lambda o: o.remove_request("a"),
                         lambda o: o.idx_mapping([])):
                try:
                    call(cls(2))
                except NotImplementedError:
                    stubs += 1
                except Exception:  # noqa: BLE001 -- the properties report it
                    pass
            if stubs == 3:
                raise NotImplementedError

        c.probe(probe)
        c.written_here("RequestRows", lambda: _replay(cls(4), BATCH[1] + [("remove", "zz")]), {
            f"RequestState.{name}": fn for name, fn in vars(RequestState).items()
            if callable(fn) and name not in ("__repr__",)})

        def diagnose():
            try:
                cls(2).remove_request("never-here")
            except Exception:  # noqa: BLE001 -- vLLM answers None here
                return UNKNOWN_MISTAKE.diagnosis()
            return _diagnose(cls, [*scripted, *traces])

        def scripted_case(case, what):
            def body():
                n, ops = case
                got = _run(cls, n, ops)
                want = _normal(_replay(RequestState(n), ops))
                assert want == _normal(_replay(RowsOracle(n), ops)), "the library and the oracle disagree"
                if got != want:
                    raise WrongAnswer(f"{what}: {_describe(ops, got, want)}",
                                      diagnose() or _diagnose(cls, [case]))
            return body

        c.prop("a fresh worker of 4 rows gives a, b, c rows 3, 2, 1 (the last free row)",
               scripted_case(FRESH, "a fresh worker"),
               "which end of the free list does vLLM take a row from?", diagnose)
        c.prop("a freed row is the next one handed out (b and d leave; e, f, g arrive)",
               scripted_case(REUSE, "rows freed and reused"),
               "where does remove_request put the row back, and where does add_request take one?",
               diagnose)

        def cycle():
            n, ops = CYCLE
            try:
                got = _run(cls, n, ops)
            except Exception as exc:  # noqa: BLE001
                raise WrongAnswer(f"six requests that each arrive and finish on a 2-row worker: "
                                  f"{type(exc).__name__}: {exc}", diagnose()) from None
            want = _normal(_replay(RequestState(n), ops))
            if got != want:
                raise WrongAnswer(f"six requests that each arrive and finish on a 2-row worker: "
                                  f"{_describe(ops, got, want)}", diagnose() or _diagnose(cls, [CYCLE]))

        c.prop("a finished request's row goes back: 2 rows serve any number of requests in turn",
               cycle, "what does remove_request do with the row besides forgetting the request?",
               diagnose)

        def no_row_twice():
            for k, (n, ops) in enumerate(traces):
                obj = cls(n)
                held: dict[str, int] = {}
                for op, arg in ops:
                    try:
                        if op == "add":
                            row = obj.add_request(arg)
                            owner = next((r for r, i in held.items() if i == row), None)
                            if owner is not None:
                                raise WrongAnswer(f"random trace {k}: add_request({arg!r}) got row {row}, "
                                                  f"which {owner!r} still holds", diagnose())
                            held[arg] = int(row)
                        elif op == "remove":
                            obj.remove_request(arg)
                            held.pop(arg, None)
                    except ValueError:
                        pass

        c.prop(f"no row is handed out twice ({cases} random traces)", no_row_twice,
               "a row comes from the free pool, and a held row is never in it", diagnose)

        def refusals():
            n, ops = FULL
            got = _run(cls, n, ops)
            want = _normal(_replay(RequestState(n), ops))
            if got != want:
                raise WrongAnswer(f"a 3-row worker: {_describe(ops, got, want)} (ValueError is "
                                  f"recorded as {REFUSED!r})", diagnose() or _diagnose(cls, [FULL]))

        c.prop("a full worker, and a request already holding a row, are refused (ValueError), "
               "changing nothing", refusals,
               "check before you take a row: a refused call must leave the free pool as it was")

        def unknown():
            obj = cls(3)
            row = obj.add_request("a")
            try:
                got = obj.remove_request("never-here")
            except Exception as exc:  # noqa: BLE001
                raise WrongAnswer(f"remove_request('never-here') raised {type(exc).__name__}: {exc}",
                                  UNKNOWN_MISTAKE.diagnosis()) from None
            if got is not None:
                raise AssertionError(f"remove_request('never-here') returned {got!r}, expected None")
            freed = obj.remove_request("a")
            if freed != row or isinstance(freed, bool):
                raise AssertionError(f"remove_request('a') returned {freed!r}, expected the row "
                                     f"add_request gave a, {row!r}")

        c.prop("remove_request returns the freed row, and None for a request that holds none",
               unknown, "what does vLLM's remove_request return when the request is not there?")
        c.prop("idx_mapping gives the batch's rows in the batch's order (t, p, u, r)",
               scripted_case(BATCH, "a step's batch"),
               "entry i is the row of the i-th request named", diagnose)

        def randomized():
            for k, (n, ops) in enumerate(traces):
                got = _run(cls, n, ops)
                want = _normal(_replay(RequestState(n), ops))
                if got != want:
                    raise WrongAnswer(f"random trace {k} on {n} rows: {_describe(ops, got, want)}",
                                      diagnose())

        c.prop(f"{cases} random traces answer as vLLM's RequestState", randomized,
               "the message names the first call that differs: replay the trace by hand", diagnose)
    return c.report


catalogue(check_request_rows, ROW_MISTAKES, BATCH_MISTAKES, [UNKNOWN_MISTAKE])
