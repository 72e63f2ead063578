"""What the kernel checkers see inside Triton's interpreter, beyond the loads.

``kernel_probes`` traces addresses; this module watches the interpreter's
builder, the object every ``tl.*`` operation of an interpreted kernel goes
through (``triton.runtime.interpreter.InterpreterBuilder``), for three
mistakes a CPU run cannot show in the values:

* ``bounded_accesses``: every live lane of every ``tl.load`` and ``tl.store``
  must lie inside some tensor the kernel could have been handed (the
  launch's tensor arguments, and the tensors a checker names). One that does
  not raises ``OutOfBounds`` *before* the access: an unmasked load that
  would have crashed the interpreter (a segfault, the notebook's kernel
  dead) becomes a red line naming the load and the tensor it overran.
* ``dot_shapes``: every ``tl.dot``'s operand shapes, held against the
  compiled target's minimum (Triton's NVIDIA backend: the inner dimension K
  at least 16, 32 for 8-bit types; M and N may be smaller, Triton pads
  them). The interpreter accepts any shape; a GPU compile refuses these.
* ``index_products``: a value loaded from a block table (or any index tensor
  named) is followed through the kernel's arithmetic, and a product computed
  in int32 is recorded. Its overflow needs a pool of 2**31 elements (8 GiB of
  fp32) to show in the values, more than a check can allocate; the dtype
  shows it at any size.

Compiled kernels never reach the builder: on a GPU these record nothing.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from .kernel_probes import interpreted

__all__ = ["on_launch", "OutOfBounds", "bounded_accesses", "DotShape", "dot_shapes", "dot_minimum",
           "IndexProduct", "index_products"]

_MARK = "pagedkv_index"  # the TensorHandle attribute that carries an index's name


def _builder():
    from triton.runtime.interpreter import InterpreterBuilder

    return InterpreterBuilder


def _launch_classes():
    from .kernel_probes import kernel_classes

    return kernel_classes()


def _tensors_in(values) -> list[torch.Tensor]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += _tensors_in(v)
    return out


@contextmanager
def on_launch(callback):
    """Call ``callback(tensor arguments)`` at every launch, before the kernel runs."""
    originals = {}
    for cls in _launch_classes():
        original = cls.__dict__.get("run")
        if original is None:
            continue

        def run(self, *args, __original=original, **kwargs):
            callback(_tensors_in(list(args) + list(kwargs.values())))
            return __original(self, *args, **kwargs)

        originals[cls] = original
        cls.run = run
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.run = original


# ------------------------------------------------------------------ bounds

class OutOfBounds(Exception):
    """A lane of a load or store outside every tensor the kernel could reach."""


def _storage_region(t: torch.Tensor) -> tuple[int, int, str]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


@dataclass
class Bounds:
    """What ``bounded_accesses`` saw: the first access out of bounds, described."""

    named: dict  # name -> tensor (the checker's names, for the message)
    regions: list = field(default_factory=list)  # (start, end) byte ranges
    violation: str | None = None
    tensor: str | None = None  # the named tensor nearest the first stray lane
    flat: np.ndarray | None = None  # the stray lanes as flat element indices of that tensor
    bad: np.ndarray | None = None  # the stray lanes' addresses

    def flat_of(self, name: str) -> np.ndarray:
        """The stray lanes as flat element indices of the named tensor, whichever lies nearest:
        a lane meant for a cache but run past its end may land nearer another tensor."""
        t = self.named[name]
        return np.sort((self.bad - t.data_ptr()) // t.element_size())

    def add(self, tensors) -> None:
        for t in tensors:
            if t.device.type == "cpu" and t.numel():
                self.regions.append(_storage_region(t))

    def _nearest(self, address: int) -> tuple[str | None, str]:
        best, words = None, "no tensor it was handed"
        gap = None
        for name, t in self.named.items():
            size = t.element_size()
            start = t.data_ptr()
            end = start + t.numel() * size
            d = address - end if address >= end else start - address
            if gap is None or d < gap:
                gap = d
                if address >= end:
                    count, where = d // size + 1, "past the last element of"
                else:
                    count, where = -(-d // size), "before the first element of"
                best, words = name, f"{count} element(s) {where} {name}"
        return best, words

    def check(self, kind: str, addresses: np.ndarray, itemsize: int) -> None:
        if not addresses.size or not self.regions:
            return
        ok = np.zeros(addresses.shape, dtype=bool)
        for start, end in self.regions:
            ok |= (addresses >= start) & (addresses + itemsize <= end)
        if ok.all():
            return
        bad = addresses[~ok]
        self.bad = bad
        self.tensor, where = self._nearest(int(bad[0]))
        if self.tensor is not None:
            t = self.named[self.tensor]
            self.flat = np.sort((bad - t.data_ptr()) // t.element_size())
        self.violation = (f"{bad.size} lane(s) of a tl.{kind} lay outside every tensor the kernel "
                          f"could reach (the first, {where})")
        raise OutOfBounds(self.violation)


@contextmanager
def bounded_accesses(named: dict):
    """Refuse, before it happens, any interpreted load or store outside the reachable tensors.

    ``named`` maps names to the tensors a checker handed over (their whole
    storage, guard rows included, is reachable); every tensor argument of a
    launch is reachable too. Yields a ``Bounds``: after an ``OutOfBounds``
    (which the interpreter re-raises wrapped in its own error),
    ``bounds.violation`` says what and ``bounds.tensor`` which tensor.
    """
    bounds = Bounds({k: v for k, v in named.items() if isinstance(v, torch.Tensor)})
    bounds.add(bounds.named.values())
    if not interpreted():
        yield bounds
        return
    builder = _builder()
    load, store = builder.create_masked_load, builder.create_masked_store

    def live(ptrs, mask):
        data = np.asarray(ptrs.data)
        on = np.broadcast_to(np.asarray(mask.data, dtype=bool), data.shape)
        return data[on].astype(np.uint64).astype(np.int64).ravel()

    def itemsize(ptrs):
        return max(1, ptrs.get_element_ty().primitive_bitwidth // 8)

    def create_masked_load(self, ptrs, mask, *args, **kwargs):
        bounds.check("load", live(ptrs, mask), itemsize(ptrs))
        return load(self, ptrs, mask, *args, **kwargs)

    def create_masked_store(self, ptrs, value, mask, *args, **kwargs):
        bounds.check("store", live(ptrs, mask), itemsize(ptrs))
        return store(self, ptrs, value, mask, *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = create_masked_load, create_masked_store
    try:
        with on_launch(bounds.add):
            yield bounds
    finally:
        builder.create_masked_load, builder.create_masked_store = load, store


# ------------------------------------------------------------------ tl.dot

@dataclass(frozen=True)
class DotShape:
    """One interpreted ``tl.dot``: ``[M, K] x [K, N]``, and its operands' bits."""

    m: int
    n: int
    k: int
    bits: int

    def __str__(self) -> str:
        return f"[{self.m}, {self.k}] x [{self.k}, {self.n}]"


def dot_minimum(bits: int) -> tuple[int, int, int]:
    """``(M, N, K)``: the smallest ``tl.dot`` Triton's NVIDIA backend compiles for operands of ``bits``."""
    try:
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import min_dot_size

        dtype = {8: tl.float8e4nv, 16: tl.float16, 32: tl.float32, 64: tl.float64}.get(bits, tl.float32)
        return tuple(min_dot_size(GPUTarget("cuda", 90, 32))(dtype, dtype))
    except Exception:  # noqa: BLE001 -- a Triton without the NVIDIA backend: its documented rule
        return (1, 1, 32 if bits == 8 else 16)


@contextmanager
def dot_shapes():
    """Record the shape of every interpreted ``tl.dot`` (a list of ``DotShape``; compiled: empty)."""
    seen: list[DotShape] = []
    if not interpreted():
        yield seen
        return
    builder = _builder()
    original = builder.create_dot

    def create_dot(self, a, b, d, *args, **kwargs):
        sa, sb = np.shape(a.data), np.shape(b.data)
        seen.append(DotShape(int(sa[-2]), int(sb[-1]), int(sa[-1]), int(a.dtype.primitive_bitwidth)))
        return original(self, a, b, d, *args, **kwargs)

    builder.create_dot = create_dot
    try:
        yield seen
    finally:
        builder.create_dot = original


# ------------------------------------------------------------------ index arithmetic

@dataclass(frozen=True)
class IndexProduct:
    """A product computed in a narrow integer type from a value loaded from index tensor ``name``."""

    name: str
    dtype: str

    def __str__(self) -> str:
        return f"a value loaded from {self.name} is multiplied in {self.dtype}"


def _marked(handle) -> str | None:
    attr = getattr(handle, "attr", None)
    return attr.get(_MARK) if isinstance(attr, dict) else None


@contextmanager
def index_products(named: dict, like=None):
    """Follow the values loaded from the named index tensors; record their int32 products.

    ``named`` maps names to (device) index tensors; ``like(tensor) -> name |
    None`` may claim a launch's tensor argument for one of them (a copy the
    wrapper made: a padded table, pairs converted to int32). Yields the list
    of ``IndexProduct`` seen (empty when compiled).
    """
    found: list[IndexProduct] = []
    if not interpreted():
        yield found
        return
    builder = _builder()
    regions: list[tuple[int, int, str]] = []
    for name, t in named.items():
        regions.append((*_storage_region(t), name))

    def claim(tensors):
        known = {r[0] for r in regions}
        for t in tensors:
            name = like(t) if like is not None else None
            if name and _storage_region(t)[0] not in known:
                regions.append((*_storage_region(t), name))

    def source(ptrs, mask) -> str | None:
        data = np.asarray(ptrs.data).astype(np.uint64).astype(np.int64)
        on = np.broadcast_to(np.asarray(mask.data, dtype=bool), data.shape)
        a = data[on]
        if not a.size:
            return None
        for start, end, name in regions:
            if ((a >= start) & (a < end)).any():
                return name
        return None

    originals = {}
    load = builder.create_masked_load

    def create_masked_load(self, ptrs, mask, *args, **kwargs):
        out = load(self, ptrs, mask, *args, **kwargs)
        name = source(ptrs, mask)
        if name is not None and out.dtype.is_int():
            out.attr[_MARK] = name
        return out

    def propagate(method_name, original):
        # A comparison's result is a mask, not an index; a select's condition
        # is one: neither carries the index on.
        skip = 1 if method_name == "create_select" else 0

        def wrapper(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            names = [n for n in map(_marked, list(args[skip:]) + list(kwargs.values())) if n]
            if names and hasattr(out, "attr"):
                out.attr[_MARK] = names[0]
                if method_name in ("create_mul", "create_shl") and out.dtype.is_int() \
                        and out.dtype.primitive_bitwidth < 64:
                    product = IndexProduct(names[0], str(out.dtype))
                    if product not in found:
                        found.append(product)
            return out
        return wrapper

    for method_name in dir(builder):
        if not method_name.startswith("create_") or method_name.startswith(("create_icmp", "create_fcmp")) \
                or method_name in ("create_masked_load", "create_masked_store"):
            continue
        original = builder.__dict__.get(method_name)
        if callable(original):
            originals[method_name] = original
            setattr(builder, method_name, propagate(method_name, original))
    builder.create_masked_load = create_masked_load
    try:
        with on_launch(claim):
            yield found
    finally:
        builder.create_masked_load = load
        for method_name, original in originals.items():
            setattr(builder, method_name, original)
