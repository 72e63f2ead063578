"""Exercise 6's prefix lookup: ``get_computed_blocks(manager, request) -> (blocks, num_tokens)``.

The longest cached prefix in whole blocks, stopping at the first miss (the
hashes are chained), capped so that the last prompt token is recomputed. The
learner's function runs inside one real ``KVCacheManager`` (a subclass
overriding ``get_computed_blocks``) and random scheduler runs are compared,
after every operation, with an untouched manager (``manager_trial``). Those
runs rarely punch a hole into a cached prefix, so a lookup that skips a miss
instead of stopping there is caught by two properties of its own: a fixed
prefix with a hole, and random prefixes with holes evicted into them,
compared with the library's lookup. A difference is diagnosed on small fixed
cases.
"""

from __future__ import annotations

import random

from ..kv_cache_manager import KVCacheManager
from ..request import Request
from ._harness import Checker, CheckReport, Mistake, WrongAnswer, catalogue
from .manager_trial import manager_trial

__all__ = ["check_get_computed_blocks"]


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


# ------------------------------------------------------- get_computed_blocks
def _cached_manager(prompt, block_size=4, num_blocks=16):
    """A manager in which a finished request has cached ``prompt``'s full blocks."""
    m = KVCacheManager(num_blocks, block_size)
    r = Request("cached", prompt, hash_block_size=block_size)
    m.allocate_slots(r, len(prompt))
    r.num_computed_tokens = len(prompt)
    m.free(r)
    return m


def _lookup_model(m, request, *, cap=-1, skip_misses=False, tokens=True):
    B = m.block_size
    blocks = []
    for i, block_hash in enumerate(request.block_hashes):
        if (i + 1) * B > request.num_tokens + cap:
            break
        block = m.block_pool.get_cached_block(block_hash)
        if block is None:
            if skip_misses:
                continue
            break
        blocks.append(block)
    return _ids(blocks), len(blocks) * B if tokens else len(blocks)


LOOKUP_MISTAKES = [
    Mistake("no -1 cap", "a fully cached prompt must still compute its "
            "last token (its logits pick the next one): hit at most "
            "num_tokens - 1 tokens",
            lambda m, r: _lookup_model(m, r, cap=0)),
    Mistake("one block too few", "the cap is num_tokens - 1 tokens, not one "
            "block less: a prompt one token past a cached block boundary "
            "hits every cached block", lambda m, r: _lookup_model(m, r, cap=-m.block_size)),
    Mistake("did not stop at the first miss", "the hashes are chained: a "
            "block's hash covers every token before it, so a prefix with a "
            "hole in it is no prefix, and no block after a miss can be a hit",
            lambda m, r: _lookup_model(m, r, skip_misses=True)),
    Mistake("blocks counted, not tokens", "the second value is a token "
            "count, and each hit block supplies block_size tokens",
            lambda m, r: _lookup_model(m, r, tokens=False)),
    Mistake("the lookup touched the blocks", "get_computed_blocks only "
            "looks: a request that is then refused must leave every "
            "reference count and the free queue as they were (allocate_slots "
            "touches the hit when it admits the request)"),
]

(NO_CAP, BLOCK_TOO_FEW, SKIPPED_MISS, BLOCKS_NOT_TOKENS,
 TOUCHED) = LOOKUP_MISTAKES


def _lookup_cases():
    """(manager, request) pairs whose right answers tell the mistakes apart."""
    p = list(range(1, 13))  # three full blocks of 4
    cases = [(_cached_manager(p), Request("same", p, hash_block_size=4)),
             (_cached_manager(p), Request("longer", p + [7], hash_block_size=4))]
    cases += _hole_cases()[:1]
    return cases


def _holed(prompt, holes, block_size=4, num_blocks=16):
    """A manager that cached ``prompt``'s full blocks, then lost the blocks at ``holes``."""
    m = _cached_manager(prompt, block_size, num_blocks)
    hashes = Request("x", prompt, hash_block_size=block_size).block_hashes
    m.block_pool.evict_blocks([m.block_pool.get_cached_block(hashes[i]).block_id
                               for i in holes])
    return m


def _hole_cases():
    """Cached prefixes with holes: a block after the hole is still cached."""
    p = list(range(1, 13))
    q = list(range(40, 60))  # five full blocks of 4
    return [(_holed(p, [1]), Request("hole", p + [7], hash_block_size=4)),
            (_holed(q, [0]), Request("hole0", q + [7], hash_block_size=4)),
            (_holed(q, [2, 3]), Request("holes", q + [7, 8], hash_block_size=4))]


def _random_hole_case(rng: random.Random):
    """A prompt cached by an earlier request, some of its blocks evicted since
    (none, at times), and a new prompt that starts with part of it."""
    B = rng.choice((4, 8, 16))
    cached = [rng.randrange(1, 50) for _ in range(rng.randrange(2, 7) * B)]
    full = len(cached) // B
    holes = sorted(rng.sample(range(full), rng.randrange(0, full)))
    m = _holed(cached, holes, B, num_blocks=2 * full + 4)
    shared = rng.choice((len(cached), rng.randrange(B, len(cached) + 1)))
    extra = [50 + rng.randrange(0, 9)
             for _ in range(rng.choice((0, rng.randrange(1, 2 * B))))]
    return m, Request("new", cached[:shared] + extra, hash_block_size=B), holes


def _as_answer(result):
    if not (isinstance(result, tuple) and len(result) == 2):
        raise AssertionError(f"expected (blocks, num_tokens), got "
                             f"{type(result).__name__} {result!r:.60}")
    blocks, n = result
    try:
        return _ids(blocks), n
    except (AttributeError, TypeError):
        raise AssertionError(f"expected a list of KVCacheBlocks first, got "
                             f"{blocks!r:.60}") from None


def _diagnose_lookup(fn) -> str | None:
    for m, r in _lookup_cases() + _hole_cases():
        before = [b.ref_cnt for b in m.block_pool.blocks]
        queue = m.block_pool.get_num_free_blocks()
        try:
            got = _as_answer(fn(m, r))
        except Exception:  # noqa: BLE001
            return None
        if [b.ref_cnt for b in m.block_pool.blocks] != before or (
                m.block_pool.get_num_free_blocks() != queue):
            return TOUCHED.diagnosis()
        if got != _lookup_model(m, r):
            for mistake in LOOKUP_MISTAKES[:4]:
                if got == mistake.model(m, r):
                    return mistake.diagnosis()
            return None
    return None


def _lookup_manager(learner_lookup):
    """A ``KVCacheManager`` subclass whose ``get_computed_blocks`` is the learner's."""
    class LearnerManager(KVCacheManager):
        def get_computed_blocks(self, request):
            return learner_lookup(self, request)

    return LearnerManager


def _expect_lookup(fn, m, r, what) -> None:
    want = _lookup_model(m, r)
    got = _as_answer(fn(m, r))
    if got != want:
        raise WrongAnswer(f"{what}: expected blocks {want[0]} and "
                          f"{want[1]} tokens, got {got[0]} and "
                          f"{got[1]}", _diagnose_lookup(fn))


def check_get_computed_blocks(fn, seeds: int = 12, cases: int = 30,
                              seed: int = 0, timeout: float = 30.0) -> CheckReport:
    """Check ``get_computed_blocks(manager, request) -> (blocks, num_tokens)``."""
    rng = random.Random(seed)
    with Checker("get_computed_blocks", timeout=timeout) as c:
        c.probe(lambda: fn(*_lookup_cases()[0]))

        def capped():
            for (m, r), what in zip(_lookup_cases()[:2], (
                    "a prompt whose 3 blocks are all cached",
                    "the same prompt and one token more")):
                _expect_lookup(fn, m, r, what)

        c.prop("the longest cached prefix in whole blocks, capped at "
               "num_tokens - 1", capped,
               "a hit never covers the last prompt token: its logits choose "
               "the first output token", lambda: _diagnose_lookup(fn))

        def holes():
            for (m, r), what in zip(_hole_cases(), (
                    "a prompt whose cached block 1 was evicted",
                    "a prompt whose cached block 0 was evicted",
                    "a prompt whose cached blocks 2 and 3 were evicted")):
                _expect_lookup(fn, m, r, what)

        c.prop("a cached prefix with a hole: the hit stops at the first miss",
               holes, "a block after a miss is still in the cache, but it "
               "cannot be part of the hit", lambda: _diagnose_lookup(fn))

        def looks_only():
            m, r = _lookup_cases()[1]
            before = [b.ref_cnt for b in m.block_pool.blocks]
            fn(m, r)
            if [b.ref_cnt for b in m.block_pool.blocks] != before:
                raise WrongAnswer("the lookup changed reference counts",
                                  TOUCHED.diagnosis())

        c.prop("looks without changing anything", looks_only,
               "a lookup may be refused admission afterwards")

        def random_holes():
            for k in range(cases):
                m, r, evicted = _random_hole_case(rng)
                library = KVCacheManager.get_computed_blocks(m, r)
                assert (_ids(library[0]), library[1]) == _lookup_model(m, r), (
                    "the library and the oracle disagree (a bug in pagedkv, "
                    "not in your code)")
                _expect_lookup(fn, m, r, f"random case {k} (block_size "
                               f"{m.block_size}, {r.num_tokens} tokens, "
                               f"cached blocks {evicted} evicted)")

        c.prop(f"{cases} random prefixes with evicted holes match the "
               "library's lookup", random_holes,
               "the message names the case and what differed",
               lambda: _diagnose_lookup(fn))

        def trials():
            for seed_ in range(seeds):
                manager_trial(_lookup_manager(fn), seed_, aligned=True,
                              diagnose=lambda: _diagnose_lookup(fn))

        c.prop(f"{seeds} random scheduler runs in KVCacheManager match the "
               "library at every step", trials,
               "the message names the operation and the first difference",
               lambda: _diagnose_lookup(fn))
    return c.report


catalogue(check_get_computed_blocks, LOOKUP_MISTAKES)
