"""The library's import rule, read from the source (every import, including those inside functions).

    python -m tools.import_rules [lib/pagedkv]    print each offending edge; exit 1 if any

The package is a core with rooms around it (``lib/pagedkv/__init__.py`` draws
it). What may import what:

* the core never imports ``sim``, ``views``, ``checks``, ``bench`` or ``tools``;
  inside the core each module imports only layers below its own (``LAYERS``);
* ``sim`` imports the core only; ``views`` never imports ``checks`` or
  ``bench``; nothing in the package imports ``tools``;
* no module imports another module's underscore names (a shared helper gets a
  public home); an underscore *module* (``_device``, ``checks/_harness``) may be
  imported only from inside the package that holds it;
* no import cycles among module-level imports.

Imports under ``if TYPE_CHECKING:`` count for the room rules (they still say
which way knowledge flows) but not for cycles (they never run).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOMS = ("sim", "views", "checks", "bench")

# What each room may not import (tools is outside the package and refused everywhere).
FORBIDDEN = {
    "core": {"sim", "views", "checks", "bench", "tools"},
    "sim": {"views", "checks", "bench", "tools"},
    "views": {"checks", "bench", "tools"},
    "checks": {"tools"},
    "bench": {"tools"},
}

# The core, bottom to top: a module imports only modules of a lower layer (or
# its own package's siblings, for the packages kernels, model and engine).
LAYERS = [
    {"_device", "common"},
    {"specs", "kv_cache_spec"},
    {"kv_cache_planning"},
    {"budget", "hashing"},
    {"server_log", "non_kv_estimate", "free_queue", "pool_events", "request"},
    {"block_pool", "step_tokens"},
    {"single_type_managers"},
    {"mamba_manager"},
    {"kv_cache_coordinator"},
    {"kv_cache_manager", "token_pool", "radix_cache"},
    {"grouped_kv_cache_manager"},
    {"kernels"},
    {"request_state", "staged_write"},
    {"block_table", "block_tables"},
    {"model"},
    {"engine"},
]


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, dotted
    target: str  # imported module, dotted
    names: tuple[str, ...]  # names taken from it (empty for `import x`)
    line: int
    module_level: bool  # runs at import time (not in a function, not TYPE_CHECKING)

    def __str__(self) -> str:
        what = f" ({', '.join(self.names)})" if self.names else ""
        return f"{self.source} -> {self.target}{what}, line {self.line}"


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package at ``root``."""
    package = root.name
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(source: str, is_package: bool, level: int, module: str | None) -> str:
    if not level:
        return module or ""
    base = source.split(".")
    if not is_package:
        base.pop()
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


class _Collector(ast.NodeVisitor):
    def __init__(self) -> None:
        self.found: list[tuple[int, int, str | None, tuple[str, ...], bool]] = []
        self._depth = 0  # inside a function, or under TYPE_CHECKING

    def _nested(self, node) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _nested

    def visit_If(self, node: ast.If) -> None:
        test = ast.unparse(node.test)
        if test in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            self._nested(node)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((node.lineno, 0, alias.name, (), self._depth == 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        names = tuple(a.name for a in node.names)
        self.found.append((node.lineno, node.level, node.module, names, self._depth == 0))


def edges(root: Path) -> list[Edge]:
    """Every import inside the package at ``root`` that names the package (or ``tools``)."""
    mods = modules(root)
    package = root.name
    out = []
    for source, path in mods.items():
        collector = _Collector()
        collector.visit(ast.parse(path.read_text(), str(path)))
        for line, level, module, names, top in collector.found:
            target = _resolve(source, path.name == "__init__.py", level, module)
            if not (target == package or target.startswith(package + ".") or target.split(".")[0] == "tools"):
                continue
            # `from pkg import submodule` is an import of the submodule
            plain = [n for n in names if f"{target}.{n}" not in mods]
            for n in names:
                if f"{target}.{n}" in mods:
                    out.append(Edge(source, f"{target}.{n}", (), line, top))
            if plain or not names:
                out.append(Edge(source, target, tuple(plain), line, top))
    return out


def room(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "tools":
        return "tools"
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else "core"


def layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package itself: its __init__ only loads submodules lazily
    for i, names in enumerate(LAYERS):
        if parts[1] in names:
            return i
    return None


def violations(root: Path) -> list[str]:
    """Every broken rule, one line each, naming the edge."""
    problems = []
    all_edges = edges(root)
    for e in all_edges:
        src_room, dst_room = room(e.source), room(e.target)
        if dst_room in FORBIDDEN[src_room]:
            problems.append(f"{src_room} imports {dst_room}: {e}")
        if src_room == dst_room == "core":
            a, b = layer(e.source), layer(e.target)
            same_package = e.source.split(".")[:2] == e.target.split(".")[:2]
            if a is not None and b is not None and b >= a and not same_package:
                problems.append(f"core layer order: {e} (layer {a} may import only layers below it)")
        private = [n for n in e.names if n.startswith("_") and not n.startswith("__")]
        if private:
            problems.append(f"imports underscore names {', '.join(private)}: {e}")
        parts = e.target.split(".")
        for i, part in enumerate(parts):
            if part.startswith("_") and not part.startswith("__"):
                home = ".".join(parts[:i])  # the package that holds the private module
                if not (e.source == home or e.source.startswith(home + ".")):
                    problems.append(f"imports a private module from outside {home}: {e}")
                break
    problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(all_edges)]
    return problems


def cycles(all_edges: list[Edge]) -> list[list[str]]:
    """Cycles among module-level imports (each reported once, from its smallest member)."""
    graph: dict[str, set[str]] = {}
    for e in all_edges:
        if e.module_level and e.source != e.target and not e.target.startswith(e.source + "."):
            graph.setdefault(e.source, set()).add(e.target)
    found, seen = [], set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == path[0]:
                cycle = path + [nxt]
                key = frozenset(cycle)
                if key not in seen and min(cycle) == path[0]:
                    seen.add(key)
                    found.append(cycle)
            elif nxt not in path and nxt > path[0]:
                walk(nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, [start])
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else "lib/pagedkv")
    problems = violations(root)
    for p in problems:
        print(p)
    print(f"import rules: {len(edges(root))} imports read, {len(problems)} broken")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
