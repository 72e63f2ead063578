"""What every kernel puzzle's check shares: run, trace, judge, score, draw.

A puzzle is a small Triton kernel behind a wrapper. Its ``Puzzle`` spec
says how to build seeded cases, what the PyTorch reference answers, which
elements of each argument the kernel may read, which tensors carry the data
(their bytes are scored), and which common mistakes to name. The harness
runs the learner's wrapper on a case with:

* every tensor argument a ``guarded_copy`` (one guard row before and after,
  NaN for floating tensors, 0 for index tensors, so a stray index stays in
  range), so a near miss lands on the guard, not on someone else's memory;
* ``traced_accesses``: in the interpreter, every live lane of every load and
  store, with the program that made it;
* ``guarded_allocations``: a store past an allocated output, compiled or not;
* ``count_triton_launches``, and a rerun with every launch skipped
  (``skipped_triton_launches``): an answer still right was PyTorch's.

A wrong answer is named in this order: a store past an allocated buffer, a
load past one (traced), the mistake whose model gives the same answer, a
load of an element the kernel must not read (traced), the puzzle's own
explanation, NaN. The trace also gives the bytes the kernel moved in
the data tensors, counted once per load or store instruction (the lanes of
one instruction that read one address are one read; a second instruction
that reads it again is a second read), against the puzzle's minimum: the
bytes the answer depends on, read once, and the output, written once. Index
tensors (block tables, lengths) are not counted. Compiled kernels cannot be
traced: on a GPU there is no picture and no score.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from .._device import default_device
from ._harness import Checker, CheckReport, Mistake, WrongAnswer
from .interpreter_probes import OutOfBounds, bounded_accesses, dot_minimum, dot_shapes, index_products
from .puzzle_cases import (INT32_INDEX_MISTAKE, READS_A_COPY, SMALL_DOT_MISTAKE, UNMASKED_MISTAKE,
                           stray_stride_mistake)
from .kernel_probes import (count_triton_launches, guarded_allocations, guarded_copy,
                            inputs_changed_at_launch, interpreted, skipped_triton_launches,
                            traced_accesses)

__all__ = ["Case", "Puzzle", "Run", "run_case", "check_puzzle", "bytes_moved", "trace_report",
           "LAUNCH_MISTAKE", "CHEAT_MISTAKE", "COPIED_MISTAKE", "OVERRUN_MISTAKE", "TAIL_READ_MISTAKE",
           "UNMASKED_MISTAKE", "SMALL_DOT_MISTAKE", "INT32_INDEX_MISTAKE"]

LAUNCH_MISTAKE = Mistake("no kernel", "the puzzle is the kernel: the answer must come from a "
                         "@triton.jit function the wrapper launches")
CHEAT_MISTAKE = Mistake("computed outside the kernel", "with every Triton launch skipped the "
                        "answer is still right, so PyTorch computed it: the wrapper's job is "
                        "to allocate and launch, and every output value comes from the kernel")
COPIED_MISTAKE = Mistake("an answer copied, not computed", "the inputs took new values as the "
                         "kernel launched, and the output still answers the old ones: the "
                         "kernel copied a result computed before it ran. Every output value "
                         "must come from the kernel's own loads of its inputs")
OVERRUN_MISTAKE = Mistake("stores past the output", "a tile has lanes past the output's last "
                          "element: a store writes only elements that exist")
TAIL_READ_MISTAKE = Mistake("loads past a buffer it allocated", "a tile has lanes past the "
                            "buffer's last element: a load reads only elements that exist")


@dataclass
class Case:
    """One seeded input: the wrapper's arguments and what the reference answers.

    ``may_read[name]`` is a boolean mask shaped like argument ``name``: the
    elements the kernel may load (an argument without a mask may be read
    whole; its guard rows never). ``minimum`` is the bytes an answer must
    move in the data tensors.
    """

    label: str
    args: dict
    want: Any
    may_read: dict = field(default_factory=dict)
    minimum: int = 0
    info: dict = field(default_factory=dict)  # whatever a puzzle's mistake models need
    #: ``views[name](tensor)``: the argument handed over is this view of the
    #: (guarded) tensor, a slice of a wider buffer, say; ``may_read`` is over
    #: the whole tensor.
    views: dict = field(default_factory=dict)
    #: what each data tensor must move at least, by name (the picture's
    #: sentence on the waste compares with these); sums to ``minimum``.
    needs: dict = field(default_factory=dict)


@dataclass
class Puzzle:
    """A puzzle's spec; see the module docstring."""

    title: str
    properties: list  # (name, [Case, ...]) in the order the check prints them
    data: tuple  # argument names whose bytes are scored; "out" is the returned tensor(s)
    mistakes: list = field(default_factory=list)  # (Mistake, model(case) -> answer)
    read_mistake: Callable | None = None  # (case, name, bad element indices) -> Mistake
    nan_mistake: Mistake | None = None  # a NaN in the output that nothing else explains
    result: Callable | None = None  # (returned, args) -> what to compare; default: returned
    atol: float = 2e-4
    picture: Callable | None = None  # (case, run) -> str
    cheat_case: Case | None = None
    extra: list = field(default_factory=list)  # more (name, body(fn)) properties
    explain: Callable | None = None  # (case, got) -> Mistake | None, after the models
    #: what a store past the output means here: a Mistake, or (case, overrun) -> Mistake
    overrun_mistake: Any = None
    tail_read_mistake: Mistake | None = None  # a load past the end of a buffer the wrapper allocated
    guard_rows: int = 1  # guard rows around every tensor argument
    #: ``answer(given) -> want``: the reference on the arguments as handed over
    #: (for the inputs changed at launch); ``None``: that check is not made.
    answer: Callable | None = None
    #: ``changes(case) -> {name: new value}``: what the inputs become at launch;
    #: by default every floating data tensor gets fresh values, poison kept.
    changes: Callable | None = None
    #: index tensors (block tables, pairs) whose products must be int64
    index_args: tuple = ()
    #: ``(Mistake, variant(case) -> Case)``: the mistake when fn is right on the variant
    passes_when: list = field(default_factory=list)


@dataclass
class Run:
    """What one call did: its answer and, in the interpreter, every access it made."""

    got: Any
    args: dict
    accesses: list
    overruns: list
    launches: int
    tails: list = field(default_factory=list)  # guarded tails of the buffers the call allocated
    dots: list = field(default_factory=list)  # every tl.dot's DotShape (interpreter only)
    grids: list = field(default_factory=list)  # every launch's grid


def _guarded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A copy of ``t`` on the default device, ``rows`` guard rows before and after.

    Floating guards hold NaN; integer guards hold 0, so that an index read
    from a guard still points inside the tensors it indexes.
    """
    fill = float("nan") if t.is_floating_point() else 0
    if rows == 1:
        return guarded_copy(t, fill)
    buf = torch.full((t.shape[0] + 2 * rows, *t.shape[1:]), fill, dtype=t.dtype, device=default_device())
    buf[rows:-rows] = t.to(buf.device)
    return buf[rows:-rows]


def run_case(fn, case: Case, puzzle: Puzzle) -> Run:
    """Run ``fn`` on guarded device copies of ``case``'s arguments; record what it touched.

    ``Run.args`` holds the guarded tensors (not the views handed over), so
    that the trace is read against the whole of each.
    """
    def guard(v):
        if isinstance(v, torch.Tensor):
            return _guarded(v, puzzle.guard_rows)
        if isinstance(v, list) and v and all(isinstance(t, torch.Tensor) for t in v):
            return [_guarded(t, puzzle.guard_rows) for t in v]  # a list of caches, say
        return v

    args = {k: guard(v) for k, v in case.args.items()}
    given = {k: case.views[k](v) if k in case.views else v for k, v in args.items()}
    # A wrong kernel's NaN and overflows are the check's to report, not numpy's warnings.
    with count_triton_launches() as n, traced_accesses() as acc, guarded_allocations() as allocs, \
            dot_shapes() as dots:
        got = _bounded_call(fn, given, args, case, puzzle)
    got = puzzle.result(got, args) if puzzle.result else got
    return Run(got, args, acc, allocs.overruns(), n.count, allocs.tails(), list(dots), n.grids)


def _bounded_call(fn, given: dict, args: dict, case: Case, puzzle: Puzzle):
    """``fn(**given)``, every interpreted load and store held inside the tensors it can reach.

    A lane outside them is stopped before it happens (in the interpreter it
    would have killed the process) and named. NaN and overflow warnings of a
    wrong kernel are the check's to report, not numpy's.
    """
    with bounded_accesses(_named_tensors(args)) as bounds, np.errstate(all="ignore"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            return fn(**given)
        except Exception as exc:  # noqa: BLE001 -- a stray lane is named; anything else is the learner's
            if bounds.violation is None:
                raise
            # The puzzle's own name for a stray read of that tensor, where it has one.
            mistake = None
            if puzzle.read_mistake is not None and bounds.tensor is not None:
                mistake = puzzle.read_mistake(case, bounds.tensor, bounds.flat)
            if mistake is None and puzzle.read_mistake is not None:
                mistake = stray_stride_mistake(case, bounds)
            raise WrongAnswer(f"{case.label}: {bounds.violation}",
                              (mistake or UNMASKED_MISTAKE).diagnosis()) from exc


def _named_tensors(args: dict) -> dict:
    """Every tensor argument by name; a list of tensors as ``name[i]``."""
    out = {}
    for k, v in args.items():
        if isinstance(v, torch.Tensor):
            out[k] = v
        elif isinstance(v, list):
            out.update({f"{k}[{i}]": t for i, t in enumerate(v) if isinstance(t, torch.Tensor)})
    return out


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _compare(got, want, atol: float) -> str | None:
    """``None`` when ``got`` equals ``want`` (within ``atol``), else what differs."""
    got, want = _as_tuple(got), _as_tuple(want)
    if len(got) != len(want):
        return f"expected {len(want)} tensor(s), got {len(got)}"
    for i, (g, w) in enumerate(zip(got, want)):
        what = f"output {i}" if len(want) > 1 else "the output"
        if not isinstance(g, torch.Tensor):
            return f"{what}: expected a torch.Tensor, got {type(g).__name__}"
        if tuple(g.shape) != tuple(w.shape):
            return f"{what}: expected shape {tuple(w.shape)}, got {tuple(g.shape)}"
        if g.dtype != w.dtype:
            return f"{what}: expected dtype {w.dtype}, got {g.dtype}"
        g, w = g.detach().cpu(), w.cpu()
        if w.is_floating_point():
            if not torch.allclose(g, w, atol=atol, rtol=atol, equal_nan=True):
                bad = ~torch.isclose(g, w, atol=atol, rtol=atol, equal_nan=True)
                idx = tuple(int(i) for i in bad.nonzero()[0])
                return f"{what}: at {list(idx)} expected {float(w[idx]):.4g}, got {float(g[idx]):.4g}"
        elif not torch.equal(g, w):
            idx = tuple(int(i) for i in (g != w).nonzero()[0])
            return f"{what}: at {list(idx)} expected {int(w[idx])}, got {int(g[idx])}"
    return None


def _region(t: torch.Tensor, rows_before: int = 0, rows_after: int = 0):
    """(start, end, element size) of a contiguous tensor's bytes, with guard rows."""
    size = t.element_size()
    row = (t.stride(0) if t.dim() else 1) * size
    return t.data_ptr() - rows_before * row, t.data_ptr() + t.numel() * size + rows_after * row, size


def elements(addresses: np.ndarray, t: torch.Tensor, guards: int = 0) -> np.ndarray:
    """Flat element indices (guard rows negative or past numel) of the addresses on ``t``."""
    start, end, size = _region(t, guards, guards)
    a = addresses[(addresses >= start) & (addresses < end)]
    a = a[(a - t.data_ptr()) % size == 0]
    return (a - t.data_ptr()) // size


def forbidden_reads(run: Run, case: Case, guards: int = 1) -> tuple[str, np.ndarray] | None:
    """The first argument the kernel read outside its ``may_read`` mask: (name, flat indices)."""
    loads = [a.addresses for a in run.accesses if a.kind == "load"]
    if not loads:
        return None
    addresses = np.concatenate(loads)
    for name, t in _named_tensors(run.args).items():
        idx = np.unique(elements(addresses, t, guards=guards))
        mask = case.may_read.get(name)
        allowed = np.ones(t.numel(), dtype=bool) if mask is None else mask.reshape(-1).numpy()
        inside = (idx >= 0) & (idx < t.numel())
        bad = np.concatenate([idx[~inside], idx[inside][~allowed[idx[inside]]]])
        if bad.size:
            return name, np.sort(bad)
    return None


def _out_tensors(run: Run) -> list:
    return [t for t in _as_tuple(run.got) if isinstance(t, torch.Tensor)]


def bytes_moved(run: Run, data: tuple, kind: str | None = None) -> dict:
    """Bytes each data tensor moved, counted once per instruction per address.

    ``kind``: ``"load"`` or ``"store"`` to count only those; both by default.
    """
    named = _named_tensors(run.args)
    tensors = {k: t for k, t in named.items() if k.split("[")[0] in data}
    if "out" in data:
        for i, t in enumerate(_out_tensors(run)):
            tensors[f"out{i}" if len(_out_tensors(run)) > 1 else "out"] = t
    moved = dict.fromkeys(tensors, 0)
    for a in run.accesses:
        if kind is not None and a.kind != kind:
            continue
        for name, t in tensors.items():
            moved[name] += int(np.unique(elements(a.addresses, t)).size) * t.element_size()
    return moved


def _explain(case: Case, moved: dict, loaded: dict) -> str:
    """The score line and, when it is over 1.00x, one sentence on the tensor that moved too much."""
    total = sum(moved.values())
    score = total / case.minimum
    line = f"bytes moved: {total:,} against a minimum of {case.minimum:,}: {score:.2f}x"
    needs = case.needs
    if round(score, 2) <= 1.0 or not needs:
        return line
    name = max(moved, key=lambda k: moved[k] - needs.get(k, 0))
    extra = moved[name] / needs[name] if needs.get(name) else float("inf")
    how = {(True, False): "read", (False, True): "written"}.get(
        (loaded[name] > 0, moved[name] > loaded[name]), "read and written")
    return (f"{line}\nthe waste: {name}, {how} {moved[name]:,} bytes where "
            f"{needs.get(name, 0):,} would do ({extra:.2f}x)")


def trace_report(puzzle: Puzzle, fn, case: Case) -> str:
    """The picture and the bytes score of ``fn`` on ``case`` (interpreter only), as text."""
    if not interpreted():
        return ("compiled kernels cannot be traced: run this cell on a CPU (Triton's "
                "interpreter) for the picture and the bytes score")
    try:
        run = run_case(fn, case, puzzle)
    except NotImplementedError:
        return "not implemented yet"
    lines = []
    if puzzle.picture is not None:
        lines.append(puzzle.picture(case, run))
    problem = _compare(run.got, case.want, puzzle.atol)
    if problem:
        lines.append(f"(the answer is wrong: {problem})")
    lines.append(_explain(case, bytes_moved(run, puzzle.data), bytes_moved(run, puzzle.data, "load")))
    return "\n".join(lines)


def _tail_reads(run: Run) -> str | None:
    """Describe the first traced load past the end of a buffer the call allocated (``None``: none)."""
    loads = [a.addresses for a in run.accesses if a.kind == "load"]
    if not loads:
        return None
    addresses = np.concatenate(loads)
    for start, end, shape in run.tails:
        n = int(((addresses >= start) & (addresses < end)).sum())
        if n:
            return f"{n} element(s) past the end of a {list(shape)} buffer it allocated"
    return None


def _small_dots(run: Run) -> str | None:
    """The first tl.dot the compiled target would refuse, described (``None``: none)."""
    for d in run.dots:
        m, n, k = dot_minimum(d.bits)
        if d.m < m or d.n < n or d.k < k:
            return (f"a tl.dot of {d} has K = {d.k}: Triton's compiled target needs K >= {k} "
                    f"(and M >= {m}, N >= {n})")
    return None


def _right_on_variant(puzzle: Puzzle, fn, case: Case, problem: str) -> None:
    """Name a mistake whose variant of ``case`` ``fn`` answers right (see ``Puzzle.passes_when``)."""
    for mistake, make in puzzle.passes_when:
        try:
            variant = make(case)
            right = variant is not None and _compare(
                run_case(fn, variant, puzzle).got, variant.want, puzzle.atol) is None
        except Exception:  # noqa: BLE001 -- it cannot tell here
            right = False
        if right:
            raise WrongAnswer(f"{case.label}: {problem}", mistake.diagnosis())


def _diagnose(puzzle: Puzzle, case: Case, run: Run, problem: str | None, fn=None) -> None:
    """Raise the ``WrongAnswer`` that names what went wrong, if anything did."""
    small = _small_dots(run)
    if small:
        raise WrongAnswer(f"{case.label}: {small}", SMALL_DOT_MISTAKE.diagnosis())
    if run.overruns:
        mistake = puzzle.overrun_mistake or OVERRUN_MISTAKE
        if callable(mistake):
            mistake = mistake(case, run.overruns[0])
        raise WrongAnswer(f"{case.label}: it wrote {run.overruns[0]}", mistake.diagnosis())
    past = _tail_reads(run)
    if past:
        raise WrongAnswer(f"{case.label}: it loaded {past}",
                          (puzzle.tail_read_mistake or TAIL_READ_MISTAKE).diagnosis())
    # A model that answers the same (NaN where it reads poison too) names the mistake best.
    for mistake, model in puzzle.mistakes if problem else ():
        try:
            if _compare(run.got, model(case), puzzle.atol) is None:
                raise WrongAnswer(f"{case.label}: {problem}", mistake.diagnosis())
        except WrongAnswer:
            raise
        except Exception:  # noqa: BLE001 -- a model that cannot run here does not match
            continue
    bad = forbidden_reads(run, case, puzzle.guard_rows)
    if bad is not None:
        name, idx = bad
        mistake = puzzle.read_mistake(case, name, idx) if puzzle.read_mistake else None
        raise WrongAnswer(f"{case.label}: it loaded {idx.size} element(s) of {name} it must not "
                          f"read (flat index {int(idx[0])}, a poisoned or guard element)",
                          mistake.diagnosis() if mistake else None)
    if problem is None:
        return
    if fn is not None:
        _right_on_variant(puzzle, fn, case, problem)
    if puzzle.explain is not None:
        mistake = puzzle.explain(case, run.got)
        if mistake is not None:
            raise WrongAnswer(f"{case.label}: {problem}", mistake.diagnosis())
    nan = any(isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape == w.shape
              and bool((torch.isnan(t.cpu()) & ~torch.isnan(w)).any())
              for t, w in zip(_as_tuple(run.got), _as_tuple(case.want)))
    if nan and puzzle.nan_mistake:
        raise WrongAnswer(f"{case.label}: {problem} (NaN or inf)", puzzle.nan_mistake.diagnosis())
    raise WrongAnswer(f"{case.label}: {problem}")


def _device_copy(v):
    if isinstance(v, list):
        return [_device_copy(t) for t in v]
    return v.to(default_device(), copy=True) if isinstance(v, torch.Tensor) else v


def _handed(case: Case, args: dict) -> dict:
    return {k: case.views[k](v) if k in case.views else v for k, v in args.items()}


def _refresh(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Fresh values shaped like ``t``; its non-finite entries (poison, -inf) stay as they are."""
    new = torch.randn(t.shape, generator=g).to(t.dtype)
    keep = ~torch.isfinite(t)
    new[keep] = t[keep]
    return new


def fresh_inputs(case: Case, puzzle: Puzzle) -> dict:
    """The default change at launch: fresh values for every floating data tensor among the inputs."""
    g = torch.Generator().manual_seed(4242)
    out = {}
    for name, v in case.args.items():
        if name not in puzzle.data:
            continue
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            out[name] = _refresh(v, g)
        elif isinstance(v, list) and v and all(isinstance(t, torch.Tensor) and t.is_floating_point()
                                               for t in v):
            out[name] = [_refresh(t, g) for t in v]
    return out


def _follows_its_inputs(puzzle: Puzzle, fn, case: Case) -> None:
    """Change the inputs as the kernel launches: the answer must be the new inputs' answer."""
    changes = (puzzle.changes or fresh_inputs)(case, puzzle) if puzzle.answer else {}
    if not changes:
        return
    args = {k: _device_copy(v) for k, v in case.args.items()}
    new_args = {**case.args, **changes}
    want = puzzle.answer(_handed(case, new_args))
    pairs = []
    for name, value in changes.items():
        if isinstance(value, list):
            pairs += list(zip(args[name], value))
        else:
            pairs.append((args[name], value))
    given = _handed(case, args)
    handed = [given[name] for name in changes if isinstance(given[name], torch.Tensor)]
    with inputs_changed_at_launch(pairs, handed):
        got = _bounded_call(fn, given, args, case, puzzle)
    got = puzzle.result(got, args) if puzzle.result else got
    if _compare(got, want, puzzle.atol) is None:
        return
    what = f"{case.label}: the inputs ({', '.join(changes)}) took new values as the kernel launched"
    if _compare(got, case.want, puzzle.atol) is None:
        raise WrongAnswer(f"{what}, and the output still answers the old ones",
                          COPIED_MISTAKE.diagnosis())
    # Merely wrong (the lines above say how) when it answers the new inputs handed over as such.
    fresh_args = {k: _device_copy(v) for k, v in new_args.items()}
    own = _bounded_call(fn, _handed(case, fresh_args), fresh_args, case, puzzle)
    own = puzzle.result(own, fresh_args) if puzzle.result else own
    if _compare(got, own, puzzle.atol) is None:
        return
    raise WrongAnswer(f"{what}, and the output answers neither: {_compare(got, want, puzzle.atol)}",
                      READS_A_COPY.diagnosis())


def _index_arithmetic(puzzle: Puzzle, fn, case: Case) -> None:
    """No product of a loaded index in int32; no index tensor handed over narrowed to int32."""
    from .interpreter_probes import on_launch

    args = {k: _guarded(v, puzzle.guard_rows) if isinstance(v, torch.Tensor) else _device_copy(v)
            for k, v in case.args.items()}
    named = {k: args[k] for k in puzzle.index_args}
    storages = {t.untyped_storage().data_ptr() for t in _named_tensors(args).values()}

    def like(t: torch.Tensor):
        for name, idx in named.items():
            if (not t.is_floating_point() and t.dtype != torch.bool and t.dim() == idx.dim()
                    and t.shape[0] == idx.shape[0] and t.untyped_storage().data_ptr() not in storages):
                return name
        return None

    narrowed = []

    def handed(tensors):
        for t in tensors:
            name = like(t)
            if name and t.element_size() < named[name].element_size():
                narrowed.append(f"the kernel is handed {name} as {str(t.dtype)[6:]}, not "
                                f"{str(named[name].dtype)[6:]} as given")

    with index_products(named, like) as found, on_launch(handed):
        _bounded_call(fn, _handed(case, args), args, case, puzzle)
    if found or narrowed:
        what = str(found[0]) if found else narrowed[0]
        raise WrongAnswer(f"{case.label}: {what}", INT32_INDEX_MISTAKE.diagnosis())


def check_puzzle(puzzle: Puzzle, fn, timeout: float = 60.0) -> CheckReport:
    """Run every property of ``puzzle`` on ``fn``; print one line each."""
    launches: list[int] = []
    with Checker(puzzle.title, timeout=timeout) as c:
        first = puzzle.properties[0][1][0]
        c.probe(lambda: run_case(fn, first, puzzle))

        def cases_hold(cases):
            def body():
                for case in cases:
                    run = run_case(fn, case, puzzle)
                    launches.append(run.launches)
                    _diagnose(puzzle, case, run, _compare(run.got, case.want, puzzle.atol), fn)
            return body

        for name, cases in puzzle.properties:
            c.prop(name, cases_hold(cases), "compare one case by hand with the reference above")
        for name, body in puzzle.extra:
            c.prop(name, lambda body=body: body(fn))
        if puzzle.index_args:
            c.prop("multiplies block ids in int64 (offsets pass 2**31)",
                   lambda: _index_arithmetic(puzzle, fn, first))

        def in_a_kernel():
            if not launches:
                raise WrongAnswer("no case ran to its end, so there is nothing to judge here "
                                  "(the lines above say why)")
            if min(launches) == 0:
                raise WrongAnswer("some call ran no Triton kernel", LAUNCH_MISTAKE.diagnosis())
            case = puzzle.cheat_case or first
            args = {k: _device_copy(v) for k, v in case.args.items()}
            with skipped_triton_launches():
                got = fn(**_handed(case, args))
            got = puzzle.result(got, args) if puzzle.result else got
            if _compare(got, case.want, puzzle.atol) is None:
                raise WrongAnswer("with every Triton launch skipped, the answer is still right",
                                  CHEAT_MISTAKE.diagnosis())
            _follows_its_inputs(puzzle, fn, case)

        c.prop("computes in a Triton kernel, from its inputs", in_a_kernel)
    return c.report


# ----------------------------------------------------------------- the picture

MARKS = {(False, False): ".", (True, False): "r", (False, True): "w", (True, True): "b"}
LEGEND = "r read, w written, b both, ! read but must not be, . untouched"


def access_grid(run: Run, case: Case, name: str, units: int, group: int, what: str,
                max_programs: int = 12) -> str:
    """One line per program: which units of tensor ``name`` it read and wrote.

    The tensor is seen as ``units`` rows (a cache's slots, say: ``[num_blocks
    * block_size, ...]``), drawn ``group`` to a cell (a block). ``name`` may
    be ``"out"``: the returned tensor. Units read outside ``may_read`` show
    ``!``. Fits 79 columns when ``units + units / group`` is at most 64.
    """
    t = _out_tensors(run)[0] if name == "out" else run.args[name]
    per_unit = t.numel() // units
    mask = case.may_read.get(name)
    allowed = None if mask is None else mask.reshape(units, per_unit).all(1).numpy()
    programs = sorted({a.program for a in run.accesses})
    header = " " * 11 + " ".join(f"{what}{i}".ljust(group)[:group] for i in range(units // group))
    lines = [header.rstrip()]
    for p in programs[:max_programs]:
        read, wrote = np.zeros(units, bool), np.zeros(units, bool)
        for a in run.accesses:
            if a.program != p:
                continue
            idx = elements(a.addresses, t)
            idx = idx[(idx >= 0) & (idx < t.numel())] // per_unit
            (read if a.kind == "load" else wrote)[idx] = True
        cells = []
        for u in range(units):
            bad = read[u] and allowed is not None and not allowed[u]
            cells.append("!" if bad else MARKS[bool(read[u]), bool(wrote[u])])
        row = " ".join("".join(cells[i:i + group]) for i in range(0, units, group))
        label = "(" + ",".join(str(i) for i in p[:max(1, _grid_rank(programs))]) + ")"
        lines.append(f"{label:<10} {row}".rstrip())
    if len(programs) > max_programs:
        lines.append(f"... and {len(programs) - max_programs} more programs")
    return "\n".join(lines)


def _grid_rank(programs) -> int:
    """How many grid axes the launch used (1 to 3), for short program labels."""
    used = [any(p[i] for p in programs) for i in range(3)]
    return max([i + 1 for i, u in enumerate(used) if u], default=1)
