"""The import rule of the library (tools/import_rules.py), on the real package and on broken ones."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from tools import import_rules

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "lib" / "pagedkv"


def test_the_library_keeps_its_import_rule():
    problems = import_rules.violations(PACKAGE)
    assert not problems, "the import rule is broken:\n" + "\n".join(problems)


def test_the_rule_reads_every_import():
    # a sanity floor: if the reader silently found nothing, the test above would pass vacuously
    edges = import_rules.edges(PACKAGE)
    assert len(edges) > 100
    pairs = {(e.source, e.target) for e in edges}
    assert ("pagedkv.kv_cache_manager", "pagedkv.block_pool") in pairs
    # an import inside a function counts too
    assert any(not e.module_level and e.source == "pagedkv.block_table" for e in edges)


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pagedkv"
    base = {"__init__.py": "", "common.py": "", "budget.py": "", "block_pool.py": "",
            "kernels/__init__.py": "", "engine/__init__.py": "", "engine/llm_engine.py": "",
            "sim/__init__.py": "", "views/__init__.py": "", "views/widgets.py": "",
            "checks/__init__.py": "", "checks/_harness.py": "", "bench/__init__.py": ""}
    for name, text in {**base, **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_a_clean_fake_package_passes(tmp_path):
    root = _package(tmp_path, {"block_pool.py": "from .common import cdiv\n",
                               "views/widgets.py": "from ..block_pool import BlockPool\n",
                               "checks/ch01.py": "from ._harness import Checker\n"})
    assert import_rules.violations(root) == []


@pytest.mark.parametrize("files,expected", [
    ({"engine/llm_engine.py": "from ..views import widgets\n"},
     "core imports views: pagedkv.engine.llm_engine -> pagedkv.views.widgets"),
    ({"block_pool.py": "def f():\n    from pagedkv.checks import ch01\n", "checks/ch01.py": ""},
     "core imports checks: pagedkv.block_pool -> pagedkv.checks.ch01"),
    ({"sim/waste.py": "from ..views.widgets import render\n"},
     "sim imports views: pagedkv.sim.waste -> pagedkv.views.widgets (render)"),
    ({"views/widgets.py": "from ..bench import timing\n", "bench/timing.py": ""},
     "views imports bench: pagedkv.views.widgets -> pagedkv.bench.timing"),
    ({"checks/ch01.py": "import tools.notebooks\n"},
     "checks imports tools: pagedkv.checks.ch01 -> tools.notebooks"),
    ({"budget.py": "from .block_pool import BlockPool\n"},
     "core layer order: pagedkv.budget -> pagedkv.block_pool (BlockPool), line 1 (layer 3"),
    ({"block_pool.py": "from .budget import _secret\n"},
     "imports underscore names _secret: pagedkv.block_pool -> pagedkv.budget"),
    ({"views/widgets.py": "from ..checks._harness import Checker\n"},
     "imports a private module from outside pagedkv.checks: pagedkv.views.widgets -> pagedkv.checks._harness"),
    ({"sim/a.py": "from . import b\n", "sim/b.py": "from .a import x\n"},
     "import cycle: pagedkv.sim.a -> pagedkv.sim.b -> pagedkv.sim.a"),
])
def test_an_injected_violation_is_named(tmp_path, files, expected):
    problems = import_rules.violations(_package(tmp_path, files))
    assert any(p.startswith(expected) for p in problems), problems


def test_a_cycle_through_type_checking_or_a_function_is_not_a_cycle(tmp_path):
    root = _package(tmp_path, {
        "sim/a.py": "from . import b\n",
        "sim/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n"
                    "def f():\n    from .a import y\n",
    })
    assert import_rules.violations(root) == []


def test_the_command_prints_the_edge_and_fails(tmp_path, capsys):
    root = _package(tmp_path, {"engine/llm_engine.py": "from ..views import widgets\n"})
    assert import_rules.main([str(root)]) == 1
    out = capsys.readouterr().out
    assert "core imports views: pagedkv.engine.llm_engine -> pagedkv.views.widgets, line 1" in out
    assert import_rules.main([str(PACKAGE)]) == 0


def _notebook_imports(path: Path) -> list[tuple[str, bool]]:
    """(module, measured) for every pagedkv import of a notebook; measured: the cell's output is the device's."""
    found = []
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            measured = "nbval-ignore-output" in cell["metadata"].get("tags", [])
            for m in re.findall(r"(?:from|import)\s+(pagedkv(?:\.\w+)*)", "".join(cell["source"])):
                found.append((m, measured))
    return found


@pytest.mark.parametrize("path", sorted((REPO / "chapters").glob("*.ipynb")), ids=lambda p: p.name)
def test_chapters_import_teaching_code_from_the_core_sim_and_views(path):
    """Never a checker; a benchmark only in a measurement cell (tagged nbval-ignore-output)."""
    wrong = sorted({m for m, measured in _notebook_imports(path)
                    if import_rules.room(m) == "checks" or (import_rules.room(m) == "bench" and not measured)})
    assert not wrong, f"{path.name} imports {wrong}: chapters take teaching code from the core, sim and views"
