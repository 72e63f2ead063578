"""Chapter 1's picture of where the KV bytes live: one buffer, one view per layer.

vLLM 0.33.0's worker allocates the whole KV pool as one flat buffer and gives
every layer its own tensor, a strided view into it. Layer ``l``'s page of
block ``b`` starts at ``l * layer_stride + b * block_stride`` bytes. Two
layouts place the pages differently:

- **layer-outermost**: each layer's view is one contiguous region of
  ``num_blocks`` pages (``layer_stride = num_blocks * page``,
  ``block_stride = page``);
- **block-outermost**: each block is one contiguous run of every layer's page
  (``layer_stride = page``, ``block_stride = num_layers * page``).

Either way a block id names the same block in every layer.
:func:`page_offsets` computes the offsets and :func:`plot_kv_buffer` draws a
small buffer in both layouts, one block's pages outlined.
"""

from __future__ import annotations

from ..common import check_int
from .style import COLORS, OWNER_PALETTE

__all__ = ["LAYOUTS", "page_offsets", "plot_kv_buffer"]

#: The two layouts :func:`page_offsets` knows, as vLLM's ``KVCacheTensor``
#: docstring names them.
LAYOUTS = ("layer-outermost", "block-outermost")


def _strides(num_layers: int, num_blocks: int, page: int,
             layout: str) -> tuple[int, int]:
    if layout == "layer-outermost":
        return num_blocks * page, page
    if layout == "block-outermost":
        return page, num_layers * page
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def page_offsets(num_layers: int, num_blocks: int, page: int, block: int,
                 layout: str = "layer-outermost") -> list[int]:
    """The byte offset of ``block``'s page in each layer, layer 0 first.

    ``offset(l) = l * layer_stride + block * block_stride`` in a buffer of
    ``num_layers * num_blocks * page`` bytes, with the strides of ``layout``
    (see :data:`LAYOUTS`).
    """
    check_int(num_layers, "num_layers", 1)
    check_int(num_blocks, "num_blocks", 1)
    check_int(page, "page", 1)
    check_int(block, "block", 0)
    if block >= num_blocks:
        raise ValueError(f"block must be below num_blocks={num_blocks}, "
                         f"got {block}")
    layer_stride, block_stride = _strides(num_layers, num_blocks, page,
                                          layout)
    return [l * layer_stride + block * block_stride
            for l in range(num_layers)]


def plot_kv_buffer(num_layers: int = 4, num_blocks: int = 6, block: int = 3):
    """One small KV buffer drawn in both layouts, ``block``'s pages outlined.

    Each cell is one page (one layer's share of one block), coloured by its
    layer and labelled with its block id; a bracket under each layer's cells
    (layer-outermost) or each block's (block-outermost) marks the contiguous
    run. The figure fits the book's column and is closed before it is
    returned, so a notebook shows it once, as the cell's value.
    """
    import matplotlib.pyplot as plt

    total = num_layers * num_blocks
    fig, axes = plt.subplots(2, 1, figsize=(6.8, 2.9))
    captions = {
        "layer-outermost": "layer-outermost: each layer's tensor is one"
                           " contiguous region",
        "block-outermost": "block-outermost: each block holds every"
                           " layer's page side by side (a layer's tensor"
                           " strides over them)",
    }
    for ax, layout in zip(axes, LAYOUTS):
        layer_stride, block_stride = _strides(num_layers, num_blocks, 1,
                                              layout)
        outlined = set(page_offsets(num_layers, num_blocks, 1, block,
                                    layout))
        for l in range(num_layers):
            colour = OWNER_PALETTE[l % len(OWNER_PALETTE)]
            for b in range(num_blocks):
                x = l * layer_stride + b * block_stride
                mine = x in outlined
                ax.add_patch(plt.Rectangle(
                    (x + 0.04, 0.04), 0.92, 0.92, facecolor=colour,
                    edgecolor=COLORS["highlight"] if mine else "white",
                    linewidth=2.2 if mine else 1.0))
                ax.text(x + 0.5, 0.5, f"{b}", ha="center", va="center",
                        fontsize=8, fontweight="bold" if mine else "normal")
        runs = num_layers if layout == "layer-outermost" else num_blocks
        run_len = total // runs
        for r in range(runs):
            left, right = r * run_len + 0.1, (r + 1) * run_len - 0.1
            ax.plot([left, left, right, right], [-0.05, -0.2, -0.2, -0.05],
                    color="#495057", linewidth=0.8)
            label = f"layer {r}" if layout == "layer-outermost" else f"block {r}"
            ax.text((left + right) / 2, -0.42, label, ha="center",
                    va="center", fontsize=7.5)
        ax.set_xlim(-0.1, total + 0.1)
        ax.set_ylim(-0.6, 1.05)
        ax.axis("off")
        ax.set_title(captions[layout], fontsize=8.5, loc="left")
    fig.suptitle(f"One buffer, {num_layers} layers x {num_blocks} blocks:"
                 " colour = layer, number = block id,"
                 f" block {block}'s pages outlined", fontsize=9)
    fig.tight_layout()
    plt.close(fig)
    return fig
