"""The kernel puzzles' checker (exercise 7b): stubs fail, solutions pass, mistakes are named.

The kernels under test are the ones committed in solutions/07b_kernel_puzzles.ipynb,
so the solutions the site shows are the ones these tests run. A wrong answer is
the solution with one piece of its source replaced; each must fail with a message
that names its mistake. A wasteful answer is right and moves more bytes: it
passes, and its trace says so.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import pagedkv  # noqa: F401  -- fixes the Triton mode before the solutions' kernels are defined
from pagedkv import checks
from pagedkv.checks import ch07b_kernel_puzzles as puzzles
from pagedkv.checks.puzzle_harness import bytes_moved, run_case

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solutions" / "07b_kernel_puzzles.ipynb"
EXERCISE = ROOT / "exercises" / "07b_kernel_puzzles.ipynb"
NAMES = {1: "slots_per_request", 2: "gather_k", 3: "attend_one_tile", 4: "row_logsumexp",
         5: "decode_mha", 6: "decode_gqa", 7: "prefill_chunk", 8: "split_partials",
         9: "merge_splits", 10: "copy_blocks_all_layers", 11: "decode_unmasked"}
interpreted = os.environ.get("TRITON_INTERPRET") == "1"


def _source(notebook: Path, n: int) -> str:
    cells = json.loads(notebook.read_text())["cells"]
    return next("".join(c["source"]) for c in cells
                if c["cell_type"] == "code" and f"def {NAMES[n]}(" in "".join(c["source"]))


def _load(src: str, name: str, tag: str):
    path = Path(tempfile.mkdtemp()) / f"_puzzle_{tag}.py"
    path.write_text("import math\nimport torch\nimport triton\nimport triton.language as tl\n\n" + src + "\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


@functools.cache
def solution(n: int):
    return _load(_source(SOLUTION, n), NAMES[n], f"sol{n}")


def variant(n: int, *pairs):
    """Puzzle ``n``'s solution with each (old, new) replaced; every old must occur."""
    src = _source(SOLUTION, n)
    for old, new in pairs:
        assert old in src, old
        src = src.replace(old, new)
    return _load(src, NAMES[n], f"var{n}_{abs(hash(pairs))}")


def failures(report):
    return {r.name: r.detail for r in report.results if not r.passed}


def assert_named(n: int, fn, words: str, traced_only=False):
    """The check fails, and some failing line's diagnosis holds ``words``."""
    if traced_only and not interpreted:
        return  # compiled kernels cannot be traced
    failed = failures(checks.check_kernel_puzzle(n, fn))
    assert failed, f"puzzle {n}: a wrong answer passed"
    assert any(f"Diagnosis: {words}" in d for d in failed.values()), failed


def score(n: int, fn) -> tuple[float, str]:
    """The bytes score of ``fn`` on puzzle ``n``'s picture case, and the trace's text."""
    case = puzzles._PICTURE[n]()
    run = run_case(fn, case, puzzles.puzzle(n))
    moved = sum(bytes_moved(run, puzzles.puzzle(n).data).values())
    text = puzzles.trace_report(puzzles.puzzle(n), fn, case)
    return moved / case.minimum, text


# ------------------------------------------------------------ every puzzle

@pytest.mark.parametrize("n", puzzles.PUZZLES)
def test_solution_passes_every_property(n, capsys):
    assert checks.check_kernel_puzzle(n, solution(n))
    assert "\u274c" not in capsys.readouterr().out


@pytest.mark.parametrize("n", puzzles.PUZZLES)
def test_untouched_stub_prints_one_line(n, capsys):
    stub = _load(_source(EXERCISE, n), NAMES[n], f"stub{n}")
    report = checks.check_kernel_puzzle(n, stub)
    assert not report and report.stub and len(report.results) == 1
    out = capsys.readouterr().out
    assert "not implemented yet" in out and "Hint" not in out
    assert max(map(len, out.splitlines())) <= 79


@pytest.mark.skipif(not interpreted, reason="the trace needs Triton's interpreter")
@pytest.mark.parametrize("n", puzzles.PUZZLES)
def test_solution_moves_the_minimum_and_its_picture_fits(n):
    got, text = score(n, solution(n))
    assert got == pytest.approx(1.0)
    assert "1.00x" in text and "!" not in text.split("\n(a ")[0]
    assert max(map(len, text.splitlines())) <= 79


@pytest.mark.parametrize("n", puzzles.PUZZLES)
def test_reference_source_fits_the_column(n, capsys):
    checks.show_reference(n)
    out = capsys.readouterr().out
    assert out.startswith("def reference_") and max(map(len, out.splitlines())) <= 79


def test_a_puzzle_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="there is no puzzle 12"):
        checks.check_kernel_puzzle(12, print)
    with pytest.raises(TypeError, match="n must be an int, got bool True"):
        checks.show_reference(True)


IN_A_KERNEL = "computes in a Triton kernel, from its inputs"
INT64 = "multiplies block ids in int64 (offsets pass 2**31)"


@triton.jit
def _nothing(x_ptr):
    pass


def test_pytorch_answers_behind_a_do_nothing_kernel_fail_the_kernel_property():
    def slots(query_start_loc, positions, block_table, block_size, max_num_tokens):
        out = puzzles.reference_slots_per_request(query_start_loc.cpu(), positions.cpu(), block_table.cpu(),
                                                  block_size, max_num_tokens).to(positions.device)
        _nothing[(1,)](out)
        return out

    def merge(partial, lse):
        out = puzzles.reference_merge(partial, lse)
        _nothing[(1,)](out)
        return out

    for n, fn in ((1, slots), (9, merge)):
        failed = failures(checks.check_kernel_puzzle(n, fn))
        assert list(failed) == [IN_A_KERNEL], failed
        assert "Diagnosis: computed outside the kernel" in failed[IN_A_KERNEL]


# ------------------------------------------------------------ wrong answers, by puzzle

def test_p1_mistakes_are_named():
    assert_named(1, variant(1, ("block.to(tl.int64) * block_size", "block * block_size")), "int32 wrap")
    no_pad = variant(1, ("    if req == tl.num_programs(0) - 1:", "    if req < 0:"))
    assert_named(1, no_pad, "the last program reads a request that does not exist", traced_only=True)
    assert_named(1, variant(1, ("ok = offs < end", "ok = offs <= end")), "an off-by-one mask",
                 traced_only=True)
    silent_pad = variant(1, ("            tl.store(slot_mapping_ptr + offs, PAD_ID,\n"
                             "                     mask=offs < max_num_tokens)", "            pass"))
    assert_named(1, silent_pad, "the tail not padded")


def test_p2_mistakes_are_named():
    assert_named(2, variant(2, ("ok = (slot < block_size) & (pos < seq_len)", "ok = slot < block_size")),
                 "the whole last block")
    assert_named(2, variant(2, ("(pos < seq_len)", "(pos <= seq_len)")), "an off-by-one mask")
    assert_named(2, variant(2, ("block = tl.load(block_table_ptr + j).to(tl.int64)",
                                "block = j.to(tl.int64)")), "blocks read in order")


def test_p3_mistakes_are_named():
    assert_named(3, variant(3, ("* scale\n", "\n")), "no scale")
    assert_named(3, variant(3, ("p = tl.exp(s - tl.max(s, 0))", "p = tl.exp(s)")),
                 "the max not subtracted")
    assert_named(3, variant(3, ('    s = tl.where(ok, s, float("-inf"))', "")), "padding lanes scored 0")
    assert_named(3, variant(3, ("ok = pos < n", "ok = pos <= n")), "an off-by-one mask", traced_only=True)


def test_p4_mistakes_are_named():
    assert_named(4, variant(4, ('m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)', "m_safe = m_new")),
                 "the m = -inf case")
    assert_named(4, variant(4, ("x.stride(0), n_cols", "n_cols, n_cols")), "read outside the row",
                 traced_only=True)
    assert_named(4, variant(4, ("mask=cols < n_cols", "mask=cols <= n_cols")), "read outside the row",
                 traced_only=True)
    assert_named(4, variant(4, ("tl.exp(", "tl.exp2("), ("tl.log(", "tl.log2(")), "log2 domain")


def test_p5_mistakes_are_named():
    assert_named(5, variant(5, (" * scale, ", ", ")), "no scale")
    assert_named(5, variant(5, ("mask=ok[:, None], other=0.0)", ")")), "read past seq_len")
    assert_named(5, variant(5, ("block = tl.load(table_ptr + req * row_stride + pos // block_size,\n"
                                "                        mask=ok, other=0)", "block = pos // block_size")),
                 "blocks read in order")
    assert_named(5, variant(5, ("pos // block_size,\n                        mask=ok, other=0)",
                                "pos // block_size)")), "loads block-table columns past", traced_only=True)


def test_p6_mistakes_are_named():
    assert_named(6, variant(6, ("head = kv_head * GROUP + g", "head = g * num_kv_heads + kv_head")),
                 "the wrong head of a group")
    assert_named(6, variant(6, ("acc / l[:, None], mask=g_ok[:, None])", "acc / l[:, None])")),
                 "rows of padding not masked")
    assert_named(6, variant(6, ("q = tl.load(q_ptr + q_off, mask=g_ok[:, None], other=0.0)",
                                "q = tl.load(q_ptr + q_off)")), "rows of padding not masked",
                 traced_only=True)


def test_p7_mistakes_are_named():
    assert_named(7, variant(7, ("visible = ok[None, :] & (pos[None, :] <= q_pos[:, None])",
                                "visible = ok[None, :] & (pos[None, :] >= 0)")), "no causal mask")
    assert_named(7, variant(7, ("q_pos = seq_len - q_len + i", "q_pos = i")), "query positions from 0")
    assert_named(7, variant(7, ("(pos[None, :] <= q_pos[:, None])", "(pos[None, :] < q_pos[:, None])")),
                 "a query does not see itself")


def test_p8_mistakes_are_named():
    natural = variant(8, ("scale2 = scale * 1.4426950408889634", "scale2 = scale"),
                      ("tl.exp2(", "tl.exp("), ("tl.log2(", "tl.log("))
    assert_named(8, natural, "lse in base e")
    assert_named(8, variant(8, ("l_safe = tl.where(l > 0, l, 1.0)", "l_safe = l")), "an empty segment")
    whole = variant(8, ("    lo = split * seg_len\n    hi = tl.minimum(lo + seg_len, seq_len)",
                        "    lo = 0\n    hi = seq_len"))
    assert_named(8, whole, "every split reads the whole sequence")


def test_p9_mistakes_are_named():
    assert_named(9, variant(9, ("tl.exp2(", "tl.exp(")), "exp where exp2 belongs")
    assert_named(9, variant(9, (" / tl.sum(w, 0)", "")), "weights not normalised")
    assert_named(9, variant(9, ("w = tl.exp2(lse - tl.max(lse, 0))", "w = tl.exp2(lse)")),
                 "the max lse not subtracted")


def test_p10_mistakes_are_named():
    swapped = variant(10, ("tl.load(pairs_ptr + 2 * pair)  #", "tl.load(pairs_ptr + 2 * pair + 1)  #"),
                      ("dst = tl.load(pairs_ptr + 2 * pair + 1)", "dst = tl.load(pairs_ptr + 2 * pair)"))
    assert_named(10, swapped, "src and dst swapped")
    assert_named(10, variant(10, ("[(len(pairs), len(caches))]", "[(len(pairs), 1)]")), "one cache only")
    unchecked = variant(10, ("        if dsts.count(dst) > 1:", "        if False:"),
                        ("        if src in dsts:", "        if False:"))
    failed = failures(checks.check_kernel_puzzle(10, unchecked))
    assert list(failed) == ["refuses overlapping pairs (ValueError naming the block), changing nothing"]
    assert "Diagnosis: overlapping pairs accepted" in next(iter(failed.values()))


def test_p11_mistakes_are_named():
    # The kernel reads the table it was given, as wide as the longest request needs.
    unpadded = variant(11, ("value_cache, table, seq_lens", "value_cache, block_table, seq_lens"),
                       ("block_size, table.stride(0)", "block_size, block_table.stride(0)"))
    assert_named(11, unpadded, "the table not padded to 128 tokens", traced_only=True)
    one_more = variant(11, ("width = triton.cdiv(block_table.shape[1], align) * align",
                            "width = block_table.shape[1] + 1"))
    assert_named(11, one_more, "the table not padded to 128 tokens", traced_only=True)
    assert_named(11, variant(11, (" * scale, ", ", ")), "no scale")


def test_p11_width_is_vllms():
    assert [puzzles.reference_table_width(n, bs) for n, bs in ((5, 16), (13, 4), (30, 1), (1, 128), (3, 48))] == \
        [8, 32, 128, 1, 8]  # 48-token blocks: 8 of them are 384 tokens, 3 x 128


# ------------------------------------------------------------ wasteful answers pass, with their score

TWO_PASS_4 = """@triton.jit
def logsumexp_kernel(x_ptr, out_ptr, row_stride, n_cols, TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * row_stride
    m = float("-inf")
    for start in range(0, n_cols, TILE):  # pass 1: the max
        cols = start + tl.arange(0, TILE)
        x = tl.load(x_ptr + row + cols, mask=cols < n_cols, other=float("-inf"))
        m = tl.maximum(m, tl.max(x, 0))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l = 0.0
    for start in range(0, n_cols, TILE):  # pass 2: the sum, reading x again
        cols = start + tl.arange(0, TILE)
        x = tl.load(x_ptr + row + cols, mask=cols < n_cols, other=float("-inf"))
        l += tl.sum(tl.exp(x - m_safe), 0)
    lse = tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), float("-inf"))
    tl.store(out_ptr + tl.program_id(0), lse)


def row_logsumexp(x):
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    logsumexp_kernel[(x.shape[0],)](x, out, x.stride(0), x.shape[1], TILE=16)
    return out
"""


EVERY_CACHE_10 = """@triton.jit
def copy_blocks_kernel(cache_ptrs_ptr, pairs_ptr, block_numel, num_caches, TILE: tl.constexpr):
    pair = tl.program_id(0)
    src = tl.load(pairs_ptr + 2 * pair)
    dst = tl.load(pairs_ptr + 2 * pair + 1)
    for c in range(num_caches):  # every program copies every cache: each copy runs num_caches times
        cache = tl.load(cache_ptrs_ptr + c).to(tl.pointer_type(tl.float32))
        for start in range(0, block_numel, TILE):
            cols = start + tl.arange(0, TILE)
            ok = cols < block_numel
            tl.store(cache + dst * block_numel + cols, tl.load(cache + src * block_numel + cols, mask=ok), mask=ok)


def copy_blocks_all_layers(caches, block_pairs):
    pairs = block_pairs.tolist()
    dsts = [d for _, d in pairs]
    for src, dst in pairs:
        if dsts.count(dst) > 1 or src in dsts:
            raise ValueError(f"block {dst if dsts.count(dst) > 1 else src} overlaps")
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=caches[0].device)
    block_numel = caches[0][0].numel()
    copy_blocks_kernel[(len(pairs), len(caches))](ptrs, block_pairs.contiguous(), block_numel, len(caches),
                                                  TILE=triton.next_power_of_2(block_numel))
"""


def _wasteful():
    """One correct answer per puzzle that moves more bytes than it must, and the tensor that pays."""
    every_program_pads = variant(1, ("    req = tl.program_id(0)\n    if req", "    req = tl.program_id(0)\n"
                                     "    for i in range(num_tokens, max_num_tokens, TILE):\n"
                                     "        offs = i + tl.arange(0, TILE)\n"
                                     "        tl.store(slot_mapping_ptr + offs, PAD_ID, mask=offs < max_num_tokens)\n"
                                     "    if req"))
    per_head = variant(2, ("tl.store(out_ptr + dst, rows, mask=ok[:, None])",
                           "mine = cols // (WIDTH // tl.num_programs(1)) == tl.program_id(1)\n"
                           "    tl.store(out_ptr + dst, rows, mask=ok[:, None] & mine[None, :])"),
                       ("[(triton.cdiv(seq_len, block_size),)]", "[(triton.cdiv(seq_len, block_size), heads)]"))
    reload_k = variant(3, ("s = tl.sum(k * q[None, :], 1) * scale",
                           "k = tl.load(k_ptr + kv_off, mask=ok[:, None], other=0.0)\n"
                           "    s = tl.sum(k * q[None, :], 1) * scale"))
    one_query_row = variant(7, ("triton.cdiv(int(q_lens.max()), 16))", "int(q_lens.max()))"),
                            ("BLOCK_Q=16", "BLOCK_Q=1"))
    reload_lse = variant(9, ("    w = tl.exp2(lse - tl.max(lse, 0))",
                             "    top = tl.max(lse, 0)\n"
                             "    lse = tl.load(lse_ptr + s * num_rows + row, mask=s_ok, other=float('-inf'))\n"
                             "    w = tl.exp2(lse - top)"))
    q_every_tile = variant(5, ("    for start in range(0, seq_len, TILE):\n",
                               "    for start in range(0, seq_len, TILE):\n        q = tl.load(q_ptr + q_off)\n"))
    q_every_tile_11 = variant(11, ("    for start in range(0, seq_len, TILE):\n",
                                   "    for start in range(0, seq_len, TILE):\n        q = tl.load(q_ptr + q_off)\n"))
    k_twice = variant(6, ("        s = tl.dot(q, tl.trans(k)", "        k = tl.load(k_cache_ptr + kv_off, mask=ok[:, None], "
                                                           "other=0.0)\n        s = tl.dot(q, tl.trans(k)"))
    q_every_tile_8 = variant(8, ("    for start in range(lo, hi, TILE):\n",
                                 "    for start in range(lo, hi, TILE):\n"
                                 "        q = tl.load(q_ptr + (req * num_heads + head) * HEAD_DIM + dims)\n"))
    return {1: (every_program_pads, "out"), 2: (per_head, "key_cache"), 3: (reload_k, "k"),
            4: (_load(TWO_PASS_4, "row_logsumexp", "two_pass4"), "x"), 5: (q_every_tile, "q"),
            6: (k_twice, "key_cache"), 7: (one_query_row, "key_cache"), 8: (q_every_tile_8, "q"),
            9: (reload_lse, "lse"), 10: (_load(EVERY_CACHE_10, "copy_blocks_all_layers", "every10"), "caches[0]"),
            11: (q_every_tile_11, "q")}


@pytest.mark.skipif(not interpreted, reason="the trace needs Triton's interpreter")
def test_wasteful_answers_pass_and_their_trace_names_the_waste(capsys):
    for n, (fn, tensor) in _wasteful().items():
        if n == 6:  # puzzle 6's lesson is the bytes: K read twice fails its property
            assert list(failures(checks.check_kernel_puzzle(n, fn))) == [READS_ONCE], n
        else:
            assert checks.check_kernel_puzzle(n, fn), n
        got, text = score(n, fn)
        assert got > 1.0, (n, got)
        assert f"the waste: {tensor}, " in text, (n, text)
        assert max(map(len, text.splitlines())) <= 79, text


@pytest.mark.skipif(not interpreted, reason="the trace needs Triton's interpreter")
def test_the_picture_marks_a_read_of_poison():
    # An off-by-one mask reads the slot at position seq_len: a '!' in its block's cell.
    off_by_one = variant(2, ("(pos < seq_len)", "(pos <= seq_len)"))
    text = puzzles.trace_report(puzzles.puzzle(2), off_by_one, puzzles._PICTURE[2]())
    grid = text.split("\n(a ")[0]
    assert grid.count("!") == 1 and "rr!." in grid


def test_the_trace_says_so_when_it_cannot_trace(monkeypatch, capsys):
    from pagedkv.checks import puzzle_harness

    monkeypatch.setattr(puzzle_harness, "interpreted", lambda: False)
    checks.trace_kernel_puzzle(1, solution(1))
    assert capsys.readouterr().out.startswith("compiled kernels cannot be traced")


# ------------------------------------------------------------ issue 36: answers that used to pass

READS_ONCE = "reads each KV head's K and V once for its group (bytes = the minimum)"


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, TILE: tl.constexpr):
    offs = tl.program_id(0) * TILE + tl.arange(0, TILE)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def _copied_into(answer, out=None):
    """A trivial kernel's work: copy ``answer`` (computed before it ran) into ``out``."""
    out = torch.empty_like(answer) if out is None else out
    _copy_kernel[(triton.cdiv(answer.numel(), 256),)](answer, out, answer.numel(), TILE=256)
    return out


def _copy_cheat(n: int):
    """Puzzle ``n`` answered by PyTorch, then copied into the output by a kernel that reads it."""
    def paged(a):
        qsl = torch.arange(a["q"].shape[0] + 1, dtype=torch.int32)
        return puzzles.reference_paged_attention(a["q"], a["key_cache"], a["value_cache"],
                                                 a["block_table"], a["seq_lens"], qsl, a["scale"])

    refs = {1: lambda a: puzzles.reference_slots_per_request(**a), 2: lambda a: puzzles.reference_gather(**a),
            3: lambda a: puzzles.reference_attend(**a), 4: lambda a: puzzles.reference_logsumexp(a["x"]),
            5: paged, 6: paged, 7: lambda a: puzzles.reference_paged_attention(**a),
            8: lambda a: puzzles.reference_split_partials(**a), 9: lambda a: puzzles.reference_merge(**a),
            11: paged}

    def cheat(**kwargs):
        cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        device = next(v for v in kwargs.values() if isinstance(v, torch.Tensor)).device
        answer = refs[n](cpu)
        if isinstance(answer, tuple):
            return tuple(_copied_into(t.to(device)) for t in answer)
        return _copied_into(answer.to(device))

    return cheat


def test_an_answer_pytorch_computed_and_a_kernel_copied_fails_every_computing_puzzle():
    # The copy kernel runs and reads (its input is PyTorch's answer), so skipping launches
    # cannot tell it from the work; changing the inputs as the kernel launches can.
    for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11):
        failed = failures(checks.check_kernel_puzzle(n, _copy_cheat(n)))
        assert list(failed) == [IN_A_KERNEL], (n, failed)
        assert "and the output still answers the old ones" in failed[IN_A_KERNEL], n
        assert "Diagnosis: an answer copied, not computed" in failed[IN_A_KERNEL], n


def test_the_wrapper_may_hand_the_kernel_copies_of_its_inputs():
    # clone(), contiguous(), a dtype conversion: the copies follow the inputs' change.
    copies = variant(5, ("        q, key_cache, value_cache, block_table, seq_lens, out, scale,",
                         "        q.clone(), key_cache.contiguous().clone(), value_cache.to(torch.float32)"
                         ".clone(), block_table.clone(), seq_lens, out, scale,"))
    assert checks.check_kernel_puzzle(5, copies)
    # Puzzle 4's x is a view of a wider buffer: a contiguous copy of the view follows it too.
    dense = variant(4, ("    rows, n_cols = x.shape\n", "    x = x.contiguous()\n    rows, n_cols = x.shape\n"))
    assert checks.check_kernel_puzzle(4, dense)


def test_unmasked_position_and_table_loads_are_named_not_a_crash():
    # Without the check's bounds the interpreter read past the positions and crashed the process.
    fn = variant(1, ("pos = tl.load(positions_ptr + offs, mask=ok, other=0)", "pos = tl.load(positions_ptr + offs)"),
                 ("block = tl.load(block_table_ptr + row + pos // block_size,\n                        mask=ok, other=0)",
                  "block = tl.load(block_table_ptr + row + pos // block_size)"))
    if not interpreted:
        return  # compiled, the guard rows and the values are all there is
    failed = failures(checks.check_kernel_puzzle(1, fn))
    first = failed["maps every request's tokens and pads the tail with -1"]
    assert "lane(s) of a tl.load lay outside every tensor the kernel could reach" in first
    assert "past the last element of positions" in first
    assert "Diagnosis: an unmasked load or store" in first
    assert "no case ran to its end" in failed[IN_A_KERNEL]


@pytest.mark.parametrize("n, pairs", [
    (2, (("block = tl.load(block_table_ptr + j).to(tl.int64)", "block = tl.load(block_table_ptr + j)"),)),
    (5, (("slot = block.to(tl.int64) * block_size", "slot = block * block_size"),)),
    (10, (("dtype=torch.int64)", "dtype=torch.int32)"),)),
])
def test_int32_block_id_arithmetic_is_named(n, pairs):
    # No CPU case can hold 2**31 cache elements: the check follows the loaded ids' dtype instead
    # (and, for puzzle 10, sees the pairs handed over as int32, compiled too).
    if not interpreted and n != 10:
        return
    failed = failures(checks.check_kernel_puzzle(n, variant(n, *pairs)))
    assert list(failed) == [INT64], failed
    assert "Diagnosis: int32 index arithmetic" in failed[INT64]
    name = "block_pairs" if n == 10 else "block_table"
    assert (f"a value loaded from {name} is multiplied in int32" in failed[INT64]
            or f"the kernel is handed {name} as int32" in failed[INT64])


def test_p6_a_dot_whose_k_is_under_16_is_refused_and_fewer_rows_pass():
    fn = variant(6, ("TILE=16)", "TILE=8)"))  # P @ V: [16, 8] x [8, 16]
    assert_named(6, fn, "a tl.dot the GPU compiler refuses", traced_only=True)
    if interpreted:
        detail = next(iter(failures(checks.check_kernel_puzzle(6, fn)).values()))
        assert "K = 8: Triton's compiled target needs K >= 16" in detail
    # M under 16 compiles (Triton pads it), so a tile of next_power_of_2(GROUP) rows passes.
    rows = variant(6, ("ROWS=max(16, triton.next_power_of_2(group))", "ROWS=triton.next_power_of_2(group)"))
    assert checks.check_kernel_puzzle(6, rows)


def test_p6_one_program_per_query_head_fails_with_its_bytes():
    per_query_head = variant(6, ("kv_head = tl.program_id(1)", "qh = tl.program_id(1)\n    kv_head = qh // GROUP"),
                             ("head = kv_head * GROUP + g", "head = qh + g"), ("g_ok = g < GROUP", "g_ok = g < 1"),
                             ("[(num_reqs, num_kv_heads)]", "[(num_reqs, num_heads)]"))
    failed = failures(checks.check_kernel_puzzle(6, per_query_head))
    assert list(failed) == [READS_ONCE], failed
    detail = failed[READS_ONCE]
    assert "27 programs for 3 requests x 3 KV heads" in detail
    assert "Diagnosis: one program per query head" in detail
    if interpreted:
        assert "K and V loaded 54,144 bytes where 18,048 would do (3.00x)" in detail


def test_p7_tiles_that_load_keys_past_their_last_query_fail():
    # The causal bound ignored in the loop, kept in the scores: right, and the statement forbids it.
    fn = variant(7, ("kv_hi = tl.minimum(seq_len, last)", "kv_hi = seq_len"))
    if not interpreted:
        return
    failed = failures(checks.check_kernel_puzzle(7, fn))
    name = "no tile loads a key none of its queries may see"
    assert list(failed) == [name], failed
    assert "program (0, 0, 0) loaded the key at position 26 of request 0" in failed[name]
    assert "Diagnosis: keys past the tile's last query loaded" in failed[name]
    # A tile past a short chunk's end has no query: it loads nothing.
    empty = variant(7, ("    if tl.program_id(2) * BLOCK_Q >= q_len:\n        return", "    if False:\n        return"))
    detail = failures(checks.check_kernel_puzzle(7, empty))[name]
    assert "program (1, 0, 1) loaded the key at position 11 of request 1, and it stores no query" in detail


def test_p10_one_tile_per_block_without_a_loop_fails_on_a_large_block():
    fn = variant(10, ("    for start in range(0, block_numel, TILE):\n", "    for start in range(0, 1):\n"))
    failed = failures(checks.check_kernel_puzzle(10, fn))
    name = "copies every pair in every cache, nothing else"
    assert list(failed) == [name], failed
    assert "blocks of 2,560 elements" in failed[name]
    assert ("Diagnosis: one tile per block -- only the first 1,024 of each block's 2,560 elements "
            "were copied") in failed[name]


def test_p11_alignment_for_block_size_48():
    # 128 // 48 = 2 columns is 96 tokens, not a whole number of 128-token spans.
    fn = variant(11, ("align = 128 // math.gcd(128, block_size)", "align = max(1, 128 // block_size)"))
    assert_named(11, fn, "the table not padded to 128 tokens", traced_only=True)
    if interpreted:
        detail = failures(checks.check_kernel_puzzle(11, fn))["equals the reference, the table loads in bounds"]
        assert "block size 48, not a power of two" in detail


# ------------------------------------------------------------ the prediction: a split-KV program grid

def test_the_split_rule_is_the_grid_the_committed_kernel_reads():
    # The expected grid is computed from the rule; the solution's kernel, traced, reads exactly it.
    from pagedkv.checks import ch07b_grid_prediction as grid
    from pagedkv.checks.kernel_probes import traced_accesses

    if not interpreted:
        return
    lens = [n for n, _ in grid.REQUESTS.values()]
    table = torch.tensor([row for _, row in grid.REQUESTS.values()], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(grid.NUM_BLOCKS, grid.BLOCK_SIZE, 1, 8, generator=g)
    q = torch.randn(len(lens), 1, 8, generator=g)
    with traced_accesses() as accesses:
        solution(8)(q, kc, kc.clone(), table, torch.tensor(lens, dtype=torch.int32), 8 ** -0.5,
                    grid.NUM_SPLITS)
    start, slot_bytes = kc.data_ptr(), kc.stride(0) * kc.element_size()
    read = {}
    for a in accesses:
        if a.kind == "load":
            hits = a.addresses[(a.addresses >= start) & (a.addresses < start + kc.numel() * 4)]
            key = (list(grid.REQUESTS)[a.program[0]], a.program[2])
            read.setdefault(key, set()).update(((hits - start) // slot_bytes).tolist())
    want = grid.split_program_blocks(grid.REQUESTS, grid.BLOCK_SIZE, grid.NUM_SPLITS)
    assert {k: sorted(v) for k, v in want.items()} == {k: sorted(read.get(k, ())) for k in want}


def test_the_grid_prediction_grades_names_and_draws(capsys):
    from pagedkv.checks import ch07b_grid_prediction as grid

    report = checks.check_split_grid_prediction(None)
    assert report.stub and "not made yet (write it into predicted_blocks" in capsys.readouterr().out
    right = grid.split_program_blocks(grid.REQUESTS, grid.BLOCK_SIZE, grid.NUM_SPLITS)
    assert checks.check_split_grid_prediction({k: list(reversed(v)) for k, v in right.items()})
    for mistake in grid.GRID_MISTAKES:
        report = checks.check_split_grid_prediction(mistake.model())
        assert not report and f"Diagnosis: {mistake.name}" in report.results[0].detail
        assert "What the trace leads to" in report.picture and "Your prediction" in report.picture
    one_short = {**right, ("A", 0): [6]}
    report = checks.check_split_grid_prediction(one_short)
    assert "program ('A', 0) reads block 2 too (you predicted [6], it reads [6, 2])" in \
        report.results[0].detail
    assert "(A, 0)    . . - . . . r" in report.picture  # the block it missed, marked
    report = checks.check_split_grid_prediction([[6, 2]])
    assert "expected a dict {(request, split): [block ids]}" in report.results[0].detail
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 79


# ------------------------------------------------------------ hints and diagnoses that teach (issue 36 §5)

CODE = ("tl.where", "tl.exp", "tl.log", "tl.load", "tl.store", "tl.maximum", "tl.zeros", "tl.arange",
        "mask=", "other=", ".to(", "m_safe")


def test_diagnoses_name_the_invariant_not_the_line():
    for n, mistakes in list(puzzles.MISTAKES.items()) + [("every", puzzles.EVERY_PUZZLE)]:
        for m in mistakes:
            assert not [c for c in CODE if c in m.fix], (n, m.name, m.fix)


def test_hints_come_in_three_levels_and_hint_3_is_the_idea_never_the_loop():
    cells = json.loads(EXERCISE.read_text())["cells"]
    hints = ["".join(c["source"]) for c in cells if "".join(c["source"]).startswith("<details>\n<summary>Hint 1")]
    assert len(hints) == 13  # the eleven puzzles, the prediction and the planted bug
    puzzle_hints = [h for h in hints if "Hint 3" in h and "windows" not in h]  # not the planted bug's
    assert len(puzzle_hints) == 11
    for n, text in enumerate(puzzle_hints, start=1):
        assert "Hint 1 (a nudge)" in text and "Hint 2 (a pointer)" in text, n
        assert "Hint 3 (the idea and the invariant)" in text, n
        third = text.split("Hint 3 (the idea and the invariant)")[1]
        assert "```" not in third and "invariant" in third, n  # prose: no loop's shape to transcribe
    for n in NAMES:  # no hint holds a line of a solution's kernel
        kernel = {ln.strip() for ln in _source(SOLUTION, n).split("def ")[1].splitlines()[1:]
                  if len(ln.strip()) > 12 and not ln.strip().startswith("#")}
        assert not [ln for h in hints for ln in kernel if ln in h], n


def test_with_the_probes_as_compiled_the_solutions_pass_and_the_grid_and_dtypes_still_tell(monkeypatch):
    # On a GPU nothing is traced: the checks fall back on the values, the launch's grid
    # (puzzle 6) and the dtypes handed over (puzzle 10). Rehearsed here with the probes told
    # they run compiled (the kernels still run in the interpreter).
    from pagedkv.checks import interpreter_probes, kernel_probes, puzzle_harness, puzzle_rules

    for module in (kernel_probes, interpreter_probes, puzzle_harness, puzzle_rules):
        monkeypatch.setattr(module, "interpreted", lambda: False)
    for n in puzzles.PUZZLES:
        assert checks.check_kernel_puzzle(n, solution(n)), n
    per_query_head = variant(6, ("kv_head = tl.program_id(1)", "qh = tl.program_id(1)\n    kv_head = qh // GROUP"),
                             ("head = kv_head * GROUP + g", "head = qh + g"), ("g_ok = g < GROUP", "g_ok = g < 1"),
                             ("[(num_reqs, num_kv_heads)]", "[(num_reqs, num_heads)]"))
    assert "27 programs for 3 requests x 3 KV heads" in failures(checks.check_kernel_puzzle(6, per_query_head))[READS_ONCE]
    narrowed = failures(checks.check_kernel_puzzle(10, variant(10, ("dtype=torch.int64)", "dtype=torch.int32)"))))
    assert "the kernel is handed block_pairs as int32" in narrowed[INT64]
    assert "still answers the old ones" in failures(checks.check_kernel_puzzle(5, _copy_cheat(5)))[IN_A_KERNEL]


# ------------------------------------------------------------ issue 45: numerics named

def test_a_missing_rescale_a_wrong_scale_and_a_mixed_log_are_named():
    assert_named(3, variant(3, ("k.shape[0], scale,", "k.shape[0], 1.0 / q.shape[0],")),
                 "the scale squared (1/head_dim)")
    assert_named(4, variant(4, ("l = l * tl.exp(m - m_safe) +", "l = l +")),
                 "the running max not rescaled")
    assert_named(5, variant(5, ("acc = acc * alpha +", "acc = acc +")), "the running max not rescaled")
    assert_named(5, variant(5, ("l = l * alpha +", "l = l +")), "the running max not rescaled")
    assert_named(5, variant(5, ("out, scale,\n", "out, 1.0 / head_dim,\n")), "the scale squared")
    assert_named(8, variant(8, ("m + tl.log2(l_safe)", "m + tl.log(l_safe)")), "ln where log2 belongs")
    assert_named(8, variant(8, ("scale2 = scale * 1.4426950408889634", "scale2 = scale")),
                 "exp2 without log2(e)")
    assert_named(8, variant(8, ("acc = acc * alpha +", "acc = acc +")), "the running max not rescaled")


def test_a_merely_wrong_kernel_is_not_said_to_read_what_the_wrapper_computed():
    for n, fn in ((3, variant(3, ("k.shape[0], scale,", "k.shape[0], 1.0 / q.shape[0],"))),
                  (4, variant(4, ("l = l * tl.exp(m - m_safe) +", "l = l +")))):
        failed = failures(checks.check_kernel_puzzle(n, fn))
        assert failed and IN_A_KERNEL not in failed, failed
        assert not any("reads what the wrapper computed" in d for d in failed.values())


@pytest.mark.parametrize("nearest", [None, "seq_lens"])
def test_a_kv_row_stride_from_num_heads_is_named_not_a_read_past_seq_len(nearest, monkeypatch):
    # The stray lanes run past the cache's end; which tensor lies nearest them is the
    # allocator's choice (seq_lens, on one CI machine): the diagnosis must not depend on it.
    if nearest is not None:
        from pagedkv.checks import interpreter_probes
        monkeypatch.setattr(interpreter_probes.Bounds, "_nearest",
                            lambda self, address: (nearest, f"somewhere near {nearest}"))
    fn = variant(6, ("(slot * num_kv_heads + kv_head)", "(slot * num_heads + kv_head)"))
    failed = failures(checks.check_kernel_puzzle(6, fn))
    first = failed["equals the reference for groups of 3, 4 and 1"]
    assert "Diagnosis: a K/V row stride from num_heads" in first, first
    assert "read past seq_len" not in first
