"""The randomized scheduler trial exercises 3 and 6 share.

``manager_trial(make_manager, seed)`` drives two ``KVCacheManager``s through
the same seeded run of a scheduler's calls (admissions with prefix hits,
growth, preemption, frees, copy acknowledgements): a plain one, and the
learner's, built by ``make_manager`` through the library's public extension
points (a ``KVCacheManager`` subclass). After every operation the block tables,
every ``ref_cnt``, the free queue in order, the cached hashes and the
outstanding copies must agree, and both ``check()``s pass.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from ..kv_cache_manager import KVCacheManager
from ..request import Request
from ._harness import WrongAnswer

__all__ = ["manager_trial", "block_ids"]


def _snapshot(m: KVCacheManager) -> dict:
    pool = m.block_pool
    return {
        "block tables": {r: [b.block_id for b in bs]
                         for r, bs in sorted(m.req_to_blocks.items())},
        "free queue (head to tail)": [
            b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "ref_cnt": {b.block_id: b.ref_cnt for b in pool.blocks[1:]
                    if b.ref_cnt},
        "hashed blocks": sorted(b.block_id for b in pool.blocks
                                if b.block_hash is not None),
        "outstanding copies": m.outstanding_copies,
    }


def _first_difference(mine: dict, lib: dict) -> str | None:
    for key in lib:
        if mine[key] != lib[key]:
            return f"{key}: yours {mine[key]}, the library's {lib[key]}"
    return None


def manager_trial(make_manager: Callable[..., KVCacheManager], seed: int,
                  n_ops: int = 60, *, aligned: bool | None = None,
                  diagnose: Callable[[], str | None] = lambda: None) -> None:
    """One seeded run of a scheduler's calls on two managers, one with the learner's code.

    ``make_manager`` builds the second manager, taking ``KVCacheManager``'s
    arguments (a subclass, or a ``functools.partial`` of the class, will do).
    After every operation both managers' states must agree and both
    ``check()``s pass; otherwise ``WrongAnswer`` names the seed, the
    operation, the first difference, and ``diagnose()``'s verdict.
    ``aligned`` forces prefix matching in whole blocks (True) or in
    sub-blocks, with copy-on-write of partial hits (False).
    """
    rng = random.Random(seed)
    B = rng.choice([2, 4])
    if aligned is None:
        aligned = rng.random() < 0.5
    h = B if aligned else rng.choice([d for d in (1, 2) if d < B])
    num_blocks = rng.randint(10, 24)
    watermark = rng.choice([0.0, 0.1, 0.2])
    lib = KVCacheManager(num_blocks, B, True, h, watermark)
    mine = make_manager(num_blocks, B, True, h, watermark)
    prefixes = [[rng.randint(1, 6) for _ in range(rng.randint(1, 4 * B))]
                for _ in range(3)]
    running: dict[str, tuple[Request, Request]] = {}
    n = 0
    history: list[str] = []

    def fail(what: str) -> None:
        raise WrongAnswer(f"seed {seed}, block_size {B}, operation "
                          f"{len(history)} ({history[-1]}): {what}", diagnose())

    def twins(rid, prompt, max_tokens):
        return (Request(rid, prompt, max_tokens, hash_block_size=h),
                Request(rid, prompt, max_tokens, hash_block_size=h))

    def allocate(rl, rm, num_new, n_hit=0, hit_l=(), hit_m=()):
        out_l = lib.allocate_slots(rl, num_new, n_hit, list(hit_l))
        out_m = mine.allocate_slots(rm, num_new, n_hit, list(hit_m))
        if (out_l is None) != (out_m is None):
            fail(f"allocate_slots returned {block_ids(out_m)}, the library "
                 f"{block_ids(out_l)}")
        return out_l is not None

    def drop(rid, preempted):
        rl, rm = running.pop(rid)
        lib.free(rl)
        mine.free(rm)

    for _ in range(n_ops):
        ops = ["admit"] * 3
        if running:
            ops += ["step"] * 5 + ["finish", "preempt"]
        if lib.outstanding_copies:
            ops += ["copies"] * 3
        op = rng.choice(ops)
        if op == "admit":
            n += 1
            rid = f"r{n}"
            prompt = (list(rng.choice(prefixes))
                      + [rng.randint(1, 6) for _ in range(rng.randint(0, 2 * B))])
            rl, rm = twins(rid, prompt, rng.randint(1, 3 * B))
            history.append(f"admit {rid} with {len(prompt)} prompt tokens")
            hit_l, n_l = lib.get_computed_blocks(rl)
            hit_m, n_m = mine.get_computed_blocks(rm)
            if ([b.block_id for b in hit_m], n_m) != ([b.block_id for b in hit_l], n_l):
                fail(f"get_computed_blocks returned blocks "
                     f"{[b.block_id for b in hit_m]} and {n_m} tokens; the "
                     f"library {[b.block_id for b in hit_l]} and {n_l}")
            num_new = min(rng.randint(1, 3 * B), rl.num_tokens - n_l)
            if allocate(rl, rm, num_new, n_l, hit_l, hit_m):
                rl.num_computed_tokens = rm.num_computed_tokens = n_l + num_new
                running[rid] = (rl, rm)
        elif op == "step":
            rid = rng.choice(sorted(running))
            rl, rm = running[rid]
            if rl.num_computed_tokens < rl.num_tokens:
                num_new = min(rng.randint(1, 3 * B),
                              rl.num_tokens - rl.num_computed_tokens)
                history.append(f"prefill {num_new} tokens of {rid}")
            elif rl.is_finished:
                history.append(f"finish {rid}")
                drop(rid, False)
                num_new = 0
            else:
                token = rng.randint(1, 6)
                rl.append_output_token_ids(token)
                rm.append_output_token_ids(token)
                num_new = 1
                history.append(f"decode one token of {rid}")
            if num_new:
                if allocate(rl, rm, num_new):
                    rl.num_computed_tokens += num_new
                    rm.num_computed_tokens += num_new
                else:  # no room: the scheduler preempts it
                    history[-1] += ", no room: preempt it"
                    drop(rid, True)
        elif op in ("finish", "preempt"):
            rid = rng.choice(sorted(running))
            history.append(f"{op} {rid}")
            drop(rid, op == "preempt")
        else:
            history.append("run and acknowledge the copies")
            lib.acknowledge_copies(lib.take_pending_copies())
            mine.acknowledge_copies(mine.take_pending_copies())
        try:
            mine.check()
        except AssertionError as exc:
            fail(f"check() fails: {exc}")
        diff = _first_difference(_snapshot(mine), _snapshot(lib))
        if diff:
            fail(diff)


def block_ids(blocks) -> list[int] | None:
    """The ids of ``blocks`` (``None`` stays ``None``)."""
    return None if blocks is None else [b.block_id for b in blocks]
