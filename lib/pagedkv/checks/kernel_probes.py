"""What the kernel checkers (exercises 5 and 7) need to see inside a launch.

* ``count_triton_launches``: how many Triton kernels a call launched.
* ``skipped_triton_launches``: run a call with every launch skipped and
  every fresh ``torch.empty*`` buffer poisoned (NaN, or an integer sentinel).
  If the answer is still right, PyTorch computed it, not the kernel: a
  learner who computes the result in PyTorch and launches a kernel that does
  nothing is caught, whatever PyTorch functions they used.
* ``guarded_rows`` and ``traced_loads``: hand a kernel a table that is a view
  into a larger buffer with guard rows, and record the address of every live
  lane of every ``tl.load`` (in Triton's interpreter only: compiled kernels
  cannot be traced). ``loads_in`` then counts the loads a kernel made into
  any region of that buffer, so a checker can name an unmasked load that
  reads outside what it may read, even when the value it read is discarded.
  ``guarded_copy`` does the same for any tensor (the guard rows hold a
  poison value of its dtype).
* ``guarded_allocations``: every buffer a call allocates (``torch.empty``,
  ``empty_like``, ``zeros``, ``clone``, ...) is handed out as a view into a
  larger buffer whose tail holds a sentinel. A kernel that stores past the
  end of its output (an unmasked row of padding, say) writes into that tail,
  not into someone else's memory, and ``overruns()`` says so afterwards; this
  works compiled as well as interpreted, since it reads values, not traces.
* ``traced_accesses``: like ``traced_loads``, for loads and stores both, each
  access tagged with the program that made it (the kernel puzzles draw what
  every program read and wrote, and count the bytes moved).
* ``inputs_changed_at_launch``: at a call's first launch, just before the
  kernel runs, the inputs take new values (in place, and in the copies the
  wrapper made of them: ``contiguous``, ``to``, ``clone``, a padded copy).
  A kernel that computes from its inputs answers for the new values; one
  that copies an answer PyTorch computed before the launch still answers
  for the old. Skipping launches cannot tell those two apart; this can,
  compiled as well as interpreted.

Every launch, compiled or interpreted, goes through ``run`` on the kernel
object (``kernel[grid](...)`` calls it), and every interpreted load through
``InterpreterBuilder.create_masked_load``; the context managers here patch
those Triton methods for the duration of a ``with`` and restore them after.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from .._device import default_device

__all__ = ["LaunchCount", "count_triton_launches", "skipped_triton_launches", "interpreted",
           "GUARD_BLOCK_ID", "guarded_rows", "guarded_copy", "traced_loads", "loads_in", "INT_POISON",
           "GuardedAllocations", "guarded_allocations", "SENTINEL", "Access", "traced_accesses",
           "inputs_changed_at_launch"]

#: The block id in the guard rows around a ``guarded_rows`` table.
GUARD_BLOCK_ID = 999_999
#: What a poisoned integer buffer holds (floating buffers hold NaN).
INT_POISON = -123_456_789
#: What the tail of a guarded allocation holds (in the buffer's dtype).
SENTINEL = -12_345


@dataclass
class LaunchCount:
    count: int = 0
    #: each launch's grid as given (a tuple, or the callable a launch may pass)
    grids: list = field(default_factory=list)


def kernel_classes():
    from triton.runtime.jit import JITFunction

    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # a Triton without the interpreter
        return classes
    return classes + [InterpretedFunction]


@contextmanager
def _patched_launches(counter: LaunchCount, skip: bool):
    originals = {}
    for cls in kernel_classes():
        original = cls.__dict__.get("run")
        if original is None:
            continue

        def run(self, *args, __original=original, **kwargs):
            counter.count += 1
            counter.grids.append(kwargs.get("grid"))
            return None if skip else __original(self, *args, **kwargs)

        originals[cls] = original
        cls.run = run
    try:
        yield counter
    finally:
        for cls, original in originals.items():
            cls.run = original


@contextmanager
def count_triton_launches():
    """``with count_triton_launches() as n: ...``; afterwards ``n.count`` launches ran."""
    with _patched_launches(LaunchCount(), skip=False) as counter:
        yield counter


class _PoisonedAllocations(TorchFunctionMode):
    """Fresh ``empty`` buffers come filled with NaN (or ``INT_POISON``), never with stale data."""

    FACTORIES = (torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.FACTORIES and isinstance(out, torch.Tensor):
            if out.is_floating_point():
                out.fill_(float("nan"))
            elif out.dtype != torch.bool:
                out.fill_(INT_POISON)
        return out


@contextmanager
def skipped_triton_launches():
    """``with skipped_triton_launches() as n``: launches are counted, not run; ``empty`` buffers poisoned.

    What a call returns or writes under this ``with`` is what it computes
    without its kernels: a wrapper that leaves the work to its kernel returns
    poison (or leaves its in-place outputs untouched).
    """
    with _patched_launches(LaunchCount(), skip=True) as counter, _PoisonedAllocations():
        yield counter


def interpreted() -> bool:
    """True when Triton runs in its interpreter (on a CPU): only then are loads traced."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def guarded_rows(table: torch.Tensor, guard: int = GUARD_BLOCK_ID) -> torch.Tensor:
    """``table`` on the default device, as a view with one guard row (all ``guard``) before and after.

    The view is contiguous (whole rows), so ``stride(0) == shape[1]``. A near
    miss of an unmasked load (row -1, one past the last row) lands in a guard
    row: a wrong value or a traced load, not a crash.
    """
    buf = torch.full((table.shape[0] + 2, table.shape[1]), guard, dtype=torch.int32,
                     device=default_device())
    buf[1:-1] = table.to(buf.device)
    return buf[1:-1]


def guarded_copy(x: torch.Tensor, fill: float = float("nan")) -> torch.Tensor:
    """A copy of ``x`` on the default device, as a view with one guard row (all ``fill``) before and after.

    Like ``guarded_rows`` for a tensor of any dtype and rank (rows along dim
    0); the view is contiguous. Read it with ``loads_in(addresses,
    view.view(view.shape[0], -1))``.
    """
    buf = torch.full((x.shape[0] + 2, *x.shape[1:]), fill, dtype=x.dtype, device=default_device())
    buf[1:-1] = x.to(buf.device)
    return buf[1:-1]


class GuardedAllocations(TorchFunctionMode):
    """Fresh buffers come with a guarded tail: a view of the first ``numel`` elements of a larger buffer.

    The tail holds ``SENTINEL``; ``overruns()`` lists the buffers whose tail
    changed, i.e. that a kernel wrote past the end of. Only contiguous,
    non-empty floating or integer results of the factories below are
    guarded; anything else passes through untouched.
    """

    FACTORIES = (torch.empty, torch.empty_like, torch.zeros, torch.zeros_like, torch.ones,
                 torch.ones_like, torch.full, torch.full_like, torch.empty_strided, torch.Tensor.new_empty,
                 torch.Tensor.new_zeros, torch.Tensor.new_full, torch.Tensor.new_ones, torch.Tensor.clone)

    def __init__(self):
        super().__init__()
        self.buffers: list[tuple[torch.Tensor, int, tuple]] = []  # (buffer, numel, shape)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func not in self.FACTORIES or not isinstance(out, torch.Tensor) or out.numel() == 0
                or out.dtype == torch.bool or out.is_complex() or not out.is_contiguous()):
            return out
        n = out.numel()
        buf = torch.empty(2 * n + 64, dtype=out.dtype, device=out.device)
        buf[n:] = SENTINEL
        view = buf[:n].view(out.shape)
        view.copy_(out)
        self.buffers.append((buf, n, tuple(out.shape)))
        return view

    def overruns(self) -> list[str]:
        """One line per guarded buffer written past its end: its shape and how many elements."""
        found = []
        for buf, n, shape in self.buffers:
            written = int((buf[n:] != SENTINEL).sum())
            if written:
                found.append(f"{written} element(s) past the end of a {list(shape)} buffer it allocated")
        return found

    def tails(self) -> list[tuple[int, int, tuple]]:
        """``(first byte, end byte, shape)`` of each guarded tail: a traced load there read past a buffer."""
        return [(buf.data_ptr() + n * buf.element_size(), buf.data_ptr() + buf.numel() * buf.element_size(),
                 shape) for buf, n, shape in self.buffers]


@contextmanager
def guarded_allocations():
    """``with guarded_allocations() as g: ...``; afterwards ``g.overruns()`` names the overrun buffers."""
    mode = GuardedAllocations()
    with mode:
        yield mode


@contextmanager
def traced_loads():
    """Record the addresses of every live lane of every ``tl.load`` (interpreter only; else nothing)."""
    addresses: list[np.ndarray] = []
    if not interpreted():
        yield addresses
        return
    from triton.runtime.interpreter import InterpreterBuilder

    original = InterpreterBuilder.create_masked_load

    def create_masked_load(self, ptrs, mask, *args, **kwargs):
        data = np.asarray(ptrs.data)
        live = np.broadcast_to(np.asarray(mask.data, dtype=bool), data.shape)
        addresses.append(data[live].astype(np.uint64).ravel())
        return original(self, ptrs, mask, *args, **kwargs)

    InterpreterBuilder.create_masked_load = create_masked_load
    try:
        yield addresses
    finally:
        InterpreterBuilder.create_masked_load = original


def loads_in(addresses, view: torch.Tensor, rows_before: int = 1, rows_after: int = 1) -> np.ndarray:
    """The traced loads that fell on a 2-D ``view``'s memory or its guard rows, as ``(row, column)`` pairs.

    Rows are numbered as the view's (the guard row before is -1); only
    element-aligned addresses count. An empty array when nothing was traced.
    """
    if not addresses:
        return np.zeros((0, 2), dtype=np.int64)
    size = view.element_size()
    row = view.stride(0) * size
    start = view.data_ptr() - rows_before * row
    end = view.data_ptr() + (view.shape[0] + rows_after) * row
    a = np.concatenate(addresses).astype(np.int64)
    a = a[(a >= start) & (a < end) & ((a - start) % size == 0)]
    offset = (a - view.data_ptr()) // size
    return np.stack([offset // view.stride(0), offset % view.stride(0)], axis=1)


@dataclass
class Access:
    """One interpreted ``tl.load`` or ``tl.store``: who made it and the addresses of its live lanes."""

    program: tuple[int, int, int]
    kind: str  # "load" or "store"
    addresses: np.ndarray  # int64 byte addresses, one per live lane


@contextmanager
def traced_accesses(*, any_machine: bool = False):
    """Record every live lane of every ``tl.load`` and ``tl.store`` with its program (interpreter only).

    ``with traced_accesses() as accesses: ...`` fills ``accesses`` with
    ``Access`` records in launch order; compiled kernels leave it empty.
    ``any_machine=True`` records on a GPU machine too, for kernels launched
    through ``interpreted_kernel``.
    """
    accesses: list[Access] = []
    if not (any_machine or interpreted()):
        yield accesses
        return
    from triton.runtime.interpreter import InterpreterBuilder

    load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store

    def record(builder, kind, ptrs, mask):
        data = np.asarray(ptrs.data)
        live = np.broadcast_to(np.asarray(mask.data, dtype=bool), data.shape)
        accesses.append(Access(tuple(int(i) for i in builder.grid_idx), kind,
                               data[live].astype(np.uint64).astype(np.int64).ravel()))

    def create_masked_load(self, ptrs, mask, *args, **kwargs):
        record(self, "load", ptrs, mask)
        return load(self, ptrs, mask, *args, **kwargs)

    def create_masked_store(self, ptrs, value, mask, *args, **kwargs):
        record(self, "store", ptrs, mask)
        return store(self, ptrs, value, mask, *args, **kwargs)

    InterpreterBuilder.create_masked_load = create_masked_load
    InterpreterBuilder.create_masked_store = create_masked_store
    try:
        yield accesses
    finally:
        InterpreterBuilder.create_masked_load = load
        InterpreterBuilder.create_masked_store = store


# ------------------------------------------------------------------ inputs changed under the kernel

def _copy_like():
    import torch.nn.functional as F

    funcs = [torch.Tensor.contiguous, torch.Tensor.clone, torch.clone, torch.Tensor.to,
             torch.Tensor.float, torch.Tensor.double, torch.Tensor.half, torch.Tensor.bfloat16,
             torch.Tensor.long, torch.Tensor.int, torch.Tensor.type, torch.Tensor.cuda,
             torch.Tensor.cpu, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten,
             torch.flatten, torch.Tensor.__setitem__, torch.Tensor.copy_, F.pad]
    return tuple(funcs)


def _storage(t) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None


class _Copies(TorchFunctionMode):
    """Record the value-preserving copies made of the watched tensors, to replay them later.

    Only copies (``contiguous``, ``to``, ``clone``, ``pad``, assigning a
    watched tensor into a slice of another, ...) of a watched tensor itself,
    or of such a copy, are recorded: never arithmetic, never a copy of a
    piece of one (an indexed block, say). A result PyTorch computed from the
    inputs is not replayed, so it keeps the old values.
    """

    def __init__(self, watched):
        super().__init__()
        self.known = list(watched)  # kept alive, so their ids stay theirs
        self.ids = {id(t) for t in self.known}
        self.steps: list = []  # (func, args, kwargs, out)
        self.replaying = False
        self.funcs = _copy_like()

    def _watch(self, t) -> None:
        self.known.append(t)
        self.ids.add(id(t))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.replaying or func not in self.funcs:
            return out
        in_place = func in (torch.Tensor.__setitem__, torch.Tensor.copy_)
        src = args[2] if func is torch.Tensor.__setitem__ else args[1] if func is torch.Tensor.copy_ \
            else args[0] if args else None
        target = args[0] if in_place else out
        if (id(src) in self.ids and isinstance(target, torch.Tensor)
                and _storage(target) != _storage(src)):
            self.steps.append((func, args, kwargs, None if in_place else out))
            self._watch(target)
        return out

    def replay(self) -> None:
        self.replaying = True
        try:
            for func, args, kwargs, out in self.steps:
                fresh = func(*args, **kwargs)
                if out is not None and isinstance(fresh, torch.Tensor) and fresh.shape == out.shape:
                    out.copy_(fresh)
        finally:
            self.replaying = False


@contextmanager
def inputs_changed_at_launch(changes, handed=()):
    """``changes``: ``(tensor, new_values)`` pairs, applied in place at the first launch.

    The copies the call made before launching of those tensors, or of the
    views of them in ``handed`` (what the call was given), are brought up
    to date too. Yields a ``LaunchCount``.
    """
    changes = [(t, v) for t, v in changes]
    copies = _Copies([t for t, _ in changes] + list(handed))
    counter = LaunchCount()
    originals = {}
    for cls in kernel_classes():
        original = cls.__dict__.get("run")
        if original is None:
            continue

        def run(self, *args, __original=original, **kwargs):
            if counter.count == 0:
                for t, v in changes:
                    t.copy_(v.to(t.device))
                copies.replay()
            counter.count += 1
            return __original(self, *args, **kwargs)

        originals[cls] = original
        cls.run = run
    try:
        with copies:
            yield counter
    finally:
        for cls, original in originals.items():
            cls.run = original


# ------------------------------------------------------------------ any kernel, interpreted

@contextmanager
def nested_calls_interpreted():
    """While an interpreted kernel runs, let it call compiled-mode ``@triton.jit`` functions.

    Compiled (on a GPU) Triton's own ``@jit`` helpers (``tl.max``, ``tl.sum``,
    ``tl.cdiv`` ...) are ``JITFunction`` objects that refuse a call outside a
    compiled kernel; the interpreter needs them run as Python, as it runs
    them when ``TRITON_INTERPRET=1`` was set before Triton was imported.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    original = JITFunction.__call__
    interpreted_copies: dict = {}

    def call(self, *args, **kwargs):  # keyed by id: a JITFunction's hash compiles its source
        if id(self) not in interpreted_copies:
            interpreted_copies[id(self)] = (self, InterpretedFunction(self.fn))
        return interpreted_copies[id(self)][1](*args, **kwargs)

    JITFunction.__call__ = call
    try:
        yield
    finally:
        JITFunction.__call__ = original


class InterpretedKernel:
    """``interpreted_kernel(k)[grid](...)``: ``k`` run in Triton's interpreter on any machine (CPU tensors)."""

    def __init__(self, kernel):
        from triton.runtime.interpreter import InterpretedFunction

        fn = getattr(kernel, "fn", None)
        if fn is None:
            raise TypeError(f"kernel must be a @triton.jit function, got {type(kernel).__name__} {kernel!r}")
        self.kernel = InterpretedFunction(fn)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with nested_calls_interpreted():
                return self.kernel[grid](*args, **kwargs)
        return launch


def interpreted_kernel(kernel) -> InterpretedKernel:
    """An interpreted copy of a ``@triton.jit`` kernel: ``print`` and ``breakpoint`` work inside it.

    On a CPU the library interprets every kernel already; on a GPU this copy
    still runs in Triton's interpreter (on CPU tensors), nested ``@jit``
    calls included, so a notebook can step through one program anywhere.
    """
    return InterpretedKernel(kernel)

