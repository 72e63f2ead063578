"""Kernel-puzzle properties that read the trace, not the answer.

A right answer can still break what a puzzle teaches. Three such lessons
are checked here, each from what the kernel's programs loaded and stored:

* puzzle 6: a program per (request, KV head) reads its K and V once for
  the whole group of query heads that share them; one program per query
  head reads them ``GROUP`` times (the bytes say so, and the launch's grid);
* puzzle 7: no query tile loads a key that none of its queries may see
  (the causal bound ends the key loop; a tile past a short chunk's end has
  no query and sees nothing);
* puzzle 10: every element of a block is copied, however large the block
  (a single tile of 1,024 lanes covers a block of 1,024 elements, no more).

On a GPU nothing is traced: the first two check the launch's grid where it
tells (puzzle 6), and otherwise pass on the values alone.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ._harness import Mistake, WrongAnswer
from .kernel_probes import interpreted
from .puzzle_harness import Case, Puzzle, elements, bytes_moved, run_case

__all__ = ["ONE_PER_QUERY_HEAD", "KV_READ_TWICE", "reads_kv_once", "CAUSAL_LOOP",
           "keys_no_query_sees", "ONE_TILE_PER_BLOCK", "block_tail_not_copied"]


# ------------------------------------------------------------ puzzle 6: K/V once per group

ONE_PER_QUERY_HEAD = Mistake(
    "one program per query head", "the GROUP query heads that share a KV head each had a "
    "program of their own, and each read that head's K and V: GROUP times the bytes. Grouped-"
    "query attention saves bandwidth only when the group shares one program, whose tile rows "
    "are its query heads and which reads its K and V once")
KV_READ_TWICE = Mistake(
    "K or V read more than once", "a program loaded some slot of K or V twice: each KV head's K "
    "and V are read once for its whole group, every element of them by one load")


def _programs(grids) -> int | None:
    """Programs in the first launch, when its grid is a tuple (``None`` when it cannot tell)."""
    if not grids or not isinstance(grids[0], (tuple, list)):
        return None
    return math.prod(int(x) for x in grids[0])


def reads_kv_once(puzzle: Puzzle, case: Case):
    """Puzzle 6's property: K and V bytes loaded equal the minimum (interpreter), and the grid."""
    def body(fn):
        run = run_case(fn, case, puzzle)
        reqs, heads = case.args["q"].shape[:2]
        kv_heads = case.args["key_cache"].shape[2]
        programs = _programs(run.grids)
        per_head = programs == reqs * heads and heads != kv_heads
        need = case.needs["key_cache"] + case.needs["value_cache"]
        if interpreted():
            loaded = sum(bytes_moved(run, ("key_cache", "value_cache"), "load").values())
            if loaded > need:
                raise WrongAnswer(
                    f"{case.label}: K and V loaded {loaded:,} bytes where {need:,} would do "
                    f"({loaded / need:.2f}x)"
                    + (f"; {programs} programs for {reqs} requests x {kv_heads} KV heads"
                       if programs else ""),
                    (ONE_PER_QUERY_HEAD if per_head else KV_READ_TWICE).diagnosis())
        elif per_head:
            raise WrongAnswer(f"{case.label}: {programs} programs for {reqs} requests x {kv_heads} "
                              "KV heads", ONE_PER_QUERY_HEAD.diagnosis())
    return body


# ------------------------------------------------------------ puzzle 7: the causal bound

CAUSAL_LOOP = Mistake(
    "keys past the tile's last query loaded", "a key after a tile's last query is masked out of "
    "every score of that tile, so loading it is traffic for nothing, and a tile past the end "
    "of a short chunk has no query at all: no tile may load a key none of its queries may see, "
    "so the causal bound ends the key loop, not only the scores")


def _owners(case: Case) -> dict:
    """Flat slot -> (request, position) for every slot a request owns."""
    a = case.args
    bs = a["key_cache"].shape[1]
    owner = {}
    for r, n in enumerate(a["seq_lens"].tolist()):
        for pos in range(n):
            owner[int(a["block_table"][r, pos // bs]) * bs + pos % bs] = (r, pos)
    return owner


def keys_no_query_sees(run, case: Case) -> str | None:
    """The first key a program loaded that none of the queries it stored may see, described."""
    a = case.args
    kc = run.args["key_cache"]
    per_slot = kc.shape[2] * kc.shape[3]
    out = run.got if isinstance(run.got, torch.Tensor) else None
    if out is None or not run.accesses:
        return None
    qsl, lens = a["query_start_loc"].tolist(), a["seq_lens"].tolist()
    token_owner = {}
    for r in range(len(qsl) - 1):
        for i in range(qsl[r], qsl[r + 1]):
            token_owner[i] = (r, lens[r] - (qsl[r + 1] - qsl[r]) + i - qsl[r])
    owner = _owners(case)
    per_token = out.shape[1] * out.shape[2]
    by_program: dict = {}
    for acc in run.accesses:
        slot_sets = by_program.setdefault(acc.program, [set(), set()])
        if acc.kind == "load":
            for name in ("key_cache", "value_cache"):
                idx = elements(acc.addresses, run.args[name])
                slot_sets[0].update((idx[(idx >= 0) & (idx < kc.numel())] // per_slot).tolist())
        else:
            idx = elements(acc.addresses, out)
            slot_sets[1].update((idx[(idx >= 0) & (idx < out.numel())] // per_token).tolist())
    for program in sorted(by_program):
        loaded, stored = by_program[program]
        last: dict = {}
        for token in stored:
            if token in token_owner:
                r, q_pos = token_owner[token]
                last[r] = max(last.get(r, -1), q_pos)
        for slot in sorted(loaded, key=lambda s: owner.get(s, (0, 0))[1], reverse=True):
            if slot not in owner:
                continue  # a read of poison: the read check names it
            r, pos = owner[slot]
            if pos > last.get(r, -1):
                where = (f"its last query of that request sits at position {last[r]}"
                         if r in last else "it stores no query of that request")
                return (f"program {program} loaded the key at position {pos} of request {r}, "
                        f"and {where}")
    return None


def causal_bound(puzzle: Puzzle, cases: list):
    def body(fn):
        if not interpreted():
            return
        for case in cases:
            seen = keys_no_query_sees(run_case(fn, case, puzzle), case)
            if seen:
                raise WrongAnswer(f"{case.label}: {seen}", CAUSAL_LOOP.diagnosis())
    return body


# ------------------------------------------------------------ puzzle 10: the whole block

ONE_TILE_PER_BLOCK = Mistake(
    "one tile per block", "only the first tile's worth of each block was copied: a block "
    "(block_size x heads x head_dim elements) can be larger than a tile, and a program walks "
    "its block a tile at a time until every element is copied")


def block_tail_not_copied(case: Case, got) -> Mistake | None:
    """Name a copy that stopped at a tile's end (the elements past it left as they were)."""
    if not isinstance(got, tuple):
        return None
    pairs = case.args["block_pairs"].tolist()
    first_wrong = None
    for have, want in zip(got, case.want):
        have = have.detach().cpu()
        for _, dst in pairs:
            bad = np.flatnonzero((have[dst] != want[dst]).reshape(-1).numpy())
            if bad.size:
                first_wrong = bad[0] if first_wrong is None else min(first_wrong, bad[0])
    n = case.args["caches"][0][0].numel()
    if first_wrong is None or first_wrong == 0 or first_wrong & (first_wrong - 1):
        return None
    return Mistake(ONE_TILE_PER_BLOCK.name,
                   f"only the first {int(first_wrong):,} of each block's {n:,} elements were "
                   "copied, one tile's worth: a block (block_size x heads x head_dim elements) "
                   "can be larger than a tile, and a program walks its block a tile at a time "
                   "until every element is copied")
