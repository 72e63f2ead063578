"""KVCacheManager: prefix hits, allocation, freeing and copy-on-write, against a simulated KV cache.

The oracle stores each token's *id* in a block-major array ``kv[block, slot]``,
as the real cache stores its K and V. Every step applies the manager's pending
copies (before the "forward pass", as the worker does), then writes the step's
tokens through the request's block table. After every step, each request's
computed tokens must read back through its table: a missing copy-on-write, a
wrong copy pair, a stale prefix entry or a block recycled too early all break
that read-back.
"""

from __future__ import annotations

import random
import warnings
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.common import InvariantError
from pagedkv.pool_events import ListenerWarning
from pagedkv.kv_cache_manager import KVCacheManager, PrefixCacheStats
from pagedkv.request import Request


def snapshot(m: KVCacheManager):
    """Everything a refused call must leave as it was."""
    pool = m.block_pool
    return (
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {rid: [b.block_id for b in bs] for rid, bs in m.req_to_blocks.items()},
        dict(m.num_cached_block),
        dict(m.num_partial_recorded),
        {h: (b.block_id, n) for h, (b, n) in m.partial_hash_to_block.items()},
        m.outstanding_copies,
        m.prefix_cache_stats,
        {rid: id(req) for rid, req in m._holders.items()},
    )


class Sim:
    """A manager, a simulated KV cache of token ids, and the scheduler's side of the protocol."""

    def __init__(self, num_blocks: int, block_size: int, hash_block_size: int | None, seed: int = 0):
        self.m = KVCacheManager(num_blocks, block_size, hash_block_size=hash_block_size)
        self.B = block_size
        self.kv = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.reqs: dict[str, Request] = {}
        self.inflight: list[tuple[int, int]] = []  # copies taken and run, not yet acknowledged
        self.stats: Counter = Counter()
        self.next_id = 0
        self.rng = random.Random(seed)

    def running(self) -> list[str]:
        return sorted(r for r in self.reqs if r in self.m.req_to_blocks)

    def waiting(self) -> list[str]:
        return sorted(r for r in self.reqs if r not in self.m.req_to_blocks)

    def add(self, prompt: list[int], max_tokens: int) -> str:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.reqs[rid] = Request(rid, prompt, max_tokens=max_tokens)
        return rid

    def schedule(self, rid: str, want: int, ack_now: bool) -> None:
        m, req = self.m, self.reqs[rid]
        hit_blocks, hit_tokens = [], 0
        if rid not in m.req_to_blocks:
            hit_blocks, hit_tokens = m.get_computed_blocks(req)
        elif req.num_computed_tokens == req.num_tokens:
            if req.is_finished:
                return
            req.append_output_token_ids(self.rng.randrange(5))  # decode: the sampled token is next
        remaining = req.num_tokens - req.num_computed_tokens - hit_tokens
        num_new = max(1, min(want, remaining))
        before = snapshot(m)
        new = m.allocate_slots(req, num_new, hit_tokens, hit_blocks)
        if new is None:
            assert snapshot(m) == before, "allocate_slots returned None but changed the manager"
            self.stats["refused"] += 1
            return
        self.stats["steps"] += 1
        self.stats["hit_tokens"] += hit_tokens
        self.stats["partial_hits"] += hit_tokens % self.B != 0
        # The worker: copies first, all at once (each dst gets src's content from before the batch) ...
        pairs = m.take_pending_copies()
        old = self.kv.copy()
        for src, dst in pairs:
            self.kv[dst] = old[src]
        # ... then the forward pass writes this step's tokens through the block table.
        table = m.get_block_ids(rid)
        start = req.num_computed_tokens + hit_tokens
        for pos in range(start, start + num_new):
            self.kv[table[pos // self.B], pos % self.B] = req.all_token_ids[pos]
        req.num_computed_tokens = start + num_new
        self.inflight.extend(pairs)
        if ack_now:
            self.ack(len(self.inflight))

    def ack(self, n: int) -> None:
        done, self.inflight = self.inflight[:n], self.inflight[n:]
        self.m.acknowledge_copies(done)

    def free(self, rid: str) -> None:
        self.m.free(self.reqs.pop(rid))

    def verify(self) -> None:
        m = self.m
        m.check()
        used: set[int] = set()
        for rid in self.running():
            req, table = self.reqs[rid], m.get_block_ids(rid)
            used.update(table)
            got = [int(self.kv[table[p // self.B], p % self.B]) for p in range(req.num_computed_tokens)]
            assert got == req.all_token_ids[: req.num_computed_tokens], f"{rid} reads back wrong tokens"
        for src, dst in self.inflight:
            used.update((src, dst))
        assert m.outstanding_copies == self.inflight  # nothing pending between steps
        assert m.get_num_free_blocks() == m.block_pool.num_gpu_blocks - 1 - len(used)


PREFIXES = [[(7 * i + j) % 5 for j in range(40)] for i in range(3)]  # few distinct tokens: many shared prefixes


class KVCacheManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(8, 28), hash_block_size=st.sampled_from([1, 2, 4, None]))
    def setup(self, num_blocks, hash_block_size):
        self.sim = Sim(num_blocks, 4, hash_block_size)

    @rule(base=st.integers(0, 2), shared=st.integers(1, 30), suffix=st.lists(st.integers(0, 4), max_size=6),
          max_tokens=st.integers(1, 6))
    def add_request(self, base, shared, suffix, max_tokens):
        self.sim.add(PREFIXES[base][:shared] + suffix, max_tokens)

    @precondition(lambda self: self.sim.waiting())
    @rule(data=st.data(), want=st.integers(1, 40), ack_now=st.booleans())
    def admit(self, data, want, ack_now):
        self.sim.schedule(data.draw(st.sampled_from(self.sim.waiting())), want, ack_now)

    @precondition(lambda self: self.sim.running())
    @rule(data=st.data(), want=st.integers(1, 8), ack_now=st.booleans())
    def step_running(self, data, want, ack_now):
        self.sim.schedule(data.draw(st.sampled_from(self.sim.running())), want, ack_now)

    @precondition(lambda self: self.sim.running())
    @rule(data=st.data())
    def free_request(self, data):
        rid = data.draw(st.sampled_from(self.sim.running()))
        req = self.sim.reqs[rid]
        self.sim.free(rid)
        before = snapshot(self.sim.m)
        self.sim.m.free(req)  # a second free finds no blocks: a no-op, as in vLLM
        assert snapshot(self.sim.m) == before

    @precondition(lambda self: self.sim.inflight)
    @rule(data=st.data())
    def acknowledge(self, data):
        self.sim.ack(data.draw(st.integers(1, len(self.sim.inflight))))

    @rule(data=st.data())
    def bad_input_changes_nothing(self, data):
        """An invalid call (or a no-op) between valid ones: an error, and the full state unchanged."""
        m = self.sim.m
        before = snapshot(m)
        calls = [
            (lambda: m.free("nobody"), None),  # holds no blocks: a no-op, as in vLLM
            (lambda: m.free(3), TypeError),
            (lambda: m.acknowledge_copies([(0, 10**6)]), ValueError),
            (lambda: m.block_pool.get_cached_block(1.0), TypeError),
            (lambda: m.block_pool.free_blocks([m.block_pool.null_block]), ValueError),
        ]
        for waiting in self.sim.waiting()[:1]:
            req = self.sim.reqs[waiting]
            calls += [
                (lambda: m.free(waiting), None),  # never allocated (aborted while waiting): a no-op
                (lambda: m.allocate_slots(req, req.num_tokens + 1), ValueError),  # draft tokens
                (lambda: m.allocate_slots(req, 1, has_scheduled_reqs=1), TypeError),
            ]
        for running in self.sim.running()[:1]:
            req = self.sim.reqs[running]
            impostor = Request(running, req.all_token_ids, max_tokens=req.max_tokens)  # same id, other object
            calls += [
                (lambda: m.allocate_slots(req, 0), ValueError),
                (lambda: m.allocate_slots(req, req.num_tokens - req.num_computed_tokens + 1), ValueError),
                (lambda: m.get_computed_blocks(req), ValueError),
                (lambda: m.allocate_slots(impostor, 1), ValueError),
                (lambda: m.get_computed_blocks(impostor), ValueError),
                (lambda: m.free(impostor), ValueError),
                (lambda: req.append_output_token_ids([1, 2**70]), ValueError),
            ]
        call, exc = data.draw(st.sampled_from(calls))
        tokens = {rid: list(r.all_token_ids) for rid, r in self.sim.reqs.items()}
        if exc is None:
            call()
        else:
            with pytest.raises(exc):
                call()
        assert snapshot(m) == before
        assert {rid: list(r.all_token_ids) for rid, r in self.sim.reqs.items()} == tokens
        m.check()

    @rule(on=st.booleans())
    def flaky_listener(self, on):
        """A listener that checks the manager on every event, then raises: the manager must not care."""
        pool = self.sim.m.block_pool
        if not on:
            pool._listeners.clear()
            return
        if pool._listeners:
            return

        def listener(p, event):
            self.sim.m.check()  # notified only once the manager agrees with the pool
            raise RuntimeError("a broken view")

        pool.subscribe(listener)

    @invariant()
    def consistent(self):
        if hasattr(self, "sim"):
            self.sim.verify()


class _QuietMachine(KVCacheManagerMachine):
    """The machine with the flaky listener's warnings silenced (they are tested below)."""

    def __init__(self):
        super().__init__()
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore", ListenerWarning)

    def teardown(self):
        self._warnings.__exit__(None, None, None)


TestKVCacheManagerMachine = _QuietMachine.TestCase
TestKVCacheManagerMachine.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _random_run(seed: int, steps: int = 300, hash_block_size=2, num_blocks=20) -> Counter:
    """The same protocol, driven by a seeded RNG: used to prove the interesting paths are reached."""
    rng = random.Random(seed)
    sim = Sim(num_blocks, 4, hash_block_size, seed)
    for _ in range(steps):
        op = rng.random()
        if op < 0.25 or not sim.reqs:
            base = rng.randrange(3)
            sim.add(PREFIXES[base][: rng.randint(1, 30)] + [rng.randrange(5) for _ in range(rng.randint(0, 4))],
                    rng.randint(1, 6))
        elif op < 0.45 and sim.waiting():
            sim.schedule(rng.choice(sim.waiting()), rng.randint(1, 40), rng.random() < 0.5)
        elif op < 0.8 and sim.running():
            sim.schedule(rng.choice(sim.running()), rng.randint(1, 8), rng.random() < 0.5)
        elif op < 0.92 and sim.running():
            sim.free(rng.choice(sim.running()))
        elif sim.inflight:
            sim.ack(rng.randint(1, len(sim.inflight)))
        sim.verify()
    return sim.stats


def test_random_workloads_reach_partial_hits_and_refusals():
    total = Counter()
    for seed in range(6):
        total += _random_run(seed)
    assert total["partial_hits"] >= 5 and total["refused"] >= 5 and total["hit_tokens"] > 0, total


def test_oracle_catches_a_manager_that_never_copies(monkeypatch):
    """Sharing a partial block without a private copy must fail the run.

    Either a read-back differs (the shared block was overwritten), or the pool
    refuses to cache a block under a second, different hash.
    """

    def no_cow(self, req_blocks, block_idx, cow):
        self.block_pool.free_blocks([cow])  # give the spare block back and write into the shared one

    monkeypatch.setattr(KVCacheManager, "redirect_partial_hit", no_cow)
    with pytest.raises((AssertionError, ValueError), match="reads back wrong tokens|already holds a different hash"):
        for seed in range(6):
            _random_run(seed)


# ------------------------------------------------------------- worked cases
def _prefix(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32_000) for _ in range(n)]


def _run_prefill(m: KVCacheManager, req: Request) -> list:
    blocks, n = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - n, n, blocks)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return new


def test_partial_hit_at_4100_tokens_copies_logical_block_256():
    m = KVCacheManager(num_blocks=600, block_size=16, hash_block_size=4)
    shared = _prefix(4100)
    a = Request("a", shared + [1, 2, 3], max_tokens=4)
    _run_prefill(m, a)
    a.append_output_token_ids(5)
    m.allocate_slots(a, 1)  # a decodes; its computed prefix is now matchable
    a.num_computed_tokens += 1

    b = Request("b", shared + [9] * 10, max_tokens=4)
    blocks, n = m.get_computed_blocks(b)
    assert n == 4100 and len(blocks) == 257 and n % 16 == 4  # logical block 256: 4 of 16 slots valid
    shared_block = blocks[256]
    assert shared_block is m.req_to_blocks["a"][256]
    new = m.allocate_slots(b, b.num_tokens - n, n, blocks)
    cow = new[0]
    assert m.get_block_ids("b")[256] == cow.block_id != shared_block.block_id
    assert m.get_block_ids("b")[:256] == m.get_block_ids("a")[:256]  # full blocks: shared, no copy
    assert m.take_pending_copies() == [(shared_block.block_id, cow.block_id)]
    assert cow.ref_cnt == 2 and shared_block.ref_cnt == 2  # both ends held by the copy
    m.check()


def test_full_block_sharing_needs_no_copy():
    m = KVCacheManager(num_blocks=64, block_size=16)
    shared = _prefix(64)
    a = Request("a", shared + [1], max_tokens=2)
    _run_prefill(m, a)
    b = Request("b", shared + [2, 3], max_tokens=2)
    blocks, n = m.get_computed_blocks(b)
    assert n == 64 and len(blocks) == 4
    m.allocate_slots(b, b.num_tokens - n, n, blocks)
    assert m.take_pending_copies() == []
    assert m.get_block_ids("b")[:4] == m.get_block_ids("a")[:4]
    assert all(blk.ref_cnt == 2 for blk in blocks)
    m.check()


def test_capacity_test_counts_the_copy_block():
    m = KVCacheManager(num_blocks=8, block_size=4, hash_block_size=2)
    a = Request("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=3)
    _run_prefill(m, a)  # 2 blocks
    a.append_output_token_ids(0)
    m.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    filler = Request("f", list(range(100, 116)), max_tokens=1)
    m.allocate_slots(filler, 16)  # 4 blocks: 7 usable - 2 - 4 = 1 free
    b = Request("b", [1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9], max_tokens=1)  # 3 blocks: 1 shared, 1 copied, 1 new
    blocks, n = m.get_computed_blocks(b)
    assert n == 6 and len(blocks) == 2
    before = snapshot(m)
    assert m.get_num_free_blocks() == 1
    assert m.allocate_slots(b, b.num_tokens - n, n, blocks) is None  # 1 free < 1 copy + 1 new
    assert snapshot(m) == before
    m.free(filler)
    assert m.allocate_slots(b, b.num_tokens - n, n, blocks) is not None
    m.check()


def test_capacity_counts_hits_that_leave_the_free_queue():
    m = KVCacheManager(num_blocks=5, block_size=4)
    a = Request("a", list(range(9)), max_tokens=1)
    _run_prefill(m, a)  # 3 blocks, two full and cached
    m.free(a)
    assert m.get_num_free_blocks() == 4
    b = Request("b", list(range(8)) + [50, 51, 52, 53, 54, 55, 56, 57, 58], max_tokens=1)  # 17 tokens: 5 blocks
    blocks, n = m.get_computed_blocks(b)
    assert n == 8 and all(blk.ref_cnt == 0 for blk in blocks)
    before = snapshot(m)
    # 2 evictable hits + 3 new blocks = 5 > 4 free.
    assert m.allocate_slots(b, b.num_tokens - n, n, blocks) is None
    assert snapshot(m) == before
    assert m.allocate_slots(b, 4, n, blocks) is not None  # 2 hits + 1 new = 3 fits
    m.check()


def test_watermark_applies_to_admission_only():
    m = KVCacheManager(num_blocks=11, block_size=4, watermark=0.2)  # 10 usable, keep 2 free at admission
    assert m.watermark_blocks == 2
    a = Request("a", list(range(36)), max_tokens=8)
    before = snapshot(m)
    assert m.allocate_slots(a, 36, has_scheduled_reqs=True) is None  # 9 blocks + 2 watermark > 10 free
    assert snapshot(m) == before
    assert m.allocate_slots(a, 28) is not None  # 7 blocks, 3 left
    a.num_computed_tokens = 28
    c = Request("c", list(range(100, 108)), max_tokens=1)
    before = snapshot(m)
    assert m.allocate_slots(c, 8) is None  # a is running: 2 blocks + 2 watermark > 3 free
    assert snapshot(m) == before
    assert m.allocate_slots(a, 4, num_lookahead_tokens=8) is not None  # a running request may use them
    m.check()


def test_watermark_is_waived_when_nothing_else_is_scheduled():
    """vLLM 0.33.0 applies the watermark only with has_scheduled_reqs: a lone request may use the whole pool."""
    m = KVCacheManager(num_blocks=8, block_size=16, watermark=0.2)  # 7 usable blocks, watermark 1
    assert m.watermark_blocks == 1
    big = Request("big", list(range(110)), max_tokens=4)  # 110 tokens: 7 blocks
    before = snapshot(m)
    assert m.allocate_slots(big, 110, has_scheduled_reqs=True) is None  # 7 + 1 > 7, as before
    assert snapshot(m) == before
    assert [b.block_id for b in m.allocate_slots(big, 110)] == [1, 2, 3, 4, 5, 6, 7]  # alone: inferred False
    m.check()
    m.free(big)
    # With another request running, the default infers has_scheduled_reqs=True ...
    small = Request("small", [1, 2, 3], max_tokens=1)
    m.allocate_slots(small, 3)
    other = Request("other", list(range(200, 280)), max_tokens=1)  # 5 blocks; 6 free, watermark 1
    before = snapshot(m)
    assert m.allocate_slots(other, 80) is not None  # 5 + 1 <= 6
    m.free(other)
    late = Request("late", list(range(300, 396)), max_tokens=1)  # 6 blocks
    before = snapshot(m)
    assert m.allocate_slots(late, 96) is None  # 6 + 1 > 6 free while small runs
    assert snapshot(m) == before
    # ... and an explicit value overrides the inference, in both directions.
    assert m.allocate_slots(late, 96, has_scheduled_reqs=False) is not None
    m.check()
    with pytest.raises(TypeError, match="has_scheduled_reqs must be a bool or None, got str 'no'"):
        m.allocate_slots(Request("x", [1]), 1, has_scheduled_reqs="no")


def test_free_releases_tail_first_and_keeps_hashes():
    m = KVCacheManager(num_blocks=6, block_size=2)
    a = Request("a", [1, 2, 3, 4, 5], max_tokens=1)
    _run_prefill(m, a)
    ids = m.get_block_ids("a")  # [1, 2, 3]: two full (hashed), one partial
    m.free(a)
    order = [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]
    assert order[0] == ids[2]  # the unhashed tail is reused first
    assert order[-2:] == [ids[1], ids[0]]  # hashed blocks at the tail, the later prefix evicted first
    before = snapshot(m)
    m.free(a)  # already freed: a no-op, as in vLLM
    m.free("never-seen")  # aborted while waiting, never allocated: a no-op too
    assert snapshot(m) == before
    m.check()


def test_copy_ends_stay_referenced_until_acknowledged():
    m = KVCacheManager(num_blocks=10, block_size=4, hash_block_size=2)
    a = Request("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=2)
    _run_prefill(m, a)
    a.append_output_token_ids(0)
    m.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    b = Request("b", [1, 2, 3, 4, 5, 6, 8, 8], max_tokens=1)
    _run_prefill(m, b)
    with pytest.raises(ValueError, match="was not taken yet"):
        m.acknowledge_copies(m.outstanding_copies)
    (src, dst), = m.take_pending_copies()
    m.free(b)
    m.free(a)
    free_ids = {blk.block_id for blk in m.block_pool.free_block_queue.get_all_free_blocks()}
    assert src not in free_ids and dst not in free_ids  # a cancelled request cannot revoke an issued copy
    m.check()
    with pytest.raises(ValueError, match="not an outstanding copy"):
        m.acknowledge_copies([(dst, src)])
    with pytest.raises(ValueError, match="acknowledged twice"):
        m.acknowledge_copies([(src, dst), (src, dst)])
    m.acknowledge_copies([(src, dst)])
    assert m.get_num_free_blocks() == 9 and m.outstanding_copies == []
    m.check()


def test_hit_is_capped_so_the_last_token_is_recomputed():
    m = KVCacheManager(num_blocks=20, block_size=4, hash_block_size=2)
    a = Request("a", list(range(12)), max_tokens=2)
    _run_prefill(m, a)
    a.append_output_token_ids(0)
    m.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    b = Request("b", list(range(12)), max_tokens=1)  # the whole prompt is cached
    blocks, n = m.get_computed_blocks(b)
    assert n == 10 and len(blocks) == 3  # 11 at most, in 2-token units: 8 full + 2 of block 2
    c = Request("c", list(range(12)), max_tokens=1)
    m2 = KVCacheManager(num_blocks=20, block_size=4)
    _run_prefill(m2, Request("a", list(range(12)), max_tokens=1))
    assert m2.get_computed_blocks(c)[1] == 8  # block units: the last full block is recomputed


def test_prefix_cache_stats_and_reset():
    m = KVCacheManager(num_blocks=20, block_size=4)
    a = Request("a", list(range(9)), max_tokens=1)
    _run_prefill(m, a)
    m.record_prefix_cache_stats(a, 0)  # the scheduler records at admission
    b = Request("b", list(range(8)) + [99], max_tokens=1)
    for _ in range(3):  # lookups alone (a request that keeps waiting) count nothing
        assert m.get_computed_blocks(b)[1] == 8
    assert m.prefix_cache_stats == PrefixCacheStats(requests=1, queries=9, hits=0)
    m.record_prefix_cache_stats(b, 8)
    stats = m.prefix_cache_stats
    assert stats == PrefixCacheStats(requests=2, queries=18, hits=8)
    assert stats.hit_rate == pytest.approx(8 / 18)
    assert m.reset_prefix_cache_stats() == stats and m.prefix_cache_stats.queries == 0
    b.num_preemptions = 1  # a preempted request admitted again counts apart, as in vLLM
    m.record_prefix_cache_stats(b, 4)
    assert m.prefix_cache_stats == PrefixCacheStats(preempted_requests=1, preempted_queries=9,
                                                    preempted_hits=4)
    assert m.prefix_cache_stats.hit_rate == 0.0
    assert m.reset_prefix_cache() is False  # a holds blocks
    m.free(a)
    assert m.reset_prefix_cache() is True
    assert m.get_computed_blocks(Request("c", list(range(9)), max_tokens=1)) == ([], 0)


def test_caching_disabled_never_hits():
    m = KVCacheManager(num_blocks=20, block_size=4, enable_caching=False)
    a = Request("a", list(range(9)), max_tokens=1)
    _run_prefill(m, a)
    assert m.get_computed_blocks(Request("b", list(range(9)), max_tokens=1)) == ([], 0)
    assert all(b.block_hash is None for b in m.block_pool.blocks)
    m.check()


# ----------------------------------------------------------------- requests
def test_request_hashes_follow_appended_tokens():
    r = Request("r", [1, 2, 3], max_tokens=3, hash_block_size=2)
    assert len(r.block_hashes) == 1
    r.append_output_token_ids(4)
    assert len(r.block_hashes) == 2 and r.num_tokens == 4 and r.num_output_tokens == 1
    r.append_output_token_ids([5, 6])
    assert len(r.block_hashes) == 3 and r.is_finished
    with pytest.raises(ValueError, match="exceed max_tokens=3"):
        r.append_output_token_ids(7)
    with pytest.raises(ValueError, match="hashes 2-token blocks, not 4"):
        KVCacheManager(10, 4).get_computed_blocks(r)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: Request("r", []), ValueError, "empty prompt"),
        (lambda: Request(5, [1]), TypeError, "request_id must be a str"),
        (lambda: Request("r", [1, 2.5]), TypeError, r"prompt_token_ids\[1\] = 2.5"),
        (lambda: Request("r", [1], max_tokens=0), ValueError, "max_tokens must be >= 1, got 0"),
        (lambda: KVCacheManager(10, 4, hash_block_size=3), ValueError, "hash_block_size=3 must divide block_size=4"),
        (lambda: KVCacheManager(10, 0), ValueError, "block_size must be >= 1, got 0"),
        (lambda: KVCacheManager(1, 4), ValueError, "num_blocks must be >= 2, got 1"),
        (lambda: KVCacheManager(10, 4, watermark=1.5), ValueError, r"watermark must be a finite number in \[0, 1\)"),
    ],
)
def test_bad_construction(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_bad_allocation_arguments_change_nothing():
    m = KVCacheManager(num_blocks=20, block_size=4, hash_block_size=2)
    a = Request("a", list(range(10)), max_tokens=2)
    _run_prefill(m, a)
    a.append_output_token_ids(0)
    m.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    b = Request("b", list(range(10)) + [7, 7], max_tokens=1)
    blocks, n = m.get_computed_blocks(b)
    other = Request("o", [3] * 20, max_tokens=1)
    before = snapshot(m)
    cases = [
        (lambda: m.allocate_slots(b, 0, n, blocks), ValueError, "num_new_tokens must be >= 1, got 0"),
        (lambda: m.allocate_slots(b, 1.0), TypeError, "num_new_tokens must be an int"),
        (lambda: m.allocate_slots(b, 13), ValueError, "has 12 tokens; cannot compute 13 after 0"),
        (lambda: m.allocate_slots(b, 1, n, blocks[:-1]), ValueError, "does not match"),
        (lambda: m.allocate_slots(other, 1, n, blocks), ValueError, "stale or foreign prefix hit"),
        (lambda: m.allocate_slots(a, 1, n, blocks), ValueError, "already holds blocks"),
        (lambda: m.allocate_slots(b, 1, num_lookahead_tokens=-1), ValueError, "num_lookahead_tokens"),
        (lambda: m.allocate_slots("b", 1), TypeError, "expected a Request"),
        (lambda: m.get_block_ids("b"), KeyError, "request 'b' holds no blocks"),
        (lambda: m.free(3), TypeError, "expected a Request or a request id"),
        (lambda: m.allocate_slots(b, 13), ValueError, "past num_tokens only by the request's spec_token_ids"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
        assert snapshot(m) == before, match
    m.check()


def test_partial_hit_must_be_used_whole():
    m = KVCacheManager(num_blocks=20, block_size=8, hash_block_size=2)
    a = Request("a", list(range(14)), max_tokens=2)
    _run_prefill(m, a)
    a.append_output_token_ids(0)
    m.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    b = Request("b", list(range(14)) + [5, 5], max_tokens=1)
    blocks, n = m.get_computed_blocks(b)
    assert n == 14 and len(blocks) == 2  # 8 full + 6 of block 1
    before = snapshot(m)
    with pytest.raises(ValueError, match="partial hit must be used whole: request 'b' hits 14 tokens, not 12"):
        m.allocate_slots(b, 1, 12, blocks)
    assert snapshot(m) == before
    assert m.allocate_slots(b, 1, 8, blocks[:1]) is not None  # a full-block prefix of the hit is fine
    m.check()


def test_a_partial_hit_whose_block_filled_since_the_lookup_is_refused():
    m = KVCacheManager(num_blocks=20, block_size=8, hash_block_size=2)
    a = Request("a", list(range(14)), max_tokens=8)
    _run_prefill(m, a)
    a.append_output_token_ids(0)
    m.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    b = Request("b", list(range(14)) + [0, 0, 5, 5], max_tokens=1)
    blocks, n = m.get_computed_blocks(b)
    assert n == 14 and len(blocks) == 2  # 8 full + 6 of a's block 1
    a.append_output_token_ids(0)  # a's block 1 fills and is cached in full: b now hits 16 tokens
    m.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    before = snapshot(m)
    with pytest.raises(ValueError, match="stale prefix hit for request 'b': its block 1 has filled"):
        m.allocate_slots(b, b.num_tokens - n, n, blocks)
    assert snapshot(m) == before
    blocks, n = m.get_computed_blocks(b)  # looked up again: the longer hit
    assert n == 16 and m.allocate_slots(b, b.num_tokens - n, n, blocks) is not None
    m.check()


def test_check_names_a_broken_reference_count():
    m = KVCacheManager(num_blocks=10, block_size=4)
    a = Request("a", list(range(6)), max_tokens=1)
    _run_prefill(m, a)
    m.req_to_blocks["a"][0].ref_cnt += 1
    with pytest.raises(InvariantError, match="ref_cnt = table entries"):
        m.check()


# ------------------------------------------------------------ hardening
def test_a_second_request_object_with_a_live_id_is_refused():
    m = KVCacheManager(num_blocks=20, block_size=4)
    a = Request("a", list(range(10)), max_tokens=2)
    _run_prefill(m, a)
    impostor = Request("a", [9, 9, 9, 9, 9], max_tokens=1)  # another object under a's id
    before = snapshot(m)
    for call in (lambda: m.allocate_slots(impostor, 5), lambda: m.get_computed_blocks(impostor),
                 lambda: m.free(impostor)):
        with pytest.raises(ValueError, match="request id 'a' is held by another live Request object"):
            call()
        assert snapshot(m) == before
    m.check()
    m.free("a")  # by id, the holder is freed
    assert m.allocate_slots(impostor, 5) is not None  # now the id is free for the new object
    m.check()


def test_freeing_a_request_that_never_got_blocks_is_a_no_op():
    m = KVCacheManager(num_blocks=10, block_size=4)
    a = Request("a", list(range(6)), max_tokens=1)
    _run_prefill(m, a)
    before = snapshot(m)
    m.free(Request("waiting", [1, 2, 3]))  # aborted while waiting
    m.free("waiting")
    assert snapshot(m) == before
    m.check()


def test_tokens_past_num_tokens_without_drafts_are_refused_with_a_reason():
    m = KVCacheManager(num_blocks=10, block_size=4)
    a = Request("a", list(range(6)), max_tokens=4)
    before = snapshot(m)
    with pytest.raises(ValueError, match=r"has 6 tokens; cannot compute 8 after 0 \(a step runs past num_tokens "
                                         r"only by the request's spec_token_ids, and it has none\)"):
        m.allocate_slots(a, 8)
    assert snapshot(m) == before
    assert m.allocate_slots(a, 6, num_lookahead_tokens=2) is not None  # lookahead slots: 8 tokens, 2 blocks
    assert len(m.get_block_ids("a")) == 2
    assert m.num_cached_block["a"] == 1  # only the real, full block is cached
    m.check()


def test_token_ids_must_fit_in_64_bits_before_anything_changes():
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] = 1180591620717411303424 does not fit in 64 bits"):
        Request("r", [1, 2**70])
    with pytest.raises(TypeError, match="prompt_token_ids must be a sequence of int token ids, got str"):
        Request("r", "abc")
    r = Request("r", [1, 2, 3], max_tokens=4, hash_block_size=2)
    state = (list(r.all_token_ids), list(r.output_token_ids), list(r.block_hashes))
    with pytest.raises(ValueError, match=r"token_ids\[1\] = -9223372036854775809 does not fit in 64 bits"):
        r.append_output_token_ids([5, -(2**63) - 1])
    with pytest.raises(TypeError, match="token_ids must be a sequence of int token ids, got bool True"):
        r.append_output_token_ids(True)
    assert (list(r.all_token_ids), list(r.output_token_ids), list(r.block_hashes)) == state
    r.append_output_token_ids([5, 2**63 - 1])  # the extremes are fine
    assert r.num_tokens == 5 and len(r.block_hashes) == 2


def test_a_raising_listener_cannot_corrupt_allocate_slots():
    """The listener fires once per pool event; it sees a consistent manager, and its exception becomes a warning."""
    m = KVCacheManager(num_blocks=20, block_size=4, hash_block_size=2)
    a = Request("a", list(range(10)), max_tokens=2)
    _run_prefill(m, a)
    a.append_output_token_ids(0)
    m.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    seen = []

    def listener(pool, event):
        m.check()  # the manager already agrees with the pool
        seen.append(event.kind)
        raise RuntimeError("boom")

    m.block_pool.subscribe(listener)
    b = Request("b", list(range(10)) + [7, 7, 7, 7, 7, 7], max_tokens=1)  # a partial hit: touch, allocate, cache
    blocks, n = m.get_computed_blocks(b)
    with pytest.warns(ListenerWarning) as record:
        new = m.allocate_slots(b, b.num_tokens - n, n, blocks)
    assert new is not None and seen == ["touch", "allocate", "cache"]
    assert [str(w.message).split(" on a ")[1].split(" event")[0] for w in record] == ["'touch'", "'allocate'", "'cache'"]
    assert all("raised RuntimeError: boom" in str(w.message) and w.filename == __file__ for w in record)
    assert m.get_block_ids("b")[len(blocks):] == [blk.block_id for blk in new[1:]]
    m.check()
    with pytest.warns(ListenerWarning, match="'free' event"):
        m.free(b)
    assert "b" not in m.req_to_blocks
    m.check()
