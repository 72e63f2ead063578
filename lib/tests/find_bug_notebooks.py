"""Notebook cells as modules, for the find-the-bug tests of exercise 7.

Not a test module: ``test_checks_ch07_find_bug`` and
``test_checks_ch07b_find_bug`` import it. The buggy kernels and their
wrappers they test are the ones the exercise notebooks build, the fixes the
ones the solution notebooks show, read from the notebooks' own cells so no
copy can drift from them. A plausible first attempt is a fix or a report a
newcomer writes before stepping through the kernel, and each must fail with
a line naming what it got wrong.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

import pagedkv  # noqa: F401  -- fixes the Triton mode before the notebooks' kernels are defined

ROOT = Path(__file__).resolve().parents[2]


def cell(notebook: str, marker: str) -> str:
    """The source of the first code cell of ``notebook`` (from the repository root) holding ``marker``."""
    cells = json.loads((ROOT / notebook).read_text())["cells"]
    return next("".join(c["source"]) for c in cells
                if c["cell_type"] == "code" and marker in "".join(c["source"]))


def module(src: str, tag: str):
    """``src`` imported as a module from a file of its own, after the imports a notebook has made.

    Triton's ``@jit`` reads a kernel's source from its file, so the cells are
    written out rather than exec'd; ``tag`` keeps two variants' modules apart.
    """
    path = Path(tempfile.mkdtemp()) / f"_find_bug_{tag}.py"
    path.write_text("import torch\nimport triton\nimport triton.language as tl\n\n" + src + "\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def failures(report) -> dict:
    """A check report's failed lines, name -> detail."""
    return {r.name: r.detail for r in report.results if not r.passed}
