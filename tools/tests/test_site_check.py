"""The browser check of the built site, on tiny fake sites; and the views as an untrusted notebook shows them."""

from __future__ import annotations

import html.parser
import re
import shutil
from pathlib import Path

import pytest

from pagedkv import views
from tools.site_check import _event_problems, pages_of, run
from pagedkv.block_pool import BlockPool

REPO = Path(__file__).resolve().parents[2]
needs_chromium = pytest.mark.skipif(
    not any(shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")),
    reason="needs Chromium (apt-get install chromium; .ci/run installs it)")

PAGE = """<!doctype html><html><head><meta charset="utf-8">{head}</head><body>
<main><article class="bd-article" style="width:688px;padding:0;margin:0">{body}</article></main></body></html>"""


def write_site(root: Path, pages: dict[str, str], head: str = "") -> Path:
    for name, body in pages.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(PAGE.format(head=head, body=body))
    return root


def bare_fonts(tmp_path: Path) -> dict:
    """A fontconfig that sees DejaVu only: a browser on a machine with no emoji font."""
    conf = tmp_path / "fonts.conf"
    conf.write_text("<?xml version='1.0'?><!DOCTYPE fontconfig SYSTEM 'fonts.dtd'><fontconfig>"
                    "<dir>/usr/share/fonts/truetype/dejavu</dir>"
                    f"<cachedir>{tmp_path}/fc-cache</cachedir></fontconfig>")
    return {"FONTCONFIG_FILE": str(conf)}


def by_kind(result) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for kind, detail in result.problems:
        out.setdefault(kind, []).append(detail)
    return out


@needs_chromium
def test_a_broken_page_fails_with_the_page_and_the_reason(tmp_path):
    pool = BlockPool(12)
    pool.get_new_blocks(3)
    good_replay = views.replay_html([views.Frame("start", views.render_pool(pool)),
                                       views.Frame("next", views.render_pool(pool))])
    dead_replay = good_replay.replace("r.querySelector('.pkv-next').onclick", "r.querySelector('.pkv-none')")
    site = write_site(tmp_path / "site", {
        "good.html": "<p>fine</p><div class='cell'><div class='cell_output'><pre>short line</pre></div></div>"
                     + views.render_pool(pool) + views.render_block_table({"A": [1, 2, 3]}) + good_replay,
        "broken/page.html": (
            "<div class='cell'><div class='cell_output'><pre style='overflow:auto'>" + "x" * 200 + "</pre></div></div>"
            "<table><tr><td style='white-space:nowrap'>" + "wide " * 60 + "</td></tr></table>"
            "<img src='missing.png' alt='lost'>"
            "<img src='http://example.com/remote.png' alt='remote'>"
            "<p>\u274c no emoji font here</p>"
            "<div class='pagedkv-block-table'><table></table></div>"
            + dead_replay +
            "<script>console.error('logged on purpose'); undefinedFunction();</script>"),
    })
    shots = tmp_path / "shots"
    results = {r.page: r for r in run(site, shots, log=None, env=bare_fonts(tmp_path))}
    assert set(results) == {"good.html", "broken/page.html"}
    assert results["good.html"].ok, results["good.html"].problems
    assert results["good.html"].counts["pool"] == 1 and results["good.html"].counts["replay"] == 1

    broken = by_kind(results["broken/page.html"])
    assert set(broken) == {"too wide", "image", "request", "console", "script error", "empty", "replay", "marks"}
    assert any("pre scrolls (content" in d and "cell 1 output" in d for d in broken["too wide"])
    assert any(d.startswith("page: table is") and "sticks out" in d for d in broken["too wide"])
    assert any("missing.png" in d for d in broken["image"])
    assert any("off the machine: http://example.com/remote.png" in d for d in broken["request"])
    assert any("HTTP 404" in d and "missing.png" in d for d in broken["request"])
    assert any("undefinedFunction is not defined" in d for d in broken["script error"])
    assert any("logged on purpose" in d for d in broken["console"])
    assert broken["empty"] == ["page: a block table with no cells"]
    assert "did not advance" in broken["replay"][0]
    assert "\u274c renders without colour" in broken["marks"][0]  # DejaVu has no U+274C: a blank box
    for page in ("good", "broken__page"):
        assert (shots / f"{page}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_chromium
def test_two_browsers_share_the_pages_and_report_as_one(tmp_path):
    pages = {f"p{i}.html": f"<p>page {i}</p>" for i in range(5)}
    pages["p3.html"] = "<img src='missing.png' alt='lost'>"
    site = write_site(tmp_path / "site", pages)
    one = run(site, None, log=None, env=bare_fonts(tmp_path))
    two = run(site, None, log=None, env=bare_fonts(tmp_path), jobs=2)
    assert [r.page for r in two] == [r.page for r in one] == sorted(pages)  # page order, whoever checked it
    assert [[k for k, _ in r.problems] for r in two] == [[k for k, _ in r.problems] for r in one]
    assert [r.ok for r in two] == [p != "p3.html" for p in sorted(pages)]


@needs_chromium
def test_the_sites_stylesheet_wraps_outputs_scales_views_and_colours_the_marks(tmp_path):
    """The book's _static/custom.css on a fake page: the fixes hold in a browser with no emoji font."""
    site = tmp_path / "site"
    shutil.copytree(REPO / "_static", site / "_static")
    pool = BlockPool(40)
    for _ in range(5):
        pool.get_new_blocks(3)
    wide_pool = views.render_pool(pool, columns=20)  # 1,176 px drawn: must scale into the column
    rows = {f"req-{i}": list(range(100 + i * 40, 100 + i * 40 + 40)) for i in range(3)}
    body = ("<div class='bd-content'>"
            "<div class='cell'><div class='cell_output'><div class='output stream highlight-myst-ansi'>"
            "<div class='highlight'><pre>" + "\u2705 a checker line that runs on " * 8 + "\n\u274c hint</pre>"
            "</div></div>" + wide_pool + views.render_block_table(rows, title="wide") + "</div></div>"
            "<table><tr><td><code class='literal'><span class='pre'>" + "a_long_identifier." * 12
            + "</span></code></td></tr></table></div>")
    # The theme's font variables, as pydata-sphinx-theme declares and uses them.
    theme = ("<style>html{--pst-font-family-base-system:sans-serif;--pst-font-family-monospace-system:monospace;"
             "--pst-font-family-base:var(--pst-font-family-base-system);"
             "--pst-font-family-monospace:var(--pst-font-family-monospace-system)}"
             "body{font-family:var(--pst-font-family-base)}pre,code{font-family:var(--pst-font-family-monospace)}"
             "pre{overflow:auto;padding:1rem}</style>")
    write_site(site, {"page.html": body}, head=theme + "<link rel='stylesheet' href='_static/custom.css'>")
    without = write_site(tmp_path / "plain", {"page.html": body}, head=theme)
    [styled] = run(site, None, log=None, env=bare_fonts(tmp_path))
    assert styled.ok, styled.problems
    assert styled.counts["marks"] == 2 and styled.counts["pool"] == 1 and styled.counts["table"] == 1
    [plain] = run(without, None, log=None, env=bare_fonts(tmp_path))
    kinds = by_kind(plain)
    assert set(kinds) == {"too wide", "marks"}  # what the stylesheet fixes
    assert len(kinds["too wide"]) == 2  # the output line and the table; the pool scales by itself



@needs_chromium
def test_on_a_phone_literals_break_and_pool_pictures_scroll_in_their_box_at_a_legible_size(tmp_path):
    """At 390 px, without the book's stylesheet a long inline literal widens the page and a
    pool picture shrinks to unreadable labels; with it, both fit and the labels stay at 9 px."""
    pool = BlockPool(12)
    pool.get_new_blocks(3)
    body = ("<div class='bd-content'><p>see <code class='literal'><span class='pre'>"
            "v1/attention/ops/triton_unified_attention.py:488-498</span></code> for it</p>"
            "<div class='cell'><div class='cell_output'>" + views.render_pool(pool) + "</div></div></div>")
    phone_page = PAGE.replace("width:688px", "width:100%").replace(
        "<head>", "<head><meta name='viewport' content='width=device-width, initial-scale=1'>")
    for name, head in (("styled", "<link rel='stylesheet' href='_static/custom.css'>"), ("plain", "")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "page.html").write_text(phone_page.format(head=head, body=body))
    shutil.copytree(REPO / "_static", tmp_path / "styled" / "_static")
    [styled] = run(tmp_path / "styled", None, log=None, modes=("phone",))
    assert styled.ok, styled.problems
    [plain] = run(tmp_path / "plain", None, log=None, modes=("phone",))
    kinds = by_kind(plain)
    assert set(kinds) == {"too wide", "illegible"}, plain.problems
    assert kinds["too wide"][0].startswith("page: laid out")
    assert "labels show at" in kinds["illegible"][0]


@needs_chromium
def test_in_dark_mode_pictures_are_inverted_and_views_keep_their_contrast(tmp_path):
    """The theme's dark mode on a fake page: without the book's stylesheet a white figure and
    the light output cards are light boxes; with it, the figure is drawn dark (its pixels,
    through the CSS filter) and a block table's cells keep dark text on their colours."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot([0, 1], [0, 1])
    switch = ("<script>document.documentElement.dataset.theme = "
              "matchMedia('(prefers-color-scheme: dark)').matches ? 'dark' : 'light'</script>")
    # The theme's two dark-mode rules that make the light cards.
    theme = ("<style>html[data-theme=dark] body{background:#14181e;color:#ced6dd}"
             "html[data-theme=dark] .bd-content div.cell_output .text_html:not(:has(table.dataframe)),"
             "html[data-theme=dark] .bd-content div.cell_output img{background-color:#ced6dd;color:#222832}"
             "</style>")
    body = ("<div class='bd-content'><div class='cell'><div class='cell_output'>"
            "<img src='figure.png' width='600'></div></div><div class='cell'><div class='cell_output'>"
            "<div class='output text_html'>" + views.render_block_table({"A": [1, 2], "B": [3]})
            + "</div></div></div></div>")
    for name, link in (("styled", "<link rel='stylesheet' href='_static/custom.css'>"), ("plain", "")):
        write_site(tmp_path / name, {"page.html": body}, head=switch + theme + link)
        fig.savefig(tmp_path / name / "figure.png", facecolor="white")
    plt.close(fig)
    shutil.copytree(REPO / "_static", tmp_path / "styled" / "_static")
    [styled] = run(tmp_path / "styled", None, log=None, modes=("dark",))
    assert styled.ok, styled.problems
    [plain] = run(tmp_path / "plain", None, log=None, modes=("dark",))
    details = by_kind(plain)["dark"]
    assert any("img is a light box" in d for d in details), details
    assert any("div.output.text_html is a light box" in d for d in details), details
    # Only the theme's card made the figure light: on a transparent card, its white pixels still show.
    (tmp_path / "plain" / "page.html").write_text((tmp_path / "plain" / "page.html").read_text().replace(
        "</style>", "html[data-theme=dark] .bd-content div.cell_output img{background:none}</style>", 1))
    [bare] = run(tmp_path / "plain", None, log=None, modes=("dark",))
    assert any("img is drawn light" in d for d in by_kind(bare)["dark"]), bare.problems


@needs_chromium
def test_a_replay_must_step_from_the_keyboard(tmp_path):
    """The player's buttons and slider step it from the keyboard; one whose next button is a
    plain span (clickable, but out of the Tab order) fails."""
    pool = BlockPool(12)
    frames = [views.Frame("start", views.render_pool(pool))]
    pool.get_new_blocks(2)
    frames.append(views.Frame("two blocks", views.render_pool(pool)))
    good = views.replay_html(frames)
    spans = good.replace("<button class='pkv-next'", "<span class='pkv-next'", 1)
    assert spans != good
    site = write_site(tmp_path / "site", {"good.html": good, "spans.html": spans})
    results = {r.page: r for r in run(site, None, log=None)}
    assert results["good.html"].ok, results["good.html"].problems
    assert by_kind(results["spans.html"]) == {"replay": ["replay 1: its .pkv-next cannot be reached with Tab"]}


@needs_chromium
def test_axe_core_fails_a_page_with_serious_violations_only(tmp_path):
    """axe-core (npm, package-lock.json) inside the check: grey-on-white text and an image
    without alt text fail; a page with only a moderate finding passes, and is counted."""
    import os

    from tools.site_check import find_axe

    if find_axe() is None:
        if os.environ.get("CI") == "true":
            raise RuntimeError("CI must run axe-core: `make node_modules` installs it")
        pytest.skip("axe-core is not installed (make node_modules)")
    site = write_site(tmp_path / "site", {
        "bad.html": "<h1>t</h1><p style='color:#bbb'>faint text</p><img src='data:image/gif;base64,"
                    "R0lGODlhAQABAAAAACw=' width='20' height='20'>",
        "fine.html": "<h1>t</h1><h3>a heading that skips a level (moderate)</h3><p>plain text</p>"},
        head="<title>t</title>")
    for page in site.glob("*.html"):  # a language, as every page of the book has
        page.write_text(page.read_text().replace("<html>", "<html lang='en'>"))
    results = {r.page: r for r in run(site, None, log=None, axe=True)}
    bad = by_kind(results["bad.html"])["axe"]
    assert any(d.startswith("serious color-contrast") for d in bad), bad
    assert any(d.startswith("critical image-alt") for d in bad), bad
    assert results["fine.html"].ok, results["fine.html"].problems
    assert results["fine.html"].counts["axe_moderate"] >= 1

def test_event_problems_report_console_errors_bad_requests_and_ignore_the_favicon_probe():
    events = [
        {"method": "Network.requestWillBeSent", "params": {"requestId": "1", "request": {"url": "https://cdn.x/y.js"}}},
        {"method": "Network.requestWillBeSent", "params": {"requestId": "2", "request": {"url": "data:image/png,xx"}}},
        {"method": "Network.requestWillBeSent", "params": {"requestId": "3",
                                                           "request": {"url": "http://127.0.0.1:9/favicon.ico"}}},
        {"method": "Network.responseReceived", "params": {"requestId": "3", "response": {
            "url": "http://127.0.0.1:9/favicon.ico", "status": 404}}},
        {"method": "Log.entryAdded", "params": {"entry": {"level": "error", "text": "Failed to load resource",
                                                          "url": "http://127.0.0.1:9/favicon.ico"}}},
        {"method": "Runtime.consoleAPICalled", "params": {"type": "log", "args": [{"value": "fine"}]}},
        {"method": "Runtime.consoleAPICalled", "params": {"type": "error", "args": [{"value": "bad"}]}},
    ]
    assert _event_problems(events) == [("request", "off the machine: https://cdn.x/y.js"), ("console", "bad")]


def test_pages_of_a_site_skip_sphinx_templates(tmp_path):
    write_site(tmp_path, {"a.html": "", "b/c.html": "", "_static/webpack-macros.html": ""})
    assert pages_of(tmp_path) == ["a.html", "b/c.html"]


# ------------------------------------------------ untrusted notebooks

# JupyterLab 4.6.6's HTML sanitizer (@jupyterlab/apputils Sanitizer, on
# sanitize-html), reduced to what matters here: the tags it keeps (any other
# tag is dropped and its text kept, except <script> and <style>, dropped with
# their content), and that no <svg> survives. An untrusted notebook's
# text/html output is shown through it; image/svg+xml is not shown at all
# (its renderer is not "safe").
JUPYTERLAB_TAGS = set(
    "a abbr acronym address area article aside audio b bdi bdo big blockquote br button canvas caption "
    "center cite code col colgroup colspan command data datalist dd del details dfn dir div dl dt em "
    "fieldset figcaption figure font footer form h1 h2 h3 h4 h5 h6 header hgroup hr i img input ins kbd "
    "label legend li map mark menu meter nav nobr ol optgroup option output p pre progress q rowspan s "
    "samp section select small source span strike strong sub summary sup table tbody td textarea tfoot "
    "th thead time tr track tt u ul var video wbr".split())
DROP_WITH_CONTENT = {"script", "style"}


class Sanitized(html.parser.HTMLParser):
    """What JupyterLab keeps of untrusted HTML, and what a reader then sees (text outside font-size:0)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out, self.stack, self.drop, self.visible = [], [], 0, []

    def handle_starttag(self, tag, attrs):
        if tag in DROP_WITH_CONTENT:
            self.drop += 1
        if self.drop or tag not in JUPYTERLAB_TAGS:
            return
        self.out.append(self.get_starttag_text())
        if tag in ("br", "img", "input", "wbr"):
            return
        attrs = dict(attrs)
        style = (attrs.get("style") or "").replace(" ", "")
        size = re.search(r"(?:^|;)font-size:([\d.]+)", style)
        parent = self.stack[-1] if self.stack else "shown"
        if parent == "hidden" or "hidden" in attrs or re.search(r"(?:^|;)display:none", style):
            state = "hidden"
        elif size:  # font-size:0 hides text; a child that sets its own size shows it again
            state = "small" if float(size.group(1)) == 0 else "shown"
        else:
            state = parent
        self.stack.append(state)

    def handle_endtag(self, tag):
        if tag in DROP_WITH_CONTENT:
            self.drop -= 1
            return
        if self.drop or tag not in JUPYTERLAB_TAGS:
            return
        self.out.append(f"</{tag}>")
        if self.stack and tag not in ("br", "img", "input", "wbr"):
            self.stack.pop()

    def handle_data(self, data):
        if self.drop:
            return
        self.out.append(data)
        if data.strip() and (not self.stack or self.stack[-1] == "shown"):
            self.visible.append(data.strip())

    @classmethod
    def of(cls, text: str) -> "Sanitized":
        s = cls()
        s.feed(text)
        s.close()
        return s


def _scenario_pool():
    pool = BlockPool(12)
    owners = views.BlockOwners(pool)
    with owners.acting_for("A"):
        a = pool.get_new_blocks(3)
    with owners.acting_for("B"):
        pool.get_new_blocks(2)
    with owners.acting_for("A"):
        pool.free_blocks(reversed(a))
    return pool, owners


def test_pool_picture_reads_in_an_untrusted_notebook():
    pool, owners = _scenario_pool()
    page = views.render_pool(pool, owners, title="demo", highlight=[4])
    kept = Sanitized.of(page)
    assert "<svg" not in "".join(kept.out)  # what JupyterLab strips
    shown = " ".join(kept.visible)
    # What a reader sees is the plain-HTML twin: heading, one cell per block, the queue, a key.
    assert shown.startswith("demo \u2014 9 of 11 blocks free")
    for block in range(12):
        assert re.search(rf"(^| ){block}( |$)", shown)
    assert "B ref 1" in shown and "free queue from its head: 3 2 1 6 7" in shown
    # ... and none of the SVG's own labels and tooltips spill out as a run of text.
    assert "free queue, head" not in shown and "block 4: in use" not in shown
    assert "font-size:0" in page.split(">", 1)[0]
    # Every cell of the twin is a styled span with its tooltip; the touched block is outlined.
    twin = "".join(kept.out)
    assert twin.count("<span title='block ") == 12
    assert re.search(r"<span title='block 4: in use by B[^']*' style='[^']*box-shadow:0 0 0 2px "
                     + views.COLORS["highlight"], twin)


def test_replay_in_an_untrusted_notebook_shows_every_frame_stacked_and_no_dead_controls():
    pool, owners = _scenario_pool()
    frames = [views.Frame(f"caption {i}", views.render_pool(pool, owners, title=f"frame {i}")) for i in range(4)]
    page = views.replay_html(frames, title="trace")
    kept = Sanitized.of(page)
    shown = " ".join(kept.visible)
    assert "<script" not in "".join(kept.out) and "<style" not in "".join(kept.out)
    positions = [shown.index(f"step {i} : caption {i}") if f"step {i} : caption {i}" in shown
                 else shown.index(f"step {i}: caption {i}") for i in range(4)]
    assert positions == sorted(positions)  # all four, in order
    assert all(f"frame {i} \u2014" in shown for i in range(4))
    assert "prev" not in shown and "/ 4" not in shown  # the controls stay hidden without their script
    # With the script and the style in place (the site, a trusted notebook) one frame shows at a time.
    assert page.count("display:block") == 1 and "<style>#pkv-replay-" in page and ".hidden=false" in page


def test_block_table_is_plain_html_and_fits_the_column_in_bands():
    rows = {f"req-{i}": list(range(1000 + 40 * i, 1040 + 40 * i)) for i in range(3)}
    page = views.render_block_table(rows, title="t", max_columns=32)
    assert "<svg" not in page and "<script" not in page
    assert set(re.findall(r"<(\w+)", page)) <= JUPYTERLAB_TAGS  # JupyterLab keeps all of it
    bands = re.findall(r"<table.*?</table>", page)
    heads = [re.findall(r">(\d+)</th>", b) for b in bands]
    assert [int(h) for band in heads for h in band] == list(range(32))  # every column once, in order
    assert len(bands) >= 2 and all(len(h) <= 16 for h in heads)
    assert page.count("\u2026 +8") == 3  # the cut-off count, in the last band only
    empty = views.render_block_table({})
    assert "no requests hold blocks" in empty and "<td" in empty


@needs_chromium
def test_explorables_are_moved_and_must_read_as_the_library(tmp_path):
    """A faithful budget calculator passes; one whose module floors nothing, or whose script never
    runs, fails with the setting and the first difference."""
    from pagedkv.views import budget_explorer

    good = budget_explorer(weight_gib=14.96).html()
    off_by_one = good.replace("var blocks = X.floorDiv(pool, perBlock);", "var blocks = Math.ceil(pool / perBlock);")
    assert off_by_one != good
    dead = good.replace("pkvExplore.mount(", "void(")
    site = write_site(tmp_path / "site", {"good.html": good, "off.html": off_by_one, "dead.html": dead})
    results = {r.page: r for r in run(site, None, log=None)}
    assert results["good.html"].ok, results["good.html"].problems
    assert results["good.html"].counts["explorable"] == 1
    off = by_kind(results["off.html"])
    assert set(off) == {"explorable"}
    assert all(d.startswith("budget 1 at {'gpu': ") and "where the library gives" in d for d in off["explorable"])
    assert by_kind(results["dead.html"])["explorable"][0] == "page: the budget explorable's script did not run"


@needs_chromium
def test_answers_and_hints_must_start_collapsed_and_open_with_the_keyboard(tmp_path):
    details = "<details class='admonition hide'><summary>Show answer</summary><pre>42</pre></details>"
    site = write_site(tmp_path / "site", {
        "closed.html": f"<div class='bd-article'>{details}{details.replace('answer', 'hint')}</div>",
        "open.html": "<div class='bd-article'>" + details.replace("<details ", "<details open ") + "</div>",
        "bare.html": "<div class='bd-article'><details><pre>no summary</pre></details></div>",
    })
    results = {r.page: r for r in run(site, None, log=None, env=bare_fonts(tmp_path))}
    assert results["closed.html"].ok, results["closed.html"].problems
    assert results["closed.html"].counts["collapsed"] == 2
    assert by_kind(results["open.html"])["collapsed"] == ["starts open: 'Show answer'"]
    assert "without a summary" in by_kind(results["bare.html"])["collapsed"][0]


@needs_chromium
def test_mathjax_screen_reader_copy_is_not_a_box_but_a_clipped_formula_is(tmp_path):
    """MathJax's assistive MathML is clipped to nothing by design; a visible box that clips is reported."""
    wide = "x<sub>j</sub> + " * 80
    hidden = ("<mjx-container><mjx-assistive-mml style='position:absolute;display:block;overflow:hidden;"
              f"height:0;width:300px;white-space:nowrap'>{wide}</mjx-assistive-mml></mjx-container>")
    clipped = f"<div style='overflow:hidden;width:300px;white-space:nowrap'>{wide}</div>"
    site = write_site(tmp_path / "site", {"math.html": hidden, "clip.html": clipped})
    results = {Path(r.page).name: r for r in run(site, None, log=None)}
    assert results["math.html"].ok, results["math.html"].problems
    assert any("div scrolls (content" in d for d in by_kind(results["clip.html"])["too wide"])
