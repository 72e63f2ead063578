"""Timing on a CUDA device, shared by the kernel benchmarks.

Measured as ``triton.testing.do_bench`` measures, so that a figure is the
device's time and not the host's or the L2 cache's:

* the L2 cache is flushed before every repetition (a buffer several times its
  size is overwritten), so a kernel reads from HBM as it does in a model step,
  where each layer's K/V differ;
* the host's work (Python, argument packing, Triton's launcher, planning)
  stays out of the timed region: ``time_ms`` records each repetition's events
  behind the flush, which keeps the device busy while the host enqueues, and
  ``time_graph_ms`` launches many calls back to back from one CUDA graph, for
  kernels of a few microseconds whose launch costs more than they do;
* events are read after the last repetition (no synchronisation in the loop),
  and the figure is their median.

Every bandwidth is put beside two ceilings measured or known for this device: a
large device-to-device copy (what a memory-bound kernel can hope for here) and
the datasheet peak (``pagedkv.budget.GPUS``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch

from ..budget import GPUSpec, gpu_for_device_name


@functools.cache
def l2_bytes() -> int:
    """The L2 cache of device 0 (50 MiB on an H100/H200 if the driver does not say)."""
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 50 * 2**20)


@functools.cache
def _flush_buffer() -> torch.Tensor:
    return torch.empty(max(256 * 2**20, 4 * l2_bytes()), dtype=torch.uint8, device="cuda")


def flush_l2() -> None:
    """Evict the L2 cache by overwriting a buffer four times its size (256 MiB at least)."""
    _flush_buffer().zero_()


def _median_ms(events: list) -> float:
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return times[len(times) // 2]


def _events(n: int) -> list:
    return [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]


def time_ms(fn: Callable[[], object], reps: int = 50, warmup: int = 5) -> float:
    """Median time of one call of ``fn`` in milliseconds, L2 flushed before each.

    For calls whose host work is shorter than a flush (tens of microseconds):
    the flush keeps the device busy while the host enqueues the call.
    """
    for _ in range(warmup):
        fn()
    events = _events(reps)
    for start, end in events:
        flush_l2()
        start.record()
        fn()
        end.record()
    return _median_ms(events)


def copies_for_cold_l2(nbytes: int) -> int:
    """Disjoint copies of a case whose back-to-back calls each read from HBM: together
    three times the L2, so a copy's data has left the cache before it is read again."""
    return max(1, math.ceil(3 * l2_bytes() / max(nbytes, 1)))


def time_graph_ms(calls: Sequence[Callable[[], object]], reps: int = 20, min_calls: int = 16) -> tuple[float, str]:
    """Median device time of one call, in ms, and how it was measured.

    ``calls`` run in turn, back to back, at least ``min_calls`` of them per
    repetition, captured once in a CUDA graph and replayed after an L2 flush:
    no host work is timed. Give each call its own copy of the data
    (``copies_for_cold_l2``) and every call reads from HBM. Where capture fails
    (a driver or library that refuses it), the same launches run between one
    event pair each repetition, and the method says so.
    """
    sequence = [calls[i % len(calls)] for i in range(max(min_calls, len(calls)))]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles, allocator) outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in sequence:
                call()
        run, method = graph.replay, f"CUDA graph of {len(sequence)} calls"
    except Exception as exc:  # noqa: BLE001 -- measure anyway, and say how
        torch.cuda.synchronize()
        print(f"  (CUDA graph capture failed: {type(exc).__name__}: {str(exc)[:120]}; timing launches)")

        def run():
            for call in sequence:
                call()
        method = f"{len(sequence)} launches per event pair"
    run()
    events = _events(reps)
    for start, end in events:
        flush_l2()
        start.record()
        run()
        end.record()
    return _median_ms(events) / len(sequence), method + ", L2 flushed"


def gbps(nbytes: int, ms: float) -> float:
    """Achieved bandwidth in GB/s (10**9 bytes per second)."""
    return nbytes / (ms * 1e-3) / 1e9


def copy_ceiling_gbps(device: torch.device) -> float:
    """Bandwidth of a 256 MiB device-to-device copy, counting bytes read and written."""
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return gbps(2 * src.numel(), time_ms(lambda: dst.copy_(src), reps=20))


def device_ceilings(device: torch.device) -> tuple[float, GPUSpec | None]:
    """Measure the copy ceiling, look up the datasheet, and print both in one line."""
    copy = copy_ceiling_gbps(device)
    gpu = gpu_for_device_name(torch.cuda.get_device_name(device))
    print(f"device copy ceiling: {copy:,.0f} GB/s (256 MiB tensor copy)"
          + (f"; datasheet peak {gpu.peak_bandwidth_gbs:,.0f} GB/s ({gpu.name})" if gpu else ""))
    return copy, gpu
