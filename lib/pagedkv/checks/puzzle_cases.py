"""What the kernel puzzles of exercise 7b share: paged K/V cases with poison, their
reference attention, the read mistakes they name, and seeded random cases.

The puzzles themselves are ``ch07b_first_kernels`` (1-4) and ``ch07b_paged_kernels``
(5-11); ``ch07b_kernel_puzzles`` is the ladder the notebook calls.
"""

from __future__ import annotations

import torch

from ..common import cdiv
from ._harness import Mistake


PAD_SLOT_ID = -1
F32 = 4  # bytes per fp32 element


def wrap32(x: torch.Tensor) -> torch.Tensor:
    return (x + 2**31) % 2**32 - 2**31


def reference_gather(key_cache, block_table, seq_len):
    """One request's keys in position order: [seq_len, heads, head_dim]."""
    bs = key_cache.shape[1]
    ids = block_table[: cdiv(seq_len, bs)].long()
    return key_cache[ids].flatten(0, 1)[:seq_len]


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


def blocks_in_order(table, num_blocks):
    cols = torch.arange(table.shape[1], dtype=torch.int32).clamp(max=num_blocks - 1)
    return cols.repeat(table.shape[0], 1)


def cache_read_mistake(case, name, idx):
    """Name a read of a poisoned cache or table element."""
    if name == "block_table":
        return TABLE_PAST
    if name in ("key_cache", "value_cache"):
        if stride_read(case, name, idx):
            return KV_STRIDE
        info = case.info
        per_slot = info["per_slot"]
        slots = set((idx // per_slot).tolist())
        if slots and slots <= info["one_past"]:
            return OFF_BY_ONE_READ
        return READ_PAST
    return None


TABLE_PAST = Mistake(
    "loads block-table columns past the sequence",
    "the columns past a request's last block hold garbage ids, and for the longest "
    "request lie past the row or past the table: a table load is bound by the sequence, "
    "as the K/V loads are")
READ_PAST = Mistake(
    "read past seq_len",
    "the slots past a sequence (the rest of its last block, blocks it does not own) hold "
    "another request's data, NaN here; a score masked to -inf gives p = 0, but 0 x NaN is "
    "NaN, so the K and V loads themselves never reach past seq_len")
OFF_BY_ONE_READ = Mistake(
    "read past seq_len, at position seq_len",
    "the only poisoned slot it read holds position seq_len, the first position the "
    "request does not have")
IN_ORDER = Mistake(
    "blocks read in order",
    "it matches reading physical blocks 0, 1, 2, ... in order: logical block j of a "
    "request lives wherever its table row says, not in physical block j")
NO_SCALE = Mistake(
    "no scale",
    "it matches attention with unscaled scores: softmax(q . k) is not softmax(q . k x "
    "scale), and the caller's scale belongs on every score")


def one_past(case_dict, lens, block_size):
    """The slot (flat, block * block_size + offset) holding position seq_len of each request."""
    out = set()
    for r, n in enumerate(lens):
        if n % block_size:
            out.add(int(case_dict["block_table"][r, n // block_size]) * block_size + n % block_size)
    return out


RANDOM_CASES = 8  # per puzzle, besides the hand-picked ones


def random_cases(n: int, make) -> tuple:
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


# ------------------------------------------------- the numerics the book teaches
# A wrong scale, a missing rescale and a mixed-up logarithm give answers as
# plausible as the right one. A wrong scale is recognised by its model (the
# reference at that scale); a missing rescale by a variant of the case on
# which it makes no difference (keys whose scores fall, so the running max
# never moves) and which the kernel then answers right.

LN2 = 0.6931471805599453
LOG2E_ = 1.0 / LN2

SCALE_MISTAKES = [
    (Mistake("the scale squared (1/head_dim)",
             "it matches scores scaled by 1/head_dim, the caller's scale squared: every "
             "score takes the caller's scale once, as given (1/sqrt(head_dim) here)"),
     lambda scale, d: 1.0 / d),
    (Mistake("sqrt(head_dim) for its inverse",
             "it matches scores multiplied by sqrt(head_dim): the scale divides the dot "
             "product by sqrt(head_dim); use the caller's scale as given"),
     lambda scale, d: d ** 0.5),
    (Mistake("exp2 without log2(e)",
             "it matches a softmax of the scores times ln(2): exp2(x) is exp(x ln 2), so "
             "base 2 gives the same softmax only when the scores are first multiplied by "
             "log2(e) (fold it into the scale)"),
     lambda scale, d: scale * LN2),
    (Mistake("log2(e) with exp",
             "it matches a softmax of the scores times log2(e): that factor belongs with "
             "exp2, which undoes it; with exp the scores take the scale alone"),
     lambda scale, d: scale * LOG2E_),
]

#: exp2 of the scores times ln 2 where log2(e) belongs: the natural log of 2
#: taken for the base-2 log of e, so the scale is off by ln(2)**2.
LN2_FOR_LOG2E = (
    Mistake("ln(2) where log2(e) belongs",
            "it matches exp2 of the scores times ln(2) = 0.693: exp2(x) is exp(x ln 2), so "
            "the factor that makes exp2 give exp's softmax is its inverse, log2(e) = "
            "1/ln(2) = 1.4427 (fold it into the scale)"),
    lambda scale, d: scale * LN2 * LN2)

NO_RESCALE = Mistake(
    "the running max not rescaled",
    "it is right when every key scores lower than the one before (the first tile holds "
    "the max) and wrong otherwise: when the running max rises from m to m_new, what was "
    "summed so far was weighed against the old max, so the running sum (and the "
    "accumulator) must be multiplied by exp(m - m_new) before the new tile is added")

KV_STRIDE = Mistake(
    "a K/V row stride from num_heads",
    "it reads slot * num_heads + kv_head: a slot of the cache holds num_kv_heads heads, "
    "not num_heads, so its row is slot * num_kv_heads + kv_head; with a group larger "
    "than 1 the offsets run past the slots and past the cache itself")


def scale_models(reference_at) -> list:
    """``(Mistake, model)`` for each wrong scale; ``reference_at(case, scale)`` answers at a scale."""
    def model(f):
        return lambda c: reference_at(c, f(c.args["scale"], c.args["q"].shape[-1]))
    return [(m, model(f)) for m, f in SCALE_MISTAKES]


def _replace(case, args, want):
    from dataclasses import replace
    return replace(case, label=f"{case.label}, keys scoring ever lower", args=args, want=want)


def falling_scores(answer):
    """``variant(case)``: the paged case with every request's scores falling with position.

    Key ``pos`` of request r, KV head k, is ``q * (1 - pos / seq_len)`` for
    the query of the group's first head (every head of a group gets that
    query): the scores fall, so the first tile holds every running max.
    ``answer(args)`` is the reference on the new arguments.
    """
    def make(case):
        a = falling_score_args(case.args)
        return None if a is None else _replace(case, a, answer(a))
    return make


def falling_score_args(args: dict) -> dict | None:
    """``args`` (a decode step's) with every request's scores falling with position (see ``falling_scores``).

    ``None`` for a prefill chunk (more query rows than requests).
    """
    a = dict(args)
    q, kc = a["q"].clone(), a["key_cache"].clone()
    kv_heads, bs = kc.shape[2], kc.shape[1]
    group = q.shape[-2] // kv_heads
    table, lens = a["block_table"], a["seq_lens"]
    rows = q.shape[0]
    if rows != len(lens):  # a prefill chunk: not this variant
        return None
    for r in range(rows):
        n = int(lens[r])
        for kh in range(kv_heads):
            lead = q[r, kh * group].clone()
            q[r, kh * group:(kh + 1) * group] = lead
            for pos in range(n):
                b = int(table[r, pos // bs])
                kc[b, pos % bs, kh] = (lead * (1.0 - pos / max(n, 1))).to(kc.dtype)
    a.update(q=q, key_cache=kc)
    return a


def stride_read(case, name, idx) -> bool:
    """Whether the poisoned reads ``idx`` of a cache are those of rows ``slot * num_heads + kv_head``."""
    if name not in ("key_cache", "value_cache"):
        return False
    a = case.args
    heads, (nb, bs, kvh, d) = a["q"].shape[-2], a[name].shape
    if heads == kvh or "block_table" not in a or "seq_lens" not in a:
        return False
    reads = set()
    for r in range(len(a["seq_lens"])):
        for pos in range(int(a["seq_lens"][r])):
            slot = int(a["block_table"][r, pos // bs]) * bs + pos % bs
            for k in range(kvh):
                row = (slot * heads + k) * d
                reads.update(range(row, row + d))
    return bool(idx.size) and set(idx.tolist()) <= reads


def stray_stride_mistake(case, bounds):
    """KV_STRIDE when the lanes stopped out of bounds are a cache's rows read with too wide a
    stride: they run past the cache's end and lie nearest whatever tensor the allocator put
    there, so they are judged by the caches' own indices, not by what lies closest."""
    if bounds.bad is None:
        return None
    for name in ("key_cache", "value_cache"):
        if name in bounds.named and stride_read(case, name, bounds.flat_of(name)):
            return KV_STRIDE
    return None


# ------------------------------------------------- mistakes every puzzle can make

UNMASKED_MISTAKE = Mistake("an unmasked load or store", "a tile's lanes past the data are "
                           "addresses too, and these lay outside every tensor the kernel was "
                           "handed: the interpreter would have crashed (the check stopped it "
                           "first), and a GPU reads or overwrites whatever lies there. Every "
                           "live lane must stay inside its tensor")
SMALL_DOT_MISTAKE = Mistake("a tl.dot the GPU compiler refuses", "the interpreter multiplies "
                            "any shapes, but Triton's compiled target needs the inner dimension "
                            "K of [M, K] x [K, N] to be at least 16 (32 for 8-bit types); M "
                            "and N may be smaller, Triton pads them")
INT32_INDEX_MISTAKE = Mistake("int32 index arithmetic", "a block id (or pair) loaded as int32 "
                              "and multiplied in int32 wraps once the product passes 2**31: a "
                              "pool's element offsets get there long before its block ids do "
                              "(2**31 fp32 elements are 8 GiB). Every product of an index must "
                              "be computed in int64")
READS_A_COPY = Mistake("reads what the wrapper computed", "the inputs took new values as the "
                       "kernel launched, and the output answers neither the old inputs nor the "
                       "new: the kernel reads something the wrapper computed from them before "
                       "launching. Hand the kernel the inputs themselves (a copy, a conversion "
                       "or a padded copy is fine; arithmetic belongs in the kernel)")


def ln_of_sum_split(a):
    """Puzzle 8's lse as ``m + ln(l)`` with ``m`` and ``l`` in base 2 (the partials are not needed)."""
    seg = cdiv(int(a["seq_lens"].max()), a["num_splits"])
    out = torch.full((a["num_splits"], *a["q"].shape[:2]), float("-inf"))
    for r in range(a["q"].shape[0]):
        n = int(a["seq_lens"][r])
        k = reference_gather(a["key_cache"], a["block_table"][r], n).float()
        for split in range(a["num_splits"]):
            lo, hi = split * seg, min((split + 1) * seg, n)
            if lo < hi:
                s2 = torch.einsum("hd,khd->hk", a["q"][r].float(), k[lo:hi]) * a["scale"] * LOG2E_
                m = s2.max(-1).values
                out[split, r] = m + torch.log(torch.exp2(s2 - m[:, None]).sum(-1))
    return out
