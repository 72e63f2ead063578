"""Dispatch ``python -m pagedkv.bench NAME [args]`` to ``pagedkv.bench.NAME.main(args)``."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import pagedkv.bench as _pkg


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(_pkg.__path__) if not m.name.startswith("_"))


def main(argv: list[str]) -> int:
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m pagedkv.bench NAME [args]   (NAME: all, " + ", ".join(names) + ")")
        return 0
    name, rest = argv[0], argv[1:]
    if name == "all":
        for n in names:
            print(f"== {n} ==", flush=True)
            importlib.import_module(f"pagedkv.bench.{n}").main(rest)
        return 0
    if name not in names:
        print(f"unknown benchmark {name!r}; choose one of: {', '.join(names)}", file=sys.stderr)
        return 2
    return importlib.import_module(f"pagedkv.bench.{name}").main(rest) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
