"""The live-view check (``make test-live``): which cells it watches, how it judges, how it starts and stops JupyterLab.

The check itself needs Chromium and a minute; these tests need neither (the
JupyterLab one starts a server for a few seconds, without a browser).
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tools.live_check import LiveCell, ViewRecord, judge, live_cells

REPO = Path(__file__).resolve().parents[2]


def nb(*cells) -> dict:
    return {"cells": [{"cell_type": t, "metadata": {"tags": tags}, "source": src} for t, tags, src in cells]}


def test_the_chapters_live_views_are_found():
    ch3 = json.loads((REPO / "chapters/03_block_pool.ipynb").read_text())
    ch4 = json.loads((REPO / "chapters/04_block_table.ipynb").read_text())
    assert live_cells(ch3) == [LiveCell(5, "BlockPoolView", "view")]
    assert live_cells(ch4) == [LiveCell(10, "BlockTableView", "view")]


def test_only_tagged_code_cells_that_build_a_view_are_live():
    cells = live_cells(nb(
        ("code", ["nbval-ignore-output"], "from pagedkv.views import (BlockOwners, BlockPoolView,\n  render_pool)"),
        ("code", [], "v = BlockPoolView(pool)\nv"),  # not tagged: its output is compared, so not live
        ("markdown", ["nbval-ignore-output"], "BlockPoolView(pool)"),
        ("code", ["nbval-ignore-output"], ["t = widgets.BlockTableView(rows)\n", "t"]),
        ("code", ["nbval-ignore-output"], "BlockPoolView(pool, title='x')"),
    ))
    assert cells == [LiveCell(3, "BlockTableView", "t"), LiveCell(4, "BlockPoolView", None)]


def state(t, own_done=True, later=True, kernel="busy"):
    return {"t": t, "hash": f"{t}", "length": 1, "ownDone": own_done, "laterPending": later,
            "kernel": kernel, "executing": 9}


def test_the_first_view_must_change_twice_after_its_cell_while_the_kernel_is_busy():
    cell = LiveCell(5, "BlockPoolView", "view")
    ok = ViewRecord(cell, [state(1.0), state(1.1), state(1.2)], 1.0)
    assert len(ok.changes_while_busy()) == 2  # the first state is the view appearing, not a change
    assert judge([ok]) == []

    def fails(states, **kw):
        problems = judge([ViewRecord(cell, states, 1.0)], **kw)
        assert len(problems) == 1 and "cell 6" in problems[0], problems
        return problems[0]

    assert "changed 1 time(s)" in fails([state(1.0), state(1.1)])
    assert "changed 0 time(s)" in fails([state(0.5, own_done=False), state(0.6, own_done=False)])
    assert "changed 1 time(s)" in fails([state(1.0), state(1.1), state(1.2, later=False)])
    assert "changed 1 time(s)" in fails([state(1.0), state(1.1, kernel="idle"), state(1.2)])
    assert "at least 3 expected" in fails([state(1.0), state(1.1), state(1.2)], min_changes=3)
    assert "never showed as a widget" in fails([])


def test_only_the_first_view_must_change_but_every_view_must_render():
    first = ViewRecord(LiveCell(5, "BlockPoolView"), [state(1.0), state(1.1), state(1.2)], 1.0)
    still = ViewRecord(LiveCell(9, "BlockTableView"), [state(2.0)], 2.0)
    assert judge([first, still]) == []
    (problem,) = judge([first, ViewRecord(LiveCell(9, "BlockTableView"), [], None)])
    assert "cell 10 (BlockTableView) never showed" in problem
    assert judge([]) and "no live view" in judge([])[0]


def test_make_test_live_is_a_target_of_its_own_not_part_of_make_test():
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^\.PHONY:.*\btest-live\b", makefile, re.M)
    assert re.search(r"^test-live:.*\n\t\$\(PY\) -m tools\.live_check", makefile, re.M)
    (test_line,) = re.findall(r"^test:(.*)$", makefile, re.M)
    assert "test-live" not in test_line


def test_jupyterlab_listens_on_127_0_0_1_with_a_token_and_stops_with_its_kernel(tmp_path):
    pytest.importorskip("jupyterlab")
    from tools.live_check import Lab

    (tmp_path / "book").mkdir()
    lab = Lab(tmp_path / "book", tmp_path / "home")
    try:
        with pytest.raises(urllib.error.HTTPError) as denied:  # no token, no entry
            urllib.request.urlopen(f"{lab.base}/api/status", timeout=5)
        assert denied.value.code == 403
        kernel = json.loads(lab._api("POST", "/api/kernels", timeout=30))
        assert kernel["id"]
        assert lab._kernel_pids(), "the kernel runs with a connection file in the lab's runtime directory"
    finally:
        lab.close()
    assert lab.proc.poll() is not None
    assert lab._kernel_pids() == []
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{lab.base}/api/status", timeout=2)
