"""Growing conversations on a ``KVCacheManager``, and a burst that evicts their histories.

A chat service's traffic is conversations: each turn's prompt is the whole
history so far (the system prompt, every earlier message and reply) plus one
new message, so the prefix cache serves a turn by the blocks its own
previous turn left in the pool. Between two turns of a conversation (the
user reads, thinks and types: tens of seconds) those blocks sit free in the
pool's free queue, where every allocation takes the block at the head: the
least recently freed.

A **burst** (a batch job, a crawler, a retry storm: many long prompts that
nobody will send again) allocates, block by block, from that head: the
idle histories go first. Then the hit rate does not come back at once.
Each conversation whose history was evicted recomputes it at its next turn,
and those allocations again take the head, where the *other*
conversations' histories, idle longer than the burst's blocks, now sit; the
burst's own blocks, freed last, wait at the tail and are reused last. The
collapse lasts until every conversation has had a turn after the burst
(roughly one think time) and can last longer when the pool is too small
for the recomputed histories and the burst's blocks together.

``simulate(ConversationWorkload(...))`` runs it on the library's
``KVCacheManager`` (the calls vLLM's scheduler makes: ``get_computed_blocks``,
``allocate_slots``, ``free``). Time is the users' clock: a request is served
the moment it arrives, one at a time (a reply takes seconds, a think time
tens of seconds, so the pool's order is what matters, not the batch).
It returns the panel's hit rate per window (``rate(hits) / rate(queries)``
over every request, the burst's included, as vLLM counts them) and the
idle time of every block the pool reused (what
``vllm:kv_block_idle_before_evict_seconds`` samples).

**A CPU offload tier** (``cpu_blocks``, off by default) models vLLM's
native KV offloading (``--kv-offloading-size``: its ``OffloadingConnector``
with the CPU backend and the default LRU policy) at the level of blocks,
hashes and LRU order. What is modelled:

- capacity: ``cpu_blocks`` blocks (vLLM: the GiB given, divided by the
  bytes of one GPU block, one block per chunk by default); 0 is a tier that
  can store nothing, as vLLM's with too few bytes for one chunk;
- stores: once a request's prompt is computed, its full prompt blocks'
  hashes are offered, from the first (blocks hit on the GPU or loaded
  included); the reply's full blocks only with
  ``cpu_offload_prompt_only=False`` (vLLM's ``offload_prompt_only``
  defaults to True), offered once the request finishes, up to its last
  token but one. An offer evicts the tier's least recent blocks, never
  one of the offered; if that cannot make room for every new block, none
  is stored (vLLM's ``prepare_store`` fails whole) and the offered blocks
  already there are still refreshed;
- recency: every block a request offers or loads becomes the most
  recent, its last block first and its first block last, so a request's
  tail is evicted before its head, as on the GPU;
- lookup: after the GPU's prefix hit ends, the tier is asked for the
  following blocks, consecutive ones from there, capped like the GPU's
  lookup (the last prompt token is always computed). A lookup changes no
  recency; the load that follows does;
- a load needs GPU blocks for what it brings, allocated exactly as for
  tokens computed, so the GPU pool, its hits and its evictions are the
  same with or without the tier: loaded tokens are counted apart, as vLLM
  counts them in ``vllm:external_prefix_cache_hits``, not in
  ``vllm:prefix_cache_hits``.

What is not: time (stores and loads are instant, so no block is pinned by
a transfer in flight, no lookup is deferred or answered "pending", and no
request waits for its load), the GPU blocks an in-flight store keeps from
reuse, chunks of several blocks, ``store_threshold``, the ARC policy, and
the CPU memory's bytes (the tier counts blocks).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..common import cdiv, check_int, check_real
from ..kv_cache_manager import KVCacheManager
from ..request import Request

__all__ = ["ConversationWorkload", "ConversationRun", "simulate"]


@dataclass(frozen=True)
class ConversationWorkload:
    """Conversations and a burst (lengths in tokens, times in seconds).

    Attributes:
        num_conversations: conversations open at any time; one that reaches
            ``turns`` turns ends and a new one (new tokens) takes its place.
        system_len: a system prompt every conversation opens with.
        message_len, reply_len: each user message and each reply.
        turns: turns of a conversation.
        think_time_s: mean gap between a reply and the next message
            (exponential, seeded).
        burst_at_s: when the burst arrives (None: no burst).
        burst_requests, burst_prompt_len, burst_output_len: the burst: this
            many unique prompts, none ever sent again.
        num_blocks: the pool, the null block included.
        block_size: tokens per block.
        duration_s: how long the users' clock runs.
        window_s: the width of the hit-rate windows.
        seed: seeds think times and tokens.
        cpu_blocks: the CPU offload tier's capacity in blocks (None: no
            tier; see the module docstring).
        cpu_offload_prompt_only: the tier stores prompt blocks only
            (vLLM's default), or the reply's too.
    """

    num_conversations: int = 24
    system_len: int = 64
    message_len: int = 48
    reply_len: int = 96
    turns: int = 8
    think_time_s: float = 30.0
    burst_at_s: float | None = 600.0
    burst_requests: int = 40
    burst_prompt_len: int = 1024
    burst_output_len: int = 64
    num_blocks: int = 1400
    block_size: int = 16
    duration_s: float = 1500.0
    window_s: float = 30.0
    seed: int = 0
    cpu_blocks: int | None = None
    cpu_offload_prompt_only: bool = True

    def __post_init__(self):
        if self.cpu_blocks is not None:
            check_int(self.cpu_blocks, "cpu_blocks", 0)
        if not isinstance(self.cpu_offload_prompt_only, bool):
            raise TypeError(f"cpu_offload_prompt_only must be a bool, got "
                            f"{type(self.cpu_offload_prompt_only).__name__} {self.cpu_offload_prompt_only!r}")
        for name in ("num_conversations", "message_len", "reply_len", "turns", "burst_requests",
                     "burst_prompt_len", "burst_output_len", "block_size"):
            check_int(getattr(self, name), name, 1)
        check_int(self.system_len, "system_len", 0)
        check_int(self.seed, "seed", 0)
        check_real(self.think_time_s, "think_time_s", minimum=0, open_min=True)
        check_real(self.duration_s, "duration_s", minimum=0, open_min=True)
        check_real(self.window_s, "window_s", minimum=0, open_min=True)
        if self.burst_at_s is not None:
            check_real(self.burst_at_s, "burst_at_s", minimum=0)
        burst_len = 0 if self.burst_at_s is None else self.burst_prompt_len + self.burst_output_len
        need = cdiv(max(self.longest_turn, burst_len), self.block_size) + 1
        if check_int(self.num_blocks, "num_blocks", 2) < need:
            raise ValueError(f"num_blocks={self.num_blocks} cannot hold the longest request and the null "
                             f"block ({need} blocks)")

    @property
    def longest_turn(self) -> int:
        """Tokens of a conversation's last turn, its reply included."""
        return self.system_len + self.turns * (self.message_len + self.reply_len)

    @property
    def working_set_blocks(self) -> int:
        """Blocks that hold every open conversation's history at its longest: a pool that keeps
        them all between turns needs about this many besides the running request."""
        return self.num_conversations * cdiv(self.longest_turn, self.block_size)


@dataclass
class ConversationRun:
    """What ``simulate`` measured.

    Attributes:
        windows: ``(start_s, queried tokens, hit tokens)`` per window, every
            request counted (the burst's too), as the panel's rate counts.
        conversation_windows: the same, conversation turns only.
        idle_before_evict_s: ``(when, idle seconds, cached)`` for every block
            the pool handed out again: the seconds since it was last
            allocated or hit, and whether it held a cached block (a history)
            rather than a partial block nobody could hit, which the manager
            frees to the head of the queue and reuses within seconds.
        num_turns: conversation turns served.
        loaded_windows: ``(start_s, tokens loaded from the CPU tier)`` per
            window, every request counted; all 0 without a tier.
        conversation_loaded_windows: the same, conversation turns only.
        cpu_stored_blocks, cpu_evicted_blocks: blocks the CPU tier stored and
            evicted; cpu_failed_stores: offers that stored nothing for want
            of room.

    The rates take ``source``: "gpu" (the GPU prefix cache's hits, the
    default and the only source without a tier), "cpu" (tokens loaded from
    the tier) or "both" (their sum: what the request did not compute).
    """

    workload: ConversationWorkload
    windows: list[tuple[float, int, int]] = field(default_factory=list)
    conversation_windows: list[tuple[float, int, int]] = field(default_factory=list)
    idle_before_evict_s: list[tuple[float, float, bool]] = field(default_factory=list)
    num_turns: int = 0
    loaded_windows: list[tuple[float, int]] = field(default_factory=list)
    conversation_loaded_windows: list[tuple[float, int]] = field(default_factory=list)
    cpu_stored_blocks: int = 0
    cpu_evicted_blocks: int = 0
    cpu_failed_stores: int = 0

    def _rows(self, conversations_only: bool, source: str) -> list[tuple[float, int, int]]:
        """``(start, queried, hits)`` per window, hits from ``source``."""
        if source not in ("gpu", "cpu", "both"):
            raise ValueError(f"source must be 'gpu', 'cpu' or 'both', got {source!r}")
        rows = self.conversation_windows if conversations_only else self.windows
        if source == "gpu":
            return rows
        loaded = self.conversation_loaded_windows if conversations_only else self.loaded_windows
        if len(loaded) != len(rows):  # a run built by hand without loads: none loaded
            loaded = [(t, 0) for t, _, _ in rows]
        return [(t, q, (h if source == "both" else 0) + n) for (t, q, h), (_, n) in zip(rows, loaded)]

    def hit_rates(self, conversations_only: bool = False,
                  source: str = "gpu") -> list[tuple[float, float | None]]:
        """``(window start, hit rate)``; None for a window without requests."""
        rows = self._rows(conversations_only, source)
        return [(t, h / q if q else None) for t, q, h in rows]

    def rate_between(self, start_s: float, end_s: float, conversations_only: bool = False,
                     source: str = "gpu") -> float:
        """Hit rate over the windows that start in ``[start_s, end_s)``."""
        rows = self._rows(conversations_only, source)
        q = sum(r[1] for r in rows if start_s <= r[0] < end_s)
        h = sum(r[2] for r in rows if start_s <= r[0] < end_s)
        if not q:
            raise ValueError(f"no request between {start_s} s and {end_s} s")
        return h / q

    def recovery_s(self, share: float = 0.9, source: str = "gpu") -> float | None:
        """Seconds from the burst to the start of the first window after it whose conversation hit
        rate is back to ``share`` of the rate before the burst (None: no burst, or never)."""
        w = self.workload
        rates = self.hit_rates(conversations_only=True, source=source)  # checks source first
        if w.burst_at_s is None:
            return None
        before = self.rate_between(0.0, w.burst_at_s, conversations_only=True, source=source)
        for t, rate in rates:
            if t > w.burst_at_s and rate is not None and rate >= share * before:
                return t - w.burst_at_s
        return None

    def idle_quantile(self, q: float, start_s: float = 0.0, end_s: float = float("inf"),
                      cached_only: bool = True) -> float:
        """The ``q`` quantile of the idle-before-evict times of the reuses in ``[start_s, end_s)``
        (of cached blocks only, by default: the histories)."""
        xs = sorted(idle for t, idle, cached in self.idle_before_evict_s
                    if start_s <= t < end_s and (cached or not cached_only))
        if not xs:
            raise ValueError(f"no block was evicted between {start_s} s and {end_s} s")
        return xs[min(int(q * len(xs)), len(xs) - 1)]


class _Clock:
    """The pool's listener: when each block was last allocated or hit, and each reuse's idle time."""

    def __init__(self, run: ConversationRun):
        self.now = 0.0
        self.last: dict[int, float] = {}
        self.cached: set[int] = set()  # the blocks of the "evict" event just before an "allocate"
        self.run = run

    def __call__(self, pool, event) -> None:
        if event.kind == "evict":
            self.cached = set(event.block_ids)
        elif event.kind == "allocate":
            for b in event.block_ids:
                if b in self.last:  # handed out again: its previous life ends (vLLM observes it then)
                    self.run.idle_before_evict_s.append((self.now, self.now - self.last[b], b in self.cached))
                self.last[b] = self.now
            self.cached = set()
        elif event.kind == "touch":
            for b in event.block_ids:
                self.last[b] = self.now


class _CPUTier:
    """vLLM's CPU offloading manager with its LRU policy, reduced to block hashes in eviction order.

    Invariants: ``len(order) <= capacity``; ``order`` runs from the next
    block to evict to the most recent. Stores and loads complete at once
    (the module docstring says what that leaves out), so every block held
    is ready and evictable between requests.
    """

    def __init__(self, capacity: int, run: ConversationRun):
        self.capacity = capacity
        self.order: OrderedDict[object, None] = OrderedDict()
        self.run = run

    def lookup(self, hashes: Sequence[object], start: int, stop: int) -> int:
        """Blocks ``hashes[start:stop]`` held, consecutive from ``start`` (recency unchanged)."""
        n = start
        while n < stop and hashes[n] in self.order:
            n += 1
        return n - start

    def touch(self, keys: Sequence[object]) -> None:
        """``keys`` (one request's, in prompt order) become the most recent: the last evicted first."""
        for key in reversed(keys):
            if key in self.order:
                self.order.move_to_end(key)

    def offer(self, keys: Sequence[object]) -> None:
        """Store the blocks of ``keys`` not held yet, evicting the least recent others; all or none."""
        offered = set(keys)
        new = [k for k in keys if k not in self.order]
        held = len(keys) - len(new)
        if new:
            need = len(new) - (self.capacity - len(self.order))
            if need > len(self.order) - held:  # the offered blocks are never evicted: no room
                self.run.cpu_failed_stores += 1
                new = []
            elif need > 0:
                victims = []
                for key in self.order:
                    if key not in offered:
                        victims.append(key)
                        if len(victims) == need:
                            break
                for key in victims:
                    del self.order[key]
                self.run.cpu_evicted_blocks += need
            for key in new:
                self.order[key] = None
            self.run.cpu_stored_blocks += len(new)
        self.touch(keys)


def _serve(manager: KVCacheManager, rid: str, prompt: list[int], reply: list[int],
           tier: _CPUTier | None = None, prompt_only: bool = True) -> tuple[int, int]:
    """One request, served whole: its prefix hit, its prompt, its reply.

    Returns the tokens hit on the GPU and those loaded from ``tier``. The
    reply's last token is sampled but never fed back, so its KV is not
    computed (as in a real engine): the next turn computes it.
    """
    req = Request(rid, prompt, max_tokens=len(reply))
    hit, num_hit = manager.get_computed_blocks(req)
    B = manager.block_size
    num_loaded = 0
    if tier is not None:  # the blocks after the GPU's hit, up to the GPU lookup's cap
        num_loaded = tier.lookup(req.block_hashes, num_hit // B, (req.num_tokens - 1) // B) * B
    # Loaded tokens take new GPU blocks as computed ones do: the allocation is the same either way.
    if manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit) is None:
        raise RuntimeError(f"{rid} ({req.num_tokens} tokens) did not fit an idle pool: blocks leaked")
    req.num_computed_tokens = req.num_tokens
    if tier is not None:  # the prompt's full blocks, from the first (the loaded ones among them)
        stored = list(req.block_hashes[:len(prompt) // B])
        tier.offer(stored)
    # The reply's tokens but the last, computed as one span (a decode step at a time in an engine;
    # alone in the pool, the blocks it takes are the same).
    for token in reply[:-1]:
        req.append_output_token_ids(token)
    if len(reply) > 1:
        if manager.allocate_slots(req, len(reply) - 1) is None:
            raise RuntimeError(f"{rid} could not grow in an idle pool: blocks leaked")
        req.num_computed_tokens += len(reply) - 1
    req.append_output_token_ids(reply[-1])
    if tier is not None:
        if not prompt_only:  # the reply's full blocks, up to its last token but one
            reply_keys = list(req.block_hashes[len(stored):(req.num_tokens - 1) // B])
            stored += reply_keys
            if reply_keys:
                tier.offer(reply_keys)
        tier.touch(stored)  # finished: its blocks' recency is committed, the reply's tail first out
    manager.free(req)
    return num_hit, num_loaded


def simulate(workload: ConversationWorkload, check_every: int = 0) -> ConversationRun:
    """Run ``workload`` on a fresh ``KVCacheManager``; see the module docstring.

    ``check_every``: run the manager's ``check()`` after every this many
    requests (0: never; the tests use it).
    """
    if not isinstance(workload, ConversationWorkload):
        raise TypeError(f"workload must be a ConversationWorkload, got {type(workload).__name__}")
    check_int(check_every, "check_every", 0)
    w = workload
    rng = random.Random(w.seed)
    manager = KVCacheManager(w.num_blocks, w.block_size, enable_caching=True)
    run = ConversationRun(w)
    clock = _Clock(run)
    unsubscribe = manager.block_pool.subscribe(clock)
    next_token = iter(range(1, 1 << 62))  # every token unique, so only a conversation's own history hits
    system = [next(next_token) for _ in range(w.system_len)]
    num_windows = int(w.duration_s // w.window_s) + 1
    windows = [[0, 0] for _ in range(num_windows)]
    conv_windows = [[0, 0] for _ in range(num_windows)]
    loaded, conv_loaded = [0] * num_windows, [0] * num_windows
    tier = None if w.cpu_blocks is None else _CPUTier(w.cpu_blocks, run)
    # Events: (time, order, kind, conversation index); a conversation's state is its history and turn.
    events: list[tuple[float, int, str, int]] = []
    order = iter(range(1 << 62))
    histories: list[list[int]] = [list(system) for _ in range(w.num_conversations)]
    turn = [0] * w.num_conversations
    for c in range(w.num_conversations):
        events.append((rng.uniform(0, w.think_time_s), next(order), "turn", c))
    if w.burst_at_s is not None:
        events.append((w.burst_at_s, next(order), "burst", -1))
    served = 0
    try:
        while events:
            events.sort()
            t, _, kind, c = events.pop(0)
            if t >= w.duration_s:
                break
            clock.now = t
            win = int(t // w.window_s)
            if kind == "burst":
                for k in range(w.burst_requests):
                    prompt = [next(next_token) for _ in range(w.burst_prompt_len)]
                    reply = [next(next_token) for _ in range(w.burst_output_len)]
                    hit, num_loaded = _serve(manager, f"burst-{k}", prompt, reply, tier,
                                             w.cpu_offload_prompt_only)
                    windows[win][0] += len(prompt)
                    windows[win][1] += hit
                    loaded[win] += num_loaded
                    served += 1
                continue
            prompt = histories[c] + [next(next_token) for _ in range(w.message_len)]
            reply = [next(next_token) for _ in range(w.reply_len)]
            hit, num_loaded = _serve(manager, f"c{c}-t{turn[c]}", prompt, reply, tier,
                                     w.cpu_offload_prompt_only)
            for rows in (windows, conv_windows):
                rows[win][0] += len(prompt)
                rows[win][1] += hit
            loaded[win] += num_loaded
            conv_loaded[win] += num_loaded
            run.num_turns += 1
            served += 1
            turn[c] += 1
            histories[c] = prompt + reply
            if turn[c] == w.turns:  # the conversation ends; a new one opens in its place
                turn[c], histories[c] = 0, list(system)
            events.append((t + rng.expovariate(1.0 / w.think_time_s), next(order), "turn", c))
            if check_every and served % check_every == 0:
                manager.check()
                if tier is not None and len(tier.order) > tier.capacity:
                    raise AssertionError(f"the CPU tier holds {len(tier.order)} blocks > {tier.capacity}")
    finally:
        unsubscribe()
    run.windows = [(i * w.window_s, q, h) for i, (q, h) in enumerate(windows)]
    run.conversation_windows = [(i * w.window_s, q, h) for i, (q, h) in enumerate(conv_windows)]
    run.loaded_windows = [(i * w.window_s, n) for i, n in enumerate(loaded)]
    run.conversation_loaded_windows = [(i * w.window_s, n) for i, n in enumerate(conv_loaded)]
    return run
