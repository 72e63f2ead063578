"""SGLang-style token pools: invariants under random alloc/free, against plain-Python oracles."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from pagedkv.common import InvariantError
from pagedkv.token_pool import PagedTokenToKVPoolAllocator, ReqToTokenPool, TokenToKVPoolAllocator

SETTINGS = settings(max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def state_of(alloc):
    return alloc.free_pages.clone(), alloc._allocated.clone()


def assert_same_state(alloc, state):
    free, allocated = state
    assert torch.equal(alloc.free_pages, free)
    assert torch.equal(alloc._allocated, allocated)


# -- ReqToTokenPool --------------------------------------------------------------------------------


def req_state(pool: ReqToTokenPool):
    """Everything a refused call must leave as it was."""
    return list(pool.free_slots), set(pool._allocated), pool.req_to_token.clone()


def assert_same_req_state(pool: ReqToTokenPool, state) -> None:
    free, allocated, table = state
    assert pool.free_slots == free and pool._allocated == allocated
    assert torch.equal(pool.req_to_token, table)


class ReqToTokenMachine(RuleBasedStateMachine):
    SIZE, WIDTH = 6, 8

    def __init__(self):
        super().__init__()
        self.pool = ReqToTokenPool(self.SIZE, self.WIDTH, device="cpu")
        self.held: set[int] = set()
        self.table = torch.zeros((self.SIZE + 1, self.WIDTH), dtype=torch.int32)  # the oracle
        self.free_order = list(range(1, self.SIZE + 1))  # SGLang's free list: pop the tail, free to the tail

    @rule(n=st.integers(0, 4))
    def alloc(self, n):
        rows = self.pool.alloc(n)
        if n > self.SIZE - len(self.held):
            assert rows is None
            return
        assert rows is not None and len(rows) == n
        assert 0 not in rows and not (set(rows) & self.held) and len(set(rows)) == n
        split = len(self.free_order) - n
        assert rows == self.free_order[split:]
        del self.free_order[split:]
        self.held |= set(rows)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        rows = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, unique=True))
        self.pool.free(rows)
        self.held -= set(rows)
        self.free_order += rows

    @rule(row=st.integers(-1, SIZE + 1))
    def free_unheld(self, row):
        if row in self.held:
            return
        before = req_state(self.pool)
        with pytest.raises(ValueError, match=f"cannot free request row {row}"):
            self.pool.free(row)
        assert_same_req_state(self.pool, before)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), start=st.integers(0, WIDTH), n=st.integers(0, WIDTH))
    def write(self, data, start, n):
        row = data.draw(st.sampled_from(sorted(self.held)))
        n = min(n, self.WIDTH - start)
        values = data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
        as_tensor = data.draw(st.booleans())
        self.pool.write((row, slice(start, start + n)), torch.tensor(values, dtype=torch.int64) if as_tensor else values)
        self.table[row, start:start + n] = torch.tensor(values, dtype=torch.int32)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def invalid_call(self, data):
        """A bad row, slice or slot id between valid calls: an error, and the full state unchanged."""
        row = data.draw(st.sampled_from(sorted(self.held)))
        calls = [
            (lambda: self.pool.write((row, slice(0, 3)), [1, 2, -1]), ValueError),  # a negative slot id
            (lambda: self.pool.write((row, slice(0, 2)), [1, 2**32]), ValueError),  # wraps to 0 in int32
            (lambda: self.pool.write((row, slice(0, 2)), [1, 2**31]), ValueError),  # wraps negative
            (lambda: self.pool.write((row, slice(0, 2)), [1, 2**70]), ValueError),  # beyond int64
            (lambda: self.pool.write((row, slice(0, 2)), [1.0, 2.5]), TypeError),  # would truncate
            (lambda: self.pool.write((row, slice(0, 2)), torch.tensor([True, False])), TypeError),
            (lambda: self.pool.write((row, slice(0, 2)), [[1, 2]]), ValueError),
            (lambda: self.pool.write((row, slice(0, 2)), [1, 2, 3]), ValueError),
            (lambda: self.pool.write((row, slice(7, 10)), [1, 2, 3]), IndexError),
            (lambda: self.pool.write((0, slice(0, 1)), [1]), ValueError),  # the padding row
            (lambda: self.pool.write(row, [1]), TypeError),
            (lambda: self.pool.free([row, row]), ValueError),
            (lambda: self.pool.free(1.0), TypeError),
            (lambda: self.pool.alloc(-1), ValueError),
            (lambda: self.pool.alloc(2.0), TypeError),
        ]
        call, exc = data.draw(st.sampled_from(calls))
        before = req_state(self.pool)
        with pytest.raises(exc):
            call()
        assert_same_req_state(self.pool, before)
        self.pool.check()

    @invariant()
    def agrees(self):
        self.pool.check()
        assert self.pool.available_size() == self.SIZE - len(self.held)
        for row in self.held:
            assert torch.equal(self.pool.req_to_token[row], self.table[row])


ReqToTokenMachine.TestCase.settings = SETTINGS
TestReqToTokenMachine = ReqToTokenMachine.TestCase


def test_req_to_token_padding_row_and_size():
    pool = ReqToTokenPool(256, 32768, device="cpu")
    assert pool.req_to_token.shape == (257, 32768)
    assert pool.metadata_bytes == 257 * 32768 * 4
    assert 0 not in pool.alloc(256)
    assert pool.alloc(1) is None


def test_req_to_token_write():
    pool = ReqToTokenPool(2, 8, device="cpu")
    (row,) = pool.alloc(1)
    pool.write((row, slice(0, 3)), [5, 6, 7])
    pool.write((row, slice(3, 5)), torch.tensor([0, 2**31 - 1], dtype=torch.int64))  # the extremes fit
    assert pool.req_to_token[row, :6].tolist() == [5, 6, 7, 0, 2**31 - 1, 0]
    snapshot = pool.req_to_token.clone()
    with pytest.raises(ValueError, match="cannot write request row 0"):
        pool.write((0, slice(0, 1)), [1])
    with pytest.raises(IndexError, match="outside the context window of 8"):
        pool.write((row, slice(6, 10)), [1, 2, 3, 4])
    with pytest.raises(ValueError, match="2 values for 3 columns"):
        pool.write((row, slice(0, 3)), [1, 2])
    with pytest.raises(ValueError, match=r"values\[1\] = -4 is not a slot id the int32 table can hold"):
        pool.write((row, slice(0, 2)), [1, -4])
    with pytest.raises(ValueError, match=r"values\[0\] = 4294967296 is not a slot id .* 0\.\.2147483647"):
        pool.write((row, slice(0, 1)), [2**32])
    with pytest.raises(ValueError, match=r"values\[1\] = 9223372036854775813 is not a slot id"):
        pool.write((row, slice(0, 2)), torch.tensor([1, 2**63 + 5], dtype=torch.uint64))
    with pytest.raises(TypeError, match="values must be integer slot ids, got dtype torch.float32"):
        pool.write((row, slice(0, 2)), [1.0, 2.9])
    assert torch.equal(pool.req_to_token, snapshot)


def test_req_to_token_double_free_in_one_call():
    pool = ReqToTokenPool(3, 4, device="cpu")
    rows = pool.alloc(2)
    with pytest.raises(ValueError, match=f"request row {rows[0]} appears twice"):
        pool.free([rows[0], rows[0]])
    pool.check()
    assert pool.available_size() == 1


# -- TokenToKVPoolAllocator ------------------------------------------------------------------------


class TokenAllocatorMachine(RuleBasedStateMachine):
    SIZE = 20
    held = Bundle("held")

    def __init__(self):
        super().__init__()
        self.alloc_ = TokenToKVPoolAllocator(self.SIZE, device="cpu")
        self.oracle: set[int] = set()

    @rule(target=held, n=st.integers(0, 8))
    def alloc(self, n):
        out = self.alloc_.alloc(n)
        if n > self.SIZE - len(self.oracle):
            assert out is None
            return []
        got = out.tolist()
        assert out.dtype == torch.int64 and len(got) == n == len(set(got))
        assert all(1 <= s <= self.SIZE for s in got), "slot 0 is never handed out"
        assert not set(got) & self.oracle, "no slot handed out twice"
        self.oracle |= set(got)
        return got

    @rule(slots=consumes(held))
    def free(self, slots):
        self.alloc_.free(torch.tensor(slots, dtype=torch.int64))
        self.oracle -= set(slots)

    @rule(slot=st.integers(-2, SIZE + 2))
    def free_unheld(self, slot):
        if slot in self.oracle:
            return
        state = state_of(self.alloc_)
        with pytest.raises(ValueError, match=f"cannot free slot {slot}"):
            self.alloc_.free([slot])
        assert_same_state(self.alloc_, state)

    @rule(data=st.data())
    def invalid_call(self, data):
        """Malformed input between valid calls: a named error, and the full state unchanged."""
        held = sorted(self.oracle)
        first = held[:1] or [0]  # a held slot, or the padding slot (never freeable)
        calls = [
            (lambda: self.alloc_.free(first + [2**70]), ValueError, r"free_index\[\d\] = 1180591620717411303424 "
                                                                    "does not fit in int64"),
            (lambda: self.alloc_.free(first + [1.5]), TypeError, "must hold integers"),
            (lambda: self.alloc_.free(first + [None]), TypeError, "is not an integer"),
            (lambda: self.alloc_.free([first + [1]]), ValueError, "must be 1-D"),
            (lambda: self.alloc_.free(first * 2), ValueError, "twice|cannot free"),
            (lambda: self.alloc_.free(torch.tensor([1], device="meta")), ValueError, "meta device"),
            (lambda: self.alloc_.alloc(-1), ValueError, "need_size must be >= 0"),
            (lambda: self.alloc_.alloc(1.0), TypeError, "need_size must be an int"),
        ]
        call, exc, words = data.draw(st.sampled_from(calls))
        state = state_of(self.alloc_)
        with pytest.raises(exc, match=words):
            call()
        assert_same_state(self.alloc_, state)
        self.alloc_.check()

    @invariant()
    def agrees(self):
        self.alloc_.check()
        assert self.alloc_.available_size() == self.SIZE - len(self.oracle)
        assert set(self.alloc_.free_pages.tolist()) == set(range(1, self.SIZE + 1)) - self.oracle


TokenAllocatorMachine.TestCase.settings = SETTINGS
TestTokenAllocatorMachine = TokenAllocatorMachine.TestCase


def test_token_allocator_reuses_in_free_order_and_rejects_duplicates():
    a = TokenToKVPoolAllocator(4, device="cpu")
    x = a.alloc(3)
    assert x.tolist() == [1, 2, 3]
    a.free(torch.tensor([2]))
    assert a.alloc(2).tolist() == [4, 2]  # the freed slot goes to the tail
    state = state_of(a)
    with pytest.raises(ValueError, match="slot 1 appears twice"):
        a.free([1, 1])
    with pytest.raises(TypeError, match="free_index must hold integers"):
        a.free([1.0])
    with pytest.raises(ValueError, match="need_size must be >= 0, got -1"):
        a.alloc(-1)
    assert_same_state(a, state)


# -- PagedTokenToKVPoolAllocator -------------------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedMachine(RuleBasedStateMachine):
    """Requests grow by prefill extends and decodes; the oracle is each request's list of slots."""

    NUM_PAGES = 12

    def __init__(self):
        super().__init__()
        self.ps = 4
        self.a = PagedTokenToKVPoolAllocator(self.NUM_PAGES * self.ps, self.ps, device="cpu")
        self.reqs: dict[int, list[int]] = {}
        self.next_id = 0

    def pages_held(self) -> set[int]:
        return {s // self.ps for slots in self.reqs.values() for s in slots}

    def last_loc(self, rid: int) -> int:
        slots = self.reqs[rid]
        return slots[-1] if slots else -1

    def extend(self, growth: dict[int, int]) -> None:
        rids = list(growth)
        prefix = [len(self.reqs[r]) for r in rids]
        seq = [p + growth[r] for p, r in zip(prefix, rids)]
        need = sum(cdiv(s, self.ps) - cdiv(p, self.ps) for p, s in zip(prefix, seq))
        free_before = self.a.available_size() // self.ps
        held_before = self.pages_held()
        state = state_of(self.a)
        out = self.a.alloc_extend(prefix, seq, [self.last_loc(r) for r in rids], sum(growth.values()))
        if need > free_before:
            assert out is None
            assert_same_state(self.a, state)
            return
        assert out is not None and out.numel() == sum(growth.values())
        got = out.tolist()
        assert len(set(got)) == len(got), "no slot handed out twice"
        new_pages = {s // self.ps for s in got} - held_before
        assert len(new_pages) == need, "exactly the pages the lengths require"
        assert not new_pages & {0}, "page 0 is the padding page"
        i = 0
        for r, p, s in zip(rids, prefix, seq):
            self.reqs[r] += got[i : i + s - p]
            i += s - p

    @rule(n=st.integers(1, 11))
    def new_request(self, n):
        rid = self.next_id
        self.next_id += 1
        self.reqs[rid] = []
        self.extend({rid: n})
        if not self.reqs[rid]:
            del self.reqs[rid]

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def extend_some(self, data):
        rids = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), min_size=1, max_size=3, unique=True))
        growth = {r: data.draw(st.integers(0, 9)) for r in rids}
        self.extend(growth)

    @precondition(lambda self: self.reqs)
    @rule()
    def decode_all(self):
        rids = sorted(self.reqs)
        seq = [len(self.reqs[r]) + 1 for r in rids]
        need = sum(1 for s in seq if (s - 1) % self.ps == 0)
        free_before = self.a.available_size() // self.ps
        state = state_of(self.a)
        out = self.a.alloc_decode(seq, [self.last_loc(r) for r in rids])
        if need > free_before:
            assert out is None
            assert_same_state(self.a, state)
            return
        for r, s in zip(rids, out.tolist()):
            if len(self.reqs[r]) % self.ps:
                assert s == self.reqs[r][-1] + 1, "a decode inside a page takes the next slot"
            self.reqs[r].append(s)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.a.free(torch.tensor(self.reqs.pop(rid), dtype=torch.int64))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def bad_last_loc_changes_nothing(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        n = len(self.reqs[rid])
        state = state_of(self.a)
        with pytest.raises(ValueError, match="last_loc"):
            self.a.alloc_extend([n], [n + 1], [self.last_loc(rid) + 1])  # off by one
        assert_same_state(self.a, state)

    @invariant()
    def agrees(self):
        self.a.check()
        held = self.pages_held()
        assert self.a.available_size() == (self.NUM_PAGES - len(held)) * self.ps
        all_slots = [s for slots in self.reqs.values() for s in slots]
        assert len(all_slots) == len(set(all_slots)), "no slot belongs to two requests"
        for slots in self.reqs.values():
            for pos, s in enumerate(slots):
                assert s % self.ps == pos % self.ps, "a token sits at offset pos % page_size of its page"
                if pos % self.ps:
                    assert s // self.ps == slots[pos - 1] // self.ps, "a page holds consecutive positions"
        owners = {}
        for rid, slots in self.reqs.items():
            for s in slots:
                assert owners.setdefault(s // self.ps, rid) == rid, "requests never share a page"


PagedMachine.TestCase.settings = SETTINGS
TestPagedMachine = PagedMachine.TestCase


def test_alloc_extend_three_cases_by_hand():
    a = PagedTokenToKVPoolAllocator(8 * 4, 4, device="cpu")
    first = a.alloc_extend([0], [5], [-1]).tolist()  # case 2 (page 1) then case 3 (page 2, 1 token)
    assert first == [4, 5, 6, 7, 8]
    # prefix 5 -> 14: case 1 fills slots 9..11 of page 2, case 2 takes page 3, case 3 starts page 4.
    second = a.alloc_extend([5], [14], [8]).tolist()
    assert second == [9, 10, 11, 12, 13, 14, 15, 16, 17]
    # Only case 1: 14 -> 16 stays inside page 4.
    assert a.alloc_extend([14], [16], [17]).tolist() == [18, 19]
    a.check()
    assert a.available_size() == (8 - 4) * 4


def test_alloc_extend_returns_none_when_short_and_changes_nothing():
    a = PagedTokenToKVPoolAllocator(3 * 4, 4, device="cpu")
    state = state_of(a)
    assert a.alloc_extend([0, 0], [8, 5], [-1, -1]) is None  # needs 2 + 2 pages, 3 free
    assert_same_state(a, state)
    assert a.alloc_extend([0], [12], [-1]).tolist() == list(range(4, 16))
    assert a.alloc_decode([13], [15]) is None


@pytest.mark.parametrize(
    "args, words",
    [
        (([3], [2], [2]), "need 0 <= prefix_len <= seq_len, got 3 and 2"),
        (([0, 0], [1], [-1]), "one entry per request"),
        (([2], [3], [2]), "last_loc 2 does not sit at offset"),
        (([1], [2], [8]), "last_loc 8 points into page 2, which is not an allocated page"),
        (([1, 1], [2, 2], [4, 4]), "two requests extend the same partial page"),
    ],
)
def test_alloc_extend_rejects_bad_input(args, words):
    a = PagedTokenToKVPoolAllocator(4 * 4, 4, device="cpu")
    a.alloc(4)  # page 1 allocated: slots 4..7
    state = state_of(a)
    with pytest.raises(ValueError, match=words):
        a.alloc_extend(*args)
    assert_same_state(a, state)


def test_paged_free_and_alloc_errors():
    a = PagedTokenToKVPoolAllocator(4 * 4, 4, device="cpu")
    with pytest.raises(ValueError, match="need_size 6 is not a multiple of page_size 4"):
        a.alloc(6)
    x = a.alloc(8)
    assert x.tolist() == list(range(4, 12))
    state = state_of(a)
    with pytest.raises(ValueError, match="cannot free page 0: page 0 is the padding page"):
        a.free([1])
    with pytest.raises(ValueError, match="cannot free page 3: it is not allocated"):
        a.free([13])
    with pytest.raises(ValueError, match="cannot free page 9: outside 1..4"):
        a.free([36])
    assert_same_state(a, state)
    a.free(x[:4])
    assert a.alloc(4).tolist() == [4, 5, 6, 7]  # a freed page is reused first
    with pytest.raises(ValueError, match="holds no whole page"):
        PagedTokenToKVPoolAllocator(3, 4)


def test_check_names_the_broken_invariant():
    a = TokenToKVPoolAllocator(4, device="cpu")
    a.alloc(2)
    a.free_pages = torch.cat((a.free_pages, torch.tensor([3])))  # corrupt: slot 3 free twice
    with pytest.raises(InvariantError, match="invariant 'no slot is free twice' broken"):
        a.check()
    p = PagedTokenToKVPoolAllocator(8, 4, device="cpu")
    p._allocated[1] = True  # page 1 both free and allocated
    with pytest.raises(InvariantError, match=r"invariant 'a page is never both free and allocated' broken: pages \[1\]"):
        p.check()
    r = ReqToTokenPool(3, 4, device="cpu")
    r.alloc(1)
    r.free_slots.append(2)  # corrupt: row 2 free twice
    with pytest.raises(InvariantError, match="invariant 'no row is free twice' broken"):
        r.check()


def test_req_rows_come_from_the_tail_of_the_free_list():
    """SGLang 0.5.23's ReqToTokenPool.alloc_rows pops free_slots[-need_size:]."""
    pool = ReqToTokenPool(8, 4, device="cpu")
    assert pool.alloc(1) == [8]
    assert pool.alloc(2) == [6, 7]
    assert pool.alloc(0) == [] and pool.free_slots == [1, 2, 3, 4, 5]
    pool.free([7, 8])
    assert pool.alloc(1) == [8]  # the row freed last is reused first
    pool.check()


def test_free_segment_keeps_the_request_page_order_where_free_sorts():
    def fresh():
        a = PagedTokenToKVPoolAllocator(6 * 4, 4, device="cpu")
        a.alloc(24)  # pages 1..6, all held
        return a

    # A request whose pages are 5, 2, 4 (slots in its order), the last page partial.
    slots = torch.tensor([20, 21, 22, 23, 8, 9, 10, 11, 16, 17])
    a = fresh()
    a.free(slots)
    assert a.free_pages.tolist() == [2, 4, 5]  # free: unique, so sorted
    b = fresh()
    b.free_segment(slots, start_pos=0)
    assert b.free_pages.tolist() == [5, 2, 4]  # free_segment: the request's order
    b.check()
    t = TokenToKVPoolAllocator(4, device="cpu")
    t.alloc(4)
    t.free_segment(torch.tensor([3, 1]), start_pos=5)
    assert t.free_pages.tolist() == [3, 1]


@pytest.mark.parametrize(
    "slots, start, words",
    [
        ([20, 21, 22, 23], 2, "segment start 2 is not page-aligned"),
        ([20, 22, 21, 23], 0, "slot 22 at segment position 1 is not offset 1 of page 5"),
        ([21, 22, 23, 8], 0, "slot 21 at segment position 0 is not offset 0"),
        ([20, 21, 22, 23, 20, 21, 22, 23], 0, "page 5 appears twice in one free_segment"),
        ([0, 1, 2, 3], 0, "page 0 is the padding page"),
    ],
)
def test_free_segment_rejects_what_is_not_one_request_run(slots, start, words):
    a = PagedTokenToKVPoolAllocator(6 * 4, 4, device="cpu")
    a.alloc(24)
    state = state_of(a)
    with pytest.raises(ValueError, match=words):
        a.free_segment(torch.tensor(slots), start_pos=start)
    assert_same_state(a, state)
