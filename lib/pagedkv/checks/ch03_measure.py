"""Exercise 3, modify and measure: the old rule that freed every block to the queue's tail.

Before vLLM 0.24.0, ``free_blocks`` appended every block reaching zero to the
free queue's *tail*, hashed or not. The reader writes that rule as a
``BlockPool`` subclass (``AllToTailPool``), plugs it into a manager through
``KVCacheManager.block_pool_class`` (the documented extension point),
predicts the prefix-cache hit rate on ``sim.PRESSURE_WORKLOAD``, then
measures it with ``sim.serve``. The checker serves the same workload with
the reader's class, so the measurement is graded for *their* rule.
"""

from __future__ import annotations

import functools
import random

from ..block_pool import BlockPool
from ..kv_cache_manager import KVCacheManager
from ..sim.prefix_pressure import PRESSURE_WORKLOAD, serve
from ._harness import Mistake, WrongAnswer, catalogue
from .ch03_pool_fixtures import queue_ids
from .measure_harness import Experiment, check_experiment, percent_mistake

__all__ = ["check_free_rule_experiment", "hit_rate"]


def hit_rate(pool_class) -> float:
    """Prompt tokens served from the prefix cache over prompt tokens, on the notebook's workload."""
    if pool_class is BlockPool:
        return _library_rate()
    manager = type("ReaderManager", (KVCacheManager,), {"block_pool_class": pool_class})
    served = serve(manager, PRESSURE_WORKLOAD)
    return sum(s.hit_tokens for s in served) / sum(s.prompt_len for s in served)


@functools.lru_cache(maxsize=None)
def _library_rate() -> float:
    served = serve(KVCacheManager, PRESSURE_WORKLOAD)
    return sum(s.hit_tokens for s in served) / sum(s.prompt_len for s in served)


MEASUREMENT_MISTAKES = [
    Mistake("the library's rule measured", "the manager was built with the library's BlockPool: "
            "serve a KVCacheManager subclass whose block_pool_class is your AllToTailPool",
            lambda true: _library_rate()),
    percent_mistake("hit rate"),
]


def _scenario(pool_class, rng: random.Random):
    """A pool some blocks of which are held (some twice, some hashed), then freed in a random order.

    Returns (pool, the blocks freed in order, what the old rule leaves: queue ids, ref counts).
    """
    pool = pool_class(12)
    blocks = pool.get_new_blocks(rng.randrange(3, 11))
    hashed = [b for b in blocks if rng.random() < 0.4]
    for k, b in enumerate(hashed):
        pool.cache_full_blocks([b], [5000 + k], 0, 1)
    twice = [b for b in blocks if rng.random() < 0.25]
    pool.touch(twice)
    order = blocks[:]
    rng.shuffle(order)
    expected_queue = queue_ids(pool)
    refs = {b.block_id: b.ref_cnt for b in blocks}
    for b in order:
        refs[b.block_id] -= 1
        if refs[b.block_id] == 0:
            expected_queue.append(b.block_id)
    return pool, order, expected_queue, refs


def check_free_rule_experiment(AllToTailPool, predicted_hit_rate=None, measured_hit_rate=None,
                               verbose: bool = True):
    """Grade exercise 3's experiment: the old free rule, its measured hit rate, the prediction."""

    def not_a_pool():
        raise WrongAnswer(f"AllToTailPool is {AllToTailPool!r}",
                          "not a BlockPool subclass -- the extension point "
                          "(KVCacheManager.block_pool_class) takes a subclass of BlockPool "
                          "that overrides free_blocks")

    is_pool = isinstance(AllToTailPool, type) and issubclass(AllToTailPool, BlockPool)

    def probe():
        pool, order, _, _ = _scenario(AllToTailPool, random.Random(0))
        pool.free_blocks(order)

    def check_rule():
        if not is_pool:
            not_a_pool()
        for seed in range(60):
            pool, order, want, refs = _scenario(AllToTailPool, random.Random(seed))
            before = queue_ids(pool)
            pool.free_blocks(iter(order))  # as the manager hands it: reversed(table), one pass
            got = queue_ids(pool)
            got_refs = {b.block_id: b.ref_cnt for b in order}
            if got_refs != refs:
                raise WrongAnswer(f"freeing {[b.block_id for b in order]}: ref_cnt {got_refs}, "
                                  f"expected {refs}", "one reference per listed block -- a "
                                  "block held twice stays held after one free")
            if got != want:
                mistake = None
                freed = [b.block_id for b in order if refs[b.block_id] == 0]
                unhashed = [i for i in freed if pool.blocks[i].block_hash is None]
                hashed = [i for i in freed if i not in unhashed]
                if got == before and freed:
                    mistake = ("the blocks walked twice -- free_blocks receives an iterator "
                               "(the manager passes reversed(table)): a second pass over it "
                               "finds nothing, so decide each block's fate in the one pass")
                elif got == unhashed + before + hashed:
                    mistake = ("the 0.33.0 rule -- unhashed blocks to the head is today's rule; "
                               "the old one appended every block reaching zero to the tail")
                elif got == before + freed[::-1]:
                    mistake = ("reversed -- append the blocks in the order given: the first "
                               "listed is evicted first")
                elif got == freed + before:
                    mistake = "all to the head -- the old rule appended to the tail"
                elif set(got) - set(before) - set(freed):
                    mistake = ("a held block queued -- only a block whose ref_cnt reaches 0 "
                               "joins the free queue")
                raise WrongAnswer(f"freeing {[b.block_id for b in order]}: queue {got}, "
                                  f"expected {want}", mistake)
            pool.check()

    def lesson(pred, true):
        lib = _library_rate()
        if abs(pred - lib) <= abs(pred - true):
            return (f"the library's rule gives {lib:.1%}, yours {true:.1%}: a finished "
                    "request's last, partial block has no hash and can never be hit, yet the "
                    "old rule queues it behind the cached prompts, so the next allocation "
                    "evicts a cached block first. Under pressure every such block costs a "
                    "cached prompt block, and a chain broken at its start loses every block "
                    "after it")
        if pred < true:
            return ("the old rule hurts only when an allocation must evict: the unhashed "
                    "blocks still come back, just later. Count how many blocks each request "
                    "frees without a hash, against the pool's spare blocks")
        return ("the old rule cannot beat today's: the blocks it keeps longer are the "
                "unhashed ones, which no request can ever hit")

    e = Experiment(
        title="experiment: every block to the tail",
        rule="AllToTailPool.free_blocks: every block reaching 0 to the tail, in order",
        check_rule=check_rule, probe=probe if is_pool else not_a_pool,
        library={"BlockPool.free_blocks": BlockPool.free_blocks},
        remeasure=(lambda: hit_rate(AllToTailPool)) if is_pool else not_a_pool,
        what="the prefix-cache hit rate (tokens)", measured=measured_hit_rate,
        predicted=predicted_hit_rate, measured_name="measured_hit_rate",
        predicted_name="predicted_hit_rate", lesson=lesson, fmt=lambda v: f"{v:.2%}",
        tolerance=5e-4, prediction_tolerance=0.05, measurement_mistakes=MEASUREMENT_MISTAKES,
        rule_hint="one reference off each block; those reaching 0, in the order given, "
                  "go to the tail with one queue call",
        measure_hint="serve sim.PRESSURE_WORKLOAD on a KVCacheManager subclass with "
                     "block_pool_class = AllToTailPool; sum the hit tokens over the prompt "
                     "tokens", stub_policy=is_pool)
    return check_experiment(e, verbose)


catalogue(check_free_rule_experiment, MEASUREMENT_MISTAKES)
