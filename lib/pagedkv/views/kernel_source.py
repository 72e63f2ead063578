"""Chapter 7's kernel excerpts: the paged-attention kernel printed in parts, from its source.

``kernel_part(name)`` returns one part of the paged-attention kernel's modules
(``pagedkv/kernels/attention_kernel.py``, ``attention_merge.py``,
``attention_plan.py``) as text that fits the book's column (79 characters).
The parts are found with ``ast`` in their module's source, read at call time,
so the chapter prints the code that runs, whatever lines it sits on:

- ``"arguments"``: the kernel's parameters, with their comments;
- ``"prologue"``: program ids to request, KV head, query tile and split; the
  rows of the tile as (token, head) pairs; the query load;
- ``"segment"``: the keys a tile may see, its split's segment, the online
  softmax's state, the first block ids;
- ``"loop"``: the loop over key tiles;
- ``"epilogue"``: after the loop, the output or the split's partial and lse;
- ``"merge"``: the whole ``_merge_splits_kernel`` (``attention_merge``);
- ``"launch"``: the launch list that ``kernel_launches`` builds (the
  arguments the wrapper passes, constexprs, ``num_warps``, ``num_stages``);
- ``"tiles"``: ``_tile_config`` (``attention_plan``), which picks ``TILE_N``,
  ``num_warps`` and ``num_stages``, with the comment above it.

``kv_buffer_summary()`` reads the committed compile report
(``book/compile_report.json``, from ``tools/compile_check.py``) and tabulates
the K/V buffers the compiler gave the main loop, per kind of launch, dtype
and head_dim, for sm_90 and sm_80; ``kernel_prediction()`` gives one
configuration's registers, shared memory and programs per SM. Both are what
the ahead-of-time compile predicts, not measurements on a GPU.

A line longer than the width gets its trailing comment on lines of its own
above it, and long code is broken after a comma inside brackets (aligned
under the bracket) or, failing that, before an operator with a backslash.
"""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
from pathlib import Path

from ..kernels import attention_kernel, attention_merge, attention_plan

__all__ = ["KERNEL_PARTS", "fit_to_column", "kernel_part", "kernel_prediction", "kv_buffer_summary", "programs_per_sm"]

KERNEL_PARTS = ("arguments", "prologue", "segment", "loop", "epilogue", "merge", "launch", "tiles")
# The module each part is read from (the rest: attention_kernel).
_MODULE_OF = {"merge": attention_merge, "tiles": attention_plan}


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise LookupError(f"no function {name!r} in the module read")


def _assigns(stmt: ast.stmt, name: str) -> bool:
    return isinstance(stmt, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == name for t in stmt.targets)


def _span(lines: list[str], first: int, last: int) -> tuple[int, int]:
    """Lines ``first..last`` (1-based), widened upwards over the comment block right above."""
    while first > 1 and lines[first - 2].strip().startswith("#"):
        first -= 1
    return first, last


def _line_spans(name: str, lines: list[str], tree: ast.Module) -> tuple[int, int]:
    if name == "merge":
        merge = _function(tree, "_merge_splits_kernel")
        return merge.decorator_list[0].lineno, merge.end_lineno
    if name == "tiles":
        fn = _function(tree, "_tile_config")
        return _span(lines, fn.lineno, fn.end_lineno)
    kernel = _function(tree, "_paged_attention_kernel")
    body = kernel.body
    loop = next(i for i, s in enumerate(body) if isinstance(s, ast.For))
    bound = next(i for i, s in enumerate(body) if _assigns(s, "kv_end"))
    if name == "arguments":
        return kernel.lineno, body[0].lineno - 1
    if name == "prologue":
        return _span(lines, body[0].lineno, body[bound - 1].end_lineno)
    if name == "segment":
        return _span(lines, body[bound].lineno, body[loop - 1].end_lineno)
    if name == "loop":
        return body[loop].lineno, body[loop].end_lineno
    if name == "epilogue":
        return _span(lines, body[loop + 1].lineno, body[-1].end_lineno)
    if name == "launch":
        fn = _function(tree, "kernel_launches")
        stmt = next(s for s in fn.body if _assigns(s, "launches"))
        return stmt.lineno, stmt.end_lineno
    raise ValueError(f"part must be one of {', '.join(KERNEL_PARTS)}, got {name!r}")


def kernel_part(name: str, width: int = 79) -> str:
    """One part of the paged-attention kernel (see the module docstring), dedented and wrapped."""
    if name not in KERNEL_PARTS:
        raise ValueError(f"part must be one of {', '.join(KERNEL_PARTS)}, got {name!r}")
    source = inspect.getsource(_MODULE_OF.get(name, attention_kernel))
    lines = source.splitlines()
    first, last = _line_spans(name, lines, ast.parse(source))
    return fit_to_column(textwrap.dedent("\n".join(lines[first - 1:last])).strip("\n"), width)


def fit_to_column(text: str, width: int = 79) -> str:
    """Python source wrapped to ``width`` columns, still valid Python (the rules in the module docstring)."""
    out: list[str] = []
    for line in text.splitlines():
        if len(line) > width and line.lstrip().startswith("# "):  # a comment line of its own
            pad = " " * (len(line) - len(line.lstrip()))
            out += textwrap.wrap(line.lstrip()[2:], width, initial_indent=pad + "# ",
                                 subsequent_indent=pad + "# ")
            continue
        code, sep, comment = line.partition("  # ")
        if len(line) > width and sep and code.strip():
            pad = " " * (len(code) - len(code.lstrip()))
            out += textwrap.wrap(comment, width, initial_indent=pad + "# ",
                                 subsequent_indent=pad + "# ")
            line = code.rstrip()
        out += _break(line, width)
    too_wide = [line for line in out if len(line) > width]
    if too_wide:
        raise ValueError(f"cannot fit {too_wide[0]!r} in {width} characters")
    return "\n".join(out)


def _open_brackets(line: str, upto: int) -> list[tuple[int, str]]:
    """Column and kind of the brackets still open at ``upto`` (strings skipped)."""
    stack: list[tuple[int, str]] = []
    quote = None
    for i, ch in enumerate(line[:upto]):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            stack.append((i, ch))
        elif ch in ")]}" and stack:
            stack.pop()
    return stack


def _in_string(line: str, upto: int) -> bool:
    """Whether column ``upto`` of ``line`` is inside a string literal."""
    quote = None
    for ch in line[:upto]:
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
    return quote is not None


def _break(line: str, width: int) -> list[str]:
    """Split a long code line so that it stays valid Python."""
    if len(line) <= width:
        return [line]
    indent = len(line) - len(line.lstrip())
    cut = line.rfind(", ", 0, width)
    while cut > 0:
        if _in_string(line, cut):  # a comma inside a string is no place to break
            cut = line.rfind(", ", 0, cut)
            continue
        brackets = _open_brackets(line, cut)
        if brackets and brackets[-1][1] == "(" and brackets[-1][0] + 1 < width - 10:
            # after a comma of a call or tuple, aligned under its bracket
            rest = " " * (brackets[-1][0] + 1) + line[cut + 2:]
            return [line[:cut + 1]] + _break(rest, width)
        if not brackets and indent:
            # a continuation line (its bracket opened on an earlier line)
            return [line[:cut + 1]] + _break(" " * indent + line[cut + 2:], width)
        cut = line.rfind(", ", 0, cut)
    for op in (" + ", " * ", " & ", " - "):
        cut = line.rfind(op, 0, width - 2)
        if cut > len(line) - len(line.lstrip()) and not _in_string(line, cut):
            pad = " " * (len(line) - len(line.lstrip()) + 4)
            return [line[:cut] + " \\"] + _break(pad + line[cut + 1:], width)
    return [line]


def _compile_report() -> dict:
    """The committed compile report, found from the book's root (the folder with ``_toc.yml``)."""
    here = Path.cwd()
    for folder in (here, *here.parents):
        if (folder / "_toc.yml").exists():
            return json.loads((folder / "book" / "compile_report.json").read_text())
    raise FileNotFoundError("no _toc.yml above the working directory: run from inside the book")


def kv_buffer_summary() -> str:
    """K/V buffers of the main loop per launch kind, dtype and head_dim, as ``sm_90/sm_80`` (a table).

    Each cell also gives ``num_stages`` (``s2``, ``s3``); block sizes share a
    cell when they agree, else the cell lists every value seen.
    """
    report = _compile_report()
    cells: dict[tuple, set] = {}
    dims: set[int] = set()
    for row in report["rows"]:
        if "kv_buffers" not in row["sm_90"]:
            continue  # the merge kernel has no K/V loop
        key = (row["kind"], row["dtype"], row["head_dim"])
        dims.add(row["head_dim"])
        cells.setdefault(key, set()).add(
            (row["sm_90"]["kv_buffers"], row["sm_80"]["kv_buffers"], row["tiles"]["num_stages"]))
    cols = sorted(dims)
    lines = [f"K/V buffers predicted, sm_90/sm_80 (num_stages); triton {report['triton']}",
             f"{'launch':<8} {'dtype':<5}" + "".join(f"{'d' + str(d):>12}" for d in cols)]
    for kind in ("decode", "split", "prefill"):
        for dtype in ("fp32", "fp16", "bf16"):
            row = []
            for d in cols:
                seen = sorted(cells.get((kind, dtype, d), ()))
                row.append(", ".join(f"{a}/{b} (s{st})" for a, b, st in seen) or "-")
            lines.append(f"{kind:<8} {dtype:<5}" + "".join(f"{c:>12}" for c in row))
    return "\n".join(lines)


def kernel_prediction(kind: str = "decode", dtype: str = "bf16", head_dim: int = 128,
                      block_size: int = 16) -> str:
    """One compiled configuration of the attention kernel as the compile report predicts it.

    Per target (sm_90, an H200; sm_80, an A100): registers per thread,
    shared memory per program and the programs one SM holds at once, with
    the SM's own limits beside them. ``kind`` is ``"decode"``, ``"split"`` or
    ``"prefill"``.
    """
    report = _compile_report()
    row = _report_row(report, kind, dtype, head_dim, block_size)
    threads = 32 * row["tiles"]["num_warps"]
    lines = [f"{kind} {dtype}, head_dim {head_dim}, blocks of {block_size}: "
             f"{row['tiles']['num_warps']} warps, {threads} threads a program",
             f"{'predicted, triton ' + report['triton']:<28}{'registers':>10}{'shared (B)':>12}"
             f"{'programs/SM':>13}"]
    targets = report["targets"]
    for target, t in targets.items():
        fig = row[target]
        lines.append(f"  {target} ({t['gpu']}){'':<14}{fig['regs']:>10}{fig['shared']:>12,}"
                     f"{fig['resident']:>13}")
    limits = [targets[t] for t in targets]
    both = " / ".join(targets)

    def per(key: str) -> str:
        return " / ".join(f"{t[key]:,}" for t in limits)

    lines += [f"one SM holds ({both}): {per('registers')} registers,",
              f"  {per('shared_bytes')} B shared, {per('threads')} threads, "
              f"{per('blocks')} programs"]
    return "\n".join(lines)


def _report_row(report: dict, kind: str, dtype: str, head_dim: int, block_size: int) -> dict:
    for row in report["rows"]:
        if (row.get("kind"), row.get("dtype"), row.get("head_dim"), row.get("block_size")) == (
                kind, dtype, head_dim, block_size):
            return row
    raise LookupError(f"the compile report has no {kind} {dtype} d{head_dim} b{block_size} kernel")


def programs_per_sm(kind: str = "split", dtype: str = "bf16", head_dim: int = 128, block_size: int = 16,
                    target: str = "sm_90") -> int:
    """The programs of one compiled configuration that one SM holds at once, as the compile report predicts."""
    return _report_row(_compile_report(), kind, dtype, head_dim, block_size)[target]["resident"]
