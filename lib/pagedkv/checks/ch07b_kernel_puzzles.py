"""Checks for exercises/07b_kernel_puzzles.ipynb: a ladder of Triton puzzles.

Each puzzle is one small kernel behind a wrapper, one idea more than the
last, from vLLM's per-request slot mapping to split-KV. Every puzzle has a
PyTorch reference here (``reference_*``), seeded cases with poison (NaN) in
every element the kernel must not read, and the common mistakes it names.
``check_kernel_puzzle(n, fn)`` prints one line per property;
``trace_kernel_puzzle(n, fn)`` draws what each program read and wrote on a
small case and scores the bytes it moved against the minimum (in Triton's
interpreter; the machinery is ``puzzle_harness``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .._device import default_device
from ..common import cdiv
from ._harness import CheckReport, Mistake, WrongAnswer, catalogue
from .puzzle_harness import (CHEAT_MISTAKE, LAUNCH_MISTAKE, OVERRUN_MISTAKE, LEGEND, Case, Puzzle,
                             Run, access_grid, check_puzzle, trace_report)

__all__ = ["check_kernel_puzzle", "trace_kernel_puzzle", "show_reference", "print_puzzle_mistakes",
           "PUZZLES", "puzzle", "MISTAKES"]

PAD_SLOT_ID = -1
F32 = 4  # bytes per fp32 element


def _wrap32(x: torch.Tensor) -> torch.Tensor:
    return (x + 2**31) % 2**32 - 2**31


# ------------------------------------------------------------ paged cases
# A pool of blocks with the requests' blocks scattered through it; every
# slot no request owns holds NaN, and so do the slots past a request's
# length in its last block. Unused table columns point at poisoned blocks.

def paged_case(seed: int, *, lens, heads=2, kv_heads=2, head_dim=8, block_size=4, free=2,
               spare_columns=1):
    """K/V caches, a block table and the masks of what may be read, for ``lens`` tokens per request."""
    g = torch.Generator().manual_seed(seed)
    need = [cdiv(n, block_size) for n in lens]
    num_blocks = sum(need) + free
    ids = torch.randperm(num_blocks, generator=g).tolist()
    unused = ids[:free]
    ids = ids[free:]
    width = max(need) + spare_columns
    cells = len(lens) * width
    table = torch.tensor(unused * cells, dtype=torch.int32)[:cells].view(len(lens), width).clone()
    shape = (num_blocks, block_size, kv_heads, head_dim)
    kc, vc = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for r, n in enumerate(lens):
        row = ids[: need[r]]
        ids = ids[need[r]:]
        table[r, : need[r]] = torch.tensor(row, dtype=torch.int32)
        for j, b in enumerate(row):
            owned[b, : min(block_size, n - j * block_size)] = True
    kc[~owned], vc[~owned] = float("nan"), float("nan")
    cache_mask = owned[:, :, None, None].expand(shape).clone()
    table_mask = torch.zeros_like(table, dtype=torch.bool)
    for r, k in enumerate(need):
        table_mask[r, :k] = True
    return dict(key_cache=kc, value_cache=vc, block_table=table, need=need, g=g,
                cache_mask=cache_mask, table_mask=table_mask)


def reference_paged_attention(q, key_cache, value_cache, block_table,
                              seq_lens, query_start_loc, scale):
    """Gather each request's K/V through its table row, then causal
    attention, in fp32.

    Request r's queries are ``q[query_start_loc[r]:query_start_loc[r + 1]]``,
    the last of its ``seq_lens[r]`` positions; query head h reads KV head
    ``h // (num_heads // num_kv_heads)``. Returns q's shape and dtype.
    """
    out = torch.zeros_like(q)
    group = q.shape[1] // key_cache.shape[2]
    qsl = query_start_loc.tolist()
    for r in range(len(qsl) - 1):
        n, q_len = int(seq_lens[r]), qsl[r + 1] - qsl[r]
        if q_len == 0:
            continue
        k = reference_gather(key_cache, block_table[r], n).float()
        v = reference_gather(value_cache, block_table[r], n).float()
        k = k.repeat_interleave(group, 1)  # query head h reads h // group
        v = v.repeat_interleave(group, 1)
        qr = q[qsl[r]:qsl[r + 1]].float()  # [q_len, heads, dim]
        s = torch.einsum("qhd,khd->hqk", qr, k) * scale
        q_pos = torch.arange(n - q_len, n)
        hidden = torch.arange(n)[None, None, :] > q_pos[None, :, None]
        p = torch.softmax(s.masked_fill(hidden, float("-inf")), -1)
        out[qsl[r]:qsl[r + 1]] = torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)
    return out


def _in_order(table, num_blocks):
    cols = torch.arange(table.shape[1], dtype=torch.int32).clamp(max=num_blocks - 1)
    return cols.repeat(table.shape[0], 1)


def _cache_read_mistake(case, name, idx):
    """Name a read of a poisoned cache or table element."""
    if name == "block_table":
        return TABLE_PAST
    if name in ("key_cache", "value_cache"):
        info = case.info
        per_slot = info["per_slot"]
        slots = set((idx // per_slot).tolist())
        if slots and slots <= info["one_past"]:
            return OFF_BY_ONE_READ
        return READ_PAST
    return None


TABLE_PAST = Mistake("loads block-table columns past the sequence", "mask the table load with "
                     "pos < seq_len, like the K/V loads: those columns hold garbage ids")
READ_PAST = Mistake("read past seq_len", "the slots past a sequence (the rest of its last "
                    "block, blocks it does not own) hold another request's data, NaN here: "
                    "mask every K/V load with pos < seq_len")
OFF_BY_ONE_READ = Mistake("read past seq_len, at position seq_len", "the only poisoned slot it "
                          "read holds position seq_len: the mask is pos < seq_len (an "
                          "off-by-one pos <= seq_len reads exactly that slot)")
IN_ORDER = Mistake("blocks read in order", "it matches reading blocks 0, 1, 2, ... in order: "
                   "look each position's block up in the table, block_table[r, pos // block_size]")
NO_SCALE = Mistake("no scale", "it matches attention without the scale: multiply the scores by "
                   "`scale`")


def _one_past(case_dict, lens, block_size):
    """The slot (flat, block * block_size + offset) holding position seq_len of each request."""
    out = set()
    for r, n in enumerate(lens):
        if n % block_size:
            out.add(int(case_dict["block_table"][r, n // block_size]) * block_size + n % block_size)
    return out


RANDOM_CASES = 8  # per puzzle, besides the hand-picked ones


def _random(n: int, make) -> tuple:
    """A property of ``RANDOM_CASES`` seeded cases: ``make(k, pick)`` builds case k.

    ``pick(options)`` draws one of ``options`` and ``pick(lo, hi)`` an int in
    ``[lo, hi]``, from a generator seeded by the puzzle number.
    """
    g = torch.Generator().manual_seed(1000 + n)

    def pick(*a):
        if len(a) == 1:
            return a[0][int(torch.randint(len(a[0]), (1,), generator=g))]
        return int(torch.randint(a[0], a[1] + 1, (1,), generator=g))

    return (f"{RANDOM_CASES} random cases", [make(k, pick) for k in range(RANDOM_CASES)])


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
    want[real] = _wrap32(want[real])
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


NO_PADDING = Mistake("the tail not padded", "slot_mapping[num_tokens:max_num_tokens] must hold "
                     "PAD_SLOT_ID (-1): the last program, tl.program_id(0) == tl.num_programs(0) "
                     "- 1, writes it")
INT32_SLOTS = Mistake("int32 wrap", "the block id is int32 and block_id * block_size passes "
                      "2**31: .to(tl.int64) before multiplying")
FROM_ZERO = Mistake("positions counted from the request's start", "a request's tokens continue "
                    "its context: the position is positions[i], not i - query_start_loc[r]")
QSL_PAST = Mistake("the last program reads a request that does not exist", "the grid has "
                   "num_reqs + 1 programs and the last one has no request: it only pads the "
                   "tail; return before loading query_start_loc")
TOKEN_PAST = Mistake("an off-by-one mask", "it read the token after the request's last: "
                     "mask with offsets < end, not <=")


def _slots_read(case, name, idx):
    if name == "block_table":
        return TABLE_PAST
    if name == "query_start_loc":
        return QSL_PAST
    if name == "positions":
        return TOKEN_PAST
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
         _random(1, lambda k, pick: _slots_case(
             f"random case {k}", 100 + k, q_lens=[pick(0, 30) for _ in range(pick(1, 4))],
             block_size=pick((1, 4, 16, 128)), pad=pick(0, 8))),
         ("slots past 2**31 do not overflow", wide)],
        data=("positions", "out"),
        mistakes=[(INT32_SLOTS, _slots_wrap), (FROM_ZERO, _slots_from_zero)],
        read_mistake=_slots_read, explain=_slots_explain, picture=_slots_picture)


# ------------------------------------------------------ puzzle 2: paged gather

def reference_gather(key_cache, block_table, seq_len):
    """One request's keys in position order: [seq_len, heads, head_dim]."""
    bs = key_cache.shape[1]
    ids = block_table[: cdiv(seq_len, bs)].long()
    return key_cache[ids].flatten(0, 1)[:seq_len]


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
                          one_past=_one_past(dict(block_table=table[None]), [seq_len], block_size)))


WHOLE_BLOCK = Mistake("the whole last block", "positions past seq_len are not the request's: "
                      "mask the load and the store with pos < seq_len (the output has seq_len "
                      "rows, not a whole number of blocks)")


OFF_BY_ONE_STORE = Mistake("an off-by-one mask", "it stored one row past the output: the mask "
                           "is pos < seq_len, not pos <= seq_len")


def _puzzle_2():
    cases = [_gather_case("one block", 1, seq_len=2, block_size=4),
             _gather_case("scattered blocks, a partial last block", 2, seq_len=14, block_size=4),
             _gather_case("block size 16", 3, seq_len=21, block_size=16),
             _gather_case("block size 1", 4, seq_len=5, block_size=1)]

    def in_order(c):
        a = c.args
        return reference_gather(a["key_cache"], _in_order(a["block_table"][None],
                                                          a["key_cache"].shape[0])[0], a["seq_len"])

    def picture(case, run):
        kc = run.args["key_cache"]
        return (access_grid(run, case, "key_cache", kc.shape[0] * kc.shape[1], kc.shape[1], "b") +
                "\n(a cell: one block of the K cache, a character per slot)\n" + LEGEND)

    def overrun(case, what):
        one_row = int(what.split()[0]) <= case.info["per_slot"]
        return OFF_BY_ONE_STORE if one_row else WHOLE_BLOCK

    rand = _random(2, lambda k, pick: _gather_case(f"random case {k}", 100 + k, seq_len=pick(1, 40),
                                                    block_size=pick((1, 4, 16))))
    return Puzzle("puzzle 2", [("gathers one request's keys in order", cases), rand],
        data=("key_cache", "out"),
                  mistakes=[(IN_ORDER, in_order)], read_mistake=_cache_read_mistake,
                  overrun_mistake=overrun, picture=picture, atol=0.0)


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


NO_MAX = Mistake("the max not subtracted", "exp of a score near 400 overflows fp32 (inf / inf "
                 "= NaN): subtract the row's max before tl.exp")
PAD_SCORES = Mistake("padding lanes scored 0", "the lanes past n got score 0 and weight "
                     "exp(0 - m): set their scores to -inf with tl.where(pos < n, s, -inf)")
ROW_PAST = Mistake("an off-by-one mask", "it read row n of k or v (a guard row): mask the loads "
                   "with pos < n, not <=")
READ_TILE = Mistake("the tile's loads unmasked", "k and v have n rows; the tile has TILE lanes: "
                    "mask both loads with pos < n")


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
        _random(3, lambda k, pick: _attend_case(f"random case {k}", 100 + k, n=pick(1, 32))),
        ("stays finite with scores near 400", big)],
        data=("q", "k", "v", "out"),
        mistakes=[(NO_SCALE, no_scale), (PAD_SCORES, pad_scores)], read_mistake=read, explain=explain,
        nan_mistake=NO_MAX, picture=picture, guard_rows=TILE_3)


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


FIRST_TILE = Mistake("the m = -inf case", "a row whose first tile is all -inf has m = -inf, and "
                     "exp(-inf - -inf) is NaN: use m_safe = tl.where(m_new == -inf, 0, m_new) "
                     "in both exps")
PAST_ROW = Mistake("read outside the row", "row r starts at r * x.stride(0) (the rows are a "
                   "slice of a wider buffer) and has n_cols columns: mask cols < n_cols")
LOG2_LSE = Mistake("log2 domain", "it matches log2(sum(2**x)): for the natural log-sum-exp "
                   "use tl.exp and tl.log (or scale by log2(e) going in and ln(2) coming out)")
NO_MAX_BACK = Mistake("the max not added back", "log(sum(exp(x - m))) is lse - m: return m + "
                      "log(l)")


def _puzzle_4():
    cases = [_lse_case("3 rows of 50 (4 tiles of 16)", 1, rows=3, n=50),
             _lse_case("rows of 5, shorter than a tile", 2, rows=2, n=5),
             _lse_case("rows of 100", 3, rows=2, n=100)]
    inf = [_lse_case("a row whose first 20 entries are -inf, a row all -inf", 4, rows=3, n=40,
                     leading_inf=20, all_inf_row=True)]

    def log2_lse(c):
        x = c.views["x"](c.args["x"])
        return torch.logsumexp(x * math.log(2), 1) / math.log(2)

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
        _random(4, lambda k, pick: _lse_case(f"random case {k}", 100 + k, rows=pick(1, 3), n=pick(1, 70),
                                             pad=pick(1, 5))),
        ("rows that start with -inf, and a row all -inf", inf)],
        data=("x", "out"),
        mistakes=[(LOG2_LSE, log2_lse), (NO_MAX_BACK, no_max_back)], read_mistake=read, explain=explain,
        nan_mistake=FIRST_TILE, picture=picture)


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
                          one_past=_one_past(p, lens, block_size)))


def _decode_models():
    def in_order(c):
        a = dict(c.args)
        a["block_table"] = _in_order(a["block_table"], a["key_cache"].shape[0])
        kc, vc = a["key_cache"], a["value_cache"]  # NaN where the mistake reads poison
        qsl = torch.arange(a["q"].shape[0] + 1, dtype=torch.int32)
        return reference_paged_attention(a["q"], kc, vc, a["block_table"], a["seq_lens"], qsl, a["scale"])

    def no_scale(c):
        a = c.args
        qsl = torch.arange(a["q"].shape[0] + 1, dtype=torch.int32)
        return reference_paged_attention(a["q"], a["key_cache"], a["value_cache"], a["block_table"], a["seq_lens"],
                          qsl, 1.0)

    return [(IN_ORDER, in_order), (NO_SCALE, no_scale)]


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
        _random(5, lambda k, pick: _decode_case(f"random case {k}", 100 + k,
                                                lens=[pick(1, 40) for _ in range(pick(1, 3))],
                                                block_size=pick((1, 4, 16))))],
        data=("q", "key_cache", "value_cache", "out"),
        mistakes=_decode_models(), read_mistake=_cache_read_mistake,
        nan_mistake=READ_PAST, picture=_decode_picture)


# --------------------------------------------------- puzzle 6: GQA, a group of 3

PADDING_ROWS = Mistake("rows of padding not masked", "with a group of 3 the tile has more rows "
                       "than heads: row g >= GROUP belongs to the next group's first head (or "
                       "lies past q and past the output for the last KV head); mask the q load "
                       "and the store with g < GROUP")
WRONG_HEAD = Mistake("the wrong head of a group", "it matches query head h reading KV head "
                     "h % num_kv_heads: the heads sharing KV head k are k * GROUP .. k * GROUP "
                     "+ GROUP - 1, so h reads h // GROUP")


def _gqa_read(case, name, idx):
    if name == "q":
        return PADDING_ROWS
    return _cache_read_mistake(case, name, idx)


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
    return Puzzle("puzzle 6", [
        ("equals the reference for groups of 3, 4 and 1", cases), _random(6, _random_gqa)],
        data=("q", "key_cache", "value_cache", "out"), mistakes=models,
        read_mistake=_gqa_read, overrun_mistake=PADDING_ROWS, nan_mistake=READ_PAST,
        picture=lambda c, r: _decode_picture(c, r, "(request, KV head)"))


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
                info=dict(per_slot=heads * head_dim, one_past=_one_past(p, lens, block_size)))


NO_CAUSAL = Mistake("no causal mask", "it matches every query seeing every key of its request: "
                    "query i of a chunk sits at q_pos = seq_len - q_len + i and sees keys with "
                    "pos <= q_pos")
FROM_ZERO_Q = Mistake("query positions from 0", "it matches query i at position i: a chunk "
                      "continues its context, q_pos = context_len + i with context_len = "
                      "seq_len - q_len")
SELF_MASKED = Mistake("a query does not see itself", "it matches the mask pos < q_pos: a query "
                      "sees its own key, pos <= q_pos")


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
    return Puzzle("puzzle 7", [
        ("equals causal attention for chunks with and without context", cases),
        _random(7, _random_prefill)],
        data=("q", "key_cache", "value_cache", "out"),
        mistakes=[(NO_CAUSAL, _prefill_model()), (FROM_ZERO_Q, _prefill_model(0, from_zero=True)),
                  (SELF_MASKED, _prefill_model(-1))] + _decode_models()[:1],
        read_mistake=_cache_read_mistake, nan_mistake=READ_PAST, atol=5e-4,
        picture=lambda c, r: _decode_picture(c, r, "(request, head, query tile)"))


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
                info=dict(per_slot=heads * head_dim, one_past=_one_past(p, lens, block_size)))


NATURAL_LSE = Mistake("lse in base e", "it matches the natural log-sum-exp: the merge expects "
                      "base 2, lse2 = m2 + log2(l) with the scores scaled by scale * log2(e) "
                      "(tl.exp2, tl.log2)")
EMPTY_SEGMENT = Mistake("an empty segment", "a split past a short request's last key sees no "
                        "key: l = 0 and m = -inf give NaN; store a partial of 0 and an lse of "
                        "-inf there")
WHOLE_SEQUENCE = Mistake("every split reads the whole sequence", "split s covers positions "
                         "s * seg .. min((s + 1) * seg, seq_len) - 1 only")


def _puzzle_8():
    cases = [_split_case("one split (the plain decode)", 1, lens=[13, 6], num_splits=1),
             _split_case("three splits", 2, lens=[30, 22], num_splits=3),
             _split_case("four splits, short requests with empty segments", 3, lens=[40, 3, 9],
                         num_splits=4)]

    def natural(c):
        partial, lse2 = reference_split_partials(**c.args)
        return partial, lse2 / LOG2E

    def whole(c):
        a = dict(c.args)
        partial, lse = reference_split_partials(**{**a, "num_splits": 1})
        S = a["num_splits"]
        return partial.repeat(S, 1, 1, 1), lse.repeat(S, 1, 1)

    return Puzzle("puzzle 8", [
        ("partials and base-2 lse for 1, 3 and 4 splits, empty segments included", cases),
        _random(8, lambda k, pick: _split_case(f"random case {k}", 100 + k,
                                               lens=[pick(1, 40) for _ in range(pick(1, 3))],
                                               num_splits=pick(1, 5), block_size=pick((1, 4, 16))))],
        data=("q", "key_cache", "value_cache", "out"),
        mistakes=[(NATURAL_LSE, natural), (WHOLE_SEQUENCE, whole)], read_mistake=_cache_read_mistake,
        nan_mistake=EMPTY_SEGMENT, picture=_split_picture, atol=5e-4)


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


EXP_NOT_EXP2 = Mistake("exp where exp2 belongs", "the lse is in base 2: the weights are "
                       "2 ** (lse - max), tl.exp2")
NOT_NORMALISED = Mistake("weights not normalised", "divide the weighted sum by the sum of the "
                         "weights")
MERGE_OVERFLOW = Mistake("the max lse not subtracted", "2 ** 200 overflows fp32 (inf / inf = "
                         "NaN): subtract the largest lse before tl.exp2")


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
        _random(9, lambda k, pick: _merge_case(f"random case {k}", 100 + k, splits=(n := pick(1, 6)),
                                               rows=pick(1, 3), empty=pick(0, n - 1))),
        ("stays finite with lse near 200", big)],
        data=("partial", "lse", "out"), mistakes=[(EXP_NOT_EXP2, exp_e),
                                                                 (NOT_NORMALISED, not_norm)],
        nan_mistake=MERGE_OVERFLOW, picture=picture)


# ------------------------------------------------------ puzzle 10: copy_blocks

def reference_copy_blocks(caches, block_pairs):
    """Copy block src to block dst in every cache (of copies); return them."""
    out = [c.clone() for c in caches]
    for src, dst in block_pairs.tolist():
        for c in out:
            c[dst] = c[src]
    return tuple(out)


def _copy_case(label, seed, *, layers, pairs, num_blocks=8, block_size=4, heads=2, head_dim=4):
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randn(num_blocks, block_size, heads, head_dim, generator=g)
              for _ in range(2 * layers)]
    pairs = torch.tensor(pairs, dtype=torch.int64)
    block = block_size * heads * head_dim * F32
    n = 2 * len(pairs) * 2 * layers * block
    return Case(label, dict(caches=caches, block_pairs=pairs), reference_copy_blocks(caches, pairs),
                minimum=n, needs={f"caches[{i}]": 2 * len(pairs) * block for i in range(2 * layers)})


SWAPPED = Mistake("src and dst swapped", "each pair is (src, dst): read block src, write block dst")
ONE_LAYER = Mistake("one cache only", "every layer's K and V cache is copied: the grid's second "
                    "axis runs over the pointer table, one program per (pair, cache)")
NOT_REFUSED = Mistake("overlapping pairs accepted", "a block that is both a src and a dst (or a "
                      "dst twice) makes the result depend on which program runs first: raise "
                      "ValueError naming the block before launching, and change nothing")


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
                        pairs=[[0, 7], [3, 1], [6, 4]])]

    def swapped(c):
        return reference_copy_blocks(c.args["caches"], c.args["block_pairs"].flip(1))

    def one(c):
        first = reference_copy_blocks(c.args["caches"][:1], c.args["block_pairs"])
        return first + tuple(t.clone() for t in c.args["caches"][1:])

    return Puzzle("puzzle 10", [
        ("copies every pair in every cache, nothing else", cases), _random(10, _random_copy)],
        data=("caches",), mistakes=[(SWAPPED, swapped), (ONE_LAYER, one)],
        result=lambda got, args: tuple(args["caches"]), picture=_copy_picture, atol=0.0,
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


NOT_PADDED = Mistake("the table not padded to 128 tokens", "an unmasked table load of a "
                     "128-key tile names columns up to the tile's end, past the request's "
                     "blocks; only a row at least as wide as the tiles (a multiple of 128 "
                     "tokens, vLLM's get_block_table_width) keeps them inside the row, and "
                     "inside the table for the last row: copy the table into zeros of that width")


def _unmasked_read(case, name, idx):
    if name == "block_table":
        return NOT_PADDED
    return _cache_read_mistake(case, name, idx)


def _puzzle_11():
    def case(label, seed, lens, block_size):
        return _decode_case(label, seed, lens=lens, block_size=block_size, spare_columns=0)

    cases = [case("block size 16: 5 columns, padded to 8", 1, [40, 9, 70], 16),
             case("block size 4: 13 columns, padded to 32", 2, [13, 50], 4),
             case("block size 1: 30 columns, padded to 128", 3, [5, 30], 1),
             case("block size 128: one column, already aligned", 4, [100, 7], 128)]
    rand = _random(11, lambda k, pick: case(f"random case {k}", 100 + k,
                                            [pick(1, 70) for _ in range(pick(1, 3))],
                                            pick((1, 2, 4, 8, 16, 32, 64, 128, 256))))
    return Puzzle("puzzle 11", [("equals the reference, the table loads in bounds", cases), rand],
                  data=("q", "key_cache", "value_cache", "out"), mistakes=_decode_models(),
                  read_mistake=_unmasked_read, tail_read_mistake=NOT_PADDED, nan_mistake=READ_PAST,
                  picture=_decode_picture, guard_rows=TOKEN_ALIGNMENT)


# ----------------------------------------------------------------- the ladder

_BUILDERS = {1: _puzzle_1, 2: _puzzle_2, 3: _puzzle_3, 4: _puzzle_4, 5: _puzzle_5, 6: _puzzle_6,
             7: _puzzle_7, 8: _puzzle_8, 9: _puzzle_9, 10: _puzzle_10, 11: _puzzle_11}
PUZZLES = tuple(sorted(_BUILDERS))
_built: dict = {}

#: The small case each puzzle's picture is drawn from.
_PICTURE = {
    1: lambda: _slots_case("picture", 7, q_lens=[6, 3, 9], block_size=4, pad=6),
    2: lambda: _gather_case("picture", 7, seq_len=14, block_size=4),
    3: lambda: _attend_case("picture", 7, n=20),
    4: lambda: _lse_case("picture", 7, rows=3, n=16, pad=2),
    5: lambda: _decode_case("picture", 7, lens=[7, 5], block_size=4),
    6: lambda: _decode_case("picture", 7, lens=[7, 5], heads=6, kv_heads=2, head_dim=16),
    7: lambda: _prefill_case("picture", 7, lens=[9, 6], q_lens=[4, 6]),
    8: lambda: _split_case("picture", 7, lens=[9, 3], num_splits=3),
    9: lambda: _merge_case("picture", 7, splits=3, empty=1),
    10: lambda: _copy_case("picture", 7, layers=2, pairs=[[0, 7], [3, 1]]),
    11: lambda: _decode_case("picture", 7, lens=[7, 5], block_size=4, spare_columns=0),
}


def puzzle(n: int) -> Puzzle:
    """Puzzle ``n``'s spec (built once)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be an int, got {type(n).__name__} {n!r}")
    if n not in _BUILDERS:
        raise ValueError(f"there is no puzzle {n}: the puzzles are {list(PUZZLES)}")
    if n not in _built:
        _built[n] = _BUILDERS[n]()
    return _built[n]


def check_kernel_puzzle(n: int, fn, timeout: float = 60.0) -> CheckReport:
    """Check your wrapper for puzzle ``n``: one line per property."""
    return check_puzzle(puzzle(n), fn, timeout)


_REFERENCES = {1: "reference_slots_per_request", 2: "reference_gather", 3: "reference_attend",
               4: "reference_logsumexp", 5: "reference_paged_attention",
               6: "reference_paged_attention", 7: "reference_paged_attention",
               8: "reference_split_partials", 9: "reference_merge", 10: "reference_copy_blocks",
               11: "reference_table_width"}


def show_reference(n: int) -> None:
    """Print the PyTorch reference puzzle ``n``'s kernel must equal (its source)."""
    import inspect

    puzzle(n)  # the same argument check
    print(inspect.getsource(globals()[_REFERENCES[n]]).rstrip())


def trace_kernel_puzzle(n: int, fn) -> None:
    """Print what each program of your kernel read and wrote, and the bytes it moved."""
    puzzle(n)
    print(trace_report(puzzle(n), fn, _PICTURE[n]()))


#: The mistakes each puzzle's check names, in the order it tries them.
MISTAKES = {
    1: [OVERRUN_MISTAKE, INT32_SLOTS, FROM_ZERO, QSL_PAST, TOKEN_PAST, TABLE_PAST, NO_PADDING],
    2: [OFF_BY_ONE_STORE, WHOLE_BLOCK, IN_ORDER, TABLE_PAST, OFF_BY_ONE_READ, READ_PAST],
    3: [OVERRUN_MISTAKE, NO_SCALE, PAD_SCORES, ROW_PAST, READ_TILE, NO_MAX],
    4: [OVERRUN_MISTAKE, LOG2_LSE, NO_MAX_BACK, PAST_ROW, FIRST_TILE],
    5: [OVERRUN_MISTAKE, IN_ORDER, NO_SCALE, TABLE_PAST, OFF_BY_ONE_READ, READ_PAST],
    6: [PADDING_ROWS, IN_ORDER, NO_SCALE, WRONG_HEAD, TABLE_PAST, OFF_BY_ONE_READ, READ_PAST],
    7: [OVERRUN_MISTAKE, NO_CAUSAL, FROM_ZERO_Q, SELF_MASKED, IN_ORDER, TABLE_PAST, OFF_BY_ONE_READ,
        READ_PAST],
    8: [OVERRUN_MISTAKE, NATURAL_LSE, WHOLE_SEQUENCE, TABLE_PAST, OFF_BY_ONE_READ, READ_PAST,
        EMPTY_SEGMENT],
    9: [OVERRUN_MISTAKE, EXP_NOT_EXP2, NOT_NORMALISED, MERGE_OVERFLOW],
    10: [OVERRUN_MISTAKE, SWAPPED, ONE_LAYER, NOT_REFUSED],
    11: [OVERRUN_MISTAKE, NOT_PADDED, IN_ORDER, NO_SCALE, OFF_BY_ONE_READ, READ_PAST],
}


def print_puzzle_mistakes(width: int = 79) -> None:
    """Print, puzzle by puzzle, the mistakes its check names (and, for all, two more)."""
    import textwrap

    for n, mistakes in MISTAKES.items():
        print(f"puzzle {n}:")
        for m in mistakes:
            print(textwrap.fill(m.diagnosis(), width, initial_indent="- ", subsequent_indent="  "))
    print("every puzzle:")
    for m in (LAUNCH_MISTAKE, CHEAT_MISTAKE):
        print(textwrap.fill(m.diagnosis(), width, initial_indent="- ", subsequent_indent="  "))


catalogue(check_kernel_puzzle, *MISTAKES.values(), [LAUNCH_MISTAKE, CHEAT_MISTAKE])
