"""Chapter 5's picture of a block-major KV cache: the slot each token lands in.

One layer's cache, drawn as its blocks: one row per physical block, one column
per offset inside a block, so that the cell in row ``b`` and column ``o`` is
slot ``b * block_size + o``. Each written slot shows the request and token
position that own it, and the slot number, in the request's colour (the owner
colours every other pool picture uses). The allocated but unwritten tail of a
request's last block is paler and hatched: it is held, not free (chapter 2's
internal fragmentation). Free blocks are grey.

:func:`slot_owners` gives the grid the picture is drawn from;
:func:`plot_slots` draws it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..common import cdiv, check_int
from .style import owner_color

__all__ = ["plot_slots", "slot_owners"]

_FREE = "#e9ecef"


def slot_owners(tables: Mapping[str, Sequence[int]],
                lengths: Mapping[str, int], block_size: int,
                num_blocks: int) -> list[list[tuple[str, int | None] | None]]:
    """Who holds each slot: ``grid[b][o]`` for block ``b``, offset ``o``.

    ``(name, pos)`` for a slot request ``name`` wrote at position ``pos``,
    ``(name, None)`` for an allocated, unwritten tail slot, ``None`` for a
    slot of a free block. ``tables[name]`` is the request's block ids in
    logical order and ``lengths[name]`` its token count; the table must hold
    exactly ``cdiv(length, block_size)`` blocks, each below ``num_blocks``
    and held by one request only.
    """
    check_int(block_size, "block_size", 1)
    check_int(num_blocks, "num_blocks", 1)
    if set(tables) != set(lengths):
        raise ValueError(f"tables and lengths must name the same requests, "
                         f"got {sorted(tables)} and {sorted(lengths)}")
    grid: list[list[tuple[str, int | None] | None]] = [
        [None] * block_size for _ in range(num_blocks)]
    for name, blocks in tables.items():
        length = check_int(lengths[name], f"lengths[{name!r}]", 0)
        if len(blocks) != cdiv(length, block_size):
            raise ValueError(
                f"request {name!r}: {length} tokens need "
                f"{cdiv(length, block_size)} blocks of {block_size}, "
                f"its table holds {len(blocks)}")
        for i, block in enumerate(blocks):
            block = check_int(block, f"tables[{name!r}][{i}]", 0)
            if block >= num_blocks:
                raise ValueError(f"request {name!r}: block {block} is not "
                                 f"below num_blocks={num_blocks}")
            if any(cell is not None for cell in grid[block]):
                raise ValueError(f"block {block} is held twice")
            grid[block] = [(name, None)] * block_size
        for pos in range(length):
            grid[blocks[pos // block_size]][pos % block_size] = (name, pos)
    return grid


def _pale(colour: str) -> str:
    """``colour`` mixed halfway with white."""
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{(c + 255) // 2:02x}" for c in (r, g, b))


def plot_slots(tables: Mapping[str, Sequence[int]], lengths: Mapping[str, int],
               block_size: int, num_blocks: int):
    """The block-major cache of :func:`slot_owners` as a grid of slots.

    Returns the matplotlib ``Figure``, closed, so that a notebook shows it
    once, as the cell's value; it fits the book's column.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    grid = slot_owners(tables, lengths, block_size, num_blocks)
    fig, ax = plt.subplots(figsize=(6.5, 0.9 + 0.4 * num_blocks))
    for b, row in enumerate(grid):
        for o, cell in enumerate(row):
            hatch, label = None, ""
            if cell is None:
                fill = _FREE
            elif cell[1] is None:
                fill, hatch, label = _pale(owner_color(cell[0])), "///", \
                    f"{cell[0]} tail"
            else:
                fill = owner_color(cell[0])
                label = f"{cell[0]}{cell[1]}\nslot {b * block_size + o}"
            ax.add_patch(Rectangle((o, b), 1, 1, facecolor=fill, hatch=hatch,
                                   edgecolor="white", linewidth=2))
            if label:
                ax.text(o + 0.5, b + 0.5, label, ha="center", va="center",
                        fontsize=7)
    ax.set_xlim(0, block_size)
    ax.set_ylim(num_blocks, 0)
    ax.set_xticks([o + 0.5 for o in range(block_size)],
                  [str(o) for o in range(block_size)])
    ax.set_yticks([b + 0.5 for b in range(num_blocks)],
                  [str(b) for b in range(num_blocks)])
    ax.set_xlabel("offset in block (pos % block_size)")
    ax.set_ylabel("physical block id")
    ax.set_title(f"A block-major KV cache: block b owns slots "
                 f"{block_size}b .. {block_size}b+{block_size - 1}",
                 fontsize=10)
    handles = [Patch(facecolor=owner_color(n), label=f"{n}: written")
               for n in tables]
    handles += [Patch(facecolor=_pale(owner_color(n)), hatch="///",
                      label=f"{n}: allocated, unwritten") for n in tables]
    handles.append(Patch(facecolor=_FREE, label="free block"))
    ax.legend(handles=handles, fontsize=7, loc="upper left",
              bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    plt.close(fig)
    return fig
