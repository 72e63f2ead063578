"""Padding a step to a captured CUDA-graph size: what it adds to the slot mapping.

Exercise 5's experiment. A CUDA graph replays a step captured for one batch
size, so a step of ``n`` tokens runs as the smallest captured size ``>= n``,
and its slot mapping gets ``padded - n`` entries of -1 that every writer
skips (chapter 5, *Padding*). Which sizes are captured is a policy: vLLM
0.33.0's default list (``vllm_capture_sizes``) is 1, 2, 4, then every
multiple of 8 below 256, then every multiple of 16 up to the largest; a step
larger than the largest runs without a graph, unpadded.

The policy is a function ``pad(num_tokens) -> padded``, the extension point;
``padded_slot_mappings(pad, sizes)`` builds each step's slot mapping under
it (real tokens get distinct slots, padding -1) and refuses a ``pad`` that
answers less than ``num_tokens`` or not an int. ``decode_batch_sizes()`` is
the workload: the decode batch of every step of a chat trace replayed on a
paged pool by the waste simulator (one token per running request).
"""

from __future__ import annotations

import bisect
import functools
import numbers

import numpy as np

from ..common import check_int
from .allocators import PagedAllocator
from .waste_sim import simulate
from .workloads import make_request_trace

__all__ = ["vllm_capture_sizes", "pad_vllm", "padded_slot_mappings", "decode_batch_sizes"]


def vllm_capture_sizes(max_size: int = 512) -> list[int]:
    """vLLM 0.33.0's default capture sizes up to ``max_size`` (its default largest is 512)."""
    max_size = check_int(max_size, "max_size", 1)
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += list(range(8, min(max_size + 1, 256), 8))
    sizes += list(range(256, max_size + 1, 16))
    return sizes


_VLLM = vllm_capture_sizes()


def pad_vllm(num_tokens: int) -> int:
    """The smallest of vLLM's default capture sizes >= ``num_tokens``; unpadded past the largest."""
    n = check_int(num_tokens, "num_tokens", 1)
    i = bisect.bisect_left(_VLLM, n)
    return _VLLM[i] if i < len(_VLLM) else n


def padded_slot_mappings(pad, sizes) -> list[np.ndarray]:
    """Each step's slot mapping, int64: its ``n`` tokens' slots, then ``pad(n) - n`` entries of -1."""
    if not callable(pad):
        raise TypeError(f"pad must be a function num_tokens -> padded, got {type(pad).__name__}")
    out, base = [], 0
    for n in sizes:
        n = check_int(n, "a step's num_tokens", 1)
        padded = pad(n)
        if isinstance(padded, bool) or not isinstance(padded, numbers.Integral):
            raise ValueError(f"pad({n}) returned {type(padded).__name__} {padded!r}; it must "
                             "return an int")
        if padded < n:
            raise ValueError(f"pad({n}) returned {padded}, fewer than the step's {n} tokens")
        mapping = np.full(int(padded), -1, dtype=np.int64)
        mapping[:n] = base + np.arange(n)  # distinct real slots; only their sign matters here
        base += n
        out.append(mapping)
    return out


@functools.lru_cache(maxsize=None)
def _sizes(num_requests: int, seed: int, capacity: int, max_steps: int) -> tuple[int, ...]:
    trace = make_request_trace("heavy-tailed", num_requests, arrival_rate=2.0, seed=seed,
                               max_model_len=8_192)
    result = simulate(PagedAllocator(capacity, 16, 8_192), trace, max_steps=max_steps)
    return tuple(int(r) for r in result.running if r > 0)


def decode_batch_sizes(num_requests: int = 1_500, seed: int = 2, capacity: int = 400_000,
                       max_steps: int = 1_500) -> list[int]:
    """Decode tokens per step (the running requests) of a seeded heavy-tailed trace, empty steps left out."""
    return list(_sizes(check_int(num_requests, "num_requests", 1), check_int(seed, "seed", 0),
                       check_int(capacity, "capacity", 16), check_int(max_steps, "max_steps", 1)))
