"""Timing on a CUDA device, shared by the kernel benchmarks.

Every figure is a median of CUDA-event times after a warm-up, and every
bandwidth is put beside two ceilings measured or known for this device: a large
device-to-device copy (what a memory-bound kernel can hope for here) and the
datasheet peak (``pagedkv.budget.GPUS``).
"""

from __future__ import annotations

import torch

from ..budget import GPUSpec, gpu_for_device_name


def time_ms(fn, reps: int = 50, warmup: int = 5) -> float:
    """Median CUDA-event time of ``fn`` in milliseconds, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


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
