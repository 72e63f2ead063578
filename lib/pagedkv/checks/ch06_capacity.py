"""Exercise 6's capacity test: ``can_allocate(manager, request, num_blocks, num_evictable_hits, has_scheduled_reqs) -> bool``.

``allocate_slots``' one subtraction: the new blocks and the hit blocks that
sit in the free queue must fit the free blocks, with the watermark held back
for an admission only while other requests are scheduled (vLLM 0.33.0's
``has_scheduled_reqs``). Checked on a fixed grid of cases that tells the
common mistakes apart, then inside a real ``KVCacheManager`` (a subclass whose
``allocate_slots`` asks the learner's test) in random scheduler runs compared
with an untouched manager (``manager_trial``).
"""

from __future__ import annotations

from ..common import cdiv
from ..kv_cache_manager import KVCacheManager
from ..request import Request
from ._harness import Checker, CheckReport, Mistake, WrongAnswer, catalogue
from .manager_trial import manager_trial

__all__ = ["check_can_allocate"]


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
            "headroom that must still be free after the allocation: it makes "
            "the test stricter, never looser",
            lambda *a: _fits(*a, side="wrong")),
    Mistake("watermark held back from running requests", "it holds back "
            "admissions (a request with no blocks yet), so that running "
            "requests can keep growing", lambda *a: _fits(*a, who="running")),
    Mistake("watermark applied to every request", "only an admission "
            "(a request that holds no blocks yet) keeps it free",
            lambda *a: _fits(*a, who="always")),
    Mistake("watermark held back always", "it applies to an admission "
            "only, and only while other requests are scheduled "
            "(has_scheduled_reqs): a running request may take every free "
            "block, and a request alone may take the whole pool",
            lambda *a: _fits(*a, who="always", when="any")),
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
               "count what leaves the free queue (new blocks, and hit "
               "blocks nobody held) and what must stay in it (the "
               "watermark, for whom and when?)")

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
