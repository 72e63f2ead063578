"""The explorables' machinery: controls, the self-contained HTML, the registry of kinds.

An explorable of kind ``k`` is drawn by the library's three functions
``KINDS[k]`` (inputs, figures, render) and in the page by the JavaScript module
``explore_<k>.js`` on the shared ``explore.js``; :mod:`pagedkv.views.explorables`
holds the kinds (chapter 1's budget in :mod:`pagedkv.views.explore_budget`) and
registers each here.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass


__all__ = ["Control", "Explorable", "KINDS", "Kind", "esc", "module_script"]

_counter = itertools.count(1)


@functools.cache
def _source(name: str) -> str:
    """A package-data script without its header comment (documentation, not emitted)."""
    text = importlib.resources.files(__package__).joinpath(name).read_text(encoding="utf-8")
    if text.startswith("/*"):
        text = text[text.index("*/\n") + 3:]
    return text.strip("\n") + "\n"


def module_script(kind: str) -> str:
    """The JavaScript of one explorable: the shared part, then its own module."""
    return _source("explore.js") + _source(f"explore_{kind}.js")


def esc(text) -> str:
    """HTML escaping, character for character as ``pkvExplore.esc`` does it."""
    table = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}
    return "".join(table.get(c, c) for c in str(text))


@dataclass(frozen=True)
class Control:
    """One input: a ``<select>`` of ``options``, or a range ``(min, max, step)``:
    a slider, or with ``number`` a field the reader types a figure into."""

    name: str
    label: str
    value: object
    options: Sequence | None = None
    range: tuple[float, float, float] | None = None
    number: bool = False

    def html(self, dom_id: str) -> str:
        numbers = [self.value, *(self.range or ())]
        kind = ("str" if isinstance(self.value, str)
                else "float" if any(isinstance(x, float) for x in numbers) else "int")
        cid = f"{dom_id}-{self.name}"
        attrs = f"id='{cid}' data-input='{self.name}' data-type='{kind}'"
        if self.options is not None:
            opts = "".join(f"<option{' selected' if o == self.value else ''}>{esc(o)}</option>"
                           for o in self.options)
            field = f"<select {attrs}>{opts}</select>"
        elif self.number:
            lo, hi, step = self.range
            field = (f"<input type='number' {attrs} min='{lo}' max='{hi}' step='{step}' "
                     f"value='{self.value}'/>")
        else:
            lo, hi, step = self.range
            field = (f"<input type='range' {attrs} min='{lo}' max='{hi}' step='{step}' "
                     f"value='{self.value}'/><output for='{cid}'>{self.value}</output>")
        return f"<label for='{cid}'>{esc(self.label)}</label><span>{field}</span>"


@dataclass(frozen=True)
class Kind:
    """What the library knows of one explorable: the same three functions as its module."""

    inputs: Callable[[dict, dict], dict]  # controls' values + config -> inputs
    figures: Callable[[dict], dict]  # inputs -> figures (computed by the library)
    render: Callable[[dict, dict], str]  # figures + config -> the output's HTML


STYLE = "<style>\n" + _source("explore.css") + "</style>"

# The block pictures of the prefix and slot explorables (chapters 3, 5, 6): a copied block,
# the slots written this step, lettered cells, one line per block, the token table.
BLOCK_STYLE = "<style>\n" + _source("explore_blocks.css") + "</style>"


# kind -> its library functions, filled in by the modules that define the kinds.
KINDS: dict[str, Kind] = {}


@dataclass
class Explorable:
    """One explorable, ready to display: ``_repr_html_`` is the whole self-contained HTML."""

    kind: str
    title: str
    controls: list[Control]
    config: dict

    def values(self) -> dict:
        return {c.name: c.value for c in self.controls}

    def figures(self) -> dict:
        k = KINDS[self.kind]
        return k.figures(k.inputs(self.values(), self.config))

    def html(self) -> str:
        config = json.dumps(self.config, sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha1(f"{self.kind}{config}{self.values()}".encode()).hexdigest()[:10]
        dom_id = f"pkv-{self.kind}-{next(_counter)}-{digest}"
        controls = "".join(c.html(dom_id) for c in self.controls)
        settings = " \u00b7 ".join(f"{c.name} {c.value}" for c in self.controls)
        return (
            f"{STYLE}{BLOCK_STYLE if self.kind in ('prefix', 'slots') else ''}"
            f"<div class='pkv-explorable pagedkv-explorable' id='{dom_id}' data-kind='{self.kind}' "
            f"data-config='{esc(config)}'><div class='pkv-title'>{esc(self.title)}</div>"
            f"<div class='pkv-controls' hidden>{controls}</div>"
            f"<div class='pkv-out'>{KINDS[self.kind].render(self.figures(), self.config)}</div>"
            f"<div class='pkv-note pkv-static'>drawn for {esc(settings)}</div></div>"
            f"<script>{module_script(self.kind)}pkvExplore.mount('{dom_id}');</script>")

    def _repr_html_(self) -> str:
        return self.html()

    def __repr__(self) -> str:
        return f"{self.title} ({self.kind} explorable: {', '.join(c.name for c in self.controls)})"


