"""The pool and block-table views, the owner labels, the trace recorder and the replay player."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from pagedkv.block_pool import BlockPool
from pagedkv.views import pool_view, table_view
from pagedkv.views import (
    COLORS,
    BlockOwners,
    BlockPoolView,
    BlockTableView,
    Frame,
    TraceRecorder,
    describe_blocks,
    owner_color,
    render_block_table,
    render_pool,
    replay_html,
)

H = [bytes([i]) * 32 for i in range(8)]


def scenario():
    """A: 3 blocks, 2 of them cached, then freed; B: a hit on A's first block plus one new block."""
    pool = BlockPool(8)
    owners = BlockOwners(pool)
    with owners.acting_for("A"):
        a = pool.get_new_blocks(3)
        pool.cache_full_blocks(a, H[:2], 0, 2)
    with owners.acting_for("B"):
        b = pool.get_new_blocks(1)
    with owners.acting_for("A"):
        pool.free_blocks(reversed(a))
    with owners.acting_for("C"):
        pool.touch([a[0]])
        c = [a[0], *pool.get_new_blocks(1)]
    return pool, owners, a, b, c


def test_describe_blocks_gives_each_block_its_state_owner_and_queue_position():
    pool, owners, a, b, c = scenario()
    cells = {cell.block_id: cell for cell in describe_blocks(pool, owners)}
    assert cells[0].state == "null"
    assert (cells[1].state, cells[1].owners, cells[1].ref_cnt) == ("in use", ("C",), 1)
    assert (cells[4].state, cells[4].owners) == ("in use", ("B",))
    assert (cells[3].state, cells[3].owners) == ("in use", ("C",))  # A's unhashed block, reused at the head
    assert (cells[2].state, cells[2].block_hash) == ("cached", H[1])
    # Free queue: 5, 6, 7 then the cached block 2 at the tail.
    assert [cells[i].queue_position for i in (5, 6, 7, 2)] == [0, 1, 2, 3]
    assert cells[1].queue_position is None


def test_owners_from_a_mapping_or_a_function_label_blocks_too():
    pool = BlockPool(6)
    x, y = pool.get_new_blocks(2), pool.get_new_blocks(1)
    pool.touch([x[0]])
    tables = {"x": x, "y": y + [x[0]]}
    for owners in (tables, lambda: tables, {"x": [1, 2], "y": [3, 1]}):
        cells = describe_blocks(pool, owners)
        assert cells[1].owners == ("x", "y") and cells[3].owners == ("y",)


def test_block_owners_follow_allocation_hits_and_frees():
    pool = BlockPool(6)
    owners = BlockOwners(pool)
    with owners.acting_for("A"):
        a = pool.get_new_blocks(2)
    with owners.acting_for("B"):
        pool.touch(a)
    assert owners.labels() == {1: ["A", "B"], 2: ["A", "B"]}
    with owners.acting_for("A"):
        pool.free_blocks(reversed(a))
    assert owners.labels() == {1: ["B"], 2: ["B"]}
    pool.free_blocks(a)  # no actor: labels go when the block is free
    assert owners.labels() == {}
    owners.close()
    with owners.acting_for("C"):
        pool.get_new_blocks(1)
    assert owners.labels() == {}  # closed: no longer listening


def test_render_pool_draws_every_state_without_scripts_or_links():
    pool, owners, *_ = scenario()
    page = render_pool(pool, owners, title="demo", highlight=[3])
    assert page == render_pool(pool, owners, title="demo", highlight=[3])  # deterministic
    assert page.startswith("<div class='pagedkv-pool'") and "<svg" in page
    assert "<script" not in page and "src=" not in page and "href" not in page
    for text in ("block 0: the null block", "block 1: in use by C, ref_cnt=1", "block 2: free and cached",
                 "block 5: free, no hash, free-queue position 0", "demo"):
        assert text in page
    assert f"fill='{owner_color('B')}'" in page and f"fill='{COLORS['cached']}'" in page
    assert page.count(f"stroke='{COLORS['highlight']}'") == 1
    # The free-queue strip lists the queue from head to tail.
    strip = page[page.index("free queue, head"):]
    assert re.findall(r"<title>block (\d+)", strip) == ["5", "6", "7", "2"]


def test_render_pool_marks_shared_blocks_and_elides_long_queues():
    pool = BlockPool(80)
    a = pool.get_new_blocks(1)
    pool.touch(a)
    page = render_pool(pool, queue_limit=20)
    assert "in use by in use, ref_cnt=2" not in page
    assert "block 1: in use, ref_cnt=2" in page  # no owners known
    assert f"stroke='{COLORS['shared']}' stroke-width='3'" in page
    strip = page[page.index("free queue, head"):]
    assert "\u2026" in strip and "free queue, head \u2192 tail (78)" in strip
    assert len(re.findall(r"<title>block \d+", strip)) == 20
    small = render_pool(pool, max_cells=32)
    assert "blocks 0-31 drawn" in small and "block 32:" not in small and "block 31:" in small


def test_block_table_colours_rows_by_owner_and_marks_shared_and_null_blocks():
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(a, H[:1], 0, 1)
    pool.touch(a[:1])
    page = render_block_table({"A": a, "B": [a[0], 0]}, pool, title="tables")
    assert page == render_block_table({"A": a, "B": [a[0], 0]}, pool, title="tables")
    assert "<script" not in page and "tables" in page
    rows = re.findall(r"<tr><th[^>]*>(\w+)</th>(.*?)</tr>", page)
    assert [name for name, _ in rows] == ["A", "B"]
    cells_a = re.findall(r"<td title='(\w*)' style='([^']*)'>(\d+)", rows[0][1])
    assert [int(c[2]) for c in cells_a] == [1, 2, 3]
    assert all(f"background:{owner_color('A')}" in c[1] for c in cells_a)
    assert cells_a[0][0] == "shared" and COLORS["shared"] in cells_a[0][1]
    cells_b = re.findall(r"<td title='([\w ]*)' style='([^']*)'>(\d+)", rows[1][1])
    assert cells_b[1][0] == "null block" and COLORS["null"] in cells_b[1][1]
    wide = render_block_table([list(range(1, 41))], max_columns=8)
    assert "\u2026 +32" in wide


def test_owner_colors_are_stable_and_distinct_for_usual_names():
    assert owner_color("A") != owner_color("B") != owner_color("C")
    assert owner_color("req-1") == owner_color("B") and owner_color("a") == owner_color("A")
    assert owner_color("some request") == owner_color("some request")


def test_trace_recorder_makes_one_frame_per_mutation_and_folds_evictions():
    pool = BlockPool(4)
    with TraceRecorder(pool, title="t") as rec:
        with rec.acting_for("A"):
            a = pool.get_new_blocks(2)
            pool.cache_full_blocks(a, H[:2], 0, 2)
            pool.free_blocks(reversed(a))
        with rec.acting_for("B"):
            pool.get_new_blocks(3)  # 3, then 2 and 1: their cache entries die
    assert rec.replay().captions() == [
        "start",
        "A: get_new_blocks(2) \u2192 [1, 2] popped from the head",
        "A: cache_full_blocks: [1, 2] hashed into the prefix cache",
        "A: free_blocks([2, 1]); [2, 1] \u2192 tail (hashed, still cached)",
        "B: get_new_blocks(3) \u2192 [3, 2, 1] popped from the head; cache entries of [2, 1] die at reuse",
    ]
    assert "block 3: in use by B" in rec.frames[-1].html
    assert pool._listeners == []  # the recorder and its owners unsubscribed
    pool.free_blocks(pool.blocks[1:])
    assert len(rec.frames) == 5


def test_trace_recorder_can_span_cells_with_start_and_stop():
    pool = BlockPool(4)
    owners = BlockOwners(pool)
    rec = TraceRecorder(pool, owners).start("before")
    with owners.acting_for("A"):
        pool.get_new_blocks(1)
    rec.snapshot("a note", highlight=[1])
    rec.stop()
    pool.get_new_blocks(1)
    assert rec.replay().captions() == ["before", "A: get_new_blocks(1) \u2192 [1] popped from the head", "a note"]
    assert pool._listeners == [owners._on_event]  # an owners object passed in stays subscribed


def test_trace_recorder_caps_its_frames():
    pool = BlockPool(4)
    with TraceRecorder(pool, max_frames=3) as rec:
        for _ in range(5):
            pool.free_blocks(pool.get_new_blocks(1))
    assert len(rec.frames) == 3 and rec.dropped == 8


def test_replay_html_is_self_contained_deterministic_and_has_controls():
    frames = [Frame("start", "<svg>0</svg>"), Frame("a < b", "<svg>1</svg>"), Frame("end", "<svg>2</svg>")]
    page = replay_html(frames, title="trace")
    again = replay_html(frames, title="trace")
    ids = re.findall(r"id='(pkv-replay-(\d+)-([0-9a-f]{10}))'", page)
    ids2 = re.findall(r"id='(pkv-replay-(\d+)-([0-9a-f]{10}))'", again)
    assert len(ids) == 1 and ids[0][2] == ids2[0][2] and int(ids2[0][1]) == int(ids[0][1]) + 1
    assert page.count("class='pkv-frame'") == 3 and page.count("<script>") == 1
    assert f"getElementById('{ids[0][0]}')" in page
    for control in ("pkv-prev", "pkv-next", "pkv-play", "type='range'", "max='2'"):
        assert control in page
    assert "a &lt; b" in page  # captions are escaped
    assert "http" not in page and "src=" not in page
    assert page.index("display:block") < page.index("display:none")  # frame 0 shows without JavaScript
    with pytest.raises(ValueError, match="got 0"):
        replay_html([])


def test_pool_view_subscribes_only_when_displayed_and_throttles():
    pool = BlockPool(16)
    view = BlockPoolView(pool, min_interval=3600)
    for _ in range(50):
        pool.free_blocks(pool.get_new_blocks(2))
    assert pool._listeners == [] and view.redraws == 0  # undisplayed: free
    bundle = view._repr_mimebundle_()
    assert bundle["text/html"] == render_pool(pool)
    if pool_view._ipywidgets is not None:
        assert "application/vnd.jupyter.widget-view+json" in bundle
        assert view.widget.value == bundle["text/html"]
    assert view.redraws == 1 and len(pool._listeners) == 1
    for _ in range(1000):
        pool.free_blocks(pool.get_new_blocks(2))
    assert view.redraws == 1 and view._stale  # throttled: at most one redraw per hour here
    view._after_cell()  # what IPython calls when the cell ends
    assert view.redraws == 2 and not view._stale
    eager = BlockPoolView(pool, min_interval=0)
    eager.attach()
    before = eager.redraws
    pool.free_blocks(pool.get_new_blocks(1))
    assert eager.redraws == before + 2
    view.close()
    eager.close()
    assert pool._listeners == []


def test_block_table_view_updates_and_carries_static_html():
    rows = {"A": [1, 2]}
    view = BlockTableView(rows, title="t")
    assert view._repr_mimebundle_()["text/html"] == render_block_table(rows, title="t")
    rows["B"] = [3]
    view.update()
    bundle = view._repr_mimebundle_()
    assert ">B</th>" in bundle["text/html"]
    if table_view._ipywidgets is not None:
        assert view.widget.value == bundle["text/html"]
    view.update({"C": [4]})
    assert ">C</th>" in view.static_html() and ">A</th>" not in view.static_html()


def _load_without_ipywidgets(monkeypatch, module):
    """A fresh copy of ``module`` imported while ``import ipywidgets`` fails."""
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import ipywidgets now fails
    name = f"pagedkv.views._{module.__name__.rsplit('.', 1)[1]}_without_ipywidgets"
    spec = importlib.util.spec_from_file_location(name, module.__file__)
    copy = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, copy)
    spec.loader.exec_module(copy)
    return copy


def test_views_work_without_ipywidgets(monkeypatch):
    pools, tables = (_load_without_ipywidgets(monkeypatch, m) for m in (pool_view, table_view))
    assert pools._ipywidgets is None and tables._ipywidgets is None
    pool = BlockPool(4)
    view = pools.BlockPoolView(pool)
    bundle = view._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"} and "<svg" in bundle["text/html"]
    table = tables.BlockTableView({"A": [1]})
    assert set(table._repr_mimebundle_()) == {"text/plain", "text/html"}
    view.close()


def test_the_player_script_ships_as_a_file_and_is_emitted_without_its_header():
    from importlib.resources import files

    from pagedkv.views.replay import player_script

    source = files("pagedkv.views").joinpath("replay.js").read_text(encoding="utf-8")
    assert source.startswith("/*") and "__REPLAY_ID__" in source
    script = player_script("pkv-replay-9-0123456789")
    assert "getElementById('pkv-replay-9-0123456789')" in script and "__REPLAY_ID__" not in script
    assert "/*" not in script and "*/" not in script  # the header is documentation, not shipped to the page
    page = replay_html([Frame("only", "<svg/>")])
    dom_id = re.search(r"id='(pkv-replay-[^']+)'", page).group(1)
    assert page.endswith(f"<script>{player_script(dom_id)}</script>")
    assert source.rstrip("\n").endswith(script.split("pkv-replay-9-0123456789", 1)[1])
