"""Rendering a chat template that came inside a model file: sandboxed, and bounded.

A chat template is a Jinja program written by whoever made the file. Jinja's
``ImmutableSandboxedEnvironment`` (what transformers uses) already refuses
attribute access to Python internals and changes to lists and dicts; it does
not bound the work a template asks for. ``render_chat_template`` adds three
bounds, each raising a ``ValueError`` that names the template's source:

* **time**: rendering stops after ``time_limit_s`` of wall-clock time (a loop
  nest or a recursion that branches). A trace function, installed only while
  the template's own code runs, checks the clock on each of its lines.
* **recursion**: a macro that calls itself without end hits Python's recursion
  limit, reported as such.
* **size**: neither the rendered prompt nor what one operation builds may
  exceed ``MAX_SIZE`` characters or items (a million: a prompt longer than
  any context served): ``'a' * 10**10``, ``x ~ x`` doubled in a loop,
  ``'a'.ljust(10**10)`` and ``'%999999999d' % 1`` are refused before they
  allocate. ``*``, ``+``, ``%`` and ``~`` check the size first, and every call
  and filter refuses an integer argument (or format width) above ``MAX_SIZE``.

What is not bounded: a value built from shared references and then printed
(a list that contains itself twice, nested 40 deep, written out with
``|string``) grows inside one C call, which neither the clock nor the size
checks can stop; only the operating system's memory limit does.
"""

from __future__ import annotations

import functools
import numbers
import re
import sys
import time

__all__ = ["render_chat_template", "MAX_SIZE", "TIME_LIMIT_S"]

#: The longest string or list one template operation may build (characters or items).
MAX_SIZE = 1 << 20
#: Wall-clock seconds a template may render for.
TIME_LIMIT_S = 0.5

_TEMPLATE_FILE = "<template>"  # the file name Jinja compiles a template from a string under
_WIDTH = re.compile(r"\d+")


class _Stop(Exception):
    """A bound was hit; the message says which."""


def _check_size(n: int, what: str) -> None:
    if n > MAX_SIZE:
        raise _Stop(f"{what} would build {n:,} characters or items, more than the limit of {MAX_SIZE:,}")


def _size(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


def _check_arguments(args, kwargs, what: str) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, numbers.Integral) and not isinstance(a, bool) and abs(a) > MAX_SIZE:
            raise _Stop(f"{what} got the integer {a}, larger than the limit of {MAX_SIZE:,}")


def _check_format(fmt: str, what: str) -> None:
    """A format string's widths (``%999999999d``, ``{:999999999}``) are sizes too."""
    for digits in _WIDTH.findall(fmt):
        if len(digits) > 9 or int(digits) > MAX_SIZE:
            raise _Stop(f"{what} has the width {digits}, larger than the limit of {MAX_SIZE:,}")


def _bounded_filter(f, name: str):
    """``f`` with its arguments checked; the filtered value itself (first, after any context) is not."""
    skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1

    @functools.wraps(f)  # keeps Jinja's pass_context/pass_environment marker
    def bounded(*args, **kwargs):
        _check_arguments(args[skip:], kwargs, f"the filter {name}")
        if name == "format" and args and isinstance(args[0], str):
            _check_format(args[0], "the filter format")
        return f(*args, **kwargs)

    return bounded


def _environment():
    import jinja2
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCodeGenerator(CodeGenerator):
        """Compiles ``a ~ b`` to ``environment.concat_bounded(...)``: Jinja offers no hook for it."""

        def visit_Concat(self, node, frame):
            self.write("environment.concat_bounded((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedCodeGenerator
        intercepted_binops = frozenset({"*", "+", "%", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if _size(seq) and isinstance(n, numbers.Integral):
                        _check_size(_size(seq) * int(n), "a repetition (*)")
            elif operator == "+":
                _check_size(_size(left) + _size(right), "a concatenation (+)")
            elif operator == "%" and isinstance(left, str):
                _check_format(left, "a % format")
                _check_arguments(right if isinstance(right, tuple) else (right,), {}, "a % format")
            elif operator == "**" and isinstance(right, numbers.Real) and not isinstance(left, (str, list)):
                if isinstance(left, numbers.Integral) and isinstance(right, numbers.Integral):
                    _check_size(abs(int(right)) * max(int(left).bit_length(), 1) // 8, "a power (**)")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
            _check_arguments(args, kwargs, f"the call of {getattr(__obj, '__name__', 'a function')}")
            method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format in its own formatter
            if getattr(method, "__name__", None) in ("format", "format_map") and isinstance(
                    getattr(method, "__self__", None), str):
                _check_format(method.__self__, "str.format")
            return super().call(__context, __obj, *args, **kwargs)

        def concat_bounded(self, values):
            parts = [str(v) for v in values]
            _check_size(sum(map(len, parts)), "a concatenation (~)")
            return "".join(parts)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters = {name: _bounded_filter(f, name) for name, f in env.filters.items()}

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env


def _deadline_tracer(deadline: float):
    """A ``sys.settrace`` function that traces only the template's compiled code and stops it at ``deadline``."""
    def line(frame, event, arg):
        if time.monotonic() > deadline:
            raise _Stop("rendering ran out of time (a loop or a recursion without end?)")
        return line

    def call(frame, event, arg):
        return line if frame.f_code.co_filename == _TEMPLATE_FILE else None

    return call


def render_chat_template(source: str, origin: str, time_limit_s: float = TIME_LIMIT_S, **context) -> str:
    """``source`` rendered with ``context``; ValueError naming ``origin`` if it is invalid or over a bound.

    ``origin`` says where the template came from (a file's path), for the message.
    """
    if not isinstance(source, str):
        raise TypeError(f"the chat template of {origin} must be a str, got {type(source).__name__}")
    previous = sys.gettrace()
    try:
        template = _environment().from_string(source)
        sys.settrace(_deadline_tracer(time.monotonic() + time_limit_s))
        try:
            parts, size = [], 0
            for part in template.generate(**context):  # the output is bounded as it grows
                size += len(part)
                _check_size(size, "the rendered prompt")
                parts.append(part)
            return "".join(parts)
        finally:
            sys.settrace(previous)
    except _Stop as e:
        raise ValueError(f"the chat template of {origin} was stopped: {e}") from None
    except RecursionError:
        raise ValueError(f"the chat template of {origin} recursed too deeply (a macro that calls itself "
                         f"without end?)") from None
    except Exception as e:  # noqa: BLE001 -- the template is untrusted code: whatever it raises is its error
        raise ValueError(f"the chat template of {origin} failed: {type(e).__name__}: {e}") from None
