"""Parallel sampling on ``PagedKV``: when a fork copies, and what the pool holds at its peak.

Exercise 6's experiment. ``n`` samples of one prompt share the prompt's KV:
``PagedKV.fork`` shares every page and copies a page only when a sample
writes into a partial page it shares (copy-on-write). When to copy is a
policy, and a ``PagedKV`` subclass that overrides ``fork`` -- the
extension point -- can copy at the fork instead.

``run_forks(pool_class, workload)`` serves ``ForkWorkload``: every prompt is
written, forked into ``samples - 1`` children (the parent is sample 0), then
every sample decodes ``output_len`` tokens, one token a step, round robin;
then all are released. It returns the peak number of allocated pages and
the pages allocated in all, and checks the pool's invariants as it goes. A
pool too small for a policy raises ``MemoryError`` naming the step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..common import check_int
from .paged_kv import PagedKV

__all__ = ["ForkWorkload", "FORK_WORKLOAD", "ForkResult", "run_forks"]


@dataclass(frozen=True)
class ForkWorkload:
    """Prompts of seeded lengths, each sampled ``samples`` times (lengths in tokens)."""

    num_prompts: int = 8
    min_prompt: int = 60
    max_prompt: int = 400
    samples: int = 4
    output_len: int = 48
    block_size: int = 16
    capacity: int = 2_048
    seed: int = 1

    def __post_init__(self):
        for name in ("num_prompts", "min_prompt", "samples", "output_len", "block_size",
                     "capacity"):
            check_int(getattr(self, name), name, 1)
        if check_int(self.max_prompt, "max_prompt", 1) < self.min_prompt:
            raise ValueError(f"max_prompt={self.max_prompt} is below min_prompt={self.min_prompt}")
        check_int(self.seed, "seed", 0)

    def prompt_lengths(self) -> list[int]:
        rng = random.Random(self.seed)
        return [rng.randint(self.min_prompt, self.max_prompt) for _ in range(self.num_prompts)]


#: The workload exercise 6 measures on.
FORK_WORKLOAD = ForkWorkload()


@dataclass(frozen=True)
class ForkResult:
    peak_pages: int  # the most pages allocated at once
    pages_allocated: int  # pages taken from the free heap over the run


def run_forks(pool_class: type[PagedKV], workload: ForkWorkload = FORK_WORKLOAD) -> ForkResult:
    """Serve ``workload`` on a fresh ``pool_class(capacity, block_size)``; see the module docstring."""
    if not (isinstance(pool_class, type) and issubclass(pool_class, PagedKV)):
        raise TypeError(f"pool_class must be PagedKV or a subclass, got {pool_class!r}")
    w = workload

    class Counted(pool_class):  # counts every page taken from the free heap, whoever takes it
        allocations = 0

        def allocate_page(self) -> int:
            page = super().allocate_page()
            type(self).allocations += 1
            return page

    pool = Counted(w.capacity, w.block_size)
    peak, token, samples = 0, 0, []
    for k, length in enumerate(w.prompt_lengths()):
        parent = f"p{k}"
        pool.create(parent)
        for _ in range(length):
            token += 1
            pool.append(parent, token)
        samples.append(parent)
        for s in range(1, w.samples):
            pool.fork(parent, f"p{k}s{s}")
            samples.append(f"p{k}s{s}")
        peak = max(peak, len(pool))
        pool.check()
    for step in range(w.output_len):
        for rid in samples:
            token += 1
            pool.append(rid, token)
            peak = max(peak, len(pool))
        pool.check()
    for rid in samples:
        pool.release(rid)
    if len(pool):
        raise ValueError(f"{len(pool)} pages still allocated after every sample was released")
    return ForkResult(peak, Counted.allocations)
