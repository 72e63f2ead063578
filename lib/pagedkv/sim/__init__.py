"""What the chapters simulate: the allocators paging replaced, workloads, the reference allocator.

None of it serves a model; each module models one idea well enough to measure
it:

- ``kv_allocator``: the five states of a slot (``Occupancy``) and the
  interface chapter 2's allocators share (``KVAllocator``);
- ``allocators``: max-length, variable-extent (first-fit, best-fit), paged
  and token-granular allocators;
- ``tail_waste``: closed forms for the unused tail of a last block;
- ``workloads``: request-length mixtures and seeded request traces;
- ``waste_sim``: the waste simulator (``simulate``, ``run_all``);
- ``deque_pool``: the deque-backed block pool chapter 3 races against
  ``BlockPool``;
- ``paged_kv``: the book's CPU reference allocator ``PagedKV`` (owners, pins,
  copy-on-write), and ``paged_kv_trial``, its randomized trial;
- ``scheduler_sim``: a scheduler model on ``PagedKV`` (chapter 6);
- ``prefix_pressure``: a multi-tenant chat trace served on a
  ``KVCacheManager`` (or a subclass), prefix hits counted (exercise 3);
- ``table_writes``: a trace's block-table writes through any ``append``
  function, cells copied to the device counted (exercise 4);
- ``step_padding``: steps padded to captured CUDA-graph sizes under any
  padding function, and their slot mappings (exercise 5);
- ``fork_workload``: parallel sampling on ``PagedKV`` or a subclass, the
  peak pages counted (exercise 6);
- ``mixed_batch``: chapter 7's driver, a mixed prefill/decode batch built by
  the real manager, block table and slot mapping, ready for one attention
  launch.

Chapter 2's names load lazily at the package level
(``from pagedkv.sim import simulate``); the drawings of the simulations live
in ``pagedkv.views.fragmentation``. Invariant failures raise
``pagedkv.common.InvariantError``.

The rule: ``sim`` imports the core and nothing else of the package (never
``views``, ``checks`` or ``bench``).
"""

from __future__ import annotations

import importlib

# name -> the module of this package that defines it
_EXPORTS = {
    **dict.fromkeys(["PARTS", "Occupancy", "KVAllocator"], "kv_allocator"),
    **dict.fromkeys(["MaxLengthAllocator", "VariableExtentAllocator", "PagedAllocator", "TokenGranularAllocator",
                     "ALLOCATOR_KINDS", "make_allocator", "largest_free_extent"], "allocators"),
    **dict.fromkeys(["unused_tail_slots", "expected_tail_waste", "uniform_tail_waste", "over_reservation_waste"],
                    "tail_waste"),
    **dict.fromkeys(["Dist", "Component", "Workload", "WORKLOADS", "workload", "Trace", "make_request_trace"],
                    "workloads"),
    **dict.fromkeys(["WasteSimResult", "simulate", "run_all", "steady_running"], "waste_sim"),
    **dict.fromkeys(["PagedKV", "format_pool", "TailWaste", "tail_waste"], "paged_kv"),
    **dict.fromkeys(["SimRequest", "SchedulerSimResult", "SchedulerSim", "demo_scheduler"], "scheduler_sim"),
    **dict.fromkeys(["PressureWorkload", "PRESSURE_WORKLOAD", "Served", "serve"], "prefix_pressure"),
    **dict.fromkeys(["TableWorkload", "TABLE_WORKLOAD", "replay_table_writes"], "table_writes"),
    **dict.fromkeys(["vllm_capture_sizes", "pad_vllm", "padded_slot_mappings", "decode_batch_sizes"],
                    "step_padding"),
    **dict.fromkeys(["ForkWorkload", "FORK_WORKLOAD", "ForkResult", "run_forks"], "fork_workload"),
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'pagedkv.sim' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
