"""PagedAttention's own picture: logical blocks, block-table entries, physical blocks in the pool.

The figure Kwon et al. (2023) draw for PagedAttention (their Figures 6 and 7),
drawn from a live state. Each request's tokens fill *logical* blocks 0, 1,
2, ... in order; its block-table row maps each logical block to a *physical*
block somewhere in the pool; a line in the request's colour joins the two.
The column in the middle is the pool, block ids top to bottom:

- a logical block is a strip of ``block_size`` slots: filled slots in the
  request's colour, the unfilled **tail slots** of its last block white and
  dashed (allocated, not yet written);
- beside it, the block-table entry: the physical block id;
- a physical block shows the slots its holders filled, in its owner's colour;
  a **shared** block (``ref_cnt > 1``, or named by more than one row) has the
  thick purple border of ``render_pool``, one colour band per holder and
  ``ref N``; free blocks are white, cached ones amber and dashed, block 0 is
  the null block; a run of blocks no row names is folded into one line.

Requests alternate between the left and the right of the pool (the first on
the left), so that no line crosses another request's blocks. The SVG is 680
px wide with a ``viewBox`` (it scales down with the column) and sits in a
``pagedkv-pool`` wrapper, so the site treats it as it treats the pool picture
(dark mode inverts it; on a phone it scrolls sideways). As there, an HTML
twin in the ``<desc>`` is what an untrusted notebook shows.

``describe_layout`` gives the data the picture is drawn from;
``render_paged_layout`` the static HTML; ``PagedLayoutView`` the live view
(redrawn as the pool changes, and after every cell, since token counts change
without any pool event).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..block_pool import BlockPool
from ..block_table import BlockTable
from ..free_queue import KVCacheBlock
from ..kv_cache_manager import KVCacheManager
from ..request import Request
from .following import EngineFollower, FollowingView, follow_engine, on_cell_end
from .style import COLORS, MONO_FONT, escape, fit, owner_color

try:  # optional: the static rendering works without it
    import ipywidgets as _ipywidgets
except ImportError:  # pragma: no cover - exercised by a test that hides the module
    _ipywidgets = None

__all__ = ["LogicalBlock", "RequestLayout", "PhysicalBlock", "PagedLayout", "describe_layout",
           "render_paged_layout", "PagedLayoutView"]


# ------------------------------------------------------------------ the data
@dataclass(frozen=True)
class LogicalBlock:
    """Logical block ``index`` of a request: the physical block its table names, and its slots."""

    index: int
    block_id: int
    filled: int  # slots holding a token (block_size for a full block)
    block_size: int

    @property
    def tail(self) -> int:
        """Allocated slots not yet written (non-zero only at the end of a request)."""
        return self.block_size - self.filled


@dataclass(frozen=True)
class RequestLayout:
    """One request: its name, its tokens, its logical blocks in order."""

    name: str
    num_tokens: int
    blocks: tuple[LogicalBlock, ...]

    @property
    def block_ids(self) -> list[int]:
        """The block-table row."""
        return [b.block_id for b in self.blocks]

    @property
    def tail_slots(self) -> int:
        """Allocated slots past the request's last token."""
        return sum(b.tail for b in self.blocks)


@dataclass(frozen=True)
class PhysicalBlock:
    """One block of the pool as the picture shows it."""

    block_id: int
    state: str  # "null" | "in use" | "free" | "cached" | "unknown" (no pool given, no row names it)
    ref_cnt: int  # the pool's count (without a pool: how many rows name it)
    holders: tuple[tuple[str, int], ...]  # (request, logical index) of every row entry naming it
    filled: int  # the most slots any holder filled

    @property
    def shared(self) -> bool:
        return self.ref_cnt > 1 or len({name for name, _ in self.holders}) > 1


@dataclass(frozen=True)
class PagedLayout:
    """What ``render_paged_layout`` draws: the requests and the pool's blocks."""

    block_size: int
    num_pool_blocks: int | None  # None when no pool was given
    requests: tuple[RequestLayout, ...]
    physical: tuple[PhysicalBlock, ...]  # blocks 0 .. the highest id any row names (or the pool's end)

    def block(self, block_id: int) -> PhysicalBlock:
        return self.physical[block_id]

    def shared_blocks(self) -> dict[int, list[str]]:
        """``{block_id: [request, ...]}`` for the blocks more than one request names."""
        return {p.block_id: sorted({n for n, _ in p.holders}) for p in self.physical
                if len({n for n, _ in p.holders}) > 1}


def _block_id(block) -> int:
    return block.block_id if isinstance(block, KVCacheBlock) else int(block)


def _rows_from(source, requests, num_tokens):
    """``[(name, [block ids], tokens or None)]``, the pool and the block size ``source`` gives."""
    tokens = dict(num_tokens or {})
    if isinstance(source, KVCacheManager):
        if requests is None:
            requests = list(source.req_to_blocks)
        rows = []
        for req in requests:
            rid = req.request_id if isinstance(req, Request) else str(req)
            holder = req if isinstance(req, Request) else source._holders.get(rid)
            n = tokens.get(rid, holder.num_computed_tokens if holder is not None else None)
            rows.append((rid, source.get_block_ids(rid), n))
        return rows, source.block_pool, source.block_size
    if hasattr(source, "single_type_managers"):  # a KV-cache coordinator: a row per request per group
        sizes = {m.block_size for m in source.single_type_managers}
        if len(sizes) != 1:
            raise ValueError(f"the groups' block sizes differ ({sorted(sizes)}): draw one group at a time")
        ids = {}
        for m in source.single_type_managers:
            for rid in m.req_to_blocks:
                ids.setdefault(rid, None)
        rows = []
        for req in (list(ids) if requests is None else requests):
            rid = req.request_id if isinstance(req, Request) else str(req)
            n = tokens.get(rid, req.num_computed_tokens if isinstance(req, Request) else None)
            # Named "<id> g<group>": owner_color gives group g the palette's g-th colour.
            rows += [(f"{rid} g{g}", row, n) for g, row in enumerate(source.get_block_ids(rid))]
        return rows, source.block_pool, sizes.pop()
    if isinstance(source, BlockTable):
        names = (dict(requests) if requests is not None else
                 {r: f"row {r}" for r in range(source.max_num_reqs) if source.num_blocks_per_row[r]})
        rows = [(str(name), [int(b) for b in source.np[r, : source.num_blocks_per_row[r]]],
                 tokens.get(str(name))) for r, name in sorted(names.items())]
        return rows, None, None
    if isinstance(source, Mapping):
        rows = [(str(name), [_block_id(b) for b in blocks], tokens.get(str(name)))
                for name, blocks in source.items()]
        return rows, None, None
    raise TypeError("describe_layout needs a KVCacheManager, a BlockTable or a mapping "
                    f"{{request: [block ids]}} (or a KV-cache coordinator), got {type(source).__name__}")


def describe_layout(source, requests=None, *, num_tokens: Mapping[str, int] | None = None,
                    block_size: int | None = None, pool: BlockPool | None = None) -> PagedLayout:
    """The state ``render_paged_layout`` draws, from a live manager, a block table or plain rows.

    ``source`` is one of:

    - a ``KVCacheManager``: ``requests`` are the ``Request`` objects (or ids)
      to draw, in order (default: every request holding blocks); a request's
      filled slots are its ``num_computed_tokens``; the pool and the block
      size are the manager's;
    - a KV-cache coordinator: one row per request and group, named
      ``"A g1"`` and coloured by group (null entries point at block 0);
    - a ``BlockTable``: ``requests`` maps row -> name (default: every
      non-empty row, named ``row r``); give ``block_size``;
    - a mapping ``{name: [block ids or KVCacheBlocks]}``; give ``block_size``.

    ``num_tokens`` (``{name: tokens}``) overrides how many slots a request
    filled; a request with no count is drawn with its blocks full. ``pool``
    (given or the manager's) supplies ``ref_cnt`` and the free/cached states.
    """
    rows, own_pool, own_block_size = _rows_from(source, requests, num_tokens)
    pool = pool if pool is not None else own_pool
    block_size = block_size if block_size is not None else own_block_size
    if block_size is None:
        raise TypeError("block_size is needed unless source is a KVCacheManager")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    layouts, holders = [], {}
    for name, ids, n in rows:
        capacity = len(ids) * block_size
        n = capacity if n is None else int(n)
        if not 0 <= n <= capacity:
            raise ValueError(f"request {name!r}: {n} tokens do not fit its {len(ids)} blocks of {block_size}")
        blocks = tuple(LogicalBlock(i, b, min(block_size, max(0, n - i * block_size)), block_size)
                       for i, b in enumerate(ids))
        layouts.append(RequestLayout(name, n, blocks))
        for blk in blocks:
            holders.setdefault(blk.block_id, []).append((name, blk.index, blk.filled))
    highest = max(holders, default=0)
    count = pool.num_gpu_blocks if pool is not None else highest + 1
    if highest >= count:
        raise ValueError(f"block {highest} is not a block of the {count}-block pool")
    physical = []
    for b in range(count):
        held = holders.get(b, [])
        if pool is not None:
            block = pool.blocks[b]
            ref = 0 if block.is_null else block.ref_cnt
            state = ("null" if block.is_null else "in use" if ref > 0 else
                     "cached" if block.block_hash is not None else "free")
        else:
            ref = len(held)
            state = "null" if b == 0 else ("in use" if held else "unknown")
        physical.append(PhysicalBlock(b, state, ref, tuple((n, i) for n, i, _ in held),
                                      max((f for *_, f in held), default=0)))
    return PagedLayout(block_size, pool.num_gpu_blocks if pool is not None else None,
                       tuple(layouts), tuple(physical))


# --------------------------------------------------------------- the picture
_W = 680  # the site's column is 688 px
_PAD, _ROW, _STRIP_H = 8, 18, 14
_STRIP = 128  # a block's slots, px
_INDEX_W, _ENTRY_W, _GAP = 16, 30, 4
_GROUP = _INDEX_W + _STRIP + _GAP + _ENTRY_W  # one side's request column
_POOL_ID, _POOL_REF = 26, 40
_POOL = _POOL_ID + _STRIP + _POOL_REF
_POOL_X = (_W - _POOL) // 2
_TEXT = "#212529"
_MUTED = "#495057"


def _darker(color: str, f: float = 0.55) -> str:
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    return "#{:02x}{:02x}{:02x}".format(*(round(c * f) for c in (r, g, b)))


def _text(x, y, s, size=11, anchor="start", weight="normal", fill=_TEXT) -> str:
    return (f"<text x='{x:g}' y='{y:g}' font-size='{size}' font-weight='{weight}' text-anchor='{anchor}' "
            f"fill='{fill}' style='{MONO_FONT}'>{escape(s)}</text>")


def _slots(x, y, block_size, filled, fills: Sequence[str], tail_color: str | None) -> str:
    """A block's strip: ``filled`` slots in ``fills`` (one band each), the rest white (dashed if a tail)."""
    w = _STRIP / block_size
    parts = []
    if filled:
        band = _STRIP_H / len(fills)
        for k, fill in enumerate(fills):
            parts.append(f"<rect x='{x}' y='{y + k * band:g}' width='{filled * w:g}' height='{band:g}' "
                         f"fill='{fill}'/>")
    if filled < block_size:
        dash = f" stroke='{tail_color}' stroke-dasharray='3 2'" if tail_color else " stroke='none'"
        parts.append(f"<rect x='{x + filled * w:g}' y='{y + 0.5}' width='{(block_size - filled) * w - 0.5:g}' "
                     f"height='{_STRIP_H - 1}' fill='#ffffff'{dash}/>")
    if w >= 4:  # slot separators, where a slot is wide enough to see
        for s in range(1, block_size):
            parts.append(f"<line x1='{x + s * w:g}' y1='{y}' x2='{x + s * w:g}' y2='{y + _STRIP_H}' "
                         f"stroke='#ffffff' stroke-width='0.8'/>")
    return "".join(parts)


def _pool_rows(layout: PagedLayout, drawn: set[int], fold: int) -> list[tuple[int, int]]:
    """The pool column's rows as (first, last) block ids; a range longer than one is a folded run.

    Block 0 and every block a drawn entry names get a row; a run of more than
    ``fold`` other blocks becomes one line.
    """
    named = [p.block_id == 0 or p.block_id in drawn for p in layout.physical]
    rows, b, n = [], 0, len(named)
    while b < n:
        if named[b]:
            rows.append((b, b))
            b += 1
            continue
        end = b
        while end + 1 < n and not named[end + 1]:
            end += 1
        if end - b + 1 > fold:
            rows.append((b, end))
        else:
            rows.extend((i, i) for i in range(b, end + 1))
        b = end + 1
    return rows


def _run_label(layout: PagedLayout, lo: int, hi: int) -> str:
    states = [p.state for p in layout.physical[lo:hi + 1]]
    kinds = sorted(set(states), key=["free", "cached", "in use", "unknown"].index)
    what = {"free": "free", "cached": "cached", "in use": "in use (not drawn)", "unknown": "in no row"}
    desc = ", ".join(f"{states.count(k)} {what[k]}" for k in kinds) if len(kinds) > 1 else what[kinds[0]]
    return f"\u22ee blocks {lo}-{hi}: {desc}"


def _physical_look(p: PhysicalBlock) -> tuple[list[str], str, float, bool, str]:
    """(band fills, border, border width, dashed, right-hand label) of a pool row."""
    if p.state == "null":
        return [COLORS["null"]], COLORS["border"], 1.0, False, "null"
    if p.holders or p.state == "in use":
        names = list(dict.fromkeys(n for n, _ in p.holders)) or ["?"]
        fills = [owner_color(n) if n != "?" else COLORS["in use"] for n in names]
        label = f"ref {p.ref_cnt}" if p.ref_cnt else ""
        if p.shared:
            return fills, COLORS["shared"], 3.0, False, label
        return fills, COLORS["border"], 1.0, False, label
    if p.state == "cached":
        return [COLORS["cached"]], COLORS["border"], 1.0, True, "cached"
    return [COLORS["free"]], COLORS["border"], 1.0, False, "free" if p.state == "free" else ""


_LEGEND = [
    ("filled slot", dict(fill=owner_color("a"))),
    ("tail slot (empty)", dict(fill="#ffffff", stroke=_darker(owner_color("a")), dash=True)),
    ("shared (ref_cnt > 1)", dict(fill="#ffffff", stroke=COLORS["shared"], width=3)),
    ("free", dict(fill=COLORS["free"])),
    ("cached (free)", dict(fill=COLORS["cached"], dash=True)),
    ("null block", dict(fill=COLORS["null"])),
]


def _legend(y: int) -> tuple[str, int]:
    parts, x = [], _PAD
    for text, look in _LEGEND:
        w = 22 + round(6.6 * len(text))
        if x > _PAD and x + w > _W - _PAD:
            x, y = _PAD, y + 18
        dash = " stroke-dasharray='3 2'" if look.get("dash") else ""
        parts.append(f"<rect x='{x}' y='{y}' width='14' height='12' rx='2' fill='{look['fill']}' "
                     f"stroke='{look.get('stroke', COLORS['border'])}' stroke-width='{look.get('width', 1)}'{dash}/>")
        parts.append(_text(x + 19, y + 10, text))
        x += w
    return "".join(parts), y + 18


def _summary(layout: PagedLayout, pool_rows_drawn: int) -> str:
    n = len(layout.requests)  # rows named "A g1" come from a coordinator: one per request and group
    kind = "group row" if n and all(" g" in r.name and r.name.rsplit(" g", 1)[1].isdigit()
                                    for r in layout.requests) else "request"
    s = f"{n} {kind}{'s' if n != 1 else ''}, blocks of {layout.block_size} tokens"
    if layout.num_pool_blocks is not None:
        free = sum(p.state in ("free", "cached") for p in layout.physical)
        s += f"; pool of {layout.num_pool_blocks} blocks, {free} free"
    shared = layout.shared_blocks()
    if shared:
        s += f"; {len(shared)} shared"
    return s


def _fallback(heading: str, layout: PagedLayout) -> str:
    """The picture as plain HTML lines (what an untrusted notebook shows where it strips the SVG)."""
    lines = [f"<div><b>{escape(heading)}</b></div>"]
    for r in layout.requests:
        entries = ", ".join(f"{b.index}\u2192{b.block_id}" + (f" ({b.filled}/{b.block_size})" if b.tail else "")
                            for b in r.blocks)
        lines.append(f"<div><span style='background:{owner_color(r.name)}'>&#160;{escape(r.name)}&#160;</span> "
                     f"{r.num_tokens} tokens, tail {r.tail_slots} slots; logical\u2192physical: "
                     f"{escape(entries) or '(none)'}</div>")
    shared = layout.shared_blocks()
    if shared:
        lines.append("<div>shared: " + escape("; ".join(f"block {b} by {'+'.join(n)}" for b, n in shared.items()))
                     + "</div>")
    return (f"<div style='font-family:monospace;font-size:11px;line-height:1.4;color:{_TEXT};max-width:640px;"
            f"white-space:normal'>{''.join(lines)}</div>")


def _drawn_entries(r: RequestLayout, max_blocks: int) -> list[LogicalBlock | None]:
    """The logical blocks drawn for ``r``: all, or the first ones and the last, ``None`` for the gap."""
    if len(r.blocks) <= max_blocks:
        return list(r.blocks)
    return [*r.blocks[: max_blocks - 2], None, r.blocks[-1]]


def _draw_pool(parts: list[str], layout: PagedLayout, rows: list[tuple[int, int]], top: float) -> dict[int, float]:
    """The pool column, ids top to bottom, from ``top``; returns ``{block_id: y of its middle}``."""
    pool_y: dict[int, float] = {}
    y = top
    sx = _POOL_X + _POOL_ID
    for lo, hi in rows:
        if lo != hi:
            parts.append(_text(_POOL_X + _POOL / 2, y + 11, _run_label(layout, lo, hi), size=10,
                               anchor="middle", fill=_MUTED))
            y += _ROW
            continue
        p = layout.physical[lo]
        fills, border, bw, dashed, label = _physical_look(p)
        held = bool(p.holders) or p.state == "in use"
        filled = p.filled if held and p.state != "null" else layout.block_size
        tail = _darker(fills[0]) if held and p.state != "null" else None
        parts.append(f"<g><title>{escape(_physical_tip(p))}</title>")
        parts.append(_text(sx - 4, y + 11, str(lo), anchor="end", weight="bold"))
        parts.append(_slots(sx, y, layout.block_size, filled, fills, tail))
        dash = " stroke-dasharray='4 2'" if dashed else ""
        parts.append(f"<rect x='{sx}' y='{y}' width='{_STRIP}' height='{_STRIP_H}' rx='2' fill='none' "
                     f"stroke='{border}' stroke-width='{bw:g}'{dash}/>")
        parts.append(_text(sx + _STRIP + 4, y + 11, label, size=10, fill=_TEXT if p.shared else _MUTED,
                           weight="bold" if p.shared else "normal"))
        parts.append("</g>")
        pool_y[lo] = y + _STRIP_H / 2
        y += _ROW
    return pool_y


def _draw_request(parts: list[str], lines: list[str], layout: PagedLayout, r: RequestLayout,
                  entries: list[LogicalBlock | None], side: str, y: float, pool_y: dict[int, float]) -> float:
    """One request's header and logical blocks on ``side`` from ``y``, and its lines; returns the y under it."""
    gx = _PAD if side == "left" else _W - _PAD - _GROUP
    color, dark = owner_color(r.name), _darker(owner_color(r.name))
    head = f"{fit(r.name, 10)}: {r.num_tokens} tokens" + (f", tail {r.tail_slots}" if r.tail_slots else "")
    parts.append(f"<rect x='{gx}' y='{y + 1}' width='10' height='10' rx='2' fill='{color}' stroke='{dark}'/>")
    parts.append(_text(gx + 14, y + 10, head, weight="bold"))
    y += 16
    for blk in entries:
        if side == "left":
            ix, sx, ex = gx + _INDEX_W - 4, gx + _INDEX_W, gx + _INDEX_W + _STRIP + _GAP
            start, end = ex + _ENTRY_W, _POOL_X
        else:
            ex, sx = gx, gx + _ENTRY_W + _GAP
            ix = sx + _STRIP + 4
            start, end = ex, _POOL_X + _POOL
        if blk is None:
            hidden = len(r.blocks) - len(entries) + 1
            parts.append(_text(sx + _STRIP / 2, y + 11, f"\u22ee {hidden} more blocks", size=10,
                               anchor="middle", fill=_MUTED))
            y += _ROW
            continue
        tip = (f"{r.name}, logical block {blk.index} -> physical block {blk.block_id}: "
               f"{blk.filled} of {blk.block_size} slots filled" + (f", {blk.tail} tail slots" if blk.tail else ""))
        shared = layout.physical[blk.block_id].shared
        parts.append(f"<g><title>{escape(tip)}</title>")
        parts.append(_text(ix, y + 11, str(blk.index), size=10, anchor="end" if side == "left" else "start",
                           fill=_MUTED))
        parts.append(_slots(sx, y, blk.block_size, blk.filled, [color], dark if blk.tail else None))
        parts.append(f"<rect x='{sx}' y='{y}' width='{_STRIP}' height='{_STRIP_H}' rx='2' fill='none' "
                     f"stroke='{dark}' stroke-width='1'/>")
        parts.append(f"<rect x='{ex}' y='{y}' width='{_ENTRY_W}' height='{_STRIP_H}' rx='2' fill='#ffffff' "
                     f"stroke='{COLORS['shared'] if shared else COLORS['border']}' "
                     f"stroke-width='{2 if shared else 1}'/>")
        parts.append(_text(ex + _ENTRY_W / 2, y + 11, str(blk.block_id), anchor="middle", weight="bold"))
        parts.append("</g>")
        y0, y1, mid = y + _STRIP_H / 2, pool_y[blk.block_id], (start + end) / 2
        lines.append(f"<path d='M{start:g},{y0:g} C{mid:g},{y0:g} {mid:g},{y1:g} {end:g},{y1:g}' "
                     f"fill='none' stroke='{dark}' stroke-width='1.3' stroke-opacity='0.85'/>")
        y += _ROW
    return y + 10


def render_paged_layout(source, requests=None, *, num_tokens: Mapping[str, int] | None = None,
                        block_size: int | None = None, pool: BlockPool | None = None, title: str | None = None,
                        fold: int = 3, max_blocks: int = 16) -> str:
    """PagedAttention's picture of ``source`` (see ``describe_layout``) as an inline SVG in a ``<div>``.

    Logical blocks of each request (left and right of the pool, alternating),
    their block-table entries, and lines to the physical blocks in the pool
    column between them; tail slots dashed, shared blocks with a purple
    border. A request with more than ``max_blocks`` blocks shows its first
    ones and its last; a run of more than ``fold`` blocks that no drawn entry
    names is folded into one line. Deterministic: the same state gives the
    same string.
    """
    layout = describe_layout(source, requests, num_tokens=num_tokens, block_size=block_size, pool=pool)
    if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 3:
        raise ValueError(f"max_blocks must be an int >= 3, got {max_blocks!r}")
    entries = [_drawn_entries(r, max_blocks) for r in layout.requests]
    drawn = {blk.block_id for es in entries for blk in es if blk is not None}
    pool_rows = _pool_rows(layout, drawn, fold)
    summary = _summary(layout, len(pool_rows))
    heading = f"{title}: {summary}" if title else summary
    parts = []
    y = _PAD + 12
    if title:
        parts.append(_text(_PAD, y, fit(title, 80), size=13, weight="bold"))
        y += 17
    parts.append(_text(_PAD, y, summary, size=11 if title else 12, weight="normal" if title else "bold",
                       fill=_MUTED if title else _TEXT))
    top = y + 14
    parts.append(_text(_PAD + _INDEX_W, top + 10, "logical blocks", fill=_MUTED))
    parts.append(_text(_PAD + _GROUP, top + 10, "table", anchor="end", fill=_MUTED))
    parts.append(_text(_POOL_X + _POOL / 2, top + 10, "physical blocks (the pool)", anchor="middle", fill=_MUTED))
    if len(layout.requests) > 1:
        right_x = _W - _PAD - _GROUP
        parts.append(_text(right_x, top + 10, "table", fill=_MUTED))
        parts.append(_text(right_x + _ENTRY_W + _GAP + _STRIP, top + 10, "logical", anchor="end", fill=_MUTED))
    top += 20
    pool_y = _draw_pool(parts, layout, pool_rows, top)
    sides = {"left": top, "right": top}
    lines: list[str] = []
    for k, (r, es) in enumerate(zip(layout.requests, entries)):
        side = "left" if k % 2 == 0 else "right"
        sides[side] = _draw_request(parts, lines, layout, r, es, side, sides[side], pool_y)
    bottom = max(top + len(pool_rows) * _ROW, *sides.values()) + 4
    legend, bottom = _legend(bottom)
    parts.append(legend)
    height = bottom + _PAD
    body = "".join(lines) + "".join(parts)  # lines first: the blocks are drawn over their ends
    return (f"<div class='pagedkv-pool pagedkv-paged-layout' style='font-size:0;line-height:0'>"
            f"<svg xmlns='http://www.w3.org/2000/svg' width='{_W}' height='{height}' viewBox='0 0 {_W} {height}' "
            f"style='max-width:100%;height:auto' role='img' aria-label='{escape(heading)}'>"
            f"<rect width='{_W}' height='{height}' fill='#ffffff'/>{body}"
            f"<desc>{_fallback(heading, layout)}</desc></svg></div>")

def _physical_tip(p: PhysicalBlock) -> str:
    if p.state == "null":
        return f"block {p.block_id}: the null block"
    who = ", ".join(f"{n} logical {i}" for n, i in p.holders)
    if p.holders or p.state == "in use":
        return f"block {p.block_id}: ref_cnt={p.ref_cnt}" + (f", named by {who}" if who else "") + \
               (", shared" if p.shared else "")
    return f"block {p.block_id}: {p.state}"


# ------------------------------------------------------------- the live view
class PagedLayoutView(FollowingView):
    """The picture, live in JupyterLab: redrawn as the pool changes and after every cell.

    Takes ``render_paged_layout``'s arguments. Displaying the view subscribes
    it to the pool (the manager's or ``pool``), throttled to one redraw per
    ``min_interval`` seconds; when a cell ends it redraws once more (token
    counts move without pool events). ``update(requests=..., num_tokens=...)``
    redraws now, with new arguments if given; ``attach(engine)`` follows a
    ``pagedkv.engine.LLMEngine`` (its manager and live requests) instead. Its
    rich display carries the static rendering, which the built page shows.
    """

    def __init__(self, source, requests=None, *, num_tokens=None, block_size=None, pool=None,
                 title: str | None = None, fold: int = 3, min_interval: float = 0.1) -> None:
        self.source, self.requests, self.num_tokens = source, requests, num_tokens
        self.block_size, self.pool, self.title, self.fold = block_size, pool, title, fold
        self.min_interval = float(min_interval)
        self.max_overhead = 0.05
        self.widget = _ipywidgets.HTML() if _ipywidgets is not None else None
        self.redraws = 0
        self.draw_seconds = 0.0
        self._last_draw = float("-inf")
        self._stale = True
        self._unsubscribe: Callable[[], None] | None = None
        self._engine: EngineFollower | None = None

    def _pool(self) -> BlockPool | None:
        if self.pool is not None:
            return self.pool
        owns_pool = isinstance(self.source, KVCacheManager) or hasattr(self.source, "single_type_managers")
        return self.source.block_pool if owns_pool else None

    def static_html(self) -> str:
        requests = self.requests() if callable(self.requests) else self.requests
        return render_paged_layout(self.source, requests, num_tokens=self.num_tokens, block_size=self.block_size,
                                   pool=self.pool, title=self.title, fold=self.fold)

    def refresh(self) -> None:
        """Redraw now."""
        self._stale, self._last_draw = False, time.monotonic()
        self.redraws += 1
        if self.widget is not None:
            self.widget.value = self.static_html()

    def update(self, requests=None, num_tokens=None) -> None:
        """Redraw now, with new ``requests`` / ``num_tokens`` if given."""
        if requests is not None:
            self.requests = requests
        if num_tokens is not None:
            self.num_tokens = num_tokens
        self.refresh()

    def _on_event(self, *_args) -> None:
        self._stale = True
        if time.monotonic() - self._last_draw >= self.min_interval:
            self.refresh()

    def _after_cell(self, *_args) -> None:
        self.refresh()

    def attach(self, engine=None) -> None:
        """Start following the pool (displaying the view does this), or ``engine``'s steps."""
        if engine is not None:
            manager = getattr(engine, "kv_cache_manager", None)
            if not isinstance(manager, KVCacheManager):
                raise TypeError(f"attach(engine) needs a pagedkv.engine.LLMEngine, got {type(engine).__name__}")
            self.close()
            self.source, self.requests = manager, None
            self._engine = follow_engine(self, engine, self.refresh)
            return
        pool = self._pool()
        if self._engine is None and self._unsubscribe is None:
            on_cell_end(self._after_cell)
            self._unsubscribe = pool.subscribe(self._on_event) if pool is not None else (lambda: None)
        if self._stale:
            self.refresh()

    def describe(self) -> str:
        return "PagedLayoutView (PagedAttention's picture)"
