"""The chapter 1 checkers: right answers pass, each kind of wrong answer fails the right property."""

import math
import signal
import sys
import time

import pytest

from pagedkv import checks
from pagedkv.checks._harness import Checker


def kv_ok(layers, kv_heads, head_dim, dtype_bytes):
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def blocks_ok(total_mib, util, weight_gib, non_kv_gib, model, block_size, dtype_bytes):
    pool = total_mib * 2**20 * util - (weight_gib + non_kv_gib) * 2**30
    page = block_size * 2 * model.num_kv_heads * model.head_dim * dtype_bytes
    return int(pool // page) // model.num_layers


def verdicts(report):
    return [r.passed for r in report.results]


def test_correct_solutions_pass_every_property(capsys):
    assert checks.check_kv_bytes_per_token(kv_ok)
    assert checks.check_kv_pool_blocks(blocks_ok)
    out = capsys.readouterr().out
    assert "\u274c" not in out and out.count("\u2705") == 7


def test_forgetting_v_fails_every_kv_property():
    report = checks.check_kv_bytes_per_token(lambda l, h, d, b: l * h * d * b)
    assert verdicts(report) == [False, False, False]
    assert "expected 131,072, got 65,536" in report.results[0].detail
    assert all("Diagnosis: K only" in r.detail for r in report.results)


def test_a_hard_coded_answer_passes_the_known_case_only():
    # A learner who hard-codes Llama's answer passes the known answer but not the rest.
    report = checks.check_kv_bytes_per_token(lambda *a: 131_072)
    assert verdicts(report) == [True, False, False]


def test_rounding_the_total_fails_the_rounding_property():
    def rounds_total(total_mib, *rest):
        return blocks_ok(round(total_mib / 1024, 2) * 1024, *rest)

    report = checks.check_kv_pool_blocks(rounds_total)
    assert report.results[0].passed is False  # 81,559 MiB rounded to 79.65 GiB gives 26,786
    assert "expected 26,785, got 26,786" in report.results[0].detail
    assert "Diagnosis: rounded total" in report.results[0].detail


def test_one_floor_division_instead_of_two_is_caught():
    def one_floor(total_mib, util, weight_gib, non_kv_gib, model, block_size, dtype_bytes):
        pool = total_mib * 2**20 * util - (weight_gib + non_kv_gib) * 2**30
        return int(pool // (block_size * 2 * model.num_kv_heads * model.head_dim * dtype_bytes * model.num_layers))

    # Mathematically floor(floor(x/a)/b) == floor(x/(ab)) for positive integers a, b, so this is
    # in fact correct: the checker must not fail it.
    assert checks.check_kv_pool_blocks(one_floor)


def test_crashes_and_wrong_types_become_red_lines_not_exceptions():
    def crashes(*args):
        return [][1]

    report = checks.check_kv_pool_blocks(crashes)
    assert not report and all("raised IndexError" in r.detail for r in report.results)
    report = checks.check_kv_bytes_per_token(lambda *a: "131072")
    assert not report and "expected an integer, got str" in report.results[0].detail
    report = checks.check_kv_bytes_per_token(lambda *a: True)
    assert not report


def test_stub_says_not_implemented_in_exactly_one_line(capsys):
    def stub(*args):
        raise NotImplementedError

    for check in (checks.check_kv_bytes_per_token, checks.check_kv_pool_blocks):
        report = check(stub)
        assert not report and report.stub and len(report.results) == 1
        out = capsys.readouterr().out
        assert out.count("\n") == 1 and "not implemented yet" in out and "Hint" not in out
        assert str(report) == out.strip()


def test_a_long_line_wraps_to_the_column_and_keeps_long_words_whole():
    from pagedkv.checks._harness import PropertyResult

    detail = "the pool holds " + ", ".join(str(i) for i in range(40)) + " and " + "x" * 90
    lines = PropertyResult("pool", False, detail).line().split("\n")
    assert lines[0].startswith("\u274c pool -- the pool holds 0, 1,") and len(lines) > 2
    assert all(len(line) <= 79 for line in lines[:-1]) and lines[-1] == "   " + "x" * 90
    assert all(line.startswith("   ") for line in lines[1:])
    assert " ".join(line.strip() for line in lines) == "\u274c pool -- " + detail


def pool_with(pool_fn=None, div=None):
    def fn(total_mib, util, weight_gib, non_kv_gib, model, block_size, dtype_bytes):
        pool = (pool_fn or (lambda T, u, w, n: T * 2**20 * u - (w + n) * 2**30))(
            total_mib, util, weight_gib, non_kv_gib)
        page = block_size * 2 * model.num_kv_heads * model.head_dim * dtype_bytes
        if div:
            return div(pool / page / model.num_layers)
        return int(pool // page) // model.num_layers
    return fn


@pytest.mark.parametrize("fn, got, name", [
    (pool_with(lambda T, u, w, n: (T * 2**20 - (w + n) * 2**30) * u), "27,644",
     "utilization applied after subtracting"),
    (pool_with(div=math.ceil), "26,786", "a ceil where a floor belongs"),
    (pool_with(div=round), "26,786", "rounded to the nearest block"),
    (pool_with(lambda T, u, w, n: T * 1e6 * u - (w + n) * 1e9), None, "decimal units"),
    (pool_with(lambda T, u, w, n: T * 2**20 * u - w * 2**30), None, "non-KV memory not subtracted"),
])
def test_each_pool_mistake_is_named(fn, got, name):
    report = checks.check_kv_pool_blocks(fn, cases=20)
    assert not report.results[0].passed
    if got:
        assert f"got {got}" in report.results[0].detail
    assert f"Diagnosis: {name}" in report.results[0].detail


@pytest.mark.parametrize("fn, name", [
    (lambda L, H, D, b: 2 * L * H * D, "bytes per element forgotten"),
    (lambda L, H, D, b: 2 * H * D * b, "one layer"),
    (lambda L, H, D, b: 16 * L * H * D * b, "bits, not bytes"),
    (lambda L, H, D, b: 4 * L * H * D, "dtype ignored"),
])
def test_each_kv_mistake_is_named(fn, name):
    report = checks.check_kv_bytes_per_token(fn, cases=20)
    assert f"Diagnosis: {name}" in [r for r in report.results if not r.passed][0].detail


def test_a_wrong_answer_no_mistake_explains_gets_the_generic_hint():
    report = checks.check_kv_bytes_per_token(lambda L, H, D, b: 2 * L * H * D * b + 1, cases=5)
    assert "Hint: count K and V" in report.results[0].detail and "Diagnosis" not in report.results[0].detail


def test_a_hang_becomes_a_timeout_line():
    def hangs():
        while True:
            time.sleep(0.01)

    with Checker("hang", timeout=0.2, verbose=False) as c:
        c.prop("never returns", hangs)
        c.prop("fine", lambda: None)  # not run: one hang costs one timeout per check
    assert [r.passed for r in c.report.results] == [False, False]
    assert "no answer within 0.2 s" in c.report.results[0].detail
    assert "no answer within 0.2 s" in c.report.results[1].detail
    assert "not run again" in c.report.results[1].detail


def _swallows_exception(*args):
    """A learner's retry loop: the timeout must get out of it anyway."""
    while True:
        try:
            time.sleep(1)
        except Exception:
            pass


def _swallows_everything(*args):
    while True:
        try:
            time.sleep(1)
        except:  # noqa: E722 -- the point of the test
            pass


def _swallows_everything_busy(*args):
    n = 0
    while True:
        try:
            n += 1
        except BaseException:
            pass


@pytest.mark.parametrize("learner", [_swallows_exception, _swallows_everything, _swallows_everything_busy])
def test_a_loop_that_catches_the_timeout_still_times_out(learner):
    handler = signal.getsignal(signal.SIGALRM)
    trace = sys.gettrace()
    start = time.monotonic()
    with Checker("hang", timeout=0.3, verbose=False) as c:
        c.prop("never returns", learner)
    with Checker("after", timeout=0.3, verbose=False) as after:
        after.prop("runs afterwards", lambda: time.sleep(0.2))  # no repeating alarm is left over
    assert time.monotonic() - start < 0.3 + 0.2 + 1.5
    assert [r.passed for r in c.report.results + after.report.results] == [False, True]
    assert "no answer within 0.3 s" in c.report.results[0].detail
    assert signal.getsignal(signal.SIGALRM) is handler and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert sys.gettrace() is trace


def test_a_real_checker_comes_back_from_a_retry_loop():
    start = time.monotonic()
    report = checks.check_largest_free_extent(_swallows_exception, timeout=0.2)
    assert not report and all("no answer within 0.2 s" in r.detail for r in report.results)
    assert time.monotonic() - start < 0.2 + 2  # one timeout, whatever the number of properties


def test_a_hang_found_by_the_probe_costs_one_timeout_and_every_property_says_so():
    import time

    def hangs(*args):
        while True:
            pass

    start = time.perf_counter()
    report = checks.check_kv_bytes_per_token(hangs, timeout=0.3)
    elapsed = time.perf_counter() - start
    assert not report and len(report.results) >= 2
    assert all("no answer within 0.3 s" in r.detail for r in report.results)
    assert elapsed < 0.3 + 3.0, elapsed


# ------------------------------------------- per rank, and the startup check
def per_rank_ok(layers, kv_heads, head_dim, dtype_bytes, tp):
    return 2 * layers * max(1, kv_heads // tp) * head_dim * dtype_bytes


def startup_ok(pool_bytes, model, block_size, dtype_bytes):
    per_block = (block_size * 2 * model.num_kv_heads * model.head_dim
                 * dtype_bytes * model.num_layers)
    return max(int(pool_bytes // per_block) - 1, 0) * block_size


def test_the_new_solutions_pass_every_property(capsys):
    assert checks.check_kv_bytes_per_rank(per_rank_ok)
    assert checks.check_startup_max_model_len(startup_ok)
    out = capsys.readouterr().out
    assert "\u274c" not in out and out.count("\u2705") == 8


def test_the_new_stubs_print_one_line(capsys):
    def stub(*args):
        raise NotImplementedError

    for check in (checks.check_kv_bytes_per_rank,
                  checks.check_startup_max_model_len):
        report = check(stub)
        assert report.stub and len(report.results) == 1
    out = capsys.readouterr().out
    assert out.count("\n") == 2 and out.count("not implemented yet") == 2


@pytest.mark.parametrize("fn, passed, name", [
    (lambda L, H, D, b, tp: 2 * L * H * D * b // tp, [True, False, False],
     "heads split below one per rank"),
    (lambda L, H, D, b, tp: 2 * L * (H // tp) * D * b, [True, False, False],
     "zero heads per rank"),
    (lambda L, H, D, b, tp: 2 * L * H * D * b, [False, False, False],
     "tensor parallelism ignored"),
    (lambda L, H, D, b, tp: 2 * L * H * D * b / tp, [False, False, False],
     "a true division"),
    (lambda L, H, D, b, tp: L * max(1, H // tp) * D * b, [False, False, False],
     "K only"),
])
def test_each_per_rank_mistake_is_named(fn, passed, name):
    report = checks.check_kv_bytes_per_rank(fn, cases=20)
    assert verdicts(report)[:3] == passed
    failed = [r for r in report.results if not r.passed]
    assert failed and all(f"Diagnosis: {name}" in r.detail for r in failed)


def _blocks(P, m, B, db, layers=True):
    page = B * 2 * m.num_kv_heads * m.head_dim * db
    return P / (page * (m.num_layers if layers else 1))


@pytest.mark.parametrize("fn, got, name", [
    (lambda P, m, B, db: int(_blocks(P, m, B, db)) * B, "32,768",
     "null block forgotten"),
    (lambda P, m, B, db: int(_blocks(P, m, B, db)) * B - 1, "32,767",
     "the null block as one token"),
    (lambda P, m, B, db: max(int(_blocks(P, m, B, db)) - 2, 0) * B, "32,736",
     "the null block held back twice"),
    (lambda P, m, B, db: max(int(_blocks(P, m, B, db)) - 1, 0), "2,047",
     "blocks, not tokens"),
    (lambda P, m, B, db: max(int(_blocks(P, m, B, db, False)) - 1, 0) * B,
     "1,048,560", "layers not divided out"),
    (lambda P, m, B, db: max(round(_blocks(P, m, B, db)) - 1, 0) * B, None,
     "rounded to the nearest block"),
    (lambda P, m, B, db: max(int(_blocks(P, m, B, db) * B) - B, 0), None,
     "tokens, not whole blocks"),
    (lambda P, m, B, db: max(math.ceil(_blocks(P, m, B, db)) - 1, 0) * B,
     None, "divided twice with different rounding"),
])
def test_each_startup_mistake_is_named(fn, got, name):
    report = checks.check_startup_max_model_len(fn, cases=20)
    failed = [r for r in report.results if not r.passed]
    # (A tiny pool may show a second mistake: a negative length.)
    assert failed and f"Diagnosis: {name}" in failed[0].detail
    assert all("Diagnosis: " in r.detail for r in failed)
    if got:
        assert f"expected 32,752, got {got}" in report.results[0].detail


def test_the_startup_check_property_uses_the_library_check():
    # One block short of the longest: the library's check admits one token
    # more, and the line says so.
    report = checks.check_startup_max_model_len(
        lambda *a: max(startup_ok(*a) - a[2], 0), cases=5)
    assert not report.results[1].passed
    assert "also admits" in report.results[1].detail


def test_a_negative_length_for_a_tiny_pool_is_named():
    report = checks.check_startup_max_model_len(
        lambda P, m, B, db: (int(_blocks(P, m, B, db)) - 1) * B, cases=5)
    assert verdicts(report) == [True, True, False, True]
    assert "got -16. Diagnosis: a negative length" in report.results[2].detail


# ------------------------------------------------------------- issue 36
def test_subtracting_the_null_block_in_the_pool_count_is_named():
    report = checks.check_kv_pool_blocks(lambda *a: blocks_ok(*a) - 1, cases=20)
    assert not report.results[0].passed
    assert "expected 26,785, got 26,784" in report.results[0].detail
    assert "Diagnosis: the null block subtracted" in report.results[0].detail


def test_a_float_block_count_is_named_not_given_the_type_message():
    def float_count(total_mib, util, weight_gib, non_kv_gib, model, block_size, dtype_bytes):
        pool = total_mib * 2**20 * util - (weight_gib + non_kv_gib) * 2**30
        per_block = block_size * 2 * model.num_kv_heads * model.head_dim * dtype_bytes * model.num_layers
        return pool // per_block  # a float: 26785.0

    report = checks.check_kv_pool_blocks(float_count, cases=20)
    assert not any(r.passed for r in report.results)
    detail = report.results[0].detail
    assert "expected the integer 26,785, got 26785.0" in detail
    assert "Diagnosis: a float block count" in detail and "Hint" not in detail


def test_a_quotient_never_floored_is_named():
    def unfloored(total_mib, util, weight_gib, non_kv_gib, model, block_size, dtype_bytes):
        pool = total_mib * 2**20 * util - (weight_gib + non_kv_gib) * 2**30
        return pool / (block_size * 2 * model.num_kv_heads * model.head_dim * dtype_bytes * model.num_layers)

    report = checks.check_kv_pool_blocks(unfloored, cases=20)
    assert "Diagnosis: no floor" in report.results[0].detail


def test_no_hint_or_diagnosis_of_the_pool_count_recommends_two_floors():
    import inspect

    from pagedkv.checks import ch01_memory_budget as ch1

    source = inspect.getsource(ch1.check_kv_pool_blocks)
    assert "// layers" not in source and "then by the layer count" not in source
    for m in ch1.POOL_MISTAKES + [ch1.FLOAT_BLOCKS, ch1.UNFLOORED]:
        assert "then by" not in m.fix


def test_pool_and_startup_block_sizes_are_multiples_of_16():
    seen = []

    def spy_blocks(*args):
        seen.append(args[5])
        return blocks_ok(*args)

    def spy_startup(*args):
        seen.append(args[2])
        return startup_ok(*args)

    assert checks.check_kv_pool_blocks(spy_blocks, cases=50)
    assert checks.check_startup_max_model_len(spy_startup, cases=50)
    assert seen and all(b % 16 == 0 for b in seen), sorted(set(seen))


# ------------------------------------- the prediction: three instances on a card
from pagedkv.checks import ch01_shared_card as card  # noqa: E402


def test_the_card_prediction_passes_and_an_empty_one_prints_one_line(capsys):
    assert checks.check_card_prediction([8_027, 19_236, None])
    report = checks.check_card_prediction(None)
    assert report.stub and not report and report.picture is None
    assert capsys.readouterr().out.splitlines()[-1] == (
        "\u274c prediction: not made yet (write it into predicted_blocks, then run this cell)")


def test_the_card_model_replays_the_library_trace():
    assert card.run_card_trace() == [i["blocks"] for i in card.start_instances(card._STARTS)]
    models = [m.model() for m in card.CARD_MISTAKES]
    assert card.run_card_trace() not in models and len({repr(m) for m in models}) == len(models)


@pytest.mark.parametrize("predicted, said, name", [
    ([8_027, 8_027, None], "B: you predicted 8,027 blocks, the trace gives 19,236 blocks",
     "the same pool for both models"),
    ([7_909, None, None], "A: you predicted 7,909 blocks", "a share of the free memory"),
    ([8_027, None, None], "B: you predicted refuses to start", "other instances subtracted"),
    ([8_027, 19_236, 4_323], "C: you predicted 4,323 blocks, the trace gives refuses to start",
     "no free-memory check"),
    ([8_026, 19_235, None], "off by a block or two", "the null block held back"),
    ([8_027, 19_000, None], "B: you predicted 19,000", None),
])
def test_a_wrong_card_prediction_is_named_and_drawn(predicted, said, name):
    report = checks.check_card_prediction(predicted)
    detail = report.results[0].detail
    assert not report and said in detail
    assert (f"Diagnosis: {name}" in detail) if name else "Diagnosis" not in detail
    ax = report.picture.axes[0]  # plot_shared_card: one bar each
    assert [t.get_text() for t in ax.get_yticklabels()] == ["the trace", "your prediction"]
    assert "the trace: A 8,027 blocks, B 19,236 blocks, C refuses to start" in ax.get_xlabel()


@pytest.mark.parametrize("predicted", ["8027", [8027, 19236], [8027.0, 19236, None], [True, 1, None]])
def test_a_malformed_card_prediction_is_a_red_line(predicted):
    report = checks.check_card_prediction(predicted)
    assert not report and "expected a list of three block counts" in report.results[0].detail


def test_the_exercise_shows_the_trace_the_checker_runs():
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for folder in ("exercises", "solutions"):
        nb = json.loads((root / folder / "01_memory_budget.ipynb").read_text())
        text = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        assert card.CARD_TRACE in text, folder


# ---------------------------------------------- the design: two instances
@pytest.mark.parametrize("pair", [(0.51, 0.28), (0.55, 0.30), (0.60, 0.35), (0.70, 0.28), (0.51, 0.47)])
def test_any_valid_pair_of_utilizations_passes(pair):
    assert checks.check_two_instances(lambda: pair)


@pytest.mark.parametrize("pair, verdict, said, name", [
    ((0.50, 0.30), [True, False, True], "9,657 usable blocks hold 247 turns", "too few chat turns"),
    ((0.60, 0.40), [True, True, False], "Qwen asks for 31.86 GiB but only 30.86 GiB are free",
     "Qwen asks for more than is left"),
    ((0.55, 0.27), [True, True, False], "one request of 32,768 tokens needs 2,048",
     "a pool too small for max_model_len"),
    ((0.20, 0.30), [False, False, True], "Llama's weights and non-KV allowance fill",
     "a budget the weights fill"),
    ((0.51, 0.48), [True, True, False], "free when it starts", "Qwen asks for more than is left"),
])
def test_an_invalid_pair_fails_with_its_reason(pair, verdict, said, name):
    report = checks.check_two_instances(lambda: pair)
    assert verdicts(report) == verdict
    failed = [r for r in report.results if not r.passed]
    assert said in " ".join(r.detail for r in failed)
    assert f"Diagnosis: {name}" in " ".join(r.detail for r in failed)


@pytest.mark.parametrize("answer", [0.5, (0.5,), (0, 0.3), (0.5, 1.2), ("0.5", "0.3"), (True, 0.3)])
def test_a_malformed_design_is_a_red_line(answer):
    report = checks.check_two_instances(lambda: answer)
    assert not report and all("expected a pair" in r.detail for r in report.results)


def test_the_design_stub_prints_one_line(capsys):
    def stub():
        raise NotImplementedError

    report = checks.check_two_instances(stub)
    assert report.stub and capsys.readouterr().out.count("\n") == 1


def test_the_design_picture_shows_both_instances():
    fig = checks.plot_two_instances(0.55, 0.30)
    assert "Llama: 11,697 blocks, Qwen: 4,323 blocks" in fig.axes[0].get_xlabel()


# ------------------------------------------------------------ issue 45: gaps readers found

def test_a_whole_float_byte_count_passes_and_the_librarys_own_function_is_refused(capsys):
    from pagedkv import budget, checks

    assert checks.check_kv_bytes_per_token(lambda L, kvh, d, b: float(2 * L * kvh * d * b))
    assert "count K and V" not in capsys.readouterr().out

    def delegated(L, kvh, d, b):
        spec = budget.model_spec("Llama-3.1-8B")
        return budget.kv_bytes_per_token(spec) * 0 + 2 * L * kvh * d * b

    report = checks.check_kv_bytes_per_token(delegated)
    assert not report and len(report.results) == 1
    assert "it calls the library's budget.kv_bytes_per_token" in report.results[0].detail
    assert "Diagnosis: the library's own function" in report.results[0].detail


def _refused(report, name):
    assert not report and len(report.results) == 1, report.results
    detail = report.results[0].detail
    assert f"it calls the library's {name}" in detail, detail
    assert "Diagnosis: the library's own function" in detail, detail


def test_the_librarys_pool_count_inside_kv_pool_blocks_is_refused(capsys):
    from pagedkv import budget, checks

    def delegated(total_mib, util, weight_gib, non_kv_gib, model, bs, nbytes):
        pool = budget.kv_pool_bytes(total_mib * budget.MiB, util, weight_gib * budget.GiB,
                                    non_kv_gib * budget.GiB)
        return budget.num_gpu_blocks(pool, model, bs, {1: "fp8", 2: "bf16", 4: "fp32"}[nbytes])

    _refused(checks.check_kv_pool_blocks(delegated), "budget.num_gpu_blocks")
    out = capsys.readouterr().out
    assert "❌ kv_pool_blocks is your own code" in out, out

    def via_plan(total_mib, util, weight_gib, non_kv_gib, model, bs, nbytes):
        gpu = budget.GPUSpec("mine", total_mib, 1.0)
        return budget.plan(gpu=gpu, model=model, gpu_memory_utilization=util, weight_gib=weight_gib,
                           non_kv_gib=non_kv_gib, block_size=bs).num_blocks

    _refused(checks.check_kv_pool_blocks(via_plan), "budget.num_gpu_blocks")


def test_the_librarys_per_rank_and_startup_answers_are_refused():
    from pagedkv import budget, checks

    def per_rank(L, kvh, d, b, tp):
        spec = budget.ModelSpec("mine", L, kvh, kvh, d, 1, 4096, 4096)
        return budget.kv_bytes_per_token(spec, {1: "fp8", 2: "bf16", 4: "fp32"}[b], tp)

    _refused(checks.check_kv_bytes_per_rank(per_rank), "budget.kv_bytes_per_token")

    def startup(pool_bytes, model, bs, b):
        return budget.usable_max_model_len(pool_bytes, model, bs, {1: "fp8", 2: "bf16"}[b])

    _refused(checks.check_startup_max_model_len(startup), "budget.usable_max_model_len")
