"""Check the book's citations of vLLM's and SGLang's source against their released wheels.

    python -m tools.citations --check            every citation in the book (what `make test` runs)
    python -m tools.citations --report           per chapter: main-text words, citations in the main text and in asides
    python -m tools.citations --budget           fail when a chapter's main text is over its budget

``--check``, ``--report`` and ``--budget`` combine (``--check --report``).

**The releases.** The book follows vLLM 0.33.0 and SGLang 0.5.23
(``RELEASES``). A citation is one of two forms (book/code_map.md, "Citing
vLLM's and SGLang's source"):

* a **link** to the cited lines at the release tag, its text the cited name in
  a code span (or a "quoted fragment" of a comment or message):
  ``[`free_blocks`](https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/core/block_pool.py#L816-L849)``,
  ``[`alloc_extend_naive`](https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/mem_cache/allocator/paged.py#L41-L114)``;
  the anchor is ``#L<first>-L<last>`` or ``#L<line>``. A link to another tag
  or branch, a malformed anchor, a link to a file without lines, or a path
  outside the package (``vllm/``, ``python/sglang/``) is a problem.
* a **code span**, for docstrings and code comments, where a link does not
  render: a name, then where it is: (`free_blocks`, `v1/core/block_pool.py:816-849`).
  The place is ``path:line`` or ``path:first-last``, the path relative to the
  ``vllm`` package, or starting with ``sglang/`` for SGLang; the name is the
  code span or the "quoted fragment" right before it, separated by a comma or
  an opening parenthesis. In docstrings the spans take double backticks.

Either way the file must be in the wheel, the range inside the file, and the
name in the cited lines (give or take ``SLACK`` lines). An SGLang code span
that names a file without lines (the form the book used before SGLang was
pinned) fails the check, naming the tag to link to; the citations in markdown still written
as code spans rather than links are counted (per chapter under ``--report``).

**Asides and the budget.** In markdown (notebook cells, book pages) an aside
is a colon-fence dropdown titled exactly ``In vLLM 0.33.0`` or
``In SGLang 0.5.23``; answers are ``Answer`` dropdowns; code is code cells
and fenced code (``tools/myst.py`` has the fence rules). A dropdown titled
"In vLLM ..." or "In SGLang ..." otherwise, and a fence that never closes,
are problems of ``--check``. For each chapter (``chapters/*.ipynb``) the
report counts the citations in the main text, in asides, in answers and in
code, and the main text's words: the markdown cells (``remove-cell`` ones
left out) outside asides, answers and code, counted by
``tools.myst.count_words`` (a code span or inline math is one word; link
targets, display math and HTML comments are not words). ``--budget`` fails
a chapter with more than ``MAX_MAIN_CITATIONS`` citations or more than
``MAX_MAIN_WORDS`` words in its main text. The report and the budget need
no wheel.

**The wheels.** The check reads the cited files straight from the wheels
(zips), which it downloads once with pip into a cache outside the repository:
``$PAGEDKV_CACHE``, else ``$XDG_CACHE_HOME/pagedkv``, else
``~/.cache/pagedkv`` (vLLM's is about 340 MB, SGLang's about 39 MB). Neither
package is ever installed. Without a wheel and without a network that
release's citations are skipped (exit 0), except under ``CI=true``, where a
skipped check would pass unseen (exit 1).
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

from tools import myst


@dataclasses.dataclass(frozen=True)
class Release:
    """A release the book cites: where its wheel comes from and where its repository keeps the package."""

    key: str  # "vllm", "sglang"
    project: str  # as the book names it
    version: str
    package: str  # the wheel's top-level package
    repository: str  # https://github.com/<repository>
    repo_package: str  # the package's folder in the repository, ending in "/"
    span_prefix: str  # a code-span citation's path starts with this ("" for vLLM: the package is implied)
    pip_platform: tuple[str, ...]  # pip download's platform options: any machine fetches the same wheel
    size: str

    @property
    def tag(self) -> str:
        return f"v{self.version}"

    @property
    def label(self) -> str:
        return f"{self.project} {self.version}"

    def link(self, path: str, first: int, last: int | None = None) -> str:
        """The link to lines of a file of the package (``path`` relative to it) at the release tag."""
        anchor = f"#L{first}" + (f"-L{last}" if last is not None and last != first else "")
        return f"https://github.com/{self.repository}/blob/{self.tag}/{self.repo_package}{path}{anchor}"


VLLM = Release("vllm", "vLLM", "0.33.0", "vllm", "vllm-project/vllm", "vllm/", "",
               ("--platform", "manylinux_2_28_x86_64"), "about 340 MB")
SGLANG = Release("sglang", "SGLang", "0.5.23", "sglang", "sgl-project/sglang", "python/sglang/", "sglang/",
                 ("--platform", "manylinux_2_34_x86_64", "--python-version", "3.11", "--implementation", "cp",
                  "--abi", "cp311"), "about 39 MB")
RELEASES = (VLLM, SGLANG)
VLLM_VERSION = VLLM.version
SLACK = 3  # lines either side of a cited range in which the name may sit
MAX_MAIN_CITATIONS = 2  # per chapter, in the main text (outside asides, answers and code)
MAX_MAIN_WORDS = 3500  # per chapter, of main text
ROOT = Path(__file__).resolve().parents[1]
# Where the book cites vLLM and SGLang: prose, notebook cells, the library's docstrings and comments.
SOURCE_GLOBS = ("chapters/*.ipynb", "exercises/*.ipynb", "solutions/*.ipynb",
                "book/*.md", "README.md", "lib/pagedkv/**/*.py")
CHAPTER_GLOB = "chapters/*.ipynb"

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

# A link into either repository; what follows the repository is parsed by _BLOB.
GITHUB_URL = re.compile(r"https?://github\.com/(?P<repo>vllm-project/vllm|sgl-project/sglang)"
                        r"(?P<rest>(?:/[^\s<>()\[\]`'\"]*)?)")
_BLOB = re.compile(r"/(?P<kind>blob|tree)/(?P<tag>[^/#?]+)/?(?P<path>[^#?]*)(?:\?[^#]*)?(?:#(?P<anchor>.*))?\Z")
_ANCHOR = re.compile(r"L(?P<first>\d+)(?:-L(?P<last>\d+))?\Z")
# What stands before a link's URL: markdown's [text]( or reST's `text <.
_MD_LABEL = re.compile(r"\[(?P<label>(?:`[^`]*`|\[[^\[\]`]*\]|[^\[\]`])*)\]\([ \t]*<?\Z")
_RST_LABEL = re.compile(r"`(?P<label>[^`<]+?)[ \t\n]*<\Z")
_CODE_LABEL = re.compile(r"(?P<tick>``?)(?P<code>[^`]+)(?P=tick)\Z")
_QUOTE_LABEL = re.compile(r"[\"\u201c](?P<quote>[^\"\u201c\u201d]+)[\"\u201d]\Z")

# --- The older forms, so that --check refuses them -----------------------------

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
    kind: str = "markdown"  # "markdown" (a page or a markdown cell), "code" (a code cell), "python"
    tags: tuple[str, ...] = ()  # a notebook cell's tags

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

    @property
    def markdown(self) -> bool:
        return self.kind == "markdown"


@dataclasses.dataclass
class Citation:
    """A citation as written: a code span after its name, or a link."""

    text: Text
    start: int  # the place's code span, or the link's text
    end: int
    path: str  # as a code span writes it: relative to vllm/, or sglang/... for SGLang
    first: int | None
    last: int | None
    name: str | None = None
    quoted: bool = False
    dash: str = "-"
    release: Release = VLLM
    link: bool = False
    problem: str | None = None  # what is wrong with its form, found while parsing

    @property
    def sglang(self) -> bool:
        return self.release is SGLANG

    @property
    def package_path(self) -> str:
        """The path inside the release's package."""
        return self.path.removeprefix(self.release.span_prefix)

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
        code = cell["cell_type"] == "code"
        regions = python_regions(src) if code else None
        kind = "code" if code else "markdown" if cell["cell_type"] == "markdown" else "raw"
        texts.append(Text(rel, src, cell=i, regions=regions, kind=kind,
                          tags=tuple(cell.get("metadata", {}).get("tags", ()))))
    return texts


def file_texts(path: Path, root: Path) -> list[Text]:
    """The texts of one file of the book."""
    rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
    if path.suffix == ".ipynb":
        return notebook_texts(path, rel)
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        return [Text(rel, text, regions=python_regions(text) or [], kind="python")]
    return [Text(rel, text)]


def book_files(root: Path) -> list[Path]:
    return sorted({p for pattern in SOURCE_GLOBS for p in root.glob(pattern)})


def parse(text: Text) -> list[Citation]:
    """The citations in one text, code spans and links, in the order they are written."""
    return sorted(parse_spans(text) + parse_links(text), key=lambda c: c.start)


def parse_spans(text: Text) -> list[Citation]:
    """The code-span citations in one text, each with the name written before it."""
    found = []
    for m in CITATION.finditer(text.text):
        if not text.prose(m.start()):
            continue
        first, path = m.group("first"), m.group("path")
        release = SGLANG if path.startswith(SGLANG.span_prefix) else VLLM
        if first is None and release is VLLM:
            continue  # a path without lines is a pointer, not a citation
        cite = Citation(text, m.start(), m.end(), path,
                        int(first) if first else None,
                        int(m.group("last") or first) if first else None,
                        dash=m.group("dash") or "-", release=release)
        before = NAME_BEFORE.search(text.text, max(0, m.start() - _NAME_LOOKBACK), m.start())
        if before and not FILE_SPAN.fullmatch(before.group("code") or ""):
            cite.name = before.group("code") or before.group("quote")
            cite.quoted = before.group("quote") is not None
        found.append(cite)
    return found


def _link_label(text: str, start: int, end: int) -> tuple[int, str] | None:
    """Where a link's text starts and the text, when the URL at start..end is a link's target
    (markdown ``[text](url)`` or reST ``text <url>`_``); None for a bare URL."""
    before = text[max(0, start - 300):start]
    m = _MD_LABEL.search(before)
    if m and re.match(r">?[ \t]*(?:\"[^\"]*\")?[ \t]*\)", text[end:]):
        return start - len(before) + m.start(), m.group("label")
    m = _RST_LABEL.search(before)
    if m and text.startswith(">`", end):  # reST's link text cannot be a code span: it is the name
        return start - len(before) + m.start(), f"``{m.group('label')}``"
    return None


def url_spans(text: Text) -> list[tuple[int, int]]:
    """Where links into vLLM's or SGLang's repository stand (so that no other rule reads them)."""
    return [m.span() for m in GITHUB_URL.finditer(text.text)]


_CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(?:.|\n(?!\n))+?(?<!`)\1(?!`)")


def code_spans(text: Text) -> list[tuple[int, int]]:
    """A markdown text's fenced code and inline code spans: a URL there is shown, not linked."""
    if not text.markdown:
        return []
    fenced = [(blk.start, blk.end) for blk in myst.blocks(text.text) if blk.kind == "code"]
    rest = list(text.text)
    for a, b in fenced:
        rest[a:b] = "\n" * (b - a)
    return fenced + [m.span() for m in _CODE_SPAN.finditer("".join(rest))]


def parse_links(text: Text) -> list[Citation]:
    """The links to lines of vLLM's or SGLang's source in one text, each named by its link text.
    A link to a file that is not a citation (another tag, no lines, a bad anchor) comes back
    with its ``problem`` set; links to a folder at the release, to issues or pull requests
    are no citations."""
    found, in_code = [], code_spans(text)
    for m in GITHUB_URL.finditer(text.text):
        if not text.prose(m.start()) or any(a <= m.start() < b for a, b in in_code):
            continue
        release = VLLM if m.group("repo") == VLLM.repository else SGLANG
        blob = _BLOB.match(m.group("rest"))
        if not blob:
            continue  # the repository, an issue, a pull request, a release page
        label = _link_label(text.text, m.start(), m.end())
        start = label[0] if label else m.start()
        tag, repo_path, anchor = blob.group("tag"), blob.group("path"), blob.group("anchor")
        path = release.span_prefix + repo_path.removeprefix(release.repo_package)
        cite = Citation(text, start, m.end(), path, None, None, release=release, link=True)
        shown = f"{release.project} link to `{repo_path}`"
        if tag != release.tag:
            cite.problem = f"{shown} at {tag!r}: link to the release's tag, {release.tag}"
        elif blob.group("kind") == "tree":
            continue  # a folder at the release: a pointer, not a citation
        elif not repo_path.startswith(release.repo_package):
            cite.problem = (f"{shown}: not in the {release.package} package "
                            f"({release.repo_package}), which is all the wheel holds")
        elif anchor is None or anchor == "":
            cite.problem = f"{shown} without lines: add #L<first>-L<last> (or #L<line>)"
        elif not _ANCHOR.match(anchor):
            cite.problem = f"{shown}: the anchor #{anchor} is not #L<first>-L<last> or #L<line>"
        else:
            a = _ANCHOR.match(anchor)
            cite.first = int(a.group("first"))
            cite.last = int(a.group("last") or a.group("first"))
        if label:
            name = label[1].strip()
            code, quote = _CODE_LABEL.fullmatch(name), _QUOTE_LABEL.fullmatch(name)
            if code and not FILE_SPAN.fullmatch(code.group("code")):
                cite.name = " ".join(code.group("code").split())
            elif quote:
                cite.name, cite.quoted = quote.group("quote"), True
            elif not code and cite.problem is None:
                cite.problem = (f"{shown}: its text {name!r} is not the cited name in a code span "
                                "(or a \"quoted fragment\")")
        found.append(cite)
    return found


def old_citations(text: Text) -> list[re.Match]:
    """Citations in an older form: a line number in words, or a path followed by a bare range."""
    found, urls = [], url_spans(text)
    for m in OLD_CITATION.finditer(text.text):
        has_path = m.group("opath") or m.group("bare")
        if not text.prose(m.start()) or not (m.group("word") or (has_path and re.search(r"[-\u2013]", m.group("ranges")))):
            continue
        if any(a <= m.start() < b for a, b in urls):
            continue
        found.append(m)
    return found


# --- The wheels ---------------------------------------------------------------

def cache_dir() -> Path:
    """Where the wheels are kept: outside the repository, shared by every checkout."""
    if os.environ.get("PAGEDKV_CACHE"):
        return Path(os.environ["PAGEDKV_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedkv"


def cached_wheel(directory: Path, release: Release = VLLM) -> Path | None:
    wheels = sorted(directory.glob(f"{release.package}-{release.version}-*.whl"))
    return wheels[0] if wheels else None


def download_wheel(directory: Path, release: Release = VLLM) -> Path | None:
    """pip downloads the wheel into a temporary folder first, so that an interrupted
    download never looks cached. None when pip cannot fetch it."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        # Any platform's wheel holds the same Python files; naming one lets a Mac fetch it.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *release.pip_platform,
               "--retries", "1", "--timeout", "20", "--quiet", "--disable-pip-version-check", "--dest", tmp,
               f"{release.package}=={release.version}"]
        print(f"citations: downloading the {release.label} wheel ({release.size}) into {directory} ...",
              file=sys.stderr)
        if subprocess.run(cmd).returncode != 0:
            return None
        fetched = cached_wheel(Path(tmp), release)
        if fetched is None:
            return None
        return Path(fetched.replace(directory / fetched.name))


def find_wheel(release: Release = VLLM) -> Path | None:
    directory = cache_dir()
    return cached_wheel(directory, release) or download_wheel(directory, release)


class Wheel:
    """A wheel's source files of one package, read from the zip without unpacking it."""

    def __init__(self, path: Path, package: str = "vllm"):
        self.zip = zipfile.ZipFile(path)
        self.package = package
        prefix = package + "/"
        self.files = {n[len(prefix):] for n in self.zip.namelist() if n.startswith(prefix)}
        self._lines: dict[str, list[str]] = {}

    def lines(self, path: str) -> list[str]:
        if path not in self._lines:
            data = self.zip.read(f"{self.package}/{path}").decode("utf-8", errors="replace")
            self._lines[path] = data.splitlines()
        return self._lines[path]

    def resolve(self, path: str) -> list[str]:
        """The wheel's files an older, shorter path may mean: ``vllm/x.py`` is ``x.py``,
        ``triton_attn.py`` whichever file of that name there is."""
        path = path.removeprefix(self.package + "/")
        if path in self.files:
            return [path]
        return sorted(f for f in self.files if f.endswith("/" + path))


# --- Checking -----------------------------------------------------------------

def _prose_only(text: str) -> str:
    """A stretch of source as words: comment marks dropped, a message that Python
    concatenates from several literals ("... on the "\\n f"block size") joined into
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
    """What is wrong with one citation, with the wheel's evidence; None when it holds.
    An SGLang code span without lines is not checked here (it is one to convert)."""
    where = cite.where()
    if cite.problem:
        return f"{where}: {cite.problem}"
    release, path = cite.release, cite.package_path
    if cite.first is None:
        return None if cite.name else f"{where}: `{cite.path}` names no function before it"
    if path not in wheel.files:
        hint = ""
        if release is VLLM and path.startswith("vllm/") and path[5:] in wheel.files:
            hint = " (paths are relative to the vllm package: drop the leading vllm/)"
        elif wheel.resolve(path):
            hint = f" (did you mean {' or '.join(release.span_prefix + f for f in wheel.resolve(path))}?)"
        return f"{where}: `{cite.path}` is not a file of the {release.label} wheel{hint}"
    n = len(wheel.lines(path))
    if cite.dash != "-":
        return f"{where}: write the range `{cite.first}-{cite.last}` with a hyphen, not {cite.dash!r}"
    if cite.first < 1 or cite.first > cite.last:
        return f"{where}: the range {cite.first}-{cite.last} of `{cite.path}` is reversed or empty"
    if cite.last > n:
        return f"{where}: `{cite.path}` has {n} lines; the citation runs to line {cite.last}"
    if cite.name is None:
        if cite.link:
            url = release.link(path, cite.first, cite.last)
            return f"{where}: the link to `{cite.path}` names nothing: write [`name`]({url})"
        return f"{where}: `{cite.path}:{cite.first}` names nothing before it; write (`name`, `{cite.path}:...`)"
    lines = wheel.lines(path)
    lo, hi = max(1, cite.first - SLACK), min(n, cite.last + SLACK)
    if occurs(cite.name, cite.quoted, lines[lo - 1:hi]):
        return None
    shown = f'"{cite.name}"' if cite.quoted else f"`{cite.name}`"
    hits = found_at(cite.name, cite.quoted, lines, cite.first)
    evidence = f"found at line {', '.join(map(str, hits))}" if hits else "not in the file at all"
    return f"{where}: {shown} not in {_lines_label(cite.first, cite.last)} of `{cite.path}`; {evidence}"


def aside_problems(text: Text) -> list[str]:
    """A markdown text's misnamed asides and fences that never close."""
    problems, found = [], myst.blocks(text.text)
    for blk in found:
        at = text.where(blk.start)
        title = blk.title
        if blk.name == "dropdown" and blk.kind != "aside" and re.match(r"In (?:vLLM|SGLang)\b", title):
            problems.append(f"{at}: the aside {title!r} is titled neither {' nor '.join(map(repr, myst.ASIDE_TITLES))}")
        if not blk.closed:
            what = f"{{{blk.name}}} {title}".strip() if blk.kind != "code" else "code fence"
            holder = [o for o in found if o is not blk and o.start < blk.start and o.holds(blk.start)]
            end = (f"{{{holder[-1].name}}} opened on line {holder[-1].line}" if holder
                   else "cell" if text.cell is not None else "page")
            problems.append(f"{at}: the {what} never closes: it runs to the end of the {end}")
    return problems


def _as_wheels(wheels) -> dict[str, Wheel | None]:
    """A vLLM wheel alone, or {release key: wheel or None}."""
    if isinstance(wheels, Wheel):
        return {VLLM.key: wheels, SGLANG.key: None}
    return {r.key: wheels.get(r.key) for r in RELEASES}


def check(files: list[Path], root: Path, wheels) -> tuple[list[str], dict]:
    """Every problem in these files, and what was counted. ``wheels``: the vLLM wheel, or
    {release key: wheel or None}; a release without a wheel has its citations counted, not checked."""
    wheels = _as_wheels(wheels)
    problems = []
    counts = {"files": set(), "links": 0, "to_convert": [], "spans_in_markdown": 0,
              **{r.key: 0 for r in RELEASES}, "cited": {r.key: set() for r in RELEASES},
              "unchecked": {r.key: 0 for r in RELEASES}, "checked": {r.key: 0 for r in RELEASES}}
    for path in files:
        for text in file_texts(path, root):
            if text.markdown:
                problems += aside_problems(text)
            for cite in parse(text):
                key = cite.release.key
                counts[key] += 1
                counts["links"] += cite.link
                counts["spans_in_markdown"] += text.markdown and not cite.link
                counts["files"].add(text.source)
                if cite.first is None and cite.problem is None:
                    # An SGLang file named without lines: the form from before SGLang was pinned.
                    counts["to_convert"].append(cite)
                    problems.append(f"{cite.where()}: {cite.name or '(no name)'} in `{cite.path}` has no lines: "
                                    f"link to them at {SGLANG.tag}")
                    continue
                wheel = wheels[key]
                if wheel is None and cite.problem is None:
                    counts["unchecked"][key] += 1
                    continue
                counts["cited"][key].add(cite.package_path)
                counts["checked"][key] += 1
                problem = check_citation(cite, wheel)
                if problem:
                    problems.append(problem)
            for m in old_citations(text):
                shown = " ".join(m.group(0).split())
                problems.append(f"{text.where(m.start())}: older citation form {shown!r}: "
                                "write a link to the lines at the tag, or (`name`, `path:first-last`)")
    return problems, counts


# --- Citations and words per chapter ------------------------------------------

@dataclasses.dataclass
class ChapterStats:
    """What a chapter holds: its main text's words and its citations by where they stand."""

    source: str
    words: int = 0
    citations: dict[str, list[Citation]] = dataclasses.field(
        default_factory=lambda: {"main": [], "aside": [], "answer": [], "code": []})
    as_spans: int = 0  # citations in markdown written as code spans, not links

    @property
    def name(self) -> str:
        return Path(self.source).stem


def chapter_stats(path: Path, root: Path) -> ChapterStats:
    """Count one chapter (the rules are in the module's docstring)."""
    stats = None
    for text in file_texts(path, root):
        stats = stats or ChapterStats(text.source)
        if text.kind == "raw" or "remove-cell" in text.tags:
            continue
        found = myst.blocks(text.text) if text.markdown else []
        if text.markdown:
            stats.words += myst.count_words(myst.main_text(text.text, found))
        for cite in parse(text):
            where = myst.kind_at(found, cite.start) if text.markdown else "code"
            stats.citations[where].append(cite)
            stats.as_spans += text.markdown and not cite.link
    return stats or ChapterStats(path.relative_to(root).as_posix())


def chapters(root: Path) -> list[ChapterStats]:
    return [chapter_stats(p, root) for p in sorted(root.glob(CHAPTER_GLOB))]


def budget_problems(all_stats: list[ChapterStats]) -> list[str]:
    """A chapter over either budget, with the main-text citations listed."""
    problems = []
    for s in all_stats:
        if s.words > MAX_MAIN_WORDS:
            problems.append(f"{s.source}: {s.words:,} words of main text (at most {MAX_MAIN_WORDS:,})")
        main = s.citations["main"]
        if len(main) > MAX_MAIN_CITATIONS:
            problems.append(f"{s.source}: {len(main)} citations in the main text (at most "
                            f"{MAX_MAIN_CITATIONS}; the rest go into asides):")
            problems += [f"    {c.where()}: " + (f'"{c.name}"' if c.quoted else c.name or c.path).replace("\n", " ")
                         for c in main]
    return problems


def report_table(all_stats: list[ChapterStats]) -> list[str]:
    """The per-chapter table ``--report`` prints."""
    head = ("chapter", "words", "main", "asides", "answers", "code", "as spans")
    rows = [(s.name, f"{s.words:,}", *(str(len(s.citations[k])) for k in ("main", "aside", "answer", "code")),
             str(s.as_spans)) for s in all_stats]
    width = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [f"main text per chapter: at most {MAX_MAIN_WORDS:,} words and {MAX_MAIN_CITATIONS} citations "
             "(citations counted where they stand; 'as spans': in markdown, written as code spans, not links)"]
    for r in [head, *rows]:
        lines.append("  ".join(c.ljust(width[0]) if i == 0 else c.rjust(width[i]) for i, c in enumerate(r)))
    return lines


# --- Notebooks in the repository's layout -------------------------------------

def dump_notebook(nb: dict) -> str:
    """The repository's notebook layout (what nbformat.write writes)."""
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


# --- Command line -------------------------------------------------------------

def open_wheel(path: str | None, release: Release = VLLM) -> Wheel | str:
    """The wheel, or why there is none."""
    if path:
        found = Path(path)
        if not found.is_file():
            return f"no wheel at {found}"
    else:
        found = find_wheel(release)
        if found is None:
            return f"no {release.label} wheel in {cache_dir()} and pip could not download it"
    try:
        return Wheel(found, release.package)
    except zipfile.BadZipFile:
        return f"{found} is not a readable wheel: delete it and run again"


def _under_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


def run_check(root: Path, wheel_paths: dict[str, str | None]) -> int:
    """``--check``: every citation; 1 when there is a problem, or a wheel is missing under CI."""
    wheels, missing = {}, {}
    for release in RELEASES:
        found = open_wheel(wheel_paths.get(release.key), release)
        wheels[release.key], missing[release.key] = (None, found) if isinstance(found, str) else (found, None)
    if any(missing.values()) and _under_ci():
        for why in filter(None, missing.values()):
            print(f"citations: FAILED: {why} (CI=true: the check may not be skipped)", file=sys.stderr)
        return 1
    if all(missing.values()):
        print(f"citations: skipped: {'; '.join(missing.values())}", file=sys.stderr)
        return 0
    problems, counts = check(book_files(root), root, wheels)
    for problem in problems:
        print(problem)
    parts = []
    for release in RELEASES:
        n, files = counts[release.key], len(counts["cited"][release.key])
        if missing[release.key]:
            parts.append(f"{n} {release.project} citations not checked ({missing[release.key]})")
        else:
            parts.append(f"{n} {release.project} citations, {counts['checked'][release.key]} checked against "
                         f"{files} files of the {release.label} wheel")
    print(f"citations: {'; '.join(parts)}; in {len(counts['files'])} files; {counts['links']} links, "
          f"{counts['spans_in_markdown']} code spans in markdown; {len(counts['to_convert'])} SGLang citations "
          f"without lines to convert; {len(problems)} problems")
    for why in filter(None, missing.values()):
        print(f"citations: skipped part: {why}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.citations", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="check every citation in the book")
    parser.add_argument("--report", action="store_true",
                        help="print each chapter's main-text words and where its citations stand")
    parser.add_argument("--budget", action="store_true",
                        help=f"fail when a chapter's main text has over {MAX_MAIN_CITATIONS} citations "
                             f"or {MAX_MAIN_WORDS:,} words")
    parser.add_argument("--root", default=str(ROOT), help="the book's root (default: this repository)")
    parser.add_argument("--wheel", help="a vLLM wheel to read instead of the cached one")
    parser.add_argument("--sglang-wheel", help="an SGLang wheel to read instead of the cached one")
    args = parser.parse_args(argv)
    if not (args.check or args.report or args.budget):
        parser.error("one of --check, --report or --budget is required")
    root = Path(args.root).resolve()

    status = 0
    if args.check:
        status = run_check(root, {VLLM.key: args.wheel, SGLANG.key: args.sglang_wheel})
    if args.report or args.budget:
        stats = chapters(root)
        if args.budget:
            over = budget_problems(stats)
            for line in over:
                print(line)
            print(f"citations: budget: {sum(1 for p in over if not p.startswith(' '))} over in "
                  f"{len({p.split(':')[0] for p in over if not p.startswith(' ')})} of {len(stats)} chapters")
            status = status or (1 if over else 0)
        for line in report_table(stats):
            print(line)
    return status


if __name__ == "__main__":
    sys.exit(main())
