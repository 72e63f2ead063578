"""The structure of the book's MyST markdown that the text checks read.

``tools/citations.py`` (citations per chapter, main-text words) and
``tools/terms.py`` (where a glossary term first appears) both need to know, for
any place in a markdown cell or page, whether a reader meets it in the main
text or only on opening something:

* an **aside** is a colon-fence dropdown titled exactly ``In vLLM 0.33.0`` or
  ``In SGLang 0.5.23`` (``ASIDE_TITLES``), from its opening line to its closing
  fence;
* an **answer** is a dropdown titled ``Answer``;
* **code** is a fenced block of code (backticks or tildes, or a directive that
  shows code: ``{code-cell}``, ``{code-block}``, ...) and ``{math}``;
* every other directive (``{note}``, a dropdown with another title) is a
  container: what it holds is main text, its fence lines are not.

Fences follow markdown-it's rules, which MyST uses: a fence opens with three
or more backticks, tildes or colons (a colon fence names its directive,
``:::{dropdown} Title``) and closes at the first later line of the same
character, at least as long, and nothing else. So an aside holding a
``:::{note}`` is written with four colons (``::::{dropdown} In vLLM 0.33.0``
... ``::::``); with three, the note's closing ``:::`` would close the aside.
The contents of a directive are parsed again for fences, so a note inside an
aside is inside the aside, and an aside inside an answer counts as an aside.
A fence that never closes runs to the end of its cell (``unclosed``).

``count_words`` counts the words of prose: HTML comments, display math
(``$$ ... $$``), targets (``(label)=``), images and link targets are dropped;
a code span, inline math or a role such as ``{cite:p}`key``` counts as one
word; ``{term}`` and ``{doc}``/``{ref}``/``{numref}`` roles count the words of
the text they show; a word is a run of non-space characters with a letter or a
digit in it (so table rules, list marks and ``#`` count for nothing).
Headings, table cells, list items and link texts are prose.
"""

from __future__ import annotations

import dataclasses
import re

ASIDE_TITLES = ("In vLLM 0.33.0", "In SGLang 0.5.23")
ANSWER_TITLE = "Answer"
# Directives whose content is code or math, not prose.
CODE_DIRECTIVES = {"code", "code-block", "code-cell", "sourcecode", "literalinclude", "raw", "eval-rst",
                   "math", "mermaid", "graphviz"}

_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,}|:{3,})(?P<info>[^\n]*)$")
_DIRECTIVE = re.compile(r"\{(?P<name>[\w:.-]+)\}[ \t]*(?P<title>.*)$")
_OPTION = re.compile(r"^[ \t]*:[\w-]+:(?:[ \t].*)?$")


@dataclasses.dataclass
class Block:
    """A fenced block of a markdown text: its kind and its offsets."""

    kind: str  # "aside", "answer", "code", "directive"
    start: int  # the opening fence line's first character
    end: int  # past the closing fence line (the end of the text when unclosed)
    body: tuple[int, int]  # the lines between the fences
    name: str  # the directive's name ("dropdown", "note"), or a code fence's language
    title: str  # what follows the directive's name
    line: int  # the opening fence's line, from 1
    closed: bool = True
    fence_lines: tuple[tuple[int, int], ...] = ()  # the fence lines and a directive's option lines

    def holds(self, offset: int) -> bool:
        return self.start <= offset < self.end


def _lines(text: str) -> list[tuple[int, int]]:
    """(start, end) of each line, end before its newline."""
    out, at = [], 0
    for line in text.split("\n"):
        out.append((at, at + len(line)))
        at += len(line) + 1
    return out


def _kind(fence: str, info: str) -> tuple[str, str, str]:
    """The block's kind, directive name and title from its opening fence."""
    m = _DIRECTIVE.match(info.strip())
    if not m:
        return ("code" if fence[0] != ":" else "directive"), info.strip(), ""
    name, title = m.group("name"), m.group("title").strip()
    if name in CODE_DIRECTIVES:
        return "code", name, title
    if name == "dropdown" and title in ASIDE_TITLES:
        return "aside", name, title
    if name == "dropdown" and title == ANSWER_TITLE:
        return "answer", name, title
    return "directive", name, title


def blocks(text: str) -> list[Block]:
    """Every fenced block of the text, nested ones included, in the order they open."""
    lines = _lines(text)
    found: list[Block] = []

    def parse(lo: int, hi: int) -> None:
        i = lo
        while i < hi:
            a, b = lines[i]
            m = _OPEN.match(text[a:b])
            fence = m.group("fence") if m else ""
            info = m.group("info") if m else ""
            if not m or (fence[0] == "`" and "`" in info) or (fence[0] == ":" and not info.strip()):
                i += 1  # no fence; or a stray closing fence of colons
                continue
            close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
            j = next((j for j in range(i + 1, hi) if close.match(text[lines[j][0]:lines[j][1]])), None)
            body_end = j if j is not None else hi
            kind, name, title = _kind(fence, info)
            fences = [lines[i]] + ([lines[j]] if j is not None else [])
            if kind != "code":  # a directive's options (":open:") are not prose
                k = i + 1
                while k < body_end and _OPTION.match(text[lines[k][0]:lines[k][1]]):
                    fences.append(lines[k])
                    k += 1
            if j is not None:
                end = lines[j][1] + 1
            else:  # an unclosed fence runs to the end of what holds it
                end = lines[hi][0] if hi < len(lines) else len(text)
            body = (lines[i][1] + 1, lines[body_end][0] if body_end < len(lines) else len(text))
            found.append(Block(kind, a, min(end, len(text)), body, name, title, i + 1, j is not None,
                               tuple(fences)))
            if kind != "code":
                parse(i + 1, body_end)
            i = body_end + 1
    parse(0, len(lines))
    return sorted(found, key=lambda blk: blk.start)


def kind_at(found: list[Block], offset: int) -> str:
    """Where a reader meets this offset: "aside", "answer", "code" or "main"."""
    kinds = {blk.kind for blk in found if blk.holds(offset)}
    for kind in ("aside", "answer", "code"):
        if kind in kinds:
            return kind
    return "main"


def main_text(text: str, found: list[Block] | None = None) -> str:
    """The text with everything that is not main text blanked (newlines kept, offsets unchanged):
    asides, answers, code, and the fence and option lines of other directives."""
    found = blocks(text) if found is None else found
    chars = list(text)

    def blank(a: int, b: int) -> None:
        for k in range(a, min(b, len(chars))):
            if chars[k] != "\n":
                chars[k] = " "

    for blk in found:
        if blk.kind != "directive":
            blank(blk.start, blk.end)
        else:
            for a, b in blk.fence_lines:
                blank(a, b)
    return "".join(chars)


_ROLE_WITH_TEXT = re.compile(r"\{(?:term|doc|ref|numref)\}`(?P<text>[^`<]*?)\s*(?:<[^`>]*>)?`")
_OTHER_ROLE = re.compile(r"\{[\w:.-]+\}`[^`]*`")


def count_words(markdown: str) -> int:
    """The words of prose in a stretch of markdown (the rule is the module's docstring)."""
    t = re.sub(r"<!--.*?-->", " ", markdown, flags=re.S)
    t = re.sub(r"\$\$.*?\$\$", " ", t, flags=re.S)
    t = re.sub(r"(?m)^[ \t]*\([\w:.-]+\)=[ \t]*$", " ", t)
    t = re.sub(r"!\[[^\]]*\]\([^)]*\)", " ", t)
    t = _ROLE_WITH_TEXT.sub(lambda m: f" {m.group('text')} ", t)
    t = _OTHER_ROLE.sub(" x ", t)
    t = re.sub(r"(?<!`)(`+)(?!`).+?(?<!`)\1(?!`)", " x ", t, flags=re.S)
    t = re.sub(r"(?<![\\$])\$[^$\n]+\$", " x ", t)
    t = re.sub(r"\]\([^)\s]*(?:\s+\"[^\"]*\")?\)", "] ", t)
    t = re.sub(r"</?[A-Za-z][^>\n]*>", " ", t)
    return sum(1 for w in t.split() if re.search(r"[^\W_]", w))
