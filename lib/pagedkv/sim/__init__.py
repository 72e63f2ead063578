"""What the chapters simulate: the allocators paging replaced, workloads, the seed's allocator.

None of it serves a model; each module models one idea well enough to measure
it, and the chapters import it directly:

- ``fragmentation``: contiguous, paged and token-granular allocators on
  workloads, and the waste simulator of chapter 2;
- ``deque_pool``: the deque-backed block pool chapter 3 races against
  ``BlockPool``;
- ``scheduler_sim``: the seed's CPU reference allocator ``PagedKV`` (owners,
  pins, copy-on-write) and a scheduler model (chapter 6).

The rule: ``sim`` imports the core and nothing else of the package (never
``views``, ``checks`` or ``bench``).
"""
