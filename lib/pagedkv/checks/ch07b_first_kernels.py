"""Kernel puzzles 1-4 of exercise 7b: the pieces before paged attention.

vLLM's per-request slot mapping, a paged gather, one query over one tile
with an exact softmax, and a long softmax over tiles (the ``m = -inf``
case). Each builder returns a ``Puzzle``: its reference, seeded cases and
the mistakes it names (``ch07b_kernel_puzzles`` is the ladder).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..common import cdiv
from ._harness import Mistake
from .puzzle_harness import LEGEND, OVERRUN_MISTAKE, Case, Puzzle, access_grid
from .puzzle_cases import (F32, IN_ORDER, NO_SCALE, OFF_BY_ONE_READ, PAD_SLOT_ID, READ_PAST,
                           TABLE_PAST, blocks_in_order, cache_read_mistake, one_past, paged_case,
                           random_cases, reference_gather, wrap32, SCALE_MISTAKES, NO_RESCALE,
                           scale_models)


# ------------------------------------------------- puzzle 1: slots per request

def reference_slots_per_request(query_start_loc, positions, block_table,
                                block_size, max_num_tokens):
    """vLLM's per-request slot mapping, PAD_SLOT_ID past the real tokens.

    Request r's tokens are query_start_loc[r] .. query_start_loc[r + 1] - 1.
    """
    out = torch.full((max_num_tokens,), PAD_SLOT_ID, dtype=torch.int64)
    qsl = query_start_loc.tolist()
    for r in range(len(qsl) - 1):
        pos = positions[qsl[r]:qsl[r + 1]]
        blocks = block_table[r, pos // block_size].long()
        out[qsl[r]:qsl[r + 1]] = blocks * block_size + pos % block_size
    return out


def _slots_case(label, seed, *, q_lens, block_size, pad=5, big_ids=False):
    g = torch.Generator().manual_seed(seed)
    ctx = [int(x) for x in torch.randint(0, 3 * block_size, (len(q_lens),), generator=g)]
    need = [cdiv(c + q, block_size) for c, q in zip(ctx, q_lens)]
    width = max(need) + 2
    ids = torch.randperm(len(q_lens) * width * 2, generator=g)[: len(q_lens) * width]
    if big_ids:
        ids = ids + 20_000_000
    table = ids.view(len(q_lens), width).to(torch.int32)
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(ctx, q_lens)]).long()
    qsl = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32)
    mask = torch.zeros_like(table, dtype=torch.bool)
    for r, k in enumerate(need):
        mask[r, :k] = True
    n = int(qsl[-1])
    args = dict(query_start_loc=qsl, positions=positions, block_table=table, block_size=block_size,
                max_num_tokens=n + pad)
    return Case(label, args, reference_slots_per_request(qsl, positions, table, block_size, n + pad),
                may_read=dict(block_table=mask), minimum=8 * n + 8 * (n + pad),
                needs=dict(positions=8 * n, out=8 * (n + pad)), info=dict(ctx=ctx))


def _slots_wrap(case):
    a = case.args
    want = reference_slots_per_request(**a)
    real = want != PAD_SLOT_ID
    want[real] = wrap32(want[real])
    return want


def _slots_from_zero(case):
    a = case.args
    qsl = a["query_start_loc"]
    pos = torch.cat([torch.arange(int(qsl[r + 1] - qsl[r])) for r in range(len(qsl) - 1)]).long()
    return reference_slots_per_request(qsl, pos, a["block_table"], a["block_size"], a["max_num_tokens"])


def _slots_explain(case, got):
    n = case.args["positions"].numel()
    if isinstance(got, torch.Tensor) and got.shape == case.want.shape:
        g = got.cpu()
        if torch.equal(g[:n], case.want[:n]) and not bool((g[n:] == PAD_SLOT_ID).all()):
            return NO_PADDING
    return None


NO_PADDING = Mistake(
    "the tail not padded",
    "the entries past the last real token, up to max_num_tokens, must hold PAD_SLOT_ID "
    "(-1), the mark that tells the KV write to skip a token: a CUDA graph of a fixed size "
    "reads them all, and the one program with no request is there to write them")
INT32_SLOTS = Mistake(
    "int32 wrap",
    "block ids are int32, and a slot, block id x block_size, passes 2**31 in a large pool "
    "(here ids past 20,000,000 at block size 128): the product must be computed in int64, "
    "before it can wrap")
FROM_ZERO = Mistake(
    "positions counted from the request's start",
    "a request's new tokens continue its context: a token's position is the one positions "
    "gives it, not its index within the request")
QSL_PAST = Mistake(
    "the last program reads a request that does not exist",
    "the grid has num_reqs + 1 programs and the last has no request: query_start_loc has "
    "no entry for it past the end, and its only work is the padding")
TOKEN_PAST = Mistake(
    "an off-by-one mask",
    "it read the token after the request's last: request r's tokens end one before "
    "query_start_loc[r + 1]")


def _slots_read(case, name, idx):
    if name == "block_table":
        return TABLE_PAST
    if name == "query_start_loc":
        return QSL_PAST
    if name == "positions":
        # One token past a request's last is an off-by-one mask; lanes further out, no mask.
        return TOKEN_PAST if int(idx.max()) <= case.args["positions"].numel() else None
    return None


def _slots_picture(case, run):
    return (access_grid(run, case, "out", run.got.numel(), 4, "t") +
            "\n(a cell: 4 entries of the slot mapping)\n" + LEGEND)


def _puzzle_1():
    cases = [
        _slots_case("one request", 1, q_lens=[5], block_size=4),
        _slots_case("four requests (one empty), tokens over several tiles", 2, q_lens=[20, 3, 0, 37],
                    block_size=16, pad=9),
        _slots_case("block size 1", 3, q_lens=[6, 2], block_size=1, pad=0),
    ]
    wide = [_slots_case("block ids past 20,000,000 at block size 128", 4, q_lens=[3, 4],
                        block_size=128, big_ids=True)]
    return Puzzle(
        "puzzle 1",
        [("maps every request's tokens and pads the tail with -1", cases),
         random_cases(1, lambda k, pick: _slots_case(
             f"random case {k}", 100 + k, q_lens=[pick(0, 30) for _ in range(pick(1, 4))],
             block_size=pick((1, 4, 16, 128)), pad=pick(0, 8))),
         ("slots past 2**31 do not overflow", wide)],
        data=("positions", "out"),
        mistakes=[(INT32_SLOTS, _slots_wrap), (FROM_ZERO, _slots_from_zero)],
        read_mistake=_slots_read, explain=_slots_explain, picture=_slots_picture,
        answer=lambda a: reference_slots_per_request(**a), index_args=("block_table",),
        # The table's ids move by 1,000 as the kernel launches: slots computed before it keep the old ids.
        changes=lambda case, puzzle: dict(block_table=case.args["block_table"] + 1000))


# ------------------------------------------------------ puzzle 2: paged gather

def _gather_case(label, seed, *, seq_len, block_size, heads=2, head_dim=8):
    p = paged_case(seed, lens=[seq_len], heads=heads, kv_heads=heads, head_dim=head_dim,
                   block_size=block_size)
    kc, table = p["key_cache"], p["block_table"][0].clone()
    args = dict(key_cache=kc, block_table=table, seq_len=seq_len)
    n = seq_len * heads * head_dim * F32
    return Case(label, args, reference_gather(kc, table, seq_len),
                may_read=dict(key_cache=p["cache_mask"], block_table=p["table_mask"][0]),
                minimum=2 * n, needs=dict(key_cache=n, out=n),
                info=dict(per_slot=heads * head_dim,
                          one_past=one_past(dict(block_table=table[None]), [seq_len], block_size)))


WHOLE_BLOCK = Mistake(
    "the whole last block",
    "the slots past seq_len in the last block are not the request's, and the output has "
    "seq_len rows, not a whole number of blocks: neither a load nor a store may touch "
    "positions from seq_len on")


OFF_BY_ONE_STORE = Mistake(
    "an off-by-one mask",
    "it stored one row past the output: position seq_len is the first one the request "
    "does not have")


def _puzzle_2():
    cases = [_gather_case("one block", 1, seq_len=2, block_size=4),
             _gather_case("scattered blocks, a partial last block", 2, seq_len=14, block_size=4),
             _gather_case("block size 16", 3, seq_len=21, block_size=16),
             _gather_case("block size 1", 4, seq_len=5, block_size=1)]

    def in_order(c):
        a = c.args
        return reference_gather(a["key_cache"], blocks_in_order(a["block_table"][None],
                                                                a["key_cache"].shape[0])[0], a["seq_len"])

    def picture(case, run):
        kc = run.args["key_cache"]
        return (access_grid(run, case, "key_cache", kc.shape[0] * kc.shape[1], kc.shape[1], "b") +
                "\n(a cell: one block of the K cache, a character per slot)\n" + LEGEND)

    def overrun(case, what):
        one_row = int(what.split()[0]) <= case.info["per_slot"]
        return OFF_BY_ONE_STORE if one_row else WHOLE_BLOCK

    rand = random_cases(2, lambda k, pick: _gather_case(f"random case {k}", 100 + k, seq_len=pick(1, 40),
                                                         block_size=pick((1, 4, 16))))
    return Puzzle("puzzle 2", [("gathers one request's keys in order", cases), rand],
        data=("key_cache", "out"),
                  mistakes=[(IN_ORDER, in_order)], read_mistake=cache_read_mistake,
                  overrun_mistake=overrun, picture=picture, atol=0.0,
                  answer=lambda a: reference_gather(**a), index_args=("block_table",))


# ------------------------------------------------ puzzle 3: one tile, exact

TILE_3 = 32


def reference_attend(q, k, v, scale):
    """softmax(k @ q * scale) @ v for one query: [head_dim]."""
    return torch.softmax(k.float() @ q.float() * scale, 0) @ v.float()


def _attend_case(label, seed, *, n, head_dim=16, big=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(head_dim, generator=g), torch.randn(n, head_dim, generator=g), \
        torch.randn(n, head_dim, generator=g)
    if big:  # scores near 400: exp overflows fp32 unless the max is subtracted first
        q, k = q.sign() * 10.0, k.sign() * 10.0
    scale = head_dim ** -0.5
    args = dict(q=q, k=k, v=v, scale=scale)
    return Case(label, args, reference_attend(q, k, v, scale), minimum=F32 * head_dim * (2 * n + 2),
                info=dict(big=big),
                needs=dict(q=F32 * head_dim, k=F32 * n * head_dim, v=F32 * n * head_dim,
                           out=F32 * head_dim))


NO_MAX = Mistake(
    "the max not subtracted",
    "exp of a score near 400 overflows fp32 (inf / inf = NaN); a softmax is unchanged "
    "when every score moves by the same amount, and moved down by the max no exp exceeds "
    "1")
PAD_SCORES = Mistake(
    "padding lanes scored 0",
    "the lanes past n got score 0, and so a weight exp(0 - m) above 0: a lane that is no "
    "key must weigh exactly nothing, which only a score of -inf gives")
ROW_PAST = Mistake(
    "an off-by-one mask",
    "it read row n of k or v, one past the last: rows 0 to n - 1 exist")
READ_TILE = Mistake(
    "the tile's loads unmasked",
    "k and v have n rows and the tile has TILE lanes: the lanes from n on are no rows of "
    "k or v, and load nothing")


def _puzzle_3():
    cases = [_attend_case("n = 32, a full tile", 1, n=32), _attend_case("n = 5", 2, n=5),
             _attend_case("n = 1", 3, n=1)]
    big = [_attend_case("scores near 400", 4, n=20, big=True)]

    def no_scale(c):
        return reference_attend(c.args["q"], c.args["k"], c.args["v"], 1.0)

    def pad_scores(c):
        a = c.args
        s = a["k"] @ a["q"] * a["scale"]
        s = torch.cat([s, torch.zeros(TILE_3 - s.numel())])
        p = torch.softmax(s, 0)[: a["k"].shape[0]]
        return p @ a["v"]

    def read(case, name, idx):
        if name in ("k", "v"):
            n, d = case.args["k"].shape
            return ROW_PAST if set((idx // d).tolist()) == {n} else READ_TILE
        return None

    def picture(case, run):
        k = run.args["k"]
        grid = access_grid(run, case, "k", k.shape[0], 8, "k")
        return grid + "\n(a cell: 8 rows of k)\n" + LEGEND

    def explain(case, got):
        # NaN with small scores: only the NaN guard rows past n can have put it there
        # (on a GPU, where loads are not traced).
        if not case.info["big"] and isinstance(got, torch.Tensor) and bool(torch.isnan(got.cpu()).any()):
            return READ_TILE
        return None

    return Puzzle("puzzle 3", [
        ("equals the exact softmax for n = 32, 5 and 1", cases),
        random_cases(3, lambda k, pick: _attend_case(f"random case {k}", 100 + k, n=pick(1, 32))),
        ("stays finite with scores near 400", big)],
        data=("q", "k", "v", "out"),
        mistakes=[(NO_SCALE, no_scale), (PAD_SCORES, pad_scores), *scale_models(
            lambda c, s: reference_attend(c.args["q"], c.args["k"], c.args["v"], s))],
        read_mistake=read, explain=explain,
        nan_mistake=NO_MAX, picture=picture, guard_rows=TILE_3,
        answer=lambda a: reference_attend(**a))


# ------------------------------------------------------ puzzle 4: long softmax

def reference_logsumexp(x):
    """log(sum(exp(x))) of each row, in fp32 (-inf for a row of -inf)."""
    return torch.logsumexp(x.float(), 1)


def _lse_case(label, seed, *, rows, n, pad=3, leading_inf=0, all_inf_row=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * 3
    if leading_inf:
        x[0, :leading_inf] = float("-inf")
    if all_inf_row:
        x[-1] = float("-inf")
    wide = torch.full((rows, n + pad), float("nan"))
    wide[:, :n] = x
    mask = torch.zeros(rows, n + pad, dtype=torch.bool)
    mask[:, :n] = True
    return Case(label, dict(x=wide), reference_logsumexp(x), may_read=dict(x=mask),
                minimum=F32 * rows * (n + 1), needs=dict(x=F32 * rows * n, out=F32 * rows),
                views=dict(x=lambda t, n=n: t[:, :n]))


FIRST_TILE = Mistake(
    "the m = -inf case",
    "a row whose first tile is all -inf has m = -inf, and exp(-inf - (-inf)) is NaN: "
    "while the max is still -inf the running sum is 0 and must stay 0, so no exp may be "
    "handed -inf - (-inf)")
PAST_ROW = Mistake(
    "read outside the row",
    "the rows are a slice of a wider buffer: row r starts x.stride(0) elements after row "
    "r - 1, and only its first n_cols entries are the row's")
LOG2_LSE = Mistake(
    "log2 domain",
    "it matches log2(sum(2**x)): the natural log-sum-exp is in base e throughout; base 2 "
    "gives it only with x scaled by log2(e) going in and the result by ln(2) coming out")
LOG2_OF_SUM = Mistake(
    "log2 of the sum",
    "it matches m + log2(l): with exp in base e, the sum l = sum(exp(x - m)) comes back "
    "through the natural log, m + ln(l); log2 belongs only with exp2 and scores in base 2")
NO_MAX_BACK = Mistake(
    "the max not added back",
    "log(sum(exp(x - m))) is the log-sum-exp less m: the max taken out to keep exp finite "
    "must be put back")


def _puzzle_4():
    cases = [_lse_case("3 rows of 50 (4 tiles of 16)", 1, rows=3, n=50),
             _lse_case("rows of 5, shorter than a tile", 2, rows=2, n=5),
             _lse_case("rows of 100", 3, rows=2, n=100)]
    inf = [_lse_case("a row whose first 20 entries are -inf, a row all -inf", 4, rows=3, n=40,
                     leading_inf=20, all_inf_row=True)]

    def log2_lse(c):
        x = c.views["x"](c.args["x"])
        return torch.logsumexp(x * math.log(2), 1) / math.log(2)

    def log2_of_sum(c):  # base e throughout, but log2 at the end
        x = c.views["x"](c.args["x"])
        m = x.max(1).values
        return m + torch.log2(torch.exp(x - m[:, None]).sum(1))

    def falling(c):  # each row's finite entries in falling order (-inf kept in place)
        x = c.args["x"].clone()
        view = c.views["x"](x)
        for row in view:
            finite = torch.isfinite(row)
            row[finite] = row[finite].sort(descending=True).values
        from dataclasses import replace
        return replace(c, label=f"{c.label}, each row in falling order", args=dict(x=x),
                       want=reference_logsumexp(c.views["x"](x)))

    def no_max_back(c):
        x = c.views["x"](c.args["x"])
        return torch.logsumexp(x, 1) - x.max(1).values

    def read(case, name, idx):
        return PAST_ROW if name == "x" else None

    def picture(case, run):
        x = run.args["x"]
        return (access_grid(run, case, "x", x.numel(), x.shape[1], "row") +
                "\n(a cell: a row of x's wider buffer)\n" + LEGEND)

    def explain(case, got):
        # Not finite where the answer is: in a row that starts with -inf, the
        # m = -inf case (NaN, or -inf behind a guard on l); elsewhere, a read
        # of the NaN past the row (seen here on a GPU, where loads are not traced).
        want = case.want
        if isinstance(got, torch.Tensor) and got.shape == want.shape:
            x = case.views["x"](case.args["x"])
            bad = ~torch.isfinite(got.cpu()) & torch.isfinite(want)
            if bool((bad & (x[:, 0] == float("-inf"))).any()):
                return FIRST_TILE
            if bool(bad.any()):  # a row of finite entries: NaN came from outside the row
                return PAST_ROW
        return None

    return Puzzle("puzzle 4", [
        ("log-sum-exp of rows longer than a tile", cases),
        random_cases(4, lambda k, pick: _lse_case(f"random case {k}", 100 + k, rows=pick(1, 3), n=pick(1, 70),
                                                  pad=pick(1, 5))),
        ("rows that start with -inf, and a row all -inf", inf)],
        data=("x", "out"),
        mistakes=[(LOG2_LSE, log2_lse), (NO_MAX_BACK, no_max_back), (LOG2_OF_SUM, log2_of_sum)],
        passes_when=[(NO_RESCALE, falling)], read_mistake=read, explain=explain,
        nan_mistake=FIRST_TILE, picture=picture, answer=lambda a: reference_logsumexp(a["x"]))

# ----------------------------------------------- what the ladder reads

BUILDERS = {1: _puzzle_1, 2: _puzzle_2, 3: _puzzle_3, 4: _puzzle_4}
REFERENCES = {1: reference_slots_per_request, 2: reference_gather, 3: reference_attend,
              4: reference_logsumexp}

#: The small case each puzzle's picture is drawn from.
PICTURES = {
    1: lambda: _slots_case("picture", 7, q_lens=[6, 3, 9], block_size=4, pad=6),
    2: lambda: _gather_case("picture", 7, seq_len=14, block_size=4),
    3: lambda: _attend_case("picture", 7, n=20),
    4: lambda: _lse_case("picture", 7, rows=3, n=16, pad=2),
}

#: The mistakes each puzzle's check names, in the order it tries them.
MISTAKES = {
    1: [OVERRUN_MISTAKE, INT32_SLOTS, FROM_ZERO, QSL_PAST, TOKEN_PAST, TABLE_PAST, NO_PADDING],
    2: [OFF_BY_ONE_STORE, WHOLE_BLOCK, IN_ORDER, TABLE_PAST, OFF_BY_ONE_READ, READ_PAST],
    3: [OVERRUN_MISTAKE, NO_SCALE, PAD_SCORES, *(m for m, _ in SCALE_MISTAKES), ROW_PAST,
        READ_TILE, NO_MAX],
    4: [OVERRUN_MISTAKE, LOG2_LSE, NO_MAX_BACK, LOG2_OF_SUM, PAST_ROW, NO_RESCALE, FIRST_TILE],
}
