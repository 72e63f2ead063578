"""Exercise 8's prediction and design tasks.

* ``check_step_prediction(predicted_step)``: the notebook shows ``STEP_TRACE``,
  four running requests on a ``Scheduler`` whose pool is nearly full and one
  waiting; the reader writes who runs in the next step, who is preempted (in
  order) and the waiting queue it leaves, before running it. The checker runs
  the trace on the library, compares, and on a mismatch draws PagedAttention's
  picture of the requests that hold blocks after the step beside the one
  predicted (the book's ``render_paged_layout``); a small list model of the
  step with one rule changed names the misunderstanding.
* ``check_pool_design(num_gpu_blocks)``: the smallest pool
  (``num_gpu_blocks_override``, the null block included) on which a given
  workload runs without a preemption, checked by property: the engine's
  scheduler runs the workload without a preemption on that pool and
  preempts on one block less (or the engine would not start there). On a
  miss the KV usage of the runs around it is drawn (``kv_usage_figure``).
"""

from __future__ import annotations

import numbers

from ..engine import EngineRequest, ModelRunnerOutput, Scheduler
from ..engine.stats import StepHistory
from ..kv_cache_manager import KVCacheManager
from ..views.figures import kv_usage_figure
from ..views.paged_layout import render_paged_layout
from ._harness import Mistake, catalogue
from .predict_harness import PredictionReport, check_prediction, side_by_side

__all__ = ["check_step_prediction", "check_pool_design", "STEP_TRACE", "run_step_trace",
           "POOL_WORKLOAD", "POOL_SETTINGS", "run_pool_design"]

# ==================================================== who runs, who is preempted
#: The trace, as the notebook shows it (and as the checker runs it).
STEP_TRACE = """\
manager = KVCacheManager(8, block_size=4, enable_caching=False)  # 7 usable
sched = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=16,
                  max_model_len=40)


def arrive(request_id, prompt_len):          # 20 tokens to generate
    sched.add_request(EngineRequest(request_id, [ord(request_id)] * prompt_len,
                                    max_tokens=20, ignore_eos=True))


def step():                                  # a step; each finished prompt
    out = sched.schedule()                   # or decode samples token 7
    ran = out.num_scheduled_tokens
    done = {r: 7 for r, n in ran.items()
            if out.num_computed_tokens[r] + n == sched.requests[r].num_tokens}
    sched.update_from_output(out, ModelRunnerOutput(done))
    return out


for request_id, prompt_len in [("A", 2), ("B", 6), ("C", 6), ("D", 2),
                               ("E", 3)]:
    arrive(request_id, prompt_len)
step()      # step 1: A, B, C, D run their prompts; E waits (max_num_seqs)
step()      # step 2: one decode token each
step()      # step 3: one decode token each
# Now A has 4 tokens in block [1], B 8 in [2, 3], C 8 in [4, 5], D 4 in
# [6]; block 7 is free; each has one sampled token to compute; E waits.
out = step()                                 # step 4: predict it
"""

_RUNNING = ["A", "B", "C", "D"]


def run_step_trace():
    """Run ``STEP_TRACE`` on the library: the scheduler after step 4, its output, and its manager."""
    namespace: dict = {"KVCacheManager": KVCacheManager, "Scheduler": Scheduler,
                       "EngineRequest": EngineRequest, "ModelRunnerOutput": ModelRunnerOutput}
    exec(STEP_TRACE, namespace)  # noqa: S102 -- the module's own constant
    return namespace["sched"], namespace["out"], namespace["manager"]


def _state_before():
    """The trace up to step 3: each running request's tokens and blocks, the free blocks, the queue."""
    namespace: dict = {"KVCacheManager": KVCacheManager, "Scheduler": Scheduler,
                       "EngineRequest": EngineRequest, "ModelRunnerOutput": ModelRunnerOutput}
    exec(STEP_TRACE.replace("out = step()", "pass"), namespace)  # noqa: S102
    sched, m = namespace["sched"], namespace["manager"]
    running = [(r.request_id, r.num_computed_tokens, m.get_block_ids(r.request_id))
               for r in sched.running]
    return running, m.get_num_free_blocks(), [r.request_id for r in sched.waiting]


def step_model(*, victim="last", admit_after=False, requeue="front"):
    """Who runs, who is preempted, the queue after step 4 under the rules, one of them changed.

    ``victim``: ``"last"`` (the last running request), ``"self"`` (the
    request that needs room), ``"first"`` (the first running request);
    ``admit_after``: admissions in a step that preempted; ``requeue``:
    ``"front"`` (``appendleft``) or ``"back"``.
    """
    running, free, waiting = _state_before()
    B = 4
    held = {rid: len(blocks) for rid, _, blocks in running}
    order = [rid for rid, _, _ in running]
    needs = {rid: computed % B == 0 for rid, computed, _ in running}  # the next token starts a block
    runs, preempted, waiting = [], [], list(waiting)
    i = 0
    while i < len(order):
        rid = order[i]
        stop = False
        while needs[rid] and free == 0:
            target = {"last": order[-1], "self": rid, "first": order[0]}[victim]
            order.remove(target)
            free += held[target]
            preempted.append(target)
            if target in runs:
                runs.remove(target)
            waiting = [target] + waiting if requeue == "front" else waiting + [target]
            if target == rid:
                stop = True
                break
        if stop:
            break  # it preempted itself: it was the last running request
        if needs[rid]:
            free -= 1
        runs.append(rid)
        i = order.index(rid) + 1
    if admit_after or not preempted:
        while waiting and len(order) < 4 and free >= 1:
            rid = waiting.pop(0)
            order.append(rid)
            runs.append(rid)
            free -= 1
    return {"runs": runs, "preempted": preempted, "waiting": waiting}


STEP_MISTAKES = [
    Mistake("each request that finds no block preempts itself", "a running "
            "request that needs room takes it from the last request in "
            "scheduler.running; it waits itself only when it is that last "
            "request", lambda: step_model(victim="self")),
    Mistake("the first running request preempted", "first come, first served "
            "owes the least to the request that joined last: the victim is "
            "the last running request, never the oldest",
            lambda: step_model(victim="first")),
    Mistake("admitting after a preemption", "a step that had to preempt "
            "admits nobody from the waiting queue: the blocks it freed go to "
            "the running requests, and the queue waits for the next step",
            lambda: step_model(admit_after=True)),
    Mistake("preempted requests queued at the back", "a preempted request "
            "goes back to the front of the waiting queue (appendleft), so it "
            "resumes before anyone who arrived after it; preempted one after "
            "the other, the later one ends up first",
            lambda: step_model(requeue="back")),
    Mistake("the waiting queue in preemption order", "each preempted "
            "request is put at the front of the queue as it is preempted "
            "(appendleft, one at a time): the one preempted last stands "
            "first, so the queue's front holds the victims in the reverse of "
            "the order they were preempted in",
            lambda: _in_preemption_order(_library_step())),
]
ADMITTED_AFTER = STEP_MISTAKES[2]


def _library_step() -> dict:
    """Step 4 as the library runs it: who runs, who is preempted (in order), the queue after."""
    sched, out, _ = run_step_trace()
    return {"runs": list(out.num_scheduled_tokens), "preempted": list(out.preempted_req_ids),
            "waiting": [r.request_id for r in sched.waiting]}


def _in_preemption_order(step: dict) -> dict:
    """``step`` with its victims at the queue's front in the order they were preempted."""
    victims = list(step["preempted"])
    return {**step, "waiting": victims + [r for r in step["waiting"] if r not in victims]}

_STEP_SHAPE = ("expected predicted_step as a dict {'runs': [request ids], "
               "'preempted': [request ids, in order], 'waiting': [request "
               "ids, front first]}")


def _names(value, what: str) -> list[str]:
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise AssertionError(f"{_STEP_SHAPE}; {what} is {type(value).__name__} {value!r:.30}")
    names = list(value)
    for n in names:
        if not isinstance(n, str):
            raise AssertionError(f"{_STEP_SHAPE}; {what} holds {n!r:.20}, not a request id")
    return names


def _read_step(predicted) -> dict:
    if not isinstance(predicted, dict):
        raise AssertionError(f"{_STEP_SHAPE}; got {type(predicted).__name__}")
    if sorted(predicted) != ["preempted", "runs", "waiting"]:
        raise AssertionError(f"{_STEP_SHAPE}; its keys are {sorted(predicted)!r:.50}")
    got = {key: _names(predicted[key], f"predicted_step[{key!r}]") for key in predicted}
    for key, names in got.items():
        unknown = [n for n in names if n not in "ABCDE" or len(n) != 1]
        if unknown:
            raise AssertionError(f"predicted_step[{key!r}] names {unknown[0]!r:.12}: the "
                                 "requests are A, B, C, D and E")
    return got


def _compare_step(got: dict, want: dict) -> str | None:
    if sorted(got["runs"]) != sorted(want["runs"]):
        return (f"who runs in step 4: you predicted {sorted(got['runs'])}, the "
                f"trace runs {want['runs']}")
    if got["preempted"] != want["preempted"]:
        return (f"who is preempted, in order: you predicted {got['preempted']}, "
                f"the trace preempts {want['preempted']}")
    if got["waiting"] != want["waiting"]:
        return (f"the waiting queue after the step, front first: you predicted "
                f"{got['waiting']}, the trace leaves {want['waiting']}")
    return None


def _diagnose_step(got: dict) -> str | None:
    right = _library_step()
    models = [(m, m.model()) for m in STEP_MISTAKES]
    for m, model in models:
        if sorted(model["runs"]) == sorted(got["runs"]) and all(
                model[k] == got[k] for k in ("preempted", "waiting")):
            return m.diagnosis()
    # Someone from the queue (one that waited, or a victim of the step) runs in a step
    # that preempted, as predicted and in fact: admitted after the preemption.
    before = {rid for rid, _, _ in _state_before()[0]}
    if (right["preempted"] and got["preempted"]
            and not set(right["runs"]) - (before - set(right["preempted"]))
            and set(got["runs"]) - (before - set(got["preempted"]))):
        return ADMITTED_AFTER.diagnosis()
    for key in ("preempted", "waiting"):  # one part explained
        for m, model in models:
            if model[key] != right[key] and model[key] == got[key]:
                return m.diagnosis()
    return None


def check_step_prediction(predicted_step) -> PredictionReport:
    """Grade a prediction of step 4 of ``STEP_TRACE``: who runs, who is preempted, the queue."""
    sched, out, manager = run_step_trace()
    want = {"runs": list(out.num_scheduled_tokens), "preempted": list(out.preempted_req_ids),
            "waiting": [r.request_id for r in sched.waiting]}
    assert want == step_model(), "the list model and the library disagree (a bug in pagedkv)"
    before, _, _ = _state_before()
    blocks_before = {rid: blocks for rid, _, blocks in before}

    def draw(got):
        rows = {rid: blocks_before[rid] for rid in _RUNNING if rid in got["runs"]}
        return side_by_side(
            render_paged_layout(manager, list(sched.running),
                                title=(f"after step 4: {', '.join(want['runs'])} ran; "
                                       f"preempted {', '.join(want['preempted']) or 'nobody'}; "
                                       f"waiting {', '.join(want['waiting'])}")),
            render_paged_layout(rows, block_size=4,
                                title=(f"your step 4: {', '.join(got['runs']) or 'nobody'} ran "
                                       "(blocks as before it); preempted "
                                       f"{', '.join(got['preempted']) or 'nobody'}; waiting "
                                       f"{', '.join(got['waiting'])}")),
            min_px=480)

    return check_prediction(
        "prediction", "predicted_step", predicted_step, want, read=_read_step,
        compare=_compare_step, draw=draw, diagnose=_diagnose_step,
        name="who runs in step 4, who is preempted, and the queue it leaves",
        hint="go through the running requests in order: does its next token "
             "start a block, is one free, and if not, whom does it take it from?")


catalogue(check_step_prediction, STEP_MISTAKES)


# ================================================= the smallest pool, by design
#: The workload: (request id, prompt tokens, tokens to generate), all arriving at once.
POOL_WORKLOAD = (("A", 8, 4), ("B", 3, 14), ("C", 6, 10))
#: The scheduler's settings for it (the engine's defaults but these).
POOL_SETTINGS = dict(block_size=4, max_model_len=24, max_num_seqs=4,
                     max_num_batched_tokens=32)
_MAX_POOL = 200


class Rejected(AssertionError):
    """A design that breaks the task's rules (the message says which)."""


class _Engine:
    """What ``StepHistory`` reads of an engine, for a scheduler driven alone."""

    def __init__(self, sched: Scheduler, block_size: int) -> None:
        self.scheduler, self.kv_cache_manager = sched, sched.kv_cache_manager
        self.args = type("Args", (), {"block_size": block_size})()


def run_pool_design(num_gpu_blocks: int):
    """Run ``POOL_WORKLOAD`` on a pool of ``num_gpu_blocks`` (the null block included).

    Returns ``(preemptions, history, refusal)``: the engine's scheduler with
    prefix caching off and no watermark, each sampled token made up (the
    workload ignores EOS, so only lengths matter); ``refusal`` is the reason
    the engine would not start on that pool (then the rest is ``None``).
    """
    B, max_len = POOL_SETTINGS["block_size"], POOL_SETTINGS["max_model_len"]
    usable = num_gpu_blocks - 1
    if usable * B < max_len:
        return None, None, (f"one {max_len}-token request (max_model_len) needs "
                            f"{-(-max_len // B)} blocks of {B}, and {num_gpu_blocks} "
                            f"blocks leave {usable} besides the null block")
    sched = Scheduler(KVCacheManager(num_gpu_blocks, B, enable_caching=False),
                      POOL_SETTINGS["max_num_seqs"], POOL_SETTINGS["max_num_batched_tokens"],
                      max_len)
    history, engine = StepHistory(), _Engine(sched, B)
    for rid, prompt, max_tokens in POOL_WORKLOAD:
        sched.add_request(EngineRequest(rid, [1 + ord(rid) + i for i in range(prompt)],
                                        max_tokens=max_tokens, ignore_eos=True))
    while sched.has_unfinished_requests():
        out = sched.schedule()
        done = {r: 7 for r, n in out.num_scheduled_tokens.items()
                if out.num_computed_tokens[r] + n == sched.requests[r].num_tokens}
        sched.update_from_output(out, ModelRunnerOutput(done))
        history(engine, out, [])
    return sched.num_preemptions, history, None


def check_pool_design(num_gpu_blocks) -> PredictionReport:
    """Check the smallest ``num_gpu_blocks_override`` on which ``POOL_WORKLOAD`` never preempts."""
    runs: dict = {}

    def read(n):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise Rejected(f"expected num_gpu_blocks as an int, got {type(n).__name__} {n!r:.20}")
        n = int(n)
        if not 2 <= n <= _MAX_POOL:
            raise Rejected(f"num_gpu_blocks={n}: try a pool from 2 to {_MAX_POOL} blocks")
        for size in (n - 1, n, n + 1):
            if size >= 2:
                runs[size] = run_pool_design(size)
        preempted, _, refused = runs[n]
        if refused is not None:
            raise Rejected(f"the engine refuses to start on {n} blocks: {refused}")
        return n

    def compare(n, _):
        preempted = runs[n][0]
        if preempted:
            return (f"on {n} blocks ({n - 1} usable) the workload preempts {preempted} "
                    "time(s): the pool is too small")
        smaller, _, refused = runs.get(n - 1, (None, None, "a pool of 1 block"))
        if refused is None and not smaller:
            return (f"on {n - 1} blocks it runs without a preemption too: {n} is not "
                    "the smallest")
        return None

    def draw(n):
        shown = [(size, runs[size][1]) for size in sorted(runs) if runs[size][1] is not None]
        return kv_usage_figure([h for _, h in shown],
                               labels=[f"{size} blocks" for size, _ in shown],
                               title="KV usage of the workload, by pool size", mark="all")

    return check_prediction(
        "design", "num_gpu_blocks", num_gpu_blocks, None, read=read, compare=compare,
        draw=draw, name="the smallest pool on which the workload never preempts",
        hint="a request computing its k-th token holds cdiv(prompt + k, block_size) "
             "blocks until it finishes; what do all of them hold together at "
             "their busiest step, and what does the pool add to its usable blocks?")
