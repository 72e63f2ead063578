"""Exercise 6, modify and measure: copy at the fork instead of on write.

``PagedKV.fork`` shares every page and copies a partial page only when a
sample writes into it. The reader writes the eager policy as a subclass,
``EagerForkKV`` overriding ``fork`` (the extension point): the child gets a
private copy of every page at once. They predict the peak number of pages
``sim.run_forks`` reaches on ``sim.FORK_WORKLOAD`` (parallel sampling, four
samples per prompt) and measure it. The checker runs the workload with the
reader's class, so the measurement is graded for *their* policy.
"""

from __future__ import annotations

import functools

from ..common import InvariantError
from ..sim.fork_workload import FORK_WORKLOAD, run_forks
from ..sim.paged_kv import PagedKV
from ._harness import Mistake, WrongAnswer, catalogue
from .measure_harness import Experiment, check_experiment

__all__ = ["check_eager_fork_experiment", "peak_pages"]


def peak_pages(pool_class) -> int:
    """The most pages allocated at once on the notebook's workload, with ``pool_class``."""
    if pool_class is PagedKV:
        return _library_peak()
    return run_forks(pool_class, FORK_WORKLOAD).peak_pages


@functools.lru_cache(maxsize=None)
def _library_peak() -> int:
    return run_forks(PagedKV, FORK_WORKLOAD).peak_pages


def _eager_peak() -> int:
    """What eager copying holds: every sample its own table of cdiv(prompt + output) pages."""
    w, B = FORK_WORKLOAD, FORK_WORKLOAD.block_size
    return w.samples * sum(-(-(n + w.output_len) // B) for n in w.prompt_lengths())


MEASUREMENT_MISTAKES = [
    Mistake("the library's fork measured", "run the workload with your EagerForkKV, not "
            "PagedKV", lambda t: _library_peak()),
    Mistake("the prompts alone", "the peak comes after decoding: every sample's output "
            "pages count too", lambda t: FORK_WORKLOAD.samples * sum(
                -(-n // FORK_WORKLOAD.block_size) for n in FORK_WORKLOAD.prompt_lengths())),
]


def _state(pool):
    return ({r: list(t) for r, t in pool.tables.items()},
            {p: sorted(o) for p, o in pool.owners.items()}, sorted(pool.free),
            {p: list(t) for p, t in pool.pages.items()})


SCENARIOS = ((33, 12, True), (10, 8, False), (16, 8, False), (3, 4, False))  # a refusal first


def _scenarios(cls, which=SCENARIOS):
    """(pool, parent, child) after a prompt of n tokens and, sometimes, an older fork."""
    out = []
    for n, capacity, pre_fork in which:
        pool = cls(capacity, 4)
        pool.create("a")
        for t in range(n):
            pool.append("a", 100 + t)
        if pre_fork:
            PagedKV.fork(pool, "a", "z")  # an older sample that shares a's pages
        out.append((pool, "a", "b"))
    return out


def check_eager_fork_experiment(EagerForkKV, predicted_peak=None, measured_peak=None,
                                verbose: bool = True):
    """Grade exercise 6's experiment: the eager fork, the peak pages, the prediction."""
    is_pool = isinstance(EagerForkKV, type) and issubclass(EagerForkKV, PagedKV)

    def not_a_pool():
        raise WrongAnswer(f"EagerForkKV is {EagerForkKV!r}",
                          "not a PagedKV subclass -- the extension point is a subclass of "
                          "PagedKV that overrides fork")

    def probe():
        pool, parent, child = _scenarios(EagerForkKV, SCENARIOS[1:2])[0]
        pool.fork(parent, child)

    def check_rule():
        if not is_pool:
            not_a_pool()
        for pool, parent, child in _scenarios(EagerForkKV):
            before = _state(pool)
            parent_pages = list(pool.tables[parent])
            too_small = len(pool.free) < len(parent_pages)
            try:
                pool.fork(parent, child)
            except MemoryError:
                if not too_small:
                    raise
                if _state(pool) != before:
                    raise WrongAnswer("a fork refused with MemoryError changed the pool",
                                      "a partial fork left behind -- count the free pages "
                                      "before allocating any") from None
                continue
            table = pool.tables.get(child)
            if table is None:
                raise WrongAnswer(f"after fork({parent!r}, {child!r}) the child has no table")
            shared = set(table) & set(parent_pages)
            if shared == set(parent_pages):
                raise WrongAnswer(f"the child's table {table} is the parent's",
                                  "pages shared, not copied -- that is copy-on-write's fork; "
                                  "the eager policy gives the child a private copy of every page")
            if shared:
                raise WrongAnswer(f"the child shares pages {sorted(shared)} with the parent",
                                  "only the partial tail copied -- the eager policy copies "
                                  "every page, full ones too, at the fork")
            if [pool.pages[p] for p in table] != [pool.pages[p] for p in parent_pages]:
                raise WrongAnswer("the child's pages do not hold the parent's tokens, page "
                                  "by page")
            if too_small:  # it forked without the free pages its copies need
                raise WrongAnswer(f"forking {len(parent_pages)} pages with {len(before[2])} "
                                  "free did not raise MemoryError",
                                  "copies need free pages -- refuse before changing anything")
            if pool.tables[parent] != parent_pages:
                raise WrongAnswer("the parent's table changed", "the parent keeps its pages")
            try:
                pool.check()
            except InvariantError as exc:
                raise WrongAnswer(str(exc), "owners not kept -- each copy's owner is the "
                                  "child alone, recorded in pool.owners") from None
            after = _state(pool)
            try:
                pool.fork(parent, child)
            except ValueError:
                if _state(pool) == after:
                    continue
            except Exception:  # noqa: BLE001 -- named below: the refusal must come first
                pass
            raise WrongAnswer(f"forking into the existing request {child!r} was not refused "
                              "with ValueError, nothing changed",
                              "refuse a child id that exists, before any change")

    def lesson(pred, true):
        lib = _library_peak()
        if pred < true:
            return (f"copy-on-write peaks at {lib} pages here, eager copying at {true}: every "
                    "sample holds a full private table, prompt included, so the prompt is paid "
                    "once per sample where sharing pays it once per prompt")
        return ("eager copying costs each sample its whole table and nothing more: the pool "
                "holds samples x the pages of prompt + output per prompt, no copies on top")

    e = Experiment(
        title="experiment: copy at the fork",
        rule="EagerForkKV.fork gives the child a private copy of every page",
        check_rule=check_rule, probe=probe if is_pool else not_a_pool,
        library={"PagedKV.fork": PagedKV.fork},
        remeasure=(lambda: peak_pages(EagerForkKV)) if is_pool else not_a_pool,
        what="the peak pages allocated", measured=measured_peak, predicted=predicted_peak,
        measured_name="measured_peak", predicted_name="predicted_peak", lesson=lesson,
        fmt=lambda v: f"{v:,.0f} pages", tolerance=0.5,
        prediction_tolerance=0.1 * _eager_peak(), measurement_mistakes=MEASUREMENT_MISTAKES,
        rule_hint="every page of the parent gets a private copy owned by the child alone, "
                  "in order; a refusal comes before the first allocation",
        measure_hint="sim.run_forks(EagerForkKV).peak_pages", stub_policy=is_pool)
    return check_experiment(e, verbose)


catalogue(check_eager_fork_experiment, MEASUREMENT_MISTAKES)
