"""Chapter 8's scheduler excerpts: the scheduling policy printed in parts, from its source.

``scheduler_part(name)`` returns one function of ``pagedkv/engine/scheduler.py``
(or the fields of ``SchedulerOutput``) as text that fits the book's column
(79 characters), its docstring left out: the chapter explains it. The parts
are found with ``ast`` in the module's source, read at call time, so the
chapter prints the code that runs:

- ``"schedule"``: ``Scheduler.schedule``, one step's frame: the budget, the
  running requests, the waiting ones only if nobody was preempted, the output;
- ``"running"``: ``Scheduler._schedule_running``, the loop over the running
  list;
- ``"preempt_last_running"``: the retry inside it, which preempts from the
  back until the allocation succeeds;
- ``"preempt"``: ``Scheduler.preempt``, what preempting a request does;
- ``"waiting"``: ``Scheduler._schedule_waiting``, the admission loop;
- ``"whole_prompt_fits"``: ``Scheduler.whole_prompt_fits``, its gate under
  ``scheduler_reserve_full_isl``;
- ``"output"``: the fields of ``SchedulerOutput``, what a step hands the
  worker.

Long lines are wrapped as ``kernel_source.fit_to_column`` wraps the kernel's.
The source is written 120 columns wide, so a statement that it cannot fit is
first joined into one line and broken again with PEP 8's hanging indent
(``call(`` then its arguments, indented by 4); failing that, an assignment's
value or a condition's last ``and``/``or`` continues after a backslash.
"""

from __future__ import annotations

import ast
import inspect
import io
import textwrap
import tokenize

from ..engine import scheduler
from .kernel_source import fit_to_column

__all__ = ["SCHEDULER_PARTS", "scheduler_part"]

SCHEDULER_PARTS = ("schedule", "running", "preempt_last_running", "preempt", "waiting", "whole_prompt_fits",
                   "output")
# part -> (class holding it, or None for a module-level function; the function's name)
_WHERE = {
    "schedule": ("Scheduler", "schedule"),
    "running": ("Scheduler", "_schedule_running"),
    "preempt_last_running": (None, "preempt_last_running"),
    "preempt": ("Scheduler", "preempt"),
    "waiting": ("Scheduler", "_schedule_waiting"),
    "whole_prompt_fits": ("Scheduler", "whole_prompt_fits"),
}


def _named(nodes: list[ast.stmt], kind: type, name: str):
    for node in nodes:
        if isinstance(node, kind) and node.name == name:
            return node
    raise LookupError(f"no {kind.__name__} {name!r} in pagedkv/engine/scheduler.py")


def _has_docstring(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
        and isinstance(body[0].value.value, str)


def _without_docstring(lines: list[str], node: ast.FunctionDef | ast.ClassDef) -> list[str]:
    """The node's lines (1-based in ``lines``), the docstring cut out."""
    first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    if not _has_docstring(node.body):
        return lines[first - 1:node.end_lineno]
    doc = node.body[0]
    return lines[first - 1:doc.lineno - 1] + lines[doc.end_lineno:node.end_lineno]


def _output_fields(lines: list[str], tree: ast.Module) -> list[str]:
    """``SchedulerOutput``'s decorator, header and fields, without its docstring and methods."""
    cls = _named(tree.body, ast.ClassDef, "SchedulerOutput")
    fields = [s for s in cls.body if isinstance(s, ast.AnnAssign)]
    head = cls.decorator_list[0].lineno if cls.decorator_list else cls.lineno
    return lines[head - 1:cls.lineno] + lines[fields[0].lineno - 1:fields[-1].end_lineno]


def _statements(text: str) -> list[list[int]]:
    """The 0-based rows of each statement that spans several lines (comment lines between them left out)."""
    statements: list[list[int]] = []
    rows: list[int] = []
    for tok in tokenize.generate_tokens(io.StringIO(text + "\n").readline):
        if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            if len(rows) > 1:
                statements.append(rows)
            rows = []
        elif tok.type in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT) and not rows:
            continue
        elif tok.type != tokenize.NL and (not rows or tok.start[0] - 1 != rows[-1]):
            rows.append(tok.start[0] - 1)
    return statements


def _open_at(line: str, upto: int) -> list[int] | None:
    """Columns of the brackets still open at column ``upto``; None inside a string."""
    stack: list[int] = []
    quote = None
    for i, ch in enumerate(line[:upto]):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            stack.append(i)
        elif ch in ")]}" and stack:
            stack.pop()
    return None if quote else stack


def _fits(line: str, width: int) -> bool:
    """Whether ``fit_to_column`` can fit this line."""
    try:
        fit_to_column(line, width)
    except ValueError:
        return False
    return True


def _hanging(line: str, width: int) -> list[str] | None:
    """``head(args)tail`` as ``head(`` and the arguments filled into lines indented by 4 (PEP 8's hanging indent)."""
    indent = len(line) - len(line.lstrip())
    for at, ch in enumerate(line):
        if ch in "([" and _open_at(line, at) == []:
            break
    else:
        return None
    close = next((i for i in range(at + 1, len(line)) if _open_at(line, i + 1) == []), None)
    if close is None or " = " in line[close:]:  # a subscript on the left of an assignment: not here
        return None
    args, start = [], at + 1
    for i in range(at + 1, close):
        if line.startswith(", ", i) and _open_at(line, i) == [at]:
            args.append(line[start:i + 1])
            start = i + 2
    args.append(line[start:close] + line[close:])
    pad = " " * (indent + 4)
    out = [line[:at + 1]]
    current = ""
    for arg in args:
        if current and len(pad) + len(current) + 1 + len(arg) > width:
            out.append(pad + current)
            current = arg
        else:
            current = f"{current} {arg}" if current else arg
    out.append(pad + current)
    return out if all(len(x) <= width for x in out) else None


def _rescue(line: str, width: int) -> list[str]:
    """A line too wide for ``fit_to_column``, broken where a reader expects it.

    In order: a condition (``if``, ``elif``, ``while``) before its last
    ``and``/``or`` that fits, with a backslash (indented by 8, apart from the
    body); an assignment whose value fits on a line of its own, after a
    backslash (indented by 4); PEP 8's hanging indent (``call(``, then its
    arguments indented by 4); the last space inside brackets that fits, the
    rest aligned under the bracket.
    """
    indent = len(line) - len(line.lstrip())

    def before_and_or() -> list[str] | None:
        for op in (" and ", " or "):
            at = line.rfind(op, 0, width - 2)
            if at > indent and _open_at(line, at) == []:
                return [line[:at] + " \\", " " * (indent + 8) + line[at + 1:]]
        return None

    if line.lstrip().startswith(("if ", "elif ", "while ")) and line.endswith(":"):
        broken = before_and_or()
        if broken:
            return broken
    at = line.find(" = ")
    if at > 0 and _open_at(line, at) == [] and indent + 4 + len(line) - at - 3 <= width:
        return [line[:at + 2] + " \\", " " * (indent + 4) + line[at + 3:]]
    hanging = _hanging(line, width)
    if hanging:
        return hanging
    for at in range(min(width, len(line)) - 1, indent, -1):
        opened = _open_at(line, at)
        if line[at] == " " and opened and opened[-1] + 1 + len(line) - at - 1 <= width:
            return [line[:at].rstrip(), " " * (opened[-1] + 1) + line[at + 1:]]
    return before_and_or() or [line]


def _fit(text: str, width: int) -> str:
    """``text`` fitted to ``width``: statements too wide as the source breaks them are joined and broken again."""
    lines = text.splitlines()
    for rows in reversed(_statements(text)):
        if all(len(lines[r]) <= width for r in rows) or any("#" in lines[r] for r in rows):
            continue
        lines[rows[0]:rows[-1] + 1] = [lines[rows[0]].rstrip() + " " +
                                       " ".join(lines[r].strip() for r in rows[1:])]
    out: list[str] = []
    for line in lines:
        if len(line) <= width or _fits(line, width):
            out.append(line)
            continue
        pieces = _rescue(line, width)
        out += pieces if len(pieces) == 1 else _fit("\n".join(pieces), width).splitlines()
    return fit_to_column("\n".join(out), width)


def scheduler_part(name: str, width: int = 79) -> str:
    """One part of the scheduler (see the module docstring), dedented and wrapped to ``width``."""
    if name not in SCHEDULER_PARTS:
        raise ValueError(f"part must be one of {', '.join(SCHEDULER_PARTS)}, got {name!r}")
    source = inspect.getsource(scheduler)
    lines = source.splitlines()
    tree = ast.parse(source)
    if name == "output":
        picked = _output_fields(lines, tree)
    else:
        owner, function = _WHERE[name]
        body = tree.body if owner is None else _named(tree.body, ast.ClassDef, owner).body
        picked = _without_docstring(lines, _named(body, ast.FunctionDef, function))
    text = textwrap.dedent("\n".join(picked)).strip("\n")
    fitted = _fit(text, width)
    ast.parse(fitted)  # still Python
    return fitted
