"""Count Triton kernel launches, so a checker can require that a kernel ran.

A learner can pass a kernel exercise's numeric checks with plain PyTorch;
the exercise is about writing the kernel. Every launch, compiled or
interpreted, goes through ``run`` on the kernel object (``kernel[grid](...)``
calls it), so patching ``run`` on the two classes counts them all.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class LaunchCount:
    count: int = 0


def _kernel_classes():
    from triton.runtime.jit import JITFunction

    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # a Triton without the interpreter
        return classes
    return classes + [InterpretedFunction]


@contextmanager
def count_triton_launches():
    """``with count_triton_launches() as n: ...``; afterwards ``n.count`` launches ran."""
    counter = LaunchCount()
    originals = {}
    for cls in _kernel_classes():
        original = cls.__dict__.get("run")
        if original is None:
            continue

        def counting_run(self, *args, __original=original, **kwargs):
            counter.count += 1
            return __original(self, *args, **kwargs)

        originals[cls] = original
        cls.run = counting_run
    try:
        yield counter
    finally:
        for cls, original in originals.items():
            cls.run = original
