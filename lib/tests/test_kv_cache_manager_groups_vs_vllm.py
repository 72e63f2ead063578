"""``GroupedKVCacheManager`` step for step beside vLLM 0.33.0's own ``KVCacheManager``, read from the wheel.

The coordinator differential (``test_kv_cache_groups``) drives both
coordinators by hand in vLLM's order; this one drives the *managers* through
their public calls, as a scheduler does (``get_computed_blocks``,
``allocate_slots`` with the watermark, ``free``), so the order inside
``allocate_slots`` is ours to get right: the window's early frees counted on
tokens whose step has run (``num_in_flight_tokens`` held back), the capacity
test with the watermark, the hit entering every table, the new blocks, what
is cached. After every call: the hit (blocks per group and length), whether
the step fitted, the new block ids per group, and everything
``test_kv_cache_groups.Pair.compare`` checks (every group's tables and cached
counts, the free queue in order, reference counts, the prefix-cache map).
"""

from __future__ import annotations

import enum
import math
import random
import sys
import types
import zipfile

import pytest

from pagedkv.grouped_kv_cache_manager import GroupedKVCacheManager
from pagedkv.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from pagedkv.request import Request
from test_kv_cache_groups import Pair, their_spec, vllm  # noqa: F401  (vllm is the fixture)
from vllm_wheel import vllm_wheel


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()


@pytest.fixture
def vllm_manager(vllm, monkeypatch):
    """vLLM 0.33.0's ``v1/core/kv_cache_manager.py`` on top of the modules ``vllm`` loaded."""
    monkeypatch.setattr(sys.modules["vllm.v1.request"], "RequestStatus", RequestStatus, raising=False)
    stats = types.ModuleType("vllm.v1.metrics.stats")
    stats.PrefixCacheStats = object
    monkeypatch.setitem(sys.modules, "vllm.v1.metrics.stats", stats)
    name = "vllm.v1.core.kv_cache_manager"
    m = types.ModuleType(name)
    m.__file__ = "vllm-0.33.0/vllm/v1/core/kv_cache_manager.py"
    monkeypatch.setitem(sys.modules, name, m)
    with zipfile.ZipFile(vllm_wheel()) as z:
        exec(compile(z.read("vllm/v1/core/kv_cache_manager.py"), m.__file__, "exec"), m.__dict__)
    return m


class View:
    """Our ``Request`` as vLLM's manager reads a request (the same counters, by reference)."""

    def __init__(self, req: Request):
        self._req = req
        req.num_in_flight_tokens = 0  # tokens of a step that has not run yet (both managers read it)
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.skip_reading_prefix_cache = False
        self.shared_prefix_boundary = 0
        self.num_prompt_tokens = len(req.prompt_token_ids)

    def __getattr__(self, name):
        return getattr(self._req, name)


LAYOUTS = {  # name: (groups, blocks in the pool)
    "fa4+sw4 window 6": ([("full", 4, None), ("sliding", 4, 6)], 44),
    "fa4+sw4 window 13": ([("full", 4, None), ("sliding", 4, 13)], 44),
    "sw4 window 9 alone": ([("sliding", 4, 9)], 12),
    "2 sw + fa window 5": ([("sliding", 4, 5), ("sliding", 4, 5), ("full", 4, None)], 44),
    # attention blocks of 8 hashed every 4: the prompt's tail gets a second key
    "fa8+sw4 window 5": ([("full", 8, None), ("sliding", 4, 5)], 44),
}


def groups_of(layout):
    # 8 // bs heads: every group's page is 8 tokens x 1 head (or 4 x 2) x 8 x 2 x 2 bytes
    specs = {"full": lambda bs, w: FullAttentionSpec(block_size=bs, num_kv_heads=8 // bs, head_size=8),
             "sliding": lambda bs, w: SlidingWindowSpec(block_size=bs, num_kv_heads=8 // bs, head_size=8,
                                                        sliding_window=w)}
    return [KVCacheGroupSpec([f"layer{i}"], specs[k](bs, w)) for i, (k, bs, w) in enumerate(layout)]


def ids(blocks):
    return None if blocks is None else [[b.block_id for b in g] for g in blocks.blocks]


def run(vllm, mgr_module, layout, num_blocks, seed, max_model_len=64, in_flight=16, watermark=0.05):
    groups = groups_of(layout)
    ours = GroupedKVCacheManager(groups, num_blocks, max_model_len, hash_block_size=4, watermark=watermark,
                                 max_in_flight_tokens=in_flight)
    I = vllm.kv_cache_interface
    config = I.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        I.KVCacheGroupSpec(list(g.layer_names), their_spec(vllm, g.kv_cache_spec)) for g in groups])
    theirs = mgr_module.KVCacheManager(config, max_model_len=max_model_len,
                                       scheduler_block_size=math.lcm(*[g.kv_cache_spec.block_size for g in groups]),
                                       hash_block_size=4, max_in_flight_tokens=in_flight, enable_caching=True,
                                       watermark=watermark)
    pair = types.SimpleNamespace(ours=ours.coordinator, theirs=theirs.coordinator, compared=0)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(40) for _ in range(rng.randrange(6, 30))] for _ in range(3)]
    waiting: list[tuple[Request, View]] = []
    running: list[tuple[Request, View]] = []
    stats = dict(calls=0, hits=0, refused=0, null_entries=0, preempted=0)
    next_id = 0

    def both_allocate(req, view, n, hit=None, their_hit=None, num_hit=0):
        scheduled = bool(running)
        a = ours.allocate_slots(req, n, num_hit, hit, has_scheduled_reqs=scheduled)
        b = theirs.allocate_slots(view, n, num_hit, their_hit, has_scheduled_reqs=scheduled)
        stats["calls"] += 1
        assert (a is None) == (b is None), f"fits, {req.request_id}"
        if a is not None:
            assert ids(a) == [list(g) for g in b.get_block_ids()], f"new blocks, {req.request_id}"
        ours.check()
        Pair.compare(pair, f"allocate {req.request_id}")
        return a

    for step in range(120):
        if rng.random() < 0.5 or not (waiting or running):
            prompt = rng.choice(prefixes) + [rng.randrange(40) for _ in range(rng.randrange(1, 24))]
            req = Request(f"r{next_id}", prompt[:max_model_len - 10], max_tokens=rng.randrange(2, 10),
                          hash_block_size=4)
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
        for req, view in list(running):
            if rng.random() < 0.08:  # preempted: freed, back to the queue as a new request
                ours.free(req)
                theirs.free(view)
                running.remove((req, view))
                again = Request(req.request_id + "p", req.all_token_ids, max_tokens=4, hash_block_size=4)
                waiting.append((again, View(again)))
                stats["preempted"] += 1
                Pair.compare(pair, f"preempt {req.request_id}")
                continue
            if req.num_computed_tokens >= req.num_tokens:
                if req.is_finished or req.num_tokens >= max_model_len - 2:
                    ours.free(req)
                    theirs.free(view)
                    running.remove((req, view))
                    Pair.compare(pair, f"finish {req.request_id}")
                    continue
                req.append_output_token_ids(rng.randrange(40))
            # Async scheduling: sometimes the previous step's token is still in flight.
            req.num_in_flight_tokens = view.num_in_flight_tokens = rng.choice([0, 0, 1])
            n = min(req.num_tokens - req.num_computed_tokens, rng.randrange(1, in_flight + 1))
            if both_allocate(req, view, n) is None:
                ours.free(req)
                theirs.free(view)
                running.remove((req, view))
                Pair.compare(pair, f"no room for {req.request_id}")
                continue
            req.num_computed_tokens += n
            stats["null_entries"] += sum(g.count(0) for g in ours.get_block_ids(req.request_id))
    stats["compared"] = pair.compared
    return stats


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_grouped_manager_matches_vllms_kv_cache_manager(vllm, vllm_manager, layout):
    total = dict(calls=0, hits=0, refused=0, null_entries=0, preempted=0, compared=0)
    for seed in range(3):
        for k, v in run(vllm, vllm_manager, *LAYOUTS[layout], seed).items():
            total[k] += v
    print(f"{layout}: {total}")
    # The workloads must exercise what is compared.
    assert total["hits"] > 0 and total["refused"] > 0 and total["preempted"] > 0, total
    assert total["null_entries"] > 0, f"no window slid: {total}"
