"""The picture of Model Runner V2's gather: rows kept for life -> the step's table."""

import re

import pytest

from pagedkv.block_tables import BlockTables
from pagedkv.request_state import RequestState
from pagedkv.views import render_gather


def _tables():
    states = RequestState(5)
    tables = BlockTables(states, [16], [12], device="cpu")
    for name, ids in (("a", [1, 2, 3]), ("b", list(range(4, 14))), ("c", [14])):
        tables.append_block_ids(states.add_request(name), [ids], overwrite=True)
    tables.apply_staged_writes()
    return states, tables


def test_one_arrow_per_batch_entry_and_every_row_drawn():
    states, tables = _tables()
    rows = [states.req_id_to_index[n] for n in ("c", "a")]  # b sits this step out
    html = render_gather(tables, rows, title="step", num_reqs_padded=3)
    assert "viewBox='0 0 " in html and "max-width:100%" in html
    assert html.count("marker-end=") == 2
    # all five rows on the left (two free), three entries on the right (one padding)
    for r in range(5):
        assert f">row {r} " in html
    assert html.count(">row 0 free<") == 1 and html.count(">row 1 free<") == 1
    assert ">i=0<" in html and ">i=1<" in html and ">i=2 pad<" in html
    # b's ten blocks: seven drawn, then +3
    assert ">+3<" in html
    assert render_gather(tables, rows, title="step", num_reqs_padded=3) == html  # deterministic


def test_staged_cells_are_outlined_until_applied():
    states, tables = _tables()
    tables.append_block_ids(states.req_id_to_index["a"], [[20]], overwrite=False)
    outlined = render_gather(tables, [states.req_id_to_index["a"]], staged=True)
    assert outlined.count("stroke-width='2.5'") == 1  # the one staged cell, column 3 of a's row
    tables.apply_staged_writes()
    assert render_gather(tables, [states.req_id_to_index["a"]], staged=True).count("stroke-width='2.5'") == 0


@pytest.mark.parametrize("rows, words", [([0], "row 0 is not a held row"), ([9], "row 9 is not a held row")])
def test_a_row_nobody_holds_is_refused(rows, words):
    _, tables = _tables()
    with pytest.raises(ValueError, match=re.escape(words)):
        render_gather(tables, rows)


def test_wrong_arguments():
    states, tables = _tables()
    with pytest.raises(TypeError, match="BlockTables"):
        render_gather({"a": [1]}, [4])
    with pytest.raises(ValueError, match="num_reqs_padded"):
        render_gather(tables, [4, 3], num_reqs_padded=1)
