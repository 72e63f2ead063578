"""Checks for the decisions of exercises/06_copy_on_write.ipynb.

The learner writes three of ``KVCacheManager``'s decisions, as functions of
the manager, and two computations on a partial hit:

* ``get_computed_blocks(manager, request) -> (blocks, num_tokens)``: the
  longest cached prefix in whole blocks, stopping at the first miss, capped
  so that the last prompt token is recomputed;
* ``can_allocate(manager, request, num_blocks, num_evictable_hits,
  has_scheduled_reqs) -> bool``: ``allocate_slots``' capacity test, with the
  watermark held back for an admission only while other requests are
  scheduled (vLLM 0.33.0's ``has_scheduled_reqs``);
* ``partial_hit(shared_tokens, block_size, match_unit) -> (block_idx,
  valid_slots, needs_copy)`` and ``blocks_to_allocate(num_tokens,
  hit_tokens, block_size) -> int``: where a hit on a match unit finer than
  the block ends, and what the capacity test counts for it (the private
  copy's block), compared with an oracle and a real
  ``KVCacheManager(hash_block_size=match_unit)``;
* ``redirect_partial_hit(manager, req_blocks, block_idx, cow_block)``: the
  copy-on-write redirect of a partial hit (overriding the manager's
  ``redirect_partial_hit`` method in a subclass).

As for chapter 3's decisions, each function runs inside one real
``KVCacheManager``, through the library's extension points (a subclass
overriding ``get_computed_blocks``, ``allocate_slots`` or
``redirect_partial_hit``), and random scheduler runs are compared,
after every operation, with an untouched manager (``manager_trial``). A
difference is diagnosed on small fixed cases.
"""

from __future__ import annotations

import random

from ..kv_cache_manager import KVCacheManager
from ..request import Request
from ._harness import (Checker, CheckReport, Mistake, WrongAnswer,
                       catalogue, expect_int, name_mistake)
from .manager_trial import manager_trial
from ..common import cdiv

__all__ = ["check_get_computed_blocks", "check_can_allocate",
           "check_partial_hit", "check_blocks_to_allocate",
           "check_redirect_partial_hit"]


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
            "prefix with a hole in it is not a prefix, stop at the first miss",
            lambda m, r: _lookup_model(m, r, skip_misses=True)),
    Mistake("blocks counted, not tokens", "num_tokens is len(blocks) x "
            "block_size", lambda m, r: _lookup_model(m, r, tokens=False)),
    Mistake("the lookup touched the blocks", "get_computed_blocks only "
            "looks; allocate_slots touches the hit when it admits the "
            "request"),
]


def _lookup_cases():
    """(manager, request) pairs whose right answers tell the mistakes apart."""
    p = list(range(1, 13))  # three full blocks of 4
    cases = [(_cached_manager(p), Request("same", p, hash_block_size=4)),
             (_cached_manager(p), Request("longer", p + [7], hash_block_size=4))]
    m = _cached_manager(p)
    hole = m.block_pool.get_cached_block(
        Request("x", p, hash_block_size=4).block_hashes[1])
    m.block_pool.evict_blocks([hole.block_id])  # a hole at block 1
    cases.append((m, Request("hole", p + [7], hash_block_size=4)))
    return cases


def _as_answer(result):
    if not (isinstance(result, tuple) and len(result) == 2):
        raise AssertionError(f"expected (blocks, num_tokens), got "
                             f"{type(result).__name__} {result!r:.60}")
    blocks, n = result
    return _ids(blocks), n


def _diagnose_lookup(fn) -> str | None:
    for m, r in _lookup_cases():
        before = [b.ref_cnt for b in m.block_pool.blocks]
        queue = m.block_pool.get_num_free_blocks()
        try:
            got = _as_answer(fn(m, r))
        except Exception:  # noqa: BLE001
            return None
        if [b.ref_cnt for b in m.block_pool.blocks] != before or (
                m.block_pool.get_num_free_blocks() != queue):
            return LOOKUP_MISTAKES[4].diagnosis()
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


def check_get_computed_blocks(fn, seeds: int = 12,
                              timeout: float = 30.0) -> CheckReport:
    """Check ``get_computed_blocks(manager, request) -> (blocks, num_tokens)``."""
    with Checker("get_computed_blocks", timeout=timeout) as c:
        c.probe(lambda: fn(*_lookup_cases()[0]))

        def fixed():
            for (m, r), what in zip(_lookup_cases(), (
                    "a prompt whose 3 blocks are all cached",
                    "the same prompt and one token more",
                    "a prompt whose cached block 1 was evicted")):
                want = _lookup_model(m, r)
                got = _as_answer(fn(m, r))
                if got != want:
                    raise WrongAnswer(f"{what}: expected blocks {want[0]} and "
                                      f"{want[1]} tokens, got {got[0]} and "
                                      f"{got[1]}", _diagnose_lookup(fn))

        c.prop("the longest cached prefix, up to the first miss, capped at "
               "num_tokens - 1", fixed,
               "walk request.block_hashes while (i + 1) * block_size <= "
               "num_tokens - 1; manager.block_pool.get_cached_block(h)",
               lambda: _diagnose_lookup(fn))

        def looks_only():
            m, r = _lookup_cases()[1]
            before = [b.ref_cnt for b in m.block_pool.blocks]
            fn(m, r)
            if [b.ref_cnt for b in m.block_pool.blocks] != before:
                raise WrongAnswer("the lookup changed reference counts",
                                  LOOKUP_MISTAKES[4].diagnosis())

        c.prop("looks without changing anything", looks_only,
               "do not touch: allocate_slots does that")

        def trials():
            for seed in range(seeds):
                manager_trial(_lookup_manager(fn), seed, aligned=True,
                              diagnose=lambda: _diagnose_lookup(fn))

        c.prop(f"{seeds} random scheduler runs in KVCacheManager match the "
               "library at every step", trials,
               "the message names the operation and the first difference",
               lambda: _diagnose_lookup(fn))
    return c.report


catalogue(check_get_computed_blocks, LOOKUP_MISTAKES)


# -------------------------------------------------------------- can_allocate
def _fits(m, request, num_blocks, evictable, scheduled, *, side="free",
          who="admission", when="scheduled", hits=True):
    admission = request.request_id not in m.req_to_blocks
    applies = {"admission": admission, "running": not admission,
               "always": True}[who]
    if when == "scheduled":
        applies = applies and scheduled
    w = m.watermark_blocks if applies else 0
    need = num_blocks + (evictable if hits else 0)
    free = m.block_pool.get_num_free_blocks()
    return need <= free + w if side == "wrong" else need <= free - w


CAPACITY_MISTAKES = [
    Mistake("watermark applied to the wrong side", "the watermark is "
            "headroom kept free: subtract it from the free blocks (or add "
            "it to the need), never add it to what is free",
            lambda *a: _fits(*a, side="wrong")),
    Mistake("watermark held back from running requests", "it holds back "
            "admissions (a request with no blocks yet), so that running "
            "requests can keep growing", lambda *a: _fits(*a, who="running")),
    Mistake("watermark applied to every request", "only an admission "
            "(a request that holds no blocks yet) keeps it free",
            lambda *a: _fits(*a, who="always")),
    Mistake("watermark applied when nothing else is scheduled", "vLLM "
            "0.33.0 applies it only when has_scheduled_reqs: a request "
            "that fits the whole pool runs when alone",
            lambda *a: _fits(*a, when="any")),
    Mistake("evictable hits not counted", "touching a hit block nobody "
            "holds takes it off the free queue: it needs a free block too",
            lambda *a: _fits(*a, hits=False)),
    Mistake("< where <= belongs", "using every free block is allowed",
            lambda m, r, n, e, s: _fits(m, r, n + 1, e, s)),
]


def _capacity_cases():
    """(manager, request, num_blocks, evictable, scheduled) on a pool of 20, watermark 4."""
    cases = []
    for free_target in (10,):
        m = KVCacheManager(20, 4, watermark=0.2)  # 4 blocks of watermark
        holder = Request("running", list(range(1, 37)), hash_block_size=4)
        m.allocate_slots(holder, 36)  # 9 blocks held: 10 free
        assert m.get_num_free_blocks() == free_target
        new = Request("new", [1, 2, 3], hash_block_size=4)
        for n in (5, 6, 7, 10, 11, 14):
            for e in (0, 1):
                for s in (True, False):
                    cases.append((m, new, n, e, s))
                    cases.append((m, holder, n, e, s))
    return cases


def _diagnose_capacity(fn) -> str | None:
    cases = _capacity_cases()
    try:
        got = [fn(*case) for case in cases]
    except Exception:  # noqa: BLE001
        return None
    for mistake in CAPACITY_MISTAKES:
        if got == [mistake.model(*case) for case in cases]:
            return mistake.diagnosis()
    return None


def _expect_bool(value, what):
    if not isinstance(value, bool):
        raise AssertionError(f"{what}: expected True or False, got "
                             f"{type(value).__name__} {value!r:.40}")
    return value


def _capacity_manager(learner_can_allocate):
    """A ``KVCacheManager`` subclass whose ``allocate_slots`` asks the learner's capacity test.

    It computes the test's arguments as ``allocate_slots`` does; on a yes,
    the library allocates with ``has_scheduled_reqs=False``, which holds no
    watermark back, so a yes the pool cannot honour shows as a refusal.
    """
    class LearnerManager(KVCacheManager):
        def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                           new_computed_blocks=None, num_lookahead_tokens=0,
                           *, has_scheduled_reqs=None):
            B, rid = self.block_size, request.request_id
            hit = list(new_computed_blocks or [])
            req_blocks = self.req_to_blocks.get(rid, [])
            computed = request.num_computed_tokens + num_new_computed_tokens
            required = cdiv(computed + num_new_tokens + num_lookahead_tokens, B)
            n = max(required - len(req_blocks) - len(hit), 0)
            n += bool(hit) and num_new_computed_tokens % B != 0
            evictable = sum(1 for b in hit if b.ref_cnt == 0)
            if has_scheduled_reqs is None:
                has_scheduled_reqs = len(self.req_to_blocks) > (rid in self.req_to_blocks)
            free = self.get_num_free_blocks()
            verdict = _expect_bool(learner_can_allocate(
                self, request, n, evictable, has_scheduled_reqs), "can_allocate")
            if not verdict:
                return None
            out = super().allocate_slots(
                request, num_new_tokens, num_new_computed_tokens, hit,
                num_lookahead_tokens, has_scheduled_reqs=False)
            if out is None:
                raise WrongAnswer(f"can_allocate said yes to {n} new blocks and "
                                  f"{evictable} evictable hits with {free} free",
                                  _diagnose_capacity(learner_can_allocate))
            return out

    return LearnerManager


def check_can_allocate(fn, seeds: int = 16, timeout: float = 30.0) -> CheckReport:
    """Check ``can_allocate(manager, request, num_blocks, num_evictable_hits, has_scheduled_reqs) -> bool``."""
    with Checker("can_allocate", timeout=timeout) as c:
        c.probe(lambda: fn(*_capacity_cases()[0]))

        def fixed():
            for m, r, n, e, s in _capacity_cases():
                got = _expect_bool(fn(m, r, n, e, s), "can_allocate")
                want = _fits(m, r, n, e, s)
                if got != want:
                    who = "an admission" if r.request_id == "new" else "a running request"
                    raise WrongAnswer(
                        f"{who} asking for {n} blocks + {e} evictable hit(s), "
                        f"10 free, watermark 4, has_scheduled_reqs={s}: "
                        f"expected {want}, got {got}", _diagnose_capacity(fn))

        c.prop("the watermark holds back admissions, only while others are "
               "scheduled", fixed,
               "need = num_blocks + num_evictable_hits; keep "
               "manager.watermark_blocks free for an admission if "
               "has_scheduled_reqs")

        def trials():
            for seed in range(seeds):
                manager_trial(_capacity_manager(fn), seed,
                              diagnose=lambda: _diagnose_capacity(fn))

        c.prop(f"{seeds} random scheduler runs in KVCacheManager match the "
               "library at every step", trials,
               "the message names the operation and the first difference",
               lambda: _diagnose_capacity(fn))
    return c.report


catalogue(check_can_allocate, CAPACITY_MISTAKES)


# ------------------------------------------------------- redirect_partial_hit
COW_MISTAKES = [
    Mistake("no redirect", "the shared block must not be written: point "
            "req_blocks[block_idx] at cow_block"),
    Mistake("wrong entry redirected", "the partial block is "
            "req_blocks[block_idx], the hit's last block"),
    Mistake("the copy's reference missing", "the pending copy holds "
            "cow_block too: cow_block.ref_cnt += 1 (released when the copy "
            "is acknowledged)"),
    Mistake("the source's reference dropped", "the source must live until "
            "the copy has run: keep the reference the prefix hit took"),
    Mistake("copy not recorded", "record it with "
            "manager.record_copy(source, cow_block), or the worker never "
            "copies the valid slots"),
    Mistake("source and destination swapped", "the copy goes from the "
            "shared block to the private one: (source, cow_block)"),
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
               "source = req_blocks[block_idx]; req_blocks[block_idx] = "
               "cow_block; cow_block.ref_cnt += 1; record (source, cow_block)",
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
            "boundary shares whole blocks only: the next block is fresh, "
            "nothing to copy (needs_copy = hit % block_size != 0)",
            lambda *a: _hit_model(*a, copy="hit")),
    Mistake("a copy for every hit", "only a hit that ends inside a block "
            "needs one", lambda *a: _hit_model(*a, copy="always")),
    Mistake("logical block off by one (cdiv)", "the hit's last token is at "
            "position hit - 1, the next one at position hit: its block is "
            "hit // block_size", lambda *a: _hit_model(*a, block="cdiv")),
    Mistake("logical block off by one (hit - 1)", "name the block the next "
            "token goes into, hit // block_size: on a boundary that is the "
            "fresh block after the hit",
            lambda *a: _hit_model(*a, block="minus")),
    Mistake("hit floored to the block", "the lookup hashes match units, "
            "not blocks: the hit is shared_tokens floored to a multiple of "
            "match_unit (floored to the block, as a one-group vLLM does, it "
            "never ends inside one)",
            lambda *a: _hit_model(*a, floor_to="block")),
    Mistake("hit not floored to the match unit", "only whole match units "
            "are hashed: a hit ends at a multiple of match_unit",
            lambda *a: _hit_model(*a, floor_to="none")),
    Mistake("blocks counted in match units", "the logical block is "
            "hit // block_size; match_unit only decides where a hit can end",
            lambda *a: _hit_model(*a, block="unit")),
    Mistake("valid slots counted in match units", "a slot holds one token: "
            "the valid slots are hit % block_size",
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
               "needs_copy is hit % block_size != 0; the block is "
               "hit // block_size")

        def unit_grid():
            for args in ((4_103, 16, 4), (13, 8, 4), (7, 8, 2)):
                _hit_case(fn, args, "shared tokens past a match-unit edge")

        c.prop("the hit ends at a multiple of the match unit", unit_grid,
               "hit = shared_tokens // match_unit * match_unit")

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
               "hit = shared // match_unit * match_unit; (hit // block_size,"
               " hit % block_size, hit % block_size != 0)")
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
            "more new block, cdiv(num_tokens, B) - hit // B in all",
            lambda *a: _alloc_model(*a, copy="never")),
    Mistake("a copy counted on a block boundary", "a hit on a block "
            "boundary has no partial block: nothing to copy",
            lambda *a: _alloc_model(*a, copy="hit")),
    Mistake("the hit counted as new blocks", "the hit's full blocks are "
            "shared, not allocated: subtract them",
            lambda *a: _alloc_model(*a, hits_new=True)),
    Mistake("floor for the prompt's blocks", "a prompt that ends inside a "
            "block needs that block: cdiv(num_tokens, block_size)",
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
               "cdiv(num_tokens, block_size) - hit_tokens // block_size")

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
               "cdiv(num_tokens, block_size) - hit_tokens // block_size")
    return c.report


catalogue(check_blocks_to_allocate, ALLOC_MISTAKES)
