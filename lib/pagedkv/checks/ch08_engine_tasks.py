"""Checks for exercise 8's engine tasks, sections 1 and 2: the worker's table and the step's token budget.

After the preemption loop (``ch08_serving_engine``) the learner writes:

1. ``update_block_table(table, row_of, scheduler_output)``: the worker's
   rows from one ``SchedulerOutput``. Checked by driving real engines step by
   step (preemptions, resumptions, prefix hits, chunked prompts, a full table
   that a request joins as another leaves) and
   comparing the learner's table, request by request, with the engine's own
   worker table after every step. The learner's table keeps its rows dense
   (``0..n-1``, the deprecated V1 runner's persistent batch, as the exercise
   asks); the engine's worker keeps a row per request for its life (Model
   Runner V2), so the two are compared by request, never by row number.
2. ``tokens_this_step(budget, running, waiting, max_num_seqs)``: how many
   tokens each request gets in a step under chunked prefill. Checked against
   ``Scheduler.schedule``'s ``num_scheduled_tokens`` on random states of a
   real scheduler (a pool large enough never to bind).

Sections 3 and 4 are checked in ``ch08_fan_out`` (``fan_out``,
``blocks_in_use``) and ``ch08_diagnose`` (``diagnose``). A wrong answer that
a known mistake explains is named (``Mistake``); every check reads the
library only through public methods.
"""

from __future__ import annotations

import functools
import random

from ..block_table import BlockTable
from ..common import cdiv
from ..engine import EngineRequest, LLMEngine, ModelRunnerOutput, Scheduler
from ..kv_cache_manager import KVCacheManager
from ._harness import (Checker, CheckReport, Mistake, WrongAnswer, catalogue,
                       expect_int, name_mistake, one_thread)
from .ch08_fixtures import engine_args, random_prompt, short_repr, tiny_model

__all__ = ["check_update_block_table", "check_tokens_this_step"]


# ============================================================ 1. the table

#: name -> (engine args, arrivals ``(step, id, prompt, max_tokens)``)
def _table_scenarios(seed: int) -> dict:
    rng = random.Random(seed)
    s = {}
    s["new and running requests"] = (
        engine_args(num_gpu_blocks_override=40, max_model_len=40),
        [(1 + i // 2, f"r{i}", random_prompt(rng, rng.randrange(3, 12)),
          rng.randrange(1, 9)) for i in range(6)])
    s["a small pool: preemptions, resumptions"] = (
        engine_args(num_gpu_blocks_override=14, max_model_len=32,
              max_num_batched_tokens=16),
        [(1 + i, f"p{i}", random_prompt(rng, rng.randrange(4, 11)), 14)
         for i in range(4)])
    prefix = random_prompt(rng, 8)
    s["prefix hits, chunked prompts, preemptions"] = (
        engine_args(num_gpu_blocks_override=16, max_model_len=40,
              enable_prefix_caching=True, max_num_batched_tokens=12),
        [(1 + 2 * (i // 3), f"b{i}",
          prefix[:rng.randrange(0, 9)] + random_prompt(rng, rng.randrange(2, 9)),
          rng.randrange(4, 14)) for i in range(9)])
    # Every row of a 3-row table in use, and a request joining in the step
    # another leaves: only removing the leaving row first makes room.
    s["a full table: a request joins as another leaves"] = (
        engine_args(num_gpu_blocks_override=40, max_model_len=40, max_num_seqs=3),
        [(1, f"f{i}", random_prompt(rng, rng.randrange(3, 8)), max_tokens)
         for i, max_tokens in enumerate((2, 5, 8, 3, 6))])
    return s


TABLE_MISTAKES = [
    Mistake("add_row for a running request (overwrites)",
            "a running request's new_block_ids are only the blocks it got "
            "this step, and add_row replaces the row: its earlier blocks "
            "are lost from the table while the request still reads them"),
    Mistake("append_row for a resumed request (stale blocks kept)",
            "a resumed request's new_block_ids are its whole block list, as "
            "for a new request, and its old blocks went back to the pool at "
            "preemption: a row that still names them names blocks another "
            "request may now hold (vLLM replaces its block ids)"),
    Mistake("forgot the preempted rows",
            "scheduler_output.preempted_req_ids left the batch this step, "
            "their blocks are freed and may go to someone else: a row kept "
            "for one of them names stale blocks, before its new ones at "
            "resumption"),
    Mistake("forgot the finished rows",
            "scheduler_output.finished_req_ids finished since the last "
            "step: they are out of the batch, and their blocks are free"),
    Mistake("left a hole in the rows",
            "the kernels read rows 0..num_reqs-1: a cleared row in the "
            "middle is read as a request with no blocks, and the last one "
            "is not read at all"),
    Mistake("added arrivals before removing departures",
            "the table has max_num_seqs rows, all in use when the batch is "
            "full: a request that joins needs the row that a leaving one "
            "frees, so no row is free until the leaving ones are out"),
]


(ADD_FOR_RUNNING, APPEND_FOR_RESUMED, KEPT_PREEMPTED, KEPT_FINISHED,
 HOLE, ADD_FIRST) = TABLE_MISTAKES


def _table_mistake(rid, got, want, out) -> str | None:
    """Name what put ``got`` in the row of ``rid`` instead of ``want``."""
    new = list(out.new_block_ids.get(rid, []))
    if got is None:
        return None
    if rid in out.scheduled_running_reqs and got == new and want != new:
        return ADD_FOR_RUNNING.diagnosis()
    if rid in out.scheduled_resumed_reqs and len(got) > len(want) \
            and got[len(got) - len(want):] == want:
        return APPEND_FOR_RESUMED.diagnosis()
    return None


def _check_table(table, row_of, want: dict, out, where: str) -> None:
    if not isinstance(row_of, dict):
        raise AssertionError(f"{where}: row_of is {type(row_of).__name__}; "
                             "keep it the dict you were given")
    extra = sorted(set(row_of) - set(want))
    missing = sorted(set(want) - set(row_of))
    for rid in extra:
        if rid in out.finished_req_ids:
            mistake, when = KEPT_FINISHED, "finished since the last step"
        elif rid in out.preempted_req_ids:
            mistake, when = KEPT_PREEMPTED, "was preempted this step"
        else:
            mistake, when = None, "is not in the batch"
        raise WrongAnswer(f"{where}: row_of still has {rid!r}, which {when}",
                          mistake and mistake.diagnosis())
    if missing:
        raise AssertionError(
            f"{where}: no row for {', '.join(map(repr, missing))}, which "
            f"ran this step; the worker holds {want}")
    rows = sorted(row_of.values())
    if rows != list(range(len(rows))):
        raise WrongAnswer(f"{where}: your rows are {rows}, not 0.."
                          f"{len(rows) - 1}", HOLE.diagnosis())
    lengths = [int(x) for x in table.num_blocks_per_row]
    if any(lengths[len(rows):]):
        raise WrongAnswer(
            f"{where}: rows past {len(rows) - 1} still hold blocks "
            f"(lengths {lengths})", HOLE.diagnosis())
    mine = {rid: table.row(row) for rid, row in row_of.items()}
    for rid in want:
        if mine[rid] != want[rid]:
            kind = ("new" if rid in out.scheduled_new_reqs else "resumed"
                    if rid in out.scheduled_resumed_reqs else "running")
            raise WrongAnswer(
                f"{where}: the row of {rid!r} ({kind}, new_block_ids "
                f"{list(out.new_block_ids.get(rid, []))}) holds "
                f"{mine[rid]}, the worker's holds {want[rid]}",
                _table_mistake(rid, mine[rid], want[rid], out))


def _full_table_mistake(fn, snapshot, out, table) -> str | None:
    """Why ``fn`` ran out of rows on a full table: it adds before it removes,
    or it never removes. Told apart on a copy with one spare row."""
    row_of, rows = snapshot
    spare = BlockTable(table.max_num_reqs + 1, table.max_num_blocks_per_req, device="cpu")
    for r, ids in enumerate(rows):
        spare.add_row(ids, r)
    row_of = dict(row_of)
    try:
        fn(spare, row_of, out)
    except Exception:  # noqa: BLE001 -- no diagnosis then
        return None
    kept = [rid for rid in out.finished_req_ids + out.preempted_req_ids if rid in row_of]
    if not kept:
        return ADD_FIRST.diagnosis()
    return (KEPT_FINISHED if kept[0] in out.finished_req_ids else KEPT_PREEMPTED).diagnosis()


def _run_table(fn, name: str, args, arrivals) -> None:
    engine = LLMEngine(args, tiny_model(), log_fn=lambda line: None)
    table = BlockTable(args.max_num_seqs,
                       cdiv(engine.max_model_len, args.block_size),
                       device="cpu")
    row_of: dict = {}
    pending = sorted(arrivals, key=lambda a: a[0])
    step, seen, last = 0, set(), None
    while pending or engine.has_unfinished_requests():
        step += 1
        while pending and (pending[0][0] <= step
                           or not engine.has_unfinished_requests()):
            _, rid, prompt, max_tokens = pending.pop(0)
            engine.add_request(rid, prompt, max_tokens=max_tokens,
                               ignore_eos=True)
        engine.step()
        out = engine.last_scheduler_output
        if out is last:  # the call only applied the last step's tokens: nothing new reached the worker
            continue
        last = out
        seen.update(("preempted" for _ in out.preempted_req_ids))
        seen.update(("resumed" for _ in out.scheduled_resumed_reqs))
        # The worker (Model Runner V2) frees a row when a step's finished or
        # preempted ids name it, as the learner does: the rows compare as they are.
        want = engine.worker.rows()
        where = f"{name}, step {out.step} ({out.summary()})"
        rows_before = len(row_of)
        snapshot = (dict(row_of), [table.row(r) for r in range(table.max_num_reqs)])
        try:
            fn(table, row_of, out)
        except (KeyError, IndexError) as exc:
            key = exc.args[0] if exc.args else None
            if key in out.scheduled_resumed_reqs:
                raise WrongAnswer(
                    f"{where}: raised {type(exc).__name__}: {exc!r} for "
                    f"the resumed request {key!r}, which has no row since "
                    "its preemption", APPEND_FOR_RESUMED.diagnosis()) from None
            leaving = out.finished_req_ids + out.preempted_req_ids
            if isinstance(exc, IndexError) and leaving and rows_before >= table.max_num_reqs:
                raise WrongAnswer(
                    f"{where}: raised IndexError: {exc} -- all "
                    f"{table.max_num_reqs} rows were in use, and "
                    f"{', '.join(leaving)} left in this step",
                    _full_table_mistake(fn, snapshot, out, table)) from None
            raise
        _check_table(table, row_of, want, out, where)
    if "preemptions" in name and not {"preempted", "resumed"} <= seen:
        raise RuntimeError(f"scenario {name!r} preempts nobody")  # our bug


def check_update_block_table(update_block_table, seed: int = 0,
                             timeout: float = 30.0) -> CheckReport:
    """Check ``update_block_table(table, row_of, scheduler_output)``.

    Real engines run step by step; after every step the learner's table
    must hold, for every request, the row the engine's worker holds.
    """
    c = Checker("update_block_table", timeout=timeout)
    scenarios = _table_scenarios(seed)
    with one_thread(), c:
        first = next(iter(scenarios.items()))
        c.probe(lambda: _run_table(update_block_table, first[0], *first[1]))
        for name, (args, arrivals) in scenarios.items():
            c.prop(f"{name}: the worker's rows, every step",
                   functools.partial(_run_table, update_block_table, name,
                                     args, arrivals),
                   hint="after the update the table holds one row per "
                        "request in the batch, rows 0..n-1, each naming "
                        "exactly the blocks the scheduler gave that request")
    return c.report


catalogue(check_update_block_table, TABLE_MISTAKES)


# ===================================================== 2. the token budget

def _budget_reference(budget, running, waiting, max_num_seqs):
    """The scheduler's arithmetic, written out (an oracle of our own)."""
    got = []
    for need in running:
        n = min(need, budget)
        got.append(n)
        budget -= n
    num_running = len(running)
    stopped = False
    for need in waiting:
        if stopped or budget <= 0 or num_running >= max_num_seqs:
            stopped = True
            got.append(0)
            continue
        n = min(need, budget)
        got.append(n)
        budget -= n
        num_running += 1
    return got


def _waiting_first(budget, running, waiting, max_num_seqs):
    w = _budget_reference(budget, [], waiting, max_num_seqs - len(running))
    left = budget - sum(w)
    r = _budget_reference(left, running, [], max_num_seqs)
    return r + w


def _no_chunking(budget, running, waiting, max_num_seqs):
    got = _budget_reference(budget, running, [], max_num_seqs)
    budget -= sum(got)
    num, stopped = len(running), False
    for need in waiting:
        if stopped or need > budget or num >= max_num_seqs:
            stopped = True
            got.append(0)
            continue
        got.append(need)
        budget -= need
        num += 1
    return got


def _skip_ahead(budget, running, waiting, max_num_seqs):
    got = _budget_reference(budget, running, [], max_num_seqs)
    budget -= sum(got)
    num = len(running)
    for need in waiting:
        if need > budget or num >= max_num_seqs:
            got.append(0)
            continue
        got.append(need)
        budget -= need
        num += 1
    return got


def _chunk_first(budget, running, waiting, max_num_seqs):
    """The first waiting prompt is cut to leave room for the others."""
    got = _budget_reference(budget, running, [], max_num_seqs)
    budget -= sum(got)
    slots = max_num_seqs - len(running)
    admit = [w for w in waiting][:max(slots, 0)]
    if not admit or budget <= 0:
        return got + [0] * len(waiting)
    rest = sum(admit[1:])
    first = max(min(admit[0], budget - rest), 0)
    plan = [first] + _budget_reference(budget - first, [], admit[1:],
                                       len(admit) - 1)
    return got + plan + [0] * (len(waiting) - len(admit))


def _one_each(budget, running, waiting, max_num_seqs):
    return _budget_reference(budget, [1] * len(running), waiting,
                             max_num_seqs)


def _no_seq_limit(budget, running, waiting, max_num_seqs):
    return _budget_reference(budget, running, waiting, 10**9)


def _seq_limit_on_waiting(budget, running, waiting, max_num_seqs):
    got = _budget_reference(budget, running, [], max_num_seqs)
    return got + _budget_reference(budget - sum(got), [], waiting,
                                   max_num_seqs)


BUDGET_MISTAKES = [
    Mistake("waiting before running",
            "running requests are served first, in running order; waiting "
            "ones only get what is left of the budget",
            _waiting_first),
    Mistake("no chunking",
            "with chunked prefill the last prompt admitted gets what is "
            "left of the budget, min(prompt, budget), instead of waiting",
            _no_chunking),
    Mistake("skipped a prompt that does not fit and admitted a later one",
            "first come, first served: the queue is taken in order and "
            "nobody overtakes its front; the one that does not fit whole "
            "is chunked, and admissions stop there", _skip_ahead),
    Mistake("chunked the wrong request",
            "only the last request admitted is cut, to what is left of the "
            "budget; the ones before it get their whole prompts",
            _chunk_first),
    Mistake("one token for every running request",
            "a running request in the middle of a chunked prompt needs the "
            "rest of its prompt: give it min(what it still needs, budget)",
            _one_each),
    Mistake("ignored max_num_seqs",
            "admissions stop once running + admitted = max_num_seqs",
            _no_seq_limit),
    Mistake("max_num_seqs counted against the waiting requests alone",
            "the running requests count too: admit at most max_num_seqs - "
            "len(running)", _seq_limit_on_waiting),
]


def _budget_states(seed: int, count: int):
    """``(budget, running, waiting, max_num_seqs, scheduled)`` from a real
    scheduler driven to random states; ``scheduled`` is its answer."""
    rng = random.Random(seed)
    states = []
    while len(states) < count:
        max_num_seqs = rng.randrange(2, 6)
        budget = rng.randrange(max_num_seqs, 24)
        manager = KVCacheManager(400, 4, enable_caching=False)
        sched = Scheduler(manager, max_num_seqs, budget, max_model_len=64)
        arrivals = 0

        def arrive(k):
            nonlocal arrivals
            for _ in range(k):
                rid = f"q{arrivals}"
                sched.add_request(EngineRequest(
                    rid, random_prompt(rng, rng.randrange(1, 30)),
                    max_tokens=rng.randrange(1, 12), ignore_eos=True,
                    arrival=arrivals))
                arrivals += 1

        arrive(rng.randrange(1, 6))
        for _ in range(rng.randrange(0, 12)):
            if rng.random() < 0.4:
                arrive(rng.randrange(1, 4))
            if not sched.has_unfinished_requests():
                arrive(1)
            out = sched.schedule()
            sampled = {
                rid: 7 for rid, n in out.num_scheduled_tokens.items()
                if out.num_computed_tokens[rid] + n
                == sched.requests[rid].num_tokens}
            sched.update_from_output(out, ModelRunnerOutput(sampled))
        if rng.random() < 0.7:
            arrive(rng.randrange(1, 4))
        if not sched.has_unfinished_requests():
            continue
        running = [r.num_tokens - r.num_computed_tokens
                   for r in sched.running]
        waiting = [r.num_tokens for r in sched.waiting]
        ids = [r.request_id for r in sched.running]
        ids += [r.request_id for r in sched.waiting]
        out = sched.schedule()
        scheduled = [out.num_scheduled_tokens.get(rid, 0) for rid in ids]
        states.append((budget, running, waiting, max_num_seqs, scheduled))
    return states


def _hand_states():
    """States where the mistakes show, answered by ``_budget_reference``
    (which the random states hold to the real scheduler)."""
    return [
        (8, [1, 1], [5, 9], 4),       # the second prompt is chunked
        (10, [1], [3, 20, 2], 4),      # a long prompt blocks a short one
        (6, [4, 1], [3], 3),           # a running request mid-prompt
        (16, [1, 1, 1], [2, 2], 4),    # max_num_seqs stops the second
        (12, [], [5, 5, 5], 3),        # nothing running: 5, 5, 2
        (20, [1], [2, 2, 2, 2, 2], 3),  # more waiting than seats
    ]


def _check_budget_case(fn, budget, running, waiting, max_num_seqs,
                       want, where) -> None:
    args = (budget, list(running), list(waiting), max_num_seqs)
    got = fn(*args)
    try:
        got = [expect_int(x, "an entry") for x in got]
    except TypeError:
        raise AssertionError(f"{where}: returned {short_repr(got)}, expected a "
                             "list of ints") from None
    if len(got) != len(running) + len(waiting):
        raise AssertionError(
            f"{where}: returned {len(got)} numbers for {len(running)} "
            f"running and {len(waiting)} waiting requests: one each, 0 for "
            "a request that gets nothing")
    if got != want:
        probes = [tuple(a) for a in _hand_states()]
        raise WrongAnswer(
            f"{where}: you gave {got}, the scheduler {want}",
            name_mistake(got, args, BUDGET_MISTAKES, call=fn, probes=probes))


def _budget_where(budget, running, waiting, max_num_seqs) -> str:
    return (f"budget {budget}, running needs {running}, waiting prompts "
            f"{waiting}, max_num_seqs {max_num_seqs}")


def check_tokens_this_step(tokens_this_step, seed: int = 0,
                           timeout: float = 20.0) -> CheckReport:
    """Check ``tokens_this_step(budget, running, waiting, max_num_seqs)``
    against the scheduler's ``num_scheduled_tokens``."""
    fn = tokens_this_step
    c = Checker("tokens_this_step", timeout=timeout)

    def hand(*cases):
        def body():
            for args in cases:
                want = _budget_reference(*args)
                _check_budget_case(fn, *args, want, _budget_where(*args))
        return body

    def random_states():
        states = _budget_states(seed, 150)
        for budget, running, waiting, seqs, want in states:
            if _budget_reference(budget, running, waiting, seqs) != want:
                raise RuntimeError("the oracle and the scheduler disagree")
            _check_budget_case(fn, budget, running, waiting, seqs, want,
                               _budget_where(budget, running, waiting, seqs))

    cases = _hand_states()
    with c:
        c.probe(hand(cases[0]))
        c.prop("running first, then the queue in order, the last chunked",
               hand(cases[0], cases[1], cases[4]),
               hint="the running requests are served before anyone "
                    "waiting, and the queue first come, first served")
        c.prop("a running request mid-prompt gets the rest of its chunk",
               hand(cases[2]))
        c.prop("max_num_seqs counts running and admitted requests",
               hand(cases[3], cases[5]))
        c.prop("150 random states of a real scheduler: its "
               "num_scheduled_tokens", random_states)
    return c.report


catalogue(check_tokens_this_step, BUDGET_MISTAKES)
