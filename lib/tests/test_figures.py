"""The chapter pictures: what each figure cell says, and its colours."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from pagedkv.block_table import BlockTable  # noqa: E402
from pagedkv.views.figures import (  # noqa: E402
    block_table_figure,
    pool_history_figure,
    pool_snapshot,
)
from pagedkv.sim.paged_kv import PagedKV  # noqa: E402


def _texts(fig):
    return [t.get_text() for t in fig.axes[0].texts]


def test_block_table_figure_shows_live_ids_only_and_is_closed():
    table = BlockTable(max_num_reqs=3, max_num_blocks_per_req=4, device="cpu")
    table.add_row([7, 2], 0)
    table.add_row([5], 2)
    fig = block_table_figure(table, {0: "a", 2: "c"}, "t")
    assert _texts(fig) == ["7", "2", "5"]
    assert fig.number not in plt.get_fignums()  # shown once, by the caller
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["row 0: a", "row 1: -", "row 2: c"]


def test_block_table_figure_keeps_a_request_colour_across_pictures():
    table = BlockTable(max_num_reqs=2, max_num_blocks_per_req=2, device="cpu")
    table.add_row([3], 1)
    both = block_table_figure(table, {0: "a", 1: "c"}, "t")
    alone = block_table_figure(table, {1: "c"}, "t")

    def colour_of_row1(fig):
        patch = [p for p in fig.axes[0].patches if p.get_xy() == (0, 1)][0]
        return patch.get_facecolor()

    assert colour_of_row1(both) == colour_of_row1(alone)


def test_pool_history_figure_labels_states():
    pool = PagedKV(capacity=2, block_size=2)
    pool.create("a")
    pool.append("a", 10)
    history = [("one", pool_snapshot(pool))]
    pool.pin("a", "t")
    pool.release("a")
    history.append(("two", pool_snapshot(pool)))
    fig = pool_history_figure(history, 2, "t")
    assert _texts(fig) == ["[10]\na | -", "free", "[10]\n- | t", "free"]
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert ticks == ["one", "two"]


def test_allocation_layout_draws_ranges_block_by_block():
    from pagedkv.views.figures import allocation_layout

    text = allocation_layout(0, 32, 40, 4, 16)
    lines = text.splitlines()
    assert lines[1] == "tokens  hhhhhhhh|hhhhhhhh|nnnnnnnn|nnnnnnnn|nnnnll..|"
    assert "76 tokens -> 5 blocks of 16" in lines[-1]
    tiny = allocation_layout(0, 0, 5, 0, 4).splitlines()[1]
    assert tiny == "tokens  nnnn|n...|"
    import pytest

    with pytest.raises(ValueError):
        allocation_layout(0, 0, 0, 0, 16)


def test_attention_grid_figure_draws_one_box_per_work_item():
    from pagedkv.kernels.attention import plan_attention
    from pagedkv.views import attention_grid_figure

    q_lens, seq_lens = [40, 1, 1], [40, 90, 30]
    plan = plan_attention(8, 2, q_lens, seq_lens)
    fig = attention_grid_figure(plan, q_lens, seq_lens, group=4, request=1)
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert labels == ["request 0: tokens 0..31", "request 0: tokens 32..39",
                      "request 1: tokens 0..0", "request 2: tokens 0..0"]
    with pytest.raises(ValueError, match="not the batch this plan was made for"):
        attention_grid_figure(plan, [40, 1], [40, 90], group=4)
    with pytest.raises(ValueError, match="request 1 has no new tokens"):
        attention_grid_figure(plan_attention(8, 2, [40, 0], [40, 9]), [40, 0], [40, 9], group=4, request=1)
