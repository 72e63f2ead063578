"""The public extension points the checkers drive the library through (issue 16).

``KVCacheManager(redirect_partial_hit=...)`` is the copy-on-write step of a
partial prefix hit, which exercise 6's checker replaces with the learner's
function instead of assigning a private method.
"""

from __future__ import annotations

import pytest

from pagedkv.checks.manager_trial import manager_trial
from pagedkv.kv_cache_manager import KVCacheManager


def test_redirect_partial_hit_is_called_for_every_partial_hit_and_changes_nothing_else():
    calls = []

    def redirect(manager, req_blocks, block_idx, cow_block):
        calls.append((manager, block_idx, cow_block.block_id))
        KVCacheManager._apply_cow(manager, req_blocks, block_idx, cow_block)  # the default, observed

    def install(m):
        m.redirect_partial_hit = redirect

    for seed in range(6):
        manager_trial(install, seed, aligned=False)  # raises on any difference from the plain manager
    assert calls, "the trials must reach partial hits"
    assert all(isinstance(m, KVCacheManager) and m.redirect_partial_hit is redirect for m, _, _ in calls)


def test_a_wrong_redirect_is_seen_by_the_trial():
    def no_copy(manager, req_blocks, block_idx, cow_block):
        req_blocks[block_idx] = cow_block  # redirects, but records no copy and takes no reference

    def install(m):
        m.redirect_partial_hit = no_copy

    with pytest.raises(AssertionError):
        for seed in range(6):
            manager_trial(install, seed, aligned=False)


def test_redirect_partial_hit_must_be_callable():
    with pytest.raises(TypeError, match="redirect_partial_hit must be callable or None, got int 3"):
        KVCacheManager(8, 4, redirect_partial_hit=3)
    m = KVCacheManager(8, 4, redirect_partial_hit=None)
    assert m.redirect_partial_hit is None
