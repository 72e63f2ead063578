"""Check the built site in a real browser: every page, as readers see it (1280x900, a phone, dark mode).

    python -m tools.site_check [_build/html] [--screenshots DIR] [--only PAGE...] [--modes MODE...] [--no-axe]

Serves the built site on 127.0.0.1 (``http.server`` in a thread), starts
headless Chromium (Debian's ``chromium``, or ``$CHROMIUM``) with a 1280x900
window and drives it over the Chrome DevTools Protocol (a small client on
``websocket-client``). Each page is loaded, every ``<details>`` is opened (so
hidden solutions and outputs are measured too), a screenshot of the whole page
goes to ``_build/screenshots/<page>.png``, and the page fails for:

* **console**: a ``console.error``/``console.assert`` message, or a browser log
  entry of level error (a blocked or failed resource, a CSP violation);
* **script error**: an uncaught exception or unhandled rejection;
* **request**: a request that failed (network error or HTTP status >= 400), or
  any request to a host other than 127.0.0.1 (``data:`` and ``blob:`` URLs stay
  on the machine). The browser also maps every other host name to nowhere
  (``--host-resolver-rules``), so nothing can leave the machine even by mistake.
  The browser's own probe for ``/favicon.ico`` at the server's root is not
  the page's request and is ignored (the book has no favicon);
* **image**: an ``<img>`` that did not load (``naturalWidth`` 0);
* **empty**: a block view (``.pagedkv-pool``, ``.pagedkv-block-table``,
  ``.pagedkv-replay``) or a figure (an ``<img>`` in a cell output or a
  ``<figure>``) drawn with no area, or a pool view with no picture, a block
  table with no cells, a replay with no frames;
* **too wide**: a box wider than its room, measured inside the page's article
  column (``article.bd-article``; 688 px wide at this window size):

  - a *scroll box*: any element whose computed ``overflow-x`` is not
    ``visible`` (so it clips or scrolls: ``div.highlight pre``, output areas,
    the theme's table wrappers, ``pre`` in tracebacks...) with
    ``scrollWidth > clientWidth + 1``: its content needs a horizontal
    scrollbar, or is cut off;
  - a *sticking-out box*: a ``pre``, ``table``, ``img``, ``svg``, ``figure``,
    ``.cell_output`` or block view whose border box extends more than 1 px
    past the column's content box (and which no scroll box above it already
    accounts for).

  One box is reported once, at its outermost offending element;
* **replay**: a trace replay whose *next* button, clicked with the mouse (CDP
  ``Input.dispatchMouseEvent`` at its centre), does not change the frame shown
  and the step counter; or that the keyboard cannot step: Tab must reach its
  *next* button and Enter step it, and Tab its slider and the right arrow;
* **axe**: a serious or critical violation of axe-core's rules (WCAG 2 A and
  AA: contrast, names, roles...) on the page with every collapsed box open;
* **marks**: a checker mark (the ✅ and ❌ that ``pagedkv.checks`` prints) that
  renders with zero width or without colour (a blank box or a missing glyph):
  the mark is drawn onto a canvas in the element's own font stack and must
  produce saturated pixels.

* **explorable**: an explorable (``.pagedkv-explorable``) whose script did not
  run, or whose output, after its controls are moved to seeded settings (input
  events, then an arrow key on its slider), does not read as the library's
  figures for those settings (``pagedkv.views.explorables.KINDS``);
* in the **phone** modes (390x844): a page laid out wider than the phone or
  scrolling sideways; code, tables and pool pictures may scroll inside their
  own box there;
* **illegible** (phone modes): a view's SVG picture (pool, replay) scaled
  down so far that its smallest label shows under 9 px;
* in the **dark** modes (the theme's dark mode, via ``prefers-color-scheme``):
  a light box in the column, a picture (``<img>``, a pool picture) drawn
  mostly light through the page's CSS filter (its pixels, on a canvas), or
  text in a view or an HTML output with contrast under 3:1.

``run()`` returns one ``PageResult`` per page and mode; ``main()`` prints each failure as
``page: kind: detail`` and exits 1 if any. For the book it also insists that
the checks that look for something found it (pool views, block tables, a
replay, figures, checker marks), so a renamed class cannot turn a check off.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import functools
import html.parser
import http.server
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from urllib.parse import urlsplit

WINDOW = (1280, 900)


@dataclass(frozen=True)
class Mode:
    """How a reader sees the site: the window, a phone or not, the theme's dark mode or not."""

    name: str
    width: int
    height: int
    mobile: bool = False
    dark: bool = False

    def metrics(self, height: int | None = None) -> dict:
        return {"width": self.width, "height": height or self.height, "deviceScaleFactor": 1,
                "mobile": self.mobile}


MODES = {m.name: m for m in (Mode("desktop", *WINDOW), Mode("phone", 390, 844, mobile=True),
                             Mode("dark", *WINDOW, dark=True), Mode("phone-dark", 390, 844, mobile=True, dark=True))}


# ---------------------------------------------------------------- the server


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no access log on stderr
        pass


@dataclass
class Server:
    root: Path
    httpd: http.server.ThreadingHTTPServer
    thread: threading.Thread

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def serve(root: Path) -> Server:
    """Serve ``root`` on 127.0.0.1 on a free port, from a daemon thread."""
    handler = functools.partial(_QuietHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    return Server(Path(root), httpd, thread)


# ---------------------------------------------------------------- the browser


def find_chromium() -> str:
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise SystemExit("no Chromium found: install Debian's `chromium` (apt-get install chromium) "
                     "or set CHROMIUM to a Chrome binary")


class CDPError(RuntimeError):
    pass


class Browser:
    """Headless Chromium with one page, driven over the DevTools protocol."""

    def __init__(self, binary: str | None = None, window=WINDOW, timeout: float = 30.0,
                 env: dict | None = None) -> None:
        import websocket  # websocket-client

        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="pagedkv-chromium-")
        args = [
            binary or find_chromium(), "--headless=new", "--remote-debugging-port=0",
            f"--user-data-dir={self.profile}", f"--window-size={window[0]},{window[1]}",
            "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--no-default-browser-check", "--disable-background-networking", "--disable-component-update",
            "--disable-default-apps", "--disable-extensions", "--disable-sync", "--mute-audio",
            "--hide-scrollbars", "--force-device-scale-factor=1", "--lang=en-US",
            # Nothing leaves the machine: every host but 127.0.0.1 resolves to nowhere.
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            "about:blank",
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})})
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not (port_file.exists() and len(port_file.read_text().split()) >= 2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise CDPError("Chromium did not start (no DevToolsActivePort)")
            time.sleep(0.05)
        port = port_file.read_text().split()[0]
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=timeout) as r:
            targets = [t for t in json.load(r) if t.get("type") == "page"]
        self.ws = websocket.create_connection(targets[0]["webSocketDebuggerUrl"], timeout=timeout,
                                              suppress_origin=True, enable_multithread=False)
        self._next_id = 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, timeout: float | None = None) -> dict:
        """Call ``method`` and return its result; events received meanwhile go to ``self.events``."""
        self._next_id += 1
        msg_id = self._next_id
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params or {}}))
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            self.ws.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                msg = json.loads(self.ws.recv())
            except Exception as exc:  # websocket timeout
                raise CDPError(f"{method}: no answer ({type(exc).__name__})") from None
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise CDPError(f"{method}: {msg['error'].get('message')}")
                return msg.get("result", {})
            if "method" in msg:
                self.events.append(msg)

    def wait_for(self, method: str, timeout: float | None = None) -> dict | None:
        """Wait for an event named ``method`` (already received ones count)."""
        deadline = time.monotonic() + (timeout or self.timeout)
        for ev in self.events:
            if ev["method"] == method:
                return ev
        while time.monotonic() < deadline:
            self.ws.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                msg = json.loads(self.ws.recv())
            except Exception:
                return None
            if "method" in msg:
                self.events.append(msg)
                if msg["method"] == method:
                    return msg
        return None

    def drain(self, quiet: float = 0.15) -> None:
        """Collect events until none arrives for ``quiet`` seconds."""
        while True:
            self.ws.settimeout(quiet)
            try:
                msg = json.loads(self.ws.recv())
            except Exception:
                return
            if "method" in msg:
                self.events.append(msg)

    def evaluate(self, expression: str, timeout: float | None = None):
        result = self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                "returnByValue": True}, timeout=timeout)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise CDPError(f"evaluate: {text}")
        return result["result"].get("value")

    def click(self, x: float, y: float) -> None:
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            params = {"type": kind, "x": x, "y": y}
            if kind != "mouseMoved":
                params.update(button="left", clickCount=1)
            self.send("Input.dispatchMouseEvent", params)

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            try:
                ws.close()
            except Exception:
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)


# ---------------------------------------------------------------- in-page checks

# Runs in the page after load. Returns {problems: [[kind, detail]], counts: {...}, replays: n}.
_PAGE_JS = r"""
(async () => {
  const problems = [], counts = {pool: 0, table: 0, replay: 0, figure: 0, marks: 0, boxes: 0, explorable: 0};
  document.querySelectorAll('details').forEach(d => { d.open = true; });
  // Images below the fold may be lazy: load them all before measuring.
  const imgs = Array.from(document.images);
  imgs.forEach(i => { i.loading = 'eager'; });
  await Promise.race([
    Promise.all(imgs.map(i => i.complete ? null : new Promise(r => { i.onload = i.onerror = r; }))),
    new Promise(r => setTimeout(r, 5000))]);
  await document.fonts.ready;
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));

  const cells = Array.from(document.querySelectorAll('div.cell'));
  const where = el => {
    const cell = el.closest('div.cell');
    const sec = el.closest('section[id]');
    let s = cell ? `cell ${cells.indexOf(cell) + 1}` : (sec ? `section #${sec.id}` : 'page');
    if (cell && el.closest('.cell_output')) s += ' output';
    else if (cell && el.closest('.cell_input')) s += ' input';
    return s;
  };
  const name = el => {
    let s = el.tagName.toLowerCase();
    if (typeof el.className === 'string' && el.className.trim())
      s += '.' + el.className.trim().split(/\s+/).slice(0, 2).join('.');
    return s;
  };
  const snippet = el => (el.textContent || el.getAttribute('alt') || '').trim().replace(/\s+/g, ' ').slice(0, 60);
  const shown = el => { const r = el.getBoundingClientRect(); return r.width > 0 || r.height > 0; };

  const col = document.querySelector('article.bd-article') || document.querySelector('main') || document.body;
  const cs0 = getComputedStyle(col), cr = col.getBoundingClientRect();
  const left = cr.left + parseFloat(cs0.paddingLeft), right = cr.right - parseFloat(cs0.paddingRight);
  counts.column = Math.round(right - left);

  // Too wide, part 1: scroll boxes whose content is wider than the box.
  const reported = [], scrollers = [];  // scrollers: boxes a phone may scroll sideways
  const inside = el => reported.some(r => r.contains(el));
  const scrolled = el => scrollers.some(s => s !== el && s.contains(el));
  for (const el of col.querySelectorAll('*')) {
    if (inside(el)) continue;
    // MathJax's copy of a formula for screen readers is clipped to nothing by design.
    if (el.tagName === 'MJX-ASSISTIVE-MML') continue;
    const ox = getComputedStyle(el).overflowX;
    if (ox === 'visible') continue;
    // On a phone, code and wide tables may scroll inside their box; only a box that clips may not.
    if (window.__pkvPhone && (ox === 'auto' || ox === 'scroll')) { scrollers.push(el); continue; }
    if (el.scrollWidth > el.clientWidth + 1 && el.clientWidth > 0) {
      reported.push(el);
      problems.push(['too wide', `${where(el)}: ${name(el)} scrolls (content ${el.scrollWidth} px in a ` +
                     `${el.clientWidth}-px box): "${snippet(el)}"`]);
    }
  }
  // Too wide, part 2: boxes that stick out of the column.
  const sel = 'pre, table, img, svg, figure, .cell_output, .pagedkv-pool, .pagedkv-block-table, .pagedkv-replay';
  for (const el of col.querySelectorAll(sel)) {
    if (inside(el) || scrolled(el) || !shown(el)) continue;
    if (el instanceof SVGElement && el.ownerSVGElement) continue;  // parts of a picture
    const r = el.getBoundingClientRect();
    if (r.right > right + 1 || r.left < left - 1) {
      reported.push(el);
      problems.push(['too wide', `${where(el)}: ${name(el)} is ${Math.round(r.width)} px wide and sticks out ` +
                     `of the ${Math.round(right - left)}-px column by ${Math.round(Math.max(r.right - right, left - r.left))} px: "${snippet(el)}"`]);
    }
  }
  counts.boxes = reported.length;

  // A phone: nothing may make the whole page scroll sideways.
  const doc = document.documentElement;
  if (window.__pkvPhone && window.innerWidth > screen.width + 1)
    problems.push(['too wide', `page: laid out ${window.innerWidth} px wide for a ${screen.width}-px phone, so the browser shrinks it`]);
  if (window.__pkvPhone && doc.scrollWidth > window.innerWidth + 1)
    problems.push(['too wide', `page: the page scrolls sideways (${doc.scrollWidth} px in a ${window.innerWidth}-px window)`]);

  // Legible on a phone: a view's SVG picture scales with the column; its smallest label, as drawn,
  // is 9 px or more. (At 1280 px the book's pictures are drawn for the column, at full size.)
  for (const svg of window.__pkvPhone ? col.querySelectorAll('.pagedkv-pool svg, .pagedkv-replay svg, .pagedkv-step > svg') : []) {
    if (svg.ownerSVGElement || !shown(svg) || svg.closest('desc')) continue;
    const vb = svg.viewBox && svg.viewBox.baseVal;
    if (!vb || !vb.width) continue;
    const scale = svg.getBoundingClientRect().width / vb.width;
    const sizes = Array.from(svg.querySelectorAll('text')).map(t => parseFloat(t.getAttribute('font-size'))).filter(x => x > 0);
    if (sizes.length && Math.min(...sizes) * scale < 9) {
      problems.push(['illegible', `${where(svg)}: a picture drawn at ${Math.round(scale * 100)} % of its size: ` +
                     `its ${Math.min(...sizes)}-px labels show at ${(Math.min(...sizes) * scale).toFixed(1)} px`]);
    }
  }

  // Dark mode: no light box in the column, and text that stands out from what is behind it.
  counts.dark = doc.dataset.theme === 'dark' ? 1 : 0;
  if (counts.dark) {
    const rgba = c => { const m = c.match(/[\d.]+/g) || []; return m.length >= 3 ? [+m[0], +m[1], +m[2], m.length > 3 ? +m[3] : 1] : [0, 0, 0, 0]; };
    const lum = ([r, g, b]) => { const f = v => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
                                 return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b); };
    const background = el => { for (let e = el; e; e = e.parentElement) { const c = rgba(getComputedStyle(e).backgroundColor);
                                  if (c[3] > 0.5) return c; } return [255, 255, 255, 1]; };
    const light = [];
    for (const el of col.querySelectorAll('*')) {
      if (light.some(l => l.contains(el)) || el.closest('svg') && el.tagName.toLowerCase() !== 'svg') continue;
      const c = rgba(getComputedStyle(el).backgroundColor), r = el.getBoundingClientRect();
      if (c[3] > 0.5 && lum(c) > 0.6 && r.width * r.height > 4000 && r.height > 24) {
        light.push(el);
        problems.push(['dark', `${where(el)}: ${name(el)} is a light box (${Math.round(r.width)} x ${Math.round(r.height)} px, ${getComputedStyle(el).backgroundColor}) in dark mode: "${snippet(el)}"`]);
      }
    }
    // Pictures (figures, diagrams, pool pictures) as drawn, through the page's CSS filter: not mostly light.
    const pageBg = background(col);
    const drawn = async el => {
      const img = el.tagName === 'IMG' ? el : await new Promise(done => {
        const i = new Image();
        i.onload = () => done(i); i.onerror = () => done(null);
        i.src = 'data:image/svg+xml;charset=utf-8,' + encodeURIComponent(new XMLSerializer().serializeToString(el));
      });
      if (!img || !img.naturalWidth) return null;
      const canvas = document.createElement('canvas');
      canvas.width = canvas.height = 64;
      const ctx = canvas.getContext('2d'), cs = getComputedStyle(el), own = rgba(cs.backgroundColor);
      ctx.fillStyle = `rgb(${pageBg[0]},${pageBg[1]},${pageBg[2]})`;
      ctx.fillRect(0, 0, 64, 64);
      ctx.filter = cs.filter || 'none';
      if (own[3] > 0) { ctx.fillStyle = cs.backgroundColor; ctx.fillRect(0, 0, 64, 64); }
      ctx.drawImage(img, 0, 0, 64, 64);
      try {
        const d = ctx.getImageData(0, 0, 64, 64).data;
        let sum = 0;
        for (let i = 0; i < d.length; i += 4) sum += lum([d[i], d[i + 1], d[i + 2]]);
        return sum / (d.length / 4);
      } catch (e) { return null; }  // a picture the canvas may not read
    };
    for (const el of col.querySelectorAll('img, .pagedkv-pool > svg, .pagedkv-step > svg')) {
      const r = el.getBoundingClientRect();
      if (light.some(l => l.contains(el)) || r.width * r.height <= 4000 || r.height <= 24) continue;
      const mean = await drawn(el);
      if (mean !== null && mean > 0.4) {
        light.push(el);
        problems.push(['dark', `${where(el)}: ${name(el)} is drawn light (${Math.round(r.width)} x ${Math.round(r.height)} px, mean luminance ${mean.toFixed(2)}) in dark mode: "${snippet(el).slice(0, 40)}"`]);
      }
    }
    counts.pictures_dark = col.querySelectorAll('img, .pagedkv-pool > svg, .pagedkv-step > svg').length;
    let faint = 0;
    for (const el of col.querySelectorAll('.pagedkv-pool, .pagedkv-block-table, .pagedkv-replay, .pagedkv-explorable, .cell_output .text_html')) {
      for (const t of el.querySelectorAll('*')) {
        if (faint >= 3 || !Array.from(t.childNodes).some(n => n.nodeType === 3 && n.data.trim()) || !shown(t)) continue;
        if (t.closest('svg')) continue;  // SVG text is drawn on its own cells
        const fg = lum(rgba(getComputedStyle(t).color)), bg = lum(background(t));
        const ratio = (Math.max(fg, bg) + 0.05) / (Math.min(fg, bg) + 0.05);
        if (ratio < 3) {
          faint++;
          problems.push(['dark', `${where(t)}: text "${snippet(t)}" has contrast ${ratio.toFixed(1)}:1 with what is behind it in dark mode`]);
        }
      }
    }
  }

  // Images that did not load.
  for (const img of imgs) {
    if (!img.complete || img.naturalWidth === 0)
      problems.push(['image', `${where(img)}: ${name(img)} did not load: ${(img.getAttribute('src') || '').slice(0, 80)}`]);
  }
  // Block views and figures: present and not empty.
  const area = el => { const r = el.getBoundingClientRect(); return r.width * r.height; };
  for (const el of col.querySelectorAll('.pagedkv-pool')) {
    if (el.closest('.pkv-frame')) continue;
    counts.pool++;
    const pic = el.querySelector('img, svg');
    if (!pic || area(pic) < 100 || (pic.tagName === 'IMG' && pic.naturalWidth === 0))
      problems.push(['empty', `${where(el)}: a pool view with no picture`]);
  }
  const hiddenFrame = el => { const f = el.closest('.pkv-frame'); return f && !shown(f); };
  for (const el of col.querySelectorAll('.pagedkv-block-table')) {
    if (hiddenFrame(el)) continue;  // a replay's other frames: the replay check steps through them
    counts.table++;
    if (!el.querySelector('td') || area(el) < 100)
      problems.push(['empty', `${where(el)}: a block table with no cells`]);
  }
  for (const el of col.querySelectorAll('.cell_output img, figure img, figure svg')) {
    if (el.closest('.pagedkv-pool, .pagedkv-replay') || el.closest('desc')) continue;
    counts.figure++;
    if (area(el) < 100) problems.push(['empty', `${where(el)}: a figure drawn with no area`]);
  }
  const replays = [];
  for (const el of col.querySelectorAll('.pagedkv-replay')) {
    counts.replay++;
    const frames = el.querySelectorAll('.pkv-frame');
    const visible = Array.from(frames).filter(shown);
    if (!frames.length || !visible.length || visible.some(f => area(f) < 100))
      problems.push(['empty', `${where(el)}: a replay with no visible frame`]);
    if (frames.length > 1) replays.push(el);
  }
  window.__pkvReplays = replays;

  // Explorables: the script ran (controls shown) and the output is drawn.
  const explorables = Array.from(col.querySelectorAll('.pagedkv-explorable'));
  for (const el of explorables) {
    counts.explorable++;
    const controls = el.querySelector('.pkv-controls'), out = el.querySelector('.pkv-out');
    if (!el.dataset.mounted || !controls || !shown(controls))
      problems.push(['explorable', `${where(el)}: the ${el.dataset.kind} explorable's script did not run`]);
    if (!out || area(out) < 100)
      problems.push(['empty', `${where(el)}: the ${el.dataset.kind} explorable shows no output`]);
  }
  window.__pkvExplorables = explorables;

  // Checker marks: non-zero width, and drawn in colour in the element's own fonts.
  const marks = {};
  const walker = document.createTreeWalker(col, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    for (const ch of ['\u2705', '\u274c']) {
      const at = n.data.indexOf(ch);
      if (at < 0 || (marks[ch] || 0) >= 3) continue;
      marks[ch] = (marks[ch] || 0) + 1;
      counts.marks++;
      const range = document.createRange();
      range.setStart(n, at); range.setEnd(n, at + ch.length);
      const w = range.getBoundingClientRect().width;
      const cs = getComputedStyle(n.parentElement);
      const canvas = document.createElement('canvas');
      canvas.width = canvas.height = 48;
      const ctx = canvas.getContext('2d');
      ctx.font = `32px ${cs.fontFamily}`;
      ctx.textBaseline = 'top';
      ctx.fillStyle = '#000';
      ctx.fillText(ch, 4, 4);
      const d = ctx.getImageData(0, 0, 48, 48).data;
      let coloured = 0;
      for (let i = 0; i < d.length; i += 4)
        if (d[i + 3] > 128 && Math.max(d[i], d[i + 1], d[i + 2]) - Math.min(d[i], d[i + 1], d[i + 2]) > 80) coloured++;
      if (!(w > 0) || coloured < 40)
        problems.push(['marks', `${where(n.parentElement)}: ${ch} renders ${w > 0 ? 'without colour (a blank box or missing glyph)' : 'with zero width'} in ${cs.fontFamily}`]);
    }
  }
  return {problems, counts, replays: replays.length, explorables: explorables.length};
})()
"""

_REPLAY_STATE_JS = r"""
((k, act) => {
  const el = window.__pkvReplays[k];
  const frames = Array.from(el.querySelectorAll('.pkv-frame'));
  const shown = frames.map((f, i) => f.getBoundingClientRect().height > 0 ? i : -1).filter(i => i >= 0);
  const step = (el.querySelector('.pkv-step') || {}).textContent || '';
  const next = el.querySelector('.pkv-next');
  let box = null;
  if (act && next) {
    next.scrollIntoView({block: 'center'});
    const r = next.getBoundingClientRect();
    box = r.width > 0 ? [r.left + r.width / 2, r.top + r.height / 2] : null;
  }
  return {shown, step, box, frames: frames.length};
})(%d, %s)
"""


# Focus one of replay k's controls by tabbing to it, as a keyboard user does: focus the
# element before it, then Tab. Returns whether the control has the focus.
_REPLAY_FOCUS_JS = r"""
((k, sel) => {
  const el = window.__pkvReplays[k], target = el.querySelector(sel);
  const all = Array.from(document.querySelectorAll('a[href], button, input, select, textarea, summary, [tabindex]'))
    .filter(e => e.tabIndex >= 0 && !e.disabled && e.getClientRects().length);
  const at = all.indexOf(target);
  if (at <= 0) return false;
  all[at - 1].focus();
  window.__pkvTabTarget = target;
  return true;
})(%d, %s)
"""


def _press(browser: "Browser", key: str, code: int, text: str | None = None) -> None:
    for kind in ("keyDown", "keyUp"):
        params = {"type": kind, "key": key, "code": key if len(key) > 1 else f"Key{key.upper()}",
                  "windowsVirtualKeyCode": code}
        if text and kind == "keyDown":
            params["text"] = text
        browser.send("Input.dispatchKeyEvent", params)


def check_replay_keyboard(browser: "Browser", k: int) -> list[tuple[str, str]]:
    """Replay k from the keyboard alone: Tab reaches its next button and Enter steps it;
    Tab reaches its slider and the right arrow steps it."""
    problems = []
    for sel, key, code, text, what in ((".pkv-next", "Enter", 13, "\r", "Enter on its next button"),
                                       ("input[type=range]", "ArrowRight", 39, None,
                                        "the right arrow on its slider")):
        before = browser.evaluate(_REPLAY_STATE_JS % (k, "false"))
        if not browser.evaluate(_REPLAY_FOCUS_JS % (k, json.dumps(sel))):
            problems.append(("replay", f"replay {k + 1}: its {sel} cannot be reached with Tab"))
            continue
        _press(browser, "Tab", 9)
        if not browser.evaluate("document.activeElement === window.__pkvTabTarget"):
            problems.append(("replay", f"replay {k + 1}: Tab did not bring the focus to its {sel}"))
            continue
        shown, _, total = before["step"].partition(" / ")
        if shown == total:  # on the last frame: step back first, so that a step forward shows
            browser.evaluate(f"window.__pkvReplays[{k}].querySelector('.pkv-prev').click()")
            before = browser.evaluate(_REPLAY_STATE_JS % (k, "false"))
            browser.evaluate("window.__pkvTabTarget.focus()")
        _press(browser, key, code, text)
        after = browser.evaluate(_REPLAY_STATE_JS % (k, "false"))
        if after["step"] == before["step"] or after["shown"] == before["shown"]:
            problems.append(("replay", f"replay {k + 1} did not advance with {what} "
                                       f"(step '{before['step']}' -> '{after['step']}')"))
    return problems

# Set explorable k's controls to ``values`` (null: leave them), one input event
# each as a reader's move fires, then read back the controls and the output.
_EXPLORABLE_JS = r"""
((k, values) => {
  const el = window.__pkvExplorables[k];
  const controls = Array.from(el.querySelectorAll('[data-input]'));
  for (const c of controls) {
    if (!values || !(c.dataset.input in values)) continue;
    c.value = values[c.dataset.input];
    c.dispatchEvent(new Event('input', {bubbles: true}));
  }
  return {kind: el.dataset.kind, config: el.dataset.config,
          slider: controls.some(c => c.type === 'range'),
          controls: controls.map(c => ({name: c.dataset.input, type: c.dataset.type, value: c.value,
            options: c.tagName === 'SELECT' ? Array.from(c.options).map(o => o.value) : null,
            range: ['range', 'number'].includes(c.type) ? [c.min, c.max, c.step] : null})),
          text: el.querySelector('.pkv-out').textContent};
})(%d, %s)
"""


class _Text(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []

    def handle_data(self, data: str) -> None:
        self.parts.append(data)


def text_of(markup: str) -> str:
    """What ``textContent`` reads of ``markup``: its text, entities decoded."""
    parser = _Text()
    parser.feed(markup)
    parser.close()
    return "".join(parser.parts)


def _control_value(control: dict):
    """A control's value as the module receives it: text, an int, or (a range) a float."""
    value, kind = control["value"], control["type"]
    return int(value) if kind == "int" else float(value) if kind == "float" else value


def _random_values(controls: list[dict], rng: random.Random) -> dict:
    """A setting of every control: one of its options, or one step of its range."""
    values = {}
    for c in controls:
        if c["options"]:
            values[c["name"]] = rng.choice(c["options"])
        elif c["range"]:
            lo, hi, step = (Decimal(x) for x in c["range"])
            values[c["name"]] = format((lo + step * rng.randint(0, int((hi - lo) / step))).normalize(), "f")
    return values


def library_text(state: dict) -> str:
    """The output text the library gives for an explorable's controls, as the page reports them."""
    from pagedkv.views.explorables import KINDS

    kind, config = KINDS[state["kind"]], json.loads(state["config"])
    values = {c["name"]: _control_value(c) for c in state["controls"]}
    return text_of(kind.render(kind.figures(kind.inputs(values, config)), config))


def _first_difference(got: str, want: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return f"shows '...{got[max(0, at - 30):at + 50]}' where the library gives '...{want[max(0, at - 30):at + 50]}'"


def check_explorable(browser: "Browser", k: int, cases: int, seed: str) -> list[tuple[str, str]]:
    """Move explorable ``k``'s controls to ``cases`` seeded settings, then one step of its
    slider with the keyboard; after each move its output must read as the library's."""
    problems = []
    state = browser.evaluate(_EXPLORABLE_JS % (k, "null"))
    rng = random.Random(seed)
    moves = [_random_values(state["controls"], rng) for _ in range(cases)]
    for values in [*moves, "keyboard"]:
        if values == "keyboard":
            if not state["slider"]:
                continue
            before = {c["name"]: c["value"] for c in state["controls"]}
            browser.evaluate(f"window.__pkvExplorables[{k}].querySelector('input[type=range]').focus()")
            for kind in ("keyDown", "keyUp"):
                browser.send("Input.dispatchKeyEvent", {"type": kind, "key": "ArrowLeft", "code": "ArrowLeft",
                                                        "windowsVirtualKeyCode": 37})
            state = browser.evaluate(_EXPLORABLE_JS % (k, "null"))
            moved = {c["name"]: c["value"] for c in state["controls"]} != before
            if not moved:
                problems.append(("explorable", f"{state['kind']} {k + 1}: its slider did not move "
                                               "with the arrow key"))
        else:
            state = browser.evaluate(_EXPLORABLE_JS % (k, json.dumps(values)))
            shown = {c["name"]: c["value"] for c in state["controls"] if c["name"] in values}
            if shown != {n: str(v) for n, v in values.items()}:
                problems.append(("explorable", f"{state['kind']} {k + 1}: controls set to {values} "
                                               f"read {shown}"))
                continue
        want = library_text(state)
        if state["text"] != want:
            setting = {c["name"]: c["value"] for c in state["controls"]}
            problems.append(("explorable", f"{state['kind']} {k + 1} at {setting}: "
                                           + _first_difference(state["text"], want)))
    return problems


# Answers (hide-cell cells) and hints (<details> in markdown) must start
# collapsed; the check also opens the first one with the keyboard.
_COLLAPSED_JS = r"""
(() => {
  const all = Array.from(document.querySelectorAll('.bd-article details'));
  window.__pkvDetails = all;
  const label = d => ((d.querySelector(':scope > summary') || {}).textContent || '').trim().slice(0, 60);
  return {count: all.length, open: all.filter(d => d.open).map(label),
          bare: all.filter(d => !d.querySelector(':scope > summary')).length};
})()
"""


def check_collapsed(browser: "Browser") -> tuple[list[tuple[str, str]], int]:
    """Every answer and hint on the page starts collapsed, has a summary to open it
    with, and the first one opens with Enter on its focused summary."""
    state = browser.evaluate(_COLLAPSED_JS)
    problems = [("collapsed", f"starts open: '{label}'") for label in state["open"]]
    if state["bare"]:
        problems.append(("collapsed", f"{state['bare']} collapsible box(es) without a summary to open them"))
    if state["count"] > state["bare"] and not state["open"]:
        first = "window.__pkvDetails.find(d => d.querySelector(':scope > summary'))"
        browser.evaluate(f"{first}.querySelector(':scope > summary').focus()")
        for kind in ("keyDown", "keyUp"):
            browser.send("Input.dispatchKeyEvent", {"type": kind, "key": "Enter", "code": "Enter",
                                                    "windowsVirtualKeyCode": 13,
                                                    **({"text": "\r"} if kind == "keyDown" else {})})
        if not browser.evaluate(f"{first}.open"):
            problems.append(("collapsed", "the first collapsed box did not open with Enter on its summary"))
        browser.evaluate(f"{first}.open = false")
    return problems, state["count"]


@dataclass
class PageResult:
    page: str
    problems: list[tuple[str, str]] = field(default_factory=list)
    counts: dict = field(default_factory=dict)
    screenshot: str | None = None
    seconds: float = 0.0
    mode: str = "desktop"

    @property
    def ok(self) -> bool:
        return not self.problems


def _is_local(url: str) -> bool:
    scheme = urlsplit(url).scheme
    if scheme in ("data", "blob", "about", "chrome-error", "devtools"):
        return True
    return urlsplit(url).hostname == "127.0.0.1"


def _browser_probe(url: str) -> bool:
    """The browser's own favicon probe at the server's root (no page asks for it)."""
    return urlsplit(url).path == "/favicon.ico"


def _event_problems(events: list[dict]) -> list[tuple[str, str]]:
    """Console errors, script errors and bad requests among the CDP events of one page load."""
    out: list[tuple[str, str]] = []
    urls: dict[str, str] = {}
    for ev in events:
        m, p = ev["method"], ev.get("params", {})
        if m == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            text = d.get("exception", {}).get("description") or d.get("text", "")
            out.append(("script error", f"{text.splitlines()[0] if text else '?'} "
                                        f"({d.get('url', '')}:{d.get('lineNumber', 0) + 1})"))
        elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            args = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
            out.append(("console", args[:200]))
        elif m == "Log.entryAdded" and p["entry"].get("level") == "error":
            e = p["entry"]
            if _browser_probe(e.get("url", "")):
                continue
            out.append(("console", f"{e.get('text', '')[:200]} {e.get('url', '')}".strip()))
        elif m == "Network.requestWillBeSent":
            url = p["request"]["url"]
            urls[p["requestId"]] = url
            if not _is_local(url):
                out.append(("request", f"off the machine: {url[:120]}"))
        elif (m == "Network.responseReceived" and p["response"].get("status", 200) >= 400
              and not _browser_probe(p["response"]["url"])):
            out.append(("request", f"HTTP {p['response']['status']}: {p['response']['url'][:120]}"))
        elif m == "Network.loadingFailed" and not p.get("canceled"):
            url = urls.get(p["requestId"], "?")
            if _is_local(url) and not _browser_probe(url):  # off-machine ones are reported above
                out.append(("request", f"failed ({p.get('errorText', '')}): {url[:120]}"))
    # The browser logs a failed request a second time as a console error: keep one.
    seen, unique = set(), []
    for kind, detail in out:
        if (kind, detail) not in seen:
            seen.add((kind, detail))
            unique.append((kind, detail))
    return unique


# ---------------------------------------------------------------- accessibility (axe-core)

AXE_IMPACTS = ("serious", "critical")  # what fails a page; minor and moderate ones are counted


def find_axe() -> Path | None:
    """axe-core's browser script, as ``npm ci`` installs it from package-lock.json (or ``$AXE_CORE``)."""
    path = Path(os.environ.get("AXE_CORE") or Path(__file__).resolve().parents[1] / "node_modules" / "axe-core"
                / "axe.min.js")
    return path if path.is_file() else None


# Runs axe on the whole page (the theme's navigation too) with its default rules (WCAG 2.x A and AA).
_AXE_RUN_JS = r"""
(async () => {
  // Collapsed boxes were just opened: let their fade-in end, or axe measures half-faded text.
  await Promise.race([Promise.all(document.getAnimations().map(a => a.finished.catch(() => null))),
                      new Promise(r => setTimeout(r, 3000))]);
  const r = await axe.run(document, {resultTypes: ['violations']});
  return r.violations.map(v => ({id: v.id, impact: v.impact, help: v.help, nodes: v.nodes.length,
    where: v.nodes.slice(0, 2).map(n => n.target.join(' ') + (n.failureSummary ? ' (' +
      n.failureSummary.split('\n').slice(1, 2).join('').trim().slice(0, 120) + ')' : ''))}));
})()
"""


def check_axe(browser: "Browser", axe_source: str) -> tuple[list[tuple[str, str]], dict]:
    """axe-core's violations on the page as it stands: serious and critical ones are problems;
    counts of all of them by impact (for the report)."""
    browser.evaluate(axe_source + ";0", timeout=60)
    violations = browser.evaluate(_AXE_RUN_JS, timeout=120)
    counts = {f"axe_{impact}": 0 for impact in ("minor", "moderate", "serious", "critical")}
    problems = []
    for v in violations:
        counts[f"axe_{v['impact']}"] = counts.get(f"axe_{v['impact']}", 0) + v["nodes"]
        if v["impact"] in AXE_IMPACTS:
            problems.append(("axe", f"{v['impact']} {v['id']} on {v['nodes']} element(s): {v['help']}: "
                                    + "; ".join(v["where"])))
    return problems, counts


def check_page(browser: Browser, url: str, page: str, screenshot: Path | None,
               explorable_cases: int = 8, mode: Mode = MODES["desktop"],
               axe_source: str | None = None) -> PageResult:
    t0 = time.monotonic()
    result = PageResult(page)
    browser.events.clear()
    browser.send("Page.navigate", {"url": url})
    if browser.wait_for("Page.loadEventFired") is None:
        result.problems.append(("load", "the page did not finish loading in time"))
    try:
        redirect = browser.evaluate("(document.querySelector('meta[http-equiv=refresh i]') || {}).content || ''")
    except CDPError as exc:  # a zero-delay redirect can leave before the question arrives
        if "navigated" not in str(exc):
            raise
        redirect = "left on load"
    if redirect:  # a redirect page (the site's index.html): check that its target loads, nothing more
        deadline = time.monotonic() + browser.timeout
        while sum(e["method"] == "Page.loadEventFired" for e in browser.events) < 2 and time.monotonic() < deadline:
            browser.drain(0.1)
        final = browser.evaluate("location.href")
        if final == url:
            result.problems.append(("load", f"the redirect ({redirect}) did not happen"))
        browser.drain()
        result.problems[:0] = _event_problems(browser.events)
        result.counts = {"redirect": 1}
        result.seconds = time.monotonic() - t0
        return result
    collapsed_problems, num_collapsed = check_collapsed(browser)  # before _PAGE_JS opens them all
    try:
        browser.evaluate(f"window.__pkvPhone = {'true' if mode.mobile else 'false'}")
        found = browser.evaluate(_PAGE_JS, timeout=60)
    except CDPError as exc:
        found = {"problems": [["script error", f"the checks could not run: {exc}"]], "counts": {}, "replays": 0}
    result.counts = {**found["counts"], "collapsed": num_collapsed}
    result.problems.extend(tuple(p) for p in found["problems"])
    result.problems.extend(collapsed_problems)
    if axe_source is not None:  # with every collapsed box open, as _PAGE_JS left them
        try:
            axe_problems, axe_counts = check_axe(browser, axe_source)
        except CDPError as exc:
            axe_problems, axe_counts = [("axe", f"axe-core could not run: {exc}")], {}
        result.problems.extend(axe_problems)
        result.counts.update(axe_counts)
    for k in range(found["replays"]):
        before = browser.evaluate(_REPLAY_STATE_JS % (k, "true"))
        if not before["box"]:
            result.problems.append(("replay", f"replay {k + 1}: no visible next button"))
            continue
        browser.click(*before["box"])
        after = browser.evaluate(_REPLAY_STATE_JS % (k, "false"))
        if after["shown"] == before["shown"] or after["step"] == before["step"]:
            result.problems.append(("replay", f"replay {k + 1} did not advance when next was clicked "
                                              f"(frames shown {before['shown']} -> {after['shown']}, "
                                              f"step '{before['step']}' -> '{after['step']}')"))
        result.problems.extend(check_replay_keyboard(browser, k))
    for k in range(found.get("explorables", 0)):
        result.problems.extend(check_explorable(browser, k, explorable_cases, f"{page}:{k}"))
    browser.drain()
    result.problems[:0] = _event_problems(browser.events)
    if screenshot is not None:
        # A window as tall as the page, then a plain capture: capturing beyond
        # the viewport shifted this theme's columns out of the picture.
        browser.evaluate("window.scrollTo(0, 0)")
        clip = _full_page_clip(browser)
        browser.send("Emulation.setDeviceMetricsOverride", mode.metrics(clip["height"]))
        try:
            shot = browser.send("Page.captureScreenshot", {"format": "png"}, timeout=60)
        finally:
            browser.send("Emulation.setDeviceMetricsOverride", mode.metrics())
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        screenshot.write_bytes(base64.b64decode(shot["data"]))
        result.screenshot = str(screenshot)
    result.seconds = time.monotonic() - t0
    return result


def _full_page_clip(browser: Browser) -> dict:
    width, height = browser.evaluate("[document.documentElement.scrollWidth, "
                                     "Math.min(document.documentElement.scrollHeight, 16000)]")
    return {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}


def pages_of(root: Path) -> list[str]:
    """Every HTML page of a built site, relative to its root (Sphinx's _static templates excluded)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.html") if "_static" not in p.parts)


def run(html_dir: str | Path, screenshots: str | Path | None = None, only: list[str] | None = None,
        binary: str | None = None, log=print, env: dict | None = None,
        modes: Sequence[str] = ("desktop",), explorable_cases: int = 8, axe: bool = False,
        jobs: int = 1) -> list[PageResult]:
    """Check every page under ``html_dir`` (or those whose path contains one of ``only``),
    once in each of ``modes`` (names in ``MODES``), and with ``axe`` also with axe-core
    (``find_axe``; its absence is an error then).

    ``env`` adds to the browser's environment (the tests give it a bare
    fontconfig). Screenshots go to ``screenshots`` when given (the first
    mode's at its top, the others' in a folder named after the mode). Each
    explorable is moved to ``explorable_cases`` settings in the first mode
    and to one in the others.

    ``jobs`` browsers share the pages (every ``jobs``-th page each, in its own
    thread: the browsers render in parallel while Python waits on them); the
    results come back in page order within each mode, as with one browser.
    """
    root = Path(html_dir)
    pages = pages_of(root)
    if only:
        pages = [p for p in pages if any(o in p for o in only)]
    if not pages:
        raise SystemExit(f"no pages under {root}: build the site first")
    axe_source = None
    if axe:
        path = find_axe()
        if path is None:
            raise SystemExit("axe-core is not installed: `make node_modules` (npm ci) installs it "
                             "from package-lock.json")
        axe_source = path.read_text(encoding="utf-8")
    server = serve(root)
    shards = [pages[j::jobs] for j in range(max(1, min(jobs, len(pages))))]
    try:
        if len(shards) == 1:
            results = _check_pages(server, shards[0], modes, screenshots, explorable_cases, axe_source,
                                   binary, env, log)
        else:
            with concurrent.futures.ThreadPoolExecutor(len(shards)) as pool:
                futures = [pool.submit(_check_pages, server, shard, modes, screenshots, explorable_cases,
                                       axe_source, binary, env, log) for shard in shards]
                results = [r for f in futures for r in f.result()]
            order = {(m, p): k for k, (m, p) in enumerate((MODES[m].name, p) for m in modes for p in pages)}
            results.sort(key=lambda r: order[(r.mode, r.page)])
    finally:
        server.close()
    return results


def _check_pages(server: Server, pages: list[str], modes: Sequence[str], screenshots, explorable_cases: int,
                 axe_source: str | None, binary: str | None, env: dict | None, log) -> list[PageResult]:
    """One browser checks ``pages`` in each of ``modes``, in order."""
    browser = Browser(binary, env=env)
    results = []
    try:
        for domain in ("Page", "Runtime", "Network", "Log"):
            browser.send(f"{domain}.enable")
        for n, mode in enumerate(MODES[name] for name in modes):
            browser.send("Emulation.setDeviceMetricsOverride", mode.metrics())
            browser.send("Emulation.setEmulatedMedia", {"features": [
                {"name": "prefers-color-scheme", "value": "dark" if mode.dark else "light"}]})
            folder = Path(screenshots) / mode.name if screenshots and n else screenshots
            for page in pages:
                shot = Path(folder) / (page[:-5].replace("/", "__") + ".png") if folder else None
                res = check_page(browser, server.base + page, page, shot,
                                 explorable_cases if n == 0 else 1, mode, axe_source)
                res.mode = mode.name
                if mode.dark and not res.counts.get("dark") and not res.counts.get("redirect"):
                    res.problems.append(("dark", "the theme did not switch to dark mode"))
                results.append(res)
                if log:
                    log(f"{'ok  ' if res.ok else 'FAIL'} {mode.name:10s} {page} ({res.seconds:.1f} s)"
                        + "".join(f"\n     {kind}: {detail}" for kind, detail in res.problems))
    finally:
        browser.close()
    return results


# What the book's pages must contain somewhere, so that no check silently finds nothing.
BOOK_EXPECTS = {"pool": 1, "table": 1, "replay": 1, "figure": 1, "marks": 2, "explorable": 5,
                "collapsed": 40}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.site_check", description=__doc__.splitlines()[0])
    parser.add_argument("html_dir", nargs="?", default="_build/html")
    parser.add_argument("--screenshots", default="_build/screenshots")
    parser.add_argument("--only", nargs="*", help="check only pages whose path contains one of these")
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES),
                        help="how a reader sees the site (default: all)")
    parser.add_argument("--no-expect", action="store_true", help="do not require the book's views to be found")
    parser.add_argument("--no-axe", action="store_true", help="do not run axe-core's accessibility rules")
    parser.add_argument("--jobs", type=int, default=1, help="browsers that share the pages (default 1)")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    results = run(args.html_dir, args.screenshots, args.only, modes=args.modes, axe=not args.no_axe,
                  jobs=args.jobs)
    failed = [r for r in results if not r.ok]
    first = [r for r in results if r.mode == args.modes[0]]
    totals = {k: sum(r.counts.get(k, 0) for r in first) for k in ("pool", "table", "replay", "figure",
                                                                   "marks", "boxes", "explorable",
                                                                   "collapsed")}
    missing = [] if args.no_expect or args.only else [
        f"{k} ({totals[k]} found, {n} expected)" for k, n in BOOK_EXPECTS.items() if totals[k] < n]
    for name in args.modes:
        mode, done = MODES[name], [r for r in results if r.mode == name]
        print(f"{name}: {len(done)} pages at {mode.width} x {mode.height}{' (dark)' if mode.dark else ''} "
              f"in {sum(r.seconds for r in done):.0f} s, {sum(1 for r in done if not r.ok)} failing"
              + ("" if args.no_axe else "; axe-core: " + ", ".join(
                  f"{sum(r.counts.get(f'axe_{i}', 0) for r in done)} {i}"
                  for i in ("critical", "serious", "moderate", "minor")) + " elements in violation"))
    print(f"{len(results)} page views in {time.monotonic() - t0:.0f} s; found {totals['pool']} pool views, "
          f"{totals['table']} block tables, {totals['replay']} replays, {totals['explorable']} explorables, "
          f"{totals['figure']} figures, {totals['collapsed']} collapsed answers and hints, "
          f"{totals['marks']} checker marks; {totals['boxes']} boxes too wide on "
          f"{sum(1 for r in first if r.counts.get('boxes'))} pages; screenshots in {args.screenshots}")
    if missing:
        print("the checks found too few of: " + ", ".join(missing), file=sys.stderr)
    if failed:
        print(f"{len(failed)} of {len(results)} page views fail:", file=sys.stderr)
        for r in failed:
            for kind, detail in r.problems:
                print(f"  {r.mode} {r.page}: {kind}: {detail}", file=sys.stderr)
    return 1 if failed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
