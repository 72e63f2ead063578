"""The static picture of a block pool: an inline SVG grid of blocks and the free queue.

Every physical block is a cell, coloured by its state:

- **null**: block 0, the placeholder (dark grey);
- **in use**: held by at least one request; filled with its owner's colour and
  labelled with the owner and ``ref_cnt`` (a thick purple border when shared);
- **free**: in the free queue, no hash (white): reused first if at the head;
- **cached**: in the free queue *with* a hash (amber): evictable, still matchable.

A small black corner marks any block that carries a hash. Free cells show their
position in the free queue (``q0`` is the head), and a strip under the grid
lists the queue from head to tail. The picture draws 10 blocks a row (about
600 px, inside the site's 688-px column) with its key wrapped; a wider one
(``columns=``) scales down (a ``viewBox`` and ``max-width:100%``).

KV-cache groups. A model with several kinds of layers draws every group's
blocks from one pool (``pagedkv.kv_cache_coordinator``). Given ``groups``
(a coordinator, or ``{block_id: group index}``), an in-use cell takes its
*group's* colour instead of its owner's, its label names both (``A g1``),
and the key lists the groups; ``block_groups`` and ``coordinator_owners``
read both from a coordinator. Without ``groups`` the picture is as above.

Untrusted notebooks. JupyterLab's sanitizer drops ``<svg>`` (keeping its
text), ``<script>`` and ``<style>`` from an untrusted notebook's HTML, and an
``image/svg+xml`` entry would not be drawn there either. So the ``<svg>``
carries, in its ``<desc>``, a plain-HTML twin (one styled ``<span>`` per block
with the same colours, labels and tooltip, then the free queue and a key). A
browser never draws a ``<desc>``; where the sanitizer strips the SVG, the twin
is what remains, and the SVG's own labels, left behind as bare text, stay
invisible in the ``font-size:0`` wrapper.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..block_pool import BlockPool
from ..free_queue import KVCacheBlock
from ..common import cdiv
from ..hashing import short_hash
from .owners import Owners, owner_labels
from .style import COLORS, MONO_FONT, cell_svg, escape, fit, owner_color

__all__ = ["BlockCell", "describe_blocks", "render_pool", "block_groups", "coordinator_owners",
           "group_names", "group_color"]

_CELL_W, _CELL_H, _GAP, _PAD = 54, 44, 4, 8


@dataclass(frozen=True)
class BlockCell:
    """What the picture shows for one block."""

    block_id: int
    state: str  # "null" | "in use" | "free" | "cached"
    ref_cnt: int
    owners: tuple[str, ...]
    queue_position: int | None  # 0 = head of the free queue; None when not free
    block_hash: object


def describe_blocks(pool: BlockPool, owners: Owners = None) -> list[BlockCell]:
    """The state of every block as the views draw it (the pictures are made from this)."""
    labels = owner_labels(owners)
    position = {b.block_id: i for i, b in enumerate(pool.free_block_queue.get_all_free_blocks())}
    cells = []
    for block in pool.blocks:
        if block.is_null:
            state = "null"
        elif block.ref_cnt > 0:
            state = "in use"
        else:
            state = "cached" if block.block_hash is not None else "free"
        names = tuple(labels.get(block.block_id, ())) if state == "in use" else ()
        cells.append(BlockCell(block.block_id, state, block.ref_cnt if not block.is_null else 0, names,
                               position.get(block.block_id), block.block_hash))
    return cells


# ------------------------------------------------------------ groups
def group_color(group_id: int) -> str:
    """Group ``g``'s fill: the palette's ``g``-th colour, as ``owner_color("g<g>")`` gives it,
    so the pool picture and the paged layout (whose rows are named ``"A g1"``) agree."""
    return owner_color(f"g{group_id}")


def _managers(coordinator) -> list:
    managers = getattr(coordinator, "single_type_managers", None)
    if managers is None:
        raise TypeError(f"expected a KV-cache coordinator (with single_type_managers), "
                        f"got {type(coordinator).__name__}")
    return list(managers)


def block_groups(coordinator) -> dict[int, int]:
    """``{block_id: group index}`` for every block a group's table holds (the null block
    left out), and for both ends of a pending copy. A block is in one group at a time."""
    found: dict[int, int] = {}
    for gid, manager in enumerate(_managers(coordinator)):
        for blocks in manager.req_to_blocks.values():
            for b in blocks:
                if not b.is_null:
                    found[b.block_id] = gid
        for pair in getattr(manager, "pending_cow_copies", ()):
            for b in pair:
                found.setdefault(b.block_id, gid)
    return found


def coordinator_owners(coordinator) -> dict[str, list[int]]:
    """``{request id: [block ids]}`` over all groups (null entries left out): an ``owners`` mapping."""
    owners: dict[str, list[int]] = {}
    for manager in _managers(coordinator):
        for rid, blocks in manager.req_to_blocks.items():
            owners.setdefault(rid, []).extend(b.block_id for b in blocks if not b.is_null)
    return owners


def group_names(coordinator) -> list[str]:
    """One short name per group, from its spec: ``full``, ``window 8``, ``mamba``."""
    names = []
    for manager in _managers(coordinator):
        spec = manager.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        kind = type(spec).__name__
        names.append(f"window {window}" if window is not None else
                     "mamba" if kind.startswith("Mamba") else "full" if "Full" in kind else kind)
    return names


def _resolve_groups(groups, names):
    """``groups`` (a coordinator, a mapping or a function returning one) as
    ``({block_id: group}, [group names])``; ``(None, None)`` without groups."""
    if groups is None:
        return None, None
    if hasattr(groups, "single_type_managers"):
        return block_groups(groups), list(names) if names is not None else group_names(groups)
    if callable(groups):
        groups = groups()
    mapping = {int(b): int(g) for b, g in dict(groups).items()}
    if names is None:
        names = [f"group {g}" for g in range(max(mapping.values(), default=-1) + 1)]
    return mapping, list(names)


def _block_look(cell: BlockCell, group: int | None = None) -> dict:
    """Fill, text and border of one block's cell, from its state (and its group, if any)."""
    b = cell.block_id
    hashed = cell.block_hash is not None
    if cell.state == "in use" and group is not None:
        who = "+".join(cell.owners) if cell.owners else ""
        shared = cell.ref_cnt > 1
        return dict(fill=group_color(group), lines=[str(b), fit(f"{who} g{group}".strip(), 8),
                                                    f"ref {cell.ref_cnt}"], hashed=hashed,
                    border=COLORS["shared"] if shared else COLORS["border"], border_width=3 if shared else 1,
                    tooltip=f"block {b}: in use by group {group}{' (' + who + ')' if who else ''}, "
                            f"ref_cnt={cell.ref_cnt}" + (f", hash {short_hash(cell.block_hash)}" if hashed else ""))
    if cell.state == "null":
        return dict(fill=COLORS["null"], lines=[str(b), "null"], text_color="#ffffff",
                    tooltip=f"block {b}: the null block (placeholder, never allocated)")
    if cell.state == "in use":
        who = "+".join(cell.owners) if cell.owners else "in use"
        fill = owner_color(cell.owners[0]) if cell.owners else COLORS["in use"]
        shared = cell.ref_cnt > 1
        return dict(fill=fill, lines=[str(b), fit(who, 8), f"ref {cell.ref_cnt}"], hashed=hashed,
                    border=COLORS["shared"] if shared else COLORS["border"], border_width=3 if shared else 1,
                    tooltip=f"block {b}: in use{' by ' + who if cell.owners else ''}, ref_cnt={cell.ref_cnt}"
                            + (f", hash {short_hash(cell.block_hash)}" if hashed else ""))
    q = cell.queue_position
    if cell.state == "cached":
        return dict(fill=COLORS["cached"], lines=[str(b), short_hash(cell.block_hash, 6), f"q{q}"],
                    hashed=True, dashed=True,
                    tooltip=f"block {b}: free and cached (evictable), hash {short_hash(cell.block_hash)}, "
                            f"free-queue position {q}")
    return dict(fill=COLORS["free"], lines=[str(b), "", f"q{q}"],
                tooltip=f"block {b}: free, no hash, free-queue position {q}")


_LEGEND = [
    (COLORS["null"], "null block", {}),
    (owner_color("A"), "in use (owner, ref_cnt)", {}),
    ("#ffffff", "in use, shared (ref_cnt > 1)", {"border": COLORS["shared"], "border_width": 3}),
    (COLORS["free"], "free, no hash", {}),
    (COLORS["cached"], "free, cached (evictable)", {"dashed": True, "hashed": True}),
]


def _legend(x: int, y: int, width: int, names: Sequence[str] | None = None) -> tuple[str, int]:
    """The colour key, wrapped onto as many lines as ``width`` needs; returns (svg, height).
    With group ``names``, one entry per group replaces the owner entry."""
    parts, cx, cy = [], x, y
    items = _LEGEND
    if names is not None:
        items = [_LEGEND[0], *[(group_color(g), f"g{g}: {n}", {}) for g, n in enumerate(names)], *_LEGEND[2:]]
    for fill, text, extra in items:
        item_w = 24 + 7 * len(text)
        if cx > x and cx + item_w > x + width:
            cx, cy = x, cy + 20
        parts.append(cell_svg(cx, cy, 14, 14, fill, [], **extra))
        parts.append(f"<text x='{cx + 19}' y='{cy + 11}' font-size='11' fill='#212529' "
                     f"style='{MONO_FONT}'>{escape(text)}</text>")
        cx += item_w
    return "".join(parts), cy - y + 20


# The plain-HTML twin of a pool picture (see "Untrusted notebooks" above).
_HTML_FONT = "font-family:monospace;font-size:11px;line-height:1.3;color:#212529"


def _fallback_cell(cell: BlockCell, highlight: bool, group: int | None = None) -> str:
    look = _block_look(cell, group)
    border = f"{look.get('border_width', 1):g}px {'dashed' if look.get('dashed') else 'solid'} " \
             f"{look.get('border', COLORS['border'])}"
    label = " ".join(line for line in look["lines"][1:] if line)
    return (f"<span title='{escape(look['tooltip'])}' style='display:inline-block;width:50px;margin:1px;"
            f"padding:1px 0;text-align:center;vertical-align:top;border-radius:3px;border:{border};"
            f"background:{look['fill']};color:{look.get('text_color', '#212529')}"
            f"{';box-shadow:0 0 0 2px ' + COLORS['highlight'] if highlight else ''}'>"
            f"<b>{cell.block_id}</b><br>{escape(label) or '&nbsp;'}</span>")


def _pool_fallback(heading: str, cells: Sequence[BlockCell], queue: Sequence[KVCacheBlock | None],
                   highlight: set[int], groups: dict[int, int] | None = None) -> str:
    """The pool as plain HTML: what an untrusted notebook shows where it strips the SVG."""
    groups = groups or {}
    ids = " ".join("\u2026" if b is None else str(b.block_id) + ("*" if b.block_hash is not None else "")
                   for b in queue)
    return (f"<div style='{_HTML_FONT};max-width:640px;white-space:normal'><div><b>{escape(heading)}</b></div>"
            f"<div>{''.join(_fallback_cell(c, c.block_id in highlight, _group_of(c, groups)) for c in cells)}</div>"
            f"<div>free queue from its head: {escape(ids) or '(empty)'} (* = cached)</div>"
            f"<div style='color:#495057'>grey: null block; coloured: in use (owner, ref_cnt; purple border: "
            f"shared); white: free; amber, dashed: free but cached (evictable); qN: free-queue position</div></div>")


def _heading(pool: BlockPool, queue: Sequence[KVCacheBlock], drawn: int, title: str | None) -> str:
    """The line above the grid: free and cached counts, usage, and how many blocks are drawn."""
    n = pool.num_gpu_blocks
    num_cached = sum(1 for b in queue if b.block_hash is not None)
    summary = (f"{pool.get_num_free_blocks()} of {n - 1} blocks free ({num_cached} cached), "
               f"usage {pool.get_usage():.0%}")
    if drawn < n:
        summary += f"; blocks 0-{drawn - 1} drawn"
    return f"{title} \u2014 {summary}" if title else summary


def _group_of(cell: BlockCell, groups: dict[int, int] | None) -> int | None:
    return groups.get(cell.block_id) if groups and cell.state == "in use" else None


def _draw_grid(parts: list[str], cells: Sequence[BlockCell], cols: int, y: int, highlight: set[int],
               groups: dict[int, int] | None = None) -> int:
    """One cell per block, ``cols`` to a row, from ``y``; returns the y under the grid."""
    for cell in cells:
        r, c = divmod(cell.block_id, cols)
        parts.append(cell_svg(_PAD + c * (_CELL_W + _GAP), y + r * (_CELL_H + _GAP), _CELL_W, _CELL_H,
                              highlight=cell.block_id in highlight, **_block_look(cell, _group_of(cell, groups))))
    return y + cdiv(len(cells), cols) * (_CELL_H + _GAP) + 8


def _draw_queue(parts: list[str], queue: list[KVCacheBlock], y: int, width: int, highlight: set[int],
                queue_limit: int) -> tuple[list[KVCacheBlock | None], int]:
    """The free queue, head to tail (a long one: its first and last few, with a gap).

    Returns the blocks drawn (``None`` for the gap) and the y under the strip.
    """
    parts.append(f"<text x='{_PAD}' y='{y + 11}' font-size='11' fill='#212529' style='{MONO_FONT}'>"
                 f"free queue, head \u2192 tail ({len(queue)}): allocation pops the head</text>")
    y += 18
    shown: list[KVCacheBlock | None] = list(queue)
    if len(queue) > queue_limit:
        shown = queue[: queue_limit - 8] + [None] + queue[-8:]
    qw, qh, x = 30, 22, _PAD
    for block in shown:
        if x + qw > width - _PAD:
            x, y = _PAD, y + qh + 6
        if block is None:
            parts.append(f"<text x='{x + qw / 2:g}' y='{y + 15}' text-anchor='middle' font-size='12' "
                         f"fill='#212529'>\u2026</text>")
        else:
            hashed = block.block_hash is not None
            parts.append(cell_svg(x, y, qw, qh, COLORS["cached"] if hashed else COLORS["free"],
                                  [str(block.block_id)], dashed=hashed, hashed=hashed,
                                  highlight=block.block_id in highlight,
                                  tooltip=f"block {block.block_id}" + (" (cached)" if hashed else "")))
        x += qw + 4
    if not queue:
        parts.append(f"<text x='{_PAD}' y='{y + 15}' font-size='11' fill='#868e96' "
                     f"style='{MONO_FONT}'>(empty)</text>")
    return shown, y + qh + 12


def render_pool(pool: BlockPool, owners: Owners = None, title: str | None = None,
                highlight: Iterable[int] = (), columns: int | None = None, queue_limit: int = 40,
                max_cells: int = 512, groups=None, names: Sequence[str] | None = None) -> str:
    """The pool as an inline SVG inside a ``<div>``: a grid of blocks and the free queue.

    ``highlight`` outlines some block ids (the ones the last operation touched).
    ``groups`` (a coordinator, ``{block_id: group}`` or a function returning
    one) colours in-use blocks by KV-cache group; ``names`` names the groups
    in the key (a coordinator's are read from its specs).
    Only the first ``max_cells`` blocks are drawn (the heading says so): the
    picture is for pools small enough to look at. Deterministic: the same pool
    state gives the same string.
    """
    cells = describe_blocks(pool, owners)[:max_cells]
    group_map, names = _resolve_groups(groups, names)
    highlight = set(highlight)
    queue = pool.free_block_queue.get_all_free_blocks()
    cols = columns or min(pool.num_gpu_blocks, 10)
    width = max(_PAD * 2 + cols * (_CELL_W + _GAP), 600)
    heading = _heading(pool, queue, len(cells), title)
    parts = [f"<text x='{_PAD}' y='{_PAD + 12}' font-size='13' font-weight='bold' fill='#212529' "
             f"style='{MONO_FONT}'>{escape(heading)}</text>"]
    y = _draw_grid(parts, cells, cols, _PAD + 22, highlight, group_map)
    shown, y = _draw_queue(parts, queue, y, width, highlight, queue_limit)
    legend, legend_h = _legend(_PAD, y, width - 2 * _PAD, names)
    parts.append(legend)
    y += legend_h + 2
    # font-size:0 on the wrapper: where a sanitizer strips the SVG, its labels
    # would spill out as a run of text; they stay invisible, and the HTML twin
    # in <desc> (never drawn while the SVG stands) shows instead.
    return (f"<div class='pagedkv-pool' style='font-size:0;line-height:0'>"
            f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{y}' "
            f"viewBox='0 0 {width} {y}' style='max-width:100%;height:auto' role='img' "
            f"aria-label='{escape(heading)}'><rect width='{width}' height='{y}' fill='#ffffff'/>{''.join(parts)}"
            f"<desc>{_pool_fallback(heading, cells, shown, highlight, group_map)}</desc></svg></div>")
