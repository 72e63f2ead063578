"""The printable book (tools/pdf.py): its one page, and a tiny site printed and read back."""

from __future__ import annotations

import shutil

import pytest

from pagedkv import views
from pagedkv.block_pool import BlockPool
from tools import pdf

PAGE = ("<html><head><link rel=\"stylesheet\" href=\"../_static/site.css\" /></head><body><nav>menu</nav>"
        "<article class=\"bd-article\">{body}</article><script>alert(1)</script></body></html>")


def test_the_toc_and_the_chapter_titles_come_from_the_book():
    files = pdf.toc_files()
    assert files[0] == "book/intro" and files.index("chapters/01_memory_budget") < files.index(
        "chapters/08_serving_engine") < files.index("exercises/01_memory_budget")
    titles = pdf.chapter_titles()
    assert len(titles) == len(list((pdf.REPO / "chapters").glob("[0-9][0-9]_*.ipynb")))
    assert titles["03_block_pool"] == "The block pool"
    assert titles["00_one_engine_step"] == "The whole step, first"
    assert titles["09_kv_cache_groups"] == "One pool for many kinds of layers"


def test_a_missing_title_is_named():
    titles = {"01": "The memory budget", "02": "Fragmentation: three kinds of waste"}
    assert pdf.missing_titles("1 The memory budget 2 Fragmentation: three kinds of waste", titles) == []
    assert pdf.missing_titles("The memory budget", titles) == ["02: 'Fragmentation: three kinds of waste'"]


def test_the_book_page_keeps_articles_drops_scripts_and_points_at_the_site(tmp_path):
    html = tmp_path / "html"
    pool = BlockPool(8)
    replay = views.replay_html([views.Frame("a", views.render_pool(pool)), views.Frame("b", views.render_pool(pool))])
    for name, body in {"book/intro": "<h1>Intro</h1><img src=\"../_images/x.png\">",
                       "chapters/01_x": "<h1>One</h1>" + replay}.items():
        (html / name).parent.mkdir(parents=True, exist_ok=True)
        (html / f"{name}.html").write_text(PAGE.format(body=body))
    page = pdf.book_page(html, ["book/intro", "chapters/01_x"])
    assert "<script" not in page and "menu" not in page and "alert" not in page
    assert page.count("class='pkv-print-page'") == 2 and page.index("Intro") < page.index("One")
    assert '"../html/_images/x.png"' in page and '"../html/_static/site.css"' in page
    with pytest.raises(FileNotFoundError, match="build the site first"):
        pdf.book_page(html, ["book/missing"])


@pytest.mark.skipif(not (shutil.which("chromium") and shutil.which("pdftotext")),
                    reason="needs Chromium and pdftotext (apt-get install chromium poppler-utils)")
def test_a_small_book_prints_with_every_replay_frame_and_reads_back(tmp_path):
    html = tmp_path / "_build" / "html"
    pool = BlockPool(8)
    frames = [views.Frame("first frame", views.render_pool(pool))]
    pool.get_new_blocks(3)
    frames.append(views.Frame("second frame", views.render_pool(pool)))
    for name, body in {"book/intro": "<h1>Cover</h1>",
                       "chapters/01_x": "<h1>Chapter one</h1>" + views.replay_html(frames)}.items():
        (html / name).parent.mkdir(parents=True, exist_ok=True)
        (html / f"{name}.html").write_text(PAGE.format(body=body))
    page = tmp_path / "_build" / "pdf" / "book.html"
    page.parent.mkdir(parents=True)
    page.write_text(pdf.book_page(html, ["book/intro", "chapters/01_x"]))
    out = page.with_suffix(".pdf")
    stats = pdf.print_pdf(tmp_path / "_build", page, out)
    assert stats["replays"] == 1 and stats["frames"] == 2
    text = pdf.pdf_text(out)
    assert pdf.pdf_pages(out) == 2  # each site page starts a sheet
    # both frames are printed (a strip), not only the first one shown on screen
    assert "first frame" in text and "second frame" in text
    assert pdf.missing_titles(text, {"01_x": "Chapter one", "02_y": "Chapter two"}) == ["02_y: 'Chapter two'"]
