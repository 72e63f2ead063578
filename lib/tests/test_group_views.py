"""The pool picture, the live pool view, the trace replay and PagedAttention's picture with KV-cache groups."""

from __future__ import annotations

import pytest

from pagedkv.kv_cache_coordinator import get_kv_cache_coordinator
from pagedkv.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from pagedkv.request import Request
from pagedkv.views import BlockPoolView, TraceRecorder, render_pool
from pagedkv.views.paged_layout import describe_layout, render_paged_layout
from pagedkv.views.pool_picture import (block_groups, coordinator_owners, describe_blocks, group_color,
                                        group_names)


def two_groups(window=8, sw_block_size=4):
    sw = SlidingWindowSpec(block_size=sw_block_size, num_kv_heads=2, head_size=8, sliding_window=window)
    fa = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8)
    return get_kv_cache_coordinator([KVCacheGroupSpec(["sw"], sw), KVCacheGroupSpec(["full"], fa)], 20,
                                    max_model_len=64, max_in_flight_tokens=4)


def decode(coord, req, steps):
    for t in range(steps):
        coord.remove_skipped_blocks(req.request_id, req.num_computed_tokens)
        req.append_output_token_ids(100 + t)
        coord.allocate_new_blocks(req.request_id, req.num_tokens)
        coord.cache_blocks(req, req.num_tokens)
        req.num_computed_tokens = req.num_tokens


def started():
    coord = two_groups()
    a = Request("A", list(range(10)), max_tokens=16, hash_block_size=4)
    coord.allocate_new_blocks("A", 10)
    coord.cache_blocks(a, 10)
    a.num_computed_tokens = 10
    return coord, a


def test_blocks_are_labelled_with_their_group_and_coloured_by_it():
    coord, a = started()
    assert block_groups(coord) == {1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1}
    assert coordinator_owners(coord) == {"A": [1, 2, 3, 4, 5, 6]}
    assert group_names(coord) == ["window 8", "full"]
    html = render_pool(coord.block_pool, coordinator_owners(coord), groups=coord)
    assert group_color(0) != group_color(1)
    assert html.count(f"fill='{group_color(0)}'") >= 3 + 1  # three blocks and the key
    assert "g0: window 8" in html and "g1: full" in html
    assert "in use by group 1 (A)" in html


def test_without_groups_the_picture_is_unchanged_and_a_mapping_works_too():
    coord, a = started()
    owners = coordinator_owners(coord)
    plain = render_pool(coord.block_pool, owners)
    assert plain == render_pool(coord.block_pool, owners, groups=None)
    assert "g0:" not in plain
    mapped = render_pool(coord.block_pool, owners, groups={1: 0, 4: 1}, names=["left", "right"])
    assert "g0: left" in mapped and mapped != plain


def test_a_window_block_returns_to_the_pool_and_the_picture_shows_it_free():
    coord, a = started()
    decode(coord, a, 6)  # 15 computed when the last step began: blocks 0, 1 of the window freed
    window, full = coord.get_block_ids("A")
    assert window[:2] == [0, 0] and 0 not in full
    cells = {c.block_id: c for c in describe_blocks(coord.block_pool)}
    assert cells[1].state == "cached" and cells[2].state == "cached"  # freed, hash kept, at the tail
    assert 1 not in block_groups(coord) and 2 not in block_groups(coord)


def test_the_live_view_and_the_replay_follow_the_window():
    coord, a = started()
    view = BlockPoolView(coord.block_pool, lambda: coordinator_owners(coord), groups=coord, min_interval=0)
    view.attach()
    rec = TraceRecorder(coord.block_pool, lambda: coordinator_owners(coord), groups=coord)
    rec.start("start")
    before = view.redraws
    decode(coord, a, 6)
    rec.stop()
    assert view.redraws > before
    frees = [f for f in rec.frames if f.caption.startswith("free_blocks")]
    assert [f.caption.split("]")[0] for f in frees] == ["free_blocks([1", "free_blocks([2"]
    assert all("g0: window 8" in f.html for f in rec.frames)
    assert "g0: window 8" in view.static_html()
    replay = rec.replay()._repr_html_()
    assert replay.count("pkv-frame") >= len(rec.frames)


def test_the_paged_layout_draws_a_row_per_request_and_group():
    coord, a = started()
    decode(coord, a, 6)
    layout = describe_layout(coord, [a])
    rows = {r.name: r.block_ids for r in layout.requests}
    assert rows == {"A g0": coord.get_block_ids("A")[0], "A g1": coord.get_block_ids("A")[1]}
    assert layout.block(0).state == "null"
    html = render_paged_layout(coord, [a])
    assert "A g0" in html and "A g1" in html and "2 group rows, blocks of 4 tokens" in html


def test_groups_of_different_block_sizes_are_refused_by_the_layout():
    coord = two_groups(sw_block_size=8)
    coord.allocate_new_blocks("A", 8)
    with pytest.raises(ValueError, match="block sizes differ"):
        describe_layout(coord)
