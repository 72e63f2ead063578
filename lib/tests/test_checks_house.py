"""The checks package's house rules: no module reads the package it sits in
while that package is importing it, and no module passes 600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

CHECKS = Path(__file__).resolve().parents[1] / "pagedkv" / "checks"


def _module_level_imports(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            yield node


def test_no_checks_module_imports_its_own_package():
    # ``from . import x`` reads pagedkv.checks itself, which its __init__ is
    # still building when it imports the module: an import cycle.
    found = []
    for path in sorted(CHECKS.glob("*.py")):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text(), path.name)
        for node in _module_level_imports(tree):
            if node.level == 1 and node.module is None:
                found.append(f"{path.name}:{node.lineno}: from . import "
                             + ", ".join(a.name for a in node.names))
    assert not found, "\n".join(found)


def test_every_checks_module_is_at_most_600_lines():
    long = {p.name: n for p in sorted(CHECKS.glob("*.py"))
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long
