"""The chapter 7 checker: the solution notebook's kernel passes; each mistake fails with its own hint.

The kernel under test is the one committed in solutions/07_paged_attention.ipynb,
so the solution the site shows is the one these tests run.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import pagedkv  # noqa: F401  -- fixes the Triton mode before the solution's kernel is defined
from pagedkv import checks
from tools.notebooks import load_cell_function
from pagedkv.kernels import paged_attention_ref

SOLUTION = Path(__file__).resolve().parents[2] / "solutions" / "07_paged_attention.ipynb"
IN_A_KERNEL = "computes in a Triton kernel"


@functools.cache
def solution_decode_attention():
    return load_cell_function(SOLUTION, "decode_attention")


def lines(report):
    return {r.name: r for r in report.results}


def test_solution_passes_every_property(capsys):
    assert checks.check_decode_attention(solution_decode_attention())
    assert "\u274c" not in capsys.readouterr().out


def test_untouched_stub_prints_one_line(capsys):
    def stub(q, key_cache, value_cache, block_table, seq_lens, scale):
        raise NotImplementedError

    report = checks.check_decode_attention(stub)
    assert len(report.results) == 1 and "not implemented yet" in report.results[0].detail
    assert "Hint" not in capsys.readouterr().out


def test_plain_pytorch_fails_only_the_launch_property():
    def torch_only(q, key_cache, value_cache, block_table, seq_lens, scale):
        qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        return paged_attention_ref(q, key_cache, value_cache, block_table, seq_lens, qsl, scale)

    report = lines(checks.check_decode_attention(torch_only))
    failed = [name for name, r in report.items() if not r.passed]
    assert failed == [IN_A_KERNEL]


def test_mistakes_are_named():
    kernel = solution_decode_attention()

    def no_scale(q, key_cache, value_cache, block_table, seq_lens, scale):
        return kernel(q, key_cache, value_cache, block_table, seq_lens, 1.0)

    def whole_blocks(q, key_cache, value_cache, block_table, seq_lens, scale):
        bs = key_cache.shape[1]
        padded = ((seq_lens + bs - 1) // bs * bs).to(torch.int32)
        return kernel(q, key_cache, value_cache, block_table, padded, scale)

    def in_order(q, key_cache, value_cache, block_table, seq_lens, scale):
        cols = torch.arange(block_table.shape[1], dtype=torch.int32, device=block_table.device)
        table = cols.repeat(block_table.shape[0], 1).clamp(max=key_cache.shape[0] - 1).contiguous()
        return kernel(q, key_cache, value_cache, table, seq_lens, scale)

    def wrong_group(q, key_cache, value_cache, block_table, seq_lens, scale):
        # Query head h reads KV head h % num_kv_heads: permute the heads so the group mapping is wrong.
        kv = key_cache.shape[2]
        group = q.shape[1] // kv
        perm = torch.arange(q.shape[1]).view(group, kv).T.reshape(-1)  # position of head h in h%kv order
        out = kernel(q[:, perm].contiguous(), key_cache, value_cache, block_table, seq_lens, scale)
        return out[:, torch.argsort(perm)].contiguous()

    expected = {no_scale: "unscaled scores", whole_blocks: "every slot of the last block",
                in_order: "in order", wrong_group: "h % num_kv_heads"}
    for fn, words in expected.items():
        report = lines(checks.check_decode_attention(fn, seed=1))
        failures = [r.detail for r in report.values() if not r.passed]
        assert failures, fn.__name__
        assert any(words in d for d in failures), (fn.__name__, failures)


# -- issue 20: answers that used to pass, messages, and the cost of a hang ----------------------------


def solution_variant(old: str, new: str):
    """The solution's ``decode_attention`` with one piece of its source replaced (the piece must exist)."""
    import importlib.util
    import json
    import tempfile

    cells = json.loads(SOLUTION.read_text())["cells"]
    src = next("".join(c["source"]) for c in cells
               if c["cell_type"] == "code" and "def decode_attention(" in "".join(c["source"]))
    assert old in src, old
    path = Path(tempfile.mkdtemp()) / f"_variant_{abs(hash(old + new))}.py"
    path.write_text("import torch\nimport triton\nimport triton.language as tl\n\n" + src.replace(old, new))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.decode_attention


def failures(report):
    return {r.name: r.detail for r in report.results if not r.passed}


def test_kv_loads_unmasked_past_seq_len_are_named():
    # Only the scores are masked: p = 0 times a NaN value is NaN.
    fn = solution_variant("mask=ok[:, None], other=0.0)", ")")
    failed = failures(checks.check_decode_attention(fn))
    assert failed, "reading NaN poison must fail"
    assert any("Diagnosis: read past seq_len" in d for d in failed.values()), failed
    assert not any("first tile" in d for d in failed.values()), failed


def test_an_unmasked_table_load_is_named():
    fn = solution_variant("pos // block_size,\n                        mask=ok, other=0)",
                          "pos // block_size)")
    failed = failures(checks.check_decode_attention(fn))
    if os.environ.get("TRITON_INTERPRET") != "1":
        return  # compiled kernels cannot be traced: only the values are checked
    assert list(failed) == ["never loads a block-table column past the sequence"], failed
    detail = failed["never loads a block-table column past the sequence"]
    assert "Diagnosis: loads block-table columns past the sequence -- a table column past" in detail


def test_torch_answer_with_a_do_nothing_kernel_fails_the_kernel_property():
    @triton.jit
    def nothing(x_ptr):
        pass

    def cheat(q, key_cache, value_cache, block_table, seq_lens, scale):
        qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        out = paged_attention_ref(q, key_cache, value_cache, block_table, seq_lens, qsl, scale)
        nothing[(1,)](out)
        return out

    failed = failures(checks.check_decode_attention(cheat))
    assert list(failed) == [IN_A_KERNEL], failed
    assert "with every Triton launch skipped, it still returned the right output" in failed[IN_A_KERNEL]
    assert "Diagnosis: computed outside the kernel" in failed[IN_A_KERNEL]


def test_a_hang_costs_one_timeout_and_every_property_says_so():
    def hangs(q, key_cache, value_cache, block_table, seq_lens, scale):
        while True:
            pass

    start = time.perf_counter()
    report = checks.check_decode_attention(hangs, timeout=0.5)
    elapsed = time.perf_counter() - start
    assert not report and len(report.results) == 12
    assert all("no answer within 0.5 s" in r.detail for r in report.results)
    assert elapsed < 0.5 + 3.0, elapsed


# -- review 2026-12-01 item 12: a group of 3 (padding rows) and bf16 ------------------------------------

PADDED = "a group of 3 query heads, padded to 4 rows (SmolLM2: 9 over 3 KV heads)"
BF16 = "bf16 q and caches (output in bf16)"


def test_an_unmasked_store_of_the_padding_rows_is_named():
    # With GROUP_P2 = 4 > GROUP = 3 the 4th row's store lands on the next group's first head, and past
    # the output for the last KV head: the guarded tail of the output sees it, compiled or interpreted.
    fn = solution_variant("acc / l[:, None], mask=g_ok[:, None])", "acc / l[:, None])")
    failed = failures(checks.check_decode_attention(fn))
    assert list(failed) == [PADDED], failed
    assert "past the end of a [3, 9, 16] buffer it allocated" in failed[PADDED]
    assert "Diagnosis: rows of padding not masked -- " in failed[PADDED]


def test_an_unmasked_q_load_of_the_padding_rows_is_named():
    # The answer stays right (the padding rows are never stored), so only the traced load shows it.
    fn = solution_variant("q = tl.load(q_ptr + q_off, mask=g_ok[:, None], other=0.0)",
                          "q = tl.load(q_ptr + q_off)")
    failed = failures(checks.check_decode_attention(fn))
    if os.environ.get("TRITON_INTERPRET") != "1":
        return  # compiled kernels cannot be traced
    assert list(failed) == [PADDED], failed
    assert "it loaded 16 element(s) of q past its last head" in failed[PADDED]
    assert "Diagnosis: rows of padding not masked" in failed[PADDED]


def test_bf16_arithmetic_is_named():
    # Without the conversions the kernel computes in bf16: the interpreter refuses a bf16 scalar product
    # (a GPU would round every partial sum); the same case in fp32 passes, which names the mistake.
    fn = solution_variant(".to(tl.float32)", "")
    failed = failures(checks.check_decode_attention(fn))
    assert list(failed) == [BF16], failed
    assert "Diagnosis: arithmetic in bf16 -- the same case in fp32 is right" in failed[BF16]


def test_the_guarded_tail_catches_a_store_past_the_end():
    from pagedkv.checks.kernel_probes import guarded_allocations

    with guarded_allocations() as allocs:
        out = torch.empty(2, 3)
    assert out.shape == (2, 3) and out.is_contiguous()
    assert allocs.overruns() == []
    out.view(-1).as_strided((7,), (1,))[6] = 1.0  # one element past the end
    assert allocs.overruns() == ["1 element(s) past the end of a [2, 3] buffer it allocated"]


# -- issue 36: answers that used to pass --------------------------------------------------------------

SCALED = "a scale the caller chooses (0.3, not 1/sqrt(head_dim))"


def test_a_hard_coded_scale_is_named():
    kernel = solution_decode_attention()

    def hard_coded(q, key_cache, value_cache, block_table, seq_lens, scale):
        return kernel(q, key_cache, value_cache, block_table, seq_lens, q.shape[2] ** -0.5)

    failed = failures(checks.check_decode_attention(hard_coded))
    assert list(failed) == [SCALED], failed
    assert "Diagnosis: the scale hard-coded -- it matches a scale of 1/sqrt(head_dim)" in failed[SCALED]


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, TILE: tl.constexpr):
    offs = tl.program_id(0) * TILE + tl.arange(0, TILE)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def test_torch_answer_copied_by_a_kernel_fails_the_kernel_property():
    # The kernel runs and reads, so skipping launches leaves poison: only changing the inputs
    # as it launches shows it answers for inputs it never read.
    def cheat(q, key_cache, value_cache, block_table, seq_lens, scale):
        qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        answer = paged_attention_ref(q, key_cache, value_cache, block_table, seq_lens, qsl, scale)
        out = torch.empty_like(q)
        _copy_kernel[(triton.cdiv(q.numel(), 256),)](answer, out, q.numel(), TILE=256)
        return out

    failed = failures(checks.check_decode_attention(cheat))
    assert list(failed) == [IN_A_KERNEL], failed
    assert "the output still answers the old ones" in failed[IN_A_KERNEL]
    assert "Diagnosis: an answer copied, not computed" in failed[IN_A_KERNEL]


def test_diagnoses_name_the_invariant_not_the_line():
    # A diagnosis says what the kernel broke; it never hands over the code that fixes it.
    from pagedkv.checks import ch07_paged_attention as ch07

    for mistake in [m for _, m in ch07.MISTAKES] + [ch07.READ_PAST, ch07.TABLE_MISTAKE,
                                                    ch07.PADDING_MISTAKE, ch07.BF16_MISTAKE,
                                                    ch07.NO_RESCALE, ch07.INT32_OFFSETS]:
        for code in ("tl.", "mask=", "other=", ".to(", " < seq_len"):
            assert code not in mistake.fix, (mistake.name, code)


def test_hint_3_is_the_idea_and_the_invariant_never_the_body():
    import json

    exercise = SOLUTION.parents[1] / "exercises" / "07_paged_attention.ipynb"
    cells = [("".join(c["source"])) for c in json.loads(exercise.read_text())["cells"]]
    hints = next(c for c in cells if c.startswith("<details>"))
    assert "Hint 1 (a nudge" in hints and "Hint 2 (a pointer)" in hints
    third = hints.split("Hint 3 (the idea and the invariant)")[1]
    assert "```" not in third and "invariant" in third  # prose, no skeleton to fill in
    solution = next("".join(c["source"]) for c in json.loads(SOLUTION.read_text())["cells"]
                    if "def decode_kernel(" in "".join(c["source"]))
    body = solution.split("def decode_attention(")[0].split("TILE: tl.constexpr):")[1]  # the kernel's body
    kernel = {ln.strip() for ln in body.splitlines() if len(ln.strip()) > 12 and not ln.strip().startswith("#")}
    every_hint = "\n".join(c for c in cells if c.startswith("<details>"))
    assert not [ln for ln in kernel if ln in every_hint]


# -- issue 45 item 5: the numerics named, and a pool past 2**31 elements ----------------------------

BIG = "block ids past 2**22: element offsets past 2**31 (a pool of 8 GiB)"


def _every_failure_named(fn, words):
    failed = failures(checks.check_decode_attention(fn))
    assert failed, words
    for name, detail in failed.items():
        assert f"Diagnosis: {words} --" in detail, (name, detail)
    return failed


def test_a_missing_running_max_rescale_is_named():
    # The cases whose max arrives after the first tile fail; on the same cases with keys that
    # score ever lower (the first tile holds the max) the kernel is right: that names it.
    for old, new in (("acc = acc * alpha[:, None] +", "acc = acc +"), ("l = l * alpha +", "l = l +")):
        failed = _every_failure_named(solution_variant(old, new), "the running max not rescaled")
        assert "one request, one block" not in failed  # one tile: nothing to rescale


def test_a_wrong_scale_and_a_mixed_up_base_are_named():
    kernel = solution_decode_attention()
    in_base_2 = solution_variant("tl.exp(", "tl.exp2(")  # p and alpha in base 2, scores unchanged

    def squared(q, key_cache, value_cache, block_table, seq_lens, scale):
        return kernel(q, key_cache, value_cache, block_table, seq_lens, 1.0 / q.shape[2])

    def ln2_for_log2e(q, key_cache, value_cache, block_table, seq_lens, scale):
        return in_base_2(q, key_cache, value_cache, block_table, seq_lens, scale * 0.6931471805599453)

    def log2e_with_exp(q, key_cache, value_cache, block_table, seq_lens, scale):
        return kernel(q, key_cache, value_cache, block_table, seq_lens, scale * 1.4426950408889634)

    for fn, words in ((squared, "the scale squared (1/head_dim)"), (in_base_2, "exp2 without log2(e)"),
                      (ln2_for_log2e, "ln(2) where log2(e) belongs"), (log2e_with_exp, "log2(e) with exp")):
        failed = _every_failure_named(fn, words)
        assert BIG in failed and IN_A_KERNEL not in failed, (words, list(failed))


def test_int32_offsets_that_overflow_past_2_31_elements_are_named():
    # The solution widens the block id once; without it every product is int32, right on every small
    # pool. A pool past 2**31 elements (reserved, not taken: a few KiB are written) wraps the offset.
    fn = solution_variant("row = (block.to(tl.int64) * block_size", "row = (block * block_size")
    report = checks.check_decode_attention(fn)
    failed = failures(report)
    if os.environ.get("TRITON_INTERPRET") != "1":
        # compiled, the case is not run (a wrapped address would end the CUDA context), and the
        # line says so: never a tick for a case that did not run
        big = [r for r in report.results if r.name == BIG]
        assert big and big[0].skipped and "not run here" in big[0].line(), report
        assert "\u2705" not in big[0].line() and "1 not run here" in report.summary()
        return
    assert list(failed) == [BIG], failed
    assert "before the first element of key_cache" in failed[BIG]
    assert "a value loaded from block_table is multiplied in int32" in failed[BIG]
    assert "Diagnosis: int32 offsets overflow --" in failed[BIG]


def test_a_property_that_cannot_run_here_says_so_and_is_not_a_tick():
    from pagedkv.checks._harness import Checker, NotRun

    def body():
        raise NotRun("needs the interpreter")

    with Checker("demo", verbose=False) as c:
        c.prop("runs", lambda: None)
        c.prop("a big case", body)
    line = c.report.results[-1].line()
    assert line.startswith("\u2796 a big case -- not run here: needs the interpreter"), line
    assert c.report.summary() == "demo: 1/1 properties hold, 1 not run here"
    assert c.report  # nothing that ran failed


def test_the_large_pool_is_reserved_not_taken():
    from pagedkv.checks import ch07_paged_attention as ch07

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the large case runs only in the interpreter")

    def resident_mib():
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    before = resident_mib()
    case = ch07._big_case(0)
    assert case["key_cache"].numel() > 2**31 and case["key_cache"] is case["value_cache"]
    ch07._past_2_31(solution_decode_attention(), 0)  # the solution passes
    assert resident_mib() - before < 64
