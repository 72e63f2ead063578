"""BlockTable against the scheduler's view: a plain list of block ids per row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import pagedkv
from pagedkv.block_table import BlockTable
from pagedkv.common import InvariantError

ROWS, WIDTH, BLOCK_SIZE = 4, 6, 4


def snapshot(bt: BlockTable):
    return bt.np.copy(), bt.num_blocks_per_row.copy(), bt.tensor.cpu().clone(), bt._committed_num_blocks.copy()


def assert_unchanged(bt: BlockTable, snap) -> None:
    np_, n, dev, committed = snap
    assert np.array_equal(bt.np, np_)
    assert np.array_equal(bt.num_blocks_per_row, n)
    assert torch.equal(bt.tensor.cpu(), dev)
    assert np.array_equal(bt._committed_num_blocks, committed)


class BlockTableMachine(RuleBasedStateMachine):
    """Random append/add/clear/move/swap/commit sequences; the oracle is a list of lists."""

    def __init__(self):
        super().__init__()
        self.bt = BlockTable(ROWS, WIDTH, device=pagedkv.default_device())
        self.rows: list[list[int]] = [[] for _ in range(ROWS)]
        self.committed: list[list[int]] = [[] for _ in range(ROWS)]  # what the device holds

    row = st.integers(0, ROWS - 1)
    ids = st.lists(st.integers(0, 999), max_size=WIDTH)

    @rule(r=row, ids=ids)
    def append(self, r, ids):
        if len(self.rows[r]) + len(ids) > WIDTH:
            snap = snapshot(self.bt)
            with pytest.raises(ValueError, match=f"row {r} holds {len(self.rows[r])} blocks"):
                self.bt.append_row(ids, r)
            assert_unchanged(self.bt, snap)
            return
        before = list(self.rows[r])
        self.bt.append_row(ids, r)
        self.rows[r] += ids
        assert self.bt.row(r)[: len(before)] == before  # append-only: nothing already there moved

    @rule(r=row, ids=ids)
    def add(self, r, ids):
        self.bt.add_row(ids, r)
        self.rows[r] = list(ids)

    @rule(r=row)
    def clear(self, r):
        self.bt.clear_row(r)
        self.rows[r] = []

    @rule(src=row, tgt=row)
    def move(self, src, tgt):
        if src == tgt:
            snap = snapshot(self.bt)
            with pytest.raises(ValueError, match=f"src = tgt = {src}"):
                self.bt.move_row(src, tgt)
            assert_unchanged(self.bt, snap)
            return
        self.bt.move_row(src, tgt)
        self.rows[tgt], self.rows[src] = list(self.rows[src]), []  # the vacated row is cleared

    @rule(a=row, b=row)
    def swap(self, a, b):
        self.bt.swap_row(a, b)
        self.rows[a], self.rows[b] = self.rows[b], self.rows[a]

    @rule(n=st.integers(0, ROWS))
    def commit(self, n):
        self.bt.commit(n)
        for r in range(n):
            self.committed[r] = list(self.rows[r])

    @precondition(lambda self: any(self.committed))
    @rule(data=st.data())
    def slot_mapping(self, data):
        live = [r for r in range(ROWS) if self.committed[r]]
        tokens = data.draw(
            st.lists(
                st.one_of(
                    st.just((-1, 0)),
                    st.sampled_from(live).flatmap(
                        lambda r: st.tuples(st.just(r), st.integers(0, len(self.committed[r]) * BLOCK_SIZE - 1))
                    ),
                ),
                min_size=1,
                max_size=8,
            )
        )
        reqs, pos = [t[0] for t in tokens], [t[1] for t in tokens]
        want = [
            -1 if r < 0 else self.committed[r][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for r, p in tokens
        ]
        assert self.bt.compute_slot_mapping(reqs, pos, BLOCK_SIZE).cpu().tolist() == want

    @invariant()
    def matches_oracle(self):
        self.bt.check()
        for r in range(ROWS):
            assert self.bt.row(r) == self.rows[r]
            assert int(self.bt.num_blocks_per_row[r]) == len(self.rows[r])
        dev = self.bt.tensor.cpu()
        for r in range(ROWS):
            n = len(self.committed[r])
            assert dev[r, :n].tolist() == self.committed[r]


BlockTableMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockTableMachine = BlockTableMachine.TestCase


def test_worked_example_row_3_column_256():
    bt = BlockTable(8, 2048, device=pagedkv.default_device())
    bt.add_row(list(range(100, 356)), 3)  # 4,096 committed tokens: 256 full blocks
    bt.append_row([1913], 3)  # the 4,097th token needs one new block
    assert int(bt.num_blocks_per_row[3]) == 257 and int(bt.np[3, 256]) == 1913
    assert bt.row(3)[:256] == list(range(100, 356))  # nothing else in the row moved
    bt.commit(4)
    assert bt.compute_slot_mapping([3], [4096], 16).cpu().tolist() == [30608]


def test_metadata_bytes_at_256_requests_and_a_32k_window():
    bt = BlockTable(256, 32768 // 16, device="cpu")
    assert bt.metadata_bytes == 256 * 2048 * 4 == 2 * 2**20
    assert bt.metadata_bytes == bt.tensor.numel() * bt.tensor.element_size()


def test_commit_publishes_only_the_committed_rows():
    bt = BlockTable(3, 4, device=pagedkv.default_device())
    bt.add_row([5, 6], 0)
    bt.add_row([7], 1)
    assert bt.tensor.cpu().abs().sum() == 0  # staged only
    bt.commit(1)
    assert bt.tensor.cpu()[0, :2].tolist() == [5, 6]
    assert bt.tensor.cpu()[1].tolist() == [0, 0, 0, 0]
    assert bt.get_device_tensor(1).shape == (1, 4)


def test_uncommitted_blocks_are_refused_before_the_kernel():
    bt = BlockTable(2, 4, device=pagedkv.default_device())
    bt.add_row([9], 0)
    bt.commit(1)
    bt.append_row([10], 0)  # staged, not committed
    with pytest.raises(IndexError, match="positions\\[0\\] = 4 is beyond row 0's 1 committed blocks"):
        bt.compute_slot_mapping([0], [4], 4)
    bt.commit(1)
    assert bt.compute_slot_mapping([0], [4], 4).cpu().tolist() == [40]


def test_move_row_zeroes_the_stale_tail_and_clears_the_vacated_row():
    bt = BlockTable(3, 4, device="cpu")
    bt.add_row([1, 2, 3], 0)
    bt.add_row([4], 1)
    bt.add_row([5, 6], 2)
    bt.move_row(1, 0)
    assert bt.np[0].tolist() == [4, 0, 0, 0]
    assert bt.np[1].tolist() == [0, 0, 0, 0] and bt.num_blocks_per_row[1] == 0  # as vLLM 0.33.0 does
    bt.move_row(2, 1)
    assert bt.row(1) == [5, 6] and bt.row(2) == [] and bt.np[2].tolist() == [0, 0, 0, 0]
    assert bt.num_blocks_per_row.tolist() == [1, 2, 0]
    bt.check()


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda bt: bt.append_row([1, 2, 3, 4], 0), ValueError, "row 0 holds 2 blocks; appending 4 would make 6"),
        (lambda bt: bt.append_row([1], 4), IndexError, "row_idx 4 is not a row"),
        (lambda bt: bt.append_row([1], -1), IndexError, "row_idx -1"),
        (lambda bt: bt.append_row([1], True), TypeError, "row_idx must be an int"),
        (lambda bt: bt.append_row([-3], 1), ValueError, "block id -3"),
        (lambda bt: bt.append_row([1.5], 1), TypeError, "block_ids"),
        (lambda bt: bt.add_row([1, 2, 3, 4, 5], 1), ValueError, "5 blocks do not fit"),
        (lambda bt: bt.move_row(0, 9), IndexError, "tgt 9"),
        (lambda bt: bt.move_row(0, 0), ValueError, "move_row needs two different rows, got src = tgt = 0"),
        (lambda bt: bt.swap_row(7, 0), IndexError, "a 7"),
        (lambda bt: bt.clear_row(5), IndexError, "row_idx 5"),
        (lambda bt: bt.commit(5), ValueError, "num_reqs must be in 0..4, got 5"),
        (lambda bt: bt.compute_slot_mapping([0], [8], 4), IndexError, "positions\\[0\\] = 8 is beyond row 0's 2"),
        (lambda bt: bt.compute_slot_mapping([1], [0], 4), IndexError, "row 1's 0 committed blocks"),
        (lambda bt: bt.compute_slot_mapping([4], [0], 4), IndexError, "req_indices\\[0\\] = 4"),
        (lambda bt: bt.compute_slot_mapping([0], [0], 0), ValueError, "block_size must be >= 1, got 0"),
        (lambda bt: bt.compute_slot_mapping(torch.tensor([0], device="meta"), [0], 4), ValueError,
         "req_indices is on the meta device"),
    ],
)
def test_bad_input_raises_and_changes_nothing(call, exc, words):
    bt = BlockTable(4, 4, device=pagedkv.default_device())
    bt.add_row([11, 12], 0)
    bt.commit(1)
    snap = snapshot(bt)
    with pytest.raises(exc, match=words):
        call(bt)
    assert_unchanged(bt, snap)
    bt.check()


def test_constructor_rejects_nonsense():
    with pytest.raises(ValueError, match="max_num_reqs must be >= 1, got 0"):
        BlockTable(0, 4)
    with pytest.raises(ValueError, match="max_num_blocks_per_req must be >= 1, got -2"):
        BlockTable(2, -2)


def test_check_names_a_broken_invariant():
    bt = BlockTable(2, 3, device="cpu")
    bt.add_row([4, 5], 0)
    bt.np[0, 2] = 9  # a stale cell past the row's length
    with pytest.raises(InvariantError, match="invariant 'cells past a row's length are 0' broken: row 0 column 2 holds 9"):
        bt.check()
    bt.np[0, 2] = 0
    bt.np[0, 1] = -3
    with pytest.raises(InvariantError, match="invariant 'live block ids are >= 0' broken: row 0 column 1 holds -3"):
        bt.check()


@pytest.mark.parametrize("max_model_len,block_size,expected", [
    (192, 16, 16),        # 12 blocks, aligned to 8 blocks = 128 tokens
    (32_768, 16, 2_048),  # already a multiple of 128 tokens
    (100, 16, 8),
    (1_000, 48, 24),      # 21 blocks; 128 and 48 share 16, so steps of 8 blocks
    (257, 256, 2),        # blocks larger than the alignment: no rounding
])
def test_table_width_aligns_to_128_tokens_as_vllm(max_model_len, block_size, expected):
    from pagedkv.block_table import block_table_width
    assert block_table_width(max_model_len, block_size) == expected
    # The aligned row covers a multiple of 128 tokens, and never fewer blocks than needed.
    width = block_table_width(max_model_len, block_size)
    assert width * block_size % 128 == 0 or block_size % 128 == 0
    assert width >= block_table_width(max_model_len, block_size, token_alignment=None)
