"""KV-cache groups: specs, per-group managers and coordinators, checked against vLLM 0.33.0's own code.

The differential runs vLLM 0.33.0's ``v1/core/{block_pool,kv_cache_utils,
single_type_kv_cache_manager,kv_cache_coordinator}.py`` and
``v1/kv_cache_interface.py`` read from the release wheel (never installed,
never copied; the few vLLM modules they import for events, metrics,
logging and config are stubbed) beside ours, on random workloads over a
full-attention group beside a sliding-window group or a Mamba group in align
mode (where hits may end inside a state block and are copied), and compares
after every operation: each group's block ids per request, each hit (blocks
per group and length), every admission decision, the free queue in order,
every block's reference count and cache state, the prefix-cache map, and the
copy-on-write pairs queued and run.
"""

from __future__ import annotations

import enum
import logging
import math
import random
import sys
import types
import zipfile

import pytest

from pagedkv.common import InvariantError
from pagedkv.kv_cache_coordinator import (HybridKVCacheCoordinator, UnitaryKVCacheCoordinator,
                                          get_kv_cache_coordinator)
from pagedkv.kv_cache_spec import (FullAttentionSpec, KVCacheGroupSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec,
                                   get_kv_cache_groups, layer_specs_from_types, unify_kv_cache_spec_page_size)
from pagedkv.request import Request
from pagedkv.single_type_managers import make_block_hash_with_group_id
from vllm_wheel import vllm_wheel

# ------------------------------------------------------------------ vLLM 0.33.0, from the wheel

VLLM_MODULES = ("vllm.utils.math_utils", "vllm.v1.kv_cache_layout", "vllm.v1.kv_cache_spec_registry",
                "vllm.v1.kv_cache_interface", "vllm.v1.core.kv_cache_utils", "vllm.v1.core.block_pool",
                "vllm.v1.hisparse.block_pool", "vllm.v1.core.single_type_kv_cache_manager",
                "vllm.v1.core.kv_cache_coordinator")


@pytest.fixture
def vllm(monkeypatch) -> types.SimpleNamespace:
    """vLLM 0.33.0's specs, block pool, managers and coordinators, executed from the wheel.

    What they import and we do not exercise is stubbed: KV events, metrics,
    the logger, ``envs``, multimodal helpers, ``Request`` (only annotations
    and attribute reads), the platform hook of the spec registry. The modules
    leave ``sys.modules`` when the test ends.
    """
    wheel = vllm_wheel()
    for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, k)

    class Logger(logging.Logger):
        def warning_once(self, *args, **kwargs):
            pass

        info_once = debug_once = warning_once

    class Anything:
        def __init__(self, *args, **kwargs):
            pass

    class MambaAttentionBackendEnum(enum.Enum):
        MAMBA1 = 1
        MAMBA2 = 2

    def stub(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        m.__path__ = []
        monkeypatch.setitem(sys.modules, name, m)
        return m

    for name in ("vllm", "vllm.utils", "vllm.v1", "vllm.v1.core", "vllm.v1.hisparse", "vllm.v1.attention",
                 "vllm.v1.attention.backends", "vllm.distributed", "vllm.multimodal", "vllm.v1.metrics"):
        stub(name)
    sys.modules["vllm"].envs = stub("vllm.envs", VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=False)
    stub("vllm.config", VllmConfig=Anything, get_current_vllm_config_or_none=lambda: None)
    stub("vllm.logger", init_logger=Logger)
    stub("vllm.multimodal.utils", get_mm_features_in_window=None)
    stub("vllm.utils.hashing", xxhash=object(), xxhash_cbor=object())
    stub("vllm.v1.request", Request=Anything)
    stub("vllm.v1.utils", tensor_data=None)
    stub("vllm.utils.torch_utils", get_dtype_size=lambda dtype: dtype.itemsize)
    stub("vllm.v1.attention.backends.registry", MambaAttentionBackendEnum=MambaAttentionBackendEnum)
    stub("vllm.distributed.kv_events", MEDIUM_GPU="GPU", MEDIUM_CPU="CPU", AllBlocksCleared=Anything,
         BlockRemoved=Anything, BlockStored=Anything, KVCacheEvent=Anything)
    stub("vllm.v1.core.kv_cache_metrics", KVCacheMetricsCollector=Anything)
    stub("vllm.platforms", current_platform=types.SimpleNamespace(register_custom_kv_cache_specs=lambda c: None))
    loaded = {}
    with zipfile.ZipFile(wheel) as z:
        for name in VLLM_MODULES:
            path = name.replace(".", "/") + ".py"
            m = types.ModuleType(name)
            m.__file__ = f"vllm-0.33.0/{path}"
            monkeypatch.setitem(sys.modules, name, m)
            exec(compile(z.read(path), m.__file__, "exec"), m.__dict__)
            loaded[name.rsplit(".", 1)[1]] = m
    return types.SimpleNamespace(**loaded)


def their_spec(vllm, spec):
    """vLLM's spec with the same fields as ours (torch dtypes: ``get_dtype_size`` reads ``itemsize``)."""
    import torch

    I = vllm.kv_cache_interface
    if isinstance(spec, MambaSpec):
        return I.MambaSpec(block_size=spec.block_size, shapes=spec.shapes,
                           dtypes=tuple(getattr(torch, d) for d in spec.dtypes),
                           mamba_cache_mode=spec.mamba_cache_mode)
    common = dict(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                  dtype=getattr(torch, spec.dtype), page_size_padded=spec.page_size_padded)
    if isinstance(spec, SlidingWindowSpec):
        return I.SlidingWindowSpec(sliding_window=spec.sliding_window, **common)
    return I.FullAttentionSpec(**common)


# ------------------------------------------------------------------ specs

@pytest.mark.parametrize("window,in_flight,max_len", [(4096, 8192, 131072), (128, 2048, 4096), (5, 3, 8),
                                                      (1000, 0, 900), (17, 16, 64)])
def test_page_size_and_max_memory_are_vllm_0_33_0s(vllm, window, in_flight, max_len):
    I = vllm.kv_cache_interface
    config = types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=max_len),
                                   parallel_config=types.SimpleNamespace(decode_context_parallel_size=1),
                                   max_in_flight_tokens=in_flight)
    for dtype in ("float16", "float32"):
        for spec in (FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype=dtype),
                     SlidingWindowSpec(block_size=16, num_kv_heads=4, head_size=128, dtype=dtype,
                                       sliding_window=min(window, max_len))):
            theirs = their_spec(vllm, spec)
            assert spec.page_size_bytes == theirs.page_size_bytes
            assert spec.max_memory_usage_bytes(max_len, in_flight) == theirs.max_memory_usage_bytes(config)
            assert spec.max_num_blocks_per_req(max_len) == cdiv(max_len, 16)
    # the window's budget: the window, the tokens in flight, one block of slack
    sw = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=1, sliding_window=4096)
    assert sw.max_admission_blocks_per_request(8192, 131072) == cdiv(4095 + 8192, 16) + 1


def cdiv(a, b):
    return -(-a // b)


def test_gemma_like_layers_form_one_group_per_kind_of_equal_size():
    types_ = (["sliding_attention"] * 5 + ["full_attention"]) * 2
    specs = layer_specs_from_types(types_, block_size=16, num_kv_heads=4, head_size=64, max_model_len=1024,
                                   sliding_window=512)
    groups = get_kv_cache_groups(specs)
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    assert kinds == ["SlidingWindowSpec"] * 5 + ["FullAttentionSpec"]
    assert all(len(g.layer_names) == 2 for g in groups)
    assert groups[0].layer_names == ["model.layers.0.self_attn", "model.layers.6.self_attn"]
    assert len({g.kv_cache_spec.page_size_bytes for g in groups}) == 1


def test_page_sizes_unify_by_growing_blocks_or_padding():
    small = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, sliding_window=64)
    big = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64)
    odd = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64)
    specs = {"a": big, "b": small, "c": odd}
    before = dict(specs)
    out = unify_kv_cache_spec_page_size(specs)
    assert specs == before  # the input is left alone
    assert out["b"].block_size == 64 and out["b"].page_size_bytes == big.page_size_bytes
    assert out["c"].block_size == 16 and out["c"].page_size_padded == big.page_size_bytes


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("kwargs,match", [
    (dict(layer_types=["full_attention", "linear_attention"]), r"model\.layers\.1\.self_attn: unknown layer type 'linear_attention'"),
    (dict(layer_types=["sliding_attention"], sliding_window=2048), r"model\.layers\.0\.self_attn: sliding_window=2048 is larger than max_model_len=1024"),
    (dict(layer_types=["full_attention", "sliding_attention"]), r"model\.layers\.1\.self_attn: a sliding_attention layer needs sliding_window"),
    (dict(layer_types=[]), r"layer_types is empty"),
])
def test_layers_that_cannot_be_grouped_are_refused_with_the_layer_and_reason(kwargs, match):
    base = dict(block_size=16, num_kv_heads=2, head_size=64, max_model_len=1024)
    with pytest.raises(ValueError, match=match):
        layer_specs_from_types(**{**base, **kwargs})


def test_page_sizes_that_cannot_be_unified_are_refused_naming_the_layer():
    specs = {"model.layers.0.self_attn": FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64),
             "model.layers.1.self_attn": MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=100)}
    before = dict(specs)
    with pytest.raises(ValueError, match=r"layer model\.layers\.1\.self_attn: .*cannot be unified"):
        get_kv_cache_groups(specs)
    assert specs == before


@pytest.mark.parametrize("make,exc", [
    (lambda: FullAttentionSpec(block_size=True, num_kv_heads=1, head_size=1), TypeError),
    (lambda: FullAttentionSpec(block_size=16, num_kv_heads=0, head_size=1), ValueError),
    (lambda: FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype="int3"), ValueError),
    (lambda: SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=1, sliding_window=0), ValueError),
    (lambda: make_block_hash_with_group_id(7, 0), TypeError),
])
def test_bad_specs_are_refused(make, exc):
    with pytest.raises(exc):
        make()


def two_groups(block_size=4, window=6, num_blocks=24, sw_block_size=None):
    fa = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=8)
    sw = SlidingWindowSpec(block_size=sw_block_size or block_size, num_kv_heads=2, head_size=8, sliding_window=window)
    return get_kv_cache_coordinator([KVCacheGroupSpec(["full"], fa), KVCacheGroupSpec(["sliding"], sw)],
                                    num_blocks, max_model_len=256, max_in_flight_tokens=16)


def snapshot(c):
    pool = c.block_pool
    return ([b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            [({r: [b.block_id for b in bs] for r, bs in m.req_to_blocks.items()}, dict(m.num_cached_block))
             for m in c.single_type_managers])


def test_refused_calls_change_nothing_in_any_group():
    c = two_groups(num_blocks=10)
    req = Request("a", list(range(10)), hash_block_size=4)
    c.allocate_new_blocks("a", 10)
    c.cache_blocks(req, 10)
    before = snapshot(c)
    # 2 more blocks per group would fit the first group alone: refused whole
    for call, exc in [(lambda: c.allocate_new_blocks("a", 30), ValueError),
                      (lambda: c.allocate_new_blocks(7, 4), TypeError),
                      (lambda: c.allocate_new_blocks("a", -1), ValueError),
                      (lambda: c.get_num_blocks_to_allocate("b", 4, ([],), 0), ValueError),
                      (lambda: c.allocate_new_computed_blocks("a", ([c.block_pool.blocks[1]], []), 4), ValueError),
                      (lambda: c.find_longest_cache_hit(req.block_hashes, 2.0), TypeError)]:
        with pytest.raises(exc):
            call()
        assert snapshot(c) == before
        c.check()


def test_a_table_edit_on_one_group_never_changes_another():
    c = two_groups(window=5)
    c.allocate_new_blocks("a", 20)
    full_before = c.get_block_ids("a")[0]
    c.remove_skipped_blocks("a", 17)  # 17 computed, window 5: tokens 0..12 skipped, blocks 0..2 freed
    full, sliding = c.get_block_ids("a")
    assert full == full_before
    assert sliding[:3] == [0, 0, 0] and 0 not in sliding[3:]
    c.get_blocks("a")[1].clear()  # a copy: editing it changes no table
    assert c.get_block_ids("a") == (full, sliding)
    c.check()


def test_check_names_a_reference_count_that_the_tables_do_not_explain():
    c = two_groups()
    c.allocate_new_blocks("a", 8)
    c.single_type_managers[1].req_to_blocks["a"].pop()
    with pytest.raises(InvariantError, match="ref_cnt = table entries over all groups"):
        c.check()


def test_sliding_window_hit_reads_right_to_left_and_hybrid_agrees_on_one_length():
    c = two_groups(window=6)
    req = Request("a", list(range(21)), hash_block_size=4)
    c.allocate_new_blocks("a", 21)
    c.cache_blocks(req, 21)
    c.remove_skipped_blocks("a", 21)
    c.free("a")
    blocks, n = c.find_longest_cache_hit(req.block_hashes, 20)
    assert n == 20
    full, sliding = ([b.block_id for b in bs] for bs in blocks)
    assert len(full) == 5 and sliding[:3] == [0, 0, 0]  # the window needs cdiv(6 - 1, 4) = 2 blocks
    # The full-attention group loses block 3's entry: the hybrid hit shrinks to what both hold.
    c.block_pool.evict_blocks([full[3]])
    _, n = c.find_longest_cache_hit(req.block_hashes, 20)
    assert n == 12
    c.check()


def test_a_prompt_tail_inside_a_long_attention_block_is_a_second_key_of_that_block():
    c = two_groups(block_size=8, window=5, sw_block_size=4, num_blocks=12)
    req = Request("a", list(range(14)), hash_block_size=4)  # a resend can hit 12 tokens: inside block 1
    c.allocate_new_blocks("a", 16)
    c.cache_blocks(req, 14)  # the hybrid caches to a multiple of 8: block 1 is not full yet
    assert c.block_pool.cached_block_hashes_by_block == {}
    req.append_output_token_ids([50, 51])
    c.cache_blocks(req, 16)
    block = c.get_blocks("a")[0][1]
    tail_key = make_block_hash_with_group_id(req.block_hashes[2], 0)
    assert block.block_hash == make_block_hash_with_group_id(req.block_hashes[3], 0)
    assert c.block_pool.cached_block_hashes_by_block == {block.block_id: [tail_key]}
    assert c.block_pool.get_cached_block(tail_key) is block
    c.check()
    c.free("a")
    # the pool reuses the block: every key it was filed under dies with it
    c.allocate_new_blocks("b", 4 * (c.block_pool.get_num_free_blocks() // 2))
    assert block.block_hash is None and c.block_pool.get_cached_block(tail_key) is None
    assert c.block_pool.cached_block_hashes_by_block == {}
    c.check()
    # a further key on a block without a hash is an invariant broken, and named
    c.block_pool.cached_block_hashes_by_block[block.block_id] = [tail_key]
    c.block_pool.cached_block_hash_to_block[tail_key] = {block.block_id: block}
    with pytest.raises(InvariantError, match="further keys only beside a hash"):
        c.check()


# ------------------------------------------------------------------ the differential

class Pair:
    """Our coordinator and vLLM's, driven as vLLM's ``KVCacheManager.allocate_slots`` drives them."""

    def __init__(self, vllm, groups, num_blocks, max_model_len, max_in_flight, hash_block_size):
        I, C = vllm.kv_cache_interface, vllm.kv_cache_coordinator
        self.ours = get_kv_cache_coordinator(groups, num_blocks, max_model_len, max_in_flight,
                                             hash_block_size=hash_block_size)
        config = I.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            I.KVCacheGroupSpec(list(g.layer_names), their_spec(vllm, g.kv_cache_spec)) for g in groups])
        sizes = [g.kv_cache_spec.block_size for g in groups]
        self.theirs = C.get_kv_cache_coordinator(
            config, max_model_len=max_model_len, max_in_flight_tokens=max_in_flight, use_eagle=False,
            enable_caching=True, enable_kv_cache_events=False, dcp_world_size=1, pcp_world_size=1,
            scheduler_block_size=math.lcm(*sizes), hash_block_size=hash_block_size)
        assert type(self.ours).__name__ == type(self.theirs).__name__
        assert (getattr(self.ours, "enable_partial_hash_hits", False)
                == self.theirs.enable_partial_hash_hits), "partial hash hits on or off"
        self.max_model_len = max_model_len
        self.compared = 0
        self.further_keys = 0  # summed over comparisons: blocks reachable under two keys were seen

    def both(self, name, *args, **kwargs):
        a = getattr(self.ours, name)(*args, **kwargs)
        b = getattr(self.theirs, name)(*args, **kwargs)
        return a, b

    def compare(self, where):
        self.compared += 1
        ours, theirs = self.ours, self.theirs
        ours.check()
        q = lambda pool: [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert q(ours.block_pool) == q(theirs.block_pool), f"free queue, {where}"
        assert [b.ref_cnt for b in ours.block_pool.blocks[1:]] == [b.ref_cnt for b in theirs.block_pool.blocks[1:]], where
        # a block's further keys (a prompt tail's partial key beside its whole-block key)
        assert ({i: set(k) for i, k in ours.block_pool.cached_block_hashes_by_block.items()}
                == theirs.block_pool.cached_block_hashes_by_block), f"further keys, {where}"
        self.further_keys = (getattr(self, "further_keys", 0)  # also called on other pairs' namespaces
                             + sum(map(len, ours.block_pool.cached_block_hashes_by_block.values())))
        mine_cow = [(s.block_id, d.block_id) for m in ours.single_type_managers for s, d in m.pending_cow_copies]
        their_cow = [(s.block_id, d.block_id) for m in theirs.single_type_managers for s, d in m._pending_cow_copies]
        assert mine_cow == their_cow, f"pending copies, {where}"
        assert ({k: list(v) for k, v in ours.block_pool.cached_block_hash_to_block.items()}
                == {k: ([v.block_id] if not isinstance(v, dict) else list(v))
                    for k, v in theirs.block_pool.cached_block_hash_to_block._cache.items()}), f"prefix cache, {where}"
        assert ([b.block_hash for b in ours.block_pool.blocks]
                == [b.block_hash for b in theirs.block_pool.blocks]), f"cached hashes, {where}"
        for g, (m, t) in enumerate(zip(ours.single_type_managers, theirs.single_type_managers)):
            mine = {r: [b.block_id for b in bs] for r, bs in m.req_to_blocks.items()}
            their = {r: [b.block_id for b in bs] for r, bs in t.req_to_blocks.items() if r in t.num_cached_block or bs}
            assert mine == their, f"group {g} tables, {where}"
            assert m.num_cached_block == t.num_cached_block, f"group {g} cached counts, {where}"


def mamba_split(req: Request, start: int, end: int, block_size: int, tail_stop: bool) -> int:
    """Where a prefill chunk ends beside a Mamba group in align mode (vLLM's
    ``Scheduler._mamba_block_aligned_split``, without EAGLE, checkpoints or
    junctions): on a state-block boundary before the prompt's end, and at the
    prompt's last hash-block boundary when partial hits are on."""
    prefill_end = max(len(req.prompt_token_ids), req.num_tokens - 1)
    if start >= prefill_end:
        return end
    if end < prefill_end and end // block_size * block_size > start:
        end = end // block_size * block_size
    if tail_stop:
        tail = (len(req.prompt_token_ids) - 1) // req.hash_block_size * req.hash_block_size
        if start < tail < end:
            end = tail
    return end


def drain_copies(pair: Pair, stats: dict, where: str):
    """End of a scheduling step: the copies run, both ends of each are freed (vLLM's
    scheduler, ``take_kv_cache_block_copies`` then ``free_blocks``)."""
    copies, retained = pair.ours.take_kv_cache_block_copies()
    theirs = [p for m in pair.theirs.single_type_managers for p in m.take_pending_cow_copies()]
    assert copies == [(s.block_id, d.block_id) for s, d in theirs], f"copies, {where}"
    stats["copies"] += len(copies)
    pair.ours.block_pool.free_blocks(retained)
    pair.theirs.block_pool.free_blocks([b for p in theirs for b in p])
    pair.compare(f"copies run, {where}")


def random_run(pair: Pair, seed: int, steps: int, chunk: int):
    """Requests share prefixes (so hits happen), prefill in chunks, decode, finish or get preempted."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 40))] for _ in range(3)]
    waiting: list[Request] = []
    running: dict[str, tuple[Request, types.SimpleNamespace]] = {}
    stats = dict(hits=0, hit_tokens=0, partial_hits=0, refused=0, preempted=0, finished=0, skipped_frees=0,
                 copies=0)
    mamba = [m for m in pair.ours.single_type_managers if isinstance(m.kv_cache_spec, MambaSpec)]
    tail_stop = getattr(pair.ours, "enable_partial_hash_hits", False)

    def split(req, start, end):
        return mamba_split(req, start, end, mamba[0].block_size, tail_stop) if mamba else end

    next_id = 0
    B = pair.ours.hash_block_size
    for step in range(steps):
        pair.both("new_step_starts")
        if rng.random() < 0.4 or not (waiting or running):
            prompt = list(rng.choice(prefixes)) + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
            waiting.append(Request(f"r{next_id}", prompt[:pair.max_model_len - 8], max_tokens=rng.randrange(1, 12),
                                   hash_block_size=B))
            next_id += 1
        if waiting and rng.random() < 0.6:  # admit one
            req = waiting[0]
            view = types.SimpleNamespace(request_id=req.request_id, block_hashes=req.block_hashes,
                                         num_prompt_tokens=len(req.prompt_token_ids), shared_prefix_boundary=0)
            (hit_ours, n_ours), (hit_theirs, n_theirs, _) = pair.both("find_longest_cache_hit", req.block_hashes,
                                                                       req.num_tokens - 1)
            assert n_ours == n_theirs, f"hit length, step {step}"
            assert ([[b.block_id for b in bs] for bs in hit_ours]
                    == [[b.block_id for b in bs] for bs in hit_theirs]), f"hit blocks, step {step}"
            need = split(req, n_ours, n_ours + min(chunk, req.num_tokens - n_ours))
            a = pair.ours.get_num_blocks_to_allocate(req.request_id, need, hit_ours, n_ours)
            b = pair.theirs.get_num_blocks_to_allocate(req.request_id, need, hit_theirs, 0, n_ours, n_ours, need)
            assert a == b, f"blocks to allocate, step {step}"
            if a > pair.ours.block_pool.get_num_free_blocks():
                stats["refused"] += 1
            else:
                waiting.pop(0)
                stats["hits"] += n_ours > 0
                stats["partial_hits"] += n_ours % max(m.block_size for m in pair.ours.single_type_managers) != 0
                stats["hit_tokens"] += n_ours
                pair.ours.allocate_new_computed_blocks(req.request_id, hit_ours, n_ours)
                pair.theirs.allocate_new_computed_blocks(req.request_id, hit_theirs, n_ours, 0)
                pair.ours.allocate_new_blocks(req.request_id, need)
                pair.theirs.allocate_new_blocks(req.request_id, need, need)
                pair.ours.cache_blocks(req, min(need, req.num_tokens))
                pair.theirs.cache_blocks(view, min(need, req.num_tokens))
                req.num_computed_tokens = need
                running[req.request_id] = (req, view)
            pair.compare(f"admission, step {step}")
        for rid in list(running):  # one step for every running request
            req, view = running[rid]
            if rng.random() < 0.15:
                pair.both("free", rid)
                del running[rid]
                waiting.append(Request(rid + "p", req.all_token_ids, max_tokens=req.max_tokens, hash_block_size=B))
                stats["preempted"] += 1
                pair.compare(f"preempt {rid}, step {step}")
                continue
            if req.num_computed_tokens >= req.num_tokens:  # decoding: one sampled token
                if req.is_finished or req.num_tokens >= pair.max_model_len - 1:
                    pair.both("free", rid)
                    del running[rid]
                    stats["finished"] += 1
                    pair.compare(f"finish {rid}, step {step}")
                    continue
                req.append_output_token_ids(rng.randrange(50))
            before = sum(b.is_null for m in pair.ours.single_type_managers for b in m.req_to_blocks.get(rid, ()))
            pair.both("remove_skipped_blocks", rid, req.num_computed_tokens)
            after = sum(b.is_null for m in pair.ours.single_type_managers for b in m.req_to_blocks.get(rid, ()))
            stats["skipped_frees"] += after - before
            start = req.num_computed_tokens
            need = split(req, start, start + min(chunk, req.num_tokens - start))
            a = pair.ours.get_num_blocks_to_allocate(rid, need, ((),) * len(pair.ours.single_type_managers),
                                                     req.num_computed_tokens)
            b = pair.theirs.get_num_blocks_to_allocate(rid, need, ((),) * len(pair.ours.single_type_managers),
                                                       0, req.num_computed_tokens, req.num_computed_tokens, need)
            assert a == b, f"blocks to allocate for {rid}, step {step}"
            if a > pair.ours.block_pool.get_num_free_blocks():  # preempt it instead
                pair.both("free", rid)
                del running[rid]
                waiting.append(Request(rid + "p", req.all_token_ids, max_tokens=req.max_tokens, hash_block_size=B))
                stats["preempted"] += 1
            else:
                pair.ours.allocate_new_blocks(rid, need)
                pair.theirs.allocate_new_blocks(rid, need, need)
                pair.ours.cache_blocks(req, min(need, req.num_tokens))
                pair.theirs.cache_blocks(view, min(need, req.num_tokens))
                req.num_computed_tokens = need
            pair.compare(f"step of {rid}, step {step}")
        drain_copies(pair, stats, f"step {step}")
    return stats


CONFIGS = {
    # name: ([(kind, block_size, window)], hash_block_size, num_blocks)
    "fa4+sw4 window 6": ([("full", 4, None), ("sliding", 4, 6)], 4, 40),
    "fa4+sw4 window 13": ([("full", 4, None), ("sliding", 4, 13)], 4, 48),
    "fa4+sw4 window 3": ([("full", 4, None), ("sliding", 4, 3)], 4, 30),
    "fa4+sw8 window 10": ([("full", 4, None), ("sliding", 8, 10)], 4, 40),
    "fa8+sw4 window 5": ([("full", 8, None), ("sliding", 4, 5)], 4, 40),
    "2 fa + sw window 7": ([("full", 4, None), ("full", 4, None), ("sliding", 4, 7)], 4, 60),
    "sw4 alone, window 9": ([("sliding", 4, 9)], 4, 30),
    "fa4 alone": ([("full", 4, None)], 4, 30),
    # Mamba in align mode: state blocks of 8 tokens hashed every 4, so hits may
    # end inside a state block and are copied (the one copy 0.33.0 makes);
    # and a state block as long as the hash block, where hits are whole.
    "fa4+mamba8 align": ([("full", 4, None), ("mamba", 8, None)], 4, 40),
    "fa4+mamba4 align": ([("full", 4, None), ("mamba", 4, None)], 4, 40),
    # attention blocks of 8 beside the state blocks: hits may end inside both
    "fa8+mamba8 align": ([("full", 8, None), ("mamba", 8, None)], 4, 40),
}


def make_groups(layout):
    groups = []
    for i, (kind, bs, window) in enumerate(layout):
        # heads chosen so every group's page is 8 * 4 * 2 * 2 * 4 = 512 bytes
        heads = 32 // bs
        if kind == "mamba":  # one 512-byte state: 256 float16 values
            groups.append(KVCacheGroupSpec([f"layer{i}"], MambaSpec(block_size=bs, shapes=((16, 16),))))
            continue
        spec = (FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=4) if kind == "full" else
                SlidingWindowSpec(block_size=bs, num_kv_heads=heads, head_size=4, sliding_window=window))
        groups.append(KVCacheGroupSpec([f"layer{i}"], spec))
    assert len({g.kv_cache_spec.page_size_bytes for g in groups}) == 1
    return groups


# A full-attention group whose block is longer than the hash block also files
# the prompt's tail, when it ends inside a block, under a partial key
# (``_cache_partial_tail_block``, ``v1/core/single_type_kv_cache_manager.py:859-897``).
# Beside a sliding window the block is already filed whole by then, so the
# tail key is a second key of the same block (``cached_block_hashes_by_block``);
# beside a Mamba group in align mode a hit can end on it, inside the block.
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_differential_against_vllm_0_33_0(vllm, name):
    layout, hash_block_size, num_blocks = CONFIGS[name]
    totals = dict(compared=0)
    for seed in range(3):
        pair = Pair(vllm, make_groups(layout), num_blocks, max_model_len=96, max_in_flight=8,
                    hash_block_size=hash_block_size)
        assert isinstance(pair.ours, UnitaryKVCacheCoordinator if len(layout) == 1 else HybridKVCacheCoordinator)
        stats = random_run(pair, seed, steps=120, chunk=[5, 8, 16][seed] if "mamba" not in name else [9, 8, 16][seed])
        totals["compared"] += pair.compared
        totals["further_keys"] = totals.get("further_keys", 0) + pair.further_keys
        for k, v in stats.items():
            totals[k] = totals.get(k, 0) + v
    print(f"\n{name}: {totals}")
    # the workloads reach what they are meant to exercise
    assert totals["hits"] > 0 and totals["preempted"] > 0 and totals["finished"] > 0
    if any(kind in ("sliding", "mamba") for kind, _, _ in layout):
        assert totals["skipped_frees"] > 0
    if name in ("fa4+mamba8 align", "fa8+mamba8 align"):  # partial hits happen, and are copied
        assert totals["partial_hits"] > 0 and totals["copies"] > 0
    if name == "fa8+sw4 window 5":  # blocks reachable under two keys, compared with vLLM's
        assert totals["further_keys"] > 0


# ------------------------------------------------------------------ stateful, against an oracle

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402


class TwoGroupMachine(RuleBasedStateMachine):
    """A full-attention and a sliding-window group over one pool, against an oracle of counts.

    The oracle knows, per request, the tokens with a slot (``T``) and the
    window's skipped blocks so far (``S``): the full table has ``cdiv(T, B)``
    blocks, the window's table as many entries of which the first ``S`` are
    null, and the pool's free count is what those real blocks leave.
    """

    B, W, N = 4, 6, 30

    def __init__(self):
        super().__init__()
        self.c = two_groups(block_size=self.B, window=self.W, num_blocks=self.N)
        self.oracle: dict[str, list[int]] = {}  # rid -> [T, S]
        self.next = 0

    @rule(tokens=st.integers(1, 24))
    def admit(self, tokens):
        rid = f"r{self.next}"
        self.next += 1
        need = self.c.get_num_blocks_to_allocate(rid, tokens, ([], []), 0)
        assert need == 2 * cdiv(tokens, self.B)
        if need > self.c.block_pool.get_num_free_blocks():
            before = snapshot(self.c)
            with pytest.raises(ValueError, match="only .* are free"):
                self.c.allocate_new_blocks(rid, tokens)
            assert snapshot(self.c) == before
            return
        self.c.allocate_new_blocks(rid, tokens)
        self.oracle[rid] = [tokens, 0]

    @precondition(lambda self: self.oracle)
    @rule(data=st.data(), more=st.integers(0, 9))
    def run_a_step(self, data, more):
        rid = data.draw(st.sampled_from(sorted(self.oracle)))
        T, S = self.oracle[rid]
        self.c.remove_skipped_blocks(rid, T)  # the step before computed all T tokens
        S = max(S, min(max(0, T - self.W + 1) // self.B, cdiv(T, self.B)))
        need = self.c.get_num_blocks_to_allocate(rid, T + more, ((), ()), T)
        if need <= self.c.block_pool.get_num_free_blocks():
            self.c.allocate_new_blocks(rid, T + more)
            T += more
        self.oracle[rid] = [T, S]

    @precondition(lambda self: self.oracle)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.oracle)))
        self.c.free(rid)
        del self.oracle[rid]

    @invariant()
    def agrees_with_the_oracle(self):
        self.c.check()
        held = 0
        for rid, (T, S) in self.oracle.items():
            full, sliding = self.c.get_block_ids(rid)
            assert len(full) == len(sliding) == cdiv(T, self.B)
            assert sliding[:S] == [0] * S and 0 not in sliding[S:] and 0 not in full
            held += len(full) + len(sliding) - S
        assert self.c.block_pool.get_num_free_blocks() == self.N - 1 - held


TestTwoGroupMachine = TwoGroupMachine.TestCase
TestTwoGroupMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# ------------------------------------------------------------------ Mamba in align mode

@pytest.mark.parametrize("kwargs,exc", [
    (dict(shapes=()), TypeError),
    (dict(shapes=((4, 0),)), ValueError),
    (dict(shapes=((4,),), dtypes=("float16", "float16")), ValueError),
    (dict(shapes=((4,),), mamba_cache_mode="all"), ValueError),
    (dict(shapes=((4,),), num_speculative_blocks=1), ValueError),
])
def test_bad_mamba_specs_are_refused(kwargs, exc):
    with pytest.raises(exc):
        MambaSpec(block_size=8, **kwargs)


def test_mamba_state_page_and_budget():
    spec = MambaSpec(block_size=8, shapes=((16, 16), (4,)), dtypes=("float16", "float32"))
    assert spec.page_size_bytes == 16 * 16 * 2 + 4 * 4
    assert spec.max_memory_usage_bytes(4096, 512) == 2 * spec.page_size_bytes  # read state + written state
    assert spec.max_num_blocks_per_req(20) == 3  # position-indexed, mostly null


def fa_mamba(num_blocks=20):
    return get_kv_cache_coordinator([
        KVCacheGroupSpec(["attn"], FullAttentionSpec(block_size=4, num_kv_heads=8, head_size=4)),
        KVCacheGroupSpec(["mamba"], MambaSpec(block_size=8, shapes=((16, 16),)))],
        num_blocks, max_model_len=64, max_in_flight_tokens=16, hash_block_size=4)


def test_a_partial_hit_under_mamba_align_is_copied_and_its_owner_keeps_its_block():
    c = fa_mamba()
    assert c.enable_partial_hash_hits and c.cache_hit_alignment_tokens == 4
    a = Request("a", list(range(14)), hash_block_size=4)  # its last hittable boundary: 12 tokens
    for n in (8, 12):  # chunks end at a state boundary, then at the prompt's tail boundary
        c.new_step_starts()
        c.remove_skipped_blocks("a", a.num_computed_tokens)
        c.allocate_new_blocks("a", n)
        c.cache_blocks(a, n)
        a.num_computed_tokens = n
        assert c.take_kv_cache_block_copies() == ([], [])
    mamba = c.single_type_managers[1]
    state = c.get_blocks("a")[1][1]
    assert state.block_hash is not None and mamba._partial_hit_reqs["a"] == (1, state)
    # a's next step writes that state: the entry moves to a copy, a keeps its block
    c.new_step_starts()
    c.remove_skipped_blocks("a", 12)
    c.allocate_new_blocks("a", 14)
    (copies, retained) = c.take_kv_cache_block_copies()
    (src, dst), = copies
    assert src == state.block_id and c.get_blocks("a")[1][1] is state and state.block_hash is None
    assert c.block_pool.blocks[dst].block_hash is not None
    c.block_pool.free_blocks(retained)  # the copy has run
    c.check()
    # b shares the 12 tokens: its hit ends inside a state block, so b gets its own copy
    c.new_step_starts()
    b = Request("b", list(range(12)) + [99, 98, 97], hash_block_size=4)
    hit, n = c.find_longest_cache_hit(b.block_hashes, b.num_tokens - 1)
    assert n == 12 and [x.block_id for x in hit[1]] == [0, dst]
    c.allocate_new_computed_blocks("b", hit, n)
    c.allocate_new_blocks("b", 15)
    (copies, retained) = c.take_kv_cache_block_copies()
    (src2, cow), = copies
    assert src2 == dst and c.get_block_ids("b")[1] == [0, cow] and cow != dst
    c.block_pool.free_blocks(retained)
    c.check()
