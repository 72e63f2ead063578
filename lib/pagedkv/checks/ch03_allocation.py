"""Checks for the allocation decisions of exercises/03_block_pool.ipynb.

The learner writes, as functions of the pool:

* ``get_new_blocks(pool, n)``: pop ``n`` blocks from the head of the free
  queue, each with ``ref_cnt`` 1; a popped block that still carries a hash
  leaves the prefix cache (its hash and its entry in
  ``cached_block_hash_to_block``); with fewer than ``n`` free, refuse with a
  ``ValueError`` before changing anything. vLLM 0.33.0's words are
  ``"Cannot get {n} free blocks from the pool"``, the library's name the
  free count too: any ``ValueError`` whose message names the ``n`` asked for
  passes. Exactly ``n`` free is enough.
* ``find_longest_cache_hit(pool, block_hashes, num_tokens, block_size)``: the
  cached blocks of the longest prefix, walking the hashes until the first
  miss, in whole blocks of at most ``num_tokens - 1`` tokens; it only looks.

Each checker installs the learner's function in one real ``KVCacheManager``
through the library's extension points (a ``BlockPool`` subclass as the
manager's ``block_pool_class``; a ``KVCacheManager`` subclass overriding
``get_computed_blocks`` for ``find_longest_cache_hit``) and runs seeded
random scheduler runs beside an untouched manager (``manager_trial``), after
fixed cases whose answers tell the common mistakes apart. The freeing
decisions are in ``ch03_pool_decisions``.
"""

from __future__ import annotations

import re

from ..block_pool import BlockPool
from ..free_queue import KVCacheBlock
from ..kv_cache_manager import KVCacheManager
from ..request import Request
from ._harness import Checker, CheckReport, Mistake, WrongAnswer, catalogue
from .ch03_pool_fixtures import pool_state, queue_ids
from .manager_trial import manager_trial

__all__ = ["check_get_new_blocks", "check_find_longest_cache_hit"]


# ------------------------------------------------------------ get_new_blocks
GET_MISTAKES = [
    Mistake("popped from the tail", "the blocks came from the tail of the "
            "free queue, where the cached blocks wait to be evicted last: "
            "allocation takes the head, the blocks least worth keeping"),
    Mistake("hash kept", "a popped block gets new content, but it still "
            "carries its old hash, in the block and in "
            "cached_block_hash_to_block: a later prefix hit on that hash "
            "would read the new tenant's KV"),
    Mistake("cache entry kept", "the block forgot its hash, but "
            "cached_block_hash_to_block still maps the hash to it: the map "
            "and the blocks' own hashes must always agree"),
    Mistake("hash not reset", "the map no longer names the block, but the "
            "block still carries its hash: the map and the blocks' own "
            "hashes must always agree"),
    Mistake("every block under the hash dropped", "several blocks may hold "
            "one hash (block 3, still held, shares block 2's): only the "
            "popped block's entry dies, the others stay matchable"),
    Mistake("an empty entry left behind", "the last block under a hash "
            "was popped, and the hash still maps to an empty dict: when its "
            "last block leaves, the hash's entry leaves the map too, so the "
            "map holds only hashes a lookup can hit"),
    Mistake("ref_cnt not set", "a popped block belongs to one request now, "
            "but its ref_cnt is still the 0 of a free block: every held "
            "block counts its holders"),
    Mistake("refused after changing the pool", "the refusal came after "
            "blocks were popped: a refused call must leave every structure "
            "exactly as it was"),
    Mistake("the refusal does not name the count", "with fewer than n free "
            "the pool refuses with a ValueError, and its message says how "
            "many blocks were asked for (vLLM: 'Cannot get 5 free blocks "
            "from the pool')"),
    Mistake("off by one in the refusal", "a request for exactly as many "
            "blocks as are free was refused: n blocks fit when n equals the "
            "free count; only more than that is too many"),
]


def _get_case() -> tuple[BlockPool, dict[int, KVCacheBlock]]:
    """A pool of 8 whose free queue is [1, 5, 2, 4] (head first).

    Blocks 2 and 4 are cached (free, hashed, at the tail); block 3, which a
    request still holds, is cached under block 2's hash 1000 too.
    """
    pool = BlockPool(8)
    b = {blk.block_id: blk for blk in pool.get_new_blocks(7)}
    for i, h in ((2, 1000), (3, 1000), (4, 1004)):
        pool.cache_full_blocks([b[i]], [h], 0, 1)
    pool.free_blocks([b[1], b[5], b[2], b[4]])
    return pool, b


def _run_get(fn, n: int):
    """(pool, returned block ids or the exception, the state afterwards)."""
    pool, _ = _get_case()
    try:
        got = [b.block_id for b in fn(pool, n)]
    except Exception as exc:  # noqa: BLE001 -- the caller judges it
        got = exc
    return pool, got, pool_state(pool)


def names_count(exc: BaseException, n: int) -> bool:
    """Whether ``exc`` is a ``ValueError`` whose message names the count ``n``."""
    return isinstance(exc, ValueError) and re.search(
        rf"(?<![\d,.]){n}(?![\d,.]\d)", str(exc)) is not None


def _diagnose_get(fn) -> str | None:
    try:
        pool, got, state = _run_get(fn, 3)
        if isinstance(got, Exception):
            return None
        if got in ([4, 2, 5], [5, 2, 4]):
            return GET_MISTAKES[0].diagnosis()
        hashed, mapped = 2 in state["hashes"], 2 in state[
            "cached_block_hash_to_block"].get(1000, [])
        if hashed and mapped:
            return GET_MISTAKES[1].diagnosis()
        if mapped:
            return GET_MISTAKES[2].diagnosis()
        if hashed:
            return GET_MISTAKES[3].diagnosis()
        if 1000 not in state["cached_block_hash_to_block"]:
            return GET_MISTAKES[4].diagnosis()
        if any(state["ref_cnt"][i] != 1 for i in got):
            return GET_MISTAKES[6].diagnosis()
        pool, got4, state4 = _run_get(fn, 4)
        if isinstance(got4, ValueError):
            return GET_MISTAKES[9].diagnosis()
        if any(not v for v in state4["cached_block_hash_to_block"].values()):
            return GET_MISTAKES[5].diagnosis()
        pool, got, state = _run_get(fn, 5)
        if state != pool_state(_get_case()[0]):
            return GET_MISTAKES[7].diagnosis()
        if not names_count(got, 5):
            return GET_MISTAKES[8].diagnosis()
    except Exception:  # noqa: BLE001 -- the property's message says what
        return None
    return None


def _get_manager(learner_get_new_blocks):
    """A ``KVCacheManager`` class whose pool allocates with the learner's
    ``get_new_blocks`` (a ``BlockPool`` subclass as ``block_pool_class``)."""
    class LearnerPool(BlockPool):
        def get_new_blocks(self, num_blocks):
            return learner_get_new_blocks(self, num_blocks)

    class LearnerManager(KVCacheManager):
        block_pool_class = LearnerPool

    return LearnerManager


def _said(got) -> str:
    return (f"{type(got).__name__}({str(got)!r})" if isinstance(got, Exception)
            else f"blocks {got}")


def check_get_new_blocks(get_new_blocks, seeds: int = 12,
                         timeout: float = 30.0) -> CheckReport:
    """Check ``get_new_blocks(pool, n) -> list of blocks``, vLLM 0.33.0's
    ``BlockPool.get_new_blocks`` as a function of the pool."""
    fn = get_new_blocks
    with Checker("get_new_blocks", timeout=timeout) as c:
        c.probe(lambda: fn(_get_case()[0], 1))
        pool_for_probe = _get_case()[0]
        c.written_here("get_new_blocks", lambda: fn(pool_for_probe, 3), {
            "BlockPool.get_new_blocks": BlockPool.get_new_blocks,
            "BlockPool.evict_blocks": BlockPool.evict_blocks})

        def compare(n, what):
            pool, got, state = _run_get(fn, n)
            ref, _ = _get_case()
            want = [b.block_id for b in ref.get_new_blocks(n)]
            if isinstance(got, Exception):
                if n == 4 and isinstance(got, ValueError):
                    raise WrongAnswer(f"{what}: got {_said(got)}, expected "
                                      f"blocks {want}",
                                      GET_MISTAKES[9].diagnosis())
                raise got
            if got != want:
                raise WrongAnswer(f"{what}: got blocks {got}, expected "
                                  f"{want}", _diagnose_get(fn))
            for key, value in pool_state(ref).items():
                if state[key] != value:
                    raise WrongAnswer(f"{what}: {key} is {state[key]}, "
                                      f"expected {value}", _diagnose_get(fn))
            pool.check()

        def head():
            compare(2, "queue [1, 5, 2, 4], get_new_blocks(2)")

        c.prop("pops n blocks from the head of the free queue, each with "
               "ref_cnt 1", head,
               "which end of the free queue holds the blocks least worth "
               "keeping, and how many requests hold a block just handed "
               "out?", lambda: _diagnose_get(fn))

        def evicts():
            compare(3, "queue [1, 5, 2, 4] (2 and 4 cached, held block 3 "
                    "shares 2's hash), get_new_blocks(3)")

        c.prop("a popped cached block leaves the prefix cache, and only it",
               evicts, "a popped block gets new content: where else is its "
               "old hash recorded?", lambda: _diagnose_get(fn))

        def exactly_enough():
            compare(4, "queue [1, 5, 2, 4], 4 free, get_new_blocks(4)")

        c.prop("exactly n free is enough: get_new_blocks(4) with 4 free "
               "pops them all", exactly_enough,
               "when is a request for n blocks too many?",
               lambda: _diagnose_get(fn))

        def refuses():
            pool, got, state = _run_get(fn, 5)
            if state != pool_state(_get_case()[0]):
                raise WrongAnswer("get_new_blocks(5) with 4 free changed the "
                                  "pool", GET_MISTAKES[7].diagnosis())
            if not names_count(got, 5):
                raise WrongAnswer(
                    f"get_new_blocks(5) with 4 free: got {_said(got)}, "
                    "expected a ValueError whose message names the 5 blocks "
                    "asked for", GET_MISTAKES[8].diagnosis())

        c.prop("too few free: a ValueError naming the 5 asked for, no "
               "change", refuses,
               "what must a refused call leave behind?")

        def trials():
            for seed in range(seeds):
                manager_trial(_get_manager(fn), seed,
                              diagnose=lambda: _diagnose_get(fn))

        c.prop(f"{seeds} random scheduler runs in KVCacheManager match "
               "the library at every step", trials,
               "the message names the operation and the first difference",
               lambda: _diagnose_get(fn))
    return c.report


catalogue(check_get_new_blocks, GET_MISTAKES)


# ---------------------------------------------------- find_longest_cache_hit
HIT_MISTAKES = [
    Mistake("no -1 cap", "a fully cached prompt was hit whole: its last "
            "token must still run through the model, whose logits pick the "
            "next token, so a hit covers at most num_tokens - 1 tokens, in "
            "whole blocks"),
    Mistake("one block too few", "the hit stopped a block early: the cap is "
            "num_tokens - 1 tokens, so a prompt one token past a cached "
            "block boundary hits every cached block"),
    Mistake("did not stop at the first miss", "blocks after a miss were "
            "counted: the hashes are chained, so a prefix with a hole in it "
            "is not a prefix"),
    Mistake("the lookup touched the blocks", "the lookup changed the pool: "
            "it only looks; the manager touches the hit when it admits the "
            "request"),
    Mistake("returned (blocks, num_tokens)", "the answer is the list of "
            "hit blocks alone; the caller counts their tokens"),
]


def _hit_model(pool, hashes, num_tokens, B, *, cap=-1, skip_misses=False):
    blocks = []
    for i, block_hash in enumerate(hashes):
        if (i + 1) * B > num_tokens + cap:
            break
        block = pool.get_cached_block(block_hash)
        if block is None:
            if skip_misses:
                continue
            break
        blocks.append(block.block_id)
    return blocks


def _hit_cases():
    """(pool, block_hashes, num_tokens, block_size, what) whose answers
    tell the mistakes apart: a prompt of 3 cached blocks of 4 tokens."""
    prompt = list(range(1, 13))
    cases = []
    for extra, hole, what in (
            ([], False, "a prompt of 12 tokens, its 3 blocks cached"),
            ([7], False, "the same 12 tokens and one more"),
            ([7], True, "13 tokens, cached block 1 evicted")):
        pool = BlockPool(16)
        hashes = Request("x", prompt + extra, hash_block_size=4).block_hashes
        blocks = pool.get_new_blocks(3)
        pool.cache_full_blocks(blocks, hashes, 0, 3)
        pool.free_blocks(list(reversed(blocks)))
        if hole:
            pool.evict_blocks([blocks[1].block_id])
        cases.append((pool, list(hashes), len(prompt + extra), 4, what))
    return cases


def _as_blocks(result) -> list[int]:
    if (isinstance(result, tuple) and len(result) == 2
            and isinstance(result[0], list)):
        raise WrongAnswer(f"returned a pair ({len(result[0])} blocks, "
                          f"{result[1]!r})",
                          HIT_MISTAKES[4].diagnosis())
    if not isinstance(result, (list, tuple)) or not all(
            isinstance(b, KVCacheBlock) for b in result):
        raise AssertionError(f"expected a list of KVCacheBlock, got "
                             f"{type(result).__name__} {result!r:.60}")
    return [b.block_id for b in result]


def _diagnose_hit(fn) -> str | None:
    for pool, hashes, n, B, _ in _hit_cases():
        before = pool_state(pool)
        try:
            got = _as_blocks(fn(pool, hashes, n, B))
        except WrongAnswer as exc:
            return exc.mistake
        except Exception:  # noqa: BLE001
            return None
        if pool_state(pool) != before:
            return HIT_MISTAKES[3].diagnosis()
        if got != _hit_model(pool, hashes, n, B):
            for mistake, kw in zip(HIT_MISTAKES, (
                    dict(cap=0), dict(cap=-B), dict(skip_misses=True))):
                if got == _hit_model(pool, hashes, n, B, **kw):
                    return mistake.diagnosis()
            return None
    return None


def _hit_manager(learner_find):
    """A ``KVCacheManager`` subclass whose ``get_computed_blocks`` answers
    with the learner's ``find_longest_cache_hit``."""
    class LearnerManager(KVCacheManager):
        def get_computed_blocks(self, request):
            super().get_computed_blocks(request)  # binds it, counts a lookup
            blocks = list(learner_find(self.block_pool, request.block_hashes,
                                       request.num_tokens, self.block_size))
            return blocks, len(blocks) * self.block_size

    return LearnerManager


def check_find_longest_cache_hit(find_longest_cache_hit, seeds: int = 12,
                                 timeout: float = 30.0) -> CheckReport:
    """Check ``find_longest_cache_hit(pool, block_hashes, num_tokens,
    block_size) -> list of blocks``."""
    fn = find_longest_cache_hit
    with Checker("find_longest_cache_hit", timeout=timeout) as c:
        c.probe(lambda: fn(*_hit_cases()[0][:4]))

        def fixed():
            for pool, hashes, n, B, what in _hit_cases():
                want = _hit_model(pool, hashes, n, B)
                got = _as_blocks(fn(pool, hashes, n, B))
                if got != want:
                    raise WrongAnswer(f"{what}: expected blocks {want}, got "
                                      f"{got}", _diagnose_hit(fn))

        c.prop("cached blocks of the longest prefix, to the first miss, "
               "< num_tokens tokens", fixed,
               "two things end the walk: which, and where is the last block "
               "a hit may cover?", lambda: _diagnose_hit(fn))

        def looks_only():
            pool, hashes, n, B, _ = _hit_cases()[1]
            before = pool_state(pool)
            fn(pool, hashes, n, B)
            if pool_state(pool) != before:
                raise WrongAnswer("the lookup changed the pool",
                                  HIT_MISTAKES[3].diagnosis())

        c.prop("looks without changing anything", looks_only,
               "who takes the references, and when?")

        def trials():
            for seed in range(seeds):
                manager_trial(_hit_manager(fn), seed, aligned=True,
                              diagnose=lambda: _diagnose_hit(fn))

        c.prop(f"{seeds} random scheduler runs in KVCacheManager match "
               "the library at every step", trials,
               "the message names the operation and the first difference",
               lambda: _diagnose_hit(fn))
    return c.report


catalogue(check_find_longest_cache_hit, HIT_MISTAKES)
