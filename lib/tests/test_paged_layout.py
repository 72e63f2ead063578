"""PagedAttention's picture: logical blocks, table entries, physical blocks, drawn from a live state."""

from __future__ import annotations

import importlib.util
import random
import re
import sys

import pytest

from pagedkv.block_pool import BlockPool
from pagedkv.block_table import BlockTable
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.request import Request
from pagedkv.views import COLORS, PagedLayoutView, describe_layout, owner_color, render_paged_layout
from pagedkv.views import paged_layout


def shared_prefix():
    """A and B share a 64-token prompt prefix (4 full blocks of 16); each has one block of its own."""
    rng = random.Random(0)
    prefix = [rng.randrange(32_000) for _ in range(64)]
    manager = KVCacheManager(num_blocks=64, block_size=16)
    a, b = Request("A", prefix + [101, 102, 103]), Request("B", prefix + [201, 202])
    for req in (a, b):
        hit, n = manager.get_computed_blocks(req)
        manager.allocate_slots(req, req.num_tokens - n, n, hit)
        req.num_computed_tokens = req.num_tokens
    return manager, a, b


def test_describe_layout_maps_logical_blocks_to_physical_ones_with_their_tails():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    req = Request("a", list(range(10)))
    manager.allocate_slots(req, 10)
    req.num_computed_tokens = 10
    layout = describe_layout(manager, [req])
    (r,) = layout.requests
    assert r.block_ids == manager.get_block_ids("a") == [1, 2, 3]
    assert [b.filled for b in r.blocks] == [4, 4, 2] and r.tail_slots == 2 and r.blocks[-1].tail == 2
    assert layout.block(0).state == "null" and layout.block(5).state == "free"
    assert layout.block(3).holders == (("a", 2),) and layout.block(3).filled == 2
    # Tokens scheduled but not computed yet: their slots are allocated, not filled.
    req.num_computed_tokens = 5
    assert describe_layout(manager, [req]).requests[0].tail_slots == 7
    assert describe_layout(manager, [req], num_tokens={"a": 12}).requests[0].tail_slots == 0
    with pytest.raises(ValueError, match="13 tokens do not fit"):
        describe_layout(manager, [req], num_tokens={"a": 13})


def test_a_shared_prefix_is_one_set_of_physical_blocks_named_by_both_rows():
    manager, a, b = shared_prefix()
    layout = describe_layout(manager)  # default: every request holding blocks
    assert [r.name for r in layout.requests] == ["A", "B"]
    ids_a, ids_b = (r.block_ids for r in layout.requests)
    assert ids_a[:4] == ids_b[:4] and ids_a[4] != ids_b[4]
    assert layout.shared_blocks() == {b: ["A", "B"] for b in ids_a[:4]}
    for block_id in ids_a[:4]:
        p = layout.block(block_id)
        assert p.shared and p.ref_cnt == 2 and p.holders == (("A", ids_a.index(block_id)),
                                                              ("B", ids_b.index(block_id)))
    assert not layout.block(ids_a[4]).shared
    page = render_paged_layout(manager, [a, b], title="shared")
    assert page == render_paged_layout(manager, [a, b], title="shared")  # deterministic
    # Each shared physical block: purple border, one band per holder, "ref 2".
    assert page.count(f"stroke='{COLORS['shared']}' stroke-width='3'") == 4 + 1  # and the key's
    assert page.count(">ref 2<") == 4
    assert "block 1: ref_cnt=2, named by A logical 0, B logical 0, shared" in page
    assert "4 shared" in page


def test_render_paged_layout_fits_the_column_and_follows_the_pool_picture():
    manager, a, b = shared_prefix()
    page = render_paged_layout(manager, [a, b])
    assert page.startswith("<div class='pagedkv-pool pagedkv-paged-layout'")  # dark mode, phone scrolling
    width, height = map(int, re.search(r"viewBox='0 0 (\d+) (\d+)'", page).groups())
    assert width <= 688 and "max-width:100%" in page
    assert "<script" not in page and "href" not in page and "&nbsp;" not in page  # valid XML too
    # One line per table entry, in the request's (darkened) colour.
    assert len(re.findall(r"<path d='M", page)) == 10
    assert f"fill='{owner_color('A')}'" in page and f"fill='{owner_color('B')}'" in page
    # The tail slots are dashed: A holds 67 tokens, so 13 empty slots in its last block.
    assert "A, logical block 4 -&gt; physical block 5: 3 of 16 slots filled, 13 tail slots" in page
    # Blocks 7-63 are free and named by nobody: one folded line.
    assert "blocks 7-63: free" in page
    # The HTML twin (what an untrusted notebook shows) lists the mapping.
    desc = page[page.index("<desc>"):]
    assert "0\u21921, 1\u21922, 2\u21923, 3\u21924, 4\u21925 (3/16)" in desc
    assert "shared: block 1 by A+B" in desc


def test_the_picture_draws_a_block_table_or_plain_rows_too():
    table = BlockTable(max_num_reqs=3, max_num_blocks_per_req=4, device="cpu")
    table.add_row([3, 7], 0)
    table.add_row([5], 2)
    layout = describe_layout(table, {0: "x", 2: "y"}, num_tokens={"x": 20}, block_size=16)
    assert [(r.name, r.block_ids, r.num_tokens) for r in layout.requests] == [("x", [3, 7], 20), ("y", [5], 16)]
    assert layout.num_pool_blocks is None and layout.block(4).state == "unknown"
    assert [r.name for r in describe_layout(table, block_size=16).requests] == ["row 0", "row 2"]
    rows = describe_layout({"p": [1, 2], "q": [2]}, block_size=8)
    assert rows.shared_blocks() == {2: ["p", "q"]} and rows.block(2).ref_cnt == 2
    pool = BlockPool(10)
    blocks = pool.get_new_blocks(2)
    with_pool = describe_layout({"p": blocks}, block_size=8, pool=pool)
    assert with_pool.block(1).state == "in use" and with_pool.block(9).state == "free"
    assert "<svg" in render_paged_layout({"p": blocks}, block_size=8, pool=pool)
    with pytest.raises(TypeError, match="block_size is needed"):
        describe_layout({"p": [1]})
    with pytest.raises(ValueError, match="not a block of the 10-block pool"):
        describe_layout({"p": [12]}, block_size=8, pool=pool)
    with pytest.raises(TypeError, match="KVCacheManager, a BlockTable or a mapping"):
        describe_layout([[1, 2]], block_size=8)


def test_long_requests_are_cut_and_unnamed_runs_folded():
    manager = KVCacheManager(num_blocks=200, block_size=4)
    long = Request("long", list(range(4 * 40)))
    manager.allocate_slots(long, long.num_tokens)
    long.num_computed_tokens = long.num_tokens
    page = render_paged_layout(manager, [long], max_blocks=6)
    assert "\u22ee 35 more blocks" in page
    assert len(re.findall(r"<path d='M", page)) == 5  # the 4 first blocks and the last
    assert "blocks 5-39: in use (not drawn)" in page and "blocks 41-199: free" in page
    with pytest.raises(ValueError, match="max_blocks"):
        render_paged_layout(manager, [long], max_blocks=2)


def test_the_live_view_redraws_on_pool_events_and_after_each_cell():
    manager, a, b = shared_prefix()
    view = PagedLayoutView(manager, [a, b], min_interval=3600)
    assert manager.block_pool._listeners == [] and view.redraws == 0  # undisplayed: free
    bundle = view._repr_mimebundle_()
    assert bundle["text/html"] == render_paged_layout(manager, [a, b])
    if paged_layout._ipywidgets is not None:
        assert "application/vnd.jupyter.widget-view+json" in bundle
        assert view.widget.value == bundle["text/html"]
    assert view.redraws == 1 and len(manager.block_pool._listeners) == 1
    a.append_output_token_ids(5)
    manager.allocate_slots(a, 1)
    a.num_computed_tokens += 1  # no pool event: the end of the cell redraws
    view._after_cell()
    assert view.redraws == 2 and "A: 68 tokens" in view.static_html()
    manager.free(b)
    view.update(requests=[a])
    assert "B:" not in view.static_html() and view.redraws == 3
    view.close()
    assert manager.block_pool._listeners == []


def test_the_live_view_works_without_ipywidgets(monkeypatch):
    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    name = "pagedkv.views._paged_layout_without_ipywidgets"
    spec = importlib.util.spec_from_file_location(name, paged_layout.__file__)
    copy = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, copy)
    spec.loader.exec_module(copy)
    view = copy.PagedLayoutView({"p": [1]}, block_size=4)
    assert set(view._repr_mimebundle_()) == {"text/plain", "text/html"}
    view.close()
