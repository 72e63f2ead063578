"""Checks for exercises/07_paged_attention.ipynb.

The learner writes a decode kernel in Triton behind a wrapper:

* ``decode_attention(q, key_cache, value_cache, block_table, seq_lens, scale)
  -> out``: ``q`` is ``[num_reqs, num_heads, head_dim]``, one new token per
  request, at the last position of its sequence; the caches are block-major
  ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``block_table`` int32
  ``[num_reqs, max_blocks]``; ``seq_lens`` int32 ``[num_reqs]``. Returns an
  output shaped like ``q``.

The cases are random pools with scattered tables, lengths that are not
multiples of the block size, GQA ratios 1 and 4, block sizes 1 and 16. Table
columns past a request's blocks point at *poison* blocks (valid ids whose K/V
are huge), so a kernel that reads past ``seq_len`` gets a wrong answer instead
of a lucky one, without ever leaving the cache. A wrong output is compared with
the answers of the common mistakes (reading blocks in order instead of through
the table, attending to the whole last block, the wrong KV head for a query
head, no scale) so that the hint names the mistake.
"""

from __future__ import annotations

import torch

from .._device import default_device
from ..kernels.attention import paged_attention_ref
from ._harness import Checker, CheckReport
from ._triton_launches import count_triton_launches
from ..common import cdiv

__all__ = ["check_decode_attention"]

POISON = 1e4


def _case(seed, *, num_reqs=3, heads=4, kv_heads=2, head_dim=16, block_size=16, max_len=70):
    """A decode step: scattered blocks, poison blocks behind every unused table column."""
    g = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(1, max_len + 1, (num_reqs,), generator=g)]
    need = [cdiv(n, block_size) for n in lens]
    num_poison = 2
    num_blocks = sum(need) + num_poison + 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    kc, vc = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    ids = torch.randperm(num_blocks, generator=g).tolist()
    poison, ids = ids[:num_poison], ids[num_poison:]
    kc[poison], vc[poison] = POISON, POISON
    table = torch.tensor(poison[0]).repeat(num_reqs, max(need) + 2).to(torch.int32)
    for r in range(num_reqs):
        table[r, : need[r]] = torch.tensor(ids[: need[r]], dtype=torch.int32)
        ids = ids[need[r]:]
        # Slots past seq_len inside the last block are poison too.
        last, used = int(table[r, need[r] - 1]), lens[r] - (need[r] - 1) * block_size
        kc[last, used:], vc[last, used:] = POISON, POISON
    q = torch.randn(num_reqs, heads, head_dim, generator=g)
    dev = default_device()
    return dict(q=q.to(dev), key_cache=kc.to(dev), value_cache=vc.to(dev), block_table=table.to(dev),
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), scale=head_dim ** -0.5)


def _reference(case, *, in_order=False, whole_blocks=False, wrong_group=False, scale=None):
    """The right answer, or the answer of one named mistake."""
    c = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    q, kc, vc, table, lens = c["q"], c["key_cache"], c["value_cache"], c["block_table"], c["seq_lens"]
    bs = kc.shape[1]
    if in_order:  # block j of every request read from physical block j, ignoring the table
        table = torch.arange(table.shape[1], dtype=torch.int32).repeat(table.shape[0], 1)
        table = table.clamp(max=kc.shape[0] - 1)
    if whole_blocks:
        lens = ((lens + bs - 1) // bs) * bs
    if wrong_group:  # query head h read from KV head h % num_kv_heads
        rep = q.shape[1] // kc.shape[2]
        kc, vc = kc.repeat(1, 1, rep, 1), vc.repeat(1, 1, rep, 1)
    n = q.shape[0]
    qsl = torch.arange(n + 1, dtype=torch.int32)
    return paged_attention_ref(q, kc, vc, table, lens.to(torch.int32), qsl,
                               c["scale"] if scale is None else scale)


def _close(a, b) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.float().cpu(), b.float().cpu(), atol=2e-3, rtol=2e-3))


def _diagnose(case, got) -> str:
    mistakes = [
        (dict(in_order=True), "it matches reading blocks 0, 1, 2, ... in order: look each position's "
                              "block up in the table, block_table[r, pos // block_size]"),
        (dict(whole_blocks=True), "it matches attending to every slot of the last block: mask the "
                                  "positions >= seq_len (their slots hold someone else's data)"),
        (dict(wrong_group=True), "it matches query head h reading KV head h % num_kv_heads: the "
                                 "group of query heads sharing KV head k is k*group .. k*group+group-1"),
        (dict(scale=1.0), "it matches attention without the scale: multiply the scores by `scale`"),
    ]
    for kwargs, hint in mistakes:
        if _close(got, _reference(case, **kwargs)):
            return hint
    if not bool(torch.isfinite(got.float()).all()):
        return "the output has NaN/inf: guard the online softmax's first tile (max of -inf)"
    if float(got.float().abs().max()) > POISON / 10:
        return ("values near the poison (1e4) reached the output: you read K/V past seq_len "
                "(unused table columns or slots past the end)")
    return "compare one request by hand with the chapter's gather-then-attend reference"


def _run(fn, case, launches_seen: list[int]):
    args = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    with count_triton_launches() as launches:
        got = fn(**args)
    launches_seen.append(launches.count)
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"expected a torch.Tensor, got {type(got).__name__}")
    if got.shape != case["q"].shape:
        raise AssertionError(f"expected q's shape {tuple(case['q'].shape)}, got {tuple(got.shape)}")
    return got


def check_decode_attention(decode_attention, seed: int = 0) -> CheckReport:
    """Run ``decode_attention`` on scattered paged caches against the reference."""
    launches: list[int] = []
    with Checker("decode attention", timeout=120) as c:
        def first():
            _run(decode_attention, _case(seed, num_reqs=1, kv_heads=2, max_len=16), launches)

        if not c.prop("runs and returns a tensor shaped like q", first):
            if "not implemented yet" in c.report.results[-1].detail:
                return c.report  # the stub: one line, no recipe of hints

        def case_prop(**shape):
            def body():
                for i in range(2):
                    case = _case(seed * 100 + i, **shape)
                    got = _run(decode_attention, case, launches)
                    if not _close(got, _reference(case)):
                        raise AssertionError(_diagnose(case, got))
            return body

        c.prop("one request, one block", case_prop(num_reqs=1, max_len=16, block_size=16))
        c.prop("scattered tables, lengths not multiples of the block size",
               case_prop(num_reqs=4, block_size=16, max_len=90))
        c.prop("block size 1 (a token-level table)", case_prop(num_reqs=3, block_size=1, max_len=40))
        c.prop("grouped-query attention, 4 query heads per KV head",
               case_prop(num_reqs=3, heads=8, kv_heads=2, max_len=50))
        c.prop("GQA ratio 1 (multi-head attention)", case_prop(num_reqs=3, heads=2, kv_heads=2, max_len=50))

        def launched():
            if not launches or min(launches) == 0:
                raise AssertionError("no Triton kernel ran in some call: the attention must be computed "
                                     "by a @triton.jit kernel launched as kernel[grid](...)")

        c.prop("computes in a Triton kernel", launched)
    return c.report
