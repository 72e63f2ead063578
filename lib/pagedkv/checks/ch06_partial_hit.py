"""Exercise 6's partial hits: a prefix hit that ends inside a block.

* ``redirect_partial_hit(manager, req_blocks, block_idx, cow_block)``: the
  copy-on-write redirect (overriding the manager's ``redirect_partial_hit``
  in a subclass), checked on a fixed case and in scheduler runs with partial
  hits compared with an untouched manager (``manager_trial``);
* ``partial_hit(shared_tokens, block_size, match_unit) -> (block_idx,
  valid_slots, needs_copy)`` and ``blocks_to_allocate(num_tokens,
  hit_tokens, block_size) -> int``: where the hit ends and what the capacity
  test counts for it (the private copy's block), compared with an oracle and
  a real ``KVCacheManager(hash_block_size=match_unit)``.
"""

from __future__ import annotations

import random

from ..common import cdiv
from ..kv_cache_manager import KVCacheManager
from ..request import Request
from ._harness import (Checker, CheckReport, Mistake, WrongAnswer,
                       catalogue, expect_int, name_mistake)
from .manager_trial import manager_trial

__all__ = ["check_redirect_partial_hit", "check_partial_hit",
           "check_blocks_to_allocate", "partial_hit_reference",
           "blocks_to_allocate_reference"]


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


# ------------------------------------------------------- redirect_partial_hit
COW_MISTAKES = [
    Mistake("no redirect", "the shared block must not be written: after "
            "the call the request's entry must name a block that it alone "
            "may write"),
    Mistake("wrong entry redirected", "only the entry of the partly valid "
            "block, the hit's last one, changes; every other entry stays "
            "shared"),
    Mistake("the copy's reference missing", "a pending copy holds both its "
            "ends: until the copy is acknowledged, the private block is held "
            "by the request and by the copy, so its ref_cnt is 2"),
    Mistake("the source's reference dropped", "the source must live until "
            "the copy has run: keep the reference the prefix hit took"),
    Mistake("copy not recorded", "the worker learns of a copy only from "
            "the manager's pending copies: one nobody records never runs, "
            "and the private block's valid slots stay empty"),
    Mistake("source and destination swapped", "a copy pair reads (source, "
            "destination): the valid slots go from the shared block to the "
            "private one"),
]


def _cow_case():
    """A manager, a 3-block table whose last block is shared, and a fresh block."""
    m = KVCacheManager(12, 4, hash_block_size=2)
    pool = m.block_pool
    table = pool.get_new_blocks(3)
    pool.touch([table[2]])  # the partial block: another request holds it too
    cow = pool.get_new_blocks(1)[0]
    return m, table, cow


def _diagnose_cow(fn) -> str | None:
    m, table, cow = _cow_case()
    source = table[2]
    before = list(table)
    try:
        fn(m, table, 2, cow)
    except Exception:  # noqa: BLE001
        return None
    if table == before:
        return COW_MISTAKES[0].diagnosis()
    if table[2] is not cow:
        return COW_MISTAKES[1].diagnosis()
    if cow.ref_cnt != 2:
        return COW_MISTAKES[2].diagnosis()
    if source.ref_cnt != 2:
        return COW_MISTAKES[3].diagnosis()
    pending = m.outstanding_copies
    if not pending:
        return COW_MISTAKES[4].diagnosis()
    if pending == [(cow.block_id, source.block_id)]:
        return COW_MISTAKES[5].diagnosis()
    return None


def check_redirect_partial_hit(fn, seeds: int = 16,
                               timeout: float = 30.0) -> CheckReport:
    """Check ``redirect_partial_hit(manager, req_blocks, block_idx, cow_block)``."""
    with Checker("redirect_partial_hit", timeout=timeout) as c:
        c.probe(lambda: fn(*_cow_case()[:2], 2, _cow_case()[2]))

        def fixed():
            m, table, cow = _cow_case()
            source = table[2]
            ids = _ids(table)
            fn(m, table, 2, cow)
            want = ids[:2] + [cow.block_id]
            got = (_ids(table), cow.ref_cnt, source.ref_cnt,
                   m.outstanding_copies)
            expected = (want, 2, 2, [(source.block_id, cow.block_id)])
            if got != expected:
                raise WrongAnswer(
                    f"table {ids}, partial block {source.block_id} shared, "
                    f"private block {cow.block_id}: (table, cow ref_cnt, "
                    f"source ref_cnt, pending copies) is {got}, expected "
                    f"{expected}", _diagnose_cow(fn))

        c.prop("the table points at the private block; both ends are held "
               "until the copy runs", fixed,
               "after the call the entry names the private block, which "
               "the request and the pending copy hold; the source keeps the "
               "hit's reference; one copy is pending",
               lambda: _diagnose_cow(fn))

        def trials():
            # the manager's copy-on-write step, overridden by a subclass
            class LearnerManager(KVCacheManager):
                def redirect_partial_hit(self, req_blocks, block_idx, cow):
                    fn(self, req_blocks, block_idx, cow)

            manager = LearnerManager
            for seed in range(seeds):
                manager_trial(manager, seed, aligned=False,
                              diagnose=lambda: _diagnose_cow(fn))

        c.prop(f"{seeds} scheduler runs with partial prefix hits match "
               "the library at every step", trials,
               "the message names the operation and the first difference",
               lambda: _diagnose_cow(fn))
    return c.report


catalogue(check_redirect_partial_hit, COW_MISTAKES)


# ---------------------------------------------------- a hit inside a block
# Two small computations on the multi-group framing of chapter 6: in vLLM
# 0.33.0 a prefix-match unit finer than the block (``hash_block_size``)
# exists only for models with several KV-cache groups; our one-group
# manager takes one for teaching. The answers are compared with an oracle
# and with a real KVCacheManager(hash_block_size=match_unit).

def _hit_model(shared, B, unit, *, floor_to="unit", block="floor",
               copy="partial", valid="slots"):
    step = {"unit": unit, "block": B, "none": 1}[floor_to]
    hit = shared // step * step
    idx = {"floor": hit // B, "cdiv": cdiv(hit, B),
           "minus": (hit - 1) // B, "unit": hit // unit}[block]
    slots = hit % B if valid == "slots" else hit % B // unit
    needs = {"partial": hit % B != 0, "hit": hit > 0,
             "always": True}[copy]
    return idx, slots, needs


def partial_hit_reference(shared_tokens, block_size, match_unit):
    """(logical block, valid slots, needs_copy) of the hit."""
    return _hit_model(shared_tokens, block_size, match_unit)


HIT_MISTAKES = [
    Mistake("a copy on a block boundary", "a hit that ends on a block "
            "boundary shares whole blocks only: the next token starts a "
            "fresh block, and there is nothing to copy",
            lambda *a: _hit_model(*a, copy="hit")),
    Mistake("a copy for every hit", "only a hit that ends inside a block "
            "needs one", lambda *a: _hit_model(*a, copy="always")),
    Mistake("logical block off by one (cdiv)", "the hit's last token is at "
            "position hit - 1, the first to compute at position hit: name "
            "the block that position lies in", lambda *a: _hit_model(*a, block="cdiv")),
    Mistake("logical block off by one (hit - 1)", "name the block the first "
            "token to compute goes into: on a boundary that is the fresh "
            "block after the hit, not the hit's last block",
            lambda *a: _hit_model(*a, block="minus")),
    Mistake("hit floored to the block", "the lookup hashes match units, "
            "not blocks: the hit is shared_tokens floored to a multiple of "
            "match_unit (floored to the block, as a one-group vLLM does, it "
            "never ends inside one)",
            lambda *a: _hit_model(*a, floor_to="block")),
    Mistake("hit not floored to the match unit", "only whole match units "
            "are hashed: a hit ends at a multiple of match_unit",
            lambda *a: _hit_model(*a, floor_to="none")),
    Mistake("blocks counted in match units", "a logical block holds "
            "block_size tokens; match_unit only decides where a hit can end",
            lambda *a: _hit_model(*a, block="unit")),
    Mistake("valid slots counted in match units", "a slot holds one token: "
            "count the hit's tokens inside that block, not its match units",
            lambda *a: _hit_model(*a, valid="units")),
]

#: Where the hit-mistakes' answers differ.
_HIT_PROBES = [(10, 4, 2), (8, 4, 2), (13, 8, 4), (0, 8, 4), (4_100, 16, 4),
               (4_096, 16, 4), (35, 16, 16)]


def _random_hit_setting(rng):
    """(block_size, match_unit, shared_tokens) for a random partial-hit case;
    the unit divides the block, as the manager requires."""
    B = rng.choice((4, 8, 16, 32))
    unit = rng.choice([u for u in (1, 2, 4, 8, 16, 32) if B % u == 0])
    return B, unit, rng.randrange(0, 6 * B)


def _library_hit(shared, B, unit, extra=3):
    """What a real manager does: the hit, its blocks, the allocation and
    the copies, for a prompt whose first ``shared`` tokens a finished
    request computed (and ``extra`` tokens more of its own)."""
    m = KVCacheManager(cdiv(shared + 2 * extra, B) * 2 + 4, B,
                       hash_block_size=unit)
    cached = [1000 + i for i in range(shared + extra)]
    a = Request("cached", cached, hash_block_size=unit)
    m.allocate_slots(a, len(cached))
    a.num_computed_tokens = len(cached)
    m.free(a)
    prompt = cached[:shared] + [5000 + i for i in range(extra)]
    r = Request("new", prompt, hash_block_size=unit)
    blocks, hit = m.get_computed_blocks(r)
    new = m.allocate_slots(r, r.num_tokens - hit, hit, blocks)
    return m, r, hit, len(new), m.outstanding_copies


def _hit_answer(fn, args):
    got = fn(*args)
    if not (isinstance(got, tuple) and len(got) == 3):
        raise AssertionError(f"expected (block_idx, valid_slots, needs_copy),"
                             f" got {type(got).__name__} {got!r:.60}")
    if not isinstance(got[2], bool):
        raise AssertionError(f"needs_copy: expected True or False, got "
                             f"{type(got[2]).__name__} {got[2]!r:.40}")
    return (expect_int(got[0], "block_idx"),
            expect_int(got[1], "valid_slots"), got[2])


def _hit_case(fn, args, what) -> None:
    got = _hit_answer(fn, args)
    want = partial_hit_reference(*args)
    if got != want:
        raise WrongAnswer(
            f"{what} ({args[0]:,} shared tokens, block_size {args[1]}, "
            f"match_unit {args[2]}): expected {want}, got {got}",
            name_mistake(got, args, HIT_MISTAKES, fn, _HIT_PROBES))


def check_partial_hit(fn, cases: int = 40, seed: int = 0) -> CheckReport:
    """Check ``partial_hit(shared_tokens, block_size, match_unit) ->
    (block_idx, valid_slots, needs_copy)``."""
    rng = random.Random(seed)
    with Checker("partial_hit") as c:
        c.probe(lambda: fn(10, 4, 2))

        c.prop("4,100 tokens, B=16, unit 4: block 256, 4 valid slots, a copy",
               lambda: _hit_case(fn, (4_100, 16, 4), "the chapter's case"),
               "4,100 = 256 x 16 + 4: the hit ends 4 slots into block 256")

        def boundary():
            for args in ((4_096, 16, 4), (4_103, 16, 16), (32, 8, 2),
                         (0, 16, 4)):
                _hit_case(fn, args, "a hit on a block boundary")

        c.prop("a hit on a block boundary (or at match_unit == B) needs no "
               "copy", boundary,
               "a copy is needed only where the request must write into a "
               "block it shares")

        def unit_grid():
            for args in ((4_103, 16, 4), (13, 8, 4), (7, 8, 2)):
                _hit_case(fn, args, "shared tokens past a match-unit edge")

        c.prop("the hit ends at a multiple of the match unit", unit_grid,
               "the lookup hashes whole match units: a unit that is only "
               "partly shared is a miss")

        def randomized():
            for k in range(cases):
                B, unit, shared = _random_hit_setting(rng)
                m, r, hit, _, copies = _library_hit(shared, B, unit)
                want = partial_hit_reference(shared, B, unit)
                ids = m.get_block_ids(r.request_id)
                library = (hit // B, hit % B, bool(copies))
                assert library == want, (
                    "the library and the oracle disagree (a bug in pagedkv, "
                    "not in your code)")
                assert not copies or copies[0][1] == ids[want[0]]
                _hit_case(fn, (shared, B, unit), f"random case {k}")

        c.prop(f"{cases} random hits match a real KVCacheManager("
               "hash_block_size=match_unit)", randomized,
               "the message names the case; the three properties above "
               "are all there is")
    return c.report


catalogue(check_partial_hit, HIT_MISTAKES)


def _alloc_model(num_tokens, hit, B, *, copy="partial", hits_new=False,
                 total="cdiv"):
    need = cdiv(num_tokens, B) if total == "cdiv" else num_tokens // B
    if hits_new:
        return need
    if copy == "partial":
        return need - hit // B
    held = cdiv(hit, B)  # the hit's blocks, the partial one included
    return need - held + {"never": 0, "hit": hit > 0}[copy]


def blocks_to_allocate_reference(num_tokens, hit_tokens, block_size):
    """New blocks allocate_slots takes for a new request after its hit."""
    return _alloc_model(num_tokens, hit_tokens, block_size)


ALLOC_MISTAKES = [
    Mistake("the copy's block forgotten", "a hit that ends inside a block "
            "supplies that block only to read from: the private copy is one "
            "more new block",
            lambda *a: _alloc_model(*a, copy="never")),
    Mistake("a copy counted on a block boundary", "a hit on a block "
            "boundary has no partial block: nothing to copy",
            lambda *a: _alloc_model(*a, copy="hit")),
    Mistake("the hit counted as new blocks", "the hit's full blocks are "
            "shared, not allocated: subtract them",
            lambda *a: _alloc_model(*a, hits_new=True)),
    Mistake("floor for the prompt's blocks", "a prompt that ends inside a "
            "block needs that block too, partly filled as it is",
            lambda *a: _alloc_model(*a, total="floor")),
]

_ALLOC_PROBES = [(4_112, 4_100, 16), (4_112, 4_096, 16), (13, 10, 4),
                 (13, 8, 4), (21, 12, 8)]


def _alloc_case(fn, args, what) -> None:
    got = expect_int(fn(*args), "blocks_to_allocate")
    want = blocks_to_allocate_reference(*args)
    if got != want:
        raise WrongAnswer(
            f"{what} ({args[0]:,} tokens, a hit of {args[1]:,}, "
            f"block_size {args[2]}): expected {want}, got {got}",
            name_mistake(got, args, ALLOC_MISTAKES, fn, _ALLOC_PROBES))


def check_blocks_to_allocate(fn, cases: int = 40,
                             seed: int = 0) -> CheckReport:
    """Check ``blocks_to_allocate(num_tokens, hit_tokens, block_size)``."""
    rng = random.Random(seed)
    with Checker("blocks_to_allocate") as c:
        c.probe(lambda: fn(13, 10, 4))

        c.prop("4,112 tokens after a 4,100-token hit, B=16: 1 block, the "
               "copy", lambda: _alloc_case(
                   fn, (4_112, 4_100, 16), "the chapter's B"),
               "cdiv(4,112, 16) = 257 blocks; the hit supplies 256 whole "
               "ones; block 256 is B's private copy")

        def copies():
            for args in ((13, 10, 4), (21, 12, 8), (4_113, 4_100, 16)):
                _alloc_case(fn, args, "a hit that ends inside a block")

        c.prop("a hit that ends inside a block counts the copy's block",
               copies, "the partial block is shared but cannot be written: "
               "count it as new")

        def boundary():
            for args in ((13, 8, 4), (4_112, 4_096, 16), (9, 0, 4)):
                _alloc_case(fn, args, "a hit on a block boundary")

        c.prop("a hit on a block boundary adds no copy", boundary,
               "only the hit's whole blocks save an allocation")

        def randomized():
            for k in range(cases):
                B, unit, shared = _random_hit_setting(rng)
                extra = rng.randrange(1, 2 * B)
                _, r, hit, allocated, _ = _library_hit(shared, B, unit,
                                                       extra)
                args = (r.num_tokens, hit, B)
                assert allocated == blocks_to_allocate_reference(*args), (
                    "the library and the oracle disagree (a bug in pagedkv, "
                    "not in your code)")
                _alloc_case(fn, args, f"random admission {k}")

        c.prop(f"{cases} random admissions match what allocate_slots takes",
               randomized,
               "the message names the case; the three properties above "
               "are all there is")
    return c.report


catalogue(check_blocks_to_allocate, ALLOC_MISTAKES)
