"""Where each glossary term first appears in reading order: its definition, or a link to it.

    python -m tools.terms --check    the terms whose first appearance is neither (exit 1 if any)
    python -m tools.terms --list     every term and where it first appears

The terms are the entries of the ``{glossary}`` directive in book/glossary.md:
each line of the directive that is not indented is a term, and consecutive
term lines are one entry (its synonyms). The reading order is ``_toc.yml``'s:
its root (book/intro), then every ``file`` of its parts in order (setup,
chapters 1-8, the exercises, the solutions, the reference pages).

**Where a term appears.** The markdown of each page and notebook is read, with
these left out (``tools/myst.py`` finds the fences): code cells and
``remove-cell`` cells, fenced code and math, display and inline math, HTML
comments, link targets, images, directive fence and option lines, and
headings (a heading names what its section goes on to define; a link there
would be a link in the page's contents). A term matches case-insensitively
as whole words, a space and a hyphen being the same ("KV-cache group" is "KV
cache group"), its last word also with a plural "s" or "es"; where two terms
match overlapping text, the longer match is the appearance ("block table" is
an appearance of *Block table*, not of *Block*). A term written as code in the
glossary (`` `max_model_len` ``) matches that identifier, case-sensitively, in
code spans and prose alike; other terms never match inside code spans.

**What counts as defining it.** The first appearance must be

* a link to the entry, ``{term}`KV cache``` or ``{term}`the cache <KV cache>```
  (the target any of the entry's terms, case-insensitively); or
* its definition: the term itself, as matched, in bold or italics
  (``**block table**``, ``*blocks*``, ``**`max_model_len`**``), in the sentence
  that defines it; or
* inside the glossary directive itself (a term used nowhere before it).

Two readers are checked: one who opens every aside and answer, and one who
skips them all (issue 35: a reader who skips the asides must still get the
whole argument). So the first appearance anywhere and the first appearance in
the main text (outside asides and answers) must each be a definition or a
link; when they are the same place it is reported once.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

import yaml

from tools import citations, myst

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = "book/glossary.md"


@dataclasses.dataclass
class Entry:
    """One glossary entry: its terms (the first is its name) and where it is."""

    terms: list[str]  # as written, backticks kept
    line: int

    @property
    def name(self) -> str:
        return self.terms[0]

    def patterns(self) -> list[tuple[re.Pattern, bool]]:
        """(pattern, code) for each term: code terms match identifiers, others words."""
        out = []
        for term in self.terms:
            code = re.fullmatch(r"`([^`]+)`", term)
            if code:
                out.append((re.compile(rf"(?<![\w.]){re.escape(code.group(1))}(?!\w)"), True))
                continue
            words = re.split(r"[\s-]+", term.strip())
            parts = [re.escape(w) for w in words]
            parts[-1] += r"(?:e?s)?"
            out.append((re.compile(r"(?<![\w-])" + r"[\s-]+".join(parts) + r"(?![\w-])", re.I), False))
        return out

    def targets(self) -> set[str]:
        return {_key(t) for t in self.terms}


def _key(term: str) -> str:
    """A {term} role's target as Sphinx compares it: case and whitespace do not matter."""
    return " ".join(term.strip("`").split()).lower()


def glossary(root: Path) -> tuple[list[Entry], tuple[int, int]]:
    """The glossary's entries, and the offsets of its directive in the page."""
    text = (root / GLOSSARY).read_text(encoding="utf-8")
    block = next((b for b in myst.blocks(text) if b.name == "glossary"), None)
    if block is None:
        raise SystemExit(f"terms: no {{glossary}} directive in {GLOSSARY}")
    entries: list[Entry] = []
    body = text[block.body[0]:block.body[1]]
    first_line = text.count("\n", 0, block.body[0]) + 1
    previous_was_term = False
    for i, line in enumerate(body.split("\n")):
        is_term = bool(line.strip()) and not line[:1].isspace()
        if is_term:
            if previous_was_term:
                entries[-1].terms.append(line.strip())
            else:
                entries.append(Entry([line.strip()], first_line + i))
        previous_was_term = is_term
    return entries, (block.start, block.end)


def reading_order(root: Path) -> list[Path]:
    """The book's files in _toc.yml's order."""
    toc = yaml.safe_load((root / "_toc.yml").read_text(encoding="utf-8"))
    names = [toc["root"]]

    def walk(items):
        for item in items or ():
            if "file" in item:
                names.append(item["file"])
            walk(item.get("sections"))
            walk(item.get("chapters"))

    for part in toc.get("parts", ()):
        walk(part.get("chapters"))
    walk(toc.get("chapters"))
    paths = []
    for name in names:
        found = [root / f"{name}{suffix}" for suffix in (".md", ".ipynb", "")
                 if (root / f"{name}{suffix}").is_file()]
        if found:
            paths.append(found[0])
    return paths


# --- What a reader reads ------------------------------------------------------

_TERM_ROLE = re.compile(r"\{term\}`(?P<body>[^`]*)`")
_ANY_ROLE = re.compile(r"\{[\w:.-]+\}`[^`]*`")
_INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(?:.|\n(?!\n))+?(?<!`)\1(?!`)")


def _blank(chars: list[str], a: int, b: int) -> None:
    for k in range(a, min(b, len(chars))):
        if chars[k] != "\n":
            chars[k] = " "


@dataclasses.dataclass
class Prose:
    """A markdown text prepared for matching: same offsets, what is not read blanked."""

    words: str  # prose, code spans blanked
    code: str  # prose with code spans' contents kept (for code terms)
    links: list[tuple[int, str]]  # {term} roles: where, and the target's key
    blocks: list[myst.Block]


def prepare(text: str) -> Prose:
    found = myst.blocks(text)
    chars = list(text)
    for blk in found:
        if blk.kind == "code":
            _blank(chars, blk.start, blk.end)
        for a, b in blk.fence_lines:
            _blank(chars, a, b)
    src = "".join(chars)
    links = []
    for m in _TERM_ROLE.finditer(src):
        body = m.group("body")
        target = re.search(r"<([^<>]+)>\s*$", body)
        links.append((m.start(), _key(target.group(1) if target else body)))
    for m in _ANY_ROLE.finditer(src):
        _blank(chars, m.start(), m.end())
    for at, _ in links:
        chars[at] = "\0"  # a mark: a link in a comment, a heading or math is blanked with it
    src = "".join(chars)
    for pattern, flags in ((r"<!--.*?-->", re.S), (r"\$\$.*?\$\$", re.S), (r"(?<![\\$])\$[^$\n]+\$", 0),
                           (r"(?m)^[ \t]*#{1,6}[ \t].*$", 0), (r"(?m)^[ \t]*\([\w:.-]+\)=[ \t]*$", 0),
                           (r"!\[[^\]]*\]\([^)]*\)", 0), (r"\]\([^)\s]*(?:\s+\"[^\"]*\")?\)", 0),
                           (r"</?[A-Za-z][^>\n]*>", 0)):
        for m in re.finditer(pattern, src, flags):
            start = m.start() + (1 if m.group(0).startswith("](") else 0)  # keep the link text's "]"
            _blank(chars, start, m.end())
    links = [(at, key) for at, key in links if chars[at] == "\0"]
    for at, _ in links:
        chars[at] = " "
    code = "".join(chars)
    for m in _INLINE_CODE.finditer(code):
        _blank(chars, m.start(), m.end())
    return Prose("".join(chars), code, links, found)


@dataclasses.dataclass
class Appearance:
    """Where an entry appears: a link to it, or a use of one of its terms."""

    entry: Entry
    where: str
    offset: int
    link: bool
    defined: bool
    in_main: bool
    shown: str  # the text as written
    order: tuple[int, int] = (0, 0)  # the text's place in reading order, the offset in it

    def ok(self) -> bool:
        return self.link or self.defined


def _emphasised(text: str, start: int, end: int, code: bool) -> bool:
    """Whether text[start:end] is the whole of a bold or italic span (a code term: of a code span in one)."""
    if code:
        m = re.search(r"(?<!`)`+\Z", text[:start])
        n = re.match(r"`+(?!`)", text[end:])
        if not (m and n):
            return False
        start, end = m.start(), end + n.end()
    for mark in ("**", "__", "*", "_"):
        if text[:start].endswith(mark) and text[end:].startswith(mark):
            return True
    return False


def appearances(text: citations.Text, entries: list[Entry], defining: tuple[int, int] | None = None
                ) -> list[Appearance]:
    """Every appearance of every entry in one markdown text, in order; overlapping matches
    keep the longest. ``defining``: offsets inside which every use counts as a definition."""
    prose = prepare(text.text)
    by_target = {key: e for e in entries for key in e.targets()}
    raw = []  # (start, end, entry, code)
    for entry in entries:
        for pattern, code in entry.patterns():
            for m in pattern.finditer(prose.code if code else prose.words):
                raw.append((m.start(), m.end(), entry, code))
    raw.sort(key=lambda r: (r[0], -(r[1] - r[0])))
    kept, reach = [], -1
    for r in raw:
        if r[0] >= reach:
            kept.append(r)
            reach = r[1]
    out = []
    for start, end, entry, code in kept:
        kind = myst.kind_at(prose.blocks, start)
        inside = defining is not None and defining[0] <= start < defining[1]
        out.append(Appearance(entry, text.where(start), start, False,
                              inside or _emphasised(text.text, start, end, code), kind == "main",
                              " ".join(text.text[start:end].split())))
    for at, key in prose.links:
        if key in by_target:
            out.append(Appearance(by_target[key], text.where(at), at, True, False,
                                  myst.kind_at(prose.blocks, at) == "main", key))
    return sorted(out, key=lambda a: a.offset)


def book_texts(root: Path) -> list[tuple[citations.Text, bool]]:
    """The markdown texts in reading order, and whether each is the glossary page."""
    out = []
    for path in reading_order(root):
        for text in citations.file_texts(path, root):
            if text.markdown and "remove-cell" not in text.tags:
                out.append((text, text.source == GLOSSARY))
    return out


@dataclasses.dataclass
class Finding:
    entry: Entry
    first: Appearance | None  # the first appearance anywhere
    first_main: Appearance | None  # the first in the main text


def first_appearances(root: Path) -> list[Finding]:
    entries, directive = glossary(root)
    first: dict[str, Appearance] = {}
    first_main: dict[str, Appearance] = {}
    for i, (text, is_glossary) in enumerate(book_texts(root)):
        if len(first_main) == len(entries):
            break
        for a in appearances(text, entries, directive if is_glossary else None):
            a.order = (i, a.offset)
            first.setdefault(a.entry.name, a)
            if a.in_main:
                first_main.setdefault(a.entry.name, a)
    return [Finding(e, first.get(e.name), first_main.get(e.name)) for e in entries]


def violations(findings: list[Finding]) -> list[str]:
    """The undefined first appearances, in reading order."""
    out = []
    for f in findings:
        for a, reader in ((f.first, ""), (f.first_main, " in the main text")):
            if a is None or a.ok() or (reader and a is f.first):
                continue
            out.append((a.order, f"{a.where}: {f.entry.name!r} first appears{reader} as {a.shown!r}, "
                                 f"neither {{term}}`{f.entry.name.strip('`')}` nor its **definition**"))
    return [line for _, line in sorted(out)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.terms", description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="list the terms first used undefined; exit 1 if any")
    mode.add_argument("--list", action="store_true", help="every term and where it first appears")
    parser.add_argument("--root", default=str(ROOT), help="the book's root (default: this repository)")
    args = parser.parse_args(argv)
    findings = first_appearances(Path(args.root).resolve())
    if args.list:
        for f in findings:
            for a, label in ((f.first, "first"), (f.first_main, "main")):
                state = "never" if a is None else ("link" if a.link else "defined" if a.defined else "UNDEFINED")
                print(f"{f.entry.name:32} {label:5} {state:9} {a.where if a else ''}")
    problems = violations(findings)
    if args.check:
        for p in problems:
            print(p)
    undefined = {f.entry.name for f in findings
                 if any(a is not None and not a.ok() for a in (f.first, f.first_main))}
    print(f"terms: {len(findings)} glossary entries; {len(undefined)} first appear neither defined nor "
          f"linked ({len(problems)} places)")
    return 1 if problems and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
