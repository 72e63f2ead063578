"""The replay player: a recorded trace as one self-contained HTML string that plays in a static page.

Inline SVG frames, prev/next/play and a slider driven by a few lines of
inline JavaScript (``replay.js``, shipped as package data): no CDN, no
network. Without JavaScript the first frame shows (a ``<style>`` hides the
others). Where a sanitizer strips both the script and the style (an
untrusted notebook), every frame shows, stacked in order with its caption,
and the controls, which would do nothing there, stay hidden.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from .style import MONO_FONT, escape

__all__ = ["Frame", "Replay", "replay_html", "player_script"]

_ID_PLACEHOLDER = "__REPLAY_ID__"
_replay_counter = itertools.count(1)


@dataclass(frozen=True)
class Frame:
    """One step of a trace: what happened, and the picture right after."""

    caption: str
    html: str


@functools.cache
def _player_template() -> str:
    """``replay.js`` without its header comment (documentation, not emitted)."""
    text = importlib.resources.files(__package__).joinpath("replay.js").read_text(encoding="utf-8")
    if text.startswith("/*"):
        text = text[text.index("*/\n") + 3:]
    return text.rstrip("\n")


def player_script(dom_id: str) -> str:
    """The player's JavaScript for the player whose root element has id ``dom_id``."""
    return _player_template().replace(_ID_PLACEHOLDER, dom_id)


def _controls(num_frames: int) -> str:
    """prev / play / next, the slider and the step counter; ``hidden`` until the script runs."""
    button = "style='font-size:12px;padding:1px 8px;margin-right:4px;cursor:pointer' type='button'"
    return (
        f"<div class='pkv-controls' hidden style='margin:4px 0;{MONO_FONT};font-size:12px'>"
        f"<button class='pkv-prev' {button}>\u25c0 prev</button>"
        f"<button class='pkv-play' {button}>\u25b6 play</button>"
        f"<button class='pkv-next' {button}>next \u25b6</button>"
        f"<input type='range' min='0' max='{num_frames - 1}' value='0' step='1' "
        f"style='vertical-align:middle;width:240px;max-width:40%' aria-label='step'/> "
        f"<span class='pkv-step'>1 / {num_frames}</span></div>"
    )


def replay_html(frames: Sequence[Frame], title: str | None = None) -> str:
    """One self-contained HTML string that plays ``frames`` with prev/next/play and a slider.

    The DOM id comes from a counter and a hash of the content, never at
    random, so re-executing a notebook gives the same output.
    """
    if not frames:
        raise ValueError("replay_html needs at least one frame, got 0")
    first = " style='display:block'"
    body = "".join(
        f"<div class='pkv-frame'{first if i == 0 else ''}>"
        f"<div style='{MONO_FONT};font-size:12px;margin:4px 0'><b>step {i}</b>: {escape(fr.caption)}</div>"
        f"{fr.html}</div>"
        for i, fr in enumerate(frames)
    )
    digest = hashlib.sha1(body.encode()).hexdigest()[:10]
    dom_id = f"pkv-replay-{next(_replay_counter)}-{digest}"
    heading = f"<div style='{MONO_FONT};font-weight:bold;font-size:13px'>{escape(title)}</div>" if title else ""
    hide = f"<style>#{dom_id} .pkv-frame{{display:none}}</style>"
    return (f"<div class='pagedkv-replay' id='{dom_id}'>{heading}{_controls(len(frames))}{body}{hide}</div>"
            f"<script>{player_script(dom_id)}</script>")


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
