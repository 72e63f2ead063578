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
