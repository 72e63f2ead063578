"""Chapter 2's simulations (pagedkv.sim) and their drawings (pagedkv.views.fragmentation): known answers, conservation on random traces, oracles, and bad input."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv import budget
from pagedkv import sim
from pagedkv.common import InvariantError
from pagedkv.views import fragmentation as fv
from pagedkv.budget import GiB, KiB, MiB

BPT = budget.kv_bytes_per_token("Llama-3-8B")  # 128 KiB
POOL_BYTES = budget.kv_pool_bytes(81_559 * MiB, 0.92, 14.96 * GiB, 6.0 * GiB)
BLOCKS = budget.num_gpu_blocks(POOL_BYTES, "Llama-3-8B", 16)  # 26,785
SLOTS = BLOCKS * 16  # 428,560
MAX_LEN = 32_768


# ------------------------------------------------------------------ known answers
def test_reference_setup():
    assert BPT == 131_072 == 128 * KiB
    assert round(POOL_BYTES / GiB, 2) == 52.32
    assert (BLOCKS, SLOTS) == (26_785, 428_560)


def test_max_length_reservation_wastes_98_13_percent_of_a_chat_turn():
    assert MAX_LEN * BPT == 4 * GiB
    assert round(100 * sim.over_reservation_waste(612, MAX_LEN), 2) == 98.13
    # Measured on the allocator: one 512 + 100 turn in its reservation.
    a = sim.MaxLengthAllocator(SLOTS, MAX_LEN)
    assert a.admit("r", 512, 100)
    for _ in range(100):
        assert a.grow("r")
    occ = a.occupancy()
    assert occ.live == 612
    assert round(100 * occ.over_reserved / (occ.live + occ.over_reserved), 2) == 98.13


def test_thirteen_reservations_hold_0_97_gib_of_live_kv():
    a = sim.MaxLengthAllocator(SLOTS, MAX_LEN)
    admitted = sum(a.admit(i, 612) for i in range(20))
    assert admitted == a.num_extents == 13 == budget.contiguous_reservations(POOL_BYTES, "Llama-3-8B", MAX_LEN)
    assert not a.admit("one more", 1)
    assert a.live * BPT == 13 * 612 * 128 * KiB == 13 * 76.5 * MiB
    assert round(a.live * BPT / GiB, 2) == 0.97
    # The pool's tail, too short for a 14th extent, is reported as unusable.
    assert a.occupancy().external == SLOTS - 13 * MAX_LEN == 2_576


def test_612_tokens_hold_39_blocks_and_the_ceiling_is_686():
    a = sim.PagedAllocator(SLOTS, 16, MAX_LEN)
    assert a.admit("r", 612) and len(a.blocks_of("r")) == 39 == budget.blocks_per_request(612, 16)
    a.finish("r")
    admitted = 0
    while a.admit(admitted, 612):
        admitted += 1
    assert admitted == 686 == budget.paged_ceiling(BLOCKS, 612, 16)
    assert a.num_free_blocks == BLOCKS - 686 * 39 < 39
    a.check()


@pytest.mark.parametrize("block_size,mib,gib_at_686,percent", [(16, 1.875, 1.3, 2.4), (128, 15.875, 10.6, 20)])
def test_internal_waste_bound_per_sequence_and_at_686(block_size, mib, gib_at_686, percent):
    worst = (block_size - 1) * BPT
    assert worst / MiB == mib
    assert round(686 * worst / GiB, 1) == gib_at_686
    assert round(100 * 686 * worst / POOL_BYTES, 1 if percent < 10 else 0) == percent
    # The worst case, measured: every request one token into a fresh block.
    a = sim.PagedAllocator(SLOTS, block_size, MAX_LEN)
    for i in range(686):
        assert a.admit(i, block_size + 1)
    assert set(a.internal_waste().values()) == {block_size - 1}
    assert a.occupancy().internal * BPT == 686 * worst


def test_tail_waste_15_1_0_15_and_when_7_75_is_the_mean():
    assert [sim.unused_tail_slots(n, 16) for n in (1, 15, 16, 17)] == [15, 1, 0, 15]
    assert sim.unused_tail_slots(np.array([1, 15, 16, 17]), 16).tolist() == [15, 1, 0, 15]
    assert sim.expected_tail_waste([1, 15, 16, 17], None, 16) == 7.75
    assert sim.expected_tail_waste([1, 15, 16, 17], [0.25] * 4, 16) == 7.75
    # Not equally likely, not 7.75: mostly 16-token sequences waste little.
    assert sim.expected_tail_waste([1, 15, 16, 17], [0.1, 0.1, 0.7, 0.1], 16) == pytest.approx(3.1)
    assert sim.uniform_tail_waste(16) == 7.5


@given(block_size=st.integers(1, 64), start=st.integers(1, 10_000), laps=st.integers(1, 3))
def test_uniform_residues_give_half_a_block_less_a_half(block_size, start, laps):
    lengths = np.arange(start, start + laps * block_size)  # every residue, equally often
    assert sim.expected_tail_waste(lengths, None, block_size) == pytest.approx((block_size - 1) / 2)


@given(lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=20), block_size=st.integers(1, 256),
       data=st.data())
def test_expected_tail_waste_matches_a_plain_loop(lengths, block_size, data):
    weights = data.draw(st.lists(st.integers(0, 10), min_size=len(lengths), max_size=len(lengths)))
    if sum(weights) == 0:
        weights[0] = 1
    probs = [w / sum(weights) for w in weights]
    want = sum(p * ((block_size - n % block_size) % block_size) for n, p in zip(lengths, probs))
    assert sim.expected_tail_waste(lengths, probs, block_size) == pytest.approx(want)


# ------------------------------------------------------------------ allocators, by construction
def test_first_fit_refuses_while_enough_total_is_free():
    a = sim.VariableExtentAllocator(100, 100, "first-fit")
    for rid in "abc":
        assert a.admit(rid, 30)
    assert a.admit("d", 10)
    a.finish("a")
    a.finish("c")
    assert a.free_slots == 60 and a.largest_free_extent() == 30
    assert a.free_extents() == [(0, 30), (60, 30)]
    assert not a.admit("e", 40)  # 60 slots free, none 40 in a row
    occ = a.occupancy(waiting=(40, 0))
    assert (occ.external, occ.free) == (60, 0)
    assert a.occupancy(waiting=(30, 0)).external == 0  # a hole holds that one
    assert a.occupancy(waiting=(70, 0)).external == 0  # not enough in total: shortage, not fragmentation
    assert sim.largest_free_extent(a.allocated_extents().values(), 100) == 30


def test_freed_extents_coalesce_with_both_neighbours():
    a = sim.VariableExtentAllocator(100, 100)
    for rid in "abcd":
        assert a.admit(rid, 20)
    a.finish("a")
    a.finish("c")
    assert a.free_extents() == [(0, 20), (40, 20), (80, 20)]
    a.finish("b")
    assert a.free_extents() == [(0, 60), (80, 20)]
    a.finish("d")
    assert a.free_extents() == [(0, 100)]
    a.check()


def test_first_fit_and_best_fit_choose_different_holes():
    placed = {}
    for policy in ("first-fit", "best-fit"):
        a = sim.VariableExtentAllocator(100, 100, policy)
        for rid, n in [("a", 50), ("b", 10), ("c", 20), ("d", 20)]:
            assert a.admit(rid, n)
        a.finish("a")
        a.finish("c")  # holes: 50 at slot 0, 20 at slot 60
        assert a.admit("e", 15)
        placed[policy] = a.allocated_extents()["e"]
        a.check()
    assert placed == {"first-fit": (0, 15), "best-fit": (60, 15)}


def test_contiguous_reservation_covers_growth_and_paged_allocates_on_block_boundaries():
    v = sim.VariableExtentAllocator(1000, 500)
    assert v.admit("r", 10, 5)
    assert v.occupancy().over_reserved == 5
    for _ in range(5):
        assert v.grow("r")
    assert v.occupancy().over_reserved == 0
    with pytest.raises(ValueError, match="already wrote"):
        v.grow("r")
    p = sim.PagedAllocator(64, 16, 64)
    assert p.admit("r", 16, 20)
    assert p.num_free_blocks == 3
    assert p.grow("r") and p.num_free_blocks == 2  # token 17 opens block 2
    for _ in range(15):
        assert p.grow("r")
    assert p.num_free_blocks == 2 and p.occupancy().internal == 0


def test_paged_growth_is_refused_without_a_free_block_and_changes_nothing():
    p = sim.PagedAllocator(32, 16, 32)
    assert p.admit("a", 16, 16) and p.admit("b", 16, 16)
    before = snapshot(p)
    assert not p.grow("a")
    assert not p.grow_all()
    assert snapshot(p) == before
    p.check()


def test_grow_all_is_vectorised_but_equal_to_one_by_one():
    one, many = (sim.PagedAllocator(4096, 16, 1024) for _ in range(2))
    for a in (one, many):
        for i, n in enumerate([1, 15, 16, 17, 100]):
            assert a.admit(i, n, 200)
    for _ in range(40):
        for i in range(5):
            assert one.grow(i)
    assert many.grow_all(40)
    assert [one.blocks_of(i) for i in range(5)] != []  # block ids may differ; counts and totals may not
    assert [len(one.blocks_of(i)) for i in range(5)] == [len(many.blocks_of(i)) for i in range(5)]
    assert one.occupancy() == many.occupancy()
    one.check()
    many.check()


# ------------------------------------------------------------------ stateful, against an oracle
class Oracle:
    """A plain-Python model: a slot bitmap for contiguous allocators, block counts for paged ones."""

    def __init__(self, kind, capacity, max_len, block_size):
        self.kind, self.max_len, self.B = kind, max_len, block_size
        self.capacity = capacity if kind not in ("paged", "token") else capacity // block_size * block_size
        self.used = [False] * self.capacity  # contiguous kinds: which slots are reserved
        self.requests = {}  # rid -> [written, limit, start, reserved]

    def free_blocks(self):
        held = sum(-(-w // self.B) for w, *_ in self.requests.values())
        return self.capacity // self.B - held

    def runs(self):
        """Free runs (start, length) of the bitmap."""
        out, s = [], None
        for i, u in enumerate(self.used + [True]):
            if not u and s is None:
                s = i
            elif u and s is not None:
                out.append((s, i - s))
                s = None
        return out

    def admit(self, rid, prompt, max_new):
        if self.kind in ("paged", "token"):
            if -(-prompt // self.B) > self.free_blocks():
                return False
            self.requests[rid] = [prompt, prompt + max_new, None, None]
            return True
        need = self.max_len if self.kind == "max-length" else prompt + max_new
        if self.kind == "max-length":
            slots = [i * self.max_len for i in range(self.capacity // self.max_len)]
            starts = [s for s in slots if not any(self.used[s : s + need])]
        else:
            fits = [(n, s) for s, n in self.runs() if n >= need]
            starts = [min(fits)[1]] if self.kind == "best-fit" and fits else [s for n, s in sorted(fits, key=lambda x: x[1])]
        if not starts:
            return False
        start = starts[0]
        self.used[start : start + need] = [True] * need
        self.requests[rid] = [prompt, prompt + max_new, start, need]
        return True

    def grow(self, rid):
        r = self.requests[rid]
        if self.kind in ("paged", "token") and r[0] % self.B == 0 and self.free_blocks() < 1:
            return False
        r[0] += 1
        return True

    def finish(self, rid):
        w, lim, start, need = self.requests.pop(rid)
        if start is not None:
            self.used[start : start + need] = [False] * need

    def parts(self, waiting=None):
        live = sum(r[0] for r in self.requests.values())
        if self.kind in ("paged", "token"):
            held = sum(-(-r[0] // self.B) for r in self.requests.values()) * self.B
            return dict(live=live, over_reserved=0, external=0, internal=held - live, free=self.capacity - held)
        reserved = sum(self.used)
        free = self.capacity - reserved
        if self.kind == "max-length":
            remainder = self.capacity % self.max_len
            return dict(live=live, over_reserved=reserved - live, external=remainder, internal=0, free=free - remainder)
        external = 0
        if waiting is not None:
            need = sum(waiting)
            if need <= free and max((n for _, n in self.runs()), default=0) < need:
                external = free
        return dict(live=live, over_reserved=reserved - live, external=external, internal=0, free=free - external)


class AllocatorMachine(RuleBasedStateMachine):
    """Random admit / grow / grow_all / finish on one allocator; check() and the oracle after each."""

    @initialize(kind=st.sampled_from(sim.ALLOCATOR_KINDS), capacity=st.integers(8, 160),
                max_len=st.integers(4, 48), block_size=st.sampled_from([1, 2, 4, 8, 16]))
    def setup(self, kind, capacity, max_len, block_size):
        max_len = min(max_len, capacity // 2 if kind != "max-length" else capacity)
        if kind in ("paged", "token"):
            block_size = 1 if kind == "token" else min(block_size, max_len)
        self.alloc = sim.make_allocator(kind, capacity, max_len, block_size)
        self.oracle = Oracle(kind, capacity, max_len, 1 if kind == "token" else block_size)
        self.next_id = 0

    @rule(prompt=st.integers(1, 48), max_new=st.integers(0, 24))
    def admit(self, prompt, max_new):
        if prompt + max_new > self.alloc.max_model_len:
            before = snapshot(self.alloc)
            with pytest.raises(ValueError, match="max_model_len"):
                self.alloc.admit(self.next_id, prompt, max_new)
            assert snapshot(self.alloc) == before
            return
        got = self.alloc.admit(self.next_id, prompt, max_new)
        assert got == self.oracle.admit(self.next_id, prompt, max_new)
        if not got:  # refused: what would have to be free is not, and nothing changed
            assert self.next_id not in self.alloc.requests()
            # paged: a refusal always means too few blocks in total, never bad placement
            if self.oracle.kind in ("paged", "token"):
                assert -(-prompt // self.oracle.B) > self.alloc.num_free_blocks
            occ = self.alloc.occupancy((prompt, max_new))
            assert occ.as_dict() == self.oracle.parts((prompt, max_new))
        self.next_id += 1

    @precondition(lambda self: self.alloc.num_requests > 0)
    @rule(data=st.data())
    def grow(self, data):
        rid = data.draw(st.sampled_from(sorted(self.alloc.requests())))
        w, lim = self.oracle.requests[rid][:2]
        if w >= lim:
            with pytest.raises(ValueError):
                self.alloc.grow(rid)
            return
        assert self.alloc.grow(rid) == self.oracle.grow(rid)

    @precondition(lambda self: self.alloc.num_requests > 0)
    @rule()
    def grow_all(self):
        if any(w >= lim for w, lim, *_ in self.oracle.requests.values()):
            before = snapshot(self.alloc)
            with pytest.raises(ValueError):
                self.alloc.grow_all()
            assert snapshot(self.alloc) == before
            return
        need = sum(1 for w, *_ in self.oracle.requests.values() if w % self.oracle.B == 0)
        fits = self.oracle.kind not in ("paged", "token") or need <= self.oracle.free_blocks()
        assert self.alloc.grow_all() == fits
        if fits:
            for rid in self.oracle.requests:
                self.oracle.requests[rid][0] += 1

    @precondition(lambda self: self.alloc.num_requests > 0)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.alloc.requests())))
        self.alloc.finish(rid)
        self.oracle.finish(rid)

    @invariant()
    def agrees_with_oracle(self):
        if not hasattr(self, "alloc"):
            return
        self.alloc.check()
        assert self.alloc.occupancy().as_dict() == self.oracle.parts()
        for rid, (w, lim, start, need) in self.oracle.requests.items():
            assert self.alloc.written(rid) == w
            if isinstance(self.alloc, sim.VariableExtentAllocator):
                assert self.alloc.allocated_extents()[rid] == (start, need)
            if isinstance(self.alloc, sim.MaxLengthAllocator):
                assert self.alloc.extent_of(rid)[0] == start
        if isinstance(self.alloc, sim.PagedAllocator):
            assert all(0 <= w < self.alloc.block_size for w in self.alloc.internal_waste().values())
        if isinstance(self.alloc, sim.VariableExtentAllocator):
            runs = self.oracle.runs()
            assert self.alloc.largest_free_extent() == max((n for _, n in runs), default=0)
            assert sim.largest_free_extent(self.alloc.allocated_extents().values(), self.alloc.capacity) == \
                self.alloc.largest_free_extent()


AllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
TestAllocatorMachine = AllocatorMachine.TestCase


# ------------------------------------------------------------------ the simulator
def small_trace(data, max_len):
    n = data.draw(st.integers(1, 25))
    prompt = data.draw(st.lists(st.integers(1, max_len // 2), min_size=n, max_size=n))
    max_new = data.draw(st.lists(st.integers(1, max_len // 2), min_size=n, max_size=n))
    output = [data.draw(st.integers(1, m)) for m in max_new]
    arrival = sorted(data.draw(st.lists(st.integers(0, 30), min_size=n, max_size=n)))
    return sim.Trace(*(np.array(x, np.int64) for x in (arrival, prompt, output, max_new)))


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(sim.ALLOCATOR_KINDS), capacity=st.integers(48, 400), block_size=st.sampled_from([2, 4, 16]),
       data=st.data())
def test_simulation_conserves_the_pool_at_every_step(kind, capacity, block_size, data):
    max_len = 40  # a pool of 48 slots or more holds one such request at every block size drawn (3 blocks of 16)
    trace = small_trace(data, max_len)
    alloc = sim.make_allocator(kind, capacity, max_len, block_size)
    res = sim.simulate(alloc, trace)
    parts = res.columns[:5]
    assert (parts >= 0).all()
    assert (parts.sum(axis=0) == alloc.capacity).all()
    assert res.finished == len(trace) and alloc.num_requests == 0
    assert np.array_equal(res.final_len, trace.final_len)  # preempted ones too, after recompute
    assert (res.live[-1], res.running[-1], res.waiting[-1]) == (0, 0, 0)
    alloc.check()
    if kind in ("paged", "token"):  # paging: no external fragmentation, tails under a block each
        assert not res.external.any()
        assert (res.internal <= res.running * (alloc.block_size - 1)).all()
        assert not res.over_reserved.any()
    else:
        assert not res.internal.any()


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["max-length", "first-fit", "best-fit"]), data=st.data())
def test_skipping_quiet_steps_records_what_stepping_would(kind, data):
    trace = small_trace(data, 40)
    fast = sim.make_allocator(kind, 200, 40)
    slow = sim.make_allocator(kind, 200, 40)
    slow.reserves_growth = False  # forces one loop iteration per step
    a, b = sim.simulate(fast, trace), sim.simulate(slow, trace)
    assert np.array_equal(a.columns, b.columns)


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(sim.ALLOCATOR_KINDS), data=st.data())
def test_uncontended_pool_matches_closed_form(kind, data):
    trace = small_trace(data, 40)
    alloc = sim.make_allocator(kind, 40 * 64, 40, 4)
    res = sim.simulate(alloc, trace)
    # Nobody waits: request i runs over steps [arrival, arrival + output) with prompt + (t - arrival) tokens.
    t = np.arange(res.steps)[:, None]
    on = (trace.arrival <= t) & (t < trace.arrival + trace.output_len)
    assert np.array_equal(res.running, on.sum(axis=1))
    assert np.array_equal(res.live, (on * (trace.prompt_len + t - trace.arrival)).sum(axis=1))
    assert res.steps == int((trace.arrival + trace.output_len).max()) + 1
    assert res.preemptions == 0 and not res.waiting.any()


def test_paged_pool_preempts_the_newest_and_still_finishes_everything():
    trace = sim.make_request_trace("heavy-tailed", 60, arrival_rate=None, seed=3, max_model_len=4096)
    alloc = sim.PagedAllocator(4096, 16, 4096)
    res = sim.simulate(alloc, trace)
    assert res.preemptions > 0 and res.finished == 60
    assert np.array_equal(res.final_len, trace.final_len)
    assert not res.external.any()


def test_preemption_takes_the_newest_and_puts_it_back_at_the_head_of_the_queue():
    # 4 blocks of 4 slots. A and B decode side by side until A needs a 5th block at step 5.
    trace = sim.Trace(*(np.array(x) for x in ([0, 1, 2], [4, 4, 12], [8, 8, 2], [8, 8, 2])))
    res = sim.simulate(sim.PagedAllocator(16, 4, 16), trace, log_events=True)
    assert res.events == [
        (0, "admit", 0), (1, "admit", 1),
        (5, "preempt", 1),  # the newest goes, having decoded 3 tokens
        (8, "finish", 0),
        (8, "admit", 1),  # back first, ahead of C, re-prefilling 4 + 3 tokens (2 blocks)
        (13, "finish", 1),  # its remaining 5 tokens
        (13, "admit", 2), (15, "finish", 2),
    ]
    assert res.live.tolist() == [4, 9, 11, 13, 15, 9, 10, 11, 7, 8, 9, 10, 11, 12, 13, 0]
    assert res.final_len.tolist() == [12, 12, 14]


def test_the_same_trace_admits_more_with_paging():
    trace = sim.make_request_trace("chat", 2000, arrival_rate=20, seed=1)
    peak = {k: int(sim.simulate(sim.make_allocator(k, SLOTS), trace, max_steps=150).running.max())
            for k in ("max-length", "first-fit", "paged")}
    assert peak["max-length"] == 13
    assert peak["first-fit"] == SLOTS // 612 == 700  # 612-slot extents, equal sizes: no holes left over
    assert peak["paged"] >= 686  # young requests hold fewer than 39 blocks


def test_heavy_tailed_first_fit_shows_external_fragmentation():
    trace = sim.make_request_trace("heavy-tailed", 1500, arrival_rate=10, seed=0)
    res = sim.simulate(sim.VariableExtentAllocator(SLOTS, MAX_LEN), trace, max_steps=600)
    assert res.external.max() > 0
    assert res.mean_fractions()["external"] > 0.01


def test_workload_traces_are_seeded_and_describe_their_parameters():
    a = sim.make_request_trace("heavy-tailed", 500, seed=7)
    b = sim.make_request_trace("heavy-tailed", 500, seed=7)
    c = sim.make_request_trace("heavy-tailed", 500, seed=8)
    assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("arrival", "prompt_len", "output_len"))
    assert not np.array_equal(a.prompt_len, c.prompt_len)
    assert "lognormal(median 400, sigma 0.8)" in a.describe() and "seed 7" in a.describe()
    assert (a.output_len <= a.max_new_tokens).all() and (a.prompt_len + a.max_new_tokens <= MAX_LEN).all()
    chat = sim.make_request_trace("chat", 10, arrival_rate=None)
    assert set(chat.final_len.tolist()) == {612} and not chat.arrival.any()
    long = sim.make_request_trace("long-context", 2000, seed=0)
    assert (long.prompt_len >= 8192).mean() == pytest.approx(0.3, abs=0.05)


# ------------------------------------------------------------------ bad input
def snapshot(a):
    """Everything observable about an allocator (to prove a failed call changed nothing)."""
    state = {"occ": a.occupancy(), "req": {r: a.written(r) for r in a.requests()}}
    if isinstance(a, sim.VariableExtentAllocator):
        state["holes"] = a.free_extents()
        state["extents"] = a.allocated_extents()
    if isinstance(a, sim.PagedAllocator):
        state["blocks"] = {r: a.blocks_of(r) for r in a.requests()}
        state["free"] = a.free_block_ids()
    if isinstance(a, sim.MaxLengthAllocator):
        state["extents"] = {r: a.extent_of(r) for r in a.requests()}
    return copy.deepcopy(state)


@pytest.mark.parametrize("kind", sim.ALLOCATOR_KINDS)
@pytest.mark.parametrize("call,exc,words", [
    (lambda a: a.admit("new", 100, 0), ValueError, "max_model_len = 64"),
    (lambda a: a.admit("new", 60, 10), ValueError, "60 \\+ 10 = 70"),
    (lambda a: a.admit("new", 0, 4), ValueError, "prompt_len must be >= 1, got 0"),
    (lambda a: a.admit("new", -3, 4), ValueError, "prompt_len must be >= 1, got -3"),
    (lambda a: a.admit("new", 4, -1), ValueError, "max_new_tokens must be >= 0, got -1"),
    (lambda a: a.admit("new", 4.0, 1), TypeError, "prompt_len must be an int, got float"),
    (lambda a: a.admit("new", True, 1), TypeError, "prompt_len must be an int, got bool"),
    (lambda a: a.admit("a", 4, 4), ValueError, "'a' is already admitted"),
    (lambda a: a.admit(["unhashable"], 4, 4), TypeError, "hashable"),
    (lambda a: a.grow("ghost"), KeyError, "unknown request 'ghost'"),
    (lambda a: a.finish("ghost"), KeyError, "unknown request 'ghost'"),
    (lambda a: a.grow("full"), ValueError, "'full' already wrote"),
    (lambda a: a.grow_all(), ValueError, "'full' cannot grow by 1"),
    (lambda a: a.grow_all(0), ValueError, "steps must be >= 1, got 0"),
])
def test_bad_calls_raise_and_change_nothing(kind, call, exc, words):
    a = sim.make_allocator(kind, 256, 64, 4)
    assert a.admit("a", 5, 10) and a.admit("full", 3, 0)
    a.grow("a")
    before = snapshot(a)
    with pytest.raises(exc, match=words):
        call(a)
    assert snapshot(a) == before
    a.check()


@pytest.mark.parametrize("make,words", [
    (lambda: sim.PagedAllocator(8, 16, 8), "pool of 8 slots is smaller than one block of 16"),
    (lambda: sim.PagedAllocator(64, 16, 100), "cannot hold one max_model_len = 100"),
    (lambda: sim.MaxLengthAllocator(100, 128), "cannot hold one max_model_len = 128"),
    (lambda: sim.VariableExtentAllocator(100, 128), "cannot hold one max_model_len = 128"),
    (lambda: sim.VariableExtentAllocator(100, 50, "worst-fit"), "unknown policy 'worst-fit'"),
    (lambda: sim.PagedAllocator(64, 0, 8), "block_size must be >= 1, got 0"),
    (lambda: sim.make_allocator("buddy", 64), "unknown allocator kind 'buddy'"),
    (lambda: sim.make_request_trace("podcast"), "unknown workload 'podcast'"),
    (lambda: sim.make_request_trace("chat", arrival_rate=0), "arrival_rate must be a positive number"),
    (lambda: sim.unused_tail_slots(-5, 16), "length must be >= 1, got -5"),
    (lambda: sim.unused_tail_slots(np.array([3, -1]), 16), "lengths must be >= 1, got -1"),
    (lambda: sim.expected_tail_waste([1, 2], [0.5, 0.6], 16), "sum to 1"),
    (lambda: sim.expected_tail_waste([1, 2], [1.5, -0.5], 16), ">= 0"),
    (lambda: sim.expected_tail_waste([1, 2], [1.0], 16), "must match lengths"),
    (lambda: sim.over_reservation_waste(700, 612), "used_tokens 700 exceeds reserved_tokens 612"),
    (lambda: sim.largest_free_extent([(0, 10), (5, 10)], 100), r"extent \(5, 10\) overlaps"),
    (lambda: sim.largest_free_extent([(95, 10)], 100), "leaves the pool of 100"),
    (lambda: sim.simulate(sim.PagedAllocator(64, 16, 64), sim.Trace(*(np.array([], np.int64) for _ in range(4)))),
     "no requests"),
    (lambda: sim.Trace([0, 1], [5, 5], [2, 3], [2, 2]), "outputs must fit max_new_tokens"),
    (lambda: sim.Trace([0.5], [5], [2], [2]), "arrival must be a 1-D array of integers"),
])
def test_bad_construction_and_arguments_are_named(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_simulate_rejects_a_request_longer_than_max_model_len_before_running():
    trace = sim.make_request_trace("long-context", 50, seed=0)  # prompts up to ~30k tokens
    alloc = sim.PagedAllocator(40_000, 16, 4096)
    with pytest.raises(ValueError, match="more than max_model_len = 4096"):
        sim.simulate(alloc, trace)
    assert alloc.num_requests == 0 and alloc.num_free_blocks == alloc.num_blocks
    busy = sim.PagedAllocator(64, 16, 64)
    busy.admit("x", 3)
    with pytest.raises(ValueError, match="empty allocator"):
        sim.simulate(busy, sim.make_request_trace("chat", 1, max_model_len=64 * 16))


def test_check_names_a_broken_invariant():
    a = sim.VariableExtentAllocator(100, 50)
    a.admit("a", 10)
    a._hole_len[10] -= 1  # corrupt: a slot vanishes
    with pytest.raises(InvariantError, match="invariant broken"):
        a.check()
    p = sim.PagedAllocator(64, 16, 64)
    p.admit("a", 20)
    p._free[p._num_free] = p.blocks_of("a")[0]  # corrupt: a block both held and free
    p._num_free += 1
    with pytest.raises(InvariantError, match="exactly one request|held-block|parts sum"):
        p.check()


# --- plotting helpers (chapter 2's figures and explorer) --------------------

import importlib.util  # noqa: E402

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLUMN_PX = 688  # the book's column at a 1280-px window; figures draw at 100 dpi


def _small_results(block_size=16):
    trace = sim.make_request_trace("heavy-tailed", 60, arrival_rate=5, seed=1)
    return sim.run_all(trace, 40_000, 32_768, block_size=block_size, steps=40)


def test_run_all_runs_every_kind_on_the_same_pool():
    results = _small_results()
    assert [r.allocator for r in results] == [
        sim.make_allocator(k, 40_000, 32_768).name for k in sim.ALLOCATOR_KINDS]
    assert all(r.capacity == 40_000 and r.steps == 40 for r in results)
    assert any(r.finished or r.running.max() for r in results)


def test_composition_figure_is_a_grid_that_fits_the_column():
    results = _small_results()
    fig = fv.plot_composition(results, "t")
    try:
        assert fig.get_size_inches()[0] * 100 <= COLUMN_PX
        panels = [ax for ax in fig.axes if ax.axison]
        assert [ax.get_title() for ax in panels] == [r.allocator for r in results]
        rows = {round(ax.get_position().y0, 3) for ax in panels}
        assert len(rows) == 2  # five panels in two rows, not one wide strip
        legend = [ax.get_legend() for ax in fig.axes if ax.get_legend()]
        texts = [t.get_text() for t in legend[0].get_texts()]
        assert set(texts) == set(fv.PART_LABELS.values())
    finally:
        plt.close(fig)


def test_other_figures_fit_the_column():
    results = _small_results()
    trace = sim.make_request_trace("chat", 50, seed=0)
    figs = [fv.plot_tail_residues({"chat": trace}, 16),
            fv.plot_concurrency(results, {"w": [1, 2, 3, 4, 5]}, [(13, "13")]),
            fv.plot_block_size_sweep([1, 16], [0, 1], [0, 2], [0, 1])]
    fig, ax = plt.subplots(figsize=(6.8, 1.5))
    ff = sim.VariableExtentAllocator(100, 100)
    ff.admit("a", 30)
    fv.draw_extents(ff, ax, "t")
    assert [t.get_text() for t in ax.texts] == ["a: 30", "hole 70"]
    figs.append(fig)
    for f in figs:
        assert f.get_size_inches()[0] * 100 <= COLUMN_PX
        plt.close(f)


def test_composition_table_is_narrow_and_names_every_allocator():
    results = _small_results()
    text = fv.composition_table(results)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 79 and len(lines) == 1 + len(results)
    for r, line in zip(results, lines[1:]):
        assert line.startswith(r.allocator)
        f = r.mean_fractions()
        assert f"{100 * f['live']:6.1f}" in line and line.rstrip().endswith(str(r.preemptions))


def test_steady_running_is_the_mean_of_the_second_half():
    r = _small_results()[3]
    assert sim.steady_running(r) == pytest.approx(r.running[20:].mean())


def test_composition_html_is_static():
    html = fv.composition_html(_small_results(), "a <title>")
    assert "data:image/png;base64," in html and "<script" not in html and "http" not in html
    assert "a &lt;title&gt;" in html and "variable-extent first-fit" in html


@pytest.mark.skipif(importlib.util.find_spec("ipywidgets") is None, reason="needs ipywidgets")
def test_explorer_reruns_on_change_and_offers_a_static_rendering():
    pytest.importorskip("ipywidgets")  # a bare GPU machine has no Jupyter
    ex = fv.FragmentationExplorer(40_000, 32_768, num_requests=40, steps=20)
    first = ex.view.value
    assert "heavy-tailed, block_size 16" in first
    ex.block.value = 64
    assert "block_size 64" in ex.view.value and ex.view.value != first
    bundle = ex._repr_mimebundle_()
    data = bundle[0] if isinstance(bundle, tuple) else bundle
    assert data["text/html"] == ex.view.value
