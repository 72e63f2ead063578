"""Pictures of a block pool and of block tables: live in JupyterLab, static in the built site.

Every physical block is a cell, coloured by its state:

- **null**: block 0, the placeholder (dark grey);
- **in use**: held by at least one request; filled with its owner's colour and
  labelled with the owner and ``ref_cnt`` (a thick purple border when shared);
- **free**: in the free queue, no hash (white): reused first if at the head;
- **cached**: in the free queue *with* a hash (amber): evictable, still matchable.

A small black corner marks any block that carries a hash. Free cells show their
position in the free queue (``q0`` is the head), and a strip under the grid
lists the queue from head to tail.

Public API (stable; chapters 3-5 use it)
----------------------------------------

- ``describe_blocks(pool, owners=None)`` -> one ``BlockCell`` per block (state,
  ``ref_cnt``, owners, free-queue position, hash): what the pictures draw.
- ``render_pool(pool, owners=None, title=None, highlight=(), columns=None)`` -> HTML
  string (an inline SVG): the static picture, deterministic, no script.
- ``render_block_table(rows, pool=None, title=None)`` -> HTML string: rows are
  requests, cells are physical block ids, coloured as in the pool picture.
- ``BlockOwners(pool)``: labels blocks with request names from the pool's
  events; ``with owners.acting_for("A"): pool.get_new_blocks(3)``.
- ``BlockPoolView(pool, owners=None, title=None, min_interval=0.1)``: a live
  view (an ``ipywidgets.HTML`` re-rendered at most every ``min_interval``
  seconds, and once more after the cell finishes). It subscribes to the pool
  only once displayed, so an undisplayed view costs nothing.
- ``BlockTableView(rows, pool=None, title=None)``: the same for block tables;
  ``update(rows)`` redraws.
- ``view.attach(engine)`` (both views): follow a ``pagedkv.engine.LLMEngine``,
  redrawing after its steps, throttled so drawing takes at most
  ``max_overhead`` (5 %) of the time the engine runs.
- ``TraceRecorder(pool, owners=None, title=None)``: a context manager (or
  ``start()``/``stop()`` across cells) that renders one frame per pool
  mutation; ``snapshot(caption)`` adds one by hand; ``replay()`` returns a player.
- ``replay_html(frames, title=None)`` -> one self-contained HTML string (inline
  SVG frames, a few lines of inline JavaScript: prev/next/play and a slider; no
  CDN, no network) that plays in a static page.

``owners`` may be a ``BlockOwners``, a mapping ``{name: [blocks or block ids]}``
(for instance ``KVCacheManager.req_to_blocks``), or a function returning one.

Both views' rich display carries a ``text/html`` static rendering next to the
widget, so a page built from the executed notebook shows the picture.
ipywidgets is optional: without it the views display their static HTML.

Sizes. Every static rendering fits the site's 688-px column: the pool picture
draws 10 blocks a row (about 600 px) with its key wrapped, and any wider one
(``columns=``) scales down (a ``viewBox`` and ``max-width:100%``); block tables
wider than the column are cut into bands of columns stacked one under another.

Untrusted notebooks. A notebook opened in JupyterLab before it runs shows its
``text/html`` outputs through JupyterLab's sanitizer, which drops ``<svg>``
(keeping its text), ``<script>`` and ``<style>``; an ``image/svg+xml`` entry
would not help, since JupyterLab renders no SVG output of an untrusted notebook
at all. So the static renderings degrade inside the HTML itself:

- the pool picture's ``<svg>`` carries, in its ``<desc>``, a plain-HTML twin
  (one styled ``<span>`` per block with the same colours, labels and tooltip,
  then the free queue and a key). A browser never draws a ``<desc>``; where
  the sanitizer strips the SVG, the twin is what remains, and the SVG's own
  labels, left behind as bare text, stay invisible in the ``font-size:0``
  wrapper (the picture itself sets its own sizes);
- block tables are plain HTML with inline styles, which the sanitizer keeps;
- the replay shows frame 0 and hides the others with a ``<style>``; its
  controls carry ``hidden`` until the script shows them. Sanitized (no script,
  no style), every frame shows, stacked in order with its caption, and no
  dead button is left.
"""

from __future__ import annotations

import hashlib
import html
import itertools
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from ..block_pool import BlockPool
from ..free_queue import KVCacheBlock
from ..pool_events import PoolEvent
from ..hashing import short_hash
from ..common import cdiv

try:  # optional: the static renderings work without it
    import ipywidgets as _ipywidgets
except ImportError:  # pragma: no cover - exercised by a test that hides the module
    _ipywidgets = None

__all__ = [
    "COLORS",
    "owner_color",
    "BlockCell",
    "describe_blocks",
    "render_pool",
    "render_block_table",
    "BlockOwners",
    "BlockPoolView",
    "BlockTableView",
    "Frame",
    "TraceRecorder",
    "Replay",
    "replay_html",
    "describe_event",
]

COLORS = {
    "null": "#495057",
    "free": "#ffffff",
    "cached": "#ffd77a",
    "in use": "#9ecae1",  # an in-use block whose owner is unknown
    "shared": "#6f42c1",  # border of a block held by more than one request
    "border": "#868e96",
    "highlight": "#d6336c",
}
# Pastel fills for owners; text stays black on all of them.
_OWNER_PALETTE = ["#8ecae6", "#b5e48c", "#f4a3a8", "#cdb4db", "#90dbc4", "#ffb677", "#a0c4ff", "#e9c46a",
                  "#c3b091", "#f7aef8"]


def owner_color(label: str) -> str:
    """The fill colour of an owner, the same in every view and every run.

    Single letters and names ending in a number take consecutive colours
    ("A", "B"... or "req-0", "req-1"...); other names are placed by a hash.
    """
    label = str(label)
    if len(label) == 1 and label.isalpha():
        index = ord(label.upper()) - ord("A")
    elif (m := re.search(r"(\d+)$", label)) is not None:
        index = int(m.group(1))
    else:
        index = int.from_bytes(hashlib.sha1(label.encode()).digest()[:4], "big")
    return _OWNER_PALETTE[index % len(_OWNER_PALETTE)]


# ---------------------------------------------------------------- owners


class BlockOwners:
    """Which request holds which block, learned from the pool's events.

    The pool does not know its requests; its caller does. Wrap each call in
    ``acting_for(name)`` and this object records ``name`` on the blocks it
    allocated or touched, and removes it from the blocks it freed. Create it
    before any view or recorder that uses it, so it hears each event first.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._labels: dict[int, list[str]] = {}
        self._actor: str | None = None
        self._unsubscribe = pool.subscribe(self._on_event)

    @contextmanager
    def acting_for(self, name: str):
        """Attribute the pool calls made inside the ``with`` block to ``name``."""
        previous, self._actor = self._actor, str(name)
        try:
            yield self
        finally:
            self._actor = previous

    def _on_event(self, pool: BlockPool, event: PoolEvent) -> None:
        actor, labels = self._actor, self._labels
        if event.kind == "allocate":
            for b in event.block_ids:
                labels[b] = [actor] if actor else []
        elif event.kind == "touch":
            for b in event.block_ids:
                if actor:
                    labels.setdefault(b, []).append(actor)
        elif event.kind == "free":
            for b in event.block_ids:
                if actor and actor in labels.get(b, ()):
                    labels[b].remove(actor)
            for b in event.block_ids:
                if pool.blocks[b].ref_cnt == 0:
                    labels.pop(b, None)

    def labels(self) -> dict[int, list[str]]:
        """``{block_id: [owner, ...]}`` for the blocks in use."""
        return {b: list(names) for b, names in self._labels.items() if names}

    def close(self) -> None:
        """Stop listening to the pool."""
        self._unsubscribe()


Owners = BlockOwners | Mapping[str, Sequence] | Callable[[], Mapping[str, Sequence]] | None


def _owner_labels(owners: Owners) -> dict[int, list[str]]:
    """Normalise any accepted ``owners`` to ``{block_id: [names]}``."""
    if owners is None:
        return {}
    if isinstance(owners, BlockOwners):
        return owners.labels()
    if callable(owners):
        owners = owners()
    labels: dict[int, list[str]] = {}
    for name, blocks in owners.items():
        for block in blocks:
            block_id = block.block_id if isinstance(block, KVCacheBlock) else int(block)
            labels.setdefault(block_id, []).append(str(name))
    return labels


# ---------------------------------------------------------------- static pictures

_CELL_W, _CELL_H, _GAP = 54, 44, 4
_FONT = "font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace"


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _cell_svg(x: int, y: int, w: int, h: int, fill: str, lines: Sequence[str], *, text_color="#212529",
              border=COLORS["border"], border_width=1.0, dashed=False, hashed=False, highlight=False,
              tooltip="") -> str:
    parts = [f"<g><title>{_esc(tooltip)}</title>"] if tooltip else ["<g>"]
    dash = " stroke-dasharray='4 2'" if dashed else ""
    parts.append(f"<rect x='{x}' y='{y}' width='{w}' height='{h}' rx='4' fill='{fill}' "
                 f"stroke='{border}' stroke-width='{border_width}'{dash}/>")
    if hashed:  # a corner mark: this block carries a hash
        parts.append(f"<path d='M{x + w - 11},{y} L{x + w - 4},{y} Q{x + w},{y} {x + w},{y + 4} "
                     f"L{x + w},{y + 11} Z' fill='#212529'/>")
    if highlight:
        parts.append(f"<rect x='{x - 2}' y='{y - 2}' width='{w + 4}' height='{h + 4}' rx='5' fill='none' "
                     f"stroke='{COLORS['highlight']}' stroke-width='2.5'/>")
    line_h = 12
    top = y + h / 2 - (len(lines) - 1) * line_h / 2 + 4
    for i, line in enumerate(lines):
        weight = "bold" if i == 0 else "normal"
        size = 12 if i == 0 else 10
        parts.append(f"<text x='{x + w / 2:g}' y='{top + i * line_h:g}' text-anchor='middle' font-size='{size}' "
                     f"font-weight='{weight}' fill='{text_color}' style='{_FONT}'>{_esc(line)}</text>")
    parts.append("</g>")
    return "".join(parts)


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
    labels = _owner_labels(owners)
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


def _block_look(cell: BlockCell) -> dict:
    """Fill, text and border of one block's cell, from its state."""
    b = cell.block_id
    hashed = cell.block_hash is not None
    if cell.state == "null":
        return dict(fill=COLORS["null"], lines=[str(b), "null"], text_color="#ffffff",
                    tooltip=f"block {b}: the null block (placeholder, never allocated)")
    if cell.state == "in use":
        who = "+".join(cell.owners) if cell.owners else "in use"
        fill = owner_color(cell.owners[0]) if cell.owners else COLORS["in use"]
        shared = cell.ref_cnt > 1
        return dict(fill=fill, lines=[str(b), _fit(who, 8), f"ref {cell.ref_cnt}"], hashed=hashed,
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


def _fit(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "\u2026"


_LEGEND = [
    (COLORS["null"], "null block", {}),
    (owner_color("A"), "in use (owner, ref_cnt)", {}),
    ("#ffffff", "in use, shared (ref_cnt > 1)", {"border": COLORS["shared"], "border_width": 3}),
    (COLORS["free"], "free, no hash", {}),
    (COLORS["cached"], "free, cached (evictable)", {"dashed": True, "hashed": True}),
]


def _legend(x: int, y: int, width: int) -> tuple[str, int]:
    """The colour key, wrapped onto as many lines as ``width`` needs; returns (svg, height)."""
    parts, cx, cy = [], x, y
    for fill, text, extra in _LEGEND:
        item_w = 24 + 7 * len(text)
        if cx > x and cx + item_w > x + width:
            cx, cy = x, cy + 20
        parts.append(_cell_svg(cx, cy, 14, 14, fill, [], **extra))
        parts.append(f"<text x='{cx + 19}' y='{cy + 11}' font-size='11' fill='#212529' "
                     f"style='{_FONT}'>{_esc(text)}</text>")
        cx += item_w
    return "".join(parts), cy - y + 20


# The plain-HTML twin of a pool picture (see "Untrusted notebooks" in the module docstring).
_HTML_FONT = "font-family:monospace;font-size:11px;line-height:1.3;color:#212529"


def _fallback_cell(cell: BlockCell, highlight: bool) -> str:
    look = _block_look(cell)
    border = f"{look.get('border_width', 1):g}px {'dashed' if look.get('dashed') else 'solid'} " \
             f"{look.get('border', COLORS['border'])}"
    label = " ".join(line for line in look["lines"][1:] if line)
    return (f"<span title='{_esc(look['tooltip'])}' style='display:inline-block;width:50px;margin:1px;"
            f"padding:1px 0;text-align:center;vertical-align:top;border-radius:3px;border:{border};"
            f"background:{look['fill']};color:{look.get('text_color', '#212529')}"
            f"{';box-shadow:0 0 0 2px ' + COLORS['highlight'] if highlight else ''}'>"
            f"<b>{cell.block_id}</b><br>{_esc(label) or '&nbsp;'}</span>")


def _pool_fallback(heading: str, cells: Sequence[BlockCell], queue: Sequence[KVCacheBlock | None],
                   highlight: set[int]) -> str:
    """The pool as plain HTML: what an untrusted notebook shows where it strips the SVG."""
    ids = " ".join("\u2026" if b is None else str(b.block_id) + ("*" if b.block_hash is not None else "")
                   for b in queue)
    return (f"<div style='{_HTML_FONT};max-width:640px;white-space:normal'><div><b>{_esc(heading)}</b></div>"
            f"<div>{''.join(_fallback_cell(c, c.block_id in highlight) for c in cells)}</div>"
            f"<div>free queue from its head: {_esc(ids) or '(empty)'} (* = cached)</div>"
            f"<div style='color:#495057'>grey: null block; coloured: in use (owner, ref_cnt; purple border: "
            f"shared); white: free; amber, dashed: free but cached (evictable); qN: free-queue position</div></div>")


def render_pool(pool: BlockPool, owners: Owners = None, title: str | None = None,
                highlight: Iterable[int] = (), columns: int | None = None, queue_limit: int = 40,
                max_cells: int = 512) -> str:
    """The pool as an inline SVG inside a ``<div>``: a grid of blocks and the free queue.

    ``highlight`` outlines some block ids (the ones the last operation touched).
    Only the first ``max_cells`` blocks are drawn (the heading says so): the
    picture is for pools small enough to look at. Deterministic: the same pool
    state gives the same string.
    """
    cells = describe_blocks(pool, owners)[:max_cells]
    highlight = set(highlight)
    queue = pool.free_block_queue.get_all_free_blocks()
    n = pool.num_gpu_blocks
    cols = columns or min(n, 10)
    rows = cdiv(len(cells), cols)
    pad = 8
    width = max(pad * 2 + cols * (_CELL_W + _GAP), 600)
    parts: list[str] = []
    y = pad
    num_cached = sum(1 for b in queue if b.block_hash is not None)
    summary = (f"{pool.get_num_free_blocks()} of {n - 1} blocks free ({num_cached} cached), "
               f"usage {pool.get_usage():.0%}")
    if len(cells) < n:
        summary += f"; blocks 0-{len(cells) - 1} drawn"
    heading = f"{title} \u2014 {summary}" if title else summary
    parts.append(f"<text x='{pad}' y='{y + 12}' font-size='13' font-weight='bold' fill='#212529' "
                 f"style='{_FONT}'>{_esc(heading)}</text>")
    y += 22
    for cell in cells:
        r, c = divmod(cell.block_id, cols)
        parts.append(_cell_svg(pad + c * (_CELL_W + _GAP), y + r * (_CELL_H + _GAP), _CELL_W, _CELL_H,
                               highlight=cell.block_id in highlight, **_block_look(cell)))
    y += rows * (_CELL_H + _GAP) + 8

    # The free queue, head to tail (long queues: first and last few, with a gap).
    parts.append(f"<text x='{pad}' y='{y + 11}' font-size='11' fill='#212529' style='{_FONT}'>"
                 f"free queue, head \u2192 tail ({len(queue)}): allocation pops the head</text>")
    y += 18
    shown: list[KVCacheBlock | None] = list(queue)
    if len(queue) > queue_limit:
        shown = queue[: queue_limit - 8] + [None] + queue[-8:]
    qw, qh, x = 30, 22, pad
    for block in shown:
        if x + qw > width - pad:
            x, y = pad, y + qh + 6
        if block is None:
            parts.append(f"<text x='{x + qw / 2:g}' y='{y + 15}' text-anchor='middle' font-size='12' "
                         f"fill='#212529'>\u2026</text>")
        else:
            hashed = block.block_hash is not None
            parts.append(_cell_svg(x, y, qw, qh, COLORS["cached"] if hashed else COLORS["free"],
                                   [str(block.block_id)], dashed=hashed, hashed=hashed,
                                   highlight=block.block_id in highlight,
                                   tooltip=f"block {block.block_id}" + (" (cached)" if hashed else "")))
        x += qw + 4
    if not queue:
        parts.append(f"<text x='{pad}' y='{y + 15}' font-size='11' fill='#868e96' style='{_FONT}'>(empty)</text>")
    y += qh + 12
    legend, legend_h = _legend(pad, y, width - 2 * pad)
    parts.append(legend)
    y += legend_h + 2
    # font-size:0 on the wrapper: where a sanitizer strips the SVG, its labels
    # would spill out as a run of text; they stay invisible, and the HTML twin
    # in <desc> (never drawn while the SVG stands) shows instead.
    return (f"<div class='pagedkv-pool' style='font-size:0;line-height:0'>"
            f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{y}' "
            f"viewBox='0 0 {width} {y}' style='max-width:100%;height:auto' role='img' "
            f"aria-label='{_esc(heading)}'><rect width='{width}' height='{y}' fill='#ffffff'/>{''.join(parts)}"
            f"<desc>{_pool_fallback(heading, cells, shown, highlight)}</desc></svg></div>")


def _normalise_rows(rows) -> list[tuple[str, list[int]]]:
    items = rows.items() if isinstance(rows, Mapping) else enumerate(rows)
    out = []
    for name, blocks in items:
        ids = [b.block_id if isinstance(b, KVCacheBlock) else int(b) for b in blocks]
        out.append((str(name), ids))
    return out


_COLUMN_PX = 680  # the site's text column is 688 px wide at a 1280-px window
_MONO_PX = 7.3  # the width of one character of 12-px monospace text


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
    680-px column, so the table never needs a horizontal scrollbar. Plain
    HTML with inline styles only: it reads the same in an untrusted notebook.
    """
    table = _normalise_rows(rows)
    count: dict[int, int] = {}
    for _, ids in table:
        for b in set(ids):
            count[b] = count.get(b, 0) + 1
    width = max((len(ids) for _, ids in table), default=0)
    shown = min(width, max_columns)
    # Column widths, from the longest id and the longest name (monospace text).
    digits = max((len(str(b)) for _, ids in table for b in ids[:shown]), default=1)
    cell_px = max(24, round(digits * _MONO_PX) + 4) + 4 + 6 + 3  # text, padding, borders, spacing
    name_px = round(max((len(name) for name, _ in table), default=1) * _MONO_PX) + 14
    corner = "request \\ block"
    name_px = max(name_px, round(len(corner) * 6.6) + 8)
    band = max(4, (_COLUMN_PX - name_px - 40) // cell_px)  # 40: the "... +N" cell of the last band
    cell = "padding:2px 2px;text-align:center;border-radius:3px;min-width:24px"
    head_style = f"font-weight:normal;color:#868e96;{_FONT};font-size:11px"
    bands = []
    for lo in range(0, max(shown, 1), band):
        hi = min(lo + band, shown)
        last = hi >= shown
        head = "".join(f"<th style='{head_style}'>{j}</th>" for j in range(lo, hi))
        if last and width > shown:
            head += "<th></th>"
        body = []
        for name, ids in table:
            tds = []
            for b in ids[lo:hi]:
                shared = count[b] > 1 or (pool is not None and 0 < b < pool.num_gpu_blocks
                                          and pool.blocks[b].ref_cnt > 1)
                if b == 0:
                    style = f"background:{COLORS['null']};color:#fff;border:1px solid {COLORS['border']}"
                else:
                    border = f"3px solid {COLORS['shared']}" if shared else f"1px solid {COLORS['border']}"
                    style = f"background:{owner_color(name)};border:{border}"
                hashed = (pool is not None and 0 <= b < pool.num_gpu_blocks
                          and pool.blocks[b].block_hash is not None)
                mark = "<sup style='font-size:8px'>\u25e5</sup>" if hashed else ""
                tip = "null block" if b == 0 else ("shared" if shared else "")
                tds.append(f"<td title='{_esc(tip)}' style='{cell};{style};{_FONT};font-size:12px'>{b}{mark}</td>")
            if last and len(ids) > shown:
                tds.append(f"<td style='color:#868e96;{_FONT};font-size:11px'>\u2026 +{len(ids) - shown}</td>")
            body.append(f"<tr><th style='text-align:right;padding-right:8px;{_FONT};font-size:12px'>"
                        f"{_esc(name)}</th>{''.join(tds)}</tr>")
        if not table:
            body.append(f"<tr><td style='color:#868e96;{_FONT};font-size:12px'>(no requests hold blocks)</td></tr>")
        bands.append(f"<table style='border-collapse:separate;border-spacing:3px;margin:0 0 4px 0'>"
                     f"<thead><tr><th style='{_FONT};font-size:11px;color:#868e96;min-width:{name_px - 8}px;"
                     f"text-align:right'>{corner}</th>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")
    caption = (f"<div style='text-align:left;font-weight:bold;{_FONT};font-size:13px'>{_esc(title)}</div>"
               if title else "")
    return f"<div class='pagedkv-block-table'>{caption}{''.join(bands)}</div>"


# ---------------------------------------------------------------- live views


class _EngineFollower:
    """Redraw after engine steps, at most every ``min_interval`` s and at most ``max_overhead`` of the time.

    A redraw that took ``c`` seconds waits ``c / max_overhead`` before the
    next one, so however slow the picture, drawing stays a bounded fraction
    of the engine's run time (5 % by default).
    """

    def __init__(self, view, redraw: Callable[[], None], min_interval: float, max_overhead: float) -> None:
        self.view, self.redraw, self.min_interval, self.max_overhead = view, redraw, min_interval, max_overhead
        self.last_draw = float("-inf")
        self.last_cost = 0.0
        self.stale = False
        self.unsubscribe: Callable[[], None] | None = None

    def on_step(self, *_args) -> None:
        self.stale = True
        now = time.perf_counter()
        if now - self.last_draw >= max(self.min_interval, self.last_cost / self.max_overhead):
            self.draw()

    def draw(self) -> None:
        t0 = time.perf_counter()
        self.redraw()
        t1 = time.perf_counter()
        self.last_draw, self.last_cost, self.stale = t1, t1 - t0, False
        self.view.draw_seconds += t1 - t0  # what following the engine has cost so far

    def after_cell(self, *_args) -> None:
        if self.stale:
            self.draw()


def _follow_engine(view, engine, redraw: Callable[[], None]) -> _EngineFollower:
    """Subscribe ``redraw`` to ``engine``'s steps (and to the end of each notebook cell)."""
    if not hasattr(engine, "add_step_listener"):
        raise TypeError(f"attach(engine) needs a pagedkv.engine.LLMEngine, got {type(engine).__name__}")
    follower = _EngineFollower(view, redraw, view.min_interval, view.max_overhead)
    follower.unsubscribe = engine.add_step_listener(follower.on_step)
    ip = _ipython()
    if ip is not None:
        ip.events.register("post_run_cell", follower.after_cell)
    follower.draw()
    return follower


def _unfollow(follower: _EngineFollower | None) -> None:
    if follower is None:
        return
    follower.unsubscribe()
    _stop_after_cell(follower.after_cell)


def _stop_after_cell(callback) -> None:
    """Unregister a post-run-cell hook, if IPython is here and the hook still is."""
    ip = _ipython()
    if ip is not None:
        try:
            ip.events.unregister("post_run_cell", callback)
        except ValueError:
            pass


def _ipython():
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return None
    return get_ipython()


class BlockPoolView:
    """A live picture of a pool: redrawn as code mutates it, throttled.

    Displaying the view subscribes it to the pool. Each mutation then marks
    the picture stale and redraws it if ``min_interval`` seconds have passed
    since the last redraw; when the running cell ends, a stale picture is
    redrawn once more. Until it is displayed the view costs the pool nothing.
    """

    def __init__(self, pool: BlockPool, owners: Owners = None, title: str | None = None,
                 min_interval: float = 0.1, columns: int | None = None) -> None:
        self.pool, self.owners, self.title, self.columns = pool, owners, title, columns
        self.min_interval = float(min_interval)
        self.widget = _ipywidgets.HTML() if _ipywidgets is not None else None
        self._stale = True
        self._last_draw = float("-inf")
        self._unsubscribe: Callable[[], None] | None = None
        self.redraws = 0  # how many times the widget was redrawn (for tests and curiosity)
        self.max_overhead = 0.05  # attach(engine): drawing takes at most this fraction of the run
        self.draw_seconds = 0.0  # attach(engine): time spent redrawing after steps
        self._engine: _EngineFollower | None = None

    def static_html(self) -> str:
        return render_pool(self.pool, self.owners, self.title, columns=self.columns)

    def refresh(self) -> None:
        """Redraw now."""
        self._stale = False
        self._last_draw = time.monotonic()
        self.redraws += 1
        if self.widget is not None:
            self.widget.value = self.static_html()

    def _on_event(self, pool: BlockPool, event: PoolEvent) -> None:
        self._stale = True
        if time.monotonic() - self._last_draw >= self.min_interval:
            self.refresh()

    def _after_cell(self, *args) -> None:
        if self._stale:
            self.refresh()

    def attach(self, engine=None) -> None:
        """Start following the pool (displaying the view does this).

        Given a ``pagedkv.engine.LLMEngine`` (whose pool this view shows),
        follow the engine instead: redraw after its steps rather than after
        each pool mutation, label blocks with the running requests (unless
        ``owners`` was given), and throttle so drawing takes at most
        ``max_overhead`` of the run.
        """
        if engine is not None:
            manager = getattr(engine, "kv_cache_manager", None)
            if manager is None or manager.block_pool is not self.pool:
                raise ValueError("attach(engine): the view must show the engine's pool "
                                 "(BlockPoolView(engine.kv_cache_manager.block_pool))")
            if self.owners is None:
                self.owners = lambda: dict(manager.req_to_blocks)
            if self._engine is None:
                self._engine = _follow_engine(self, engine, self.refresh)
            return
        if self._engine is not None:  # already following an engine: displaying only redraws
            if self._stale:
                self.refresh()
            return
        if self._unsubscribe is None:
            self._unsubscribe = self.pool.subscribe(self._on_event)
            ip = _ipython()
            if ip is not None:
                ip.events.register("post_run_cell", self._after_cell)
        if self._stale:
            self.refresh()

    def close(self) -> None:
        """Stop following the pool (or the engine)."""
        _unfollow(self._engine)
        self._engine = None
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
            _stop_after_cell(self._after_cell)

    def _repr_mimebundle_(self, include=None, exclude=None):
        self.attach()
        data = {}
        if self.widget is not None:
            data.update(self.widget._repr_mimebundle_() or {})
        data["text/plain"] = f"BlockPoolView of a {self.pool.num_gpu_blocks}-block pool"
        data["text/html"] = self.static_html()
        return data


class BlockTableView:
    """Block tables as a table of physical block ids; ``update(rows)`` redraws."""

    def __init__(self, rows, pool: BlockPool | None = None, title: str | None = None,
                 max_columns: int = 32) -> None:
        self.rows, self.pool, self.title, self.max_columns = rows, pool, title, max_columns
        self.widget = _ipywidgets.HTML(value=self.static_html()) if _ipywidgets is not None else None
        self.min_interval = 0.1  # attach(engine): the most redraws per second ...
        self.max_overhead = 0.05  # ... and the most of the run they may take
        self.redraws = 0
        self.draw_seconds = 0.0  # attach(engine): time spent redrawing after steps
        self._engine: _EngineFollower | None = None

    def static_html(self) -> str:
        return render_block_table(self.rows, self.pool, self.title, self.max_columns)

    def update(self, rows=None) -> None:
        """Redraw, with new rows if given (the same mapping, mutated, works too)."""
        if rows is not None:
            self.rows = rows
        self.redraws += 1
        if self.widget is not None:
            self.widget.value = self.static_html()

    def attach(self, engine) -> None:
        """Follow a ``pagedkv.engine.LLMEngine``: show its worker's rows, redrawn after steps (throttled)."""
        if self._engine is None:
            if self.pool is None and hasattr(engine, "kv_cache_manager"):
                self.pool = engine.kv_cache_manager.block_pool
            worker = getattr(engine, "worker", None)
            if worker is None:
                raise TypeError(f"attach(engine) needs a pagedkv.engine.LLMEngine, got {type(engine).__name__}")
            self._engine = _follow_engine(self, engine, lambda: self.update(worker.rows()))

    def close(self) -> None:
        """Stop following the engine."""
        _unfollow(self._engine)
        self._engine = None

    def _repr_mimebundle_(self, include=None, exclude=None):
        data = {}
        if self.widget is not None:
            self.update()
            data.update(self.widget._repr_mimebundle_() or {})
        data["text/plain"] = f"BlockTableView of {len(_normalise_rows(self.rows))} rows"
        data["text/html"] = self.static_html()
        return data


# ---------------------------------------------------------------- trace and replay


@dataclass(frozen=True)
class Frame:
    """One step of a trace: what happened, and the pool's picture right after."""

    caption: str
    html: str


def _ids(ids: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, ids)) + "]"


def describe_event(event: PoolEvent, evicted: Sequence[int] = ()) -> str:
    """A one-line caption for a pool event."""
    k, ids = event.kind, event.block_ids
    if k == "allocate":
        text = f"get_new_blocks({len(ids)}) \u2192 {_ids(ids)} popped from the head"
        if evicted:
            text += f"; cache entries of {_ids(evicted)} die at reuse"
        return text
    if k == "free":
        parts = [f"free_blocks({_ids(ids)})"]
        if event.head:
            parts.append(f"{_ids(event.head)} \u2192 head (no hash)")
        if event.tail:
            parts.append(f"{_ids(event.tail)} \u2192 tail (hashed, still cached)")
        still = [b for b in ids if b not in event.head and b not in event.tail]
        if still:
            parts.append(f"{_ids(sorted(set(still)))} still held")
        return "; ".join(parts)
    if k == "touch":
        return f"touch({_ids(ids)}): prefix hit, ref_cnt + 1"
    if k == "cache":
        return f"cache_full_blocks: {_ids(ids)} hashed into the prefix cache"
    if k == "reset":
        return f"reset_prefix_cache(): {len(ids)} hashes cleared"
    if k == "evict":
        return f"evict {_ids(ids)}"
    return k


class TraceRecorder:
    """Record a pool's mutations as frames: ``with TraceRecorder(pool) as rec: ...``.

    Each mutation becomes one frame (caption plus the picture right after it,
    with the touched blocks outlined). An ``"evict"`` event is folded into the
    allocation that caused it. ``snapshot(caption)`` adds a frame by hand;
    ``acting_for(name)`` labels the blocks of the calls inside it (see
    ``BlockOwners``). ``replay()`` returns the player.
    """

    def __init__(self, pool: BlockPool, owners: Owners = None, title: str | None = None,
                 max_frames: int = 200, columns: int | None = None) -> None:
        self.pool, self.title, self.columns = pool, title, columns
        self._own_owners = owners is None
        self.owners: Owners = BlockOwners(pool) if owners is None else owners
        self.max_frames = max_frames
        self.frames: list[Frame] = []
        self.dropped = 0  # events beyond max_frames
        self._evicted: tuple[int, ...] = ()
        self._unsubscribe: Callable[[], None] | None = None

    @contextmanager
    def acting_for(self, name: str):
        if not isinstance(self.owners, BlockOwners):
            raise TypeError("acting_for needs BlockOwners (pass owners=None to get one)")
        with self.owners.acting_for(name):
            yield self

    def _actor(self) -> str | None:
        return self.owners._actor if isinstance(self.owners, BlockOwners) else None

    def snapshot(self, caption: str, highlight: Iterable[int] = ()) -> None:
        """Add a frame now."""
        if len(self.frames) >= self.max_frames:
            self.dropped += 1
            return
        picture = render_pool(self.pool, self.owners, self.title, highlight=highlight, columns=self.columns)
        self.frames.append(Frame(caption, picture))

    def _on_event(self, pool: BlockPool, event: PoolEvent) -> None:
        if event.kind == "evict":
            self._evicted = event.block_ids
            return
        caption = describe_event(event, self._evicted)
        self._evicted = ()
        actor = self._actor()
        self.snapshot(f"{actor}: {caption}" if actor else caption, highlight=event.block_ids)

    def start(self, caption: str = "start") -> "TraceRecorder":
        """Take a first frame and start listening (``with`` does this; ``start``/``stop`` span cells)."""
        if self._unsubscribe is None:
            self.snapshot(caption)
            self._unsubscribe = self.pool.subscribe(self._on_event)
        return self

    def stop(self) -> "TraceRecorder":
        """Stop listening; the frames stay."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._own_owners and isinstance(self.owners, BlockOwners):
            self.owners.close()
        return self

    def __enter__(self) -> "TraceRecorder":
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False

    def replay(self, title: str | None = None) -> "Replay":
        return Replay(list(self.frames), title or self.title)


_replay_counter = itertools.count(1)

_PLAYER_JS = """(function(){var r=document.getElementById('%(id)s');if(!r)return;
r.querySelector('.pkv-controls').hidden=false;var f=r.querySelectorAll('.pkv-frame'),s=r.querySelector('input'),c=r.querySelector('.pkv-step'),
p=r.querySelector('.pkv-play'),i=0,t=null;
function show(k){i=Math.max(0,Math.min(f.length-1,k));for(var j=0;j<f.length;j++)
f[j].style.display=j===i?'block':'none';s.value=i;c.textContent=(i+1)+' / '+f.length;}
function stop(){if(t){clearInterval(t);t=null;p.textContent='\\u25b6 play';}}
r.querySelector('.pkv-prev').onclick=function(){stop();show(i-1);};
r.querySelector('.pkv-next').onclick=function(){stop();show(i+1);};
s.oninput=function(){stop();show(+s.value);};
p.onclick=function(){if(t){stop();return;}if(i>=f.length-1)show(0);p.textContent='\\u275a\\u275a pause';
t=setInterval(function(){if(i>=f.length-1){stop();return;}show(i+1);},900);};show(0);})();"""


def replay_html(frames: Sequence[Frame], title: str | None = None) -> str:
    """One self-contained HTML string that plays ``frames`` with prev/next/play and a slider.

    Inline SVG and a few lines of inline JavaScript: no CDN, no network. The
    DOM id comes from a counter and a hash of the content, never at random,
    so re-executing a notebook gives the same output. Without JavaScript the
    first frame shows (a ``<style>`` hides the others). Where a sanitizer
    strips both the script and the style (an untrusted notebook), every frame
    shows, stacked in order with its caption, and the controls, which would
    do nothing there, stay hidden.
    """
    if not frames:
        raise ValueError("replay_html needs at least one frame, got 0")
    first = " style='display:block'"
    body = "".join(
        f"<div class='pkv-frame'{first if i == 0 else ''}>"
        f"<div style='{_FONT};font-size:12px;margin:4px 0'><b>step {i}</b>: {_esc(fr.caption)}</div>"
        f"{fr.html}</div>"
        for i, fr in enumerate(frames)
    )
    digest = hashlib.sha1(body.encode()).hexdigest()[:10]
    dom_id = f"pkv-replay-{next(_replay_counter)}-{digest}"
    button = ("style='font-size:12px;padding:1px 8px;margin-right:4px;cursor:pointer' type='button'")
    heading = f"<div style='{_FONT};font-weight:bold;font-size:13px'>{_esc(title)}</div>" if title else ""
    controls = (
        f"<div class='pkv-controls' hidden style='margin:4px 0;{_FONT};font-size:12px'>"
        f"<button class='pkv-prev' {button}>\u25c0 prev</button>"
        f"<button class='pkv-play' {button}>\u25b6 play</button>"
        f"<button class='pkv-next' {button}>next \u25b6</button>"
        f"<input type='range' min='0' max='{len(frames) - 1}' value='0' step='1' "
        f"style='vertical-align:middle;width:240px;max-width:40%' aria-label='step'/> "
        f"<span class='pkv-step'>1 / {len(frames)}</span></div>"
    )
    hide = f"<style>#{dom_id} .pkv-frame{{display:none}}</style>"
    script = _PLAYER_JS % {"id": dom_id}
    return (f"<div class='pagedkv-replay' id='{dom_id}'>{heading}{controls}{body}{hide}</div>"
            f"<script>{script}</script>")


class Replay:
    """A recorded trace; displays as the player (``replay_html``)."""

    def __init__(self, frames: Sequence[Frame], title: str | None = None) -> None:
        self.frames = list(frames)
        self.title = title

    def __len__(self) -> int:
        return len(self.frames)

    def captions(self) -> list[str]:
        return [f.caption for f in self.frames]

    def _repr_html_(self) -> str:
        return replay_html(self.frames, self.title)

    def __repr__(self) -> str:
        return f"Replay of {len(self.frames)} frames"
