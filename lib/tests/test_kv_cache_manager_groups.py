"""KVCacheManager's answers per KV-cache group, the grouped manager over a coordinator, per-group tables.

- ``KVCacheBlocks``: one block list per group (vLLM's shape); with one group
  it still reads as that group's list, as chapters 3-6 use it.
- ``GroupedKVCacheManager``: the manager over a coordinator, for a full-attention
  group beside a sliding-window group; a window's old blocks go back to the
  pool while the request runs and its table holds the null block there.
- ``BlockTables`` and the worker: one table per group, and an edit of one
  group's row never changes another group's.
- Bad input: refused with ``ValueError`` naming the problem, nothing changed.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from pagedkv.block_tables import BlockTables
from pagedkv.engine.sizing import kv_cache_groups_of
from pagedkv.grouped_kv_cache_manager import GroupedKVCacheManager, get_kv_cache_manager
from pagedkv.kv_cache_coordinator import HybridKVCacheCoordinator, KVCacheBlocks, UnitaryKVCacheCoordinator
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec, layer_specs_from_types
from pagedkv.request import Request
from pagedkv.request_state import RequestState

FA = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8)
SW = SlidingWindowSpec(block_size=4, num_kv_heads=2, head_size=8, sliding_window=6)


def hybrid(num_blocks=40, **kw) -> GroupedKVCacheManager:
    return get_kv_cache_manager([KVCacheGroupSpec(["full"], FA), KVCacheGroupSpec(["sliding"], SW)],
                                num_blocks, 64, **kw)


def run_prompt(m, rid, prompt, hash_block_size=4):
    r = Request(rid, prompt, max_tokens=20, hash_block_size=hash_block_size)
    hit, n = m.get_computed_blocks(r)
    new = m.allocate_slots(r, len(prompt) - n, n, hit)
    r.num_computed_tokens = len(prompt)
    m.check()
    return r, hit, n, new


def decode(m, r, steps):
    for _ in range(steps):
        r.append_output_token_ids(7)
        assert m.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
        m.check()


# ------------------------------------------------------------------ KVCacheBlocks
def test_one_group_blocks_read_as_a_list_and_give_vllms_per_group_ids():
    m = KVCacheManager(16, 4)
    r, hit, n, new = run_prompt(m, "a", list(range(10)))
    assert isinstance(new, KVCacheBlocks) and isinstance(hit, KVCacheBlocks)
    assert new.get_block_ids() == ([1, 2, 3],) and m.get_blocks("a").get_block_ids() == ([1, 2, 3],)
    assert [b.block_id for b in new] == [1, 2, 3] and len(new) == 3 and new[0].block_id == 1
    assert new == m.req_to_blocks["a"] and not hit and hit == []
    assert m.get_block_ids("a") == [1, 2, 3]  # the book's one-list accessor
    blocks = m.get_blocks("a")
    blocks.blocks[0].clear()  # a copy: the table is untouched
    assert m.get_block_ids("a") == [1, 2, 3]
    with pytest.raises(KeyError, match="holds no blocks"):
        m.get_blocks("nobody")


def test_blocks_of_several_groups_refuse_to_pose_as_one_list():
    m = hybrid()
    r, hit, n, new = run_prompt(m, "a", list(range(10)))
    assert new.get_block_ids() == ([1, 2, 3], [4, 5, 6])
    assert m.get_block_ids("a") == ([1, 2, 3], [4, 5, 6])
    for use in (len, list, lambda b: b[0]):
        with pytest.raises(TypeError, match="2 KV-cache groups"):
            use(new)
    assert (new + new.new_empty()).get_block_ids() == new.get_block_ids()


def test_the_factory_picks_the_folded_manager_for_one_full_attention_group_only():
    assert type(get_kv_cache_manager([KVCacheGroupSpec(["f"], FA)], 16, 64)) is KVCacheManager
    alone = get_kv_cache_manager([KVCacheGroupSpec(["s"], SW)], 16, 64)
    assert isinstance(alone.coordinator, UnitaryKVCacheCoordinator)
    assert isinstance(hybrid().coordinator, HybridKVCacheCoordinator)


# ------------------------------------------------------------------ the grouped manager
def test_a_window_returns_its_old_blocks_while_the_request_runs():
    m = hybrid()
    r, _, _, _ = run_prompt(m, "a", list(range(20)))
    free = m.get_num_free_blocks()
    assert m.get_block_ids("a") == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    decode(m, r, 1)  # 20 computed, window 6: tokens 0..14 are skipped, blocks 0..2 of the window group
    full, sliding = m.get_block_ids("a")
    assert full == [1, 2, 3, 4, 5, 11] and sliding == [0, 0, 0, 9, 10, 12]
    assert m.get_num_free_blocks() == free - 2 + 3  # two new blocks, three returned
    decode(m, r, 4)
    assert m.get_block_ids("a")[1][:4] == [0, 0, 0, 0]
    m.free(r)
    m.check()
    assert m.get_num_free_blocks() == 39


def test_a_hybrid_hit_is_one_length_every_group_accepts():
    m = hybrid()
    a, _, _, _ = run_prompt(m, "a", list(range(20)))
    b, hit, n, _ = run_prompt(m, "b", list(range(20)) + [99, 98])
    assert n == 20  # five full blocks in both groups
    full, sliding = hit.get_block_ids()
    assert full == [1, 2, 3, 4, 5] and sliding == [0, 0, 0, 9, 10]  # the window needs only its last two
    assert m.get_block_ids("b")[1][:5] == [0, 0, 0, 9, 10]


def test_allocation_that_does_not_fit_returns_none_and_the_watermark_holds_back_admissions():
    m = hybrid(num_blocks=12, watermark=0.2)  # 11 usable, watermark 2
    a, _, _, _ = run_prompt(m, "a", list(range(12)))  # 3 + 3 blocks
    r = Request("b", list(range(50, 66)), hash_block_size=4)
    before = snapshot(m)
    assert m.allocate_slots(r, 16) is None  # needs 8, 5 free
    assert snapshot(m) == before
    r2 = Request("c", list(range(50, 58)), hash_block_size=4)
    assert m.allocate_slots(r2, 8) is None  # needs 4 of 5 free, but the watermark keeps 2
    assert m.allocate_slots(r2, 8, has_scheduled_reqs=False) is not None


def snapshot(m):
    c = m.coordinator
    return (copy.deepcopy([m_.req_to_blocks and {r: [b.block_id for b in bs] for r, bs in m_.req_to_blocks.items()}
                           for m_ in c.single_type_managers]),
            [dict(m_.num_cached_block) for m_ in c.single_type_managers],
            [b.block_id for b in c.block_pool.free_block_queue.get_all_free_blocks()],
            [(b.ref_cnt, b.block_hash) for b in c.block_pool.blocks], sorted(m._holders))


@pytest.mark.parametrize("call, exc, match", [
    (lambda m, r: m.allocate_slots(r, 0), ValueError, "num_new_tokens"),
    (lambda m, r: m.allocate_slots(r, 40), ValueError, "cannot compute"),
    (lambda m, r: m.allocate_slots(r, 1, 4, [object()]), ValueError, "one list per group"),
    (lambda m, r: m.allocate_slots(r, 1, 4, KVCacheBlocks(([],))), ValueError, "one list per group"),
    (lambda m, r: m.allocate_slots(r, 1, has_scheduled_reqs=1), TypeError, "has_scheduled_reqs"),
    (lambda m, r: m.allocate_slots(Request("a", [1, 2, 3], hash_block_size=4), 1), ValueError, "another live"),
    (lambda m, r: m.get_computed_blocks(r), ValueError, "already holds blocks"),
    (lambda m, r: m.cache_blocks(Request("zz", [1], hash_block_size=4), 1), KeyError, "holds no blocks"),
    (lambda m, r: m.acknowledge_copies([(1, 2)]), ValueError, "not an outstanding copy"),
])
def test_bad_calls_are_refused_and_change_nothing(call, exc, match):
    m = hybrid()
    r, _, _, _ = run_prompt(m, "a", list(range(20)))
    r.append_output_token_ids(5)
    before = snapshot(m)
    with pytest.raises(exc, match=match):
        call(m, r)
    assert snapshot(m) == before
    m.check()


# ------------------------------------------------------------------ per-group tables
def test_a_table_edit_on_one_group_never_changes_another():
    states = RequestState(4)
    tables = BlockTables(states, [4, 4], [6, 6], device="cpu", sliding_window_reach=[0, 5])
    row = states.add_request("a")
    tables.append_block_ids(row, ([1, 2, 3], [4, 5, 6]), overwrite=True)
    tables.apply_staged_writes()
    group0 = tables.block_tables[0].gpu.clone(), tables.num_blocks[0].copy()
    tables.append_block_ids(row, ([], [7, 8]), overwrite=False)  # group 1 only
    tables.apply_staged_writes()
    assert torch.equal(tables.block_tables[0].gpu, group0[0]) and np.array_equal(tables.num_blocks[0], group0[1])
    assert tables.block_ids(row) == ([1, 2, 3], [4, 5, 6, 7, 8])
    tables.append_block_ids(row, ([9], [10]), overwrite=True)  # a rewrite from column 0: each group its own
    tables.apply_staged_writes()
    assert tables.block_ids(row) == ([9], [10])
    tables.check()


def test_the_gather_nulls_a_window_groups_entries_below_the_window_only():
    states = RequestState(4)
    tables = BlockTables(states, [4, 4], [6, 6], device="cpu", sliding_window_reach=[0, 5])
    a, b = states.add_request("a"), states.add_request("b")
    tables.append_block_ids(a, ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]), overwrite=True)
    tables.append_block_ids(b, ([11, 12], [13, 14]), overwrite=True)
    tables.apply_staged_writes()
    gathered = tables.gather_block_tables([a, b], reference=True)
    tables.null_below_window(gathered, [18, 5])  # a: (18 - 5) // 4 = 3 entries; b: none
    assert gathered[0].tolist() == [[1, 2, 3, 4, 5, 0], [11, 12, 0, 0, 0, 0]]  # full attention untouched
    assert gathered[1].tolist() == [[0, 0, 0, 9, 10, 0], [13, 14, 0, 0, 0, 0]]
    assert tables.block_ids(a) == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])  # the rows themselves keep their ids
    with pytest.raises(ValueError, match="one entry per group"):
        BlockTables(states, [4, 4], [6, 6], device="cpu", sliding_window_reach=[0])


# ------------------------------------------------------------------ layers that cannot be grouped
class StubModel:
    """What ``kv_cache_groups_of`` reads of a model: its per-layer specs."""

    def __init__(self, layer_types, window=None, heads=None):
        self.layer_types, self.window, self.heads = layer_types, window, heads

    def kv_cache_spec(self, block_size, max_model_len):
        specs = layer_specs_from_types(self.layer_types, block_size=block_size, num_kv_heads=2, head_size=8,
                                       max_model_len=max_model_len, sliding_window=self.window)
        if self.heads:  # one layer with other shapes: its page size differs
            name = next(iter(specs))
            specs[name] = FullAttentionSpec(block_size=block_size, num_kv_heads=self.heads, head_size=8)
        return specs


@pytest.mark.parametrize("model, match", [
    (StubModel(["full_attention", "mamba"]), r"layer model\.layers\.1\.self_attn: unknown layer type 'mamba'"),
    (StubModel(["sliding_attention", "full_attention"], window=128),
     r"layer model\.layers\.0\.self_attn: sliding_window=128 is larger than max_model_len=64"),
    (StubModel(["sliding_attention", "full_attention"]), r"layer model\.layers\.0\.self_attn: .*needs sliding_window"),
    (StubModel(["full_attention", "sliding_attention"], window=8, heads=1),
     r"layer model\.layers\.0\.self_attn: its page size differs"),
])
def test_layers_that_cannot_be_grouped_are_refused_naming_the_layer(model, match):
    before = copy.deepcopy(model.__dict__)
    with pytest.raises(ValueError, match=match):
        kv_cache_groups_of(model, 4, 64)
    assert model.__dict__ == before


def test_plain_llama_layers_give_no_groups_and_mixed_ones_give_one_group_per_kind():
    assert kv_cache_groups_of(StubModel(["full_attention"] * 3), 4, 64) is None
    groups = kv_cache_groups_of(StubModel(["sliding_attention", "full_attention"], window=8), 4, 64)
    assert [type(g.kv_cache_spec).__name__ for g in groups] == ["SlidingWindowSpec", "FullAttentionSpec"]
