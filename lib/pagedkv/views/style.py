"""The look every picture shares: colours, the owner palette, the font, escaping, one SVG cell.

Kept in one place so that a block has the same colour in the pool picture,
the block table, the trace replay and the live views, in every run.
"""

from __future__ import annotations

import hashlib
import html
import re
from collections.abc import Sequence

__all__ = ["COLORS", "OWNER_PALETTE", "MONO_FONT", "owner_color", "escape", "fit", "cell_svg"]

COLORS = {
    "null": "#495057",
    "free": "#ffffff",
    "cached": "#ffd77a",
    "in use": "#9ecae1",  # an in-use block whose owner is unknown
    "shared": "#6f42c1",  # border of a block held by more than one request
    "border": "#868e96",
    "highlight": "#d6336c",
}
#: Pastel fills for owners; text stays black on all of them.
OWNER_PALETTE = ["#8ecae6", "#b5e48c", "#f4a3a8", "#cdb4db", "#90dbc4", "#ffb677", "#a0c4ff", "#e9c46a",
                 "#c3b091", "#f7aef8"]
#: The inline style of every monospace label.
MONO_FONT = "font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace"


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
    return OWNER_PALETTE[index % len(OWNER_PALETTE)]


def escape(text: object) -> str:
    """``text`` as HTML, quotes included (every attribute here is single-quoted)."""
    return html.escape(str(text), quote=True)


def fit(text: str, n: int) -> str:
    """``text`` cut to ``n`` characters, an ellipsis marking the cut."""
    return text if len(text) <= n else text[: n - 1] + "\u2026"


def cell_svg(x: int, y: int, w: int, h: int, fill: str, lines: Sequence[str], *, text_color="#212529",
             border=COLORS["border"], border_width=1.0, dashed=False, hashed=False, highlight=False,
             tooltip="") -> str:
    """One rounded cell with centred lines of text (the first bold), as an SVG group."""
    parts = [f"<g><title>{escape(tooltip)}</title>"] if tooltip else ["<g>"]
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
                     f"font-weight='{weight}' fill='{text_color}' style='{MONO_FONT}'>{escape(line)}</text>")
    parts.append("</g>")
    return "".join(parts)
