"""Checks for exercises/07_paged_attention.ipynb.

The learner writes a decode kernel in Triton behind a wrapper:

* ``decode_attention(q, key_cache, value_cache, block_table, seq_lens, scale)
  -> out``: ``q`` is ``[num_reqs, num_heads, head_dim]``, one new token per
  request, at the last position of its sequence; the caches are block-major
  ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``block_table`` int32
  ``[num_reqs, max_blocks]``; ``seq_lens`` int32 ``[num_reqs]``. Returns an
  output shaped like ``q``, in q's dtype.

The cases are random pools with scattered tables, lengths that are not
multiples of the block size, GQA ratios 1, 2, 3 and 4, block sizes 1, 4 and
16, fp32 and bf16. The group of 3 (SmolLM2's 9 query heads over 3 KV heads)
is the one case where the tile's ``GROUP_P2`` rows include padding: ``q`` is
handed over as a view with poisoned guard rows after it, the buffers the
function allocates get a guarded tail (``guarded_allocations``), and a query
row of padding loaded (traced in the interpreter) or stored (seen on any
device) past the group is named. The bf16 case is also run in fp32 when it
fails: right in fp32 and wrong in bf16 means the arithmetic was not done in
fp32 (in the interpreter bf16 values are raw 16-bit integers to numpy).
Every slot the kernel must not read is *poison*, NaN, +inf and -inf in turn:
the slots past ``seq_len`` in a request's last block, the free blocks, and the
blocks behind every unused table column (valid ids, so a stray read never
leaves the cache). A read of poison cannot hide: a score masked to -inf gives
p = 0, but 0 x NaN is still NaN. A NaN output is then diagnosed by running the
same case with the poison replaced by zeros: if that answer is right (or
matches a named mistake), the NaN came from reading past ``seq_len``.

The block table is a view into a larger buffer with a guard row after it. In
Triton's interpreter (on a CPU) every load is traced, and a load of a table
column past a request's last block (a column the sequence does not reach, or
past the row, or past the table) is named even though the kernel discards
the value: our kernel promises never to read past the sequence, and the
exercise asks the same (vLLM's loads the table unmasked and relies on its
padding). Compiled on a GPU, loads cannot be traced; that property then checks
the values only.

A wrong output is compared with the answers of the common mistakes (reading
blocks in order instead of through the table, attending to the whole last
block, the wrong KV head for a query head, no scale, a wrong scale or a
mixed-up base of exp2 and exp) so that the hint names the mistake; one that
none explains is rerun with keys that score ever lower (the first tile holds
every maximum), and right there names a running max not rescaled.

One case puts two requests' blocks past id 2**22 in a pool of 2**31+
elements: offsets computed in int32 wrap there. The pool is an anonymous
mapping reserved with MAP_NORESERVE, so only the few blocks written take
memory; in the interpreter the wrapped address is stopped before the load
and named. Compiled on a GPU the case is not run (a wrapped address there is
an illegal access that ends the CUDA context). Finally, the function is run once more with every Triton launch
skipped and its fresh buffers poisoned: an answer that is still right was
computed by PyTorch, not by the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._device import default_device
from ..common import cdiv
from ..kernels.attention import paged_attention_ref
from ._harness import Checker, CheckReport, Mistake, NotRun, WrongAnswer, catalogue
from .interpreter_probes import bounded_accesses, dot_minimum, dot_shapes
from .interpreter_probes import index_products
from .kernel_probes import (count_triton_launches, guarded_allocations, guarded_copy, guarded_rows,
                            inputs_changed_at_launch, interpreted, loads_in, skipped_triton_launches,
                            traced_loads)
from .puzzle_cases import LN2_FOR_LOG2E, NO_RESCALE, SCALE_MISTAKES, falling_score_args

__all__ = ["check_decode_attention", "TABLE_MISTAKE", "PADDING_MISTAKE", "BF16_MISTAKE"]

#: What the poisoned slots hold, element by element in turn.
POISON = (float("nan"), float("inf"), float("-inf"))


def _poison_like(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(POISON).repeat(cdiv(x.numel(), len(POISON)))[: x.numel()].view_as(x)


def _case(seed, *, num_reqs=3, heads=4, kv_heads=2, head_dim=16, block_size=16, max_len=70,
          dtype=torch.float32, scale=None):
    """A decode step: scattered blocks; poison in every slot the kernel must not read.

    Besides the kernel's arguments, ``need`` (each request's number of blocks,
    the table columns it may read) and ``poison`` (a ``[num_blocks,
    block_size]`` mask of the poisoned slots).
    """
    g = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(1, max_len + 1, (num_reqs,), generator=g)]
    need = [cdiv(n, block_size) for n in lens]
    num_free = 2
    num_blocks = sum(need) + num_free + 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    kc, vc = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    # Block 0 (vLLM's null block, and where a masked table load's other=0 points) is free, so
    # poisoned: a K/V load left unmasked behind a masked table load reads it.
    ids = [0] + (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    poison = torch.ones(num_blocks, block_size, dtype=torch.bool)  # cleared where a request's token sits
    unused = ids[: num_free + 2]  # unused columns point at these: free blocks, all poison
    ids = ids[num_free + 2:]
    table = torch.tensor(unused).repeat(max(need) + 2)[: num_reqs * (max(need) + 2)]
    table = table.view(num_reqs, max(need) + 2).to(torch.int32)
    for r in range(num_reqs):
        table[r, : need[r]] = torch.tensor(ids[: need[r]], dtype=torch.int32)
        for j, block in enumerate(ids[: need[r]]):
            poison[block, : min(block_size, lens[r] - j * block_size)] = False
        ids = ids[need[r]:]
    kc[poison], vc[poison] = _poison_like(kc[poison]), _poison_like(vc[poison])
    q = torch.randn(num_reqs, heads, head_dim, generator=g)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    return dict(q=q, key_cache=kc, value_cache=vc, block_table=table,
                seq_lens=torch.tensor(lens, dtype=torch.int32),
                scale=head_dim ** -0.5 if scale is None else scale, need=need, poison=poison)


def _cleaned(case) -> dict:
    """The same case with zeros instead of poison."""
    clean = dict(case)
    for name in ("key_cache", "value_cache"):
        clean[name] = case[name].clone()
        clean[name][case["poison"]] = 0.0
    return clean


def _reference(case, *, in_order=False, whole_blocks=False, wrong_group=False, scale=None,
               scale_of=None):
    """The right answer, or the answer of one named mistake.

    ``scale_of(scale, head_dim)``: the scale a mistake uses instead of the caller's.
    """
    q, kc, vc, table, lens = case["q"], case["key_cache"], case["value_cache"], case["block_table"], case["seq_lens"]
    bs = kc.shape[1]
    if in_order:  # block j of every request read from physical block j, ignoring the table
        table = torch.arange(table.shape[1], dtype=torch.int32).repeat(table.shape[0], 1)
        table = table.clamp(max=kc.shape[0] - 1)
    if whole_blocks:
        lens = ((lens + bs - 1) // bs) * bs
    if scale == "1/sqrt(d)":  # the scale hard-coded
        scale = q.shape[2] ** -0.5
    if scale_of is not None:
        scale = scale_of(case["scale"], q.shape[2])
    if wrong_group:  # query head h read from KV head h % num_kv_heads
        rep = q.shape[1] // kc.shape[2]
        kc, vc = kc.repeat(1, 1, rep, 1), vc.repeat(1, 1, rep, 1)
    n = q.shape[0]
    qsl = torch.arange(n + 1, dtype=torch.int32)
    return paged_attention_ref(q, kc, vc, table, lens.to(torch.int32), qsl,
                               case["scale"] if scale is None else scale)


def _in_fp32(case) -> dict:
    """The same case in fp32 (a bf16 case's values, exactly)."""
    return {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in case.items()}


def _close(a, b) -> bool:
    # bf16 keeps 8 bits of mantissa: a right answer rounded to bf16 is within
    # one unit of the last place (0.4 % relative) of the reference.
    tol = 2e-2 if torch.bfloat16 in (a.dtype, b.dtype) else 2e-3
    return a.shape == b.shape and bool(torch.allclose(a.float().cpu(), b.float().cpu(), atol=tol, rtol=tol))


MISTAKES = [
    (dict(in_order=True), Mistake(
        "blocks read in order", "it matches reading physical blocks 0, 1, 2, ... in order: logical "
        "block j of a request lives wherever its table row says, not in physical block j")),
    (dict(whole_blocks=True), Mistake(
        "every slot of the last block", "it matches attending to every slot of the last block: the "
        "slots from seq_len on hold someone else's data, and a request sees only its own seq_len "
        "positions")),
    (dict(wrong_group=True), Mistake(
        "the wrong KV head", "it matches query head h reading KV head h % num_kv_heads: the query "
        "heads that share KV head k are consecutive, k * group to k * group + group - 1")),
    (dict(scale=1.0), Mistake(
        "no scale", "it matches attention with unscaled scores: the caller's scale belongs on "
        "every score")),
    (dict(scale="1/sqrt(d)"), Mistake(
        "the scale hard-coded", "it matches a scale of 1/sqrt(head_dim) where the caller passed "
        "another: the scale is the caller's choice (a model may set its own, and vLLM passes it "
        "in), so the kernel uses the one it is given")),
    # A wrong scale (squared, inverted) and a base mixed up (exp2 without log2(e), log2(e)
    # with exp, ln 2 for log2(e)): each is the softmax at another scale.
    *((dict(scale_of=f), m) for m, f in (*SCALE_MISTAKES, LN2_FOR_LOG2E)),
]
READ_PAST = Mistake(
    "read past seq_len",
    "NaN/inf from the poisoned slots reached the output, and with zeros there the answer "
    "is right: a score masked to -inf gives p = 0, but 0 x NaN is NaN (and on a GPU those "
    "slots hold whatever a previous request left), so the K and V loads themselves never "
    "reach past seq_len")
READ_POISON = Mistake(
    "read past seq_len",
    "NaN/inf from the poisoned slots (past seq_len, behind unused table columns, in free "
    "blocks) reached the output: no K or V load may reach a slot the request does not own")
FIRST_TILE = Mistake(
    "the online softmax's first tile",
    "the output has NaN/inf even with no poison in the cache: before the first real score "
    "the running max is -inf, and exp(-inf - (-inf)) is NaN; the recurrence must start "
    "from m = -inf, l = 0 without ever computing that")
TABLE_MISTAKE = Mistake(
    "loads block-table columns past the sequence",
    "a table column past the request's last block holds a garbage id, and may lie past "
    "the row or past the whole table: a table load is bound by the sequence, as the K/V "
    "loads are")
PADDING_MISTAKE = Mistake(
    "rows of padding not masked",
    "with a group of 3 the tile has GROUP_P2 = 4 rows and the 4th is padding: its head "
    "index is the next group's first head, or lies past q and past the output for the "
    "last KV head, so that row neither loads nor stores")
OVERRUN_MISTAKE = Mistake(
    "stores past the output",
    "a store reached past the end of the output: every stored lane must be a row and head "
    "that exists")
BF16_MISTAKE = Mistake(
    "arithmetic in bf16",
    "the same case in fp32 is right: the arithmetic (scores, m, l, acc) must run in fp32 "
    "whatever the inputs' dtype, and only the stored output is bf16 (in the interpreter "
    "bf16 values are raw 16-bit integers, so bf16 arithmetic is garbage there; on a GPU "
    "it loses precision)")
UNMASKED_MISTAKE = Mistake(
    "an unmasked load or store", "a tile's lanes past the data are addresses too, and these lay "
    "outside every tensor the kernel was handed: the interpreter would have crashed (the check "
    "stopped it first), and a GPU reads or overwrites whatever lies there")
SMALL_DOT_MISTAKE = Mistake(
    "a tl.dot the GPU compiler refuses", "the interpreter multiplies any shapes, but Triton's "
    "compiled target needs the inner dimension K of [M, K] x [K, N] to be at least 16: the "
    "head_dim for the scores, the key tile for p @ V (M, the rows, may be fewer)")
COPIED_MISTAKE = Mistake(
    "an answer copied, not computed", "the kernel copied a result computed before it ran: every "
    "output value must come from the kernel's own loads of q, K and V")
CHEAT_MISTAKE = Mistake(
    "computed outside the kernel",
    "the kernel must produce the output: the wrapper's job is to allocate it and launch, "
    "and every output value comes from the kernel's own loads of q, K and V")


def _named(case, got) -> str | None:
    for kwargs, mistake in MISTAKES:
        if _close(got, _reference(case, **kwargs)):
            return mistake.diagnosis()
    return None


def _right_in_fp32(fn, case) -> bool:
    """Whether ``fn`` answers the fp32 copy of a (bf16) case right."""
    fp32 = _in_fp32(case)
    try:
        return _close(_run(fn, fp32, _Log()), _reference(fp32))
    except Exception:  # noqa: BLE001 -- a learner's bug in the rerun names nothing
        return False


def _diagnose(fn, case, got) -> str | None:
    """Name the mistake; for a NaN output, rerun the case with zeros in place of the poison.

    A bf16 case that fails is first rerun in fp32: right there means the
    arithmetic was done in bf16.
    """
    if case["q"].dtype == torch.bfloat16 and _right_in_fp32(fn, case):
        return BF16_MISTAKE.diagnosis()
    if bool(torch.isfinite(got.float()).all()):
        return _named(case, got) or _right_when_scores_fall(fn, case)
    clean = _cleaned(case)
    got_clean = _run(fn, clean, _Log())
    if not bool(torch.isfinite(got_clean.float()).all()):
        return FIRST_TILE.diagnosis()
    named = _named(clean, got_clean)
    if named:
        return f"{READ_POISON.name} ({named})"
    if _close(got_clean, _reference(clean)):
        return READ_PAST.diagnosis()
    return READ_POISON.diagnosis()


def _right_when_scores_fall(fn, case) -> str | None:
    """NO_RESCALE when ``fn`` is right on the case with every request's scores falling.

    The keys are made to score ever lower, so the first tile holds each row's
    maximum and the running max never rises after it: a kernel that forgets to
    rescale the sum or the accumulator when it rises is right there, and wrong
    where the maximum arrives later.
    """
    fallen = falling_score_args(case)
    if fallen is None:
        return None
    try:
        right = _close(_run(fn, fallen, _Log()), _reference(fallen))
    except Exception:  # noqa: BLE001 -- a crash on the variant names nothing
        return None
    return NO_RESCALE.diagnosis() if right else None


# ---------------------------------------------------- a pool past 2**31 elements
INT32_OFFSETS = Mistake(
    "int32 offsets overflow",
    "block ids past 2**31 / (block_size x num_kv_heads x head_dim) put a slot's element "
    "offset past 2**31, and the product computed in int32 wraps to a negative offset, an "
    "address before the cache: a block id is small, but what it is multiplied by is not, "
    "so every product that makes an address is computed in int64 (8 GiB of fp32 is such "
    "a pool)")

#: The large case's shape: a block holds 16 x 2 x 16 = 512 elements, so block ids from
#: 2**22 on start past element 2**31.
_BIG = dict(block_size=16, kv_heads=2, head_dim=16, heads=4, first_id=2 ** 22)


def _reserved(numel: int) -> torch.Tensor:
    """An fp32 tensor of ``numel`` zeros whose memory is reserved, not taken.

    An anonymous private mapping with MAP_NORESERVE: a page takes memory only
    when written, and pages never written read as zeros. The check writes a
    few blocks of a pool of 8 GiB, and a right kernel reads only those.
    """
    import mmap

    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
    return torch.frombuffer(mmap.mmap(-1, numel * 4, flags=flags), dtype=torch.float32)


def _big_case(seed: int) -> dict:
    """Two requests whose blocks have ids past ``2**22``, in one K/V pool of 2**31+ elements.

    K and V share the pool (V = K: attention is still attention), so the
    mapping is 8 GiB of address space, of which a few KiB are written. Also
    ``small``: the same step on a compact pool (the used blocks only), for
    the reference.
    """
    bs, kvh, d, top = _BIG["block_size"], _BIG["kv_heads"], _BIG["head_dim"], _BIG["first_id"]
    g = torch.Generator().manual_seed(seed)
    lens = [37, 20]
    need = [cdiv(n, bs) for n in lens]
    num_blocks = top + 2 * sum(need) + 8
    pool = _reserved(num_blocks * bs * kvh * d).view(num_blocks, bs, kvh, d)
    ids = (top + 1 + torch.randperm(2 * sum(need) + 6, generator=g)[: sum(need)]).tolist()
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    small_table = torch.zeros_like(table)
    small = torch.zeros(sum(need), bs, kvh, d)
    k = 0
    for r, n in enumerate(need):
        for j in range(n):
            table[r, j], small_table[r, j] = ids[k], k
            small[k] = torch.randn(bs, kvh, d, generator=g)
            pool[ids[k]] = small[k]
            k += 1
    q = torch.randn(len(lens), _BIG["heads"], d, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    step = dict(q=q, block_table=table, seq_lens=seq_lens, scale=d ** -0.5)
    return dict(step, key_cache=pool, value_cache=pool, need=need,
                small=dict(step, key_cache=small, value_cache=small, block_table=small_table,
                           need=need))


def _past_2_31(fn, seed: int) -> None:
    """Run ``fn`` on ``_big_case``; name an int32 offset that wrapped (interpreter only).

    Compiled on a GPU the case is not run: a wrapped offset there is an
    illegal address, which ends the process's CUDA context rather than
    raising; the interpreter stops the access before it happens.
    """
    if not interpreted():
        raise NotRun("compiled on a GPU a wrapped offset is an illegal address, which "
                     "ends the process's CUDA context; the interpreter (a CPU) runs it")
    case = _big_case(seed)
    args = {k: case[k].clone() if k in ("q", "block_table", "seq_lens") else case[k]
            for k in ("q", "key_cache", "value_cache", "block_table", "seq_lens", "scale")}
    first = min(int(x) for row, n in zip(case["block_table"], case["need"]) for x in row[:n])
    where = (f"block ids from {first:,} in a pool of {case['key_cache'].shape[0]:,} blocks "
             f"(element offsets past 2**31)")
    with bounded_accesses(args) as bounds, \
            index_products({"block_table": args["block_table"]}) as found:
        try:
            got = fn(**args)
        except Exception as exc:  # noqa: BLE001 -- a stray address is named; anything else is the learner's
            if bounds.violation is None:
                raise
            also = f"; {found[0]}" if found else ""
            raise WrongAnswer(f"{where}: {bounds.violation}{also}", INT32_OFFSETS.diagnosis()) from exc
    want = _reference(case["small"])
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        raise AssertionError(f"{where}: expected a tensor shaped {tuple(want.shape)}")
    if not _close(got, want):  # wrapped into another tensor, or a mistake small pools show too
        raise WrongAnswer(f"{where}: the output differs from the reference"
                          + (f" ({found[0]})" if found else ""),
                          INT32_OFFSETS.diagnosis() if found else
                          _named(case["small"], got) or _right_when_scores_fall(fn, case["small"]))


def _table_reads_past(case, view, addresses) -> str | None:
    """The first traced table load past a request's last block, described (``None``: none)."""
    need = case["need"]
    for row, col in loads_in(addresses, view).tolist():
        if not 0 <= row < len(need):
            return f"it loaded the table's memory past its last row (row {row}, column {col})"
        if col >= need[row]:
            return (f"it loaded block-table column {col} of request {row}, whose sequence "
                    f"({int(case['seq_lens'][row])} tokens) ends in column {need[row] - 1}")
    return None


@dataclass
class _Log:
    """What the probes saw, call after call."""

    launches: list[int] = field(default_factory=list)  # Triton launches per call
    table_reads: list[str] = field(default_factory=list)  # table columns loaded past a sequence
    past_q: list[str] = field(default_factory=list)  # query rows loaded past q (this call: last entry)
    overruns: list[str] = field(default_factory=list)  # stores past a buffer the call allocated


def _run(fn, case, log: _Log):
    """Run ``fn`` on device copies of ``case``, its table and q guarded views; record what it touched.

    The table and q sit between guard rows; the buffers ``fn`` allocates get
    a guarded tail. ``log`` receives the launches, the table loads past a
    sequence, the loads of q's guard row after it (interpreter only) and the
    stores past an allocated buffer, each call's as one entry.
    """
    dev = default_device()
    args = {k: (case[k].to(dev, copy=True) if isinstance(case[k], torch.Tensor) else case[k])
            for k in ("key_cache", "value_cache", "seq_lens", "scale")}
    # The guard row after the table points at a poisoned block too: a stray read stays in the cache.
    args["block_table"] = guarded_rows(case["block_table"], guard=int(case["block_table"][0, -1]))
    # q's guard rows hold NaN: a row of padding loaded past the last head reads it.
    args["q"] = guarded_copy(case["q"])
    with count_triton_launches() as launches, traced_loads() as addresses, \
            guarded_allocations() as allocs, dot_shapes() as dots, bounded_accesses(args) as bounds:
        try:
            got = fn(**args)
        except Exception as exc:  # noqa: BLE001 -- a stray lane is named; anything else is the learner's
            if bounds.violation is None:
                raise
            raise WrongAnswer(bounds.violation, UNMASKED_MISTAKE.diagnosis()) from exc
    for d in dots:
        m, n, k = dot_minimum(d.bits)
        if d.m < m or d.n < n or d.k < k:
            raise WrongAnswer(f"a tl.dot of {d} has K = {d.k}: Triton's compiled target needs "
                              f"K >= {k}", SMALL_DOT_MISTAKE.diagnosis())
    log.launches.append(launches.count)
    seen = _table_reads_past(case, args["block_table"], addresses)
    if seen:
        log.table_reads.append(seen)
    q_rows = loads_in(addresses, args["q"].view(args["q"].shape[0], -1))
    past = int((q_rows[:, 0] >= args["q"].shape[0]).sum()) if len(q_rows) else 0
    log.past_q.append(f"it loaded {past} element(s) of q past its last head" if past else "")
    over = allocs.overruns()
    log.overruns.append(f"it wrote {over[0]}" if over else "")
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"expected a torch.Tensor, got {type(got).__name__}")
    if got.shape != case["q"].shape:
        raise AssertionError(f"expected q's shape {tuple(case['q'].shape)}, got {tuple(got.shape)}")
    if got.dtype != case["q"].dtype:
        raise AssertionError(f"expected q's dtype {case['q'].dtype}, got {got.dtype}")
    return got


def _past_the_group(case, log: _Log) -> None:
    """Raise when the last call loaded q past its end or stored past an allocation."""
    what = [w for w in (log.overruns[-1], log.past_q[-1]) if w]
    if not what:
        return
    heads, kv_heads = case["q"].shape[1], case["key_cache"].shape[2]
    group = heads // kv_heads
    padded = group & (group - 1) != 0
    mistake = PADDING_MISTAKE if padded else OVERRUN_MISTAKE
    raise WrongAnswer(f"{'; '.join(what)} (groups of {group} query heads)", mistake.diagnosis())


def _follows_its_inputs(fn, case) -> None:
    """q, K and V take new values as the kernel launches: the output must answer the new ones."""
    dev = default_device()
    g = torch.Generator().manual_seed(4242)
    args = {k: (case[k].to(dev, copy=True) if isinstance(case[k], torch.Tensor) else case[k])
            for k in ("q", "key_cache", "value_cache", "block_table", "seq_lens", "scale")}
    new = dict(case)
    for name in ("q", "key_cache", "value_cache"):
        fresh = torch.randn(case[name].shape, generator=g).to(case[name].dtype)
        keep = ~torch.isfinite(case[name])  # the poison stays where it was
        fresh[keep] = case[name][keep]
        new[name] = fresh
    with inputs_changed_at_launch([(args[k], new[k]) for k in ("q", "key_cache", "value_cache")]), \
            bounded_accesses(args) as bounds:
        try:
            got = fn(**args)
        except Exception as exc:  # noqa: BLE001 -- as in _run
            if bounds.violation is None:
                raise
            raise WrongAnswer(bounds.violation, UNMASKED_MISTAKE.diagnosis()) from exc
    if not isinstance(got, torch.Tensor) or _close(got, _reference(new)):
        return
    if _close(got, _reference(case)):
        raise WrongAnswer("q, K and V took new values as the kernel launched, and the output still "
                          "answers the old ones", COPIED_MISTAKE.diagnosis())
    # Merely wrong (the lines above say how) when it answers the new values handed over as such.
    fresh = {k: (new[k].to(dev, copy=True) if isinstance(new[k], torch.Tensor) else new[k])
             for k in ("q", "key_cache", "value_cache", "block_table", "seq_lens", "scale")}
    try:
        own = fn(**fresh)
    except Exception:  # noqa: BLE001 -- it cannot tell: say what was seen
        own = None
    if isinstance(own, torch.Tensor) and _close(got, own):
        return
    raise WrongAnswer("q, K and V took new values as the kernel launched, and the output answers "
                      "neither the old values nor the new", COPIED_MISTAKE.diagnosis())


def _without_kernels(fn, case) -> None:
    """Run with every launch skipped and fresh buffers poisoned: a right answer is PyTorch's."""
    dev = default_device()
    args = {k: (case[k].to(dev, copy=True) if isinstance(case[k], torch.Tensor) else case[k])
            for k in ("q", "key_cache", "value_cache", "block_table", "seq_lens", "scale")}
    with skipped_triton_launches():
        got = fn(**args)
    if isinstance(got, torch.Tensor) and _close(got, _reference(case)):
        raise WrongAnswer("with every Triton launch skipped, it still returned the right output: "
                          "PyTorch computed it, not your kernel", CHEAT_MISTAKE.diagnosis())


def check_decode_attention(decode_attention, seed: int = 0, timeout: float = 120.0) -> CheckReport:
    """Run ``decode_attention`` on scattered paged caches against the reference.

    ``timeout`` bounds each property, in seconds (the interpreter is slow; a
    hang stops the whole check after one timeout).
    """
    fn = decode_attention
    log = _Log()
    with Checker("decode attention", timeout=timeout) as c:
        def first():
            _run(fn, _case(seed, num_reqs=1, kv_heads=2, max_len=16), log)

        if not c.prop("runs and returns a tensor shaped like q", first):
            if "not implemented yet" in c.report.results[-1].detail:
                return c.report  # the stub: one line, no recipe of hints

        def case_prop(**shape):
            def body():
                for i in range(2):
                    case = _case(seed * 100 + i, **shape)
                    try:
                        got = _run(fn, case, log)
                    except Exception as exc:  # noqa: BLE001 -- named if fp32 works
                        if case["q"].dtype == torch.bfloat16 and _right_in_fp32(fn, case):
                            raise WrongAnswer(f"case {i}: raised {type(exc).__name__} on bf16 input "
                                              f"({str(exc)[:120]})", BF16_MISTAKE.diagnosis()) from exc
                        raise
                    _past_the_group(case, log)
                    if not _close(got, _reference(case)):
                        finite = bool(torch.isfinite(got.float()).all())
                        raise WrongAnswer(f"case {i} ({case['q'].shape[0]} requests, block size "
                                          f"{case['key_cache'].shape[1]}): the output "
                                          f"{'differs from the reference' if finite else 'has NaN/inf'}",
                                          _diagnose(fn, case, got))
            return body

        hint = "compare one request by hand with the chapter's gather-then-attend reference"
        c.prop("one request, one block", case_prop(num_reqs=1, max_len=16, block_size=16), hint)
        c.prop("scattered tables, lengths not multiples of the block size",
               case_prop(num_reqs=4, block_size=16, max_len=90), hint)
        c.prop("block size 1 (a token-level table)", case_prop(num_reqs=3, block_size=1, max_len=40), hint)
        c.prop("grouped-query attention, 4 query heads per KV head",
               case_prop(num_reqs=3, heads=8, kv_heads=2, max_len=50), hint)
        c.prop("GQA ratio 1 (multi-head attention)", case_prop(num_reqs=3, heads=2, kv_heads=2, max_len=50), hint)
        c.prop("a group of 3 query heads, padded to 4 rows (SmolLM2: 9 over 3 KV heads)",
               case_prop(num_reqs=3, heads=9, kv_heads=3, max_len=50), hint)
        c.prop("a scale the caller chooses (0.3, not 1/sqrt(head_dim))",
               case_prop(num_reqs=3, heads=8, kv_heads=2, max_len=50, scale=0.3), hint)
        c.prop("bf16 q and caches (output in bf16)",
               case_prop(num_reqs=3, heads=8, kv_heads=4, max_len=50, dtype=torch.bfloat16), hint)

        def table_loads():
            case_prop(num_reqs=3, block_size=4, max_len=30)()
            if log.table_reads:
                raise WrongAnswer(f"{log.table_reads[0]} ({len(log.table_reads)} call(s) read past a sequence)",
                                  TABLE_MISTAKE.diagnosis())

        c.prop("never loads a block-table column past the sequence", table_loads)
        c.prop("block ids past 2**22: element offsets past 2**31 (a pool of 8 GiB)",
               lambda: _past_2_31(fn, seed), hint)

        def launched():
            if not log.launches or min(log.launches) == 0:
                raise AssertionError("no Triton kernel ran in some call: the attention must be computed "
                                     "by a @triton.jit kernel launched as kernel[grid](...)")
            _without_kernels(fn, _case(seed + 7, num_reqs=2, max_len=20))
            _follows_its_inputs(fn, _case(seed + 7, num_reqs=2, max_len=20))

        c.prop("computes in a Triton kernel", launched)
    return c.report


catalogue(check_decode_attention, [m for _, m in MISTAKES],
          [READ_PAST, READ_POISON, FIRST_TILE, NO_RESCALE, TABLE_MISTAKE, INT32_OFFSETS, PADDING_MISTAKE,
           OVERRUN_MISTAKE, BF16_MISTAKE, UNMASKED_MISTAKE, SMALL_DOT_MISTAKE, CHEAT_MISTAKE, COPIED_MISTAKE])
