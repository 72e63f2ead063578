"""Exercise 9, the prefix hit across groups: full attention beside a sliding window.

A cache state is given as two sets of logical block indices: the blocks of
a prompt that the full-attention group still has cached, and those the
sliding-window group has. Three tasks:

* ``check_hybrid_hit(fn)``: the learner writes
  ``hybrid_hit(full_cached, window_cached, window, block_size, max_length)``,
  the hit length the hybrid coordinator gives. The expected value comes from
  the library's ``HybridKVCacheCoordinator`` on a real pool whose cache was
  put in that state (``library_hybrid_hit``); calling the library's lookups
  is caught.
* ``check_hit_prediction(predicted)``: the reader predicts the hit
  ``HIT_TRACE`` gives a new prompt.
* ``check_trap_design(design)``: a design graded by property: a cache state
  where the smaller of the two groups' own answers is *not* the hit.

The wrong rules have models (``HIT_MISTAKES``): the smaller per-group hit
without asking again, one group only, the window read left to right, a
window one block too wide, the cap ignored.
"""

from __future__ import annotations

import numbers
import random

from ..common import cdiv
from ..kv_cache_coordinator import HybridKVCacheCoordinator, get_kv_cache_coordinator
from ..kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from ..request import Request
from ..single_type_managers import FullAttentionManager, SlidingWindowManager
from ._harness import Checker, CheckReport, Mistake, WrongAnswer, catalogue, expect_int, name_mistake
from .predict_harness import PredictionReport, check_prediction

__all__ = ["check_hybrid_hit", "check_hit_prediction", "check_trap_design", "library_hybrid_hit",
           "HIT_TRACE", "HIT_MISTAKES", "TRAP_WINDOW", "TRAP_BLOCK_SIZE", "TRAP_MAX_LENGTH"]


# ------------------------------------------------------------- the oracle
def library_hybrid_hit(full_cached, window_cached, window: int, block_size: int, max_length: int) -> int:
    """The library's answer: one request fills the cache (its blocks up to the cap and up
    to the highest index given), the blocks outside the two sets are evicted, and the
    same prompt looks itself up with ``max_length`` as its cap."""
    num_blocks = max(max_length // block_size, max(set(full_cached) | set(window_cached), default=-1) + 1)
    full = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=4)
    sw = SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=4, sliding_window=window)
    coord = get_kv_cache_coordinator([KVCacheGroupSpec(["full"], full), KVCacheGroupSpec(["sw"], sw)],
                                     2 * num_blocks + 2,
                                     max_model_len=max(num_blocks * block_size + 1, window),
                                     max_in_flight_tokens=1)
    r = Request("R", list(range(num_blocks * block_size + 1)), hash_block_size=block_size)
    coord.allocate_new_blocks("R", num_blocks * block_size)
    coord.cache_blocks(r, num_blocks * block_size)
    full_ids, sw_ids = coord.get_block_ids("R")
    coord.free("R")
    coord.block_pool.evict_blocks([full_ids[i] for i in range(num_blocks) if i not in full_cached]
                                  + [sw_ids[i] for i in range(num_blocks) if i not in window_cached])
    return coord.find_longest_cache_hit(r.block_hashes, max_length)[1]


# ------------------------------------------------------------ the models
def _full(cached, length, b) -> int:
    n = 0
    while n < length // b and n in cached:
        n += 1
    return n * b


def _window(cached, length, w, b, need=None) -> int:
    need = cdiv(w - 1, b) if need is None else need
    run = 0
    for i in range(length // b - 1, -1, -1):
        if i not in cached:
            run = 0
            continue
        run += 1
        if run >= need:
            return (i + run) * b
    return run * b  # only a run reaching block 0 counts


def _hybrid(f, s, w, b, cap, need=None, window_rule=None) -> int:
    window_rule = window_rule or (lambda length: _window(s, length, w, b, need))
    length = cap
    while True:
        shorter = window_rule(_full(f, length, b))
        if shorter >= length:
            return length
        length = shorter


HIT_MISTAKES = [
    Mistake("the smaller per-group hit, without asking again", "each kind answers for the length it "
            "was asked; a window that accepted a long hit may not hold the blocks a shorter one needs. "
            "Ask again at the shorter length until no kind shortens it",
            lambda f, s, w, b, cap: min(_full(f, cap, b), _window(s, cap, w, b))),
    Mistake("full attention only", "the sliding-window group must hold the blocks the next token "
            "reads too: ask it at full attention's length",
            lambda f, s, w, b, cap: _full(f, cap, b)),
    Mistake("the window only", "full attention needs every block of the prefix: its hit is the first "
            "run from block 0, and bounds the window's",
            lambda f, s, w, b, cap: _window(s, cap, w, b)),
    Mistake("the window read left to right", "a window needs only the cdiv(window - 1, block_size) "
            "blocks before the hit's end, so it looks from the right; missing blocks further left "
            "do not matter",
            lambda f, s, w, b, cap: _hybrid(f, s, w, b, cap, window_rule=lambda n: _full(s, n, b))),
    Mistake("a window one block too wide", "the next token reads window - 1 earlier tokens, so the "
            "window needs cdiv(window - 1, block_size) blocks, not cdiv(window, block_size)",
            lambda f, s, w, b, cap: _hybrid(f, s, w, b, cap, need=cdiv(w, b))),
    Mistake("the cap ignored", "a hit may cover at most max_length tokens (the prompt minus its last "
            "token): look only at blocks that end within it",
            lambda f, s, w, b, cap: _hybrid(f, s, w, b, (max(f | s, default=-1) + 1) * b)),
]


# ---------------------------------------------------------------- cases
def _cases() -> list[tuple[set, set, int, int, int]]:
    """Fixed states first (the chapter's trap among them), then random ones."""
    fixed = [({0, 1, 2, 3, 5}, {0, 1, 3, 4, 5}, 8, 4, 24), ({0, 1, 2, 3, 4, 5}, {0, 1, 2, 3, 4, 5}, 8, 4, 24),
             (set(), {4, 5}, 8, 4, 24), ({0, 1, 2}, set(), 8, 4, 24), ({0, 1, 2, 3}, {2, 3}, 8, 4, 16),
             ({0, 1, 2, 3, 4, 5, 6}, {1, 2, 4, 5, 6}, 9, 4, 28), ({0, 1, 2, 3, 4, 5, 6, 7}, {0, 3, 4}, 13, 4, 32),
             ({0, 1, 2, 3, 4, 5, 6, 7}, {6, 7}, 8, 4, 24), ({0, 1}, {0, 1}, 3, 2, 4),
             ({0, 1, 2, 3, 4, 5, 6, 7}, {0, 1, 2, 3, 4, 5, 6, 7}, 8, 4, 20),
             ({0, 1, 2, 3, 4, 5}, {0, 1, 2, 4, 5}, 9, 4, 24)]
    assert len(fixed) == _NUM_FIXED
    rng = random.Random(44)
    for _ in range(50):
        b = rng.choice((2, 4, 8))
        n = rng.randrange(2, 10)
        w = rng.randrange(2, 4 * b + 2)
        f = {i for i in range(n) if rng.random() < 0.8}
        s = {i for i in range(n) if rng.random() < 0.7}
        fixed.append((f, s, w, b, rng.randrange(1, n + 1) * b))  # the cap may cut the sets
    return fixed


_NUM_FIXED = 11


def _want(f, s, w, b, cap) -> int:
    return _hybrid(f, s, w, b, cap)


_PROBES = [({0, 1, 2, 3, 4, 5, 6}, {1, 2, 4, 5, 6}, 9, 4, 28), ({0, 1, 2, 3}, {0, 2, 3}, 5, 2, 8),
           ({0, 1, 2, 3, 4, 6}, {0, 1, 3, 4, 5, 6}, 8, 4, 28), ({0, 1, 2, 3, 4}, {0, 1, 2, 3, 4}, 8, 4, 12)]


def _call(fn, f, s, w, b, cap) -> int:
    return expect_int(fn(set(f), set(s), w, b, cap), f"hybrid_hit({sorted(f)}, {sorted(s)}, {w}, {b}, {cap})")


def _diagnose(fn) -> str | None:
    for f, s, w, b, cap in _cases():
        try:
            got = _call(fn, f, s, w, b, cap)
        except Exception:  # noqa: BLE001
            return None
        if got != _want(f, s, w, b, cap):
            return name_mistake(got, (f, s, w, b, cap), HIT_MISTAKES, lambda *a: _call(fn, *a), _PROBES)
    return None


_LIBRARY = {
    "HybridKVCacheCoordinator.find_longest_cache_hit": HybridKVCacheCoordinator.find_longest_cache_hit,
    "FullAttentionManager.find_longest_cache_hit": FullAttentionManager.find_longest_cache_hit,
    "SlidingWindowManager.find_longest_cache_hit": SlidingWindowManager.find_longest_cache_hit,
    "library_hybrid_hit": library_hybrid_hit,
}

_HINT = ("ask full attention first, then the window at full attention's length; if the window "
         "answers shorter, what must you ask again?")


def check_hybrid_hit(hybrid_hit, timeout: float = 30.0) -> CheckReport:
    """Check ``hybrid_hit(full_cached, window_cached, window, block_size, max_length) -> tokens``."""
    fn = hybrid_hit
    with Checker("hybrid_hit", timeout=timeout) as c:
        c.probe(lambda: fn({0, 1}, {0, 1}, 8, 4, 8))
        c.written_here("hybrid_hit", lambda: fn({0, 1, 2, 3, 5}, {0, 1, 3, 4, 5}, 8, 4, 24), _LIBRARY)

        def leaves_sets():
            f, s = {0, 1, 2, 3, 5}, {0, 1, 3, 4, 5}
            fn(f, s, 8, 4, 24)
            if f != {0, 1, 2, 3, 5} or s != {0, 1, 3, 4, 5}:
                raise AssertionError(f"the lookup changed its input sets: now {sorted(f)}, {sorted(s)}")

        c.prop("looks without changing the cached sets", leaves_sets, "a lookup only reads")

        def run(cases, what):
            for f, s, w, b, cap in cases:
                got = _call(fn, f, s, w, b, cap)
                want = library_hybrid_hit(f, s, w, b, cap)
                if got != want:
                    raise WrongAnswer(f"full cached {sorted(f)}, window cached {sorted(s)}, window {w}, "
                                      f"blocks of {b}, max_length {cap}: the coordinator hits {want} "
                                      f"tokens, you said {got}",
                                      name_mistake(got, (f, s, w, b, cap), HIT_MISTAKES,
                                                   lambda *a: _call(fn, *a), _PROBES))

        cases = _cases()
        c.prop(f"{_NUM_FIXED} hand-made cache states: as the library's coordinator",
               lambda: run(cases[:_NUM_FIXED], "fixed"), _HINT, lambda: _diagnose(fn))
        c.prop(f"{len(cases) - _NUM_FIXED} random cache states: as the library's coordinator",
               lambda: run(cases[_NUM_FIXED:], "random"), _HINT, lambda: _diagnose(fn))
    return c.report


catalogue(check_hybrid_hit, HIT_MISTAKES)


# ------------------------------------------------------ the prediction task
#: The trace, as the notebook shows it (and as the checker runs it).
HIT_TRACE = """\
coord = get_kv_cache_coordinator(                 # group 0: full attention
    [KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=4,
        num_kv_heads=1, head_size=4)),
     KVCacheGroupSpec(["sw"], SlidingWindowSpec(block_size=4,
        num_kv_heads=1, head_size=4, sliding_window=9))],
    40, max_model_len=64, max_in_flight_tokens=4)
a = Request("A", list(range(28)), hash_block_size=4)
coord.allocate_new_blocks("A", 28)                # A's 7 full blocks
coord.cache_blocks(a, 28)                         # ... filed in both groups
full_ids, window_ids = coord.get_block_ids("A")
coord.free("A")                                   # A finishes
coord.block_pool.evict_blocks([full_ids[5],       # the pool recycles three
                               window_ids[0], window_ids[3]])
b = Request("B", list(range(28)) + [7] * 5, hash_block_size=4)
blocks, hit = coord.find_longest_cache_hit(b.block_hashes, b.num_tokens - 1)
"""
_TRACE_STATE = ({0, 1, 2, 3, 4, 6}, {1, 2, 4, 5, 6}, 9, 4, 32)


def run_hit_trace() -> int:
    """Run ``HIT_TRACE`` on the library: the hit length."""
    namespace = {"get_kv_cache_coordinator": get_kv_cache_coordinator, "KVCacheGroupSpec": KVCacheGroupSpec,
                 "SlidingWindowSpec": SlidingWindowSpec, "FullAttentionSpec": FullAttentionSpec,
                 "Request": Request}
    exec(HIT_TRACE, namespace)  # noqa: S102 -- the module's own constant
    return namespace["hit"]


def _read_hit(predicted) -> int:
    if isinstance(predicted, bool) or not isinstance(predicted, numbers.Integral):
        raise AssertionError(f"expected the hit as a number of tokens, such as 16; got "
                             f"{type(predicted).__name__} {predicted!r:.40}")
    return int(predicted)


def check_hit_prediction(predicted_hit) -> PredictionReport:
    """Grade a prediction of the hit length ``HIT_TRACE`` gives B."""
    want = run_hit_trace()

    def diagnose(got):
        found = [m for m in HIT_MISTAKES if m.model(*_TRACE_STATE) == got]
        if len(found) > 1:
            return "one of: " + "; or ".join(m.diagnosis() for m in found)
        return found[0].diagnosis() if found else None

    def compare(got, w):
        if got == w:
            return None
        if got % 4:
            return f"you predicted {got} tokens, the trace hits {w}: a hit is whole blocks of 4"
        return f"you predicted {got} tokens, the trace hits {w}"

    return check_prediction(
        "hit length", "predicted_hit", predicted_hit, want, read=_read_hit, compare=compare,
        draw=lambda got: None, diagnose=diagnose, name="B's hit is the one the coordinator finds",
        hint="write each group's cached entries, then ask full attention and the window in turn")


catalogue(check_hit_prediction, HIT_MISTAKES)


# --------------------------------------------------------- the design task
TRAP_WINDOW, TRAP_BLOCK_SIZE, TRAP_MAX_LENGTH = 8, 4, 32
_NUM = TRAP_MAX_LENGTH // TRAP_BLOCK_SIZE


def _read_design(design) -> tuple[set, set]:
    shape = (f"expected a pair (full_cached, window_cached) of sets of block indices 0 to {_NUM - 1}, "
             "such as ({0, 1, 2}, {1, 2})")
    if not isinstance(design, tuple) or len(design) != 2:
        raise AssertionError(f"{shape}; got {type(design).__name__} {design!r:.60}")
    out = []
    for part in design:
        if isinstance(part, (str, bytes)) or not hasattr(part, "__iter__"):
            raise AssertionError(f"{shape}; got {design!r:.60}")
        items = list(part)
        for i in items:
            if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < _NUM:
                raise AssertionError(f"{shape}; {i!r} is not a block index 0 to {_NUM - 1}")
        out.append({int(i) for i in items})
    return out[0], out[1]


def check_trap_design(design, timeout: float = 30.0) -> CheckReport:
    """Grade a cache state ``(full_cached, window_cached)`` for window 8, blocks of 4,
    ``max_length`` 32 (or a function returning one; ``None``: not made yet): the hit is
    at least 12 tokens, and the smaller per-group answer (each group asked at 32) is
    longer than the hit."""
    w, b, cap = TRAP_WINDOW, TRAP_BLOCK_SIZE, TRAP_MAX_LENGTH
    with Checker("trap design", timeout=timeout) as c:
        state: dict = {}

        def untouched():
            if design is None:  # the exercise's unfilled state
                raise NotImplementedError
            if callable(design):
                design()

        c.probe(untouched)

        def shape():
            state["f"], state["s"] = _read_design(design() if callable(design) else design)

        if not c.prop("a pair of sets of block indices", shape, "return two sets"):
            return c.report

        def real():
            hit = library_hybrid_hit(state["f"], state["s"], w, b, cap)
            state["hit"] = hit
            if hit < 12:
                raise AssertionError(f"the coordinator hits {hit} tokens: make the true hit at least 12 "
                                     "(three blocks), so the trap costs something real")

        c.prop("the coordinator's hit is at least 12 tokens", real,
               "full attention needs blocks 0, 1, 2 at least, and the window two cached blocks ending there")

        def trap():
            f, s = state["f"], state["s"]
            naive = min(_full(f, cap, b), _window(s, cap, w, b))
            hit = state.get("hit", library_hybrid_hit(f, s, w, b, cap))
            if naive <= hit:
                raise AssertionError(f"each group alone, asked at {cap}: full attention {_full(f, cap, b)}, "
                                     f"window {_window(s, cap, w, b)}; the smaller, {naive}, is the hit "
                                     f"({hit}), so the shortcut gets it right here")

        c.prop("the smaller per-group answer overestimates the hit", trap,
               "let the window hold a run far right that full attention cannot reach, and miss a block "
               "just before full attention's end")
    return c.report
