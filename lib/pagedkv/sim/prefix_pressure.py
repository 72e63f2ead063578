"""Prefix hits under memory pressure: serve a multi-tenant chat trace on a ``KVCacheManager``.

Exercise 3's experiment. Each request opens with one of ``num_tenants`` system
prompts (taken in turn), then a user turn of its own, and generates
``output_len`` tokens; ``concurrency`` requests run at once. The pool is sized
so that the running requests always fit (nobody is ever preempted) but the
tenants' cached prompts do not all fit beside them: every allocation may
evict a cached block, and *which* block the free queue offers first decides
how many prompt tokens the next requests find cached.

``serve(manager_class, workload)`` drives any ``KVCacheManager`` subclass --
the extension point for a pool with another freeing rule is its class
attribute ``block_pool_class`` -- through the calls vLLM's scheduler makes
(``get_computed_blocks``, ``allocate_slots``, ``free``) and returns, per
request in admission order, its prompt length and the tokens its prefix hit
covered. The driver checks the manager's invariants after every request.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..common import cdiv, check_int
from ..kv_cache_manager import KVCacheManager
from ..request import Request

__all__ = ["PressureWorkload", "Served", "serve", "PRESSURE_WORKLOAD"]


@dataclass(frozen=True)
class PressureWorkload:
    """A seeded multi-tenant chat trace and the pool it runs in (lengths in tokens)."""

    num_requests: int = 240
    num_tenants: int = 6
    system_len: int = 200
    user_len: int = 40
    output_len: int = 30
    concurrency: int = 4
    block_size: int = 16
    num_blocks: int = 90
    seed: int = 0

    def __post_init__(self):
        for name in ("num_requests", "num_tenants", "system_len", "user_len", "output_len",
                     "concurrency", "block_size"):
            check_int(getattr(self, name), name, 1)
        check_int(self.seed, "seed", 0)
        need = self.concurrency * cdiv(self.system_len + self.user_len + self.output_len,
                                       self.block_size) + 1
        if check_int(self.num_blocks, "num_blocks", 2) < need:
            raise ValueError(f"num_blocks={self.num_blocks} cannot hold {self.concurrency} running "
                             f"requests and the null block ({need} blocks): this workload "
                             "never preempts")

    def prompts(self) -> list[tuple[str, list[int]]]:
        """(request id, prompt tokens), in arrival order; seeded, so every run sees the same."""
        rng = random.Random(self.seed)
        systems = [[1_000_000 * (t + 1) + i for i in range(self.system_len)]
                   for t in range(self.num_tenants)]
        out = []
        for k in range(self.num_requests):
            user = [rng.randrange(1, 999_999) for _ in range(self.user_len)]
            out.append((f"r{k}", systems[k % self.num_tenants] + user))
        return out


#: The workload exercise 3 measures on.
PRESSURE_WORKLOAD = PressureWorkload()


@dataclass(frozen=True)
class Served:
    """One request as the manager saw it at admission."""

    request_id: str
    prompt_len: int
    hit_tokens: int


def serve(manager_class: type[KVCacheManager], workload: PressureWorkload = PRESSURE_WORKLOAD
          ) -> list[Served]:
    """Run ``workload`` on a fresh ``manager_class``; one ``Served`` per request, in admission order.

    A step admits waiting requests first come first served while fewer than
    ``concurrency`` run (each: one prefix lookup, one allocation for the rest
    of its prompt), then gives every running request one output token, then
    frees the requests that are done (by the manager's own ``free``, which
    hands the table to the pool tail first). Output tokens are distinct
    per request, so only prompts are ever shared.
    """
    if not (isinstance(manager_class, type) and issubclass(manager_class, KVCacheManager)):
        raise TypeError(f"manager_class must be KVCacheManager or a subclass, got {manager_class!r}")
    if not isinstance(workload, PressureWorkload):
        raise TypeError(f"workload must be a PressureWorkload, got {type(workload).__name__}")
    w = workload
    manager = manager_class(w.num_blocks, w.block_size)
    waiting = [Request(rid, prompt, max_tokens=w.output_len) for rid, prompt in w.prompts()]
    waiting.reverse()  # pop() takes the oldest
    running: list[Request] = []
    served: list[Served] = []
    next_token = 2_000_000_000
    while waiting or running:
        while waiting and len(running) < w.concurrency:
            req = waiting[-1]
            hit, num_hit = manager.get_computed_blocks(req)
            if manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit) is None:
                raise RuntimeError(f"{req.request_id} did not fit although the pool is sized for "
                                   f"{w.concurrency} requests: the pool leaked blocks")
            waiting.pop()
            req.num_computed_tokens = req.num_tokens
            served.append(Served(req.request_id, len(req.prompt_token_ids), num_hit))
            running.append(req)
        for req in running:  # one token each; its slot is allocated before it is computed
            next_token += 1
            req.append_output_token_ids(next_token)
            if req.num_output_tokens < w.output_len:
                if manager.allocate_slots(req, 1) is None:
                    raise RuntimeError(f"{req.request_id} could not grow: the pool leaked blocks")
                req.num_computed_tokens += 1
        done = [r for r in running if r.num_output_tokens >= w.output_len]
        for req in done:
            manager.free(req)
            running.remove(req)
            manager.check()
    return served
