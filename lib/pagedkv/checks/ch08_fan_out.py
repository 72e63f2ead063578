"""Checks for exercise 8's section 3: an ``n > 1`` request's children and the blocks they share.

* ``fan_out(request_id, n, seed)``: the child ids and seeds of an ``n > 1``
  request, against the ids and seeds the engine queues;
* ``blocks_in_use(prompt_len, n, block_size, num_tokens)``: the blocks ``n``
  children of one prompt hold with prefix caching, against the engine's pool.

A wrong answer that a known mistake explains is named (``Mistake``).
"""

from __future__ import annotations

import random

from ..common import cdiv
from ..engine import LLMEngine, SamplingParams
from ._harness import (Checker, CheckReport, Mistake, WrongAnswer, catalogue,
                       expect_int, name_mistake, one_thread)
from .ch08_fixtures import engine_args, random_prompt, short_repr, tiny_model

__all__ = ["check_fan_out", "check_blocks_in_use", "FAN_OUT_MISTAKES", "BLOCKS_MISTAKES"]


# ================================================== 3. the n > 1 fan-out

def _fan_out_engine(request_id: str, n: int, seed):
    """The ids and seeds the engine queues for one request with ``n``."""
    engine = LLMEngine(engine_args(num_gpu_blocks_override=16, max_model_len=32),
                       tiny_model(), log_fn=lambda line: None)
    params = SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=4)
    engine.add_request(request_id, [1, 2, 3], sampling_params=params)
    return [(r.request_id, r.sampling_params.seed)
            for r in engine.scheduler.waiting]


def _children(rid, n, seed, name="{i}_{rid}", first=0, step=1,
              unseeded=None, fan_one=False):
    """vLLM's fan-out, or (with other arguments) one mistake in it."""
    if n == 1 and not fan_one:
        return [(rid, seed)]
    if seed is None:
        seed = unseeded
    return [(name.format(i=i + first, rid=rid),
             None if seed is None else seed + step * (i + first))
            for i in range(n)]


FAN_OUT_MISTAKES = [
    Mistake("the index after the id",
            "vLLM names child i f\"{i}_{request_id}\": the index first",
            lambda rid, n, seed: _children(rid, n, seed, "{rid}_{i}")),
    Mistake("counted the children from 1",
            "children are numbered 0..n-1",
            lambda rid, n, seed: _children(rid, n, seed, first=1)),
    Mistake("the same seed for every child",
            "a seeded parent gives child i the seed seed + i; with one seed "
            "for all, the n samples would be the same text n times",
            lambda rid, n, seed: _children(rid, n, seed, step=0)),
    Mistake("fanned out n = 1",
            "with n = 1 there is no parent: the request keeps its id and "
            "its seed",
            lambda rid, n, seed: _children(rid, n, seed, fan_one=True)),
    Mistake("invented seeds for an unseeded request",
            "seed None stays None for every child: each then samples with "
            "a seed of its own",
            lambda rid, n, seed: _children(rid, n, seed, unseeded=0)),
]


FAN_OUT_PROBES = [("req", 3, 7), ("req", 3, None), ("solo", 1, 5)]


def _check_fan_out_case(fn, rid, n, seed) -> None:
    where = f"fan_out({rid!r}, {n}, {seed})"
    want = _fan_out_engine(rid, n, seed)
    got = fn(rid, n, seed)
    try:
        got = [(str(a), b) for a, b in got]
    except (TypeError, ValueError):
        raise AssertionError(f"{where}: returned {short_repr(got)}, expected a "
                             "list of (child id, seed) pairs") from None
    if got != want:
        raise WrongAnswer(f"{where}: you gave {short_repr(got)}, the engine "
                          f"queues {short_repr(want)}",
                          name_mistake(got, (rid, n, seed), FAN_OUT_MISTAKES,
                                       call=fn, probes=FAN_OUT_PROBES))


def check_fan_out(fan_out, timeout: float = 20.0) -> CheckReport:
    """Check ``fan_out(request_id, n, seed) -> [(child id, seed), ...]``
    against the requests the engine queues."""
    c = Checker("fan_out", timeout=timeout)

    def cases(*args):
        def body():
            for a in args:
                _check_fan_out_case(fan_out, *a)
        return body

    with one_thread(), c:
        c.probe(cases(("req", 3, 7)))
        c.prop("seeded: ids {i}_{id}, seeds seed + i",
               cases(("req", 3, 7), ("cmpl-9_a", 4, 0), ("x", 2, 2**40)))
        c.prop("unseeded: every child's seed stays None",
               cases(("req", 3, None)))
        c.prop("n = 1: no children, the request as it is",
               cases(("solo", 1, 5), ("solo", 1, None)))
    return c.report


catalogue(check_fan_out, FAN_OUT_MISTAKES)


def _blocks_reference(prompt_len, n, block_size, num_tokens):
    shared = (prompt_len - 1) // block_size
    return shared + n * (cdiv(num_tokens, block_size) - shared)


BLOCKS_MISTAKES = [
    Mistake("no sharing",
            "with prefix caching the children after the first hit its full "
            "prompt blocks: those are held once",
            lambda L, n, B, T: n * cdiv(T, B)),
    Mistake("shared the last prompt block when the prompt fills it",
            "a prefix hit never covers the whole prompt: the last token is "
            "always computed, for its logits, so a prompt that ends on a "
            "block boundary shares one block fewer, (prompt_len - 1) // "
            "block_size",
            lambda L, n, B, T: L // B + n * (cdiv(T, B) - L // B)),
    Mistake("shared the partial tail block too",
            "only full blocks are cached and shared; the block the prompt "
            "ends in, and every block after, is each child's own",
            lambda L, n, B, T: cdiv(L, B) + n * (cdiv(T, B) - cdiv(L, B))),
    Mistake("blocks for the prompt alone",
            "each child also holds the blocks of the tokens it has "
            "generated since: cdiv(num_tokens, block_size) in all",
            lambda L, n, B, T: _blocks_reference(L, n, B, L)),
]


def _blocks_engine(prompt_len, n, block_size, num_tokens, seed=0):
    """Blocks the n children hold, in the engine, when each has the KV of
    ``num_tokens`` tokens."""
    rng = random.Random(seed)
    args = engine_args(block_size=block_size, num_gpu_blocks_override=200,
                 max_model_len=64, enable_prefix_caching=True,
                 max_num_batched_tokens=256)
    engine = LLMEngine(args, tiny_model(), log_fn=lambda line: None)
    params = SamplingParams(n=n, temperature=1.0, seed=seed,
                            max_tokens=num_tokens - prompt_len + 2,
                            ignore_eos=True)
    engine.add_request("p", random_prompt(rng, prompt_len), sampling_params=params)
    for _ in range(num_tokens + 2):
        engine.step()
        computed = [r.num_computed_tokens for r in engine.scheduler.running]
        if len(computed) == n and all(c == num_tokens for c in computed):
            break
    else:
        raise RuntimeError("the children never reached num_tokens")  # ours
    ids = {b for r in engine.scheduler.running
           for b in engine.kv_cache_manager.get_block_ids(r.request_id)}
    return len(ids)


BLOCKS_PROBES = [(9, 3, 4, 9), (8, 3, 4, 8), (9, 3, 4, 13)]


def _check_blocks_case(fn, L, n, B, T) -> None:
    where = (f"blocks_in_use(prompt_len={L}, n={n}, block_size={B}, "
             f"num_tokens={T})")
    want = _blocks_engine(L, n, B, T)
    if want != _blocks_reference(L, n, B, T):
        raise RuntimeError(f"{where}: the oracle and the engine disagree")
    got = expect_int(fn(L, n, B, T), where)
    if got != want:
        raise WrongAnswer(f"{where}: you said {got}, the engine's children "
                          f"hold {want}",
                          name_mistake(got, (L, n, B, T), BLOCKS_MISTAKES,
                                       call=fn, probes=BLOCKS_PROBES))


def check_blocks_in_use(blocks_in_use, timeout: float = 20.0) -> CheckReport:
    """Check ``blocks_in_use(prompt_len, n, block_size, num_tokens)``
    against the blocks an engine's n children hold."""
    c = Checker("blocks_in_use", timeout=timeout)

    def cases(*args):
        def body():
            for a in args:
                _check_blocks_case(blocks_in_use, *a)
        return body

    with one_thread(), c:
        c.probe(cases((9, 3, 4, 9)))
        c.prop("right after the prompt: full blocks once, tails each",
               cases((9, 3, 4, 9), (11, 4, 4, 11)))
        c.prop("a prompt that ends on a block boundary",
               cases((8, 3, 4, 8), (16, 2, 8, 16)))
        c.prop("after some generated tokens",
               cases((9, 3, 4, 13), (6, 4, 4, 17), (12, 2, 4, 14)))
    return c.report


catalogue(check_blocks_in_use, BLOCKS_MISTAKES)
