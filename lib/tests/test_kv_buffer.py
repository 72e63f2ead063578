"""Chapter 1's KV buffer picture: the offsets it draws, and bad input refused."""

import pytest

from pagedkv import budget
from pagedkv.views import page_offsets, plot_kv_buffer


def test_layer_outermost_offsets_step_by_one_layer_region():
    # Llama-3.1-8B, 26,785 blocks: each layer's region is 26,785 pages of 64 KiB
    page = budget.page_bytes_per_layer("Llama-3.1-8B", 16)
    offsets = page_offsets(32, 26_785, page, 1913)
    assert offsets[0] == 1913 * page
    assert offsets[1] - offsets[0] == 26_785 * page
    assert offsets[-1] == 31 * 26_785 * page + 1913 * page


def test_block_outermost_puts_a_blocks_pages_side_by_side():
    offsets = page_offsets(4, 6, 10, 3, "block-outermost")
    assert offsets == [120, 130, 140, 150]


@pytest.mark.parametrize("layout", ["layer-outermost", "block-outermost"])
def test_every_page_has_its_own_offset(layout):
    offsets = {o for b in range(6)
               for o in page_offsets(4, 6, 1, b, layout)}
    assert offsets == set(range(24))


@pytest.mark.parametrize("kwargs, error", [
    (dict(block=6), ValueError), (dict(block=-1), ValueError),
    (dict(layout="LBHNC"), ValueError), (dict(page=2.0), TypeError)])
def test_bad_input_is_refused(kwargs, error):
    args = dict(num_layers=4, num_blocks=6, page=1, block=3) | kwargs
    with pytest.raises(error):
        page_offsets(**args)


def test_picture_outlines_one_page_per_layer_in_each_layout():
    fig = plot_kv_buffer(num_layers=4, num_blocks=6, block=3)
    for ax in fig.axes:
        outlined = [p for p in ax.patches if p.get_linewidth() > 2]
        assert len(outlined) == 4
        assert len(ax.patches) == 24
