"""Checks for exercises/05_slot_mapping.ipynb.

The learner first computes the slot mapping in numpy (``slot_mapping_numpy``,
checked by ``check_slot_mapping_numpy`` at the end of this module), then
writes two Triton kernels, each behind a small Python wrapper:

* ``slot_mapping(block_table, req_indices, positions, block_size) -> torch.Tensor``:
  ``block_table`` an ``[num_rows, max_blocks]`` int32 tensor, ``req_indices``
  and ``positions`` int64 tensors of one entry per token (``-1`` = padding),
  all on ``pagedkv.default_device()``; returns one int64 slot per token.
* ``kv_write(key, value, key_cache, value_cache, slot_mapping) -> None``:
  writes each token's ``[num_kv_heads, head_dim]`` key and value into the
  block-major caches ``[num_blocks, block_size, num_kv_heads, head_dim]`` at its
  slot, in place, skipping slot -1.

The checks run the learner's kernels (compiled on a GPU, in Triton's
interpreter on a CPU) on seeded random tables and compare them with the
library's references (``pagedkv.kernels.compute_slot_mapping_ref``,
``reshape_and_cache_ref``) and with token-by-token oracles written here.

Both exercises are about writing the kernel: every call is wrapped in
``count_triton_launches`` and a property requires that a Triton kernel ran.
A padding token must not read the block table at all, not even a value it
then discards: in Triton's interpreter (on a CPU) every load is traced, and a
read of the guard rows around the table (where a padding token's unmasked
load lands) fails the padding property. Compiled on a GPU, loads cannot be
traced, and the property checks the values only. Wrong slots are named as in
the numpy task (``diagnose_slots``); wrong cache contents are compared with the
common mistakes (off by one slot, K and V swapped, one head copied, the dtype
converted).
"""

from __future__ import annotations

import torch

import numpy as np

from .._device import default_device
from ..kernels.kv_write import reshape_and_cache_ref
from ..kernels.slot_mapping import compute_slot_mapping_ref
from ._harness import Checker, CheckReport, Mistake, WrongAnswer, catalogue
from .kernel_probes import (GUARD_BLOCK_ID, count_triton_launches, guarded_rows, loads_in,
                            skipped_triton_launches, traced_loads)
from .slot_mistakes import SLOT_MISTAKES, diagnose_slots
from ..common import cdiv
from .ch05_tasks import check_both_kernels, check_slot_prediction  # noqa: E402 -- the prediction, both kernels
from .ch05_gather import check_gather_block_tables, check_gather_kernel, check_gathered_slot_mapping  # noqa: E402

__all__ = ["check_gather_block_tables", "check_gather_kernel", "check_gathered_slot_mapping",
           "check_slot_mapping_numpy", "check_slot_mapping_kernel",
           "check_kv_write_kernel", "check_slot_prediction", "check_both_kernels"]

BLOCK_SIZES = (1, 8, 16, 32, 128)


def _slot_oracle(table: torch.Tensor, reqs: torch.Tensor, positions: torch.Tensor, block_size: int) -> list[int]:
    t = table.cpu().tolist()
    return [
        -1 if r == -1 else t[r][p // block_size] * block_size + p % block_size
        for r, p in zip(reqs.cpu().tolist(), positions.cpu().tolist())
    ]


def _random_slot_case(g: torch.Generator, block_size: int, num_tokens: int | None = None):
    rows = int(torch.randint(1, 6, (1,), generator=g))
    width = int(torch.randint(1, 9, (1,), generator=g))
    table = torch.randperm(rows * width * 2, generator=g)[: rows * width].reshape(rows, width).to(torch.int32)
    n = num_tokens if num_tokens is not None else int(torch.randint(1, 40, (1,), generator=g))
    reqs = torch.randint(0, rows, (n,), generator=g)
    positions = torch.randint(0, width * block_size, (n,), generator=g)
    pad = torch.rand(n, generator=g) < 0.2
    reqs[pad], positions[pad] = -1, 0
    return table, reqs, positions


def _guard_reads(addresses, view: torch.Tensor) -> int:
    """How many traced loads hit the guard rows around ``view`` (a ``guarded_rows`` table)."""
    rows = loads_in(addresses, view)[:, 0]
    return int(((rows < 0) | (rows >= view.shape[0])).sum())


def _flat_row_model(table, reqs, positions, block_size):
    """The row offset taken as req * block_size instead of req * row_stride."""
    flat = np.asarray(table).ravel().tolist()
    out = []
    for r, p in zip(np.asarray(reqs).tolist(), np.asarray(positions).tolist()):
        if r == -1:
            out.append(-1)
            continue
        i = r * block_size + p // block_size
        if not 0 <= i < len(flat):
            raise IndexError(i)
        out.append(flat[i] * block_size + p % block_size)
    return out


KERNEL_SLOT_MISTAKES = [
    Mistake("the row offset", "row r starts at r * block_table.stride(0), "
            "the table's width, not r * block_size", _flat_row_model),
]
READ_MISTAKE = Mistake("padding tokens read the table", "a padding token's "
                       "row is -1: an unmasked table load reads outside the "
                       "table, even if tl.where then discards the value")
LAUNCH_MISTAKE = Mistake("no kernel", "the exercise is the kernel: the "
                         "answer must come from a @triton.jit function's "
                         "launch")


def _run_slot_fn(fn, table, reqs, positions, block_size, what: str, launches=None,
                 reads=None) -> torch.Tensor:
    dev = default_device()
    view = guarded_rows(table)
    with count_triton_launches() as n, traced_loads() as addresses:
        got = fn(view, reqs.to(dev), positions.to(dev), block_size)
    if launches is not None:
        launches.append(n.count)
    if reads is not None:
        reads.append(_guard_reads(addresses, view))
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what}: expected a torch.Tensor, got {type(got).__name__}")
    if got.shape != (reqs.numel(),):
        raise AssertionError(f"{what}: expected shape ({reqs.numel()},), got {tuple(got.shape)}")
    return got


def _compare_slots(got: torch.Tensor, want: list[int], reqs, positions, block_size: int, what: str,
                   table=None, only=None) -> None:
    for i, (g, w) in enumerate(zip(got.cpu().tolist(), want)):
        if g != w and (only is None or i in only):
            outside = g // block_size == GUARD_BLOCK_ID
            hint = " -- it read outside the block table" if outside else ""
            kind = "padding" if int(reqs[i]) == -1 else f"row {int(reqs[i])}"
            mistake = None
            if table is not None:
                mistake = diagnose_slots(got, table, reqs, positions, block_size, KERNEL_SLOT_MISTAKES)
            if mistake is None and outside and int(reqs[i]) == -1:
                mistake = READ_MISTAKE.diagnosis()
            raise WrongAnswer(
                f"{what}: token {i} ({kind}, position {int(positions[i])}) expected slot {w}, got {g}{hint}",
                mistake)


def check_slot_mapping_kernel(fn, cases: int = 25, seed: int = 0, timeout: float = 60.0) -> CheckReport:
    """Check ``fn(block_table, req_indices, positions, block_size) -> int64 tensor`` (a Triton kernel's wrapper).

    ``timeout`` bounds each property, in seconds (the interpreter is slow, a hang is slower).
    """
    g = torch.Generator().manual_seed(seed)
    launches: list[int] = []
    with Checker("slot_mapping kernel", timeout=timeout) as c:
        c.probe(lambda: _run_slot_fn(fn, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0]),
                                     torch.tensor([0]), 16, "probe"))

        def worked_example():
            table = torch.zeros(4, 300, dtype=torch.int32)
            table[3, :256] = torch.arange(256) + 5000
            table[3, 256] = 1913
            reqs, pos = torch.tensor([3]), torch.tensor([4096])
            got = _run_slot_fn(fn, table, reqs, pos, 16, "row 3, position 4096", launches)
            _compare_slots(got, [30608], reqs, pos, 16, "the worked example", table)

        c.prop("the worked example: row 3, position 4096 -> slot 30,608", worked_example,
               "row r starts r * row_stride cells into the table; a slot is its block's first slot plus the "
               "offset in the block")

        def dtype_and_device():
            table, reqs, pos = _random_slot_case(g, 16)
            got = _run_slot_fn(fn, table, reqs, pos, 16, "a random batch", launches)
            if got.dtype != torch.int64:
                raise AssertionError(f"expected an int64 tensor, got {got.dtype}")
            if got.device.type != default_device().type:
                raise AssertionError(f"expected the result on {default_device()}, got {got.device}")

        c.prop("returns int64 slots on the table's device", dtype_and_device,
               "slots are int64 (they pass 2**31) and live where the table lives; torch.empty's defaults are "
               "float32 on the CPU")

        def padding():
            table = torch.tensor([[7, 9], [4, 0]], dtype=torch.int32)
            reqs = torch.tensor([-1, 0, -1, 1, -1])
            pos = torch.tensor([0, 17, 5, 3, 0])
            reads: list[int] = []
            got = _run_slot_fn(fn, table, reqs, pos, 16, "a batch with padding", launches, reads)
            _compare_slots(got, [-1, 9 * 16 + 1, -1, 4 * 16 + 3, -1], reqs, pos, 16, "padding", table,
                           only={0, 2, 4})
            if reads and reads[0]:
                raise WrongAnswer(f"the kernel loaded {reads[0]} value(s) from outside the block table: "
                                  "the padding tokens' table reads", READ_MISTAKE.diagnosis())

        c.prop("padding tokens get slot -1 (and never read the table)", padding,
               "a padding token (row -1) neither reads the table nor gets a real slot")

        def many_tokens():
            table, reqs, pos = _random_slot_case(g, 8, num_tokens=1000)
            got = _run_slot_fn(fn, table, reqs, pos, 8, "1,000 tokens", launches)
            _compare_slots(got, _slot_oracle(table, reqs, pos, 8), reqs, pos, 8, "1,000 tokens", table)

        c.prop("1,000 tokens (not a multiple of any tile) are all mapped", many_tokens,
               "every token needs a lane of some program, and no lane past the last token may load or "
               "store")

        def wide_slots():
            table = torch.tensor([[20_000_000, 3]], dtype=torch.int32)
            reqs, pos = torch.tensor([0, 0]), torch.tensor([5, 130])
            got = _run_slot_fn(fn, table, reqs, pos, 128, "block id 20,000,000 at block_size 128", launches)
            _compare_slots(got, [20_000_000 * 128 + 5, 3 * 128 + 2], reqs, pos, 128, "slots past 2**31", table)

        c.prop("slots past 2**31 do not overflow", wide_slots,
               "an int32 product wraps past 2**31: the block id must be int64 before it is multiplied")

        def randomized():
            for k in range(cases):
                bs = BLOCK_SIZES[k % len(BLOCK_SIZES)]
                table, reqs, pos = _random_slot_case(g, bs)
                what = f"random case {k} (block_size {bs}, table {table.shape[0]} x {table.shape[1]})"
                got = _run_slot_fn(fn, table, reqs, pos, bs, what, launches)
                want = _slot_oracle(table, reqs, pos, bs)
                assert compute_slot_mapping_ref(table, reqs, pos, bs).tolist() == want, "library and oracle disagree"
                _compare_slots(got, want, reqs, pos, bs, what, table)

        c.prop(f"{cases} random tables at block sizes 1, 8, 16, 32, 128 match the reference", randomized,
               "a row offset built from anything but the table's row stride fails on tables of "
               "other widths")

        c.prop("computes in a Triton kernel", lambda: _launched(launches, lambda: _slots_without_kernels(fn)),
               "the exercise is the kernel: every slot must come from a Triton launch")
    return c.report


CHEAT_MISTAKE = Mistake("computed outside the kernel", "the kernel must "
                        "produce the answer: every value the wrapper returns "
                        "comes from a tl.store")


def _launched(launches: list[int], without_kernels) -> None:
    """Every call launched a kernel, and the answer needs it: ``without_kernels()`` (run with every
    launch skipped and fresh buffers poisoned) must not still come out right."""
    if not launches:
        raise AssertionError("no call returned an answer to look at")
    if min(launches) == 0:
        raise WrongAnswer(f"{launches.count(0)} of {len(launches)} calls ran no Triton kernel",
                          LAUNCH_MISTAKE.diagnosis())
    seen = without_kernels()
    if seen:
        raise WrongAnswer(f"with every Triton launch skipped, {seen}: PyTorch computed the "
                          "answer, not your kernel", CHEAT_MISTAKE.diagnosis())


def _slots_without_kernels(fn) -> str | None:
    """What ``fn`` answers with its kernels skipped, if that is still right (``None`` otherwise)."""
    table = torch.tensor([[7, 9, 2], [4, 0, 5]], dtype=torch.int32)
    reqs, pos = torch.tensor([0, 1, 1, 0]), torch.tensor([17, 3, 40, 33])
    with skipped_triton_launches():
        got = fn(guarded_rows(table), reqs.to(default_device()), pos.to(default_device()), 16)
    want = _slot_oracle(table, reqs, pos, 16)
    if isinstance(got, torch.Tensor) and got.cpu().tolist() == want:
        return f"it still returned the right slots {want}"
    return None


catalogue(check_slot_mapping_kernel, SLOT_MISTAKES, KERNEL_SLOT_MISTAKES,
          [READ_MISTAKE, LAUNCH_MISTAKE, CHEAT_MISTAKE])


def _random_kv_case(g: torch.Generator, dtype: torch.dtype, block_size: int, heads: int = 2, head_dim: int = 8,
                    tokens: int = 6):
    num_blocks = max(3, cdiv(2 * tokens, block_size))
    key = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    value = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    shape = (num_blocks, block_size, heads, head_dim)
    key_cache = torch.randn(shape, generator=g).to(dtype)  # old contents that must survive
    value_cache = torch.randn(shape, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[int(torch.randint(0, tokens, (1,), generator=g))] = -1
    return key, value, key_cache, value_cache, slots


def _run_kv_fn(fn, key, value, key_cache, value_cache, slots, what: str, launches=None):
    """Run the learner's kernel on device copies; return the caches it wrote, on the CPU."""
    dev = default_device()
    bufs = []
    for cache in (key_cache, value_cache):
        buf = torch.empty((cache.shape[0] + 2, *cache.shape[1:]), dtype=cache.dtype, device=dev)
        buf[0], buf[-1] = -777.0, 777.0  # the guard blocks
        buf[1:-1] = cache.to(dev)
        bufs.append(buf)
    kc, vc = bufs[0][1:-1], bufs[1][1:-1]  # contiguous: whole blocks
    with count_triton_launches() as n:
        result = fn(key.to(dev), value.to(dev), kc, vc, slots.to(dev))
    if launches is not None:
        launches.append(n.count)
    if result is not None and not isinstance(result, (tuple, list, torch.Tensor)):
        raise AssertionError(f"{what}: expected None (the caches are written in place), got {type(result).__name__}")
    for name, buf in zip(("key_cache", "value_cache"), bufs):
        if not (bool((buf[0] == -777.0).all()) and bool((buf[-1] == 777.0).all())):
            side = "before" if not bool((buf[0] == -777.0).all()) else "after"
            raise WrongAnswer(f"{what}: the kernel wrote {side} {name}'s memory (slot -1 must be skipped, "
                              "and every store masked)",
                              KV_MISTAKES[0 if side == "before" else 1].diagnosis())
    return kc.cpu(), vc.cpu()


KV_MISTAKES = [
    Mistake("padding written", "slot -1 is padding and writes nothing: an "
            "unmasked store there lands in the memory before the cache"),
    Mistake("off by one slot", "token t goes to row slot_mapping[t] of the "
            "flattened cache, exactly"),
    Mistake("K and V swapped", "key goes to key_cache, value to value_cache"),
    Mistake("one head copied", "a token's row is num_kv_heads x head_dim "
            "elements wide: copy all of them"),
    Mistake("the dtype converted", "a copy keeps every bit: a round trip "
            "through another type changes fp16/bf16 bits"),
    Mistake("a cache never written", "each token's key and value both land "
            "at its slot, in key_cache and value_cache"),
]


def _diagnose_kv(got, data, other, old, slots) -> str | None:
    """Name the mistake one cache shows: ``got`` should hold ``data`` at the slots, ``old`` elsewhere.

    ``other`` is what the other cache should receive (the value for the key
    cache): finding it here means K and V were swapped.
    """
    flat = got.reshape(-1, *got.shape[2:])
    flat_old = old.reshape(-1, *old.shape[2:])
    real = [(t, s) for t, s in enumerate(slots.tolist()) if s >= 0]
    if not real:
        return None
    n = flat.shape[0]
    if all(s + 1 < n and torch.equal(flat[s + 1], data[t]) for t, s in real) or \
            all(s >= 1 and torch.equal(flat[s - 1], data[t]) for t, s in real):
        return KV_MISTAKES[1].diagnosis()
    if all(torch.equal(flat[s], flat_old[s]) for _, s in real):
        return KV_MISTAKES[5].diagnosis()
    if all(torch.equal(flat[s], other[t]) for t, s in real):
        return KV_MISTAKES[2].diagnosis()
    if data.shape[1] > 1 and all(torch.equal(flat[s][0], data[t][0]) and not torch.equal(flat[s], data[t])
                                 for t, s in real):
        return KV_MISTAKES[3].diagnosis()
    if all(torch.allclose(flat[s].float(), data[t].float(), rtol=1e-2, atol=1e-2) for t, s in real) and \
            not all(torch.equal(flat[s], data[t]) for t, s in real):
        return KV_MISTAKES[4].diagnosis()
    return None


def _compare_caches(got_k, got_v, want_k, want_v, slots, what: str, key=None, value=None,
                    old=None) -> None:
    """Both caches must equal the reference; a difference is named (``old``: the caches before the call)."""
    bs = want_k.shape[1]
    written = {s for s in slots.tolist() if s >= 0}
    for i, (name, got, want) in enumerate((("key_cache", got_k, want_k), ("value_cache", got_v, want_v))):
        flat_g, flat_w = got.reshape(-1, *got.shape[2:]), want.reshape(-1, *want.shape[2:])
        differs = (flat_g != flat_w).flatten(1).any(1).nonzero().flatten().tolist()
        if differs:
            s = differs[0]
            mistake = None
            if key is not None and old is not None:
                data, other = (key, value) if i == 0 else (value, key)
                mistake = _diagnose_kv(got, data, other, old[i], slots)
            if s in written:
                t = slots.tolist().index(s)
                raise WrongAnswer(f"{what}: {name} slot {s} (block {s // bs}, offset {s % bs}) "
                                  f"should hold token {t}'s data and does not", mistake)
            raise WrongAnswer(f"{what}: {name} slot {s} (block {s // bs}, offset {s % bs}) was not "
                              "written by any token but changed", mistake)


def _kv_property(fn, g, dtype, block_size, heads=2, head_dim=8, tokens=6, what="", launches=None) -> None:
    key, value, kc, vc, slots = _random_kv_case(g, dtype, block_size, heads, head_dim, tokens)
    want_k, want_v = kc.clone(), vc.clone()
    reshape_and_cache_ref(key, value, want_k, want_v, slots)
    oracle_k, oracle_v = kc.clone(), vc.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            oracle_k[s // block_size, s % block_size] = key[t]
            oracle_v[s // block_size, s % block_size] = value[t]
    assert torch.equal(want_k, oracle_k) and torch.equal(want_v, oracle_v), "library and oracle disagree"
    got_k, got_v = _run_kv_fn(fn, key, value, kc, vc, slots, what, launches)
    _compare_caches(got_k, got_v, want_k, want_v, slots, what, key, value, (kc, vc))


def check_kv_write_kernel(fn, seed: int = 0, timeout: float = 60.0) -> CheckReport:
    """Check ``fn(key, value, key_cache, value_cache, slot_mapping) -> None`` (a Triton kernel's wrapper).

    ``timeout`` bounds each property, in seconds.
    """
    g = torch.Generator().manual_seed(seed)
    launches: list[int] = []
    with Checker("kv_write kernel", timeout=timeout) as c:
        def probe():
            key, value, kc, vc, slots = _random_kv_case(torch.Generator().manual_seed(1), torch.float32, 4)
            _run_kv_fn(fn, key, value, kc, vc, slots, "probe")

        c.probe(probe)
        c.prop("fp32 tokens land at their slots; every other slot keeps its contents",
               lambda: _kv_property(fn, g, torch.float32, 16, what="fp32, block_size 16", launches=launches),
               "viewed flat, token t is row t of key and slot s is row s of the cache, each "
               "num_kv_heads * head_dim wide")

        def padding_only():
            key, value, kc, vc, slots = _random_kv_case(g, torch.float32, 4)
            slots[:] = -1
            got_k, got_v = _run_kv_fn(fn, key, value, kc, vc, slots, "a batch of padding only", launches)
            _compare_caches(got_k, got_v, kc, vc, slots, "a batch of padding only")

        c.prop("padding tokens (slot -1) write nothing", padding_only,
               "a store at slot -1 lands in the memory just before the cache")

        def block_sizes():
            for bs in BLOCK_SIZES:
                _kv_property(fn, g, torch.float32, bs, what=f"block_size {bs}", launches=launches)

        c.prop("block sizes 1, 8, 16, 32, 128", block_sizes,
               "block-major caches are flat rows: block b, offset o is row b * block_size + o")

        def half_types():
            for dtype in (torch.float16, torch.bfloat16):
                _kv_property(fn, g, dtype, 8, what=str(dtype).replace("torch.", ""), launches=launches)

        c.prop("fp16 and bf16 are copied bit for bit", half_types,
               "a copy moves bytes: nothing on the way may convert them")

        c.prop("a token width that is not a power of two (3 heads x 5 dims)",
               lambda: _kv_property(fn, g, torch.float32, 8, heads=3, head_dim=5, what="3 heads x 5 dims",
                                    launches=launches),
               "tl.arange needs a power of two, and the lanes past the width must not touch memory")

        c.prop("many tokens (200) in one call",
               lambda: _kv_property(fn, g, torch.float32, 16, tokens=200, what="200 tokens", launches=launches),
               "every token needs a program of its own")

        c.prop("computes in a Triton kernel", lambda: _launched(launches, lambda: _kv_without_kernels(fn)),
               "the exercise is the kernel: every write must come from a Triton launch")
    return c.report


def _kv_without_kernels(fn) -> str | None:
    """Which slots ``fn`` still writes right with its kernels skipped (``None`` if none)."""
    key, value, kc, vc, slots = _random_kv_case(torch.Generator().manual_seed(2), torch.float32, 4)
    dev = default_device()
    k_dev, v_dev = kc.to(dev, copy=True), vc.to(dev, copy=True)
    with skipped_triton_launches():
        fn(key.to(dev), value.to(dev), k_dev, v_dev, slots.to(dev))
    flat_k, flat_v = k_dev.cpu().flatten(0, 1), v_dev.cpu().flatten(0, 1)
    right = [s for t, s in enumerate(slots.tolist()) if s >= 0 and
             (torch.equal(flat_k[s], key[t]) or torch.equal(flat_v[s], value[t]))]
    return f"slots {right} still received their tokens" if right else None


catalogue(check_kv_write_kernel, KV_MISTAKES, [LAUNCH_MISTAKE, CHEAT_MISTAKE])


# ----------------------------------------------------- the slot mapping in numpy
# Exercise 5's first rung, before the kernels: the same formula as whole-array
# numpy on the staging table. ``slot_mapping_numpy(block_table, req_indices,
# positions, block_size) -> np.ndarray``, ``block_table`` an ``[num_rows,
# max_blocks]`` int32 array, ``req_indices`` and ``positions`` int64 arrays of
# one entry per token (``-1`` = padding); one int64 slot per token. Each case
# is compared with ``compute_slot_mapping_ref`` and a token-by-token oracle;
# the padding property judges padding tokens only.


def _numpy_oracle(table: np.ndarray, reqs: np.ndarray, positions: np.ndarray, block_size: int) -> list[int]:
    out = []
    for r, p in zip(reqs.tolist(), positions.tolist()):
        out.append(-1 if r == -1 else int(table[r, p // block_size]) * block_size + p % block_size)
    return out


def random_table_case(rng: np.random.Generator, block_size: int, padding: bool = True):
    """A table of distinct block ids with some rows partly filled, and tokens inside the filled part."""
    rows, width = int(rng.integers(1, 6)), int(rng.integers(1, 9))
    table = np.zeros((rows, width), dtype=np.int32)
    lengths = rng.integers(1, width + 1, size=rows)
    ids = rng.permutation(rows * width * 2)[: rows * width].astype(np.int32)
    for r in range(rows):
        table[r, : lengths[r]] = ids[r * width : r * width + lengths[r]]
    n = int(rng.integers(1, 40))
    reqs = rng.integers(0, rows, size=n).astype(np.int64)
    positions = np.array([rng.integers(0, lengths[r] * block_size) for r in reqs], dtype=np.int64)
    if padding:
        pad = rng.random(n) < 0.2
        reqs[pad], positions[pad] = -1, 0
    return table, reqs, positions


def _call_numpy(fn, table, reqs, positions, block_size, what: str) -> np.ndarray:
    """Run the learner's function on copies; return its answer as a 1-D array of the right length."""
    got = fn(table.copy(), reqs.copy(), positions.copy(), block_size)
    arr = np.asarray(got)
    if arr.shape != (len(reqs),):
        raise AssertionError(f"{what}: expected one slot per token, shape ({len(reqs)},), got shape {arr.shape}")
    return arr


def _compare_numpy(got: np.ndarray, want: list[int], reqs, positions, what: str,
                   table=None, block_size=None, only=None) -> None:
    """Compare slot by slot (``only``: the tokens to judge); name the mistake."""
    for i, (g, w) in enumerate(zip(got.tolist(), want)):
        if g != w and (only is None or i in only):
            kind = "padding" if int(reqs[i]) == -1 else f"row {int(reqs[i])}"
            raise WrongAnswer(
                f"{what}: token {i} ({kind}, position {int(positions[i])}) expected slot {w}, got {g}",
                None if table is None else diagnose_slots(got, table, reqs, positions, block_size))


def check_slot_mapping_numpy(fn, cases: int = 60, seed: int = 0) -> CheckReport:
    """Check ``fn(block_table, req_indices, positions, block_size) -> np.ndarray`` of int64 slots."""
    rng = np.random.default_rng(seed)
    with Checker("slot_mapping_numpy") as c:
        c.probe(lambda: fn(np.zeros((1, 1), np.int32), np.zeros(1, np.int64),
                           np.zeros(1, np.int64), 16))

        def worked_example():
            table = np.zeros((4, 300), dtype=np.int32)
            table[3, :256] = np.arange(256) + 5000
            table[3, 256] = 1913
            reqs, pos = np.array([3], dtype=np.int64), np.array([4096], dtype=np.int64)
            got = _call_numpy(fn, table, reqs, pos, 16, "row 3, position 4096, block_size 16")
            _compare_numpy(got, [30608], reqs, pos, "the worked example", table, 16)

        c.prop("the worked example: row 3, position 4096 -> block 1913 -> slot 30,608", worked_example,
               "column = position // block_size, offset = position % block_size, slot = block * block_size + offset")

        def returns_int64():
            table, reqs, pos = random_table_case(rng, 16)
            got = fn(table.copy(), reqs.copy(), pos.copy(), 16)
            if not isinstance(got, np.ndarray):
                raise AssertionError(f"expected a numpy array, got {type(got).__name__}")
            if got.dtype != np.int64:
                raise AssertionError(f"expected dtype int64, got {got.dtype}")
            if got.shape != (len(reqs),):
                raise AssertionError(f"expected shape ({len(reqs)},), got {got.shape}")

        c.prop("returns an int64 numpy array with one slot per token", returns_int64,
               "the answer is an int64 numpy array, one slot per token")

        def padding():
            table = np.array([[7, 9], [4, 0]], dtype=np.int32)
            reqs = np.array([-1, 0, -1, 1, -1], dtype=np.int64)
            pos = np.array([0, 17, 5, 3, 0], dtype=np.int64)
            got = _call_numpy(fn, table, reqs, pos, 16, "a batch with padding tokens")
            _compare_numpy(got, [-1, 9 * 16 + 1, -1, 4 * 16 + 3, -1], reqs, pos, "padding", table, 16,
                     only={0, 2, 4})

        c.prop("padding tokens (req_indices == -1) get slot -1", padding,
               "row -1 is a valid numpy index (the last row): a padding token must not be looked up "
               "there, and its slot is -1")

        def wide_slots():
            table = np.array([[20_000_000, 3]], dtype=np.int32)
            reqs, pos = np.array([0, 0], dtype=np.int64), np.array([5, 130], dtype=np.int64)
            got = _call_numpy(fn, table, reqs, pos, 128, "block id 20,000,000 at block_size 128")
            _compare_numpy(got, [20_000_000 * 128 + 5, 3 * 128 + 2], reqs, pos, "slots past 2**31", table, 128)

        c.prop("slots past 2**31 do not overflow", wide_slots,
               "block ids are int32, and block_id * block_size need not fit in 32 bits")

        def randomized():
            for k in range(cases):
                bs = BLOCK_SIZES[k % len(BLOCK_SIZES)]
                table, reqs, pos = random_table_case(rng, bs)
                what = f"random case {k} (block_size {bs}, table {table.shape[0]} x {table.shape[1]})"
                got = _call_numpy(fn, table, reqs, pos, bs, what)
                want = _numpy_oracle(table, reqs, pos, bs)
                library = compute_slot_mapping_ref(torch.from_numpy(table), torch.from_numpy(reqs),
                                                   torch.from_numpy(pos), bs).tolist()
                assert library == want, "the library and the oracle disagree (a bug in pagedkv, not in your code)"
                _compare_numpy(got, want, reqs, pos, what, table, bs)

        c.prop(f"{cases} random tables at block sizes 1, 8, 16, 32, 128 match the library", randomized,
               "the message names the case and the first token that differs")

        def leaves_inputs_alone():
            table, reqs, pos = random_table_case(rng, 8)
            copies = (table.copy(), reqs.copy(), pos.copy())
            fn(table, reqs, pos, 8)
            for name, before, after in zip(("block_table", "req_indices", "positions"), copies, (table, reqs, pos)):
                if not np.array_equal(before, after):
                    raise AssertionError(f"{name} was modified")

        c.prop("the block table and the inputs are left unchanged", leaves_inputs_alone,
               "the inputs belong to the caller: nothing in them may change")
    return c.report


catalogue(check_slot_mapping_numpy, SLOT_MISTAKES)
