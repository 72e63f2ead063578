"""Exercise 7 part 2, "change the split count and measure": programs and bytes of a split launch.

The reader writes a split policy, ``num_splits_for(seq_lens, num_kv_heads) ->
int``, the count ``paged_attention(..., num_splits=...)`` takes, predicts
what it does to the library's launch on the notebook's decode batch, then
the check measures it: the library plans the launch (``plan_attention``)
and its kernels run in Triton's interpreter, on any machine, while every
live lane of every load and store is attributed to the tensor it touches.
Measured, never computed from a formula:

* ``programs``: the split kernel's grid, ``(work, kv_heads, splits)``;
* ``empty_programs``: programs whose segment holds no key (they still
  launch, store an empty partial, and weigh nothing in the merge);
* ``kv_bytes``: K and V bytes loaded;
* ``extra_bytes``: data bytes (q, K, V, partials, lse, out; index tensors
  apart) moved beyond what the same batch moves with one split.
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.attention import paginate, paged_attention_ref
from ..kernels.attention_kernel import kernel_launches
from ..kernels.attention_plan import plan_attention, split_segments
from ..kernels.residency import MAX_SPLITS
from ._harness import Checker, CheckReport, Mistake, WrongAnswer, fit_column
from .kernel_probes import interpreted_kernel, traced_accesses

__all__ = ["SPLIT_WORKLOAD", "decode_batch", "measure_splits", "check_split_policy", "KEYS"]

#: The notebook's decode batch: one long request, one medium, one short.
SPLIT_WORKLOAD = dict(seq_lens=(200, 40, 7), num_heads=8, num_kv_heads=2, head_dim=32, block_size=16)
KEYS = ("programs", "empty_programs", "kv_bytes", "extra_bytes")
_DATA = ("q", "key_cache", "value_cache", "out", "partials", "lse")


def decode_batch(seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    """A seeded decode batch on a shuffled paged cache: q, K, V caches, table, lens, query_start_loc."""
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=g) for n in seq_lens]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=g) for n in seq_lens]
    kc, vc, table, lens = paginate(keys, values, block_size)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g)
    return q, kc, vc, table, lens, torch.arange(len(seq_lens) + 1, dtype=torch.int32)


def _traced_run(launches, names: dict) -> dict:
    """Run ``launches`` interpreted; bytes loaded and stored per named tensor."""
    regions = []
    for _, _, args, _ in launches:
        for a in args:
            if torch.is_tensor(a) and all(a.data_ptr() != r[0] for r in regions):
                lo = a.data_ptr()
                regions.append((lo, lo + a.numel() * a.element_size(), names.get(lo, "index"),
                                a.element_size()))
    with traced_accesses(any_machine=True) as accesses:
        for kernel, grid, args, kwargs in launches:
            interpreted_kernel(kernel)[grid](*args, **kwargs)
    tally: dict = {}
    for access in accesses:
        for lo, hi, name, size in regions:
            n = int(((access.addresses >= lo) & (access.addresses < hi)).sum())
            if n:
                tally[access.kind, name] = tally.get((access.kind, name), 0) + n * size
    return tally


def _measure_raw(num_splits: int, workload: dict) -> dict:
    w = workload
    q, kc, vc, table, lens, qsl = decode_batch(w["seq_lens"], w["num_heads"], w["num_kv_heads"], w["head_dim"],
                                         w["block_size"])
    plan = plan_attention(w["num_heads"], w["num_kv_heads"], [1] * len(lens), lens.tolist(), num_splits,
                          head_dim=w["head_dim"], dtype=torch.float32, block_size=w["block_size"])
    out = torch.empty_like(q)
    launches = kernel_launches(plan, q, kc, vc, table, lens, qsl, w["head_dim"] ** -0.5, out,
                               interpreted=True)
    names = {q.data_ptr(): "q", kc.data_ptr(): "key_cache", vc.data_ptr(): "value_cache",
             out.data_ptr(): "out"}
    if num_splits > 1:  # the split kernel's scratch, known by its shape: partials and their lse
        for a in launches[0][2]:
            if torch.is_tensor(a) and a.dim() == 4 and a.shape[0] == num_splits:
                names[a.data_ptr()] = "partials"
            elif torch.is_tensor(a) and tuple(a.shape) == (num_splits, *q.shape[:2]):
                names[a.data_ptr()] = "lse"
    tally = _traced_run(launches, names)
    right = bool(torch.allclose(out, paged_attention_ref(q, kc, vc, table, lens, qsl, w["head_dim"] ** -0.5),
                                atol=1e-4))
    empty = sum(lo >= hi for n in lens.tolist() for lo, hi in split_segments(n, num_splits, plan.tile_n))
    return dict(programs=int(np.prod(plan.grid)), empty_programs=empty * w["num_kv_heads"],
                kv_bytes=sum(v for (kind, name), v in tally.items() if name in ("key_cache", "value_cache")),
                data_bytes=sum(v for (kind, name), v in tally.items() if name in _DATA),
                tally=tally, right=right, tile_n=plan.tile_n)


def measure_splits(num_splits: int, workload: dict | None = None) -> dict:
    """The four measured figures (``KEYS``) of ``num_splits`` on ``workload`` (the notebook's by default)."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) \
            or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int from 1 to {MAX_SPLITS}, got {num_splits!r}")
    w = SPLIT_WORKLOAD if workload is None else workload
    got = _measure_raw(int(num_splits), w)
    base = got if num_splits == 1 else _measure_raw(1, w)
    return dict(programs=got["programs"], empty_programs=got["empty_programs"], kv_bytes=got["kv_bytes"],
                extra_bytes=got["data_bytes"] - base["data_bytes"], right=got["right"], tile_n=got["tile_n"])


PROGRAMS = Mistake("the grid's axes", "the split kernel launches one program per (request, KV head, "
                   "split): every split of every KV head of every request is a program")
EMPTY_ROUNDING = Mistake("segments of whole tiles", "a segment is cdiv(seq_len, splits) rounded up to "
                         "whole TILE_N tiles, so a short request's later splits start past its end")
EMPTY_HEADS = Mistake("one empty program per KV head", "an empty segment is empty for every KV head: "
                      "each is its own program")
KV_SPLITS = Mistake("K/V read once", "the segments partition the keys: each K and V row is loaded by "
                    "exactly one split, whatever their number")
KV_BLOCKS = Mistake("masked lanes move nothing", "the slots past seq_len in a last block are masked: "
                    "only seq_len rows per request are loaded")
EXTRA_ROUND_TRIP = Mistake("the partials' round trip", "each split stores a partial and its lse, and "
                           "the merge loads every one of them back")
EXTRA_Q = Mistake("q read by every split", "each split's program loads its group's q rows again")


def _guesses(p: int, m1: dict, got: dict, w: dict) -> dict:
    """What each named mistake would have predicted (for naming a wrong prediction)."""
    n, kvh, d = len(w["seq_lens"]), w["num_kv_heads"], w["head_dim"]
    part = n * w["num_heads"] * (d + 1) * 4  # one split's partials and lse, bytes
    q = n * w["num_heads"] * d * 4
    seg_plain = [[(s * -(-L // p), min((s + 1) * -(-L // p), L)) for s in range(p)] for L in w["seq_lens"]]
    return dict(
        programs=[(p * kvh, PROGRAMS), (p * n, PROGRAMS), (n * kvh, PROGRAMS)],
        empty_programs=[(kvh * sum(lo >= hi for segs in seg_plain for lo, hi in segs), EMPTY_ROUNDING),
                        (got["empty_programs"] // kvh, EMPTY_HEADS)],
        kv_bytes=[(m1["kv_bytes"] * p, KV_SPLITS),
                  (sum(-(-L // w["block_size"]) * w["block_size"] for L in w["seq_lens"]) * kvh * d * 8,
                   KV_BLOCKS)],
        extra_bytes=[(0, EXTRA_ROUND_TRIP), (p * part if p > 1 else 0, EXTRA_ROUND_TRIP),
                     (2 * p * part if p > 1 else 0, EXTRA_Q), ((p - 1) * q, EXTRA_ROUND_TRIP)])


def check_split_policy(num_splits_for, predicted, timeout: float = 120.0) -> CheckReport:
    """Measure the reader's split policy on the notebook's batch; compare the prediction, figure by figure."""
    w = SPLIT_WORKLOAD
    with Checker("your split policy, measured", timeout=timeout) as c:
        c.probe(lambda: num_splits_for(list(w["seq_lens"]), w["num_kv_heads"]))
        chosen: dict = {}

        def policy():
            p = num_splits_for(list(w["seq_lens"]), w["num_kv_heads"])
            if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or not 1 <= p <= MAX_SPLITS:
                raise AssertionError(f"the policy must return an int from 1 to {MAX_SPLITS}, got {p!r}")
            chosen["p"] = int(p)
            chosen["got"] = measure_splits(int(p))
            chosen["one"] = measure_splits(1)
            if not chosen["got"]["right"]:
                raise AssertionError("the library's output differs with this split count (a library bug)")

        if not c.prop("your policy gives a split count the library takes", policy):
            return c.report
        p, got = chosen["p"], chosen["got"]
        print(f"   measured at num_splits={p}:")
        print(fit_column("   " + ", ".join(f"{k} {got[k]:,}" for k in KEYS)))

        def prediction():
            if predicted is None:
                raise AssertionError("predicted is None: write your prediction first, then run the check")
            if not isinstance(predicted, dict) or set(predicted) != set(KEYS):
                raise AssertionError(f"predicted must be a dict with the keys {KEYS}, got {predicted!r}")
            guesses = _guesses(p, chosen["one"], got, w)
            wrong = []
            for k in KEYS:
                if predicted[k] == got[k]:
                    continue
                named = next((m for v, m in guesses[k] if v == predicted[k] and v != got[k]), None)
                wrong.append(f"{k}: you predicted {predicted[k]!r}, measured {got[k]:,}"
                             + (f" ({named.name}: {named.fix})" if named else ""))
            if wrong:
                raise WrongAnswer("; ".join(wrong), None)

        c.prop("your prediction matches the measurement, figure by figure", prediction)
    return c.report
