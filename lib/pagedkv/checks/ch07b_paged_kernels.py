"""Kernel puzzles 5-11 of exercise 7b: paged attention and around it.

Paged decode (MHA, then GQA), a varlen prefill chunk, split-KV partials and
their merge, ``copy_blocks`` over all layers, and vLLM's unmasked table load.
Each builder returns a ``Puzzle`` (``ch07b_kernel_puzzles`` is the ladder).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .._device import default_device
from ..common import cdiv
from ._harness import Mistake, WrongAnswer
from .puzzle_harness import LEGEND, OVERRUN_MISTAKE, Case, Puzzle, Run, access_grid
from .puzzle_cases import (F32, IN_ORDER, NO_SCALE, OFF_BY_ONE_READ, READ_PAST, TABLE_PAST,
                           blocks_in_order, cache_read_mistake, one_past, paged_case, random_cases,
                           reference_gather, reference_paged_attention, KV_STRIDE, NO_RESCALE,
                           SCALE_MISTAKES, falling_scores, ln_of_sum_split,
                           scale_models)
from .puzzle_rules import (CAUSAL_LOOP, KV_READ_TWICE, ONE_PER_QUERY_HEAD, ONE_TILE_PER_BLOCK,
                           block_tail_not_copied, causal_bound, reads_kv_once)


# ------------------------------------------------------ puzzle 5: paged decode

def _decode_case(label, seed, *, lens, heads=2, kv_heads=2, head_dim=8, block_size=4,
                 spare_columns=1):
    p = paged_case(seed, lens=lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   block_size=block_size, spare_columns=spare_columns)
    q = torch.randn(len(lens), heads, head_dim, generator=p["g"])
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = dict(q=q, key_cache=p["key_cache"], value_cache=p["value_cache"],
                block_table=p["block_table"], seq_lens=seq_lens, scale=head_dim ** -0.5)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    want = reference_paged_attention(q, p["key_cache"], p["value_cache"], p["block_table"], seq_lens, qsl,
                                     args["scale"])
    kv = sum(lens) * kv_heads * head_dim * F32
    qb = q.numel() * F32
    return Case(label, args, want, may_read=dict(key_cache=p["cache_mask"], value_cache=p["cache_mask"],
                                                 block_table=p["table_mask"]),
                minimum=2 * qb + 2 * kv, needs=dict(q=qb, key_cache=kv, value_cache=kv, out=qb),
                info=dict(per_slot=kv_heads * head_dim,
                          one_past=one_past(p, lens, block_size)))


def _decode_models():
    def in_order(c):
        a = dict(c.args)
        a["block_table"] = blocks_in_order(a["block_table"], a["key_cache"].shape[0])
        kc, vc = a["key_cache"], a["value_cache"]  # NaN where the mistake reads poison
        qsl = torch.arange(a["q"].shape[0] + 1, dtype=torch.int32)
        return reference_paged_attention(a["q"], kc, vc, a["block_table"], a["seq_lens"], qsl, a["scale"])

    def no_scale(c):
        a = c.args
        qsl = torch.arange(a["q"].shape[0] + 1, dtype=torch.int32)
        return reference_paged_attention(a["q"], a["key_cache"], a["value_cache"], a["block_table"], a["seq_lens"],
                          qsl, 1.0)

    def at(c, scale):
        return _decode_answer({**c.args, "scale": scale})

    return [(IN_ORDER, in_order), (NO_SCALE, no_scale), *scale_models(at)]


def _decode_answer(a):
    qsl = torch.arange(a["q"].shape[0] + 1, dtype=torch.int32)
    return reference_paged_attention(a["q"], a["key_cache"], a["value_cache"], a["block_table"],
                                     a["seq_lens"], qsl, a["scale"])


def _decode_picture(case, run, programs="(request, head)"):
    kc = run.args["key_cache"]
    return (access_grid(run, case, "key_cache", kc.shape[0] * kc.shape[1], kc.shape[1], "b") +
            f"\n(a cell: one block of the K cache; programs: {programs})\n" + LEGEND)


def _puzzle_5():
    cases = [_decode_case("one request, one block", 1, lens=[3]),
             _decode_case("three requests, scattered blocks", 2, lens=[17, 5, 30]),
             _decode_case("block size 16", 3, lens=[40, 9], block_size=16),
             _decode_case("block size 1", 4, lens=[6, 3], block_size=1)]
    return Puzzle("puzzle 5", [
        ("equals the reference on scattered tables", cases),
        random_cases(5, lambda k, pick: _decode_case(f"random case {k}", 100 + k,
                                                     lens=[pick(1, 40) for _ in range(pick(1, 3))],
                                                     block_size=pick((1, 4, 16))))],
        data=("q", "key_cache", "value_cache", "out"),
        mistakes=_decode_models(), read_mistake=cache_read_mistake,
        nan_mistake=READ_PAST, picture=_decode_picture, answer=_decode_answer,
        index_args=("block_table",), passes_when=[(NO_RESCALE, falling_scores(_decode_answer))])


# --------------------------------------------------- puzzle 6: GQA, a group of 3

PADDING_ROWS = Mistake(
    "rows of padding not masked",
    "with a group of 3 the tile has more rows than heads: a row g >= GROUP is the next "
    "group's first head, or lies past q and past the output for the last KV head, so it "
    "neither loads nor stores")
WRONG_HEAD = Mistake(
    "the wrong head of a group",
    "it matches query head h reading KV head h % num_kv_heads: the heads that share KV "
    "head k are k * GROUP to k * GROUP + GROUP - 1, consecutive")


def _gqa_read(case, name, idx):
    if name == "q":
        return PADDING_ROWS
    return cache_read_mistake(case, name, idx)


def _wrong_head(c):
    a = c.args
    group = a["q"].shape[1] // a["key_cache"].shape[2]
    kc, vc = (a[k].repeat(1, 1, group, 1) for k in ("key_cache", "value_cache"))
    qsl = torch.arange(a["q"].shape[0] + 1, dtype=torch.int32)
    return reference_paged_attention(a["q"], kc, vc, a["block_table"], a["seq_lens"], qsl, a["scale"])


def _random_gqa(k, pick):
    heads, kv_heads = pick(((9, 3), (8, 2), (6, 2), (4, 4), (6, 1), (5, 1)))
    return _decode_case(f"random case {k} ({heads} heads over {kv_heads})", 100 + k,
                        lens=[pick(1, 40) for _ in range(pick(1, 3))], heads=heads,
                        kv_heads=kv_heads, head_dim=16, block_size=pick((1, 4, 16)))


def _puzzle_6():
    cases = [_decode_case("9 query heads over 3 KV heads (a group of 3)", 1, lens=[13, 30, 4],
                          heads=9, kv_heads=3, head_dim=16),
             _decode_case("8 query heads over 2 KV heads", 2, lens=[21, 6], heads=8, kv_heads=2,
                          head_dim=16, block_size=16),
             _decode_case("4 over 4 (a group of 1)", 3, lens=[9, 17], heads=4, kv_heads=4,
                          head_dim=16)]
    models = _decode_models() + [(WRONG_HEAD, _wrong_head)]
    p = Puzzle("puzzle 6", [
        ("equals the reference for groups of 3, 4 and 1", cases), random_cases(6, _random_gqa)],
        data=("q", "key_cache", "value_cache", "out"), mistakes=models,
        read_mistake=_gqa_read, overrun_mistake=PADDING_ROWS, nan_mistake=READ_PAST,
        picture=lambda c, r: _decode_picture(c, r, "(request, KV head)"), answer=_decode_answer,
        index_args=("block_table",))
    p.extra.append(("reads each KV head's K and V once for its group (bytes = the minimum)",
                    reads_kv_once(p, cases[0])))
    return p


# ------------------------------------------------ puzzle 7: a prefill chunk

BLOCK_Q = 16


def _prefill_case(label, seed, *, lens, q_lens, heads=2, head_dim=16, block_size=4):
    p = paged_case(seed, lens=lens, heads=heads, kv_heads=heads, head_dim=head_dim,
                   block_size=block_size)
    qsl = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), heads, head_dim, generator=p["g"])
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = dict(q=q, key_cache=p["key_cache"], value_cache=p["value_cache"],
                block_table=p["block_table"], seq_lens=seq_lens, query_start_loc=qsl,
                scale=head_dim ** -0.5)
    want = reference_paged_attention(**args)
    # Each (request, head, query tile) program reads the keys up to its last query's position.
    keys = sum(min(n, n - ql + (t + 1) * BLOCK_Q) for n, ql in zip(lens, q_lens)
               for t in range(cdiv(ql, BLOCK_Q)))
    kv = keys * heads * head_dim * F32
    qb = q.numel() * F32
    return Case(label, args, want, may_read=dict(key_cache=p["cache_mask"], value_cache=p["cache_mask"],
                                                 block_table=p["table_mask"]),
                minimum=2 * qb + 2 * kv, needs=dict(q=qb, key_cache=kv, value_cache=kv, out=qb),
                info=dict(per_slot=heads * head_dim, one_past=one_past(p, lens, block_size)))


NO_CAUSAL = Mistake(
    "no causal mask",
    "it matches every query seeing every key of its request: query i of a chunk sits at "
    "q_pos = seq_len - q_len + i and sees only the keys at positions up to its own")
FROM_ZERO_Q = Mistake(
    "query positions from 0",
    "it matches query i at position i: a chunk continues its context, so its first query "
    "sits at context_len = seq_len - q_len")
SELF_MASKED = Mistake(
    "a query does not see itself",
    "it matches the mask pos < q_pos: a query's own key is written before attention runs, "
    "and it sees it")


def _prefill_model(causal_shift=None, from_zero=False):
    def model(c):
        a = c.args
        out = torch.zeros_like(a["q"])
        qsl = a["query_start_loc"].tolist()
        for r in range(len(qsl) - 1):
            n, ql = int(a["seq_lens"][r]), qsl[r + 1] - qsl[r]
            k = reference_gather(a["key_cache"], a["block_table"][r], n)
            v = reference_gather(a["value_cache"], a["block_table"][r], n)
            s = torch.einsum("qhd,khd->hqk", a["q"][qsl[r]:qsl[r + 1]], k) * a["scale"]
            q_pos = torch.arange(ql) if from_zero else torch.arange(n - ql, n)
            if causal_shift is not None:
                s = s.masked_fill(torch.arange(n)[None, None, :] > q_pos[None, :, None] + causal_shift,
                                  float("-inf"))
            p = torch.softmax(s, -1).nan_to_num(0.0)  # a query that sees nothing: 0
            out[qsl[r]:qsl[r + 1]] = torch.einsum("hqk,khd->qhd", p, v)
        return out
    return model


def _random_prefill(k, pick):
    q_lens = [pick(1, 24) for _ in range(pick(1, 3))]
    lens = [q + pick(0, 20) for q in q_lens]
    return _prefill_case(f"random case {k}", 100 + k, lens=lens, q_lens=q_lens,
                         block_size=pick((1, 4, 16)))


def _puzzle_7():
    cases = [_prefill_case("one request, no context", 1, lens=[12], q_lens=[12]),
             _prefill_case("a chunk after 20 tokens of context", 2, lens=[30], q_lens=[10]),
             _prefill_case("20 queries: two query tiles", 3, lens=[27], q_lens=[20]),
             _prefill_case("three requests: a chunk, a decode, a whole prompt", 4,
                           lens=[19, 9, 6], q_lens=[7, 1, 6], block_size=16)]
    beside = _prefill_case("a 20-query chunk beside a decode (the decode's tile 1 is empty)", 5,
                           lens=[30, 12], q_lens=[20, 1])
    p = Puzzle("puzzle 7", [
        ("equals causal attention for chunks with and without context", cases + [beside]),
        random_cases(7, _random_prefill)],
        data=("q", "key_cache", "value_cache", "out"),
        mistakes=[(NO_CAUSAL, _prefill_model()), (FROM_ZERO_Q, _prefill_model(0, from_zero=True)),
                  (SELF_MASKED, _prefill_model(-1))] + _decode_models()[:1],
        read_mistake=cache_read_mistake, nan_mistake=READ_PAST, atol=5e-4,
        picture=lambda c, r: _decode_picture(c, r, "(request, head, query tile)"),
        answer=lambda a: reference_paged_attention(**a), index_args=("block_table",))
    p.extra.append(("no tile loads a key none of its queries may see",
                    causal_bound(p, [cases[1], cases[2], beside])))
    return p


# ------------------------------------------------ puzzle 8: split-KV partials

LOG2E = 1.0 / math.log(2)


def reference_split_partials(q, key_cache, value_cache, block_table,
                             seq_lens, scale, num_splits):
    """Each split's normalised partial output and its log-sum-exp in base 2.

    Split s of request r covers positions ``[s * seg, min((s + 1) * seg,
    seq_len))`` with ``seg = cdiv(max(seq_lens), num_splits)``; an empty
    segment gives a partial of 0 and an lse of -inf.
    """
    R, H, D = q.shape
    seg = cdiv(int(seq_lens.max()), num_splits)
    partial = torch.zeros(num_splits, R, H, D)
    lse = torch.full((num_splits, R, H), float("-inf"))
    for r in range(R):
        n = int(seq_lens[r])
        k = reference_gather(key_cache, block_table[r], n).float()
        v = reference_gather(value_cache, block_table[r], n).float()
        for split in range(num_splits):
            lo, hi = split * seg, min((split + 1) * seg, n)
            if lo >= hi:
                continue
            s = torch.einsum("hd,khd->hk", q[r].float(), k[lo:hi]) * scale
            p = torch.softmax(s, -1)
            partial[split, r] = torch.einsum("hk,khd->hd", p, v[lo:hi])
            # log2(sum(exp(s))) = ln(sum(exp(s))) * log2(e)
            lse[split, r] = torch.logsumexp(s, -1) * LOG2E
    return partial, lse


def _split_case(label, seed, *, lens, num_splits, heads=2, head_dim=8, block_size=4):
    p = paged_case(seed, lens=lens, heads=heads, kv_heads=heads, head_dim=head_dim,
                   block_size=block_size)
    q = torch.randn(len(lens), heads, head_dim, generator=p["g"])
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = dict(q=q, key_cache=p["key_cache"], value_cache=p["value_cache"],
                block_table=p["block_table"], seq_lens=seq_lens, scale=head_dim ** -0.5,
                num_splits=num_splits)
    want = reference_split_partials(**args)
    kv = sum(lens) * heads * head_dim * F32
    qb = q.numel() * F32
    outs = want[0].numel() * F32 + want[1].numel() * F32
    return Case(label, args, want, may_read=dict(key_cache=p["cache_mask"], value_cache=p["cache_mask"],
                                                 block_table=p["table_mask"]),
                minimum=num_splits * qb + 2 * kv + outs,
                needs=dict(q=num_splits * qb, key_cache=kv, value_cache=kv,
                           out0=want[0].numel() * F32, out1=want[1].numel() * F32),
                info=dict(per_slot=heads * head_dim, one_past=one_past(p, lens, block_size)))


NATURAL_LSE = Mistake(
    "lse in base e",
    "it matches the natural log-sum-exp: the merge weighs a split by 2 to the power of "
    "its lse, so the lse is in base 2, of scores taken to base 2")
LN_OF_SUM = Mistake(
    "ln where log2 belongs",
    "it matches m + ln(l) with m and l in base 2: the lse is in base 2 throughout, so "
    "the sum l = sum(2**(s - m)) comes back through log2, m + log2(l)")
EMPTY_SEGMENT = Mistake(
    "an empty segment",
    "a split past a short request's last key sees no key: l = 0 and m = -inf. It must "
    "weigh nothing in the merge (a partial of 0, an lse of -inf) rather than divide by 0")
WHOLE_SEQUENCE = Mistake(
    "every split reads the whole sequence",
    "split s covers positions s * seg to min((s + 1) * seg, seq_len) - 1 only: the splits "
    "share the keys out, none is read twice")


def _puzzle_8():
    cases = [_split_case("one split (the plain decode)", 1, lens=[13, 6], num_splits=1),
             _split_case("three splits", 2, lens=[30, 22], num_splits=3),
             _split_case("four splits, short requests with empty segments", 3, lens=[40, 3, 9],
                         num_splits=4)]

    def natural(c):
        partial, lse2 = reference_split_partials(**c.args)
        return partial, lse2 / LOG2E

    def ln_of_sum(c):  # scores in base 2, but the natural log of their sum
        return reference_split_partials(**c.args)[0], ln_of_sum_split(c.args)

    def at(c, scale):
        return reference_split_partials(**{**c.args, "scale": scale})

    def whole(c):
        a = dict(c.args)
        partial, lse = reference_split_partials(**{**a, "num_splits": 1})
        S = a["num_splits"]
        return partial.repeat(S, 1, 1, 1), lse.repeat(S, 1, 1)

    return Puzzle("puzzle 8", [
        ("partials and base-2 lse for 1, 3 and 4 splits, empty segments included", cases),
        random_cases(8, lambda k, pick: _split_case(f"random case {k}", 100 + k,
                                                    lens=[pick(1, 40) for _ in range(pick(1, 3))],
                                                    num_splits=pick(1, 5), block_size=pick((1, 4, 16))))],
        data=("q", "key_cache", "value_cache", "out"),
        mistakes=[(NATURAL_LSE, natural), (WHOLE_SEQUENCE, whole), (LN_OF_SUM, ln_of_sum),
                  *scale_models(at)],
        passes_when=[(NO_RESCALE, falling_scores(lambda a: reference_split_partials(**a)))],
        read_mistake=cache_read_mistake,
        nan_mistake=EMPTY_SEGMENT, picture=_split_picture, atol=5e-4,
        answer=lambda a: reference_split_partials(**a), index_args=("block_table",))


def _split_picture(case, run):
    kc = run.args["key_cache"]
    return (access_grid(run, case, "key_cache", kc.shape[0] * kc.shape[1], kc.shape[1], "b") +
            "\n(a cell: one block of the K cache; programs: (request, head, split))\n" + LEGEND)


# ------------------------------------------------------ puzzle 9: the merge

def reference_merge(partial, lse):
    """Merge the splits: weights 2**(lse - max lse), normalised; [R, H, D]."""
    w = torch.exp2(lse - lse.max(0).values)
    return (w[..., None] * partial).sum(0) / w.sum(0)[..., None]


def _merge_case(label, seed, *, splits, rows=2, heads=2, head_dim=8, empty=0, big=False):
    g = torch.Generator().manual_seed(seed)
    partial = torch.randn(splits, rows, heads, head_dim, generator=g)
    lse = torch.randn(splits, rows, heads, generator=g) * 3
    if big:
        lse = lse + 200.0  # 2**200 overflows fp32: subtract the max first
    if empty:  # the last segments of request 0 saw no key
        lse[-empty:, 0] = float("-inf")
        partial[-empty:, 0] = 0.0
    args = dict(partial=partial, lse=lse)
    outb = rows * heads * head_dim * F32
    return Case(label, args, reference_merge(partial, lse),
                minimum=partial.numel() * F32 + lse.numel() * F32 + outb,
                needs=dict(partial=partial.numel() * F32, lse=lse.numel() * F32, out=outb))


EXP_NOT_EXP2 = Mistake(
    "exp where exp2 belongs",
    "the lse is in base 2: a split's weight is 2, not e, to the power of its lse less the "
    "largest")
NOT_NORMALISED = Mistake(
    "weights not normalised",
    "the merged output is a weighted average of the partials: the weights sum to 1 only "
    "once divided by their sum")
MERGE_OVERFLOW = Mistake(
    "the max lse not subtracted",
    "2 ** 200 overflows fp32 (inf / inf = NaN); the average is unchanged when every lse "
    "moves by the same amount, and moved down by the largest no weight exceeds 1")


def _puzzle_9():
    cases = [_merge_case("four splits", 1, splits=4), _merge_case("one split", 2, splits=1),
             _merge_case("three splits (not a power of two), two of them empty", 3, splits=3,
                         empty=2)]
    big = [_merge_case("lse near 200", 4, splits=4, big=True)]

    def exp_e(c):
        a = c.args
        w = torch.exp(a["lse"] - a["lse"].max(0).values)
        return (w[..., None] * a["partial"]).sum(0) / w.sum(0)[..., None]

    def not_norm(c):
        a = c.args
        w = torch.exp2(a["lse"] - a["lse"].max(0).values)
        return (w[..., None] * a["partial"]).sum(0)

    def picture(case, run):
        lse = run.args["lse"]
        return (access_grid(run, case, "lse", lse.numel(), lse.shape[1] * lse.shape[2], "s") +
                "\n(a cell: one split's lse, a character per (request, head))\n" + LEGEND)

    return Puzzle("puzzle 9", [
        ("merges 4, 1 and 3 splits, empty segments included", cases),
        random_cases(9, lambda k, pick: _merge_case(f"random case {k}", 100 + k, splits=(n := pick(1, 6)),
                                                    rows=pick(1, 3), empty=pick(0, n - 1))),
        ("stays finite with lse near 200", big)],
        data=("partial", "lse", "out"), mistakes=[(EXP_NOT_EXP2, exp_e),
                                                                 (NOT_NORMALISED, not_norm)],
        nan_mistake=MERGE_OVERFLOW, picture=picture, answer=lambda a: reference_merge(**a))


# ------------------------------------------------------ puzzle 10: copy_blocks

def reference_copy_blocks(caches, block_pairs):
    """Copy block src to block dst in every cache (of copies); return them."""
    out = [c.clone() for c in caches]
    for src, dst in block_pairs.tolist():
        for c in out:
            c[dst] = c[src]
    return tuple(out)


def _copy_case(label, seed, *, layers, pairs, num_blocks=8, block_size=4, heads=2, head_dim=4):
    """``caches``: 2 x ``layers`` fp32 caches; ``block_pairs`` int64 ``(src, dst)``."""
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randn(num_blocks, block_size, heads, head_dim, generator=g)
              for _ in range(2 * layers)]
    pairs = torch.tensor(pairs, dtype=torch.int64)
    block = block_size * heads * head_dim * F32
    n = 2 * len(pairs) * 2 * layers * block
    return Case(label, dict(caches=caches, block_pairs=pairs), reference_copy_blocks(caches, pairs),
                minimum=n, needs={f"caches[{i}]": 2 * len(pairs) * block for i in range(2 * layers)})


SWAPPED = Mistake(
    "src and dst swapped",
    "each pair is (src, dst): block src is read, block dst written")
ONE_LAYER = Mistake(
    "one cache only",
    "every layer's K and V cache holds its own copy of the block: the launch covers every "
    "(pair, cache), one program each")
NOT_REFUSED = Mistake(
    "overlapping pairs accepted",
    "a block that is both a src and a dst (or a dst twice) makes the result depend on "
    "which program runs first: the statement asks for a ValueError naming the block, "
    "raised before anything changes")


def _refuses(fn):
    for pairs, block in (([[1, 2], [2, 3]], 2), ([[1, 3], [4, 3]], 3)):
        caches = [torch.randn(6, 2, 1, 4) for _ in range(2)]
        before = [c.clone() for c in caches]
        dev = [c.to(default_device()) for c in caches]
        try:
            fn(caches=dev, block_pairs=torch.tensor(pairs, device=default_device()))
        except ValueError as exc:
            if str(block) not in str(exc):
                raise WrongAnswer(f"pairs {pairs}: the ValueError does not name block {block}: "
                                  f"{exc}", NOT_REFUSED.diagnosis()) from None
        else:
            raise WrongAnswer(f"pairs {pairs}: no ValueError", NOT_REFUSED.diagnosis())
        if not all(torch.equal(a, b.cpu()) for a, b in zip(before, dev)):
            raise WrongAnswer(f"pairs {pairs}: it raised, but changed a cache first",
                              NOT_REFUSED.diagnosis())


def _random_copy(k, pick):
    blocks = torch.randperm(8, generator=torch.Generator().manual_seed(100 + k)).tolist()
    n = pick(1, 4)  # n sources and n destinations, all distinct
    return _copy_case(f"random case {k}", 100 + k, layers=pick(1, 3),
                      pairs=[[blocks[i], blocks[n + i]] for i in range(n)])


def _puzzle_10():
    cases = [_copy_case("one pair, one layer", 1, layers=1, pairs=[[2, 5]]),
             _copy_case("three pairs, three layers (six caches)", 2, layers=3,
                        pairs=[[0, 7], [3, 1], [6, 4]]),
             _copy_case("blocks of 2,560 elements (16 slots x 2 heads x 80), more than a tile",
                        3, layers=1, pairs=[[1, 6], [4, 2]], block_size=16, head_dim=80)]

    def swapped(c):
        return reference_copy_blocks(c.args["caches"], c.args["block_pairs"].flip(1))

    def one(c):
        first = reference_copy_blocks(c.args["caches"][:1], c.args["block_pairs"])
        return first + tuple(t.clone() for t in c.args["caches"][1:])

    return Puzzle("puzzle 10", [
        ("copies every pair in every cache, nothing else", cases), random_cases(10, _random_copy)],
        data=("caches",), mistakes=[(SWAPPED, swapped), (ONE_LAYER, one)],
        result=lambda got, args: tuple(args["caches"]), picture=_copy_picture, atol=0.0,
        # Its work is a copy: there is no answer to compute before the launch (no ``answer``).
        explain=block_tail_not_copied, index_args=("block_pairs",),
        extra=[("refuses overlapping pairs (ValueError naming the block), changing nothing",
                _refuses)])


def _copy_picture(case, run):
    """One line per program; a column per block of each cache it touched."""
    lines = []
    for i, c in enumerate(run.args["caches"][:4]):
        sub = Run(run.got, {"cache": c}, run.accesses, [], run.launches)
        grid = access_grid(sub, case, "cache", c.shape[0], c.shape[0], "blocks")
        body = grid.splitlines()[1:]
        lines += [f"cache {i}:"] + [ln for ln in body if set(ln[11:]) - {".", " "}]
    return ("\n".join(lines) + "\n(a character per block of that cache; programs: (pair, cache))\n"
            + LEGEND)


# ------------------------------------ puzzle 11: vLLM's unmasked table load

TOKEN_ALIGNMENT = 128  # vLLM's block-table rows are a whole number of 128-token spans


def reference_table_width(max_num_blocks, block_size):
    """vLLM's table width: max_num_blocks, rounded up to 128-token spans."""
    # The fewest blocks that make a whole number of 128-token spans:
    align = TOKEN_ALIGNMENT // math.gcd(TOKEN_ALIGNMENT, block_size)
    return cdiv(max_num_blocks, align) * align


NOT_PADDED = Mistake(
    "the table not padded to 128 tokens",
    "an unmasked table load of a 128-key tile names columns up to the tile's end, past "
    "the request's blocks; only a row whose width is a whole number of 128-token spans "
    "(vLLM's get_block_table_width) keeps them inside the row, and inside the table for "
    "the last row")


def _unmasked_read(case, name, idx):
    if name == "block_table":
        return NOT_PADDED
    return cache_read_mistake(case, name, idx)


def _puzzle_11():
    def case(label, seed, lens, block_size):
        return _decode_case(label, seed, lens=lens, block_size=block_size, spare_columns=0)

    cases = [case("block size 16: 5 columns, padded to 8", 1, [40, 9, 70], 16),
             case("block size 4: 13 columns, padded to 32", 2, [13, 50], 4),
             case("block size 1: 30 columns, padded to 128", 3, [5, 30], 1),
             case("block size 128: one column, already aligned", 4, [100, 7], 128),
             case("block size 48, not a power of two: 3 columns, padded to 8", 5, [60, 140], 48)]
    rand = random_cases(11, lambda k, pick: case(f"random case {k}", 100 + k,
                                                 [pick(1, 70) for _ in range(pick(1, 3))],
                                                 pick((1, 2, 4, 8, 16, 32, 64, 128, 256))))
    return Puzzle("puzzle 11", [("equals the reference, the table loads in bounds", cases), rand],
                  data=("q", "key_cache", "value_cache", "out"), mistakes=_decode_models(),
                  read_mistake=_unmasked_read, tail_read_mistake=NOT_PADDED, nan_mistake=READ_PAST,
                  picture=_decode_picture, guard_rows=TOKEN_ALIGNMENT, answer=_decode_answer,
                  index_args=("block_table",))

# ----------------------------------------------- what the ladder reads

BUILDERS = {5: _puzzle_5, 6: _puzzle_6, 7: _puzzle_7, 8: _puzzle_8, 9: _puzzle_9, 10: _puzzle_10,
            11: _puzzle_11}
REFERENCES = {5: reference_paged_attention, 6: reference_paged_attention, 7: reference_paged_attention,
              8: reference_split_partials, 9: reference_merge, 10: reference_copy_blocks,
              11: reference_table_width}

#: The small case each puzzle's picture is drawn from.
PICTURES = {
    5: lambda: _decode_case("picture", 7, lens=[7, 5], block_size=4),
    6: lambda: _decode_case("picture", 7, lens=[7, 5], heads=6, kv_heads=2, head_dim=16),
    7: lambda: _prefill_case("picture", 7, lens=[9, 6], q_lens=[4, 6]),
    8: lambda: _split_case("picture", 7, lens=[9, 3], num_splits=3),
    9: lambda: _merge_case("picture", 7, splits=3, empty=1),
    10: lambda: _copy_case("picture", 7, layers=2, pairs=[[0, 7], [3, 1]]),
    11: lambda: _decode_case("picture", 7, lens=[7, 5], block_size=4, spare_columns=0),
}

#: The mistakes each puzzle's check names, in the order it tries them.
MISTAKES = {
    5: [OVERRUN_MISTAKE, IN_ORDER, NO_SCALE, *(m for m, _ in SCALE_MISTAKES), TABLE_PAST,
        OFF_BY_ONE_READ, READ_PAST, NO_RESCALE],
    6: [PADDING_ROWS, IN_ORDER, NO_SCALE, *(m for m, _ in SCALE_MISTAKES), WRONG_HEAD, TABLE_PAST,
        KV_STRIDE, OFF_BY_ONE_READ, READ_PAST,
        ONE_PER_QUERY_HEAD, KV_READ_TWICE],
    7: [OVERRUN_MISTAKE, NO_CAUSAL, FROM_ZERO_Q, SELF_MASKED, IN_ORDER, TABLE_PAST, OFF_BY_ONE_READ,
        READ_PAST, CAUSAL_LOOP],
    8: [OVERRUN_MISTAKE, NATURAL_LSE, WHOLE_SEQUENCE, LN_OF_SUM, *(m for m, _ in SCALE_MISTAKES),
        TABLE_PAST, OFF_BY_ONE_READ, READ_PAST, NO_RESCALE, EMPTY_SEGMENT],
    9: [OVERRUN_MISTAKE, EXP_NOT_EXP2, NOT_NORMALISED, MERGE_OVERFLOW],
    10: [OVERRUN_MISTAKE, SWAPPED, ONE_LAYER, ONE_TILE_PER_BLOCK, NOT_REFUSED],
    11: [OVERRUN_MISTAKE, NOT_PADDED, IN_ORDER, NO_SCALE, *(m for m, _ in SCALE_MISTAKES),
         OFF_BY_ONE_READ, READ_PAST],
}
