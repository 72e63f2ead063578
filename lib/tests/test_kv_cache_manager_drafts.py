"""Draft tokens at the manager: slots past ``num_tokens`` up to ``num_tokens_with_spec``, never cached.

One test per refusal (each leaves every structure as it was; a step past
``num_tokens`` by a request without drafts is ``test_kv_cache_manager``'s),
and the accepted case worked by hand. The differential against vLLM 0.33.0 is
``test_kv_cache_manager_drafts_vs_vllm``.
"""

from __future__ import annotations

import pytest

from pagedkv.grouped_kv_cache_manager import GroupedKVCacheManager
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from pagedkv.request import Request
from test_kv_cache_manager import snapshot
from test_kv_cache_manager_groups import snapshot as grouped_snapshot


def decoding(m, num_prompt=6):
    """A request whose prompt ran and whose first token was sampled: it decodes next."""
    r = Request("a", list(range(num_prompt)), max_tokens=8)
    m.allocate_slots(r, num_prompt)
    r.num_computed_tokens = num_prompt
    r.append_output_token_ids(100)
    return r


def test_drafts_get_slots_and_only_real_tokens_are_cached():
    m = KVCacheManager(num_blocks=10, block_size=4)
    r = decoding(m)  # 7 tokens, 6 computed, 2 blocks
    r.spec_token_ids = [7, 8, 9]
    assert r.num_tokens_with_spec == 10
    new = m.allocate_slots(r, 4)  # the last token and 3 drafts: slots up to 10, 3 blocks
    assert [len(g) for g in new.blocks] == [1] and len(m.get_block_ids("a")) == 3
    assert m.num_cached_block["a"] == 1  # block 1 holds drafts' slots: not cached
    r.spec_token_ids = []
    r.num_computed_tokens += 4
    r.append_output_token_ids([7, 42])  # one draft accepted, one bonus token
    r.num_computed_tokens -= 2  # two rejected: their slots are written again
    assert (r.num_tokens, r.num_computed_tokens) == (9, 8)
    assert m.allocate_slots(r, 1).blocks == ([],)
    assert m.num_cached_block["a"] == 2  # tokens 4..7 are real now
    m.check()


def test_more_tokens_than_the_drafts_are_refused_and_change_nothing():
    m = KVCacheManager(num_blocks=10, block_size=4)
    r = decoding(m)
    r.spec_token_ids = [7, 8]
    before = snapshot(m)
    with pytest.raises(ValueError, match=r"request 'a' has 7 tokens and 2 draft tokens; cannot compute 4 after 6 "
                                         r"\(more than its drafts"):
        m.allocate_slots(r, 4)
    assert snapshot(m) == before and r.spec_token_ids == [7, 8]
    m.check()


def test_placeholders_and_drafts_together_bound_a_step():
    m = KVCacheManager(num_blocks=10, block_size=4)
    r = decoding(m)
    r.num_output_placeholders = 1
    r.spec_token_ids = [7]
    before = snapshot(m)
    with pytest.raises(ValueError, match=r"has 8 tokens with placeholders and 1 draft tokens; cannot compute 4"):
        m.allocate_slots(r, 4)
    assert snapshot(m) == before
    assert m.allocate_slots(r, 3) is not None  # 6 + 3 = 7 tokens + 1 placeholder + 1 draft
    m.check()


def test_the_grouped_manager_refuses_more_than_the_drafts_and_changes_nothing():
    groups = [KVCacheGroupSpec(["l0"], FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8)),
              KVCacheGroupSpec(["l1"], SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8,
                                                         sliding_window=6))]
    m = GroupedKVCacheManager(groups, 20, 64, hash_block_size=4)
    r = decoding(m)
    r.spec_token_ids = [7, 8]
    assert m.allocate_slots(r, 3) is not None  # the last token and both drafts
    r.num_computed_tokens += 3
    r.spec_token_ids = [5]
    before = grouped_snapshot(m)
    with pytest.raises(ValueError, match=r"request 'a' has 7 tokens and 1 draft tokens; cannot compute 1 after 9"):
        m.allocate_slots(r, 1)  # num_computed_tokens was not rolled back after the step
    assert grouped_snapshot(m) == before
    m.check()


@pytest.mark.parametrize("drafts, exc, match", [
    ([1, 2.0], TypeError, r"spec_token_ids\[1\] = 2.0 is not an integer token id"),
    ([2**70], ValueError, r"spec_token_ids\[0\] = 1180591620717411303424 does not fit in 64 bits"),
    ("12", TypeError, "spec_token_ids must be a sequence of int token ids, got str"),
])
def test_draft_tokens_that_are_not_token_ids_are_refused_and_change_nothing(drafts, exc, match):
    r = Request("a", [1, 2, 3])
    r.spec_token_ids = [4, -1]  # vLLM marks an invalid draft -1
    with pytest.raises(exc, match=match):
        r.spec_token_ids = drafts
    assert r.spec_token_ids == [4, -1] and r.num_tokens_with_spec == 5
