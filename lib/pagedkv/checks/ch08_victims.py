"""Exercise 8, "change the victim and measure": a preemption policy against the default, on one workload.

The reader writes ``choose_victim(running, request)``: which running request
to preempt when ``request`` needs room (the default, vLLM's FCFS rule, is
``running[-1]``, the newest). ``victim_loop`` wraps it into the loop the
scheduler takes (``Scheduler(allocate_with_preemption=...)``, the extension
point). The reader predicts, before measuring, whether the rule gives more,
fewer or the same preemptions, recomputed tokens and mean time to first
token than the default; ``check_victim_policy`` measures both rules on
``VICTIM_WORKLOAD`` with ``drive`` and compares.

``drive`` runs a ``Scheduler`` with no model (each request that finishes its
prompt or a decode step samples token 7), adds each request at the step after
its arrival, calls ``check()`` after every step, and measures:

* ``preemptions``: calls to ``scheduler.preempt``;
* ``recomputed``: tokens the victims had computed when preempted (work thrown
  away, computed again on resumption unless a prefix-cache hit saves it);
* ``ttft``: per request, steps from its arrival to the step that samples its
  first token (1: the step right after it arrived); ``mean_ttft`` their mean;
* ``broke``: the first ``check()`` failure, ``(step, message)``, or ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..common import InvariantError
from ..engine import EngineRequest, ModelRunnerOutput, Scheduler
from ..kv_cache_manager import KVCacheManager
from ._harness import Checker, CheckReport, WrongAnswer

__all__ = ["VICTIM_WORKLOAD", "POOL", "Run", "MeasuredScheduler", "drive", "victim_loop", "newest",
           "check_victim_policy", "METRICS"]

#: (request id, prompt tokens, tokens to generate, arrival step, priority: smaller runs first)
VICTIM_WORKLOAD = (("A", 6, 14, 0, 1), ("B", 9, 12, 0, 0), ("C", 3, 16, 1, 2), ("D", 5, 10, 2, 0),
                   ("E", 7, 12, 4, 1), ("F", 2, 10, 6, 0))
#: The pool: 12 usable blocks of 4 tokens, 4 requests at most, 16 tokens a step, prefix caching on.
POOL = dict(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
METRICS = ("preemptions", "recomputed", "mean_ttft")
_MAX_STEPS = 400


@dataclass
class Run:
    steps: int = 0
    preemptions: int = 0
    recomputed: int = 0
    ttft: dict = field(default_factory=dict)
    #: (step, victim id, its computed tokens, every running request's computed tokens) per preemption
    victims: list = field(default_factory=list)
    broke: tuple | None = None
    summaries: list = field(default_factory=list)

    @property
    def mean_ttft(self) -> float:
        return round(sum(self.ttft.values()) / len(self.ttft), 2) if self.ttft else float("nan")


def newest(running, request):
    """The default rule (vLLM's FCFS): the request that joined ``running`` last."""
    return running[-1]


def victim_loop(choose_victim):
    """The scheduler's loop around a victim rule: allocate, else preempt ``choose_victim``'s pick and retry."""
    def loop(scheduler, request, num_new_tokens):
        while True:
            blocks = scheduler.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if blocks is not None:
                return blocks
            victim = choose_victim(list(scheduler.running), request)
            if not any(victim is r for r in scheduler.running):
                raise ValueError(f"the victim must be one of the running requests, got {victim!r}")
            scheduler.preempt(victim)
            if victim is request:
                return None
    return loop


class MeasuredScheduler(Scheduler):
    """A ``Scheduler`` that records each preemption (the subclass overrides ``preempt``, then defers)."""

    #: (step, victim id, its computed tokens, every running request's computed tokens), per preemption
    victims: list

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.victims = []

    def preempt(self, victim) -> None:
        self.victims.append((self.step_count, victim.request_id, victim.num_computed_tokens,
                             {r.request_id: r.num_computed_tokens for r in self.running}))
        super().preempt(victim)


def drive(loop, workload=VICTIM_WORKLOAD, *, max_num_seqs: int | None = None, stop_at_broken: bool = True) -> Run:
    """Run ``workload`` on a fresh scheduler with ``loop``; measure (see the module docstring)."""
    manager = KVCacheManager(POOL["num_blocks"] + 1, block_size=POOL["block_size"], enable_caching=True)
    s = MeasuredScheduler(manager, max_num_seqs=max_num_seqs or POOL["max_num_seqs"],
                          max_num_batched_tokens=POOL["max_num_batched_tokens"], max_model_len=64,
                          allocate_with_preemption=loop)
    pending = sorted(workload, key=lambda w: w[3])
    first: dict = {}
    summaries: list = []
    broke = None
    steps = 0
    while (pending or s.has_requests()) and steps < _MAX_STEPS:
        steps += 1
        while pending and pending[0][3] < steps:
            rid, prompt, max_tokens, arrival, priority = pending.pop(0)
            s.add_request(EngineRequest(rid, [ord(rid)] * prompt, max_tokens=max_tokens, ignore_eos=True,
                                        arrival=arrival, priority=priority))
        out = s.schedule()
        done = {r: 7 for r, n in out.num_scheduled_tokens.items()
                if out.num_computed_tokens[r] + n >= s.requests[r].num_tokens}
        for r in done:
            first.setdefault(r, steps)
        summaries.append(out.summary())
        s.update_from_output(out, ModelRunnerOutput(done))
        try:
            s.check()
        except InvariantError as exc:
            broke = broke or (steps, str(exc))
            if stop_at_broken:
                break
    return Run(steps=steps, preemptions=len(s.victims), recomputed=sum(v[2] for v in s.victims),
               ttft={w[0]: first[w[0]] - w[3] for w in workload if w[0] in first}, victims=s.victims,
               broke=broke, summaries=summaries)


def _direction(mine, base) -> str:
    return "same" if mine == base else "more" if mine > base else "fewer"


def _mean_victim(run: Run) -> float:
    return sum(v[2] for v in run.victims) / len(run.victims) if run.victims else 0.0


def check_victim_policy(choose_victim, predicted, timeout: float = 60.0) -> CheckReport:
    """Measure the reader's victim rule against the default; compare the predicted directions."""
    with Checker("your victim rule, measured", timeout=timeout) as c:
        c.probe(lambda: choose_victim([EngineRequest("X", [1], 1)], EngineRequest("X", [1], 1)))
        runs: dict = {}

        def runs_clean():
            runs["base"], runs["mine"] = drive(victim_loop(newest)), drive(victim_loop(choose_victim))
            mine = runs["mine"]
            if mine.broke:
                raise AssertionError(f"step {mine.broke[0]}: {mine.broke[1]}")
            if len(mine.ttft) != len(VICTIM_WORKLOAD):
                raise AssertionError(f"after {mine.steps} steps only {sorted(mine.ttft)} had a first token")
            if [v[:2] for v in mine.victims] == [v[:2] for v in runs["base"].victims]:
                raise AssertionError("your rule preempts the same requests at the same steps as the "
                                     "default (the newest): change the policy, then measure")

        if not c.prop("your rule runs the workload, check() holding after every step, and differs "
                      "from the default", runs_clean):
            return c.report
        base, mine = runs["base"], runs["mine"]
        print("   rule      preemptions  recomputed  mean TTFT  last step")
        for name, run in (("default", base), ("yours", mine)):
            print(f"   {name:8} {run.preemptions:12} {run.recomputed:11} {run.mean_ttft:10} {run.steps:10}")

        def prediction():
            if predicted is None:
                raise AssertionError("predicted is None: write your prediction first, then run the check")
            if not isinstance(predicted, dict) or set(predicted) != set(METRICS):
                raise AssertionError(f"predicted must be a dict with the keys {METRICS}, each "
                                     f'"more", "fewer" or "same", got {predicted!r}')
            why = {
                "preemptions": f"each of your preemptions freed a victim of {_mean_victim(mine):.1f} "
                               f"computed tokens on average, the default's {_mean_victim(base):.1f}: a "
                               "bigger victim frees more blocks, so fewer are needed",
                "recomputed": "the tokens thrown away are the victims' computed tokens, summed: "
                              "fewer preemptions of bigger victims can still lose more",
                "mean_ttft": "time to first token is what a newcomer waits: it waits while the "
                             "pool is full, and a preempted request queues ahead of it",
            }
            wrong = []
            for k in METRICS:
                said = predicted[k]
                if said not in ("more", "fewer", "same"):
                    raise AssertionError(f'predicted["{k}"] must be "more", "fewer" or "same", got {said!r}')
                got = _direction(getattr(mine, k), getattr(base, k))
                if said != got:
                    wrong.append(f"{k}: you predicted {said}, measured {got} ({getattr(mine, k)} against "
                                 f"{getattr(base, k)}): {why[k]}")
            if wrong:
                raise WrongAnswer("; ".join(wrong), None)

        c.prop("your prediction matches the measurement, metric by metric", prediction)
    return c.report
