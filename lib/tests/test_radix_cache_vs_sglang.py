"""``pagedkv.radix_cache`` beside SGLang 0.5.23's own ``RadixCache``, run from the release wheel.

SGLang's ``mem_cache/{evict_policy,cache_init_params,base_prefix_cache,radix_cache}.py``
are read from the wheel (never installed) and executed with what they import
stubbed: no KV events, no metrics, LRU as the only policy, and a logical clock
in place of ``time.monotonic()`` (one tick a call, as ours ticks once a call),
so both trees see the same order of accesses. Both trees free evicted slots
into our ``TokenToKVPoolAllocator`` (one each), which records every
``free_segment``.

Random workloads (seeds 0-5, page sizes 1 and 4) mimic a scheduler: requests
built on a few shared system prompts, multi-turn follow-ups that extend a
cached conversation, requests that ignore the cache (so an insert finds
duplicates to free), lookups that end inside an edge, decode steps, finishes
(insert, free duplicates, unlock) and evictions under memory pressure. After
every operation the two must agree on the result (matched length and slots,
the matched node, inserted prefix length, evicted slots in order), the tree
(keys, slots, lock counts, child order, the order of access times), the
evictable leaves, ``evictable_size``/``protected_size`` and both allocators'
free lists. ``check()`` holds after every operation.

Planted bugs, tried by hand and not kept: evicting the most recent leaf first
(the heap keyed on ``-last_access_time``) fails all 12 runs at their first
eviction (different slots freed); a split that gives the new node
``lock_ref = 0`` fails all 12 at the first split of a locked edge (the
trees' lock counts differ). 7,601 states compared, 0 divergences.

Then bad input: each refusal names the problem and changes nothing.
"""

from __future__ import annotations

import itertools
import random
import types
import zipfile
from array import array

import pytest
import torch

from pagedkv.common import InvariantError
from pagedkv.radix_cache import RadixCache, TreeNode
from pagedkv.token_pool import TokenToKVPoolAllocator
from vllm_wheel import exec_from_wheel, sglang_wheel, stub_modules

MEM = "sglang/srt/mem_cache"


def load_sglang_radix_cache(wheel, monkeypatch) -> dict[str, types.ModuleType]:
    """SGLang's radix cache modules, executed from the wheel with their imports stubbed.

    ``monkeypatch`` takes every ``sglang`` module out of ``sys.modules`` again when the test ends.
    """
    stub = stub_modules(monkeypatch, "sglang")

    class NoEvents:  # KVCacheEventRecorder, switched off: every record_* does nothing
        def __init__(self, **kwargs):
            pass

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    for name in ("sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.utils",
                 "sglang.srt.mem_cache.unified_cache", "sglang.srt.observability"):
        stub(name)
    stub("sglang.srt.mem_cache.events", KVCacheEventRecorder=NoEvents, LoRANameTable=dict, KvEventLoraNames=dict)
    stub("sglang.srt.mem_cache.allocator", BaseTokenToKVPoolAllocator=object)
    stub("sglang.srt.mem_cache.memory_pool", ReqToTokenPool=object)
    stub("sglang.srt.mem_cache.unified_cache.component_type", ComponentType=object)
    stub("sglang.srt.observability.metrics_collector", STAT_LOGGER_ROLE_RADIX_CACHE=None,
         RadixCacheMetricsCollector=object, radix_cache_metric_labels=None, resolve_collector_class=None)
    stub("sglang.srt.runtime_context", get_observability=None, get_parallel=None)
    stub("sglang.srt.utils.common", ceil_align=lambda x, a: -(-x // a) * a)
    loaded = {}
    with zipfile.ZipFile(wheel) as z:
        def load(short):
            loaded[short] = exec_from_wheel(monkeypatch, z, f"{MEM}/{short}.py",
                                            f"sglang.srt.mem_cache.{short}", "sglang-0.5.23")
            return loaded[short]

        policy = load("evict_policy")

        def split_node_hash_value(hash_value, split_len, page_size):
            assert hash_value is None  # no KV events: hashes are never computed
            return None, None

        stub("sglang.srt.mem_cache.utils", split_node_hash_value=split_node_hash_value,
             get_eviction_strategy=lambda policy_name, config=None: {"lru": policy.LRUStrategy}[policy_name]())
        for short in ("cache_init_params", "base_prefix_cache", "radix_cache"):
            load(short)
    clock = itertools.count(1)
    loaded["radix_cache"].time = types.SimpleNamespace(monotonic=lambda: next(clock), perf_counter=lambda: 0.0)
    return loaded


class RecordingAllocator(TokenToKVPoolAllocator):
    """Our token allocator, logging every ``free_segment`` (the radix cache's eviction frees)."""

    def __init__(self, size):
        super().__init__(size, device="cpu")
        self.log: list[list[int]] = []

    def free_segment(self, free_index, *, start_pos: int) -> None:
        self.log.append(torch.as_tensor(free_index).tolist())
        super().free_segment(free_index, start_pos=start_pos)


# ------------------------------------------------------------ comparing the two trees

def _dfs(root):
    out, stack = [], [root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(reversed(list(node.children.values())))
    return out


def _dense_rank(xs):
    order = {v: i for i, v in enumerate(sorted(set(xs)))}
    return [order[v] for v in xs]


def shape(root, key_of):
    """Keys, slots, lock counts and child order of every node, parents first; then access-time ranks."""
    nodes = _dfs(root)
    rows = [(key_of(n), n.value.tolist() if n is not root else [], n.lock_ref, len(n.children)) for n in nodes]
    return rows, _dense_rank([n.last_access_time for n in nodes]), nodes


class Pair:
    """Ours and SGLang's, driven with the same calls; ``compare()`` after every operation."""

    def __init__(self, mods, page_size, pool_size):
        self.m = mods
        self.ours_alloc = RecordingAllocator(pool_size)
        self.theirs_alloc = RecordingAllocator(pool_size)
        self.ours = RadixCache(page_size, self.ours_alloc)
        params = mods["cache_init_params"].CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.theirs_alloc, page_size=page_size)
        self.theirs = mods["radix_cache"].RadixCache(params)
        self.compared = 0

    def key(self, ids):
        return self.m["radix_cache"].RadixKey(array("q", ids))

    def their_node(self, ours_node):
        """SGLang's node at the same place in the tree as ``ours_node``."""
        ours_nodes = _dfs(self.ours.root_node)
        return _dfs(self.theirs.root_node)[ours_nodes.index(ours_node)]

    def compare(self, where):
        o_rows, o_rank, o_nodes = shape(self.ours.root_node, lambda n: list(n.key))
        t_rows, t_rank, t_nodes = shape(self.theirs.root_node, lambda n: list(n.key.token_ids))
        assert o_rows == t_rows, f"{where}: trees differ"
        assert o_rank == t_rank, f"{where}: the order of access times differs"
        assert {o_nodes.index(n) for n in self.ours.evictable_leaves} == \
            {t_nodes.index(n) for n in self.theirs.evictable_leaves}, f"{where}: evictable leaves differ"
        assert (self.ours.evictable_size(), self.ours.protected_size()) == \
            (self.theirs.evictable_size(), self.theirs.protected_size()), f"{where}: sizes differ"
        assert torch.equal(self.ours_alloc.free_pages, self.theirs_alloc.free_pages), f"{where}: free lists differ"
        assert self.ours_alloc.log == self.theirs_alloc.log, f"{where}: freed slots differ"
        self.ours.check()
        self.ours_alloc.check()
        self.compared += 1

    # -- the operations, each on both

    def match(self, ids):
        o = self.ours.match_prefix(ids)
        t = self.theirs.match_prefix(self.m["base_prefix_cache"].MatchPrefixParams(key=self.key(ids)))
        t_slots = self.theirs.path_device_indices(t.last_device_node)
        assert o.device_prefix_len == t.device_prefix_len == len(t_slots)
        assert torch.equal(o.device_indices, t_slots)
        assert self.their_node(o.last_device_node) is t.last_device_node
        return o

    def insert(self, ids, slots):
        o = self.ours.insert(ids, slots)
        t = self.theirs.insert(self.m["base_prefix_cache"].InsertParams(key=self.key(ids), value=slots.clone()))
        assert o.prefix_len == t.prefix_len
        assert self.their_node(o.last_device_node) is t.last_device_node
        return o

    def evict(self, n):
        before = len(self.ours_alloc.log)
        o = self.ours.evict(n)
        t = self.theirs.evict(self.m["base_prefix_cache"].EvictParams(num_tokens=n))
        assert o.num_tokens_evicted == t.num_tokens_evicted
        assert [v.tolist() for v in o.evicted] == self.ours_alloc.log[before:]
        return o

    def lock(self, node, inc):
        theirs = self.their_node(node)
        o = (self.ours.inc_lock_ref if inc else self.ours.dec_lock_ref)(node)
        t = (self.theirs.inc_lock_ref if inc else self.theirs.dec_lock_ref)(theirs)
        assert o == t.delta

    def alloc(self, n):
        a, b = self.ours_alloc.alloc(n), self.theirs_alloc.alloc(n)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
        return a

    def free(self, slots):
        self.ours_alloc.free(slots)
        self.theirs_alloc.free(slots)


# ------------------------------------------------------------ the workload

class Workload:
    """A scheduler's use of the cache: requests lock their match, finish by inserting and unlocking."""

    def __init__(self, pair: Pair, rng: random.Random):
        self.p, self.rng = pair, rng
        ps = pair.ours.page_size
        self.prompts = [[rng.randrange(100, 140) for _ in range(rng.randrange(3, 25))] for _ in range(4)]
        self.finished: list[list[int]] = []  # conversations to continue
        self.running: list[dict] = []  # ids, slots (one per token), protected, node
        self.page = ps

    def new_ids(self):
        r = self.rng.random()
        if self.finished and r < 0.4:  # a follow-up turn, or a prefix of an old one
            base = self.rng.choice(self.finished)
            if self.rng.random() < 0.3:
                return base[: self.rng.randrange(1, len(base) + 1)]
            return base + [self.rng.randrange(0, 6) for _ in range(self.rng.randrange(1, 12))]
        base = self.rng.choice(self.prompts)
        cut = len(base) if self.rng.random() < 0.7 else self.rng.randrange(1, len(base) + 1)
        return base[:cut] + [self.rng.randrange(0, 6) for _ in range(self.rng.randrange(0, 15))]

    def room_for(self, n, where):
        """Evict as a scheduler does when the pool is short; True if ``n`` slots are now free."""
        short = n - self.p.ours_alloc.available_size()
        if short > 0:
            self.p.evict(short)
            self.p.compare(f"{where}: evict {short} under pressure")
        return self.p.ours_alloc.available_size() >= n

    def start(self, step):
        ids = self.new_ids()
        use_cache = self.rng.random() < 0.85
        if use_cache:
            m = self.p.match(ids)
            self.p.compare(f"step {step}: match {len(ids)} tokens")
            protected, node, cached = m.device_prefix_len, m.last_device_node, m.device_indices
        else:  # computes everything itself: its insert will find duplicates to free
            protected, node, cached = 0, self.p.ours.root_node, torch.empty(0, dtype=torch.int64)
        self.p.lock(node, inc=True)  # lock before evicting, as the scheduler does
        self.p.compare(f"step {step}: lock the match")
        need = len(ids) - protected
        if not self.room_for(need, f"step {step}"):
            self.p.lock(node, inc=False)
            self.p.compare(f"step {step}: no room, unlock")
            return
        slots = torch.cat((cached, self.p.alloc(need)))
        self.p.compare(f"step {step}: alloc {need}")
        self.running.append(dict(ids=ids, slots=slots, protected=protected, node=node))

    def decode(self, step):
        req = self.rng.choice(self.running)
        n = self.rng.randrange(1, 5)
        if not self.room_for(n, f"step {step} decode"):
            return
        req["ids"] = req["ids"] + [self.rng.randrange(0, 6) for _ in range(n)]
        req["slots"] = torch.cat((req["slots"], self.p.alloc(n)))
        self.p.compare(f"step {step}: decode {n}")

    def finish(self, step):
        req = self.running.pop(self.rng.randrange(len(self.running)))
        ids, slots, protected = req["ids"], req["slots"], req["protected"]
        res = self.p.insert(ids, slots)
        self.p.compare(f"step {step}: insert {len(ids)} tokens")
        aligned = len(ids) - len(ids) % self.page
        # As SGLang's cache_finished_req: free the duplicates the tree already held, and the
        # partial last page the tree does not take; the protected prefix was the tree's all along.
        dup = slots[protected:res.prefix_len]
        self.p.free(torch.cat((dup, slots[aligned:])))
        self.p.lock(req["node"], inc=False)
        self.p.compare(f"step {step}: free {len(dup)} duplicates, unlock")
        self.finished.append(ids)

    def run(self, steps):
        for step in range(steps):
            r = self.rng.random()
            if r < 0.35 or not self.running:
                self.start(step)
            elif r < 0.5:
                self.decode(step)
            elif r < 0.8:
                self.finish(step)
            elif r < 0.9:  # a lookup nobody follows up: may split an edge, moves access times
                self.p.match(self.new_ids())
                self.p.compare(f"step {step}: lookup")
            else:
                self.p.evict(self.rng.randrange(0, 30))
                self.p.compare(f"step {step}: evict")
        while self.running:
            self.finish(steps)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(6))
def test_radix_cache_matches_sglang_on_random_workloads(seed, page_size, monkeypatch):
    mods = load_sglang_radix_cache(sglang_wheel(), monkeypatch)
    pair = Pair(mods, page_size, pool_size=160)
    Workload(pair, random.Random(seed * 10 + page_size)).run(300)
    # the workload did what it is for: splits, evictions under pressure, duplicate frees
    assert pair.compared > 600 and len(pair.ours_alloc.log) > 10
    # everything finished and unlocked: the whole tree is evictable, and evicting it empties the pool's users
    assert pair.ours.protected_size() == 0
    pair.evict(pair.ours.evictable_size())
    pair.compare("drain")
    assert pair.ours.total_size() == 0 and pair.ours_alloc.available_size() == 160


# ------------------------------------------------------------ by hand

def test_a_match_inside_an_edge_splits_it_and_lru_evicts_unlocked_leaves_first():
    alloc = TokenToKVPoolAllocator(32, device="cpu")
    tree = RadixCache(1, alloc)
    a = alloc.alloc(5)
    assert tree.insert([1, 2, 3, 4, 5], a).prefix_len == 0
    m = tree.match_prefix([1, 2, 3, 9])  # stops after 3 tokens, inside the edge [1..5]
    assert m.device_prefix_len == 3 and m.device_indices.tolist() == a[:3].tolist()
    assert [n.key for n in tree.nodes()] == [(1, 2, 3), (4, 5)]
    b = alloc.alloc(2)
    tree.insert([1, 2, 3, 7, 8], torch.cat((a[:3], b)))
    tree.inc_lock_ref(m.last_device_node)  # a request reads [1, 2, 3]
    assert (tree.evictable_size(), tree.protected_size()) == (4, 3)
    res = tree.evict(10)  # [4, 5] is older than [7, 8]; the locked [1, 2, 3] stays
    assert [v.tolist() for v in res.evicted] == [a[3:].tolist(), b.tolist()] and res.num_tokens_evicted == 4
    assert [n.key for n in tree.nodes()] == [(1, 2, 3)] and tree.evictable_size() == 0
    assert tree.dec_lock_ref(m.last_device_node) == 3
    assert tree.evict(1).evicted[0].tolist() == a[:3].tolist()
    assert alloc.available_size() == 32
    tree.check()


def test_page_size_4_matches_and_inserts_whole_pages_only():
    tree = RadixCache(4)
    assert tree.insert(list(range(10)), list(range(100, 110))).prefix_len == 0
    assert tree.total_size() == 8  # the partial page (2 tokens) is not cached
    m = tree.match_prefix([0, 1, 2, 3, 4, 5, 99, 7, 8])  # 6 tokens agree: 4, a whole page
    assert m.device_prefix_len == 4
    assert [n.key for n in tree.nodes()] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    tree.check()


def test_check_catches_a_broken_size():
    tree = RadixCache()
    tree.insert([1, 2], [5, 6])
    tree.evictable_size_ += 1
    with pytest.raises(InvariantError, match="sizes add up"):
        tree.check()


# ------------------------------------------------------------ refusals change nothing

def snapshot(tree: RadixCache):
    return (tree.format_tree(), tree.evictable_size(), tree.protected_size(), tree._clock, tree._next_id,
            [n.id for n in tree.evictable_leaves], sorted(tree._slots),
            [n.last_access_time for n in tree.nodes()])


def small_tree():
    tree = RadixCache()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    tree.insert([1, 2, 5], [10, 11, 14])
    return tree


@pytest.mark.parametrize("call, error, message", [
    (lambda t: t.insert([1, 2.5], [1, 2]), TypeError, r"key\[1\] = 2.5 is not an int"),
    (lambda t: t.insert([1, True], [1, 2]), TypeError, r"key\[1\] = True is not an int"),
    (lambda t: t.insert([1, -3], [1, 2]), ValueError, r"key\[1\] = -3 is negative"),
    (lambda t: t.insert("abc", [1, 2, 3]), TypeError, "key must be a sequence of ints, got str"),
    (lambda t: t.insert([7, 8, 9], [20, 21]), ValueError, "value has 2 slots for a key of 3 tokens"),
    (lambda t: t.insert([7, 8], [20, 20]), ValueError, "slot 20 appears twice in the new part of value"),
    (lambda t: t.insert([1, 2, 3, 9], [0, 0, 0, 12]), ValueError, "slot 12 is already in the tree"),
    (lambda t: t.insert([7], [-1]), ValueError, r"value\[0\] = -1 is negative"),
    (lambda t: t.insert([7], torch.tensor([[1]])), TypeError, "value must be a 1-D integer tensor"),
    (lambda t: t.insert([7], torch.tensor([1.0])), TypeError, "value must be a 1-D integer tensor"),
    (lambda t: t.match_prefix([1, None]), TypeError, r"key\[1\] = None is not an int"),
    (lambda t: t.match_prefix(torch.tensor([1.0])), TypeError, "key must be a 1-D integer tensor"),
    (lambda t: t.evict(-1), ValueError, "num_tokens must be >= 0, got -1"),
    (lambda t: t.evict(True), TypeError, "num_tokens must be an int"),
    (lambda t: t.dec_lock_ref(next(t.nodes())), ValueError, r"is not locked"),
    (lambda t: t.inc_lock_ref("node"), TypeError, "node must be a TreeNode, got str"),
    (lambda t: t.inc_lock_ref(small_tree().insert([9], [99]).last_device_node), ValueError,
     "is not in this tree"),
    (lambda t: t.path_device_indices(TreeNode(99, 0)), ValueError, "is not in this tree"),
])
def test_refusals_name_the_problem_and_change_nothing(call, error, message):
    tree = small_tree()
    before = snapshot(tree)
    with pytest.raises(error, match=message):
        call(tree)
    assert snapshot(tree) == before
    tree.check()


def test_an_evicted_node_can_be_neither_locked_nor_unlocked():
    tree = small_tree()
    leaf = tree.match_prefix([1, 2, 5]).last_device_node
    tree.match_prefix([1, 2, 3, 4])  # now [5] is the least recently used leaf
    assert tree.evict(1).evicted[0].tolist() == [14]
    assert leaf not in list(tree.nodes())
    before = snapshot(tree)
    for op in (tree.inc_lock_ref, tree.dec_lock_ref):
        with pytest.raises(ValueError, match="is not in this tree"):
            op(leaf)
    assert snapshot(tree) == before


def test_constructor_refusals():
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        RadixCache(0)
    with pytest.raises(TypeError, match="must have a free_segment"):
        RadixCache(1, object())
