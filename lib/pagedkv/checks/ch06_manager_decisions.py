"""Checks for the decisions of exercises/06_copy_on_write.ipynb, one module per concept.

The learner writes three of ``KVCacheManager``'s decisions, as functions of
the manager, and two computations on a partial hit:

* ``ch06_prefix_lookup``: ``get_computed_blocks(manager, request) ->
  (blocks, num_tokens)``, the longest cached prefix;
* ``ch06_capacity``: ``can_allocate(manager, request, num_blocks,
  num_evictable_hits, has_scheduled_reqs) -> bool``, ``allocate_slots``'
  capacity test and its watermark;
* ``ch06_partial_hit``: ``redirect_partial_hit``, ``partial_hit`` and
  ``blocks_to_allocate``, a hit that ends inside a block.

As for chapter 3's decisions, each function runs inside one real
``KVCacheManager``, through the library's extension points (a subclass
overriding ``get_computed_blocks``, ``allocate_slots`` or
``redirect_partial_hit``), and random scheduler runs are compared, after
every operation, with an untouched manager (``manager_trial``). A difference
is diagnosed on small fixed cases. The exercise's prediction and design tasks
are in ``ch06_copy_prediction`` and ``ch06_designs``.
"""

from __future__ import annotations

from .ch06_capacity import CAPACITY_MISTAKES, check_can_allocate  # noqa: F401
from .ch06_partial_hit import (ALLOC_MISTAKES, COW_MISTAKES, HIT_MISTAKES,  # noqa: F401
                               blocks_to_allocate_reference, check_blocks_to_allocate,
                               check_partial_hit, check_redirect_partial_hit,
                               partial_hit_reference)
from .ch06_prefix_lookup import LOOKUP_MISTAKES, check_get_computed_blocks  # noqa: F401

__all__ = ["check_get_computed_blocks", "check_can_allocate",
           "check_partial_hit", "check_blocks_to_allocate",
           "check_redirect_partial_hit"]
