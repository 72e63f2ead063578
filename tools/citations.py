"""Check the book's citations of vLLM's source against the vLLM 0.33.0 wheel.

    python -m tools.citations --check            every citation in the book (what `make test` runs)
    python -m tools.citations --rewrite PATH...  convert older citation forms in place

The notation (book/code_map.md, "Citing vLLM's source") is a name, then where
it is: (`free_blocks`, `v1/core/block_pool.py:816-849`). The place is one code
span, ``path:line`` or ``path:first-last``, the path relative to the ``vllm``
package; the name is the code span or the "quoted fragment" right before it,
separated by a comma or an opening parenthesis, and must occur in the cited
lines (give or take ``SLACK`` lines). In docstrings the spans take double
backticks. SGLang pins no release: an SGLang citation names a file under
``sglang/`` and a function, never lines.

The check reads the cited files straight from the wheel (a zip), which it
downloads once with pip into a cache outside the repository: ``$PAGEDKV_CACHE``,
else ``$XDG_CACHE_HOME/pagedkv``, else ``~/.cache/pagedkv``. vLLM is never
installed. Without a wheel and without a network the check is skipped (exit 0),
except under ``CI=true``, where a skipped check would pass unseen (exit 1).

``--rewrite`` turns the older forms ("`v1/core/kv_cache_manager.py`, line 302",
"vllm/sampling_params.py, line 592", "(lines 488-498)" after a cited file,
"same file, lines 932-936") into the notation. It needs the wheel too: a short
path is resolved against the wheel's files, and a citation is converted only
when a name from the text before it occurs in the cited lines; the rest are
listed for a person to convert. Notebooks change in their cell sources only,
written back in the repository's JSON layout (indent 1, sorted keys).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import tokenize
import zipfile
from pathlib import Path

VLLM_VERSION = "0.33.0"
SLACK = 3  # lines either side of a cited range in which the name may sit
ROOT = Path(__file__).resolve().parents[1]
# Where the book cites vLLM: prose, notebook cells, the library's docstrings and comments.
SOURCE_GLOBS = ("chapters/*.ipynb", "exercises/*.ipynb", "solutions/*.ipynb",
                "book/*.md", "README.md", "lib/pagedkv/**/*.py")

# --- The notation -----------------------------------------------------------

# Whitespace inside a citation may break a line; in a Python comment the next
# line starts with "#" (or "#:" for an attribute's doc comment).
_W = r"[ \t]*(?:\n[ \t]*(?:#:?[ \t]*)?)*"  # unambiguous, so that no match backtracks for long
_SEP = _W + r"(?:[,(]" + _W + r")?"
_SPAN = r"(?<!`)(?P<tick>``?)(?!`)"  # a code span's opening, one or two backticks
CITATION = re.compile(_SPAN + r"(?P<path>[\w.-]+(?:/[\w.-]+)*\.[A-Za-z]+)"
                      r"(?::(?P<first>\d+)(?:(?P<dash>[-\u2013])(?P<last>\d+))?)?(?P=tick)(?!`)")
# The name right before a citation: a code span or a quoted fragment, then a separator.
NAME_BEFORE = re.compile(r"(?:" + _SPAN + r"(?P<code>[^`]+?)(?P=tick)(?!`)"
                         r"|[\"\u201c](?P<quote>[^\"\u201c\u201d]+)[\"\u201d])" + _SEP + r"\Z")
_NAME_LOOKBACK = 400  # characters before a citation searched for its name
# A code span that is a file (with or without lines) is a place, never a name.
FILE_SPAN = re.compile(r"(?:[\w.-]+/)*[\w.-]+\.(?:py|cu|cuh|h|hpp|cpp)(?::[\d\-\u2013]*)?")
DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
ELLIPSIS = re.compile(r"\s*(?:\.\.\.|\u2026)\s*")

# --- The older forms, for --rewrite and so that --check catches them ---------

_RANGE = r"\d+(?:" + _W + r"[-\u2013]" + _W + r"\d+)?"
_RANGES = _RANGE + r"(?:" + _W + r"(?:,|and|,[ \t]*and)" + _W + _RANGE + r")*"
_OLD_PATH = (r"(?:(?<!`)(?P<otick>``?)(?P<opath>[\w.-]+(?:/[\w.-]+)*\.(?:py|cu|cuh|h|hpp|cpp))(?P=otick)(?!`)"
             r"|(?<![\w/`.-])(?P<bare>(?:[\w.-]+/)*[\w.-]+\.py)(?![\w`]))")
OLD_CITATION = re.compile(
    r"(?:" + _OLD_PATH + _W + r"(?:," + _W + r")?|(?P<same>\bsame" + _W + r"file," + _W + r"))?"
    r"(?:(?P<word>\blines?\b)" + _W + r")?(?P<ranges>" + _RANGES + r")(?:" + _W + r"\bthere\b)?")


@dataclasses.dataclass
class Text:
    """One stretch of the book that may cite vLLM: a page, a notebook cell, a Python file."""

    source: str  # the file, relative to the root
    text: str
    cell: int | None = None  # a notebook cell's index
    regions: list[tuple[int, int]] | None = None  # a .py file: its comments and strings only

    def where(self, offset: int) -> str:
        """'chapters/x.ipynb, cell 8, line 5' or 'lib/pagedkv/x.py:91'."""
        line = self.text.count("\n", 0, offset) + 1
        if self.cell is not None:
            return f"{self.source}, cell {self.cell}, line {line}"
        return f"{self.source}:{line}"

    def prose(self, offset: int) -> bool:
        """Whether ``offset`` is prose: in a .py file, a comment or a string."""
        return self.regions is None or any(a <= offset < b for a, b in self.regions)

    @property
    def double_ticks(self) -> bool:
        """Python files write code spans as reST does, with two backticks."""
        return self.source.endswith(".py")


@dataclasses.dataclass
class Citation:
    """A citation in the notation, as written."""

    text: Text
    start: int  # the place's code span
    end: int
    path: str
    first: int | None
    last: int | None
    name: str | None = None
    quoted: bool = False
    dash: str = "-"

    @property
    def sglang(self) -> bool:
        return self.path.startswith("sglang/")

    def where(self) -> str:
        return self.text.where(self.start)


def python_regions(text: str) -> list[tuple[int, int]] | None:
    """Offsets of the comments and strings of Python source; None when it does not tokenize
    (a notebook cell with IPython syntax), and then all of it counts as prose."""
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    regions = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in (tokenize.COMMENT, tokenize.STRING):
                (r0, c0), (r1, c1) = tok.start, tok.end
                regions.append((starts[r0 - 1] + c0, starts[r1 - 1] + c1))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    return regions


def notebook_texts(path: Path, rel: str) -> list[Text]:
    """A notebook's cells, markdown and code, as texts."""
    texts = []
    for i, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
        src = "".join(cell["source"])
        regions = python_regions(src) if cell["cell_type"] == "code" else None
        texts.append(Text(rel, src, cell=i, regions=regions))
    return texts


def file_texts(path: Path, root: Path) -> list[Text]:
    """The texts of one file of the book."""
    rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
    if path.suffix == ".ipynb":
        return notebook_texts(path, rel)
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        return [Text(rel, text, regions=python_regions(text) or [])]
    return [Text(rel, text)]


def book_files(root: Path) -> list[Path]:
    return sorted({p for pattern in SOURCE_GLOBS for p in root.glob(pattern)})


def parse(text: Text) -> list[Citation]:
    """The citations in the notation in one text, each with the name written before it."""
    found = []
    for m in CITATION.finditer(text.text):
        if not text.prose(m.start()):
            continue
        first = m.group("first")
        if first is None and not m.group("path").startswith("sglang/"):
            continue  # a path without lines is a pointer, not a citation
        cite = Citation(text, m.start(), m.end(), m.group("path"),
                        int(first) if first else None,
                        int(m.group("last") or first) if first else None,
                        dash=m.group("dash") or "-")
        before = NAME_BEFORE.search(text.text, max(0, m.start() - _NAME_LOOKBACK), m.start())
        if before and not FILE_SPAN.fullmatch(before.group("code") or ""):
            cite.name = before.group("code") or before.group("quote")
            cite.quoted = before.group("quote") is not None
        found.append(cite)
    return found


def old_citations(text: Text) -> list[re.Match]:
    """Citations in an older form: a line number in words, or a path followed by a bare range."""
    found = []
    for m in OLD_CITATION.finditer(text.text):
        has_path = m.group("opath") or m.group("bare")
        if not text.prose(m.start()) or not (m.group("word") or (has_path and re.search(r"[-\u2013]", m.group("ranges")))):
            continue
        found.append(m)
    return found


# --- The wheel ----------------------------------------------------------------

def cache_dir() -> Path:
    """Where the wheel is kept: outside the repository, shared by every checkout."""
    if os.environ.get("PAGEDKV_CACHE"):
        return Path(os.environ["PAGEDKV_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedkv"


def cached_wheel(directory: Path) -> Path | None:
    wheels = sorted(directory.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    return wheels[0] if wheels else None


def download_wheel(directory: Path) -> Path | None:
    """pip downloads the wheel (about 340 MB) into a temporary folder first, so that an
    interrupted download never looks cached. None when pip cannot fetch it."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        # Any platform's wheel holds the same Python files; naming one lets a Mac fetch it.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--platform", "manylinux_2_28_x86_64", "--retries", "1", "--timeout", "20",
               "--quiet", "--disable-pip-version-check", "--dest", tmp, f"vllm=={VLLM_VERSION}"]
        print(f"citations: downloading the vLLM {VLLM_VERSION} wheel into {directory} ...", file=sys.stderr)
        if subprocess.run(cmd).returncode != 0:
            return None
        fetched = cached_wheel(Path(tmp))
        if fetched is None:
            return None
        return Path(fetched.replace(directory / fetched.name))


def find_wheel() -> Path | None:
    directory = cache_dir()
    return cached_wheel(directory) or download_wheel(directory)


class Wheel:
    """The vLLM wheel's source files, read from the zip without unpacking it."""

    def __init__(self, path: Path):
        self.zip = zipfile.ZipFile(path)
        self.files = {n[len("vllm/"):] for n in self.zip.namelist() if n.startswith("vllm/")}
        self._lines: dict[str, list[str]] = {}

    def lines(self, path: str) -> list[str]:
        if path not in self._lines:
            data = self.zip.read("vllm/" + path).decode("utf-8", errors="replace")
            self._lines[path] = data.splitlines()
        return self._lines[path]

    def resolve(self, path: str) -> list[str]:
        """The wheel's files an older, shorter path may mean: ``vllm/x.py`` is ``x.py``,
        ``triton_attn.py`` whichever file of that name there is."""
        path = path.removeprefix("vllm/")
        if path in self.files:
            return [path]
        return sorted(f for f in self.files if f.endswith("/" + path))


# --- Checking -----------------------------------------------------------------

def _prose_only(text: str) -> str:
    """A stretch of source as words: comment marks dropped, a message that Python
    concatenates from several literals ("... on the "\n f"block size") joined into
    one, whitespace collapsed."""
    text = re.sub(r"(?m)^\s*#+", " ", text)
    text = re.sub(r"(?<!\\)([\"'])\s*[rRbBfFuU]{0,2}\1", "", text)
    return " ".join(text.split())


def occurs(name: str, quoted: bool, lines: list[str]) -> bool:
    """Whether the cited name is in these lines. A dotted name counts by its last part
    (``BlockPool.free_blocks`` is ``def free_blocks`` inside the class); other code must
    be there as written, a quoted fragment as words, "..." standing for a cut."""
    text = "\n".join(lines)
    if quoted:
        words, at = _prose_only(text), 0
        for piece in ELLIPSIS.split(name.strip()):
            at = words.find(" ".join(piece.split()), at)
            if at < 0:
                return False
        return True
    if DOTTED_NAME.fullmatch(name):
        last = name.rsplit(".", 1)[-1]
        return re.search(rf"(?<!\w){re.escape(last)}(?!\w)", text) is not None
    # Other code as written, whole words at its ends: `seed + i` is not `seed + index`.
    code = re.escape(" ".join(name.split()))
    code = (r"(?<!\w)" if name.strip()[:1].isalnum() or name.strip()[:1] == "_" else "") + code
    code += r"(?!\w)" if name.strip()[-1:].isalnum() or name.strip()[-1:] == "_" else ""
    return re.search(code, " ".join(text.split())) is not None


def found_at(name: str, quoted: bool, lines: list[str], near: int) -> list[int]:
    """The lines where the name does occur, nearest to the cited line first (at most five)."""
    hits = [i + 1 for i in range(len(lines)) if occurs(name, quoted, lines[i:i + 1])]
    if not hits and quoted:  # a fragment across lines: the first line of a window holding it
        width = name.count(" ") // 6 + 3
        hits = [i + 1 for i in range(len(lines)) if occurs(name, quoted, lines[i:i + width])
                and not occurs(name, quoted, lines[i + 1:i + 1 + width])]
    return sorted(hits, key=lambda n: abs(n - near))[:5]


def _lines_label(first: int, last: int) -> str:
    return f"line {first}" if first == last else f"lines {first}-{last}"


def check_citation(cite: Citation, wheel: Wheel) -> str | None:
    """What is wrong with one citation, with the wheel's evidence; None when it holds."""
    where = cite.where()
    if cite.sglang:
        if cite.first is not None:
            return f"{where}: SGLang pins no release: cite `{cite.path}` by a function, without line numbers"
        return None if cite.name else f"{where}: `{cite.path}` names no function before it"
    if cite.path not in wheel.files:
        hint = ""
        if cite.path.startswith("vllm/") and cite.path[5:] in wheel.files:
            hint = " (paths are relative to the vllm package: drop the leading vllm/)"
        elif wheel.resolve(cite.path):
            hint = f" (did you mean {' or '.join(wheel.resolve(cite.path))}?)"
        return f"{where}: `{cite.path}` is not a file of the vLLM {VLLM_VERSION} wheel{hint}"
    n = len(wheel.lines(cite.path))
    if cite.dash != "-":
        return f"{where}: write the range `{cite.first}-{cite.last}` with a hyphen, not {cite.dash!r}"
    if cite.first < 1 or cite.first > cite.last:
        return f"{where}: the range {cite.first}-{cite.last} of `{cite.path}` is reversed or empty"
    if cite.last > n:
        return f"{where}: `{cite.path}` has {n} lines; the citation runs to line {cite.last}"
    if cite.name is None:
        return f"{where}: `{cite.path}:{cite.first}` names nothing before it; write (`name`, `{cite.path}:...`)"
    lines = wheel.lines(cite.path)
    lo, hi = max(1, cite.first - SLACK), min(n, cite.last + SLACK)
    if occurs(cite.name, cite.quoted, lines[lo - 1:hi]):
        return None
    shown = f'"{cite.name}"' if cite.quoted else f"`{cite.name}`"
    hits = found_at(cite.name, cite.quoted, lines, cite.first)
    evidence = f"found at line {', '.join(map(str, hits))}" if hits else "not in the file at all"
    return f"{where}: {shown} not in {_lines_label(cite.first, cite.last)} of `{cite.path}`; {evidence}"


def check(files: list[Path], root: Path, wheel: Wheel) -> tuple[list[str], dict]:
    """Every problem in these files, and what was counted."""
    problems, counts = [], {"vllm": 0, "sglang": 0, "files": set(), "cited": set()}
    for path in files:
        for text in file_texts(path, root):
            for cite in parse(text):
                counts["sglang" if cite.sglang else "vllm"] += 1
                counts["files"].add(text.source)
                if not cite.sglang:
                    counts["cited"].add(cite.path)
                problem = check_citation(cite, wheel)
                if problem:
                    problems.append(problem)
            for m in old_citations(text):
                shown = " ".join(m.group(0).split())
                problems.append(f"{text.where(m.start())}: older citation form {shown!r}: "
                                "write (`name`, `path:first-last`), or run --rewrite")
    return problems, counts


# --- Rewriting the older forms ------------------------------------------------

@dataclasses.dataclass
class Conversion:
    where: str
    old: str
    new: str | None  # None: left for a person, see `why`
    why: str = ""


def _ranges(text: str) -> list[tuple[int, int]]:
    pairs = re.findall(r"(\d+)(?:\s*[#:]*\s*[-\u2013]\s*[#:]*\s*(\d+))?", text)
    return [(int(a), int(b or a)) for a, b in pairs]


def _names_before(text: Text, start: int, floor: int) -> list[tuple[int, re.Match]]:
    """Code spans and quoted fragments in the 300 characters before ``start`` (not before
    ``floor``), nearest first, leaving out spans that are themselves paths. The spans are
    found from ``floor`` on, so that backticks pair up as they do in the text."""
    spans = re.finditer(_SPAN + r"(?P<code>[^`]+?)(?P=tick)(?!`)|[\"\u201c](?P<quote>[^\"\u201c\u201d]+)[\"\u201d]",
                        text.text[floor:start])
    keep = [m for m in spans if m.end() >= start - floor - 300 and not FILE_SPAN.fullmatch(m.group("code") or "")]
    return [(floor, m) for m in reversed(keep)]


def _resolve(path: str, wheel: Wheel, known: set[str]) -> list[str]:
    """The wheel files an older path may mean; of several, the one this source file names in full."""
    files = wheel.resolve(path)
    named = [f for f in files if f in known]
    return named if len(files) > 1 and len(named) == 1 else files


def named_files(texts: list[Text], wheel: Wheel) -> set[str]:
    """The wheel files a source file names by their full path, cited or only pointed to."""
    return {m.group("path").removeprefix("vllm/") for t in texts for m in CITATION.finditer(t.text)
            if m.group("path").removeprefix("vllm/") in wheel.files}


def _cited_paths(text: Text, wheel: Wheel, known: set[str]) -> list[tuple[int, str]]:
    """The files a text names (cited or pointed to, any form) and where: the candidates
    for a bare 'lines 12-14' that names no file."""
    named = [(m.start(), m.group("path")) for m in CITATION.finditer(text.text)]
    named += [(m.start(), m.group("opath") or m.group("bare")) for m in old_citations(text)
              if m.group("opath") or m.group("bare")]
    resolved = [(at, _resolve(path, wheel, known)) for at, path in named]
    return [(at, files[0]) for at, files in resolved if len(files) == 1]


@dataclasses.dataclass
class Edit:
    start: int
    end: int
    new: str
    name: str
    brk: str = ""  # the line break the replaced text held, to put back at the next space


def convert_one(text: Text, m: re.Match, floor: int, wheel: Wheel, known: set[str]) -> Edit | Conversion:
    """The edit for one older citation, or why there is none."""
    old = " ".join(m.group(0).split())
    where = text.where(m.start())
    ranges = _ranges(m.group("ranges"))
    if len(ranges) > 1:
        return Conversion(where, old, None, "several ranges: give each its own name")
    first, last = ranges[0]
    path = m.group("opath") or m.group("bare")
    if path:
        files = _resolve(path, wheel, known)
        if len(files) != 1:
            why = "not a file of the wheel" if not files else f"ambiguous: {', '.join(files)}"
            return Conversion(where, old, None, f"`{path}`: {why}")
    else:  # 'lines 12-14', 'same file': one of the files this text names, the nearest before first
        cited = sorted(_cited_paths(text, wheel, known), key=lambda c: (c[0] > m.start(), abs(c[0] - m.start())))
        files = list(dict.fromkeys(p for _, p in cited))
        if not files:
            return Conversion(where, old, None, "names no file, nor does its cell or paragraph")
    names = _names_before(text, m.start(), floor)
    if names and _adjacent(text, names[0], m):
        names = names[:1]  # the text names what it cites: no other name may stand in for it
    for file in files:
        lines = wheel.lines(file)
        if last > len(lines) or first > last:
            continue
        lo, hi = max(1, first - SLACK), min(len(lines), last + SLACK)
        for base, name in names:
            quoted = name.group("quote") is not None
            if occurs(name.group("code") or name.group("quote"), quoted, lines[lo - 1:hi]):
                return _replacement(text, m, base, name, file, first, last)
    shown = " or ".join(f"`{f}`" for f in files)
    if names and len(names) == 1 and _adjacent(text, names[0], m):
        name = " ".join(names[0][1].group(0).split())
        return Conversion(where, old, None, f"{name} is not in {_lines_label(first, last)} of {shown}")
    return Conversion(where, old, None, f"no name before it occurs in {_lines_label(first, last)} of {shown}")


def _adjacent(text: Text, found: tuple[int, re.Match], m: re.Match) -> bool:
    """Whether only a separator ("," / "(" / "in" / "of") stands between a name and a citation."""
    base, name = found
    return re.fullmatch(_SEP + r"|" + _W + r"(?:in|of)" + _W, text.text[base + name.end():m.start()]) is not None


def _replacement(text: Text, m: re.Match, base: int, name: re.Match, file: str, first: int, last: int) -> Edit:
    """Write (name, `path:lines`): the name stays where it is when only a separator
    ("," / "(" / "in" / "of") stands between it and the place; otherwise a copy goes in front."""
    tick = m.group("otick") or ("``" if text.double_ticks else "`")
    place = f"{tick}{file}:{first}" + (f"-{last}" if last != first else "") + tick
    name_end = base + name.end()
    gap = text.text[name_end:m.start()]
    label = name.group("code") or name.group("quote")
    if re.fullmatch(_SEP, gap):
        edit = Edit(m.start(), m.end(), place, label)
    elif re.fullmatch(_W + r"(?:in|of)" + _W, gap):
        # "`name` in\n# `path`" -> "`name`,\n# `path:...`": the word goes, the break stays.
        edit = Edit(name_end, m.end(), re.sub(r"[ \t]*\b(?:in|of)\b[ \t]*", ", ", gap, count=1).replace(", \n", ",\n") + place, label)
    else:
        edit = Edit(m.start(), m.end(), f"{name.group(0)}, {place}", label)
    removed = text.text[edit.start:edit.end]
    brk = re.search(r"\n[ \t]*(?:#:?[ \t]*)?", removed)
    if brk and "\n" not in edit.new:
        edit.brk = brk.group(0)
    return edit


def _apply(text: str, edits: list[Edit]) -> str:
    """Apply edits from the last to the first. A line break the old text held moves to the
    first space after the new text, so that the paragraph keeps its line count."""
    for e in sorted(edits, key=lambda e: e.start, reverse=True):
        rest = text[e.end:]
        if e.brk:
            space = re.search(r" |\n", rest)
            if space and space.group(0) == " ":
                rest = rest[:space.start()].rstrip(" \t") + e.brk + rest[space.end():]
            # else the line ends right after the citation: the two lines join.
        text = text[:e.start] + e.new + rest
    return text


def convert_text(text: Text, wheel: Wheel, known: set[str]) -> tuple[str, list[Conversion]]:
    """The text with every older citation that can be converted rewritten, and a record of each."""
    edits, record, floor = [], [], 0
    for m in old_citations(text):
        result = convert_one(text, m, floor, wheel, known)
        if isinstance(result, Conversion):
            record.append(result)
        else:
            edits.append(result)
            old = " ".join(text.text[result.start:m.end()].split())
            record.append(Conversion(text.where(m.start()), old, " ".join(result.new.split()),
                                     f"name `{result.name}`"))
        floor = m.end()  # a later citation's name is never in front of this one
    return _apply(text.text, edits), record


def _split_source(text: str) -> list[str]:
    """A cell source as nbformat stores it: lines that keep their newline."""
    return re.findall(r"[^\n]*\n|[^\n]+", text)


def dump_notebook(nb: dict) -> str:
    """The repository's notebook layout (what nbformat.write writes)."""
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def rewrite_file(path: Path, root: Path, wheel: Wheel) -> list[Conversion]:
    """Convert one file in place; notebooks change in their cell sources only."""
    raw = path.read_text(encoding="utf-8")
    texts = file_texts(path, root)
    known = named_files(texts, wheel)
    record = []
    if path.suffix == ".ipynb":
        nb = json.loads(raw)
        if dump_notebook(nb) != raw:
            return [Conversion(str(path), "", None, "not in the repository's JSON layout: left alone")]
        for text in texts:
            new, conversions = convert_text(text, wheel, known)
            record += conversions
            if new != text.text:
                cell = nb["cells"][text.cell]
                cell["source"] = _split_source(new) if isinstance(cell["source"], list) else new
        out = dump_notebook(nb)
    else:
        out, record = convert_text(texts[0], wheel, known)
    if out != raw:
        path.write_text(out, encoding="utf-8")
    return record


def expand(paths: list[str]) -> list[Path]:
    """Files, and the .py, .md and .ipynb files under folders."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.suffix in (".py", ".md", ".ipynb")
                          and ".ipynb_checkpoints" not in f.parts)
        else:
            out.append(p)
    return out


# --- Command line -------------------------------------------------------------

def open_wheel(path: str | None) -> Wheel | str:
    """The wheel, or why there is none."""
    if path:
        found = Path(path)
        if not found.is_file():
            return f"no wheel at {found}"
    else:
        found = find_wheel()
        if found is None:
            return f"no vLLM {VLLM_VERSION} wheel in {cache_dir()} and pip could not download it"
    try:
        return Wheel(found)
    except zipfile.BadZipFile:
        return f"{found} is not a readable wheel: delete it and run again"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.citations", description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="check every citation in the book")
    mode.add_argument("--rewrite", nargs="+", metavar="PATH", help="convert older forms in these files in place")
    parser.add_argument("--root", default=str(ROOT), help="the book's root (default: this repository)")
    parser.add_argument("--wheel", help="a vLLM wheel to read instead of the cached one")
    args = parser.parse_args(argv)

    wheel = open_wheel(args.wheel)
    if isinstance(wheel, str):
        if os.environ.get("CI", "").lower() in ("true", "1"):
            print(f"citations: FAILED: {wheel} (CI=true: the check may not be skipped)", file=sys.stderr)
            return 1
        print(f"citations: skipped: {wheel}", file=sys.stderr)
        return 0
    root = Path(args.root).resolve()
    if args.rewrite:
        return report_rewrite([c for p in expand(args.rewrite) for c in rewrite_file(p.resolve(), root, wheel)])
    problems, counts = check(book_files(root), root, wheel)
    for problem in problems:
        print(problem)
    print(f"citations: {counts['vllm']} vLLM citations in {len(counts['files'])} files checked against "
          f"{len(counts['cited'])} files of the vLLM {VLLM_VERSION} wheel; {counts['sglang']} SGLang "
          f"citations (no lines to check); {len(problems)} problems")
    return 1 if problems else 0


def report_rewrite(record: list[Conversion]) -> int:
    done = [c for c in record if c.new is not None]
    for c in done:
        print(f"converted  {c.where}: {c.old!r} -> {c.new!r} ({c.why})")
    for c in record:
        if c.new is None:
            print(f"by hand    {c.where}: {c.old!r}: {c.why}")
    print(f"citations: {len(done)} converted, {len(record) - len(done)} left to convert by hand")
    return 0


if __name__ == "__main__":
    sys.exit(main())
