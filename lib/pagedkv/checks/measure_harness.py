"""What the modify-and-measure tasks of exercises 2-6 share.

A modify-and-measure task has the reader change one policy through a
documented extension point (a function handed to the library, or a subclass),
write a prediction of its effect into a variable *before* measuring, then
measure it on a workload the notebook provides. ``check_experiment`` grades
three things, one line each:

1. the policy follows the rule the task asks for (``rule``, on the checker's
   own cases); a crash in it is named with its line, and a policy that calls
   the library's own answer (``library``) is refused by name;
2. the measurement is right *for the reader's policy*: the checker measures
   again with that policy (``remeasure``) and compares; a measurement that
   equals one of the known wrong ones (``measurement_mistakes``: the
   library's default policy, a percentage for a fraction, ...) is named;
3. the prediction, compared with the checker's measurement: how far off,
   and what the gap teaches (``lesson``).

A missing policy (the stub) prints one line and stops; a missing
measurement or prediction is a red line that says which variable to fill.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from ._harness import (DELEGATED, Checker, CheckReport, Mistake, PropertyResult,
                       WrongAnswer, library_calls)

__all__ = ["Experiment", "check_experiment", "percent_mistake", "NO_VALUE"]

#: A crash in the reader's policy, wherever the checker ran it.
CRASH = Mistake("a crash in your policy", "call it on a small case by hand and read the "
                "traceback's last line in your code; the policy must answer for every state "
                "the workload reaches")

NO_VALUE = "not filled in yet: run your measurement and store it in {variable}"


@dataclass
class Experiment:
    """One modify-and-measure task, as its checker describes it.

    Attributes:
        title: the report's title.
        rule: the property line for the policy, e.g. ``"worst_fit takes
            the largest hole"``.
        check_rule: runs the reader's policy on the checker's cases and
            raises ``AssertionError``/``WrongAnswer`` when it breaks the
            rule (any other exception is the reader's crash).
        probe: one short call of the reader's policy (the stub test, and
            the call watched for the library's answer).
        library: name -> the library function the policy must not call.
        remeasure: the checker's own measurement with the reader's policy.
        what: what is measured, in words ("the mean external share").
        fmt: how a value is printed.
        measured, predicted: the reader's two variables' values.
        measured_name, predicted_name: those variables' names.
        tolerance: how far a measurement may be from the checker's.
        prediction_tolerance: how close a prediction counts as right.
        measurement_mistakes: ``Mistake``s whose ``model(true)`` is the value
            a reader who makes that mistake measures.
        lesson: ``lesson(predicted, true)`` says what the gap teaches.
        read_prediction: turns the reader's prediction into a number or
            a choice (raising ``AssertionError`` with the expected shape).
    """

    title: str
    rule: str
    check_rule: Callable[[], None]
    probe: Callable[[], Any]
    remeasure: Callable[[], Any]
    what: str
    measured: Any
    predicted: Any
    measured_name: str
    predicted_name: str
    lesson: Callable[[Any, Any], str]
    library: dict = field(default_factory=dict)
    fmt: Callable[[Any], str] = lambda v: f"{v:.4g}"
    tolerance: float = 1e-9
    prediction_tolerance: float = 0.0
    measurement_mistakes: list = field(default_factory=list)
    read_prediction: Callable[[Any], Any] | None = None
    rule_hint: str = ""
    measure_hint: str = "measure with your policy plugged in, on the notebook's workload"
    stub_policy: bool = True  # a NotImplementedError from probe means the policy is untouched


def _crash(exc: BaseException) -> str:
    """The exception and the line of the reader's code it came from."""
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (line {tb[-1].lineno} in {tb[-1].name})" if tb else ""
    return f"raised {type(exc).__name__}: {exc}{where}"


def _number(value, what: str) -> float:
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise AssertionError(f"{what}: expected a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise AssertionError(f"{what}: expected a finite number, got {value!r}")
    return value


def _close(a, b, tol: float) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= tol + 1e-12 * max(1.0, abs(b))
    return a == b


def check_experiment(e: Experiment, verbose: bool = True) -> CheckReport:
    """Grade one modify-and-measure task (see the module docstring); one line per property."""
    state: dict = {}
    with Checker(e.title, verbose=verbose) as c:
        if e.stub_policy:
            c.probe(e.probe)
        if e.library:
            try:
                used = library_calls(e.probe, e.library)
            except Exception:  # noqa: BLE001 -- the properties say what
                used = []
            if used:
                result = PropertyResult(
                    f"{e.rule} (your own code)", False,
                    f"it calls the library's {used[0]}. Diagnosis: {DELEGATED.name} -- the policy "
                    "asked for is a different rule from the library's, so calling it measures "
                    "the library's rule, not yours. Write the rule yourself")
                c.report.results.append(result)
                if verbose:
                    print(result.line())
                state["delegated"] = True

        def rule_body():
            try:
                e.check_rule()
            except (AssertionError, NotImplementedError):
                raise
            except Exception as exc:  # noqa: BLE001 -- the reader's crash, named with its line
                raise WrongAnswer(_crash(exc), CRASH.diagnosis()) from None

        if not state.get("delegated"):
            c.prop(e.rule, rule_body, e.rule_hint)

        def measure_body():
            if e.measured is None:
                raise AssertionError(NO_VALUE.format(variable=e.measured_name))
            got = e.measured
            if isinstance(e.measured, (int, float)) or not isinstance(e.measured, str):
                got = _number(e.measured, e.measured_name)
            try:
                true = e.remeasure()
            except NotImplementedError:
                raise
            except AssertionError:
                raise
            except Exception as exc:  # noqa: BLE001 -- the reader's policy crashed in the workload
                raise WrongAnswer(
                    f"the checker could not measure your policy: it {_crash(exc)}",
                    CRASH.diagnosis())
            state["true"] = true
            if not _close(got, true, e.tolerance):
                mistake = None
                for m in e.measurement_mistakes:
                    try:
                        if m.model is not None and _close(got, m.model(true), e.tolerance):
                            mistake = m.diagnosis()
                            break
                    except Exception:  # noqa: BLE001 -- a model that cannot run does not match
                        continue
                raise WrongAnswer(f"{e.measured_name} = {e.fmt(got)}, but {e.what} with your "
                                  f"policy is {e.fmt(true)}", mistake)

        c.prop(f"{e.measured_name}: {e.what} with your policy", measure_body, e.measure_hint)

        def prediction_body():
            if e.predicted is None:
                raise AssertionError(f"no prediction recorded: write it into {e.predicted_name} "
                                     "before you measure")
            got = e.read_prediction(e.predicted) if e.read_prediction else _number(
                e.predicted, e.predicted_name)
            if "true" not in state:
                raise AssertionError("nothing to compare it with until the measurement above holds")
            true = state["true"]
            if isinstance(got, (int, float)) and isinstance(true, (int, float)):
                gap = f"off by {e.fmt(abs(got - true))}"
            else:
                gap = "a different outcome"
            if not _close(got, true, e.prediction_tolerance):
                raise WrongAnswer(f"you predicted {e.fmt(got)}, the measurement is {e.fmt(true)} "
                                  f"({gap})", e.lesson(got, true))

        name = f"{e.predicted_name}: your prediction against the measurement"
        try:  # a passing line says how close too: the reader sees the gap either way
            got = e.read_prediction(e.predicted) if e.read_prediction else _number(
                e.predicted, e.predicted_name)
            if "true" in state and _close(got, state["true"], e.prediction_tolerance):
                name += f" (you predicted {e.fmt(got)}, measured {e.fmt(state['true'])})"
        except Exception:  # noqa: BLE001 -- the property below says what is wrong with it
            pass
        c.prop(name, prediction_body,
               "compare the two and ask which part of the mechanism you left out")
    return c.report


def percent_mistake(unit: str = "fraction") -> Mistake:
    """The measurement given in percent where a fraction was asked."""
    return Mistake("a percentage", f"store the {unit} (0.25, not 25)", lambda true: 100 * true)
