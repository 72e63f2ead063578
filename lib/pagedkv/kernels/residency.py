"""How many programs of a compiled kernel an SM holds at once, and when split-KV pays.

A GPU runs a grid's programs a wave at a time: each streaming multiprocessor
(SM) keeps as many *resident* as its registers, shared memory, threads and
program slots allow. A grid smaller than that capacity leaves SMs idle; that
is when cutting each sequence's keys into segments (split-KV) helps, at the
price of a merge. ``plan_attention`` (``kernels.attention``) asks
``choose_splits`` with the capacity of the kernel it will launch;
``tools/compile_check.py`` reports the same figure per configuration for an
A100 and an H200, from the ahead-of-time compile.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..common import cdiv

__all__ = ["MAX_SPLITS", "SMLimits", "SM_LIMITS", "resident_programs", "split_rule", "choose_splits"]

MAX_SPLITS = 64  # the most segments one sequence's keys are cut into


@dataclass(frozen=True)
class SMLimits:
    """What one streaming multiprocessor offers the programs resident on it."""

    registers: int  # 32-bit registers per SM
    shared_bytes: int  # shared memory per SM
    shared_per_block: int  # the most one program may opt in to
    threads: int  # resident threads per SM
    blocks: int  # resident programs per SM, whatever their size


# CUDA C Programming Guide, "Technical Specifications per Compute Capability";
# 1 KB of every program's shared memory is reserved by the driver.
SM_LIMITS = {
    80: SMLimits(65536, 167_936, 166_912, 2048, 32),  # A100
    90: SMLimits(65536, 233_472, 232_448, 2048, 32),  # H100 / H200
}
_RESERVED_SHARED = 1024


def resident_programs(n_regs: int, shared_bytes: int, num_warps: int, limits: SMLimits) -> int:
    """Programs of one compiled kernel that fit on one SM at once (0: it cannot launch).

    The least of four limits: registers (allocated per warp in units of 256),
    shared memory (plus the reserved 1 KB per program), threads, programs.
    """
    if shared_bytes > limits.shared_per_block:
        return 0
    regs_per_warp = cdiv(max(n_regs, 1) * 32, 256) * 256
    by_regs = (limits.registers // regs_per_warp) // num_warps
    by_shared = limits.shared_bytes // (shared_bytes + _RESERVED_SHARED)
    by_threads = limits.threads // (32 * num_warps)
    return min(by_regs, by_shared, by_threads, limits.blocks)


def split_rule(resident_per_sm: int | None = None, num_sms: int | None = None) -> str:
    """One paragraph: how ``plan_attention`` chooses ``num_splits``, with this GPU's figures if given."""
    where = ""
    if resident_per_sm is not None and num_sms is not None:
        where = (f" Here: {resident_per_sm} programs per SM x {num_sms} SMs = "
                 f"{resident_per_sm * num_sms} resident programs.")
    return ("Split-KV is chosen from the GPU's resident capacity: how many programs of the "
            "compiled kernel fit on one SM at once (the least of what its registers, its shared "
            "memory, its threads and the 32-program limit allow), times the number of SMs. A grid "
            "with fewer programs than that leaves the GPU partly idle, so for sequences of at least "
            "2,048 tokens each query tile's keys are cut into as many segments as still fit the "
            "resident capacity in one wave, with at least four key tiles per segment and at most "
            f"{MAX_SPLITS} segments; a grid that already fills it is not split. The count is a "
            "runtime argument, so one compiled kernel serves every count. On a CPU the "
            "kernel runs in the interpreter and never splits." + where)


def choose_splits(num_programs: int, max_seq_len: int, tile_n: int, capacity: int) -> int:
    """Split the keys only when the grid cannot fill the resident capacity and sequences are long."""
    if max_seq_len < 2048 or num_programs >= capacity:
        return 1
    wanted = capacity // num_programs  # rounded down: the split grid stays within one wave
    return max(1, min(wanted, max_seq_len // (4 * tile_n), MAX_SPLITS))
