"""The machinery every exercise checker shares.

A checker runs a learner's function on randomized cases and compares it with
the library's implementation and with an independent oracle. It must survive
the learner's bugs: an exception, a wrong type or shape, or a hang becomes a
red line with a hint, never a crashed notebook. Each property prints exactly
one line, so a committed notebook shows a stable, readable verdict.

Hints teach only where there is something to learn from:

* An untouched stub gets one line. A checker calls ``probe(body)`` first;
  when ``body`` raises ``NotImplementedError`` the checker prints
  ``not implemented yet`` once and stops. A property that meets a
  ``NotImplementedError`` later (one method of several still a stub) says
  so without a hint.
* A wrong answer that a known mistake explains is named: a property raises
  ``WrongAnswer(message, mistake=...)`` (usually through ``name_mistake``),
  and the line shows that diagnosis instead of the property's generic hint.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import textwrap
import threading
import traceback
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

PASS, FAIL = "\u2705", "\u274c"  # the two marks a reader scans for
NOT_RUN = "\u2796"  # a property this machine cannot test: neither held nor failed
COLUMN = 79  # characters in a line of the book's column


def fit_column(text: str, width: int = COLUMN) -> str:
    """``text`` with every line longer than ``width`` wrapped at spaces, continued 3 columns in.

    A checker's line is printed into a notebook, then into the book's column:
    wrapped here, it never makes a reader scroll sideways. A word longer than
    the line (a long value) is left whole.
    """
    out = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip(" ")) + 3)
        out.append(textwrap.fill(line, width, subsequent_indent=indent, break_long_words=False,
                                 break_on_hyphens=False))
    return "\n".join(out)


class CheckTimeout(BaseException):
    """The learner's code ran past the checker's time limit.

    A ``BaseException``, like ``KeyboardInterrupt``: a learner's ``except
    Exception`` (a retry loop, say) must not swallow it.
    """


class NotRun(Exception):
    """Raised by a property's body that cannot run here (its reason is the message).

    The line shows ``NOT_RUN`` and the reason, never a green tick: a check
    that did not run proves nothing. The report stays truthy when every
    property that ran holds, and its summary counts the ones not run.
    """


class WrongAnswer(AssertionError):
    """A wrong answer, with the common mistake it points to (or ``None``)."""

    def __init__(self, message: str, mistake: str | None = None):
        super().__init__(message)
        self.mistake = mistake


class _Stub(BaseException):
    """Raised by ``Checker.probe`` on an untouched stub; ends the ``with``."""


@dataclass
class PropertyResult:
    name: str
    passed: bool
    detail: str = ""
    #: Not run on this machine (``passed`` is then True: nothing failed).
    skipped: bool = False

    def line(self) -> str:
        if self.skipped:
            return fit_column(f"{NOT_RUN} {self.name} -- not run here: {self.detail}")
        mark = PASS if self.passed else FAIL
        return fit_column(f"{mark} {self.name}" + ("" if self.passed else f" -- {self.detail}"))


@dataclass
class CheckReport:
    """The verdict of one checker: one result per property; truthy when all passed."""

    title: str
    results: list[PropertyResult] = field(default_factory=list)
    #: True when the checker stopped at an untouched stub (one line shown).
    stub: bool = False

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    def __bool__(self) -> bool:
        return self.passed

    def summary(self) -> str:
        if self.stub:
            return f"{self.title}: not implemented yet"
        ran = [r for r in self.results if not r.skipped]
        n_ok = sum(r.passed for r in ran)
        not_run = len(self.results) - len(ran)
        return (f"{self.title}: {n_ok}/{len(ran)} properties hold"
                + (f", {not_run} not run here" if not_run else ""))

    def __str__(self) -> str:
        if self.stub:
            return fit_column(f"{FAIL} {self.title}: {NOT_IMPLEMENTED}")
        return "\n".join([*(r.line() for r in self.results), self.summary()])

    def __repr__(self) -> str:
        return f"<CheckReport {self.summary()}>"

    def _ipython_display_(self) -> None:
        """Show nothing more in a notebook: the checker already printed one line per property.

        (A trailing ``;`` is not a reliable way to hide the value: nbval runs cells
        without storing history, and IPython then reads the wrong cell's ``;``.)
        """


_REPEAT_S = 0.05  # after the deadline, the alarm fires again this often until the learner's code lets go


def _in_harness(frame) -> bool:
    return frame is not None and frame.f_code.co_filename == __file__


class _time_limit:
    """Raise ``CheckTimeout`` in the learner's code once ``seconds`` have passed, until it stops.

    Jupyter runs cells in the main thread, where SIGALRM is available on Unix;
    elsewhere (Windows, worker threads) the limit is not enforced.

    The learner's code may catch what we raise, so one alarm is not enough:

    1. ``CheckTimeout`` derives from ``BaseException``: ``except Exception``
       does not catch it.
    2. The alarm repeats every ``_REPEAT_S`` seconds past the deadline
       (``setitimer`` with an interval), so a bare ``except:`` in a loop gets
       another one, and another.
    3. From the second alarm on, a line tracer is installed on the learner's
       frames: the next line they run raises ``CheckTimeout`` again, also
       inside an ``except`` block, where the enclosing ``try`` cannot catch
       it. A loop with a bare ``except:`` still exits.

    The harness's own frames (this file) are never interrupted: an alarm that
    lands there is ignored, and leaving the ``with`` disarms everything first.
    What can still outlast this: code that blocks in C without returning to
    Python, and a loop that swallows ``BaseException`` at two nested levels
    (CPython drops a tracer that raises, so each alarm gets two raises in).
    """

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
        self.fired = 0
        self.traced = False

    def _timeout(self) -> CheckTimeout:
        return CheckTimeout(f"no answer within {self.seconds:g} s (an infinite loop?)")

    def _trace(self, frame, event, arg):
        if _in_harness(frame):
            return None
        if event == "line":
            raise self._timeout()
        return self._trace

    def _alarm(self, signum, frame) -> None:
        if _in_harness(frame):
            return  # never inside the harness itself: the next alarm will come
        self.fired += 1
        if self.fired > 1:  # the first one was swallowed: make every line of theirs raise
            f = frame
            while f is not None and not _in_harness(f):
                f.f_trace = self._trace
                f = f.f_back
            sys.settrace(self._trace)
            self.traced = True
        raise self._timeout()

    def __enter__(self) -> "_time_limit":
        if self.usable:
            self._previous_trace = sys.gettrace()
            self._previous_handler = signal.signal(signal.SIGALRM, self._alarm)
            signal.setitimer(signal.ITIMER_REAL, self.seconds, _REPEAT_S)
        return self

    def __exit__(self, *exc) -> bool:
        if self.usable:
            signal.setitimer(signal.ITIMER_REAL, 0)
            if self.traced:
                sys.settrace(self._previous_trace)
            signal.signal(signal.SIGALRM, self._previous_handler)
        return False


NOT_IMPLEMENTED = "not implemented yet (it raises NotImplementedError)"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, NotImplementedError):
        return NOT_IMPLEMENTED
    if isinstance(exc, CheckTimeout):
        return str(exc)
    if isinstance(exc, AssertionError):
        return str(exc) or "assertion failed"
    # Name the exception and where in the learner's code it came from, briefly.
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (line {tb[-1].lineno} in {tb[-1].name})" if tb else ""
    return f"raised {type(exc).__name__}: {exc}{where}"


class Checker:
    """Collects properties; use as ``with Checker("title") as c: c.prop(...)``.

    ``prop(name, body, hint)`` runs ``body()``; the property holds when it
    returns without raising. ``body`` signals a wrong answer with
    ``AssertionError(message)``; any other exception is the learner's crash.
    The hint is shown only on failure.
    """

    def __init__(self, title: str, timeout: float = 20.0, verbose: bool = True):
        self.report = CheckReport(title)
        self.timeout = timeout
        self.verbose = verbose
        #: Set once the learner's code ran past ``timeout``: every later
        #: property then fails at once with the same words, so a hang costs
        #: one timeout per check call, not one per property.
        self.hung: str | None = None

    def __enter__(self) -> "Checker":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is _Stub:  # the stub (or a delegation): its one line is already printed
            if self.verbose and not self.report.stub:
                print(self.report.summary())
            return True
        if self.verbose:
            print(self.report.summary())
        return False  # checker bugs propagate; learner bugs never reach here

    def probe(self, body: Callable[[], None]) -> None:
        """Run ``body`` once; on ``NotImplementedError`` report the stub and stop.

        Use it first, inside the ``with``: an untouched stub then prints one
        line, ``not implemented yet``, instead of every property's hint.
        Anything else ``body`` does (a crash, a wrong answer, a hang) is left
        for the properties to report.
        """
        try:
            with _time_limit(self.timeout):
                body()
        except NotImplementedError:
            result = PropertyResult(self.report.title, False, NOT_IMPLEMENTED)
            self.report.results.append(result)
            self.report.stub = True
            if self.verbose:
                print(fit_column(f"{FAIL} {self.report.title}: {NOT_IMPLEMENTED}"))
            raise _Stub from None
        except CheckTimeout as exc:  # every property will say so, at once
            self.hung = str(exc)
        except Exception:  # noqa: BLE001 -- the properties will say what
            pass

    def written_here(self, task: str, call: Callable[[], None], library: dict) -> None:
        """Stop with one red line when ``call()`` runs one of the library's functions.

        ``library`` maps a name (``"BlockPool.get_new_blocks"``) to the
        library's function that the task asks the learner to write. Calling
        it answers with the oracle the check compares against, so every
        property would pass and prove nothing: the check says so and stops.
        Anything else ``call`` does (a crash, a hang) is left to the
        properties. Use it right after ``probe``.
        """
        try:
            with _time_limit(self.timeout):
                used = library_calls(call, library)
        except (Exception, CheckTimeout):  # noqa: BLE001 -- the properties will say what
            return
        if not used:
            return
        result = PropertyResult(
            f"{task} is your own code", False,
            f"it calls the library's {used[0]}. Diagnosis: {DELEGATED.name} -- "
            f"{DELEGATED.fix}")
        self.report.results.append(result)
        if self.verbose:
            print(result.line())
        raise _Stub

    def prop(self, name: str, body: Callable[[], None], hint: str = "",
             diagnose: Callable[[], str | None] | None = None) -> bool:
        """Run one property; ``diagnose()`` names the mistake behind a failure
        that does not name one itself (a crash, a plain ``AssertionError``).

        After a hang (``self.hung``) the body is not run: the line says that
        an earlier call gave no answer in time."""
        if self.hung is not None:
            result = PropertyResult(name, False, f"{self.hung}; not run again after the first hang")
            self.report.results.append(result)
            if self.verbose:
                print(result.line())
            return False
        try:
            with _time_limit(self.timeout):
                body()
            result = PropertyResult(name, True)
        except NotRun as exc:  # honest: neither a tick nor a cross
            result = PropertyResult(name, True, str(exc), skipped=True)
        except (Exception, CheckTimeout) as exc:  # noqa: BLE001 -- every learner bug becomes a red line
            detail = _describe(exc)
            if isinstance(exc, CheckTimeout):
                self.hung = str(exc)
            mistake = getattr(exc, "mistake", None)
            if not mistake and diagnose is not None and not isinstance(
                    exc, (NotImplementedError, CheckTimeout)):
                try:
                    with _time_limit(self.timeout):
                        mistake = diagnose()
                except CheckTimeout as hang:  # the diagnosis ran the learner's code into a hang
                    self.hung, mistake = str(hang), None
                except Exception:  # noqa: BLE001 -- no diagnosis then
                    mistake = None
            if mistake:
                detail += f". Diagnosis: {mistake}"
            elif hint and not isinstance(exc, NotImplementedError):
                detail += f". Hint: {hint}"
            result = PropertyResult(name, False, detail)
        self.report.results.append(result)
        if self.verbose:
            print(result.line())
        return result.passed


def expect_equal(got, want, what: str) -> None:
    """Assert equality with a message naming what differed and both values.

    Booleans are ints in Python; ``True`` never passes for ``1`` here.
    """
    if isinstance(got, bool) != isinstance(want, bool) or got != want:
        raise AssertionError(f"{what}: expected {want!r}, got {got!r}")


def expect_int(value, what: str) -> int:
    """Accept Python and numpy integers (not bools, not floats); say so otherwise."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise AssertionError(f"{what}: expected an integer, got {type(value).__name__} {value!r}")
    return int(value)


class Mistake(NamedTuple):
    """A common mistake: a short name, what to do instead, and a model of it.

    ``model(*args)`` computes what a learner who makes this mistake answers
    (``None`` for mistakes a checker recognises some other way).
    """

    name: str
    fix: str
    model: Callable | None = None

    def diagnosis(self) -> str:
        return f"{self.name} -- {self.fix}"


DELEGATED = Mistake(
    "the library's own function", "the task is to write it: the library's "
    "version is the oracle your answer is compared with, so calling it "
    "passes every check and teaches nothing. Write the steps yourself")


def library_calls(call: Callable[[], None], library: dict) -> list[str]:
    """The names in ``library`` (name -> function) whose code ran while ``call()`` ran.

    Matched by code object, so an alias, a bound method, ``super()`` or an
    inherited method is seen as well as a direct call. An exception of
    ``call``'s ends the call; what ran until then is still returned.
    """
    codes = {}
    for name, fn in library.items():
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        if code is not None:
            codes[code] = name
    seen: list[str] = []
    previous = sys.getprofile()

    def profile(frame, event, arg):
        if event == "call":
            name = codes.get(frame.f_code)
            if name is not None and name not in seen:
                seen.append(name)

    sys.setprofile(profile)
    try:
        call()
    except Exception:  # noqa: BLE001 -- the properties report the crash
        pass
    finally:
        sys.setprofile(previous)
    return seen


def name_mistake(got, args: tuple, mistakes, call=None, probes=()) -> str | None:
    """The diagnosis of the first mistake whose model answers ``got`` on ``args``.

    When several models give ``got`` and ``call`` (the learner's function) is
    given, each of ``probes`` (more argument tuples) keeps only the models
    that also agree with the learner there. ``None`` when none explains it.
    """

    def agrees(model, a, value) -> bool:
        try:
            want = model(*a)
        except Exception:  # noqa: BLE001 -- a model that cannot run here does not match
            return False
        try:
            if hasattr(want, "tolist"):
                want = want.tolist()
            if hasattr(value, "tolist"):
                value = value.tolist()
            if isinstance(want, float) or isinstance(value, float):
                return math.isclose(want, value, rel_tol=1e-9, abs_tol=1e-9)
            return bool(want == value)
        except Exception:  # noqa: BLE001 -- e.g. arrays of different shapes
            return False

    found = [m for m in mistakes if m.model is not None and agrees(m.model, args, got)]
    if len(found) > 1 and call is not None:
        for a in probes:
            try:
                value = call(*a)
            except Exception:  # noqa: BLE001 -- cannot tell them apart here
                continue
            narrowed = [m for m in found if agrees(m.model, a, value)]
            if narrowed:
                found = narrowed
            if len(found) == 1:
                break
    return found[0].diagnosis() if found else None


def wrong(message: str, got, args: tuple, mistakes, call=None,
          probes=()) -> WrongAnswer:
    """A ``WrongAnswer`` for ``message``, naming the mistake if one explains ``got``."""
    return WrongAnswer(message, name_mistake(got, args, mistakes, call, probes))


def catalogue(fn, *mistake_lists) -> None:
    """Attach the mistakes a checker names to it, for ``print_mistakes``."""
    fn.mistakes = [m for ms in mistake_lists for m in ms]


def print_mistakes(*check_fns, width: int = 79) -> None:
    """Print the mistakes each checker names, as a wrapped list (for the solutions).

    A checker lists them in its ``mistakes`` attribute (``Mistake`` objects,
    set by ``catalogue``), in the order it tries them.
    """
    import textwrap

    for fn in check_fns:
        print(f"{fn.__name__}:")
        for m in getattr(fn, "mistakes", ()):
            print(textwrap.fill(m.diagnosis(), width, initial_indent="- ",
                                subsequent_indent="  "))


@contextlib.contextmanager
def one_thread():
    """Run the tiny model on one CPU thread: on a busy machine more threads only wait for each other."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
