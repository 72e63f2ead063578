"""Exercise 9, find the planted bug: a decode step that frees a block its own step still reads.

``BUGGY_DECODE_STEP`` is a colleague's scheduler step for one decoding
request over a coordinator: it asks the window to drop what it skipped
*after* appending the new token, so it counts the token the step is about to
compute as computed. ``check_decode_step(fn)`` runs the reader's fixed
``decode_step(coord, request, token)`` on random windows, block sizes and
prompts, beside the library's own order of calls, and after every step checks:

* every block the step reads is in the window table (no null entry among the
  positions ``n - window + 1`` to ``n`` of the token at position ``n``);
* the tables, the free queue and the computed count equal the library's;
* the coordinator's own ``check()`` holds.

The planted bug, a step that never releases anything, and a step that
releases after allocating (the pool then lends one block more than it must
at the peak) each get a line naming them.
"""

from __future__ import annotations

import random

from ..kv_cache_coordinator import KVCacheCoordinator, get_kv_cache_coordinator
from ..kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from ..request import Request
from ._harness import Checker, CheckReport, Mistake, WrongAnswer, catalogue

__all__ = ["check_decode_step", "BUGGY_DECODE_STEP", "reference_decode_step", "DECODE_MISTAKES"]

#: The colleague's step, as the notebook shows it.
BUGGY_DECODE_STEP = '''\
def decode_step(coord, request, token):
    """One scheduler step for one decoding request."""
    request.append_output_token_ids(token)
    coord.remove_skipped_blocks(request.request_id, request.num_tokens)
    coord.allocate_new_blocks(request.request_id, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
'''


def reference_decode_step(coord, request, token) -> None:
    """The library's order: drop what the computed tokens skipped, then append and allocate."""
    coord.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
    request.append_output_token_ids(token)
    coord.allocate_new_blocks(request.request_id, request.num_tokens)
    request.num_computed_tokens = request.num_tokens


def _buggy(coord, request, token) -> None:
    namespace: dict = {}
    exec(BUGGY_DECODE_STEP, namespace)  # noqa: S102 -- the module's own constant
    namespace["decode_step"](coord, request, token)


def _never(coord, request, token) -> None:
    request.append_output_token_ids(token)
    coord.allocate_new_blocks(request.request_id, request.num_tokens)
    request.num_computed_tokens = request.num_tokens


def _late(coord, request, token) -> None:
    done = request.num_computed_tokens
    request.append_output_token_ids(token)
    coord.allocate_new_blocks(request.request_id, request.num_tokens)
    coord.remove_skipped_blocks(request.request_id, done)
    request.num_computed_tokens = request.num_tokens


DECODE_MISTAKES = [
    Mistake("the step in flight counted as computed", "remove_skipped_blocks must see only tokens whose "
            "step has run: call it before appending, with num_computed_tokens, or the block holding the "
            "oldest token this step reads goes back to the pool while the step reads it", _buggy),
    Mistake("nothing released", "the window group must give its skipped blocks back every step "
            "(remove_skipped_blocks), or it holds the whole context like full attention", _never),
    Mistake("released after allocating", "drop the skipped blocks before allocating: the pool can then "
            "reuse them in the same step, and never lends more than the window needs", _late),
]


def _setup(seed: int):
    rng = random.Random(seed)
    b = rng.choice((2, 4, 8))
    w = rng.randrange(2, 4 * b)
    prompt = rng.randrange(1, 3 * b + 3)
    steps = rng.randrange(w + 2 * b, w + 4 * b)
    sw = SlidingWindowSpec(block_size=b, num_kv_heads=1, head_size=4, sliding_window=w)
    fa = FullAttentionSpec(block_size=b, num_kv_heads=1, head_size=4)

    def make():
        # Few spare blocks: a step that lends one block too many is refused.
        need = -(-(w - 1 + 1) // b) + 1 + -(-(prompt + steps) // b) + 1
        coord = get_kv_cache_coordinator([KVCacheGroupSpec(["sw"], sw), KVCacheGroupSpec(["full"], fa)],
                                         need + 1, max_model_len=prompt + steps + 1, max_in_flight_tokens=1,
                                         enable_caching=False)
        req = Request("R", [rng_tok % 50 for rng_tok in range(prompt)], max_tokens=steps + 1)
        coord.allocate_new_blocks("R", prompt)
        req.num_computed_tokens = prompt
        return coord, req

    return make, w, b, steps


def _state(coord: KVCacheCoordinator, req: Request):
    return (coord.get_block_ids("R"), [x.block_id for x in coord.block_pool.free_block_queue.get_all_free_blocks()],
            req.num_computed_tokens)


def _run(fn, seed: int) -> None:
    """Run ``fn`` and the library's step side by side; raise at the first difference."""
    make, w, b, steps = _setup(seed)
    (coord, req), (ref, ref_req) = make(), make()
    for step in range(steps):
        n = req.num_tokens  # the position this step computes
        try:
            fn(coord, req, 7)
        except ValueError as exc:
            raise AssertionError(f"window {w}, blocks of {b}, decode step {step + 1}: the pool refused "
                                 f"the step ({exc})") from None
        reference_decode_step(ref, ref_req, 7)
        window_row = coord.get_blocks("R")[0]
        first = max(0, n - w + 1) // b
        gone = [i for i in range(first, len(window_row)) if window_row[i].is_null]
        if gone:
            raise AssertionError(f"window {w}, blocks of {b}, decode step {step + 1} computes position {n}, "
                                 f"which reads positions {max(0, n - w + 1)} to {n}; the window table's entry "
                                 f"{gone[0]} (positions {gone[0] * b} to {gone[0] * b + b - 1}) is already "
                                 "the null block")
        got, want = _state(coord, req), _state(ref, ref_req)
        if got != want:
            what = ("tables" if got[0] != want[0] else "free queues" if got[1] != want[1] else "computed counts")
            raise AssertionError(f"window {w}, blocks of {b}, decode step {step + 1}: the {what} differ from "
                                 f"the library's (yours {got[0] if what == 'tables' else got[1:]}, "
                                 f"the library's {want[0] if what == 'tables' else want[1:]})")
        coord.check()


def _diagnose(fn) -> str | None:
    for seed in range(12):
        try:
            _run(fn, seed)
        except AssertionError:
            # A mistake explains the failure if it fails this seed with the same words.
            mine = _first_failure(fn, seed)
            for m in DECODE_MISTAKES:
                if _first_failure(m.model, seed) == mine:
                    return m.diagnosis()
            return None
        except Exception:  # noqa: BLE001
            return None
    return None


def _first_failure(fn, seed: int) -> str | None:
    try:
        _run(fn, seed)
    except AssertionError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__
    return None


def check_decode_step(decode_step, seeds: int = 12, timeout: float = 30.0) -> CheckReport:
    """Check a fixed ``decode_step(coord, request, token)``."""
    fn = decode_step
    with Checker("decode_step", timeout=timeout) as c:
        c.probe(lambda: fn(*_setup(0)[0](), 7))

        def runs():
            for seed in range(seeds):
                try:
                    _run(fn, seed)
                except AssertionError as exc:
                    raise WrongAnswer(str(exc), _diagnose(fn)) from None

        c.prop(f"{seeds} random requests decode as the library's steps do, never losing a block "
               "a step reads", runs, "which computed count does the step hand the window, and when?",
               lambda: _diagnose(fn))
    return c.report


catalogue(check_decode_step, DECODE_MISTAKES)
