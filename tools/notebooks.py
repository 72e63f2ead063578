"""Execute, normalise and audit the book's notebooks.

    python -m tools.notebooks execute NB...   execute in place (what `make execute` runs)
    python -m tools.notebooks normalise NB... apply the normalisation below without executing
    python -m tools.notebooks check-toc       every notebook is listed in _toc.yml
    python -m tools.notebooks check-site      the built site loads no script from a network
    python -m tools.notebooks run-plain NB... execute code cells without Jupyter and compare
                                                 printed text with the committed outputs

Conventions the tools enforce (authors: build cells with nbformat, then run ``execute``):

* Outputs are committed and must be identical on any machine except in cells
  tagged ``nbval-ignore-output`` (device, clock, live views).
* After execution each cell gets a stable id, timing metadata is dropped and the
  live-widget part of an output (``application/vnd.jupyter.widget-view+json``,
  whose model id is random and whose model is gone once the kernel stops) is
  removed, so the committed output keeps its static ``text/html`` rendering.
  Re-running the cell in JupyterLab shows the live widget again.
* Cells that are meant to raise carry the tag ``raises-exception``.
* Never rely on a trailing ``;`` to hide a cell's value: nbval executes cells
  without storing history, so IPython checks the wrong cell for the ``;`` and
  the value appears anyway. Assign it, or give the object an
  ``_ipython_display_`` that shows nothing (``CheckReport`` does).

``run-plain`` exists for machines that have torch and Triton but no Jupyter (a
bare GPU instance): it runs each notebook's code cells in one namespace, feeds
``display()`` and the last expression through plain ``repr``, and compares the
``stream`` text of every un-ignored cell with the committed one.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import linecache
import os
import re
import sys
from pathlib import Path

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
NOTEBOOK_DIRS = ("chapters", "exercises", "solutions")


def _repo_root() -> Path:
    """The book's root: the nearest parent holding _toc.yml (the library lives in lib/)."""
    for parent in [Path.cwd(), *Path.cwd().parents]:
        if (parent / "_toc.yml").exists():
            return parent
    raise SystemExit("no _toc.yml found in this directory or its parents: run from the book's root")


# An absolute path in a traceback names the machine that ran it. Keep the part a
# reader can use: "pagedkv/budget.py", "<python>/site-packages/torch/...".
_PAGEDKV_PATH = re.compile(r"(?:[A-Za-z]:)?[/\\][^\s:'\"]*?[/\\](pagedkv[/\\])")
_PYTHON_PATH = re.compile(r"(?:[A-Za-z]:)?[/\\][^\s:'\"]*?[/\\](site-packages|lib[/\\]python3\.\d+)[/\\]")
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|tmp|root|home|Users|opt|usr)/[\w.-]+")


def scrub_paths(text: str) -> str:
    """Replace machine-specific path prefixes in traceback text."""
    text = _PAGEDKV_PATH.sub(r"\1", text)
    return _PYTHON_PATH.sub(r"<python>/\1/", text)


def _merge_streams(outputs: list) -> list:
    """Join consecutive stdout (or stderr) chunks: how a kernel splits a print into
    messages depends on timing, and must not show up as a diff on re-execution."""
    merged: list = []
    for out in outputs:
        prev = merged[-1] if merged else None
        if (out.get("output_type") == "stream" and prev is not None and prev.get("output_type") == "stream"
                and prev.get("name") == out.get("name")):
            prev["text"] = "".join(prev["text"]) + "".join(out["text"])
        else:
            merged.append(out)
    return merged


def normalise(nb) -> None:
    """Make a freshly executed notebook stable under re-execution (see module docstring)."""
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"c{i:03d}"
        cell.metadata.pop("execution", None)
        if "outputs" in cell:
            cell["outputs"] = _merge_streams(cell["outputs"])
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                out["traceback"] = [scrub_paths(line) for line in out.get("traceback", [])]
            data = out.get("data")
            if data and WIDGET_VIEW in data:
                del data[WIDGET_VIEW]
                if "text/plain" in data and "text/html" in data:
                    # The widget's plain repr names an object, not a result.
                    data["text/plain"] = "[live view: run this cell in JupyterLab]"
    nb.metadata.pop("widgets", None)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}


def execute(paths: list[str], timeout: int = 900) -> None:
    import nbformat
    from nbclient import NotebookClient

    for path in map(Path, paths):
        nb = nbformat.read(path, as_version=4)
        print(f"executing {path} ...", flush=True)
        client = NotebookClient(
            nb,
            timeout=timeout,
            kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}},
            record_timing=False,
            store_widget_state=False,
        )
        client.execute()
        normalise(nb)
        nbformat.write(nb, path)


def check_toc() -> int:
    """Fail when a notebook in chapters/, exercises/ or solutions/ is missing from _toc.yml,
    or when a notebook names a path of the machine that executed it."""
    root = _repo_root()
    leaks = []
    for d in NOTEBOOK_DIRS:
        for nb in sorted((root / d).glob("*.ipynb")):
            found = MACHINE_PATH.search(nb.read_text())
            if found:
                leaks.append(f"{d}/{nb.name} ({found.group(0)})")
    if leaks:
        print("notebooks naming a machine path: " + ", ".join(leaks), file=sys.stderr)
        return 1
    toc = (root / "_toc.yml").read_text()
    listed = set(re.findall(r"file:\s*([\w./-]+)", toc))
    missing = []
    for d in NOTEBOOK_DIRS:
        for nb in sorted((root / d).glob("*.ipynb")):
            stem = f"{d}/{nb.stem}"
            if stem not in listed and f"{stem}.ipynb" not in listed:
                missing.append(f"{d}/{nb.name}")
    if missing:
        print("notebooks missing from _toc.yml: " + ", ".join(missing), file=sys.stderr)
        return 1
    print(f"_toc.yml lists every notebook in {', '.join(NOTEBOOK_DIRS)}")
    return 0


@contextlib.contextmanager
def _chdir(path: Path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def check_site(html_dir: str = "_build/html") -> int:
    """Fail when a built page loads a script from the network (CDN MathJax, widget managers...).

    The site must read complete with no kernel and no network: widgets and
    replays carry their own inline rendering, and prose uses no TeX math.
    """
    root = _repo_root() / html_dir
    pages = sorted(root.rglob("*.html"))
    if not pages:
        print(f"no pages under {html_dir}: build the book first", file=sys.stderr)
        return 1
    remote = re.compile(r"<script[^>]*\bsrc=[\"'](?:https?:)?//", re.IGNORECASE)
    offenders = [str(p.relative_to(root)) for p in pages if remote.search(p.read_text(errors="replace"))]
    if offenders:
        print("pages that load scripts from the network: " + ", ".join(offenders), file=sys.stderr)
        return 1
    # An inline script emitted twice that declares a `const` or `let` throws "has
    # already been declared" (Sphinx 7 emits scripts registered after the builder
    # starts twice; a repeated `var` is harmless and is not counted).
    inline = re.compile(r"<script>(.*?)</script>", re.DOTALL)
    declares = re.compile(r"^\s*(?:const|let)\s", re.MULTILINE)
    for p in pages:
        bodies = [b.strip() for b in inline.findall(p.read_text(errors="replace")) if declares.search(b)]
        twice = sorted({b for b in bodies if bodies.count(b) > 1})
        if twice:
            print(f"{p.relative_to(root)} declares one inline script's constants twice: {twice[0][:80]}", file=sys.stderr)
            return 1
    print(f"{len(pages)} pages, none loads a script from the network or declares a script constant twice")
    return 0


def _python_only(source: str) -> str:
    """A cell's source without IPython's magics and shell lines."""
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))


def run_cell(source: str, ns: dict, filename: str = "<cell>") -> None:
    """Exec a cell like IPython would: the value of a trailing expression is displayed.

    The source is registered in ``linecache`` under ``filename`` (give each
    cell its own), as IPython does: ``inspect.getsource`` then finds a cell's
    functions, which compiled ``@triton.jit`` needs ("@jit functions should be
    defined in a Python file"; the interpreter does not ask) and tracebacks show.
    """
    source = _python_only(source)
    # mtime None: linecache.checkcache keeps the entry although no such file exists.
    linecache.cache[filename] = (len(source), None, (source + "\n").splitlines(keepends=True), filename)
    tree = ast.parse(source, filename)
    last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    if last is not None:
        tree.body.pop()
    exec(compile(tree, filename, "exec"), ns)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), filename, "eval"), ns)
        if value is not None:
            print(repr(value))


def cell_filename(path: Path, index: int) -> str:
    """The name a notebook cell's code runs under: unique per cell, no machine path."""
    return f"<{path.parent.name}/{path.name} cell {index}>"


JUPYTER_ONLY = ("ipywidgets", "IPython", "nbformat", "nbclient")


def _install_ipython_shim() -> None:
    """Make ``IPython.display.display`` a no-op; give notebooks a stand-in where IPython is missing.

    With IPython installed but no kernel, ``display`` would print each object's
    repr into the text being compared; in a notebook it prints nothing there.
    """
    try:
        import IPython.display

        IPython.display.display = lambda *a, **k: None
        return
    except ImportError:
        pass
    import types

    ipython = types.ModuleType("IPython")
    display_mod = types.ModuleType("IPython.display")
    display_mod.display = lambda *a, **k: None
    for name in ("HTML", "Markdown", "SVG", "Image"):
        setattr(display_mod, name, lambda data=None, **k: data)
    ipython.display = display_mod
    ipython.get_ipython = lambda: None
    ipython.version_info = (0, 0, 0)  # matplotlib looks; an old version means "no IPython hooks"
    sys.modules.setdefault("IPython", ipython)
    sys.modules.setdefault("IPython.display", display_mod)


# Cells that compare with an implementation nobody here wrote need it installed;
# a bare GPU machine may lack it. nbval runs these cells on every CPU run.
REFERENCE_ONLY = ("transformers",)


# A notebook marks what a cell needs beyond the book's requirements with a guard
# name it computes itself: chapter 8's real-model cells run under `if HAVE_MODEL:`
# (SmolLM2, a package a bare GPU machine lacks and cannot download). Where the
# guard is false, the cell prints nothing of what was committed with the model:
# run-plain skips it and says so, instead of reporting a difference.
GUARDS = ("HAVE_MODEL",)


def unmet_guard(source: str, ns: dict) -> str | None:
    """The first guard name the cell reads that is false in the notebook's namespace, if any."""
    try:
        names = {n.id for n in ast.walk(ast.parse(_python_only(source))) if isinstance(n, ast.Name)}
    except SyntaxError:
        return None  # running the cell reports it
    return next((g for g in GUARDS if g in names and g in ns and not ns[g]), None)


def _needs_jupyter(exc: BaseException) -> bool:
    return isinstance(exc, ImportError) and any(name in str(exc) for name in JUPYTER_ONLY)


def _needs_reference(exc: BaseException) -> bool:
    return isinstance(exc, ImportError) and any(f"'{name}'" in str(exc) for name in REFERENCE_ONLY)


def run_plain(paths: list[str]) -> int:
    import json

    os.environ.setdefault("MPLBACKEND", "Agg")  # figures are drawn, never shown
    _install_ipython_shim()
    total_failures = 0
    for path in map(Path, paths):
        failures = 0
        nb = json.loads(path.read_text())
        ns: dict = {"__name__": "__main__", "display": lambda *a, **k: None}
        with _chdir(path.parent):
            for i, cell in enumerate(nb["cells"]):
                if cell["cell_type"] != "code":
                    continue
                tags = cell.get("metadata", {}).get("tags", [])
                src = "".join(cell["source"])
                guard = unmet_guard(src, ns)
                if guard:
                    print(f"skip {path} cell {i}: {guard} is false here (it needs a package this machine lacks)")
                    continue
                buf = io.StringIO()
                try:
                    with contextlib.redirect_stdout(buf):
                        run_cell(src, ns, cell_filename(path, i))
                except Exception as exc:  # noqa: BLE001
                    if "nbval-ignore-output" in tags and _needs_jupyter(exc):
                        print(f"skip {path} cell {i}: a live view, needs Jupyter ({exc})")
                        continue
                    if _needs_reference(exc):
                        print(f"skip {path} cell {i}: a comparison with a package this machine lacks ({exc})")
                        continue
                    if "raises-exception" not in tags:
                        print(f"FAIL {path} cell {i}: raised {type(exc).__name__}: {exc}")
                        failures += 1
                        break
                if "nbval-ignore-output" in tags:
                    continue
                want = "".join(
                    "".join(o.get("text", "")) for o in cell.get("outputs", []) if o["output_type"] == "stream"
                    and o.get("name") == "stdout"
                )
                got = buf.getvalue()
                if want and want.strip() not in got:
                    print(f"FAIL {path} cell {i}: printed text differs from the committed output")
                    failures += 1
        print(f"{'ok  ' if not failures else 'FAIL'} {path}")
        total_failures += failures
    return 1 if total_failures else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.notebooks")
    sub = parser.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("execute")
    ex.add_argument("paths", nargs="+")
    nm = sub.add_parser("normalise")
    nm.add_argument("paths", nargs="+")
    sub.add_parser("check-toc")
    sub.add_parser("check-site")
    rp = sub.add_parser("run-plain")
    rp.add_argument("paths", nargs="+")
    args = parser.parse_args(argv)
    if args.cmd == "execute":
        execute(args.paths)
        return 0
    if args.cmd == "normalise":
        import nbformat

        for path in args.paths:
            nb = nbformat.read(path, as_version=4)
            normalise(nb)
            nbformat.write(nb, path)
        return 0
    if args.cmd == "check-toc":
        return check_toc()
    if args.cmd == "check-site":
        return check_site()
    return run_plain(args.paths)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def load_cell_function(notebook: str | Path, name: str):
    """Import the code cell of ``notebook`` that defines ``name`` and return ``name``.

    The tests of the exercise checkers run the committed solutions this way,
    so the solution the site shows is the one that is tested. The cell is
    written to a temporary module file and imported, because ``@triton.jit``
    reads its function's source from a file.
    """
    import importlib.util
    import json
    import tempfile

    cells = json.loads(Path(notebook).read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    src = next((s for s in sources if f"def {name}(" in s), None)
    if src is None:
        raise LookupError(f"no code cell of {notebook} defines {name}")
    module_name = f"_cell_{Path(notebook).stem}_{name}"
    path = Path(tempfile.mkdtemp()) / f"{module_name}.py"
    path.write_text("import torch\nimport triton\nimport triton.language as tl\n\n" + src + "\n")
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)
