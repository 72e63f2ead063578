"""The conversation sim's CPU offload tier call for call beside vLLM 0.33.0's own ``CPUOffloadingManager``.

``sim.conversations`` models vLLM's native CPU KV offloading (the
``CPUOffloadingManager`` with the LRU policy) by a ``_CPUTier`` of block
hashes in eviction order. This test runs ``simulate`` on random
conversation workloads with that tier replaced by a subclass that does
exactly what the sim asks (it calls the sim's own methods) and, at each of
the sim's calls, makes the manager calls it stands for on vLLM's manager,
executed from the wheel (at the sim's granularity: one store per offer,
every transfer complete at once):

- a request's ``lookup`` (its first tier call) opens a ``ReqContext``
  (``on_new_request``), records every key's end position, asks ``lookup``
  key by key from where the GPU's hit ended until a miss or the cap, then
  ``prepare_load`` / ``complete_load`` the keys hit (a load is instant);
- ``offer`` (the prompt's full blocks once computed; the reply's once it
  finishes, with ``offload_prompt_only`` off) is ``prepare_store`` then
  ``complete_store`` of the keys it accepted;
- the request's last ``touch`` (outside an offer) is ``on_request_finished``.

Compared: every lookup's length; every store's accepted keys, whether it
failed, and its evicted keys in eviction order; and after every request the
blocks held with their whole eviction order (vLLM's: the LRU policy's ranks,
ascending, which its heap pops in that order), every chunk ready and
evictable (nothing in flight between requests, as the sim assumes). The
workloads are sized so that the GPU pool evicts histories (the tier is hit
and loads), the small tiers evict and refuse whole stores (a burst prompt
longer than the tier), and the large one does neither; 0 stores nothing;
on a tight GPU pool a reply's store evicts its own prompt's tail, leaving
a hole a later lookup must stop at. The test asserts each of these happens.

It fails when the sim is wrong; each of these, planted in ``_CPUTier`` by
hand (never committed), failed it at the first divergence:

- an MRU eviction (``victims`` taken from ``reversed(self.order)``):
  "evicted keys, in order", capacity 12, seed 0, request 7;
- a store that may evict the offered blocks (``offered = set()``): the
  same store, same message;
- the refusal test without the offered blocks held (``need >
  len(self.order)``): "evicted keys, in order", capacity 12, request 15;
- ``touch`` making the head least recent (``for key in keys``): "eviction
  order", capacity 12, request 1;
- a lookup that counts held blocks past a hole: "lookup from block 7",
  capacity 8, seed 2, replies stored (only the tight runs make holes).

Not tested here: which blocks vLLM's connector offers and when (the sim's
model, stated in its docstring); only what the manager then does with them.

Stubbed (not exercised): the logger, the connector's stats class, the
``kv_hints`` and offloading-config classes (annotations only).
"""

from __future__ import annotations

import logging
import types
import zipfile

import pytest

from pagedkv.sim import conversations
from pagedkv.sim.conversations import ConversationWorkload, simulate
from vllm_wheel import exec_from_wheel, stub_modules, vllm_wheel

SimTier = conversations._CPUTier  # the sim's own, before any test replaces it

MODULES = ("utils.math_utils", "v1.metrics.cache_hit_source", "v1.kv_offload.base",
           "v1.kv_offload.cpu.common", "v1.kv_offload.cpu.policies.base",
           "v1.kv_offload.cpu.policies.factory", "v1.kv_offload.cpu.policies.lru",
           "v1.kv_offload.cpu.manager")


@pytest.fixture
def vllm_offload(monkeypatch) -> dict[str, types.ModuleType]:
    """vLLM 0.33.0's ``v1/kv_offload`` base, CPU manager and LRU policy, executed from the wheel.

    The modules leave ``sys.modules`` when the test ends.
    """
    wheel = vllm_wheel()
    stub = stub_modules(monkeypatch, "vllm")

    for name in ("vllm", "vllm.utils", "vllm.v1", "vllm.v1.metrics", "vllm.v1.kv_offload",
                 "vllm.v1.kv_offload.cpu", "vllm.v1.kv_offload.cpu.policies", "vllm.distributed",
                 "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
                 "vllm.distributed.kv_transfer.kv_connector.v1",
                 "vllm.distributed.kv_transfer.kv_connector.v1.offloading"):
        stub(name)
    stub("vllm.logger", init_logger=logging.getLogger)
    stub("vllm.v1.kv_hints", KvHintsEnvelope=object)
    stub("vllm.v1.kv_offload.config", OffloadingConfig=object)
    stub("vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics", OffloadingConnectorStats=object)
    loaded = {}
    with zipfile.ZipFile(wheel) as z:
        for short in MODULES:
            loaded[short] = exec_from_wheel(monkeypatch, z, f"vllm/{short.replace('.', '/')}.py",
                                            f"vllm.{short}", "vllm-0.33.0")
    return loaded


def lockstep_tier(vllm, stats: dict):
    """A ``_CPUTier`` that drives vLLM's ``CPUOffloadingManager`` (LRU) beside itself and compares."""
    base, manager = vllm["v1.kv_offload.base"], vllm["v1.kv_offload.cpu.manager"]
    HIT = base.LookupResult.HIT

    class Lockstep(SimTier):
        def __init__(self, capacity, run):
            super().__init__(capacity, run)
            self.theirs = manager.CPUOffloadingManager(num_chunks=capacity, cache_policy="lru")
            self.keys: dict[object, bytes] = {}  # our block hash -> vLLM's OffloadKey (group 0)
            self.ctx = None
            self.in_offer = False
            self.offered = 0  # keys this request offered so far: the next one's position
            self.requests = 0

        def key(self, h) -> bytes:
            if h not in self.keys:
                self.keys[h] = base.make_offload_key(len(self.keys).to_bytes(8, "big"), 0)
            return self.keys[h]

        def where(self) -> str:
            w = self.run.workload
            return (f"seed {w.seed}, cpu_blocks {w.cpu_blocks}, prompt_only {w.cpu_offload_prompt_only}, "
                    f"request {self.requests}")

        def lookup(self, hashes, start, stop):
            n = super().lookup(hashes, start, stop)
            assert self.ctx is None, f"a lookup inside a request, {self.where()}"
            self.ctx = base.ReqContext(req_id=f"r{self.requests}")
            self.theirs.on_new_request(self.ctx)
            self.offered = 0
            for i, h in enumerate(hashes):  # end positions, in blocks: only their order matters
                self.ctx.set_offload_key_position(self.key(h), i + 1)
            m = 0
            while start + m < stop and self.theirs.lookup(self.key(hashes[start + m]), self.ctx) == HIT:
                m += 1
            assert n == m, f"lookup from block {start}: ours {n}, vLLM {m}, {self.where()}"
            stats["lookups"] += 1
            stats["gaps"] += any(h in self.order for h in hashes[start + m:stop])
            if m:
                loaded = [self.key(h) for h in hashes[start:start + m]]
                self.theirs.prepare_load(loaded, self.ctx)
                self.theirs.complete_load(loaded, self.ctx)
                stats["loaded_blocks"] += m
            return n

        def offer(self, keys):
            assert self.ctx is not None, f"an offer outside a request, {self.where()}"
            before = list(self.order)
            self.in_offer = True
            try:
                super().offer(keys)
            finally:
                self.in_offer = False
            new = [k for k in keys if k not in before]
            ours_stored = [self.key(k) for k in new if k in self.order]
            ours_evicted = [self.key(k) for k in before if k not in self.order]
            ours_failed = bool(new) and not ours_stored  # all or none: a refused store stores nothing
            theirs_keys = [self.key(k) for k in keys]
            for i, k in enumerate(theirs_keys):
                self.ctx.set_offload_key_position(k, self.offered + i + 1)
            self.offered += len(keys)
            out = self.theirs.prepare_store(theirs_keys, self.ctx)
            if out is not None:
                self.theirs.complete_store(out.keys_to_store, self.ctx)
            what = f"store of {len(keys)} keys, {self.where()}"
            theirs_evicted = [] if out is None else list(out.evicted_keys)
            assert ours_evicted == theirs_evicted, f"evicted keys, in order; {what}"
            assert ours_failed == (out is None), f"refused: ours {ours_failed}, vLLM {out is None}; {what}"
            assert ours_stored == ([] if out is None else list(out.keys_to_store)), f"stored keys; {what}"
            stats["stores"] += 1
            stats["failed_stores"] += out is None
            stats["evicted_blocks"] += len(ours_evicted)

        def touch(self, keys):
            super().touch(keys)
            if self.in_offer:
                return
            assert self.ctx is not None, f"a finish outside a request, {self.where()}"
            self.theirs.on_request_finished(self.ctx)
            self.ctx = None
            self.requests += 1
            self.compare()

        def compare(self):
            policy = self.theirs._policy
            theirs = sorted(policy.chunks, key=policy._ranks.__getitem__)  # next to evict first
            ours = [self.key(h) for h in self.order]
            assert len(ours) <= self.capacity, f"ours holds {len(ours)} > {self.capacity}, {self.where()}"
            assert set(ours) == set(theirs), (f"held: ours {len(ours)}, vLLM {len(theirs)}, "
                                              f"{len(set(ours) ^ set(theirs))} differ, {self.where()}")
            assert ours == theirs, f"eviction order ({len(ours)} held), {self.where()}"
            assert all(c.is_ready and c.ref_cnt == 0 for c in policy.chunks.values()), self.where()
            assert policy._evictable == set(theirs), f"vLLM holds a pinned chunk, {self.where()}"
            assert self.theirs._num_evictable_cache_chunks == len(theirs), self.where()
            stats["states"] += 1
            stats["held_max"] = max(stats["held_max"], len(ours))

    return Lockstep


# Six conversations whose working set (6 x 22 blocks) outgrows a 60-block GPU pool, and a burst of
# 16-block prompts: a 12-block tier refuses them whole, 60 evicts, 10,000 never does, 0 stores nothing.
# Three conversations on a 24-block pool (one request's worth) with a tier of 8 or 14: a reply's store
# can evict its own prompt's tail, the only way to leave a hole that a later lookup must stop at.
RUNS = [(60, 6, cpu_blocks) for cpu_blocks in (0, 12, 60, 10_000)] + [(24, 3, 8), (24, 3, 14)]
SEEDS = (0, 1, 2, 3, 4)


def workload(seed, cpu_blocks, prompt_only, num_blocks, num_conversations):
    return ConversationWorkload(num_conversations=num_conversations, system_len=32, message_len=24,
                                reply_len=40, turns=5, think_time_s=20.0, burst_at_s=100.0, burst_requests=8,
                                burst_prompt_len=256, burst_output_len=32, num_blocks=num_blocks, block_size=16,
                                duration_s=300.0, window_s=30.0, seed=seed, cpu_blocks=cpu_blocks,
                                cpu_offload_prompt_only=prompt_only)


def run_lockstep(vllm, monkeypatch, prompt_only):
    """Every run of ``RUNS`` x ``SEEDS`` in lockstep; ``{(num_blocks, cpu_blocks, seed): stats}``."""
    totals = {}
    for num_blocks, num_conversations, cpu_blocks in RUNS:
        for seed in SEEDS:
            stats = dict(lookups=0, gaps=0, loaded_blocks=0, stores=0, failed_stores=0, evicted_blocks=0,
                         states=0, held_max=0)
            monkeypatch.setattr(conversations, "_CPUTier", lockstep_tier(vllm, stats))
            run = simulate(workload(seed, cpu_blocks, prompt_only, num_blocks, num_conversations))
            # every request was compared, and the run's own counters agree with what was compared
            where = (num_blocks, cpu_blocks, seed)
            assert stats["states"] == stats["lookups"] == run.num_turns + 8, where
            assert run.cpu_failed_stores == stats["failed_stores"], where
            assert run.cpu_evicted_blocks == stats["evicted_blocks"], where
            assert sum(n for _, n in run.loaded_windows) == stats["loaded_blocks"] * 16, where
            totals[where] = stats
    return totals


@pytest.mark.parametrize("prompt_only", [True, False], ids=["prompt_only", "with_replies"])
def test_offload_tier_equals_vllm_cpu_offloading_manager(vllm_offload, monkeypatch, prompt_only):
    totals = run_lockstep(vllm_offload, monkeypatch, prompt_only)
    # the workloads exercise what is compared: loads, evictions and refused stores where they can happen
    for seed in SEEDS:
        assert totals[60, 0, seed]["held_max"] == 0 and totals[60, 0, seed]["failed_stores"] > 0
        assert totals[60, 12, seed]["failed_stores"] > 0 and totals[60, 12, seed]["evicted_blocks"] > 0
        assert totals[60, 60, seed]["evicted_blocks"] > 0 and totals[60, 60, seed]["loaded_blocks"] > 0
        big = totals[60, 10_000, seed]
        assert big["evicted_blocks"] == big["failed_stores"] == 0 and big["loaded_blocks"] > 0
    if not prompt_only:  # some lookup stopped at a hole with blocks held past it
        assert sum(totals[24, c, seed]["gaps"] for c in (8, 14) for seed in SEEDS) > 0
