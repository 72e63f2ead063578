"""Where a chat workload loses its prefix-cache hits: an estimate from a description, and the engine's count.

Prefix caching serves a request's leading *whole blocks* whose chained hashes
match blocks already in the pool, never the last prompt token, and nothing
after the first block that differs (chapter 6). So for a workload the
token-weighted hit rate, vLLM's "Prefix cache hit rate" (cached tokens over
prompt tokens looked up), is set by *where* the first per-request token
sits, not by the block size, once the shared part is long:

``ChatWorkload`` describes the traffic: a system prompt shared by every
request (or ``num_system_prompts`` of them, taken in turn), per-request text
inside it (a date, a user name, a request id: ``varying_len`` tokens at
``varying_at``), a document some requests carry after it, the user's turn,
the block size. ``estimate`` gives the hit rate from that description alone,
in closed form; ``run_on_engine`` serves the same prompts on the book's
engine and reads its counters, so the two can be compared.

The pool matters through eviction. With ``num_system_prompts`` prompts served
in turn, one request at a time, a prompt's blocks survive until its next
turn only if the requests in between did not pop them from the free queue:
``estimate`` counts, in closed form, how many of its leading blocks are left
(the last ones go first), and says how large a pool keeps them all.

Counted as vLLM 0.33.0 counts: every admitted request's prompt tokens are
queried, its cached tokens hit; a request admitted again after a preemption
is left out of both (it goes to the ``preempted_*`` statistics), so
recomputation never shows as a hit rate.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..common import cdiv, check_int, check_real

__all__ = ["ChatWorkload", "HitEstimate", "estimate", "run_on_engine", "position_for_rate"]


@dataclass(frozen=True)
class ChatWorkload:
    """Chat traffic as the prompt template lays it out (lengths in tokens).

    A prompt is ``system[:varying_at] + varying + system[varying_at:] +
    document + user``:

    Attributes:
        system_prompt_len: the system prompt every request starts with.
        user_len: the user's turn, different in every request.
        varying_len: per-request tokens inside the system prompt (0: none).
        varying_at: where they sit (0: before the system prompt, as in a
            template that opens with the date or a request id).
        document_len: a document, unique to its request, after the system
            prompt (retrieval, an uploaded file).
        document_share: the share of requests that carry one (0..1).
        block_size: the engine's block size.
        num_system_prompts: distinct system prompts (tenants, products),
            requests taking them in turn.
        output_len: tokens each request generates (they hold blocks, and
            are never looked up).
    """

    system_prompt_len: int
    user_len: int
    varying_len: int = 0
    varying_at: int = 0
    document_len: int = 0
    document_share: float = 0.0
    block_size: int = 16
    num_system_prompts: int = 1
    output_len: int = 1

    def __post_init__(self):
        check_int(self.system_prompt_len, "system_prompt_len", 0)
        check_int(self.user_len, "user_len", 1)
        check_int(self.varying_len, "varying_len", 0)
        check_int(self.varying_at, "varying_at", 0)
        if self.varying_at > self.system_prompt_len:
            raise ValueError(f"varying_at={self.varying_at} is past the system prompt "
                             f"({self.system_prompt_len} tokens)")
        check_int(self.document_len, "document_len", 0)
        check_real(self.document_share, "document_share", minimum=0, maximum=1)
        check_int(self.block_size, "block_size", 1)
        check_int(self.num_system_prompts, "num_system_prompts", 1)
        check_int(self.output_len, "output_len", 1)

    # ------------------------------------------------------------- the shape
    @property
    def shared_len(self) -> int:
        """Tokens every request with the same system prompt starts with."""
        return self.varying_at if self.varying_len else self.system_prompt_len

    def carries_document(self, i: int) -> bool:
        """Whether request ``i`` carries a document: exactly ``document_share``
        of every run of requests, spread evenly."""
        s = self.document_share
        return self.document_len > 0 and int((i + 1) * s + 1e-9) > int(i * s + 1e-9)

    def prompt_len(self, i: int) -> int:
        return (self.system_prompt_len + self.varying_len + self.user_len
                + (self.document_len if self.carries_document(i) else 0))

    def hit_tokens(self, i: int) -> int:
        """Cached tokens of request ``i`` once its system prompt is in the pool:
        the shared part's whole blocks, capped at ``prompt_len - 1``."""
        B = self.block_size
        return min(self.shared_len, self.prompt_len(i) - 1) // B * B

    def shared_blocks(self) -> int:
        """Blocks of one system prompt's shared part that a hit reuses."""
        return self.shared_len // self.block_size

    def own_blocks(self, i: int) -> int:
        """Blocks request ``i`` allocates besides the ones it hits."""
        return cdiv(self.prompt_len(i) + self.output_len, self.block_size) - self.hit_tokens(i) // self.block_size

    # ----------------------------------------------------------- the prompts
    def prompts(self, num_requests: int, seed: int = 0, vocab_size: int = 512) -> list[list[int]]:
        """Token ids for ``num_requests`` requests of this workload (seeded).

        Every per-request part is drawn fresh, so no two requests share a
        block after ``shared_len``; request ``i`` uses system prompt
        ``i % num_system_prompts``.
        """
        check_int(num_requests, "num_requests", 1)
        rng = random.Random(seed)

        def draw(n):
            return [rng.randrange(1, vocab_size) for _ in range(n)]

        systems = [draw(self.system_prompt_len) for _ in range(self.num_system_prompts)]
        out = []
        for i in range(num_requests):
            system = systems[i % self.num_system_prompts]
            doc = draw(self.document_len) if self.carries_document(i) else []
            out.append(system[:self.varying_at] + draw(self.varying_len) + system[self.varying_at:]
                       + doc + draw(self.user_len))
        return out


@dataclass(frozen=True)
class HitEstimate:
    """What ``estimate`` predicts for ``num_requests`` requests.

    ``rate``: hits / prompt tokens over the run (the first request of each
    system prompt finds nothing cached). ``steady``: the same once every
    system prompt is cached (what vLLM's log line, over the last 1,000
    requests, shows on a long run). ``fits``: whether the pool keeps every
    system prompt cached between its turns (always True without a pool).
    """

    rate: float
    steady: float
    hits: int
    queries: int
    fits: bool
    blocks_needed: int | None


def _held(w: ChatWorkload, i: int) -> tuple[int, int]:
    """Request ``i``'s blocks when it finishes: ``(full, partial)``. The last
    sampled token never gets a slot, so it holds ``prompt + output - 1``
    tokens; its full blocks are cached (hashed), a partial last block is not."""
    n = w.prompt_len(i) + w.output_len - 1
    return n // w.block_size, int(n % w.block_size != 0)


def estimate(w: ChatWorkload, num_requests: int = 1000, pool_blocks: int | None = None) -> HitEstimate:
    r"""The token-weighted prefix hit rate of ``num_requests`` requests of ``w``.

    Without ``pool_blocks`` the pool is taken to be large enough: the first
    request of each system prompt finds nothing, every later one its shared
    whole blocks (:meth:`ChatWorkload.hit_tokens`).

    With ``pool_blocks`` (the usable blocks, the null block excluded)
    requests are taken one at a time, each finishing before the next is
    admitted: eviction, not sharing between running requests, decides. A
    finished request's full blocks go to the free queue's tail, last block
    first, so that its first block is the most recently freed; a partial
    last block (never cached) goes to the head. Each later request pops what
    it needs from the head. So of the shared blocks of request ``i - k``
    (``k = num_system_prompts``), the first

    $$ h_i = N - \sum_{r=i-k+1}^{i-1} F_r - e_{i-1} $$

    survive until request ``i`` looks them up (``N`` usable blocks, ``F_r``
    the full blocks request ``r`` held, ``e_{i-1}`` whether the request just
    before left a partial block at the head): an LRU cache under a cyclic
    access pattern loses each prompt's *last* blocks first, and a hit stops
    at the first block missing. ``fits`` says whether every warm request got
    all of its shared blocks; ``blocks_needed`` is the smallest pool for that.
    """
    check_int(num_requests, "num_requests", 1)
    k, B = w.num_system_prompts, w.block_size
    if pool_blocks is not None:
        check_int(pool_blocks, "pool_blocks", 1)
    hits = queries = steady_hits = steady_queries = 0
    fits, need = True, 0
    held = [_held(w, i) for i in range(num_requests)]
    for i in range(num_requests):
        n, shared = w.prompt_len(i), w.hit_tokens(i) // B
        need = max(need, sum(held[i]))  # the request itself must fit
        got = shared
        if pool_blocks is not None and i >= k:
            between = sum(held[r][0] for r in range(i - k + 1, i))
            got = min(shared, max(0, pool_blocks - between - held[i - 1][1]))
            need = max(need, shared + between + held[i - 1][1])
        fits = fits and (i < k or got == shared)
        queries += n
        if i >= k:
            hits += got * B
            steady_hits += got * B
            steady_queries += n
    if steady_queries == 0:  # every request was the first of its prompt
        steady = sum(w.hit_tokens(i) for i in range(num_requests)) / queries
    else:
        steady = steady_hits / steady_queries
    return HitEstimate(rate=hits / queries, steady=steady, hits=hits, queries=queries,
                       fits=fits, blocks_needed=None if pool_blocks is None else need)


def position_for_rate(w: ChatWorkload, rate: float) -> int:
    """Where a per-request token would sit, in a prompt shaped like ``w``'s
    without documents, for the steady hit rate to be ``rate``: the shared
    whole blocks a rate that low leaves, in tokens (a multiple of the block
    size)."""
    check_real(rate, "rate", minimum=0, maximum=1)
    n = w.system_prompt_len + w.varying_len + w.user_len
    return int(rate * n) // w.block_size * w.block_size


def run_on_engine(w: ChatWorkload, num_requests: int, model, *, pool_blocks: int | None = None,
                  one_at_a_time: bool = False, seed: int = 0, **engine_args) -> dict:
    """Serve ``num_requests`` requests of ``w`` on the book's engine and read its counters.

    ``pool_blocks``: usable blocks (the engine gets one more, the null
    block); None: room for every request at once. ``one_at_a_time``: each
    request runs to completion before the next is added (``estimate``'s
    assumption when a pool is given); otherwise all are added at once.
    ``engine_args`` go to ``EngineArgs`` (block size, prefix caching and the
    torch backend are set here). Returns the engine's own counts: ``hits``,
    ``queries``, ``rate`` (``KVCacheManager.prefix_cache_stats``, recorded at
    admission), and ``preempted_queries`` (what resumed requests looked up,
    left out of the rate).
    """
    from ..engine import EngineArgs, LLMEngine

    prompts = w.prompts(num_requests, seed, vocab_size=model.config.vocab_size)
    longest = max(map(len, prompts)) + w.output_len
    if pool_blocks is None:
        pool_blocks = sum(cdiv(len(p) + w.output_len, w.block_size) for p in prompts)
    kwargs = dict(block_size=w.block_size, enable_prefix_caching=True, kernel_backend="torch",
                  num_gpu_blocks_override=pool_blocks + 1, max_model_len=cdiv(longest + 1, w.block_size) * w.block_size,
                  max_num_batched_tokens=max(8192, longest), log_stats_interval=0)
    kwargs.update(engine_args)
    engine = LLMEngine(EngineArgs(**kwargs), model)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, max_tokens=w.output_len, ignore_eos=True)
        if one_at_a_time:
            while engine.has_unfinished_requests():
                engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.kv_cache_manager.prefix_cache_stats
    return {"hits": stats.hits, "queries": stats.queries, "rate": stats.hit_rate,
            "requests": stats.requests, "preempted_queries": stats.preempted_queries,
            "preempted_hits": stats.preempted_hits, "num_preemptions": engine.scheduler.num_preemptions}
