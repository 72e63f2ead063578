"""PagedKV, the reference allocator: the worked example, a randomized oracle test, bad input,
and the admission/cleanup scheduler model."""

from __future__ import annotations

import copy
import random

import pytest

from pagedkv.common import InvariantError
from pagedkv.sim.paged_kv import PagedKV, format_pool, tail_waste
from pagedkv.sim.scheduler_sim import SchedulerSim, SchedulerSimResult, SimRequest, demo_scheduler


def snapshot(pool: PagedKV):
    """Everything a failed call must leave untouched."""
    return copy.deepcopy(
        (pool.pages, sorted(pool.free), pool.tables, pool.owners, pool.pins, pool.transfers, pool._completed)
    )


def test_worked_example_verbatim():
    pool = PagedKV(capacity=3, block_size=4)
    pool.create("a")
    pool.append("a", 10)
    pool.fork("a", "b")
    source, = pool.pin("a", "transfer-1")
    pool.append("b", 20)  # Partial shared tail: copy before writing.
    assert pool.read("a") == [10]
    assert pool.read("b") == [10, 20]
    pool.release("a")    # Cancellation removes ownership, not the transfer pin.
    assert source in pool.pages and source not in pool.free
    pool.unpin("transfer-1")
    assert source in pool.free
    pool.check()
    pool.release("b")
    assert len(pool.free) == 3
    print("shared prefix, copy-on-write, and transfer cleanup: OK")


def test_worked_example_references_step_by_step():
    """Page 0 starts with two owners and one pin; b's write moves b alone to page 1."""
    pool = PagedKV(capacity=3, block_size=4)
    pool.create("a")
    pool.append("a", 10)
    pool.fork("a", "b")
    assert pool.pin("a", "transfer-1") == (0,)
    assert pool.owners[0] == {"a", "b"} and pool.pins[0] == {"transfer-1"}
    pool.append("b", 20)
    assert pool.tables == {"a": [0], "b": [1]}
    assert pool.pages == {0: [10], 1: [10, 20]}
    pool.release("a")
    assert pool.owners[0] == set() and pool.pins[0] == {"transfer-1"}


# ----------------------------------------------------------- randomized test
class Oracle:
    """Plain lists: what each request should read back, and which handles exist."""

    def __init__(self):
        self.seqs: dict[str, list[int]] = {}
        self.frozen: dict[str, dict[int, list[int]]] = {}  # live handle -> pinned page contents
        self.used_handles: set[str] = set()


def _run_random(seed: int, n_ops: int = 200, cls=PagedKV) -> dict[str, int]:
    rng = random.Random(seed)
    capacity, block_size = rng.randint(3, 16), rng.randint(1, 4)
    pool, oracle = cls(capacity, block_size), Oracle()
    tally = dict(cow=0, cow_pinned_sole_owner=0, memory_error=0, bad_input=0, applied=0)
    next_id, next_token = 0, 1000

    for _ in range(n_ops):
        live = sorted(oracle.seqs)
        # One of the six choices, among those that apply now (all but create need a request or a handle).
        weights = {"create": 2, "append": 8 * bool(live), "fork": 3 * bool(live), "pin": 2 * bool(live),
                   "unpin": 3 * bool(oracle.frozen) + bool(oracle.used_handles), "release": (3 + 6 * (not pool.free)) * bool(live),
                   "malformed": 1}  # a full pool drains; now and then an argument of the wrong type
        op = rng.choices(list(weights), list(weights.values()))[0]
        before, free_before = snapshot(pool), len(pool.free)
        bad = rng.random() < 0.05  # now and then, a call that must be refused
        try:
            if op == "create":
                rid = rng.choice(live) if bad and live else f"r{next_id}"
                pool.create(rid)
                next_id += 1
                oracle.seqs[rid] = []
            elif op == "append":
                rid = "nobody" if bad else rng.choice(live)
                table = pool.tables.get(rid, [])
                tail = table[-1] if table else None
                will_copy = (tail is not None and len(pool.pages[tail]) < block_size
                             and (pool.owners[tail] != {rid} or bool(pool.pins[tail])))
                sole_pinned = will_copy and pool.owners[tail] == {rid}
                pool.append(rid, next_token)
                oracle.seqs[rid].append(next_token)
                next_token += 1
                tally["cow"] += will_copy
                tally["cow_pinned_sole_owner"] += sole_pinned
            elif op == "fork":
                parent = rng.choice(live)
                child = rng.choice(live) if bad else f"r{next_id}"
                pool.fork(parent, child)
                next_id += 1
                oracle.seqs[child] = list(oracle.seqs[parent])
            elif op == "pin":
                rid = rng.choice([r for r in live if oracle.seqs[r]] or live)
                handle = rng.choice(sorted(oracle.used_handles)) if bad and oracle.used_handles else f"t{next_id}"
                pages = pool.pin(rid, handle)
                next_id += 1
                assert list(pages) == pool.tables[rid]
                oracle.used_handles.add(handle)
                oracle.frozen[handle] = {p: list(pool.pages[p]) for p in pages}
            elif op == "unpin":
                if bad or not oracle.frozen:
                    bad = True  # only completed or never-issued handles to choose from
                    handle = rng.choice(sorted(oracle.used_handles - set(oracle.frozen)) or ["never-issued"])
                else:
                    handle = rng.choice(sorted(oracle.frozen))
                pool.unpin(handle)
                del oracle.frozen[handle]
            elif op == "malformed":
                bad = True
                rid = rng.choice(live) if live else "nobody"
                call = rng.choice([
                    lambda: pool.create(5),
                    lambda: pool.append(rid, 2.5),
                    lambda: pool.append(rid, True),
                    lambda: pool.append(b"r0", 1),
                    lambda: pool.fork(rid, None),
                    lambda: pool.pin(rid, 7),
                    lambda: pool.release(["r0"]),
                ])
                call()
            else:  # release
                rid = "nobody" if bad else rng.choice(live)
                pool.release(rid)
                del oracle.seqs[rid]
            tally["applied"] += 1
        except MemoryError:
            assert free_before == 0, f"seed {seed}: MemoryError with {free_before} free pages"
            assert snapshot(pool) == before, f"seed {seed}: MemoryError changed the pool"
            tally["memory_error"] += 1
        except (KeyError, ValueError, TypeError):
            assert bad or (op == "pin" and not pool.tables[rid]), f"seed {seed}: {op} refused a valid call"
            assert snapshot(pool) == before, f"seed {seed}: a refused {op} changed the pool"
            tally["bad_input"] += 1

        pool.check()
        assert sorted(pool.tables) == sorted(oracle.seqs)
        for rid, tokens in oracle.seqs.items():
            assert pool.read(rid) == tokens, f"seed {seed}: {rid} reads {pool.read(rid)}, expected {tokens}"
        for handle, pages in oracle.frozen.items():
            for page, contents in pages.items():
                assert pool.pages.get(page) == contents, f"seed {seed}: pinned page {page} of {handle} changed"
        referenced = {p for t in pool.tables.values() for p in t} | {p for ps in oracle.frozen.values() for p in ps}
        assert set(pool.pages) == referenced, f"seed {seed}: allocated pages differ from referenced pages"
    return tally


@pytest.mark.parametrize("seed", range(25))
def test_randomized_against_list_oracle(seed):
    tally = _run_random(seed)
    assert tally["applied"] + tally["memory_error"] + tally["bad_input"] == 200
    assert tally["applied"] >= 100, tally  # most choices changed the pool


def test_randomized_run_exercises_every_branch():
    """The 25 seeds together hit copy-on-write (shared and pinned sole owner), MemoryError and refusals."""
    total = dict.fromkeys(["cow", "cow_pinned_sole_owner", "memory_error", "bad_input"], 0)
    for seed in range(25):
        for k, v in _run_random(seed).items():
            if k in total:
                total[k] += v
    assert all(v >= 5 for v in total.values()), total


def test_randomized_oracle_catches_a_missing_copy():
    """A PagedKV that writes shared tails in place must fail the randomized test."""

    class NoCopy(PagedKV):
        def must_copy(self, page, request_id):
            return False

    with pytest.raises(AssertionError):
        for seed in range(25):
            _run_random(seed, cls=NoCopy)


# ------------------------------------------------------------ specific cases
def test_sole_owner_of_pinned_partial_tail_copies():
    pool = PagedKV(capacity=4, block_size=4)
    pool.create("a")
    for t in (1, 2):
        pool.append("a", t)
    (page,) = pool.pin("a", "x")
    pool.append("a", 3)
    assert pool.pages[page] == [1, 2], "the transfer's snapshot must not change"
    assert pool.read("a") == [1, 2, 3] and pool.tables["a"] != [page]
    pool.check()


def test_one_page_pool_cannot_copy_shared_tail():
    pool = PagedKV(capacity=1, block_size=4)
    pool.create("a")
    pool.append("a", 7)
    pool.fork("a", "b")
    before = snapshot(pool)
    with pytest.raises(MemoryError, match="no free page"):
        pool.append("b", 8)
    assert snapshot(pool) == before
    assert pool.read("a") == [7] and pool.read("b") == [7]
    pool.check()


def test_sole_unpinned_owner_writes_in_place_with_empty_heap():
    pool = PagedKV(capacity=1, block_size=4)
    pool.create("a")
    for t in range(4):
        pool.append("a", t)  # page 0 is ours alone: no copy, no new page
    assert pool.tables["a"] == [0] and pool.free == []
    with pytest.raises(MemoryError):
        pool.append("a", 4)  # the page is full now


def test_full_shared_tail_needs_no_copy():
    pool = PagedKV(capacity=3, block_size=2)
    pool.create("a")
    pool.append("a", 1)
    pool.append("a", 2)
    pool.fork("a", "b")
    pool.append("a", 3)
    pool.append("b", 4)
    assert pool.tables == {"a": [0, 1], "b": [0, 2]}
    assert pool.owners[0] == {"a", "b"}
    pool.check()


def test_pin_outlives_release_and_frees_on_unpin():
    pool = PagedKV(capacity=2, block_size=2)
    pool.create("a")
    pool.append("a", 1)
    pool.pin("a", "h")
    pool.release("a")
    assert 0 in pool.pages and pool.free == [1]
    pool.check()
    pool.unpin("h")
    assert pool.pages == {} and sorted(pool.free) == [0, 1]


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda p: p.release("zz"), KeyError, "unknown request 'zz'"),
        (lambda p: p.read("zz"), KeyError, "unknown request 'zz'"),
        (lambda p: p.append("zz", 1), KeyError, "unknown request 'zz'"),
        (lambda p: p.append("a", 1.5), TypeError, "token must be an int, got float 1.5"),
        (lambda p: p.append("a", True), TypeError, "token must be an int"),
        (lambda p: p.create("a"), ValueError, "request 'a' already exists"),
        (lambda p: p.create(3), TypeError, "request_id must be a str, got int 3"),
        (lambda p: p.fork("zz", "c"), KeyError, "unknown request 'zz'"),
        (lambda p: p.fork("a", "b"), ValueError, "request 'b' already exists"),
        (lambda p: p.pin("a", "live"), ValueError, "handle 'live' was already used"),
        (lambda p: p.pin("a", "done"), ValueError, "handle 'done' was already used"),
        (lambda p: p.pin("empty", "new"), ValueError, "request 'empty' has no pages"),
        (lambda p: p.unpin("nope"), KeyError, "unknown transfer handle 'nope'"),
        (lambda p: p.unpin("done"), KeyError, "already completed transfer handle 'done'"),
    ],
)
def test_bad_input_raises_and_changes_nothing(call, exc, match):
    pool = PagedKV(capacity=4, block_size=2)
    pool.create("a")
    pool.append("a", 1)
    pool.fork("a", "b")
    pool.create("empty")
    pool.pin("a", "live")
    pool.pin("b", "done")
    pool.unpin("done")
    before = snapshot(pool)
    with pytest.raises(exc, match=match):
        call(pool)
    assert snapshot(pool) == before
    pool.check()


@pytest.mark.parametrize("capacity, block_size, exc", [(0, 4, ValueError), (3, 0, ValueError), (2.0, 4, TypeError), (3, True, TypeError)])
def test_constructor_rejects_bad_sizes(capacity, block_size, exc):
    with pytest.raises(exc):
        PagedKV(capacity, block_size)


@pytest.mark.parametrize(
    "corrupt, name",
    [
        (lambda p: p.free.append(0), "free and allocated are disjoint"),
        (lambda p: p.free.remove(3), "free and allocated cover the pool"),
        (lambda p: p.owners[0].discard("b"), "every table entry has an owner entry"),
        (lambda p: p.owners[2].add("a"), "every owner entry has a table entry"),
        (lambda p: p.pins[0].add("ghost"), "every pin has a live transfer record"),
        (lambda p: p.pins[0].clear(), "every transfer record has its page pins"),
        (lambda p: p.tables["a"].append(0), "a table has no duplicate pages"),
        (lambda p: p.pages[0].pop(), "every non-tail page is full"),
        (lambda p: p.pages[1].clear(), "a tail holds 1..block_size tokens"),
        (lambda p: (p.tables["c"].clear(), p.owners[2].clear()), "every allocated page has an owner or a pin"),
    ],
)
def test_check_names_the_broken_invariant(corrupt, name):
    pool = PagedKV(capacity=4, block_size=2)
    pool.create("a")
    for t in (1, 2, 3):
        pool.append("a", t)  # pages 0 (full) and 1 (tail)
    pool.fork("a", "b")
    pool.pin("a", "h")
    pool.create("c")
    pool.append("c", 9)  # page 2
    pool.check()
    corrupt(pool)
    with pytest.raises(InvariantError, match=name):
        pool.check()


def test_format_pool_shows_owners_pins_and_free_pages():
    pool = PagedKV(capacity=3, block_size=4)
    pool.create("a")
    pool.append("a", 10)
    pool.fork("a", "b")
    pool.pin("a", "transfer-1")
    pool.append("b", 20)
    assert format_pool(pool).splitlines() == [
        "page  slots         owners         pins",
        "   0  [10  .  .  .] a              transfer-1",
        "   1  [10 20  .  .] b              -",
        "   2  (free)",
        "tables: a->[0]  b->[1]",
    ]


# ----------------------------------------------------------------- tail waste
def test_tail_waste_counts_shared_pages_once():
    pool = PagedKV(capacity=8, block_size=4)
    pool.create("a")
    for t in range(5):  # one full page, one tail holding 1 of 4
        pool.append("a", t)
    for child in ("b", "c"):
        pool.fork("a", child)
    waste = tail_waste(pool)
    assert waste.physical == 3  # the shared tail's 3 empty slots, once
    assert waste.per_request == 9  # three requests each "see" 3 empty slots
    assert waste.allocated_slots == 8
    pool.append("b", 99)  # b copies the tail: now two physical tails
    assert tail_waste(pool).physical == 3 + 2


# ---------------------------------------------------------- scheduler model
def test_demo_shows_what_each_mechanism_protects_against(capsys):
    results = demo_scheduler(verbose=True)
    assert all(isinstance(r, SchedulerSimResult) for r in results.values())
    safe, early, optimistic = results.values()
    assert safe.out_of_memory == []
    assert early.out_of_memory, "returning credits at termination must hand out pinned pages"
    assert optimistic.out_of_memory and optimistic.recomputed_tokens > 0
    for res in results.values():
        assert sorted(res.finished) == ["r0", "r1", "r2"]
    assert "out-of-memory" in capsys.readouterr().out


@pytest.mark.parametrize("seed", range(10))
def test_credits_returned_at_free_never_run_out(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    capacity = rng.randint(4, 16)
    trace = []
    for i in range(rng.randint(3, 12)):
        total_pages = rng.randint(1, capacity)
        total = total_pages * block_size - rng.randint(0, block_size - 1)
        prompt = rng.randint(1, max(1, total - 1))
        trace.append(SimRequest(f"q{i}", prompt, max(1, total - prompt), arrival=rng.randint(0, 10)))
    sim = SchedulerSim(capacity, block_size, credits=True, credits_at_free=True, cleanup_delay=rng.randint(0, 4))
    res = sim.run(trace)
    assert res.out_of_memory == []
    assert sorted(res.finished) == sorted(r.request_id for r in trace)
    assert res.peak_pages <= capacity
    assert sim.pool.pages == {} and len(sim.pool.free) == capacity


def test_scheduler_bad_input():
    with pytest.raises(ValueError, match="needs 3 pages; the pool has 2"):
        SchedulerSim(2, 4).run([SimRequest("big", 8, 4)])
    with pytest.raises(ValueError, match=r"duplicate request ids in trace: \['x'\]"):
        SchedulerSim(4, 4).run([SimRequest("x", 1, 1), SimRequest("x", 2, 1)])
    with pytest.raises(ValueError, match="cleanup_delay"):
        SchedulerSim(4, 4, cleanup_delay=-1)
    with pytest.raises(ValueError, match="prompt_len must be >= 1, got 0"):
        SimRequest("z", 0, 1)
    with pytest.raises(TypeError, match="trace\\[0\\] must be a SimRequest, got int 1"):
        SchedulerSim(4, 4).run([1, 2])
    with pytest.raises(TypeError, match="trace must be an iterable of SimRequest, got SimRequest"):
        SchedulerSim(4, 4).run(SimRequest("x", 1, 1))
    with pytest.raises(TypeError, match="trace must be an iterable of SimRequest, got int 3"):
        SchedulerSim(4, 4).run(3)
