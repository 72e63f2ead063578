"""Watch the live views redraw in a real JupyterLab while the later cells run.

    python -m tools.live_check [NOTEBOOK...] [--out _build/live] [--timeout 300]

A developers' check (``make test-live``), not part of ``make test``: it needs
Chromium, and takes about 20 s on two cores.

1. The notebooks (by default chapters 3 and 4) are copied into a temporary
   directory (the committed ones are never touched), and one JupyterLab is
   started there, headless, on 127.0.0.1, on a free port, with a random token
   and its own settings, config, data, runtime, workspace and IPython
   directories (``windowingMode: none``, so every cell stays in the page; no
   news, no update check, no extension manager, no autosave).
2. Headless Chromium (``tools.site_check.Browser``: every host but
   127.0.0.1 resolves to nowhere) opens JupyterLab; for each notebook in turn
   it opens the copy through ``window.jupyterapp`` (``docmanager:open``), waits
   for its kernel, clears the outputs and runs ``notebook:run-all-cells``.
3. A ``MutationObserver`` in the page records every distinct HTML the live
   views (the ipywidgets ``HTML`` of the cells tagged ``nbval-ignore-output``
   that build a ``BlockPoolView``/``BlockTableView``) go through, each with the
   time, whether the view's own cell had finished, whether a later cell was
   still queued or running, the kernel's status and the cell executing;
   meanwhile the views are screenshot as they change (polled, so a sample: up
   to ``--shots`` different pictures each, ``<nb>-cellNN-liveMM.png``). After
   the run every recorded state is drawn again on top of the page and
   screenshot (``<nb>-cellNN-stateMM.png``, up to ``--states``), and the
   window once (``<nb>-final.png``), all into ``--out``.
4. After the run the kernel is asked how often each view redrew itself
   (``view.redraws``; repeated identical pictures count there, not in the
   page's distinct states).

Cells are numbered from 1, markdown cells included, as in the notebook.

It fails (exit 1, with the reason) if, in a notebook, the first live view did
not render as a widget, or its HTML changed fewer than ``--min-changes`` (2)
times after its own cell had finished while a later cell was still queued or
running and the kernel was busy; if another live view never rendered; if a cell
raised or did not run; if the run did not finish within ``--timeout``; or if
JupyterLab or Chromium did not start. JupyterLab (and its kernels) and Chromium
are stopped on every way out (an exception, Ctrl-C, SIGTERM, the time limit),
and the temporary directory is removed.
A summary goes to ``<out>/report.json``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tools.site_check import Browser, CDPError, find_chromium

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = ("chapters/03_block_pool.ipynb", "chapters/04_block_table.ipynb")
WINDOW = (1280, 1000)
LIVE_TAG = "nbval-ignore-output"
_BUILDS_VIEW = re.compile(r"\b(BlockPoolView|BlockTableView)\s*\(")
_NAMES_VIEW = re.compile(r"^\s*([A-Za-z_]\w*)\s*=\s*(?:\w+\.)*(?:BlockPoolView|BlockTableView)\s*\(", re.M)


class LiveCheckError(RuntimeError):
    """Something the check could not do (JupyterLab did not start, a cell raised...)."""


# ---------------------------------------------------------------- which cells are live


@dataclass(frozen=True)
class LiveCell:
    index: int  # position among all the notebook's cells, from 0
    kind: str  # BlockPoolView or BlockTableView
    name: str | None = None  # the variable it is bound to, if the cell binds it (`view = BlockPoolView(...)`)


def live_cells(notebook: dict) -> list[LiveCell]:
    """The cells that display a live view: code cells tagged ``nbval-ignore-output`` that build one.

    (Importing ``BlockPoolView`` is not building one: the name must be called.)
    """
    out = []
    for i, cell in enumerate(notebook.get("cells", [])):
        if cell.get("cell_type") != "code" or LIVE_TAG not in cell.get("metadata", {}).get("tags", []):
            continue
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        m = _BUILDS_VIEW.search(source)
        if m:
            named = _NAMES_VIEW.search(source)
            out.append(LiveCell(i, m.group(1), named.group(1) if named else None))
    return out


# ---------------------------------------------------------------- judging the record


@dataclass
class ViewRecord:
    cell: LiveCell
    states: list[dict]  # each: t, hash, length, ownDone, laterPending, kernel, executing
    finished_at: float | None  # when its own cell finished (s after the run started)
    shots: list[tuple[float, str]] = field(default_factory=list)
    redraws: int | None = None  # the view's own count of redraws, asked of the kernel after the run

    def changes_while_busy(self) -> list[dict]:
        """Changes of the picture after its cell finished, while a later cell ran and the kernel was busy.

        The first state is the view appearing, not a change.
        """
        return [s for s in self.states[1:]
                if s["ownDone"] and s["laterPending"] and s["kernel"] == "busy"]


def judge(views: list[ViewRecord], min_changes: int = 2) -> list[str]:
    """Why the record fails (empty: it passes). Only the first live view must change; all must render."""
    problems = []
    if not views:
        return ["no live view found (no cell tagged nbval-ignore-output builds a BlockPoolView/BlockTableView)"]
    for v in views:
        if not v.states:
            problems.append(f"the live view of cell {v.cell.index + 1} ({v.cell.kind}) never showed as a widget "
                            "(no .widget-html-content in its output: is jupyterlab_widgets installed?)")
    first = views[0]
    if first.states:
        n = len(first.changes_while_busy())
        if n < min_changes:
            problems.append(
                f"the first live view (cell {first.cell.index + 1}, {first.cell.kind}) changed {n} time(s) after "
                f"its cell finished while later cells ran and the kernel was busy; at least {min_changes} expected "
                f"({len(first.states)} distinct states in all)")
    return problems


def _span(states: list[dict]) -> str:
    if not states:
        return "none"
    cells = sorted({s["executing"] + 1 for s in states if s.get("executing") is not None})
    during = f", during cells {_ranges(cells)}" if cells else ""
    return f"{states[0]['t']:.2f}-{states[-1]['t']:.2f} s{during}"


def _ranges(nums: list[int]) -> str:
    parts, start = [], None
    for i, n in enumerate(nums):
        if start is None:
            start = n
        if i + 1 == len(nums) or nums[i + 1] != n + 1:
            parts.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ",".join(parts)


def describe(view: ViewRecord) -> str:
    busy = view.changes_while_busy()
    fin = f"{view.finished_at:.2f} s" if view.finished_at is not None else "never"
    redrawn = f"the kernel redrew it {view.redraws} times, " if view.redraws is not None else ""
    return (f"cell {view.cell.index + 1} ({view.cell.kind}): {redrawn}the page showed {len(view.states)} distinct states "
            f"({_span(view.states)}); its cell finished at {fin}; {len(busy)} changes after that while "
            f"later cells ran and the kernel was busy ({_span(busy)}); {len(view.shots)} screenshots during the run")


# ---------------------------------------------------------------- JupyterLab


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LAB_CONFIG = """\
c.ServerApp.ip = "127.0.0.1"
c.ServerApp.port = {port}
c.ServerApp.port_retries = 0
c.ServerApp.open_browser = False
c.ServerApp.root_dir = {root!r}
c.ServerApp.terminals_enabled = False
c.ServerApp.allow_remote_access = False
c.ServerApp.allow_root = True  # containers run as root; the server listens on 127.0.0.1 only
c.IdentityProvider.token = {token!r}
c.LabApp.expose_app_in_browser = True
c.LabApp.news_url = None
c.LabApp.check_for_updates_class = "jupyterlab.handlers.announcements.NeverCheckForUpdate"
"""

# Lab settings for this run only: every cell stays attached to the page (the
# observer watches the live cells wherever they are scrolled), nothing fetched
# from outside, no autosave of the copy.
_LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                        "checkForUpdates": False},
    "@jupyterlab/extensionmanager-extension/plugin.jupyterlab-settings": {"enabled": False},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
}


class Lab:
    """JupyterLab serving ``root`` on 127.0.0.1, started in its own process group."""

    def __init__(self, root: Path, home: Path, timeout: float = 90.0) -> None:
        self.root, self.home = Path(root), Path(home)
        self.port, self.token = _free_port(), secrets.token_hex(24)
        self.runtime = home / "runtime"
        env = dict(os.environ)
        for var, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
                         ("JUPYTER_RUNTIME_DIR", "runtime"), ("JUPYTERLAB_SETTINGS_DIR", "settings"),
                         ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"), ("IPYTHONDIR", "ipython")):
            (home / sub).mkdir(parents=True, exist_ok=True)
            env[var] = str(home / sub)
        env.pop("JUPYTER_TOKEN", None)
        env["JUPYTER_PLATFORM_DIRS"] = "0"
        (home / "config" / "jupyter_lab_config.py").write_text(
            _LAB_CONFIG.format(port=self.port, root=str(self.root), token=self.token))
        for rel, value in _LAB_SETTINGS.items():
            path = home / "settings" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value))
        self.log_path = home / "lab.log"
        self._log = open(self.log_path, "wb")
        jupyter = Path(sys.executable).with_name("jupyter")
        cmd = [str(jupyter), "lab"] if jupyter.exists() else [sys.executable, "-m", "jupyterlab"]
        self.proc = subprocess.Popen(cmd + ["--no-browser"], cwd=str(self.root), env=env, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait(timeout)
        except BaseException:  # not serving, or interrupted: stop what was started
            self.close()
            raise

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise LiveCheckError(f"JupyterLab exited with status {self.proc.returncode} before serving:\n"
                                     + self.log_tail())
            if time.monotonic() > deadline:
                raise LiveCheckError(f"JupyterLab did not answer on 127.0.0.1:{self.port} within {timeout:.0f} s:\n"
                                     + self.log_tail())
            try:
                self._api("GET", "/api/status", timeout=2)
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.3)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _api(self, method: str, path: str, timeout: float = 5):
        req = urllib.request.Request(self.base + path, method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read()

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + line for line in lines[-n:])

    def _kernel_pids(self) -> list[int]:
        """Our kernels: processes whose command line names a connection file in our runtime directory."""
        pids, mark = [], str(self.runtime).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if mark in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
        return pids

    def close(self) -> None:
        """Stop the server and its kernels: politely (the API), then by signal, by process id."""
        if self.proc.poll() is None:
            try:
                self._api("POST", "/api/shutdown", timeout=5)
            except (urllib.error.URLError, OSError):
                pass
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, sig)  # its own group (start_new_session)
                except ProcessLookupError:
                    pass
                try:
                    self.proc.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    pass
        # Kernels run in sessions of their own (jupyter_client starts them so).
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self._kernel_pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while pids and time.monotonic() < deadline:
                pids = [p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)]
                time.sleep(0.1)
            if not pids:
                break
        self._log.close()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


# ---------------------------------------------------------------- in the page

_OPEN_JS = r"""
(async (path) => {
  const app = window.jupyterapp;
  await app.started; await app.restored;
  for (const w of Array.from(app.shell.widgets('main'))) w.dispose();
  const panel = await app.commands.execute('docmanager:open', {path, factory: 'Notebook'});
  await panel.context.ready;
  await panel.sessionContext.ready;
  app.shell.activateById(panel.id);
  window.__pkv = {panel};
  return panel.content.widgets.length;
})(%s)
"""

_KERNEL_JS = r"""
(() => {
  const k = window.__pkv.panel.sessionContext.session?.kernel;
  return k ? [k.status, k.connectionStatus] : ['none', 'none'];
})()
"""

# Clear the outputs, watch the live cells, start Run All. Returns at once.
_START_JS = r"""
(async (live) => {
  const app = window.jupyterapp, W = window.__pkv, panel = W.panel;
  app.shell.activateById(panel.id);
  await app.commands.execute('notebook:clear-all-cell-outputs');
  const cells = panel.content.widgets;
  const kernel = () => panel.sessionContext.session?.kernel;
  const done = c => c.model.executionState !== 'running' && c.model.executionCount !== null;
  const hash = s => { let h = 5381; for (let i = 0; i < s.length; i++) h = (h * 33 + s.charCodeAt(i)) | 0; return (h >>> 0).toString(16); };
  W.live = live;
  W.states = live.map(() => []);
  W.finished = {};
  W.run = {done: false, error: null};
  const now = () => (performance.now() - W.t0) / 1000;
  cells.forEach((c, i) => {
    if (c.model.type !== 'code') return;
    c.model.stateChanged.connect((_, a) => {
      if (a.name === 'executionCount' && a.newValue !== null) W.finished[i] = now();
    });
  });
  const snap = () => {
    const t = now(), ks = (kernel() || {}).status || 'none';
    const running = [];
    cells.forEach((c, i) => { if (c.model.type === 'code' && c.model.executionState === 'running') running.push(i); });
    live.forEach((ci, k) => {
      const el = cells[ci].node.querySelector('.widget-html-content');
      if (!el) return;
      const html = el.innerHTML, list = W.states[k];
      if (!html || (list.length && list[list.length - 1].html === html)) return;
      list.push({t, html, hash: hash(html), length: html.length, ownDone: done(cells[ci]),
                 laterPending: running.some(i => i > ci), kernel: ks,
                 executing: running.length ? running[0] : null});
    });
  };
  W.observers = live.map(ci => {
    const o = new MutationObserver(snap);
    o.observe(cells[ci].node, {subtree: true, childList: true, characterData: true});
    return o;
  });
  W.t0 = performance.now();
  app.commands.execute('notebook:run-all-cells').then(
    r => { W.run.done = true; W.run.result = r; },
    e => { W.run.done = true; W.run.error = String(e); });
  return true;
})(%s)
"""

# How far the run is; and the first live view whose picture changed since its
# last screenshot (shotAt: the number of states then; -1: no more screenshots),
# scrolled into the middle of the notebook, with its box in the window.
_PROGRESS_JS = r"""
((shotAt) => {
  const W = window.__pkv, cells = W.panel.content.widgets;
  const running = cells.filter(c => c.model.type === 'code' && c.model.executionState === 'running').length;
  const k = W.panel.sessionContext.session?.kernel;
  const counts = W.states.map(s => s.length);
  let shot = null;
  for (let v = 0; v < counts.length && !shot; v++) {
    if (shotAt[v] < 0 || counts[v] <= shotAt[v]) continue;
    const el = cells[W.live[v]].node.querySelector('.widget-html');
    if (!el) continue;
    el.scrollIntoView({block: 'center'});
    const r = el.getBoundingClientRect();
    if (r.width > 0 && r.height > 0) shot = {view: v, count: counts[v], box: [r.left, r.top, r.width, r.height]};
  }
  return {counts, running, done: W.run.done, error: W.run.error, shot,
          kernel: k ? k.status : 'none', t: (performance.now() - W.t0) / 1000};
})(%s)
"""

_RESULT_JS = r"""
(() => {
  const W = window.__pkv, cells = W.panel.content.widgets;
  W.observers.forEach(o => o.disconnect());
  const errors = [], unrun = [];
  cells.forEach((c, i) => {
    if (c.model.type !== 'code') return;
    if (c.model.executionCount === null) unrun.push(i);
    for (const o of c.model.outputs.toJSON())
      if (o.output_type === 'error') errors.push([i, o.ename, o.evalue]);
  });
  return {states: W.states.map(l => l.map(({html, ...rest}) => rest)),
          finished: W.finished, errors, unrun, ncode: cells.filter(c => c.model.type === 'code').length,
          run: W.run, t: (performance.now() - W.t0) / 1000};
})()
"""

# The live view k: scrolled into the middle of the notebook; its box in the window.
_VIEW_BOX_JS = r"""
((k) => {
  const W = window.__pkv, cell = W.panel.content.widgets[W.live[k]];
  const el = cell.node.querySelector('.widget-html') || cell.node.querySelector('.jp-OutputArea');
  if (!el) return null;
  el.scrollIntoView({block: 'center'});
  const r = el.getBoundingClientRect();
  return r.width > 0 && r.height > 0 ? [r.left, r.top, r.width, r.height] : null;
})(%d)
"""

# Ask the kernel, after the run, how often each named view redrew itself.
_REDRAWS_JS = r"""
(async (names) => {
  const k = window.__pkv.panel.sessionContext.session?.kernel;
  if (!k) return '';
  const args = names.map(n => `getattr(globals().get(${JSON.stringify(n)}), 'redraws', None)`);
  let text = '';
  const future = k.requestExecute({code: `print(${args.join(', ')})`, silent: false, store_history: false});
  future.onIOPub = msg => { if (msg.header.msg_type === 'stream') text += msg.content.text; };
  await future.done;
  return text;
})(%s)
"""

# Draw state j of live view k, as the page recorded it during the run, in a
# box on top of JupyterLab (the same widget classes, so the same styles); its
# box in the window. k < 0: remove the box.
_STATE_JS = r"""
((k, j) => {
  let box = document.getElementById('pkv-state-box');
  if (k < 0) { if (box) box.remove(); return null; }
  if (!box) {
    box = document.createElement('div');
    box.id = 'pkv-state-box';
    box.style.cssText = 'position:fixed;left:0;top:0;z-index:100000;background:#fff;padding:6px 8px;'
                      + 'max-width:1200px;border:1px solid #ccc';
    document.body.appendChild(box);
  }
  const W = window.__pkv, s = W.states[k][j];
  const note = `live view in cell ${W.live[k] + 1}, state ${j + 1} of ${W.states[k].length}, at ${s.t.toFixed(2)} s`
             + (s.executing !== null ? `, cell ${s.executing + 1} executing` : '') + `, kernel ${s.kernel}`;
  box.innerHTML = '<div style="font:11px monospace;color:#666;margin-bottom:4px"></div>'
                + '<div class="lm-Widget jupyter-widgets widget-html"><div class="widget-html-content"></div></div>';
  box.firstChild.textContent = note;
  box.querySelector('.widget-html-content').innerHTML = s.html;
  const r = box.getBoundingClientRect();
  return [r.left, r.top, r.width, r.height];
})(%d, %d)
"""

_CLOSE_JS = r"""
(async () => {
  const W = window.__pkv;
  if (!W) return;
  try { await W.panel.sessionContext.shutdown(); } catch (e) {}
  W.panel.dispose();
  window.__pkv = null;
})()
"""


# ---------------------------------------------------------------- one notebook


@dataclass
class NotebookResult:
    notebook: str
    views: list[ViewRecord] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    code_cells: int = 0
    cells_run: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def _screenshot(browser: Browser, path: Path, box=None, same_as: str | None = None, pad: float = 4) -> bool:
    """Save a screenshot (of ``box`` and ``pad`` px around it, if given); not if it is file ``same_as``'s picture."""
    params = {"format": "png"}
    if box is not None:
        x, y, w, h = box
        params["clip"] = {"x": max(0.0, x - pad), "y": max(0.0, y - pad), "width": w + 2 * pad,
                          "height": h + 2 * pad, "scale": 1}
    shot = browser.send("Page.captureScreenshot", params, timeout=30)
    data = base64.b64decode(shot["data"])
    if same_as is not None and Path(same_as).read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return True


def check_notebook(browser: Browser, lab: Lab, rel: str, out: Path, deadline: float, min_changes: int = 2,
                   max_shots: int = 8, max_states: int = 100, log=print) -> NotebookResult:
    t_start = time.monotonic()
    result = NotebookResult(rel)
    live = live_cells(json.loads((lab.root / rel).read_text()))
    stem = Path(rel).stem
    if not live:
        result.problems.append("no live view found (no cell tagged nbval-ignore-output builds a "
                               "BlockPoolView/BlockTableView)")
        return result

    def left(doing: str) -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 1:
            raise LiveCheckError(f"{rel}: out of time (--timeout) while {doing}")
        return remaining

    browser.evaluate(_OPEN_JS % json.dumps(rel), timeout=min(90, left("opening the notebook")))
    while True:  # the kernel: started and idle
        status, conn = browser.evaluate(_KERNEL_JS)
        if status == "idle" and conn == "connected":
            break
        if status == "dead" or time.monotonic() - t_start > 120:
            raise LiveCheckError(f"{rel}: the kernel did not become ready (status {status}, {conn})")
        left(f"waiting for the kernel (status {status}, {conn})")
        time.sleep(0.2)
    log(f"{rel}: kernel ready after {time.monotonic() - t_start:.1f} s; running all cells "
        f"(live views in cells {', '.join(str(c.index + 1) for c in live)}, numbered from 1 with markdown)")
    browser.evaluate(_START_JS % json.dumps([c.index for c in live]), timeout=30)
    shots: list[list[tuple[float, str]]] = [[] for _ in live]
    timed_out = False
    shot_at = [0] * len(live)  # the number of states at the last screenshot; -1 once there are max_shots
    while True:
        p = browser.evaluate(_PROGRESS_JS % json.dumps(shot_at))
        if p["shot"]:
            k = p["shot"]["view"]
            path = out / f"{stem}-cell{live[k].index + 1:02d}-live{len(shots[k]) + 1:02d}.png"
            if _screenshot(browser, path, p["shot"]["box"], same_as=shots[k][-1][1] if shots[k] else None):
                shots[k].append((round(p["t"], 2), str(path)))
            shot_at[k] = p["shot"]["count"] if len(shots[k]) < max_shots else -1
            continue
        if p["done"] and p["running"] == 0:
            break
        if time.monotonic() > deadline:
            timed_out = True
            break
        time.sleep(0.05)
    time.sleep(0.5)  # the last messages
    res = browser.evaluate(_RESULT_JS, timeout=30)
    for k, cell in enumerate(live):  # every state the page went through, as recorded
        for j in range(len(res["states"][k]) if max_states else 0):
            if j == max_states:
                break
            box = browser.evaluate(_STATE_JS % (k, j))
            _screenshot(browser, out / f"{stem}-cell{cell.index + 1:02d}-state{j + 1:02d}.png", box, pad=0)
    browser.evaluate(_STATE_JS % (-1, 0))
    browser.evaluate(_VIEW_BOX_JS % 0)  # the first live view in the middle of the window
    _screenshot(browser, out / f"{stem}-final.png")
    result.seconds = res["t"]
    result.code_cells, result.cells_run = res["ncode"], res["ncode"] - len(res["unrun"])
    for k, cell in enumerate(live):
        fin = res["finished"].get(str(cell.index))
        result.views.append(ViewRecord(cell, res["states"][k], fin, shots[k]))
    for i, ename, evalue in res["errors"]:
        result.problems.append(f"cell {i + 1} raised {ename}: {evalue}")
    if res["run"].get("error"):
        result.problems.append(f"Run All failed: {res['run']['error']}")
    if timed_out:
        result.problems.append(f"out of time (--timeout): Run All had not finished after {res['t']:.0f} s, "
                               f"{len(res['unrun'])} of {res['ncode']} code cells had not run")
    elif res["unrun"] and not result.problems:
        result.problems.append(f"cells {_ranges([i + 1 for i in res['unrun']])} did not run")
    named = [v for v in result.views if v.cell.name]
    if named and not timed_out:  # (a busy kernel would answer only after the run)
        try:
            said = browser.evaluate(_REDRAWS_JS % json.dumps([v.cell.name for v in named]), timeout=20).split()
            for v, n in zip(named, said):
                v.redraws = int(n) if n.isdigit() else None
        except CDPError:
            pass
    if not result.problems:  # the views are judged on a complete run
        result.problems.extend(judge(result.views, min_changes))
    try:
        browser.evaluate(_CLOSE_JS, timeout=20)
    except CDPError:
        pass
    return result


# ---------------------------------------------------------------- the whole check


class _Timeout(Exception):
    pass


def _alarm(*_args):
    raise _Timeout()


def _terminate(signum, _frame):
    raise SystemExit(f"stopped by signal {signum}")


def run(notebooks=NOTEBOOKS, out: str | Path = "_build/live", timeout: float = 300, min_changes: int = 2,
        max_shots: int = 8, max_states: int = 100, log=print) -> list[NotebookResult]:
    """Run the check; return one result per notebook. Raises LiveCheckError when it cannot run at all."""
    binary = find_chromium()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.png"), out / "report.json"]:  # the last run's pictures, nothing else
        old.unlink(missing_ok=True)
    deadline = time.monotonic() + timeout
    home = Path(tempfile.mkdtemp(prefix="pagedkv-live-"))
    work = home / "book"
    rels = []
    for nb in notebooks:
        src = Path(nb) if Path(nb).is_absolute() else REPO / nb
        if not src.exists():
            raise LiveCheckError(f"no notebook {nb}")
        try:
            rel = str(src.resolve().relative_to(REPO))
        except ValueError:
            rel = src.name
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, work / rel)
        rels.append(rel)
    lab = browser = None
    results: list[NotebookResult] = []
    old_alarm = signal.signal(signal.SIGALRM, _alarm)
    old_term = signal.signal(signal.SIGTERM, _terminate)
    signal.alarm(int(timeout) + 60)  # a backstop: whatever hangs, the finally below still runs
    try:
        t0 = time.monotonic()
        lab = Lab(work, home)
        log(f"JupyterLab on 127.0.0.1:{lab.port} ({time.monotonic() - t0:.1f} s), serving a copy in {work}")
        browser = Browser(binary, window=WINDOW, timeout=60)
        browser.send("Emulation.setDeviceMetricsOverride", {"width": WINDOW[0], "height": WINDOW[1],
                                                            "deviceScaleFactor": 1, "mobile": False})
        browser.send("Page.navigate", {"url": f"{lab.base}/lab?reset&token={lab.token}"})
        while not browser.evaluate("!!(window.jupyterapp && document.querySelector('#jp-main-dock-panel'))"):
            if time.monotonic() > deadline:
                raise LiveCheckError(f"out of time (--timeout {timeout:.0f}) while JupyterLab loaded in Chromium")
            if time.monotonic() - t0 > 120:
                raise LiveCheckError("JupyterLab's page did not load in Chromium in 120 s (no window.jupyterapp)")
            time.sleep(0.3)
        browser.evaluate("(async () => { await window.jupyterapp.restored; })()", timeout=60)
        log(f"JupyterLab open in Chromium ({time.monotonic() - t0:.1f} s)")
        for rel in rels:
            res = check_notebook(browser, lab, rel, out, deadline, min_changes, max_shots, max_states, log)
            results.append(res)
            for v in res.views:
                log(f"  {describe(v)}")
            ran = f": {res.cells_run} of {res.code_cells} code cells ran, in {res.seconds:.1f} s" if res.code_cells else ""
            log(f"{'ok  ' if res.ok else 'FAIL'} {rel}{ran}" + "".join(f"\n     {p}" for p in res.problems))
            if time.monotonic() > deadline:
                for other in rels[len(results):]:
                    results.append(NotebookResult(other, problems=["not run: out of time (--timeout)"]))
                    log(f"FAIL {other}: not run, out of time")
                break
    except _Timeout:
        raise LiveCheckError(f"the check ran past its {timeout:.0f}-s limit") from None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old_alarm)
        signal.signal(signal.SIGTERM, old_term)
        if browser is not None:
            browser.close()
        if lab is not None:
            lab.close()
        shutil.rmtree(home, ignore_errors=True)
        _write_report(out, results)
    return results


def _write_report(out: Path, results: list[NotebookResult]) -> None:
    report = [{"notebook": r.notebook, "ok": r.ok, "problems": r.problems, "seconds": round(r.seconds, 2),
               "views": [{"cell": v.cell.index + 1, "kind": v.cell.kind, "finished_at": v.finished_at,
                          "redraws": v.redraws, "distinct_states": len(v.states), "changes_while_busy": len(v.changes_while_busy()),
                          "states": v.states, "screenshots": v.shots} for v in r.views]}
              for r in results]
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.live_check", description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", default=list(NOTEBOOKS))
    parser.add_argument("--out", default="_build/live", help="screenshots and report.json (the last run's are removed first)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for the whole check")
    parser.add_argument("--min-changes", type=int, default=2)
    parser.add_argument("--shots", type=int, default=8, help="screenshots of each live view during the run, at most")
    parser.add_argument("--states", type=int, default=100,
                        help="pictures of each live view's recorded states, after the run, at most")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    try:
        results = run(args.notebooks, args.out, args.timeout, args.min_changes, args.shots, args.states)
    except (LiveCheckError, CDPError) as exc:
        print(f"live check could not run: {exc}", file=sys.stderr)
        return 1
    failed = [r for r in results if not r.ok]
    print(f"{len(results)} notebooks in {time.monotonic() - t0:.0f} s; screenshots and report.json in {args.out}")
    for r in failed:
        for p in r.problems:
            print(f"  {r.notebook}: {p}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
