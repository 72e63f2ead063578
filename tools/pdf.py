"""The whole book as one PDF, printed by headless Chromium from the built site, offline.

    python -m tools.pdf [_build/html] [--out _build/pdf/book.pdf]

1. One page: every page of ``_toc.yml``, in its order, as the site built it
   (``_build/html``): each page's article, its scripts removed, each page
   starting on a new sheet, under the site's own stylesheets. Without their
   scripts, views print as the static site shows them with no script: an
   explorable shows the figures drawn for the settings named under it, and a
   trace replay shows every frame, stacked in order (a strip of frames). Every
   collapsed answer, hint and hidden cell is opened: paper cannot be clicked.
   Math is typeset by the MathJax the site ships before the page prints.
   (Jupyter Book's own single-page builder, ``singlehtml``, stops on
   myst-nb's hidden cells; its ``pdfhtml`` downloads a browser.)
2. Chromium (``tools.site_check.Browser``: no host but 127.0.0.1 resolves)
   prints it to A4 (CDP ``Page.printToPDF``).
3. The check: ``pdftotext`` (Debian's poppler-utils) reads the PDF back, and
   every chapter's title (the first heading of each ``chapters/*.ipynb``)
   must be in it; ``pdfinfo`` gives its pages.
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tools.site_check import Browser, serve

REPO = Path(__file__).resolve().parents[1]

# Print rules for the book page only (the site's own stylesheets come first).
PRINT_CSS = """<style>
.pkv-print-page{break-before:page}
.pkv-print-page:first-child{break-before:auto}
.pagedkv-replay .pkv-frame{display:block!important;break-inside:avoid;margin-bottom:6px}
.pagedkv-replay .pkv-controls,.pagedkv-explorable .pkv-controls{display:none!important}
.headerlink,.copybtn,.toggle-button{display:none!important}
.bd-content div.cell_output img,.bd-content figure img{break-inside:avoid}
body{background:#fff}
</style>"""


def toc_files(toc: Path = REPO / "_toc.yml") -> list[str]:
    """The book's pages in reading order: the root, then every part's chapters."""
    data = yaml.safe_load(toc.read_text(encoding="utf-8"))
    files = [data["root"]]
    for part in data.get("parts", []):
        files += [c["file"] for c in part.get("chapters", [])]
    return files


def chapter_titles(root: Path = REPO) -> dict[str, str]:
    """Each chapter notebook's title: the text of its first ``# `` heading."""
    titles = {}
    for path in sorted((root / "chapters").glob("*.ipynb")):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] != "markdown":
                continue
            m = re.search(r"^# (.+)$", "".join(cell["source"]), re.M)
            if m:
                titles[path.stem] = m.group(1).strip()
                break
    return titles


MATHJAX = "_static/mathjax/tex-svg-full.js"  # copied into the site by html_extra_path
_SCRIPT = re.compile(r"<script\b.*?</script>", re.S | re.I)
_STYLESHEET = re.compile(r"<link\b[^>]*rel=\"stylesheet\"[^>]*>")


def article(page_html: str, name: str) -> str:
    """A built page's article, without its scripts."""
    start, end = page_html.find('<article class="bd-article">'), page_html.rfind("</article>")
    if start < 0 or end < start:
        raise ValueError(f"{name}: no <article class=\"bd-article\"> in the built page")
    return _SCRIPT.sub("", page_html[start:end + len("</article>")])


def book_page(html_dir: Path, files: list[str]) -> str:
    """The whole book as one HTML page, for a file one level below ``html_dir``'s parent
    (``_build/pdf/``): every page's links to ``../_static`` and ``../_images`` are rewritten."""
    pages, head = [], ""
    for name in files:
        path = html_dir / f"{name}.html"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: build the site first (make book)")
        text = path.read_text(encoding="utf-8")
        if len(Path(name).parts) != 2:
            raise ValueError(f"{name}: the book page expects every page one folder deep")
        if not head:
            head = "".join(_STYLESHEET.findall(text))
        pages.append(f"<div class='pkv-print-page' data-page='{name}'>{article(text, name)}</div>")
    body = "".join(pages)
    # The pages' math is typeset by the MathJax the site ships (its scripts were
    # removed with the rest): the same options as the site's pages.
    math = ""
    if (html_dir / MATHJAX).is_file():
        math = ("<script>window.MathJax = {options: {processHtmlClass:"
                " 'tex2jax_process|mathjax_process|math|output_area'}}</script>"
                f"<script src='../html/{MATHJAX}'></script>")
    fix = lambda s: s.replace('"../_static/', '"../html/_static/').replace('"../_images/', '"../html/_images/')  # noqa: E731
    return (f"<!doctype html><html lang='en' data-theme='light'><head><meta charset='utf-8'>"
            f"<title>PagedAttention, hands-on</title>{fix(head)}{PRINT_CSS}{math}</head><body><div class='bd-content'>"
            f"<div class='bd-article-container'>{fix(body)}</div></div></body></html>")


_PREPARE_JS = r"""
(async () => {
  document.querySelectorAll('details').forEach(d => { d.open = true; });
  await document.fonts.ready;
  if (window.MathJax && MathJax.startup) await MathJax.startup.promise;
  await Promise.race([Promise.all(Array.from(document.images).map(i => i.complete ? null :
    new Promise(r => { i.onload = i.onerror = r; }))), new Promise(r => setTimeout(r, 20000))]);
  return {images: document.images.length, broken: Array.from(document.images).filter(i => !i.naturalWidth).length,
          replays: document.querySelectorAll('.pagedkv-replay').length,
          frames: document.querySelectorAll('.pagedkv-replay .pkv-frame').length};
})()
"""


def print_pdf(build: Path, page: Path, out: Path) -> dict:
    """Print ``page`` (a file under ``build``, served from there) to ``out`` with Chromium."""
    server = serve(build)
    browser = Browser(timeout=120)
    try:
        browser.send("Page.enable")
        browser.send("Page.navigate", {"url": server.base + str(page.relative_to(build))})
        if browser.wait_for("Page.loadEventFired", timeout=120) is None:
            raise RuntimeError("the book page did not finish loading")
        stats = browser.evaluate(_PREPARE_JS, timeout=120)
        if stats["broken"]:
            raise RuntimeError(f"{stats['broken']} of {stats['images']} pictures did not load")
        result = browser.send("Page.printToPDF", {
            "paperWidth": 8.27, "paperHeight": 11.69, "marginTop": 0.5, "marginBottom": 0.5,
            "marginLeft": 0.5, "marginRight": 0.5, "printBackground": True, "transferMode": "ReturnAsStream",
        }, timeout=600)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("wb") as f:
            while True:
                chunk = browser.send("IO.read", {"handle": result["stream"], "size": 1 << 20})
                f.write(base64.b64decode(chunk["data"]) if chunk.get("base64Encoded") else chunk["data"].encode())
                if chunk.get("eof"):
                    break
        browser.send("IO.close", {"handle": result["stream"]})
        return stats
    finally:
        browser.close()
        server.close()


def pdf_text(pdf: Path) -> str:
    """The PDF's text (``pdftotext``), whitespace runs made single spaces."""
    if shutil.which("pdftotext") is None:
        raise SystemExit("pdftotext is missing: apt-get install poppler-utils (.ci/run installs it)")
    text = subprocess.run(["pdftotext", "-enc", "UTF-8", str(pdf), "-"], capture_output=True, text=True,
                          check=True).stdout
    return re.sub(r"\s+", " ", text)


def pdf_pages(pdf: Path) -> int:
    info = subprocess.run(["pdfinfo", str(pdf)], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"^Pages:\s+(\d+)", info, re.M).group(1))


def missing_titles(text: str, titles: dict[str, str]) -> list[str]:
    """The titles not found in ``text`` (whitespace-normalised, as ``pdf_text`` gives it)."""
    return [f"{stem}: {title!r}" for stem, title in titles.items()
            if re.sub(r"\s+", " ", title) not in text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.pdf", description=__doc__.splitlines()[0])
    parser.add_argument("html_dir", nargs="?", default="_build/html")
    parser.add_argument("--out", default="_build/pdf/book.pdf")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    html_dir, out = Path(args.html_dir).resolve(), Path(args.out).resolve()
    page = out.parent / "book.html"
    if page.parent.parent != html_dir.parent:
        raise SystemExit(f"--out must sit in a folder beside {html_dir} (e.g. _build/pdf/book.pdf)")
    files = toc_files()
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(book_page(html_dir, files), encoding="utf-8")
    stats = print_pdf(html_dir.parent, page, out)
    titles = chapter_titles()
    missing = missing_titles(pdf_text(out), titles)
    print(f"{out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out.name}: "
          f"{pdf_pages(out)} pages, {out.stat().st_size / 2**20:.1f} MiB, {len(files)} site pages, "
          f"{stats['images']} pictures, {stats['replays']} replays printed as {stats['frames']} frames, "
          f"in {time.monotonic() - t0:.0f} s; {len(titles) - len(missing)} of {len(titles)} chapter titles found")
    if missing:
        print("chapter titles missing from the PDF's text: " + "; ".join(missing), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
