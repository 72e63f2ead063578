"""Exercise 9, the sliding window: what a window group releases while a request runs.

Two tasks:

* ``check_skipped_blocks(fn)``: the learner writes
  ``skipped_blocks(num_computed_tokens, sliding_window, block_size)``, the
  number of leading table entries a sliding-window group has given back once
  ``num_computed_tokens`` tokens are computed. The expected value comes from
  running the library's coordinator (``remove_skipped_blocks`` on a real
  table, null entries counted) and from the rule in words; calling the
  library's window code is caught.
* ``check_released_prediction(predicted)``: the reader predicts, before
  running it, which entries of the window table ``RELEASE_TRACE`` leaves
  pointing at the null block.

Every plausible wrong rule has a model (``WINDOW_MISTAKES``), so a wrong
value gets a line naming it: the window one token too short or too long,
rounding up (releasing the block that holds the oldest token still in the
window), counting the step still in flight, no floor at zero.
"""

from __future__ import annotations

import numbers
import random

from ..common import cdiv
from ..kv_cache_coordinator import KVCacheCoordinator, get_kv_cache_coordinator
from ..kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from ..request import Request
from ..single_type_managers import SingleTypeKVCacheManager, SlidingWindowManager
from ..views.paged_layout import render_paged_layout
from ._harness import Checker, CheckReport, Mistake, WrongAnswer, catalogue, expect_int, name_mistake
from .predict_harness import PredictionReport, check_prediction, side_by_side

__all__ = ["check_skipped_blocks", "check_released_prediction", "RELEASE_TRACE", "run_release_trace",
           "WINDOW_MISTAKES", "library_skipped_blocks"]


# ----------------------------------------------------------- the oracles
def _rule(n: int, w: int, b: int) -> int:
    """The rule in words: the next token reads the last ``w - 1`` computed tokens."""
    return max(0, n - w + 1) // b


def library_skipped_blocks(num_computed_tokens: int, sliding_window: int, block_size: int) -> int:
    """Run the library: a window group's table of ``num_computed_tokens`` tokens, then
    ``remove_skipped_blocks``; the null entries it leaves."""
    spec = SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=4, sliding_window=sliding_window)
    n = num_computed_tokens
    coord = get_kv_cache_coordinator([KVCacheGroupSpec(["sw"], spec)], cdiv(max(n, 1), block_size) + 2,
                                     max_model_len=max(n, sliding_window, 1), max_in_flight_tokens=1,
                                     enable_caching=False)
    coord.allocate_new_blocks("r", n)
    coord.remove_skipped_blocks("r", n)
    return sum(b.is_null for b in coord.get_blocks("r")[0])


WINDOW_MISTAKES = [
    Mistake("the window one token short", "with n computed, the next token attends to itself and the "
            "w - 1 tokens before it: n - w + 1 tokens are skipped, not n - w + 2",
            lambda n, w, b: max(0, n - w + 2) // b),
    Mistake("the window one token too long", "the window of w tokens includes the next token itself, "
            "so only w - 1 computed tokens stay read: n - w + 1 are skipped, not n - w",
            lambda n, w, b: max(0, n - w) // b),
    Mistake("releasing the block holding the oldest in-window token", "a block goes back only when "
            "every token in it is skipped: round the skipped tokens down to whole blocks, not up",
            lambda n, w, b: cdiv(max(0, n - w + 1), b)),
    Mistake("no floor at zero", "while fewer than w tokens are computed nothing is skipped: the "
            "count is max(0, n - w + 1), never negative",
            lambda n, w, b: (n - w + 1) // b),
    Mistake("whole windows of blocks", "the window is counted in tokens, not blocks: skipped tokens "
            "are n - w + 1, and only then rounded down to blocks",
            lambda n, w, b: max(0, n // b - cdiv(w, b))),
]

_HINT = ("with n tokens computed, which tokens does the next token read, and which blocks hold "
         "none of them?")


def _cases() -> list[tuple[int, int, int]]:
    fixed = [(n, 8, 4) for n in range(0, 29)] + [(100, 32, 16), (111, 32, 16), (7, 8, 4), (31, 16, 16)]
    rng = random.Random(9)
    fixed += [(rng.randrange(0, 200), rng.randrange(1, 60), rng.choice((1, 2, 4, 8, 16))) for _ in range(60)]
    return fixed


def _probe_args():
    return [(40, 8, 4), (5, 8, 4), (30, 9, 4), (64, 16, 16), (17, 3, 2)]


def _diagnose(fn) -> str | None:
    for args in _cases():
        try:
            got = fn(*args)
        except Exception:  # noqa: BLE001
            return None
        if got != _rule(*args):
            return name_mistake(got, args, WINDOW_MISTAKES, fn, _probe_args())
    return None


_LIBRARY = {
    "SlidingWindowManager.get_num_skipped_tokens": SlidingWindowManager.get_num_skipped_tokens,
    "SingleTypeKVCacheManager.remove_skipped_blocks": SingleTypeKVCacheManager.remove_skipped_blocks,
    "KVCacheCoordinator.remove_skipped_blocks": KVCacheCoordinator.remove_skipped_blocks,
    "library_skipped_blocks": library_skipped_blocks,
}


def check_skipped_blocks(skipped_blocks, timeout: float = 20.0) -> CheckReport:
    """Check ``skipped_blocks(num_computed_tokens, sliding_window, block_size) -> int``."""
    fn = skipped_blocks
    with Checker("skipped_blocks", timeout=timeout) as c:
        c.probe(lambda: fn(12, 8, 4))
        c.written_here("skipped_blocks", lambda: fn(40, 8, 4), _LIBRARY)

        def is_int():
            expect_int(fn(12, 8, 4), "skipped_blocks(12, 8, 4)")

        c.prop("returns a whole number of blocks", is_int, "a count of table entries")

        def small():
            for n in range(0, 29):
                got = expect_int(fn(n, 8, 4), f"skipped_blocks({n}, 8, 4)")
                want = library_skipped_blocks(n, 8, 4)
                if got != want:
                    raise WrongAnswer(f"window 8, blocks of 4, {n} computed: the library's table has "
                                      f"{want} null entries, you said {got}",
                                      name_mistake(got, (n, 8, 4), WINDOW_MISTAKES, fn, _probe_args()))

        c.prop("window 8, blocks of 4, 0 to 28 computed: as the library's table", small, _HINT,
               lambda: _diagnose(fn))

        def random_cases():
            for n, w, b in _cases():
                got = expect_int(fn(n, w, b), f"skipped_blocks({n}, {w}, {b})")
                want = library_skipped_blocks(n, w, b)
                if got != want:
                    raise WrongAnswer(f"window {w}, blocks of {b}, {n} computed: expected {want}, got {got}",
                                      name_mistake(got, (n, w, b), WINDOW_MISTAKES, fn, _probe_args()))

        c.prop("92 windows, block sizes and lengths: as the library's table", random_cases, _HINT,
               lambda: _diagnose(fn))
    return c.report


catalogue(check_skipped_blocks, WINDOW_MISTAKES)


# ------------------------------------------------------ the prediction task
#: The trace, as the notebook shows it (and as the checker runs it).
RELEASE_TRACE = """\
coord = get_kv_cache_coordinator(                  # window 6, blocks of 4
    [KVCacheGroupSpec(["sw"], SlidingWindowSpec(block_size=4,
        num_kv_heads=1, head_size=4, sliding_window=6)),
     KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=4,
        num_kv_heads=1, head_size=4))],
    24, max_model_len=64, max_in_flight_tokens=4)
r = Request("R", list(range(10)), max_tokens=16)  # a 10-token prompt
coord.allocate_new_blocks("R", 10)                 # step 1: the prompt
r.num_computed_tokens = 10
for step in range(7):                              # 7 decode steps
    coord.remove_skipped_blocks("R", r.num_computed_tokens)
    r.append_output_token_ids(step)
    coord.allocate_new_blocks("R", r.num_tokens)
    r.num_computed_tokens = r.num_tokens
"""


def run_release_trace():
    """Run ``RELEASE_TRACE`` on the library: the coordinator and the request."""
    namespace = {"get_kv_cache_coordinator": get_kv_cache_coordinator, "KVCacheGroupSpec": KVCacheGroupSpec,
                 "SlidingWindowSpec": SlidingWindowSpec, "FullAttentionSpec": FullAttentionSpec,
                 "Request": Request}
    exec(RELEASE_TRACE, namespace)  # noqa: S102 -- the module's own constant
    return namespace["coord"], namespace["r"]


def _released_model(rule, last_call=True) -> list[int]:
    """The released entries under ``rule``: the last remove_skipped_blocks call saw 16
    computed tokens (17 if the step in flight is counted)."""
    n = 16 if last_call else 17
    return list(range(rule(n, 6, 4)))


_RELEASE_MISTAKES = [
    Mistake("counting the step still in flight", "remove_skipped_blocks runs before the step, with the "
            "tokens already computed: the last call saw 16, not the 17 computed at the end",
            lambda: _released_model(_rule, last_call=False)),
    *[Mistake(m.name, m.fix, (lambda m=m: _released_model(m.model))) for m in WINDOW_MISTAKES],
    Mistake("block ids instead of table entries", "the question asks for positions in R's window "
            "table (0 is its first entry), not the physical block ids that were there",
            lambda: [1, 2]),
]


def _read(predicted) -> list[int]:
    shape = "expected the released table entries as a list of ints, such as [0, 1]"
    if isinstance(predicted, (str, bytes)) or not hasattr(predicted, "__iter__"):
        raise AssertionError(f"{shape}; got {type(predicted).__name__} {predicted!r:.40}")
    out = []
    for i in predicted:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise AssertionError(f"{shape}; got {list(predicted)!r:.60}")
        out.append(int(i))
    return sorted(out)


def _compare(got: list[int], want: list[int], table_len: int) -> str | None:
    if got == want:
        return None
    words = f"you predicted entries {got} released, the trace leaves {want} at the null block"
    outside = [i for i in got if not 0 <= i < table_len]
    if outside:
        return f"{words}: R's window table has {table_len} entries, there is no entry {outside[0]}"
    if len(set(got)) != len(got):
        return f"{words}: each entry once"
    return words


def check_released_prediction(predicted_released) -> PredictionReport:
    """Grade a prediction of the window-table entries ``RELEASE_TRACE`` releases."""
    coord, r = run_release_trace()
    window_row = coord.get_blocks("R")[0]
    want = [i for i, b in enumerate(window_row) if b.is_null]

    def diagnose(got):
        # Several wrong rules can give one answer here: name them all.
        found = [m for m in _RELEASE_MISTAKES if m.model() == got]
        if len(found) > 1:
            return "one of: " + "; or ".join(m.diagnosis() for m in found)
        return found[0].diagnosis() if found else None

    def draw(got):
        ids = [b.block_id for b in window_row]
        predicted = [0 if i in set(got) else ids[i] for i in range(len(ids))]
        return side_by_side(
            render_paged_layout({"R g0": ids}, block_size=4, pool=coord.block_pool, num_tokens={"R g0": 17},
                                title="the trace"),
            render_paged_layout({"R g0": predicted}, block_size=4, num_tokens={"R g0": 17},
                                title="your prediction"), min_px=300)

    return check_prediction(
        "released entries", "predicted_released", predicted_released, want,
        read=_read, compare=lambda got, w: _compare(got, w, len(window_row)), draw=draw, diagnose=diagnose,
        name="the window entries at the null block are the ones the trace leaves",
        hint="write the computed count each remove_skipped_blocks call sees, and the tokens the "
             "next token reads")


catalogue(check_released_prediction, _RELEASE_MISTAKES)
