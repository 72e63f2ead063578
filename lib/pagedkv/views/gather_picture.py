"""Model Runner V2's block tables as a picture: the rows kept for life, gathered into the step's table.

Left, the per-request table: one line per row of ``BlockTables`` (every row,
held or free), labelled with the row number and its request, each live cell
the physical block id in the request's colour. Right, the step's input table:
batch entry ``i`` holds the row ``idx_mapping[i]``, and an arrow joins the two.
Rows the step leaves out stay where they are and get no arrow; padding
entries (``num_reqs_padded``) are drawn as zeros, the null block.

A static SVG with a ``viewBox`` (it scales to the site's column); it reads
the host mirrors of ``BlockTables`` (what the device holds once staged
writes are applied) and recomputes the gather from them, so it draws the
same picture on a CPU and a GPU. Cells staged but not yet applied can be
outlined (``staged=True``): those are the entries the next
``apply_staged_writes`` copies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .style import COLORS, MONO_FONT, cell_svg, escape, fit, owner_color

__all__ = ["render_gather"]

_CELL_W, _CELL_H, _GAP = 28, 22, 3
_LEFT_LABEL_W = 92  # "row 7 a"
_RIGHT_LABEL_W = 60  # "i=0", "i=3 pad"
_MORE_W = 34  # the "+N" after a long row
_ARROWS_W = 56


def render_gather(block_tables, idx_mapping: Sequence[int], names: Mapping[str, str] | None = None,
                  title: str | None = None, max_columns: int = 7, group: int = 0,
                  num_reqs_padded: int | None = None, staged: bool = False) -> str:
    """The per-request rows of ``block_tables`` (a ``pagedkv.block_tables.BlockTables``) and the step's table.

    Args:
        block_tables: the worker's tables; rows are read from its host mirror.
        idx_mapping: the step's rows, in batch order.
        names: request id -> label drawn beside its row (default: the id).
        title: a caption above the picture.
        max_columns: block ids drawn per row before "+N".
        group: the KV-cache group to draw.
        num_reqs_padded: entries of the step's table (>= ``len(idx_mapping)``);
            the extra ones are padding, all zeros.
        staged: outline the cells written since the last ``apply_staged_writes``.
    """
    from ..block_tables import BlockTables

    if not isinstance(block_tables, BlockTables):
        raise TypeError(f"block_tables must be a BlockTables, got {type(block_tables).__name__}")
    rows = [int(r) for r in idx_mapping]
    max_num_reqs = block_tables.max_num_reqs
    for i, r in enumerate(rows):
        if not 0 <= r < max_num_reqs or not block_tables.req_states.is_held(r):
            raise ValueError(f"idx_mapping[{i}] = row {r} is not a held row")
    padded = len(rows) if num_reqs_padded is None else int(num_reqs_padded)
    if padded < len(rows):
        raise ValueError(f"num_reqs_padded must be >= len(idx_mapping) = {len(rows)}, got {padded}")
    names = dict(names or {})
    states = block_tables.req_states
    table = block_tables.block_tables[group]
    lengths = block_tables.num_blocks[group]
    fresh: set[tuple[int, int]] = set()
    if staged:  # the mirror is ahead of the device exactly where writes wait
        ahead = (table.gpu.cpu().numpy() != table.np).nonzero()
        fresh = {(int(r), int(c)) for r, c in zip(*ahead)}
    shown = max(1, min(max_columns, max((int(lengths[r]) for r in range(max_num_reqs)), default=1)))
    cells_w = shown * (_CELL_W + _GAP)
    right_x = _LEFT_LABEL_W + cells_w + _MORE_W + _ARROWS_W
    width_px = right_x + _RIGHT_LABEL_W + cells_w + _MORE_W
    top = 48 if title else 28
    line_h = _CELL_H + 6
    height = top + max(max_num_reqs, padded) * line_h + 8

    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width_px}' height='{height}' "
             f"viewBox='0 0 {width_px} {height}' style='max-width:100%;height:auto' role='img' "
             f"aria-label='{escape(title or 'block tables gathered by idx_mapping')}'>",
             f"<rect width='{width_px}' height='{height}' fill='#ffffff'/>",
             "<defs><marker id='pkv-gather-arrow' markerWidth='8' markerHeight='8' refX='7' refY='4' "
             "orient='auto'><path d='M0,0 L8,4 L0,8 Z' fill='#495057'/></marker></defs>"]

    def text(x, y, s, size=12, weight="normal", anchor="start", color="#212529"):
        parts.append(f"<text x='{x}' y='{y}' font-size='{size}' font-weight='{weight}' text-anchor='{anchor}' "
                     f"fill='{color}' style='{MONO_FONT}'>{escape(s)}</text>")

    if title:
        text(8, 20, title, 13, "bold")
    text(8, top - 8, "rows kept for life", 11, color="#868e96")
    text(right_x, top - 8, "the step's table", 11, color="#868e96")

    def draw_row(x0, label_w, y, label, name, ids, total, row=None):
        text(x0 + label_w - 6, y + 15, label, 12, anchor="end",
             color="#212529" if name is not None else "#adb5bd")
        x = x0 + label_w
        for c, b in enumerate(ids[:shown]):
            fill = COLORS["null"] if b == 0 else owner_color(name or "")
            parts.append(cell_svg(x, y, _CELL_W, _CELL_H, fill, [str(b)],
                                  text_color="#ffffff" if b == 0 else "#212529",
                                  highlight=row is not None and (row, c) in fresh,
                                  tooltip=f"column {c}: block {b}"))
            x += _CELL_W + _GAP
        if total > shown:
            text(x + 2, y + 15, f"+{total - shown}", 11, color="#868e96")

    for r in range(max_num_reqs):
        y = top + r * line_h
        rid = states.index_to_req_id.get(r)
        n = int(lengths[r]) if rid is not None else 0
        label = f"row {r} {fit(names.get(rid, rid), 5)}" if rid is not None else f"row {r} free"
        draw_row(0, _LEFT_LABEL_W, y, label, None if rid is None else names.get(rid, rid),
                 table.np[r, :n].tolist(), n, row=r)
    for i in range(padded):
        y = top + i * line_h
        if i < len(rows):
            r = rows[i]
            rid = states.index_to_req_id[r]
            n = int(lengths[r])
            draw_row(right_x, _RIGHT_LABEL_W, y, f"i={i}", names.get(rid, rid),
                     table.np[r, :n].tolist(), n)
            y0, y1 = top + r * line_h + _CELL_H / 2, y + _CELL_H / 2
            x0 = _LEFT_LABEL_W + min(n, shown) * (_CELL_W + _GAP) + (_MORE_W - 4 if n > shown else 2)
            x1 = right_x + 10
            parts.append(f"<path d='M{x0},{y0:g} C{x0 + 40},{y0:g} {x1 - 40},{y1:g} {x1},{y1:g}' "
                         f"fill='none' stroke='#495057' stroke-width='1.2' "
                         f"marker-end='url(#pkv-gather-arrow)' opacity='0.8'/>")
        else:
            draw_row(right_x, _RIGHT_LABEL_W, y, f"i={i} pad", "", [0] * shown, shown)
    parts.append("</svg>")
    return f"<div class='pagedkv-gather' style='font-size:0;line-height:0'>{''.join(parts)}</div>"
