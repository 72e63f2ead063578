"""Check the version matrix, and the operator's page's citations, against the releases' wheels.

    python -m tools.versions --check     every cell of book/version_matrix.json, and the vLLM and
                                         SGLang links of the book's notebooks outside chapters/ (book/*.ipynb)
    python -m tools.versions --table     the matrix as text: each claim, its value per release, where it changed

**The matrix** (``book/version_matrix.json``) says, for each claim the book
makes about vLLM 0.33.0's defaults, log lines, metric names, flags and
allocator, what earlier releases did. A cell is one release's value with its
source: a file of the ``vllm`` package, a line range, a name in those lines
(a code name, or a quoted fragment with ``"quoted": true``), and optionally
``evidence`` (code that must be in the cited lines: the value itself, as
written there) and ``absent`` (text that must be nowhere in the file: what
the release does not have yet). The page renders it with
``pagedkv.views.operator.version_table``, each value a link to its lines at
that release's tag; ``changed_in`` names the release where a value changed
when the matrix reads two consecutive releases (``pypi_order``), and "between"
the two releases around the change otherwise.

**The wheels** are read as ``tools.citations`` reads 0.33.0's: from the zip,
never unpacked, never installed, in the same cache
(``tools.citations.cache_dir``). A release whose whole wheel is not there is
read member by member over HTTP range requests (``tools.wheel_members``):
its file list and the files its cells cite, a few MB a release, kept under
``members/``; pip downloads the whole wheel only where that fails. Older wheels carry other platform tags, so
the matrix records each release's (``platforms``). Without a wheel and
without a network the check is skipped (exit 0), except under ``CI=true``
(exit 1), like the citation check.

**The page's citations**: ``tools.citations`` reads ``book/*.md`` but not
notebooks in ``book/``, so ``--check`` runs its check on ``book/*.ipynb``
too, against the 0.33.0 and 0.5.23 wheels.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import zipfile
from pathlib import Path

from tools import citations, wheel_members

ROOT = Path(__file__).resolve().parents[1]
MATRIX = ROOT / "book" / "version_matrix.json"
PAGE_GLOB = "book/*.ipynb"


def load_matrix(path: Path = MATRIX) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def release(version: str, platform: str | None = None) -> citations.Release:
    """vLLM at ``version``, fetched for ``platform`` (the platform tag its wheel carries)."""
    pip_platform = ("--platform", platform) if platform else citations.VLLM.pip_platform
    return dataclasses.replace(citations.VLLM, version=version, pip_platform=pip_platform)


def open_wheel(version: str, platform: str | None = None, download: bool = True) -> citations.Wheel | str:
    """One release's wheel, or why there is none: a whole wheel already in the cache;
    else the members this run reads, fetched by range requests and kept
    (``tools.wheel_members``: a few MB a release, not the 340 MB wheel); else, where
    the index or server allows no range requests, the whole wheel downloaded by pip."""
    r = release(version, platform)
    directory = citations.cache_dir()
    found = citations.cached_wheel(directory, r)
    if found is None:
        try:
            return wheel_members.open_member_wheel(r.package, version, platform or r.pip_platform[-1],
                                                   download=download, cache=directory)
        except wheel_members.MemberFetchError as why:
            if not download:
                return f"no {r.label} wheel in {directory} (not downloaded)"
            print(f"versions: {why}; downloading the whole wheel instead", file=sys.stderr)
        found = citations.download_wheel(directory, r)
    if found is None:
        return f"no {r.label} wheel in {directory}"
    try:
        return citations.Wheel(found, r.package)
    except zipfile.BadZipFile:
        return f"{found} is not a readable wheel: delete it and run again"


def releases_of(matrix: dict) -> list[str]:
    return sorted({c["release"] for row in matrix["rows"] for c in row["cells"]},
                  key=lambda v: tuple(int(p) for p in v.split(".")))


def check_cell(cell: dict, wheel: citations.Wheel, where: str) -> list[str]:
    """What is wrong with one cell, read from its release's wheel (empty: it holds)."""
    text = citations.Text(where, "")
    cite = citations.Citation(text, 0, 0, cell["path"], cell["first"], cell["last"], name=cell["name"],
                              quoted=bool(cell.get("quoted")), release=release(cell["release"]), link=True)
    problem = citations.check_citation(cite, wheel)
    if problem:
        return [problem]
    lines = wheel.lines(cell["path"])
    lo, hi = max(1, cell["first"] - citations.SLACK), min(len(lines), cell["last"] + citations.SLACK)
    problems = []
    if "evidence" in cell and not citations.occurs(cell["evidence"], False, lines[lo - 1:hi]):
        problems.append(f"{where}: `{cell['evidence']}` is not in lines {cell['first']}-{cell['last']} of "
                        f"`{cell['path']}` in {cell['release']}")
    if "absent" in cell and cell["absent"] in "\n".join(lines):
        at = next(i + 1 for i, line in enumerate(lines) if cell["absent"] in line)
        problems.append(f"{where}: {cell['absent']!r} is in `{cell['path']}` of {cell['release']} "
                        f"(line {at}): the cell says it is not there yet")
    return problems


def check_matrix(matrix: dict, wheels: dict[str, citations.Wheel]) -> list[str]:
    """Every problem of the matrix: its form, then each cell against its wheel (releases without one skipped)."""
    problems = []
    order = matrix["pypi_order"]
    for i, row in enumerate(matrix["rows"]):
        label = f"{MATRIX.name}, row {i + 1} ({row['claim']})"
        versions = [c["release"] for c in row["cells"]]
        for v in versions:
            if v not in order:
                problems.append(f"{label}: release {v} is not in pypi_order")
            if v not in matrix["platforms"]:
                problems.append(f"{label}: release {v} has no platform tag in platforms")
        if any(v not in order for v in versions):
            continue
        if versions != sorted(versions, key=order.index):
            problems.append(f"{label}: cells are not oldest first")
        if len(set(versions)) != len(versions):
            problems.append(f"{label}: a release appears twice")
        for cell in row["cells"]:
            wheel = wheels.get(cell["release"])
            if wheel is not None:
                try:
                    problems += check_cell(cell, wheel, f"{label}, {cell['release']}")
                except wheel_members.MemberFetchError as why:
                    problems.append(f"{label}, {cell['release']}: {why}")
    return problems


def _under_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


def run_check(root: Path = ROOT, matrix_path: Path = MATRIX, download: bool = True) -> int:
    matrix = load_matrix(matrix_path)
    wheels, missing = {}, []
    for v in releases_of(matrix):
        found = open_wheel(v, matrix["platforms"].get(v), download)
        if isinstance(found, str):
            missing.append(found)
        else:
            wheels[v] = found
    if missing and _under_ci():
        for why in missing:
            print(f"versions: FAILED: {why} (CI=true: the check may not be skipped)", file=sys.stderr)
        return 1
    problems = check_matrix(matrix, wheels)
    # The page's own citations (notebooks in book/ are not in tools.citations' globs).
    pages = sorted(root.glob(PAGE_GLOB))
    page_wheels = {citations.VLLM.key: wheels.get(citations.VLLM.version)}
    sglang = citations.open_wheel(None, citations.SGLANG) if download else "not downloaded"
    page_wheels[citations.SGLANG.key] = None if isinstance(sglang, str) else sglang
    page_problems, counts = citations.check(pages, root, page_wheels)
    problems += page_problems
    for p in problems:
        print(p)
    cells = sum(len(r["cells"]) for r in matrix["rows"])
    checked = sum(1 for r in matrix["rows"] for c in r["cells"] if c["release"] in wheels)
    print(f"versions: {len(matrix['rows'])} claims, {cells} cells, {checked} checked against "
          f"{len(wheels)} wheels ({', '.join(sorted(wheels, key=lambda v: tuple(map(int, v.split('.')))))}); "
          f"{counts['checked'][citations.VLLM.key] + counts['checked'][citations.SGLANG.key]} citations "
          f"in {len(pages)} book notebooks; {len(problems)} problems")
    for why in missing:
        print(f"versions: skipped: {why}", file=sys.stderr)
    return 1 if problems else 0


def table_lines(matrix: dict) -> list[str]:
    from pagedkv.views.operator import changed_in

    out = []
    for row in matrix["rows"]:
        values = "; ".join(f"{c['release']}: {c['value']}" for c in row["cells"])
        out.append(f"{row['claim']}: {values}; changed: {changed_in(row, matrix['pypi_order'])}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.versions", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="check every cell against its release's wheel")
    parser.add_argument("--table", action="store_true", help="print the matrix")
    parser.add_argument("--matrix", default=str(MATRIX), help="the matrix (default: book/version_matrix.json)")
    parser.add_argument("--offline", action="store_true", help="read cached wheels only; download none")
    args = parser.parse_args(argv)
    if not (args.check or args.table):
        parser.error("one of --check or --table is required")
    status = 0
    if args.table:
        print("\n".join(table_lines(load_matrix(Path(args.matrix)))))
    if args.check:
        status = run_check(ROOT, Path(args.matrix), download=not args.offline)
    return status


if __name__ == "__main__":
    sys.exit(main())
