"""Draft tokens: our managers step for step beside vLLM 0.33.0's own ``KVCacheManager``, read from the wheel.

Requests decode with ``k`` draft tokens per step (``k`` random, 0 to 4, set as
``spec_token_ids``), sometimes fewer scheduled than proposed (a token budget
cuts them, as vLLM's scheduler does), sometimes with lookahead slots. After
each step a random number of the scheduled drafts is accepted: the accepted
drafts and one bonus token are appended, and ``num_computed_tokens`` moves
back by the rejected ones (vLLM's ``Scheduler.update_from_output``), so the
next step overwrites their slots. Requests share prompt prefixes (prefix
hits), prefill in chunks, finish, are preempted, or are dropped when a step
does not fit; the pool is small, so cached blocks are evicted.

Both managers get the same calls (``get_computed_blocks``, ``allocate_slots``
with the watermark, ``free``): the single-group ``KVCacheManager`` against
vLLM's over one full-attention group, and ``GroupedKVCacheManager`` (full
attention beside a sliding window) against vLLM's over the same groups.
After every call: the hit, whether the step fitted, the new block ids, every
table and cached count, the free queue in order, every reference count, every
block's hash and the prefix-cache map.

The test can fail. Planted bugs, each tried by hand on every seed and not
kept: caching up to ``num_tokens_with_spec`` instead of ``num_tokens`` in
``KVCacheManager.allocate_slots`` fails all four single-group seeds at the
first step whose drafts fill a block (the block has no hash to be cached
under, and our pool refuses the range: ``num_full_blocks exceeds
len(block_hashes)``); counting no slots for drafts fails all eight runs at
the first draft (``new blocks``). The same caching bug in
``GroupedKVCacheManager`` changes nothing observable, here or anywhere: each
group's ``cache_blocks`` also stops at the tokens that have a hash, as
vLLM's does, and a draft has none.
"""

from __future__ import annotations

import math
import random
import types

import pytest

from pagedkv.grouped_kv_cache_manager import GroupedKVCacheManager
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.request import Request
from test_kv_cache_groups import Pair, their_spec, vllm  # noqa: F401  (vllm is a fixture)
from test_kv_cache_manager_groups_vs_vllm import RequestStatus, View, groups_of, ids, vllm_manager  # noqa: F401

SEEDS = range(4)
BLOCK = 4
MAX_MODEL_LEN = 64


def compare_single(ours: KVCacheManager, theirs, where: str) -> None:
    """Everything our one-group manager holds, against vLLM's manager over one full-attention group."""
    ours.check()
    pool, their_pool = ours.block_pool, theirs.block_pool
    strip = lambda key: None if key is None else bytes(key[:-4])  # vLLM keys carry a 4-byte group id
    assert all(int.from_bytes(k[-4:], "big") == 0 for k in their_pool.cached_block_hash_to_block._cache), where
    q = lambda p: [b.block_id for b in p.free_block_queue.get_all_free_blocks()]
    assert q(pool) == q(their_pool), f"free queue, {where}"
    assert [b.ref_cnt for b in pool.blocks[1:]] == [b.ref_cnt for b in their_pool.blocks[1:]], f"ref counts, {where}"
    assert [b.block_hash for b in pool.blocks] == [strip(b.block_hash) for b in their_pool.blocks], \
        f"cached hashes, {where}"
    assert ({k: list(v) for k, v in pool.cached_block_hash_to_block.items()}
            == {strip(k): ([v.block_id] if not isinstance(v, dict) else list(v))
                for k, v in their_pool.cached_block_hash_to_block._cache.items()}), f"prefix cache, {where}"
    t = theirs.coordinator.single_type_managers[0]
    mine = {r: [b.block_id for b in bs] for r, bs in ours.req_to_blocks.items()}
    their = {r: [b.block_id for b in bs] for r, bs in t.req_to_blocks.items() if r in t.num_cached_block or bs}
    assert mine == their, f"tables, {where}"
    # vLLM enters a request's count when it first caches a block; ours at its first allocation (0)
    assert set(t.num_cached_block) <= set(ours.num_cached_block), f"cached counts, {where}"
    assert ours.num_cached_block == {r: t.num_cached_block.get(r, 0) for r in ours.num_cached_block}, \
        f"cached counts, {where}"


def build(vllm, mgr_module, kind: str, num_blocks: int, watermark: float, in_flight: int):
    """Our manager, vLLM's, and a ``compare(where)`` that counts the states it compared."""
    layout = [("full", BLOCK, None)] if kind == "single" else [("full", BLOCK, None), ("sliding", BLOCK, 6)]
    groups = groups_of(layout)
    I = vllm.kv_cache_interface
    config = I.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        I.KVCacheGroupSpec(list(g.layer_names), their_spec(vllm, g.kv_cache_spec)) for g in groups])
    theirs = mgr_module.KVCacheManager(config, max_model_len=MAX_MODEL_LEN,
                                       scheduler_block_size=math.lcm(*[g.kv_cache_spec.block_size for g in groups]),
                                       hash_block_size=BLOCK, max_in_flight_tokens=in_flight, enable_caching=True,
                                       watermark=watermark)
    if kind == "single":
        ours = KVCacheManager(num_blocks, BLOCK, watermark=watermark)
        counter = types.SimpleNamespace(compared=0)

        def compare(where):
            counter.compared += 1
            compare_single(ours, theirs, where)
    else:
        ours = GroupedKVCacheManager(groups, num_blocks, MAX_MODEL_LEN, hash_block_size=BLOCK, watermark=watermark,
                                     max_in_flight_tokens=in_flight)
        counter = types.SimpleNamespace(ours=ours.coordinator, theirs=theirs.coordinator, compared=0)

        def compare(where):
            ours.check()
            Pair.compare(counter, where)
    return ours, theirs, compare, counter


def run(vllm, mgr_module, kind: str, seed: int, num_blocks: int = 40, watermark: float = 0.05,
        in_flight: int = 16, steps: int = 150) -> dict:
    ours, theirs, compare, counter = build(vllm, mgr_module, kind, num_blocks, watermark, in_flight)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(40) for _ in range(rng.randrange(6, 30))] for _ in range(3)]
    waiting: list[tuple[Request, View]] = []
    running: list[tuple[Request, View]] = []
    stats = dict(calls=0, hits=0, refused=0, preempted=0, evicted=0, drafts=0, rejected=0, draft_blocks=0,
                 cut=0, lookahead=0)
    next_id = 0

    def hashed_ids():
        return {b.block_id for b in ours.block_pool.blocks if b.block_hash is not None}

    def both_allocate(req, view, n, hit=None, their_hit=None, num_hit=0, lookahead=0):
        scheduled = bool(running)
        before = hashed_ids()
        a = ours.allocate_slots(req, n, num_hit, hit, lookahead, has_scheduled_reqs=scheduled)
        b = theirs.allocate_slots(view, n, num_hit, their_hit, lookahead, has_scheduled_reqs=scheduled)
        stats["calls"] += 1
        assert (a is None) == (b is None), f"fits, {req.request_id}"
        if a is not None:
            assert ids(a) == [list(g) for g in b.get_block_ids()], f"new blocks, {req.request_id}"
            stats["evicted"] += len(before & {i for g in ids(a) for i in g})
        compare(f"allocate {req.request_id} n={n} drafts={req.spec_token_ids}")
        return a

    def drop(req, view, why):
        ours.free(req)
        theirs.free(view)
        running.remove((req, view))
        compare(f"{why} {req.request_id}")

    for step in range(steps):
        if rng.random() < 0.5 or not (waiting or running):
            prompt = rng.choice(prefixes) + [rng.randrange(40) for _ in range(rng.randrange(1, 20))]
            req = Request(f"r{next_id}", prompt, max_tokens=rng.randrange(2, 16), hash_block_size=BLOCK)
            waiting.append((req, View(req)))
            next_id += 1
        if waiting:
            req, view = waiting[0]
            hit, n = ours.get_computed_blocks(req)
            their_hit, their_n, _ = theirs.get_computed_blocks(view)
            assert n == their_n and ids(hit) == [list(g) for g in their_hit.get_block_ids()], f"hit, step {step}"
            chunk = min(req.num_tokens - n, rng.randrange(1, in_flight + 1))
            if both_allocate(req, view, chunk, hit, their_hit, n) is None:
                stats["refused"] += 1
            else:
                waiting.pop(0)
                stats["hits"] += n > 0
                req.num_computed_tokens = n + chunk
                view.status = RequestStatus.RUNNING
                running.append((req, view))
                if req.num_computed_tokens == req.num_tokens:  # the prompt's last chunk ran: one token sampled
                    req.append_output_token_ids(rng.randrange(40))
        for req, view in list(running):
            if rng.random() < 0.06:  # preempted: freed, back to the queue as a new request
                drop(req, view, "preempt")
                again = Request(req.request_id + "p", req.all_token_ids, max_tokens=4, hash_block_size=BLOCK)
                waiting.append((again, View(again)))
                stats["preempted"] += 1
                continue
            if req.is_finished or req.num_tokens >= MAX_MODEL_LEN - 12:
                drop(req, view, "finish")
                continue
            start, lookahead = req.num_computed_tokens, 0
            if start == req.num_tokens - 1:  # decoding: the last sampled token, and drafts after it
                k = min(rng.randrange(5), req.max_tokens - req.num_output_tokens - 1)
                req.spec_token_ids = [rng.randrange(40) for _ in range(k)]
                n = 1 + k
                if k and rng.random() < 0.2:  # a token budget cuts the drafts
                    n = rng.randrange(1, k + 1)
                    stats["cut"] += 1
                if rng.random() < 0.2:
                    lookahead = rng.randrange(1, 3)
                    stats["lookahead"] += 1
            else:  # a prefill chunk
                n = min(req.num_tokens - start, rng.randrange(1, in_flight + 1))
            if both_allocate(req, view, n, lookahead=lookahead) is None:
                req.spec_token_ids = []
                drop(req, view, "no room for")
                continue
            drafts = req.spec_token_ids[:max(0, start + n - req.num_tokens)]
            req.spec_token_ids = []  # vLLM's scheduler clears them once scheduled
            req.num_computed_tokens += n
            if drafts and math.ceil((start + n) / BLOCK) > math.ceil(req.num_tokens / BLOCK):
                stats["draft_blocks"] += 1  # a block holds nothing but drafts' slots
            if req.num_computed_tokens >= req.num_tokens:  # the step samples: accepted drafts and a bonus token
                accepted = rng.randrange(len(drafts) + 1)
                req.append_output_token_ids(drafts[:accepted] + [rng.randrange(40)])
                req.num_computed_tokens -= len(drafts) - accepted
                assert req.num_computed_tokens == req.num_tokens - 1
                stats["drafts"] += len(drafts)
                stats["rejected"] += len(drafts) - accepted
    stats["compared"] = counter.compared
    return stats


@pytest.mark.parametrize("kind", ["single", "grouped"])
def test_draft_tokens_match_vllms_kv_cache_manager(vllm, vllm_manager, kind):
    total: dict[str, int] = {}
    for seed in SEEDS:
        for k, v in run(vllm, vllm_manager, kind, seed).items():
            total[k] = total.get(k, 0) + v
    print(f"{kind}, seeds {list(SEEDS)}: {total}")
    # The workloads must exercise what is compared.
    for key in ("hits", "refused", "preempted", "evicted", "drafts", "rejected", "cut", "lookahead"):
        assert total[key] > 0, f"no {key}: {total}"
    assert total["draft_blocks"] > 0, f"no block held drafts alone: {total}"
