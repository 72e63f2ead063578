"""The static picture of block tables: one row per request, one cell per logical block.

Plain HTML with inline styles only, so it reads the same in an untrusted
notebook (JupyterLab's sanitizer keeps it). A table wider than the site's
column is cut into bands of columns stacked one under another, so it never
needs a horizontal scrollbar.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..block_pool import BlockPool
from ..free_queue import KVCacheBlock
from .style import COLORS, MONO_FONT, escape, owner_color

__all__ = ["normalise_rows", "render_block_table"]

_COLUMN_PX = 680  # the site's text column is 688 px wide at a 1280-px window
_MONO_PX = 7.3  # the width of one character of 12-px monospace text
_CORNER = "request \\ block"
_CELL = "padding:2px 2px;text-align:center;border-radius:3px;min-width:24px"
_HEAD = f"font-weight:normal;color:#868e96;{MONO_FONT};font-size:11px"


def normalise_rows(rows) -> list[tuple[str, list[int]]]:
    """``{name: [blocks or ids]}`` or a list of such lists -> ``[(name, [block ids])]``."""
    items = rows.items() if isinstance(rows, Mapping) else enumerate(rows)
    out = []
    for name, blocks in items:
        ids = [b.block_id if isinstance(b, KVCacheBlock) else int(b) for b in blocks]
        out.append((str(name), ids))
    return out


def _widths(table: list[tuple[str, list[int]]], shown: int) -> tuple[int, int]:
    """(name column px, columns per band), from the longest id and name (monospace text)."""
    digits = max((len(str(b)) for _, ids in table for b in ids[:shown]), default=1)
    cell_px = max(24, round(digits * _MONO_PX) + 4) + 4 + 6 + 3  # text, padding, borders, spacing
    name_px = round(max((len(name) for name, _ in table), default=1) * _MONO_PX) + 14
    name_px = max(name_px, round(len(_CORNER) * 6.6) + 8)
    band = max(4, (_COLUMN_PX - name_px - 40) // cell_px)  # 40: the "... +N" cell of the last band
    return name_px, band


def _cell(name: str, b: int, shared: bool, pool: BlockPool | None) -> str:
    """One ``<td>``: the physical block id in its owner's colour (block 0: the null block)."""
    if b == 0:
        style = f"background:{COLORS['null']};color:#fff;border:1px solid {COLORS['border']}"
    else:
        border = f"3px solid {COLORS['shared']}" if shared else f"1px solid {COLORS['border']}"
        style = f"background:{owner_color(name)};border:{border}"
    hashed = pool is not None and 0 <= b < pool.num_gpu_blocks and pool.blocks[b].block_hash is not None
    mark = "<sup style='font-size:8px'>\u25e5</sup>" if hashed else ""
    tip = "null block" if b == 0 else ("shared" if shared else "")
    return f"<td title='{escape(tip)}' style='{_CELL};{style};{MONO_FONT};font-size:12px'>{b}{mark}</td>"


def _band(table, count: dict[int, int], pool, lo: int, hi: int, shown: int, width: int, name_px: int) -> str:
    """Logical blocks ``lo``..``hi - 1`` of every row as one ``<table>``; the last band carries "... +N"."""
    last = hi >= shown
    head = "".join(f"<th style='{_HEAD}'>{j}</th>" for j in range(lo, hi))
    if last and width > shown:
        head += "<th></th>"
    body = []
    for name, ids in table:
        tds = []
        for b in ids[lo:hi]:
            shared = count[b] > 1 or (pool is not None and 0 < b < pool.num_gpu_blocks
                                      and pool.blocks[b].ref_cnt > 1)
            tds.append(_cell(name, b, shared, pool))
        if last and len(ids) > shown:
            tds.append(f"<td style='color:#868e96;{MONO_FONT};font-size:11px'>\u2026 +{len(ids) - shown}</td>")
        body.append(f"<tr><th style='text-align:right;padding-right:8px;{MONO_FONT};font-size:12px'>"
                    f"{escape(name)}</th>{''.join(tds)}</tr>")
    if not table:
        body.append(f"<tr><td style='color:#868e96;{MONO_FONT};font-size:12px'>(no requests hold blocks)</td></tr>")
    return (f"<table style='border-collapse:separate;border-spacing:3px;margin:0 0 4px 0'>"
            f"<thead><tr><th style='{MONO_FONT};font-size:11px;color:#868e96;min-width:{name_px - 8}px;"
            f"text-align:right'>{_CORNER}</th>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")


def render_block_table(rows, pool: BlockPool | None = None, title: str | None = None,
                       max_columns: int = 32) -> str:
    """Block tables as an HTML table: one row per request, one cell per logical block.

    ``rows`` is ``{request: [blocks or block ids]}`` or a list of such lists.
    A cell holds the physical block id, filled with its row's owner colour (as
    in ``render_pool``); a block that appears in more than one row (or, given
    ``pool``, has ``ref_cnt > 1``) gets the purple "shared" border; block 0 is
    the null block. Given ``pool``, a hashed block gets the corner mark.

    At most ``max_columns`` logical blocks per row are shown (then "... +N").
    Wider tables are cut into bands of columns stacked one under the other
    (logical blocks 0-13, then 14-27, ...), as many columns per band as fit a
    680-px column.
    """
    table = normalise_rows(rows)
    count: dict[int, int] = {}
    for _, ids in table:
        for b in set(ids):
            count[b] = count.get(b, 0) + 1
    width = max((len(ids) for _, ids in table), default=0)
    shown = min(width, max_columns)
    name_px, band = _widths(table, shown)
    bands = [_band(table, count, pool, lo, min(lo + band, shown), shown, width, name_px)
             for lo in range(0, max(shown, 1), band)]
    caption = (f"<div style='text-align:left;font-weight:bold;{MONO_FONT};font-size:13px'>{escape(title)}</div>"
               if title else "")
    return f"<div class='pagedkv-block-table'>{caption}{''.join(bands)}</div>"
