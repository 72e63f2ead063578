"""Exercise 9, modify and measure: a window that keeps what it has skipped.

A sliding-window group gives a block back as soon as the window has passed
it (``SlidingWindowManager.remove_skipped_blocks``). The reader writes the
opposite rule as a subclass, ``KeepWindowManager``, whose
``remove_skipped_blocks`` keeps every block until the request's ``free``;
predicts the most blocks the group holds at once on ``LONG_DECODES`` (four
long decodes started together); then measures it with
``serve_long_decodes``, which builds the manager from the class it is
handed (the manager's constructor is the extension point: a pool, a spec,
a group id). The checker serves the same workload with the reader's class,
so the measurement is graded for *their* rule, and the prediction against
that measurement.
"""

from __future__ import annotations

import functools
import random

from ..block_pool import BlockPool
from ..common import cdiv
from ..kv_cache_spec import SlidingWindowSpec
from ..single_type_managers import SingleTypeKVCacheManager, SlidingWindowManager
from ._harness import Mistake, WrongAnswer, catalogue
from .measure_harness import Experiment, check_experiment

__all__ = ["LONG_DECODES", "WINDOW", "BLOCK_SIZE", "serve_long_decodes",
           "check_keep_window_experiment"]

#: The workload: (prompt tokens, tokens decoded), every request admitted at step 0.
LONG_DECODES = ((100, 400), (100, 300), (100, 200), (100, 100))
#: The group's window and block size (tokens).
WINDOW, BLOCK_SIZE = 64, 16


def _spec(window: int, block_size: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=4,
                             sliding_window=window)


def serve_long_decodes(manager_class, workload=LONG_DECODES, window: int = WINDOW,
                       block_size: int = BLOCK_SIZE) -> list[int]:
    """Blocks the group holds after each step's allocations, one entry per step.

    Step 0 prefills every prompt; each later step decodes one token of every
    running request, in the order a scheduler drives a window group: first
    ``remove_skipped_blocks`` with the tokens already computed (processed
    tokens only), then ``allocate_new_blocks`` for the token being computed.
    A request that has computed all its tokens is freed before the next step.
    """
    manager_class = _manager_class(manager_class)
    # Enough blocks that no allocation ever fails, whatever the rule: every table whole.
    num_blocks = 1 + sum(cdiv(p + d, block_size) for p, d in workload)
    pool = BlockPool(num_blocks, enable_caching=False)
    manager = manager_class(_spec(window, block_size), pool, False, 0)
    usable = pool.get_num_free_blocks()
    computed = {}  # request id -> tokens computed (committed)
    total = {}
    held = []
    for i, (prompt, decode) in enumerate(workload):
        rid = f"r{i}"
        manager.allocate_new_blocks(rid, prompt)
        computed[rid], total[rid] = prompt, prompt + decode
    held.append(usable - pool.get_num_free_blocks())
    while computed:
        for rid in [r for r in computed if computed[r] == total[r]]:
            manager.free(rid)
            del computed[rid]
        if not computed:
            break
        for rid in computed:
            manager.remove_skipped_blocks(rid, computed[rid])
            manager.allocate_new_blocks(rid, computed[rid] + 1)
        held.append(usable - pool.get_num_free_blocks())
        for rid in computed:
            computed[rid] += 1
    return held


def _manager_class(cls):
    if not (isinstance(cls, type) and issubclass(cls, SlidingWindowManager)):
        raise TypeError(f"expected a SlidingWindowManager subclass, got {cls!r}")
    return cls


@functools.lru_cache(maxsize=None)
def _peak(cls) -> int:
    return max(serve_long_decodes(cls))


def _full_tables() -> int:
    """Every request's whole table at once: what a reader who forgets the frees counts."""
    return sum(cdiv(p + d, BLOCK_SIZE) for p, d in LONG_DECODES)


MEASUREMENT_MISTAKES = [
    Mistake("the library's rule measured", "the blocks were counted with SlidingWindowManager: "
            "hand serve_long_decodes your KeepWindowManager", lambda true: _peak(SlidingWindowManager)),
    Mistake("the last step, not the peak", "serve_long_decodes returns one count per step: "
            "take the largest"),
    Mistake("every table whole at once", "that sum holds only if no request had finished; "
            "measure the trace's maximum", lambda true: _full_tables()),
]


def _one_request(cls, rng: random.Random):
    """A random window, block size and request: (manager, pool, steps to drive, block size)."""
    block_size = rng.choice([2, 4, 8, 16])
    window = rng.randrange(2, 5 * block_size)
    prompt, decode = rng.randrange(1, 6 * block_size), rng.randrange(1, 8 * block_size)
    pool = BlockPool(2 + cdiv(prompt + decode, block_size), enable_caching=False)
    return cls(_spec(window, block_size), pool, False, 0), pool, prompt, decode, window, block_size


def check_keep_window_experiment(KeepWindowManager, predicted_peak_blocks=None,
                                 measured_peak_blocks=None, verbose: bool = True):
    """Grade exercise 9's experiment: the keep-everything window, its peak, the prediction."""
    cls = KeepWindowManager
    is_manager = isinstance(cls, type) and issubclass(cls, SlidingWindowManager)
    # The rule may be written in remove_skipped_blocks (the task's way) or by skipping no
    # tokens (get_num_skipped_tokens); a class that overrides neither changes nothing.
    own_remove = is_manager and (cls.remove_skipped_blocks
                                 is not SingleTypeKVCacheManager.remove_skipped_blocks)
    own = own_remove or (is_manager and cls.get_num_skipped_tokens
                         is not SlidingWindowManager.get_num_skipped_tokens)

    def not_a_manager():
        raise WrongAnswer(f"KeepWindowManager is {cls!r}",
                          "not a SlidingWindowManager subclass -- write "
                          "class KeepWindowManager(SlidingWindowManager) and override "
                          "remove_skipped_blocks")

    def no_change():
        what = ("the library's own SlidingWindowManager" if cls is SlidingWindowManager
                else f"{cls.__name__}, which does not override remove_skipped_blocks "
                "(nor get_num_skipped_tokens)")
        raise WrongAnswer(f"you passed {what}", "no change -- the library's class frees the "
                          "skipped blocks; the experiment needs a subclass whose "
                          "remove_skipped_blocks keeps them")

    def probe():
        manager, _, prompt, _, window, _ = _one_request(cls, random.Random(0))
        manager.allocate_new_blocks("p", prompt + window)
        manager.remove_skipped_blocks("p", prompt + window)

    def check_rule():
        if not is_manager:
            not_a_manager()
        if not own:
            no_change()
        for seed in range(40):
            manager, pool, prompt, decode, window, bs = _one_request(cls, random.Random(seed))
            start = pool.get_num_free_blocks()
            manager.allocate_new_blocks("r", prompt)
            for n in range(prompt, prompt + decode):
                manager.remove_skipped_blocks("r", n)
                manager.allocate_new_blocks("r", n + 1)
                table = manager.req_to_blocks["r"]
                if any(b.is_null for b in table):
                    raise WrongAnswer(
                        f"window {window}, blocks of {bs}, {n} tokens computed: the table "
                        f"{[b.block_id for b in table]} has null entries",
                        "still frees -- a null entry is a block given back; keep every "
                        "entry until free (do nothing in remove_skipped_blocks)")
                if len(table) != cdiv(n + 1, bs):
                    raise WrongAnswer(f"{n + 1} tokens: the table has {len(table)} entries, "
                                      f"expected {cdiv(n + 1, bs)}",
                                      "the table changed size -- remove_skipped_blocks must "
                                      "neither drop nor add entries")
                manager.check()
            manager.free("r")
            if pool.get_num_free_blocks() != start:
                raise WrongAnswer(f"after free, {pool.get_num_free_blocks()} blocks free, "
                                  f"expected {start}", "a leak -- free must still return "
                                  "every block the request holds")
            pool.check()

    def remeasure():
        if not is_manager:
            not_a_manager()
        return _peak(cls)

    def lesson(pred, true):
        lib = _peak(SlidingWindowManager)
        if abs(pred - lib) <= abs(pred - true):
            return (f"the library's window holds at most {lib} blocks; yours {true}: kept "
                    "blocks grow with the context, not the window, and the admission cap "
                    "(max_admission_blocks_per_request) counts on the window giving them back")
        if pred > true:
            return (f"every table whole at once would be {_full_tables()}: no request holds "
                    "its whole table while the others do -- the shortest is freed first, so "
                    "the peak comes at one of the finishes")
        return ("count the blocks held just before each request finishes: after the first "
                "finish fewer requests run, but each keeps growing, so the peak need not "
                "come at the first finish")

    stub_ok = is_manager and own
    last = MEASUREMENT_MISTAKES[1]
    mistakes = [MEASUREMENT_MISTAKES[0],
                Mistake(last.name, last.fix, lambda true: serve_long_decodes(cls)[-1]),
                MEASUREMENT_MISTAKES[2]]
    e = Experiment(
        title="experiment: a window that keeps its blocks",
        rule="KeepWindowManager.remove_skipped_blocks keeps every block until free",
        check_rule=check_rule, probe=probe if stub_ok else (lambda: None),
        library={"SlidingWindowManager.remove_skipped_blocks":
                 SingleTypeKVCacheManager.remove_skipped_blocks} if own_remove else {},
        remeasure=remeasure, what="the peak blocks held on LONG_DECODES",
        measured=measured_peak_blocks, predicted=predicted_peak_blocks,
        measured_name="measured_peak_blocks", predicted_name="predicted_peak_blocks",
        lesson=lesson, fmt=lambda v: f"{v:.0f}", tolerance=0,
        prediction_tolerance=2,  # rounding slips pass; the first finish's count does not
        measurement_mistakes=mistakes,
        rule_hint="give nothing back in remove_skipped_blocks; free returns the whole table",
        measure_hint="max(serve_long_decodes(KeepWindowManager))", stub_policy=stub_ok)
    return check_experiment(e, verbose)


catalogue(check_keep_window_experiment, MEASUREMENT_MISTAKES)
