"""Model Runner V2's worker side: RequestState, StagedWriteTensor, BlockTables, the gather kernel.

Three kinds of evidence:

- the gather kernel equals its PyTorch reference on random tables (in Triton's
  interpreter on a CPU, compiled on a GPU);
- random sequences of arrivals, departures, block appends and steps keep
  every ``check()`` green and match a plain-Python oracle;
- the same sequences, run through vLLM 0.33.0's own ``RequestState`` and
  ``BlockTables`` (``vllm/v1/worker/gpu/{states,block_table,buffer_utils}.py``
  read from the release wheel, never installed, executed with the few vLLM
  utilities they import stubbed, their Triton kernels in the interpreter on a
  CPU), give the same rows, the same gathered tables and the same slots.

And bad input: every refusal names the row or the value and changes nothing.
"""

from __future__ import annotations

import logging
import random
import sys
import types
import zipfile

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from pagedkv import default_device
from pagedkv.block_tables import BlockTables
from pagedkv.common import InvariantError
from pagedkv.kernels.gather_block_tables import gather_block_tables, gather_block_tables_ref
from pagedkv.request_state import RequestState
from pagedkv.staged_write import StagedWriteTensor
from vllm_wheel import vllm_wheel  # noqa: E402

DEV = default_device()


# ------------------------------------------------------------ the kernel against its reference

@pytest.mark.parametrize("seed", range(8))
def test_gather_kernel_equals_reference_on_random_tables(seed):
    g = torch.Generator().manual_seed(seed)
    rows = int(torch.randint(1, 9, (1,), generator=g))
    width = [1, 3, 16, 37, 1030][seed % 5]  # 1030: more than one 1024-column chunk
    table = torch.randint(0, 2**31 - 1, (rows, width), generator=g, dtype=torch.int32).to(DEV)
    num_blocks = torch.randint(0, width + 1, (rows,), generator=g, dtype=torch.int32).to(DEV)
    k = int(torch.randint(0, rows + 1, (1,), generator=g))
    idx = torch.randperm(rows, generator=g)[:k]
    padded = k + int(torch.randint(0, 3, (1,), generator=g))
    got = gather_block_tables(table, num_blocks, idx, padded)
    want = gather_block_tables_ref(table, num_blocks, idx, padded)
    assert got.shape == (padded, width) and torch.equal(got, want)
    # by hand: the live prefix of each gathered row, zeros after it and in padding rows
    for i, r in enumerate(idx.tolist()):
        n = int(num_blocks[r])
        assert got[i, :n].tolist() == table[r, :n].tolist() and not got[i, n:].any()
    assert not got[k:].any()


def test_gather_into_a_used_buffer_overwrites_every_returned_row():
    table = torch.arange(1, 25, dtype=torch.int32, device=DEV).reshape(4, 6)
    num_blocks = torch.tensor([6, 2, 0, 4], dtype=torch.int32, device=DEV)
    out = torch.full((5, 6), 99, dtype=torch.int32, device=DEV)
    got = gather_block_tables(table, num_blocks, [3, 1], 3, out=out)
    want = gather_block_tables_ref(table, num_blocks, [3, 1], 3)
    assert torch.equal(got, want) and got.data_ptr() == out.data_ptr()
    assert out[3:].eq(99).all()  # rows past num_reqs_padded are not touched


@pytest.mark.parametrize("bad, message", [
    ([1, 4], r"idx_mapping\[1\] = row 4 is out of range"),
    ([-1], r"idx_mapping\[0\] = row -1 is out of range"),
    ([2, 0, 2], r"row 2 appears twice in idx_mapping \(entries 0 and 2\)"),
])
def test_gather_kernel_refuses_bad_rows_and_writes_nothing(bad, message):
    table = torch.arange(16, dtype=torch.int32, device=DEV).reshape(4, 4)
    num_blocks = torch.full((4,), 4, dtype=torch.int32, device=DEV)
    out = torch.full((4, 4), 7, dtype=torch.int32, device=DEV)
    for fn in (gather_block_tables, gather_block_tables_ref):
        with pytest.raises(ValueError, match=message):
            fn(table, num_blocks, bad, 4, out=out)
        assert out.eq(7).all()


def test_gather_kernel_refuses_wrong_types_and_lengths():
    table = torch.zeros(2, 4, dtype=torch.int32, device=DEV)
    n = torch.zeros(2, dtype=torch.int32, device=DEV)
    with pytest.raises(TypeError, match="block_table must be int32"):
        gather_block_tables(table.long(), n, [0])
    with pytest.raises(TypeError, match="idx_mapping must hold int32 or int64"):
        gather_block_tables(table, n, torch.tensor([0.0]))
    with pytest.raises(ValueError, match=r"num_blocks\[1\] = 5 is not a row length"):
        gather_block_tables(table, torch.tensor([0, 5], dtype=torch.int32, device=DEV), [1])
    with pytest.raises(ValueError, match="num_reqs_padded must be >= 2, got 1"):
        gather_block_tables(table, n, [0, 1], 1)
    with pytest.raises(TypeError, match="num_reqs_padded must be an int"):
        gather_block_tables(table, n, [0], True)


# ------------------------------------------------------------ RequestState

def test_rows_are_popped_from_the_tail_and_kept_for_life():
    rs = RequestState(4)
    assert [rs.add_request(r) for r in "abc"] == [3, 2, 1]  # vLLM pops the last free row
    assert rs.remove_request("b") == 2 and rs.remove_request("b") is None
    assert rs.add_request("d") == 2  # the freed row is the next one handed out
    assert rs.req_id_to_index == {"a": 3, "c": 1, "d": 2} and rs.free_indices == [0]
    assert rs.idx_mapping(["d", "a"]) == [2, 3]
    rs.check()


def test_request_state_refusals_change_nothing():
    rs = RequestState(2)
    rs.add_request("a")
    before = (dict(rs.req_id_to_index), list(rs.free_indices))
    with pytest.raises(ValueError, match="'a' already holds row 1"):
        rs.add_request("a")
    with pytest.raises(TypeError, match="req_id must be a str"):
        rs.add_request(3)
    rs.add_request("b")
    with pytest.raises(ValueError, match="no free row for request 'c': all 2 rows are held"):
        rs.add_request("c")
    with pytest.raises(ValueError, match="'zz' holds no row"):
        rs.idx_mapping(["a", "zz"])
    assert rs.req_id_to_index == {"a": 1, "b": 0} and before[0] == {"a": 1}
    rs.check()


def test_check_catches_a_row_handed_out_twice():
    rs = RequestState(3)
    rs.add_request("a")
    rs.free_indices.append(2)  # row 2 is held by "a" and free: the next arrival would share it
    with pytest.raises(InvariantError, match="a row is never handed out twice"):
        rs.check()
    rs = RequestState(3)
    rs.free_indices.append(0)
    with pytest.raises(InvariantError, match="row 0 is in the free pool twice"):
        rs.check()
    rs = RequestState(3)
    rs.free_indices.pop()
    with pytest.raises(InvariantError, match="held and free rows are all the rows"):
        rs.check()


# ------------------------------------------------------------ StagedWriteTensor

def test_staged_writes_copy_only_the_changed_entries():
    t = StagedWriteTensor((64, 128), torch.int32, DEV)
    t.stage_write(5, 0, [1, 2, 3])
    t.stage_write(9, 10, [7])
    t.stage_write(5, 2, [30, 40])  # cell (5, 2) written twice: sent once, with its last value
    assert t.num_staged_writes == 3 and not t.gpu.any()  # nothing on the device yet
    assert t.apply_write() == 5 and t.num_copied_elements == 5  # of 8,192 cells
    assert t.gpu[5, :5].tolist() == [1, 2, 30, 40, 0] and int(t.gpu[9, 10]) == 7
    assert int(t.gpu.count_nonzero()) == 5 and t.apply_write() == 0
    t.check()
    one = StagedWriteTensor(8, torch.int64, DEV)
    one.stage_write_elem(3, 2**40)
    one.apply_write()
    assert one.gpu.tolist() == [0, 0, 0, 2**40, 0, 0, 0, 0]


def test_staged_write_refusals_stage_nothing():
    t = StagedWriteTensor((4, 4), torch.int32, DEV)
    for args, err, msg in [((4, 0, [1]), ValueError, "index 4 is not a row"),
                           ((0, 3, [1, 2]), ValueError, "reaches column 4, past the row's 4 columns"),
                           ((0, 0, [2**31]), ValueError, "2147483648 does not fit torch.int32"),
                           ((0, 0, [1.5]), TypeError, "must be ints"),
                           ((True, 0, [1]), TypeError, "index must be an int"),
                           ((0, -1, [1]), ValueError, "start must be >= 0")]:
        with pytest.raises(err, match=msg):
            t.stage_write(*args)
    assert t.num_staged_writes == 0 and not t.cpu.any()
    with pytest.raises(ValueError, match="dtype must be one of"):
        StagedWriteTensor(4, torch.int8)


def test_check_catches_a_device_copy_that_missed_a_write():
    t = StagedWriteTensor((2, 3), torch.int32, DEV)
    t.stage_write(1, 0, [4, 5])
    t.apply_write()
    t.gpu[1, 1] = 9  # as if only part of the copy had landed
    with pytest.raises(InvariantError, match=r"the device holds the applied writes.*\[1, 1\]"):
        t.check()


# ------------------------------------------------------------ BlockTables against an oracle

class Oracle:
    """Rows and block lists in plain Python."""

    def __init__(self, groups):
        self.groups = groups
        self.blocks: dict[int, list[list[int]]] = {}

    def table(self, idx, width, g):
        return [(self.blocks[r][g] + [0] * width)[:width] for r in idx]


def random_run(seed, bt: BlockTables, vllm=None, steps=12):
    """Arrivals, departures, appends and steps, checked after each, against the oracle (and vLLM)."""
    rng = random.Random(seed)
    rs = bt.req_states
    oracle = Oracle(bt.num_kv_cache_groups)
    widths = [t.gpu.shape[1] for t in bt.block_tables]
    next_id, next_block = 0, 1
    for _ in range(steps):
        for rid in [r for r in rs.req_id_to_index if rng.random() < 0.25]:  # finished or preempted
            row = rs.remove_request(rid)
            del oracle.blocks[row]
            if vllm:
                assert vllm.req_states.remove_request(rid) == row
        while rs.free_indices and rng.random() < 0.6:  # arrivals, blocks from column 0
            rid = f"r{next_id}"
            next_id += 1
            row = rs.add_request(rid)
            ids = tuple(list(range(next_block, next_block + rng.randint(0, w // 2))) for w in widths)
            next_block += 50
            bt.append_block_ids(row, ids, overwrite=True)
            oracle.blocks[row] = [list(x) for x in ids]
            if vllm:
                vllm.add(rid, row, ids)
        for rid, row in rs.req_id_to_index.items():  # running requests grow at their tails
            if rng.random() < 0.5:
                room = [w - len(oracle.blocks[row][g]) for g, w in enumerate(widths)]
                ids = tuple(list(range(next_block, next_block + rng.randint(0, min(r, 2)))) for r in room)
                next_block += 10
                bt.append_block_ids(row, ids, overwrite=False)
                for g, x in enumerate(ids):
                    oracle.blocks[row][g] += x
                if vllm:
                    vllm.tables.append_block_ids(row, ids, overwrite=False)
        bt.apply_staged_writes()
        bt.check()
        if vllm:
            vllm.tables.apply_staged_writes()
        # a step: some held rows, in any order; the tokens of each lie in its blocks
        held = list(rs.req_id_to_index.values())
        idx = rng.sample(held, rng.randint(0, len(held)))
        padded = min(len(idx) + rng.randint(0, 2), bt.max_num_reqs)
        gathered = bt.gather_block_tables(idx, padded)
        for g in range(bt.num_kv_cache_groups):
            assert gathered[g][: len(idx)].tolist() == oracle.table(idx, widths[g], g)
            assert not gathered[g][len(idx):].any()
        spans = []
        for r in idx:
            cap = min(len(oracle.blocks[r][g]) * bt.block_sizes[g] for g in range(bt.num_kv_cache_groups))
            start = rng.randint(0, cap)
            spans.append((start, rng.randint(start, min(cap, start + 5))))
        qsl = np.cumsum([0] + [e - s for s, e in spans])
        pos = [p for s, e in spans for p in range(s, e)]
        slots = bt.compute_slot_mappings(idx, qsl, pos)
        for g, b in enumerate(bt.block_sizes):
            batch = np.repeat(np.arange(len(idx)), np.diff(qsl)).tolist()
            want = [oracle.blocks[idx[i]][g][p // b] * b + p % b for i, p in zip(batch, pos)]
            assert slots[g].tolist() == want
        if vllm:
            vllm.compare(idx, padded, gathered, qsl, pos, slots, oracle)


@pytest.mark.parametrize("seed", range(6))
def test_random_runs_match_the_oracle_and_keep_every_invariant(seed):
    groups = [([16], [8]), ([4, 16], [12, 3])][seed % 2]
    bt = BlockTables(RequestState(5), *groups, device=DEV)
    random_run(seed, bt)


# ------------------------------------------------------------ bad input changes nothing

def snapshot(bt: BlockTables):
    rs = bt.req_states
    return (dict(rs.req_id_to_index), list(rs.free_indices), bt.num_blocks.copy(),
            [t.cpu.clone() for t in bt.block_tables], [t.gpu.cpu().clone() for t in bt.block_tables],
            [t.cpu().clone() for t in bt.input_block_tables], [t.num_staged_writes for t in bt.block_tables],
            bt.num_blocks_gpu.cpu().clone())


def same(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else
               (np.array_equal(x, y) if isinstance(x, np.ndarray) else
                (all(torch.equal(p, q) for p, q in zip(x, y)) if x and isinstance(x, list)
                 and isinstance(x[0], torch.Tensor) else x == y))
               for x, y in zip(a, b))


@pytest.fixture
def tables():
    rs = RequestState(4)
    bt = BlockTables(rs, [16], [4], device=DEV)
    for rid, ids in (("a", [1, 2]), ("b", [3])):
        bt.append_block_ids(rs.add_request(rid), (ids,), overwrite=True)
    bt.apply_staged_writes()
    bt.gather_block_tables([3, 2])  # a: row 3, b: row 2; rows 0 and 1 are free
    return bt


@pytest.mark.parametrize("idx, message", [
    ([3, 1], r"idx_mapping\[1\] = row 1 is a free row"),
    ([3, 4], r"idx_mapping\[1\] = row 4 is out of range: the table has rows 0..3"),
    ([-1], r"idx_mapping\[0\] = row -1 is out of range"),
    ([2, 3, 2], r"row 2 appears twice in idx_mapping \(entries 0 and 2\)"),
])
def test_gather_refuses_a_free_an_out_of_range_or_a_repeated_row(tables, idx, message):
    before = snapshot(tables)
    with pytest.raises(ValueError, match=message):
        tables.gather_block_tables(idx)
    assert same(snapshot(tables), before)
    tables.check()


def test_a_row_freed_this_step_cannot_be_gathered(tables):
    tables.req_states.remove_request("b")
    before = snapshot(tables)
    with pytest.raises(ValueError, match=r"idx_mapping\[1\] = row 2 is a free row"):
        tables.gather_block_tables([3, 2])
    assert same(snapshot(tables), before)


def test_other_refusals_change_nothing(tables):
    before = snapshot(tables)
    cases = [
        (lambda: tables.append_block_ids(0, ([5],), True), ValueError, "req_index 0 is a free row"),
        (lambda: tables.append_block_ids(9, ([5],), True), ValueError, "req_index 9 is out of range"),
        (lambda: tables.append_block_ids(3, ([5, 6, 7],), False), ValueError,
         "row 3 of group 0 would hold 5 blocks, past its width 4"),
        (lambda: tables.append_block_ids(3, ([5], [6]), False), ValueError, "one list per KV-cache group"),
        (lambda: tables.append_block_ids(3, ([-5],), False), ValueError, "block id -5"),
        (lambda: tables.append_block_ids(3, ([5],), 1), TypeError, "overwrite must be True or False"),
        (lambda: tables.gather_block_tables([3], 5), ValueError, "num_reqs_padded must be <= max_num_reqs = 4"),
        (lambda: tables.compute_slot_mappings([2, 3], [0, 1, 2], [0, 0]), ValueError,
         "not the one last gathered"),
        (lambda: tables.compute_slot_mappings([3, 2], [0, 1, 2], [0, 16]), ValueError,
         r"positions\[1\] = 16 is outside row 2's 1 blocks of 16 tokens"),
        (lambda: tables.compute_slot_mappings([3, 2], [0, 2], [0, 1]), ValueError,
         "query_start_loc must rise from 0"),
    ]
    for call, err, msg in cases:
        with pytest.raises(err, match=msg):
            call()
        assert same(snapshot(tables), before), msg
    tables.append_block_ids(3, ([5],), False)  # staged, not applied: the gather would read stale rows
    with pytest.raises(RuntimeError, match="apply_staged_writes"):
        tables.gather_block_tables([3])


def test_check_catches_a_stale_device_row_length(tables):
    tables.num_blocks_gpu[0, 3] = 1  # the device thinks row 3 holds one block, the host two
    with pytest.raises(InvariantError, match="the device row lengths are the host's"):
        tables.check()


def test_no_row_moves_when_a_request_leaves(tables):
    """The V1 runner would move the last row into the hole; under V2 the survivors keep theirs."""
    rs = tables.req_states
    c = rs.add_request("c")
    tables.append_block_ids(c, ([9],), True)
    tables.apply_staged_writes()
    rs.remove_request("b")  # row 2 becomes free
    assert rs.req_id_to_index == {"a": 3, "c": 1} and tables.block_ids(1) == ([9],)
    assert tables.gather_block_tables(rs.idx_mapping(["c", "a"]))[0].tolist() == [[9, 0, 0, 0], [1, 2, 0, 0]]


# ------------------------------------------------------------ against vLLM 0.33.0's own code

def load_vllm_worker_modules(wheel, monkeypatch) -> dict[str, types.ModuleType]:
    """vLLM 0.33.0's ``v1/worker/gpu/{buffer_utils,states,block_table}.py``, executed from the wheel.

    Their vLLM imports are stubbed: Triton itself for ``vllm.triton_utils``,
    no UVA (so buffers take vLLM's explicit-copy path), a plain logger,
    ``PAD_SLOT_ID = -1``. Nothing is installed; ``monkeypatch`` takes the
    modules out of ``sys.modules`` again when the test ends.
    """
    for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, k)

    class Logger(logging.Logger):
        def warning_once(self, *args, **kwargs):
            pass

    def stub(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        m.__path__ = []
        monkeypatch.setitem(sys.modules, name, m)

    for name in ("vllm", "vllm.utils", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends",
                 "vllm.v1.worker", "vllm.v1.worker.gpu"):
        stub(name)
    stub("vllm.triton_utils", tl=tl, triton=triton)
    stub("vllm.logger", init_logger=Logger)
    stub("vllm.utils.platform_utils", is_uva_available=lambda: False)
    stub("vllm.utils.torch_utils", get_accelerator_view_from_cpu_tensor=None,
         async_tensor_h2d=lambda data, dtype, device, **_: torch.tensor(data, dtype=dtype, device=device))
    stub("vllm.platforms", current_platform=types.SimpleNamespace(device_type=DEV.type))
    stub("vllm.v1.attention.backends.utils", PAD_SLOT_ID=-1)
    loaded = {}
    with zipfile.ZipFile(wheel) as z:
        for short in ("buffer_utils", "states", "block_table"):
            name = f"vllm.v1.worker.gpu.{short}"
            m = types.ModuleType(name)
            m.__file__ = f"vllm-0.33.0/vllm/v1/worker/gpu/{short}.py"
            monkeypatch.setitem(sys.modules, name, m)
            exec(compile(z.read(f"vllm/v1/worker/gpu/{short}.py"), m.__file__, "exec"), m.__dict__)
            loaded[short] = m
    return loaded


class VllmWorker:
    """vLLM's RequestState and BlockTables, driven as its model runner drives them."""

    def __init__(self, modules, bt: BlockTables):
        n = bt.max_num_reqs
        widths = [t.gpu.shape[1] for t in bt.block_tables]
        self.req_states = modules["states"].RequestState(n, 4096, 256, 0, 100, DEV)
        self.tables = modules["block_table"].BlockTables(bt.block_sizes, n, 256, widths, DEV)

    def add(self, rid, row, ids):
        self.req_states.add_request(rid, 1, [0], 0, 8)
        assert self.req_states.req_id_to_index[rid] == row  # the same row, from the same free pool
        self.tables.append_block_ids(row, ids, overwrite=True)

    def compare(self, idx, padded, gathered, qsl, pos, slots, oracle):
        theirs = self.tables.gather_block_tables(torch.tensor(idx, dtype=torch.int64, device=DEV), padded)
        for g, (ours, their) in enumerate(zip(gathered, theirs)):
            assert their.shape == ours.shape
            for i, r in enumerate(idx):  # vLLM leaves the columns past a row's blocks as they were
                n = len(oracle.blocks[r][g])
                assert their[i, :n].tolist() == ours[i, :n].tolist()
            assert not their[len(idx):].any()  # padding rows: zeros in both
        their_slots = self.tables.compute_slot_mappings(
            torch.tensor(idx, dtype=torch.int64, device=DEV), torch.tensor(qsl, dtype=torch.int32, device=DEV),
            torch.tensor(pos, dtype=torch.int64, device=DEV), len(pos))
        assert torch.equal(their_slots, slots)


@pytest.mark.parametrize("seed", range(4))
def test_vllm_0_33_0_gives_the_same_rows_tables_and_slots(seed, monkeypatch):
    modules = load_vllm_worker_modules(vllm_wheel(), monkeypatch)
    groups = [([16], [8]), ([4, 16], [12, 3])][seed % 2]  # two groups take vLLM's fused writer
    bt = BlockTables(RequestState(5), *groups, device=DEV)
    random_run(100 + seed, bt, VllmWorker(modules, bt), steps=8)
