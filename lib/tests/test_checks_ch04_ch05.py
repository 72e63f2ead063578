"""The exercise 4 and 5 checkers: right answers pass, each kind of wrong answer fails the right property."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import pagedkv  # noqa: F401  -- fixes the Triton mode before the kernels below are defined
from pagedkv import checks


def verdicts(report):
    return [r.passed for r in report.results]


# -- exercise 5, first rung: the slot mapping in numpy --------------------------------------------


def slots_np(block_table, req_indices, positions, block_size):
    real = req_indices >= 0
    rows = np.where(real, req_indices, 0)
    blocks = block_table[rows, positions // block_size].astype(np.int64)
    return np.where(real, blocks * block_size + positions % block_size, -1).astype(np.int64)


def test_numpy_solution_passes_every_property(capsys):
    assert checks.check_slot_mapping_numpy(slots_np)
    out = capsys.readouterr().out
    assert "\u274c" not in out and out.count("\u2705") == 6


def test_numpy_int32_arithmetic_fails_dtype_and_overflow_only():
    def int32_slots(block_table, req_indices, positions, block_size):
        real = req_indices >= 0
        blocks = block_table[np.where(real, req_indices, 0), positions // block_size]  # stays int32
        return np.where(real, blocks * block_size + (positions % block_size).astype(np.int32), -1).astype(np.int32)

    report = checks.check_slot_mapping_numpy(int32_slots)
    assert verdicts(report) == [True, False, True, False, True, True]
    assert "expected dtype int64, got int32" in report.results[1].detail
    assert "Diagnosis: int32 wrap" in report.results[3].detail


def test_numpy_forgetting_padding_fails_padding_and_random():
    def no_padding(block_table, req_indices, positions, block_size):
        blocks = block_table[req_indices, positions // block_size].astype(np.int64)
        return blocks * block_size + positions % block_size

    report = checks.check_slot_mapping_numpy(no_padding)
    assert verdicts(report) == [True, True, False, True, False, True]
    assert "expected slot -1" in report.results[2].detail
    assert "Diagnosis: padding looked up in row -1" in report.results[2].detail


def test_numpy_a_wrong_ordinary_token_is_not_reported_under_padding():
    def ceil_column(block_table, req_indices, positions, block_size):
        real = req_indices >= 0
        cols = np.minimum(-(-positions // block_size), block_table.shape[1] - 1)
        blocks = block_table[np.where(real, req_indices, 0), cols].astype(np.int64)
        return np.where(real, blocks * block_size + positions % block_size, -1)

    report = checks.check_slot_mapping_numpy(ceil_column)
    assert verdicts(report)[2] is True  # padding tokens are right: the padding property holds
    assert verdicts(report)[4] is False


@pytest.mark.parametrize("slot, name", [
    (lambda b, p, B: b * B, "offset forgotten"),
    (lambda b, p, B: b + p % B, "block id not scaled"),
])
def test_numpy_slot_formula_mistakes_are_named(slot, name):
    def fn(block_table, req_indices, positions, block_size):
        real = req_indices >= 0
        blocks = block_table[np.where(real, req_indices, 0), positions // block_size].astype(np.int64)
        return np.where(real, slot(blocks, positions, block_size), -1).astype(np.int64)

    report = checks.check_slot_mapping_numpy(fn)
    failed = [r for r in report.results if not r.passed]
    assert failed and all(f"Diagnosis: {name}" in r.detail for r in failed)


def test_numpy_mutating_the_input_is_caught():
    def mutates(block_table, req_indices, positions, block_size):
        real = req_indices >= 0
        req_indices[~real] = 0  # in place: the caller's array changes
        blocks = block_table[req_indices, positions // block_size].astype(np.int64)
        return np.where(real, blocks * block_size + positions % block_size, -1)

    report = checks.check_slot_mapping_numpy(mutates)
    assert verdicts(report) == [True, True, True, True, True, False]
    assert "req_indices was modified" in report.results[5].detail


def test_numpy_stub_crash_and_wrong_type_are_red_lines():
    def stub(*args):
        raise NotImplementedError

    report = checks.check_slot_mapping_numpy(stub)
    assert not report and report.stub and len(report.results) == 1
    assert "not implemented yet" in report.results[0].detail
    report = checks.check_slot_mapping_numpy(lambda t, r, p, b: [0] * len(r))
    assert verdicts(report)[1] is False and "expected a numpy array, got list" in report.results[1].detail
    report = checks.check_slot_mapping_numpy(lambda t, r, p, b: t[r + 10])
    assert not report and "raised IndexError" in report.results[0].detail


# -- chapter 5: the kernels --------------------------------------------------------------------------


@triton.jit
def _slots_kernel(table_ptr, row_stride, req_ptr, pos_ptr, out_ptr, n, block_size,
                  TILE: tl.constexpr, WIDEN: tl.constexpr, HANDLE_PADDING: tl.constexpr,
                  MASK_LOAD: tl.constexpr):
    offs = tl.program_id(0) * TILE + tl.arange(0, TILE)
    in_range = offs < n
    req = tl.load(req_ptr + offs, mask=in_range, other=-1)
    pos = tl.load(pos_ptr + offs, mask=in_range, other=0)
    is_real = req >= 0
    if HANDLE_PADDING and MASK_LOAD:
        load_mask = in_range & is_real
    else:
        load_mask = in_range
    block = tl.load(table_ptr + req * row_stride + pos // block_size, mask=load_mask, other=0)
    if WIDEN:
        block = block.to(tl.int64)
    slot = block * block_size + pos % block_size
    if HANDLE_PADDING:
        slot = tl.where(is_real, slot, -1)
    tl.store(out_ptr + offs, slot, mask=in_range)


def make_slots_fn(widen=True, handle_padding=True, tile=64, one_program=False, mask_load=True):
    def fn(block_table, req_indices, positions, block_size):
        n = req_indices.numel()
        out = torch.empty(n, dtype=torch.int64, device=block_table.device)
        grid = (1,) if one_program else (triton.cdiv(n, tile),)
        _slots_kernel[grid](block_table, block_table.stride(0), req_indices, positions, out, n, block_size,
                            TILE=tile, WIDEN=widen, HANDLE_PADDING=handle_padding, MASK_LOAD=mask_load)
        return out

    return fn


@triton.jit
def _kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, width, BLOCK: tl.constexpr,
               SKIP_PADDING: tl.constexpr, SHIFT: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    if SKIP_PADDING:
        mask = mask & (slot >= 0)
    src = t * width + cols
    dst = (slot + SHIFT) * width + cols
    tl.store(kc_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(vc_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


def make_kv_fn(skip_padding=True, shift=0):
    def fn(key, value, key_cache, value_cache, slot_mapping):
        width = key.shape[1] * key.shape[2]
        _kv_kernel[(key.shape[0],)](key, value, key_cache, value_cache, slot_mapping, width,
                                    BLOCK=triton.next_power_of_2(width), SKIP_PADDING=skip_padding, SHIFT=shift)

    return fn


def test_ch05_slot_kernel_solution_passes(capsys):
    assert checks.check_slot_mapping_kernel(make_slots_fn())
    out = capsys.readouterr().out
    assert "\u274c" not in out and out.count("\u2705") == 7


def test_ch05_int32_multiply_fails_only_the_overflow_property():
    report = checks.check_slot_mapping_kernel(make_slots_fn(widen=False))
    assert verdicts(report) == [True, True, True, True, False, True, True]
    assert "Diagnosis: int32 wrap" in report.results[4].detail


def test_ch05_an_unmasked_table_load_is_caught_although_its_value_is_discarded():
    report = checks.check_slot_mapping_kernel(make_slots_fn(mask_load=False))
    assert verdicts(report) == [True, True, False, True, True, True, True]
    assert "loaded 3 value(s) from outside the block table" in report.results[2].detail
    assert "Diagnosis: padding tokens read the table" in report.results[2].detail


def test_ch05_plain_torch_answers_fail_the_launch_property():
    def torch_slots(block_table, req_indices, positions, block_size):
        real = req_indices >= 0
        rows = torch.where(real, req_indices, 0)
        blocks = block_table[rows, positions // block_size].long()
        return torch.where(real, blocks * block_size + positions % block_size, -1)

    report = checks.check_slot_mapping_kernel(torch_slots)
    assert verdicts(report) == [True] * 6 + [False]
    assert "Diagnosis: no kernel" in report.results[6].detail

    def torch_kv(key, value, key_cache, value_cache, slot_mapping):
        real = slot_mapping >= 0
        key_cache.view(-1, *key.shape[1:])[slot_mapping[real]] = key[real]
        value_cache.view(-1, *value.shape[1:])[slot_mapping[real]] = value[real]

    report = checks.check_kv_write_kernel(torch_kv)
    assert verdicts(report) == [True] * 6 + [False]
    assert "ran no Triton kernel" in report.results[6].detail


def test_ch05_no_padding_handling_is_caught_without_a_crash():
    report = checks.check_slot_mapping_kernel(make_slots_fn(handle_padding=False))
    assert verdicts(report)[2] is False and verdicts(report)[5] is False
    assert "it read outside the block table" in report.results[2].detail


def test_ch05_one_program_misses_tokens():
    report = checks.check_slot_mapping_kernel(make_slots_fn(one_program=True))
    assert verdicts(report)[3] is False  # 1,000 tokens, only the first 64 mapped
    assert verdicts(report)[0] is True


def test_ch05_slot_kernel_hang_and_wrong_type_are_red_lines():
    def hangs(*args):
        while True:
            pass

    report = checks.check_slot_mapping_kernel(hangs, timeout=0.2)
    assert not report and all("no answer within" in r.detail for r in report.results[:-1])
    report = checks.check_slot_mapping_kernel(lambda t, r, p, b: r.tolist())
    assert not report and "expected a torch.Tensor, got list" in report.results[0].detail


def test_ch05_kv_kernel_solution_passes(capsys):
    assert checks.check_kv_write_kernel(make_kv_fn())
    out = capsys.readouterr().out
    assert "\u274c" not in out and out.count("\u2705") == 7


def test_ch05_kv_kernel_writing_padding_hits_the_guard():
    report = checks.check_kv_write_kernel(make_kv_fn(skip_padding=False))
    assert verdicts(report)[1] is False
    assert "wrote before key_cache's memory" in report.results[1].detail
    assert "Diagnosis: padding written" in report.results[1].detail


def test_ch05_kv_kernel_off_by_one_slot_fails_every_write_property():
    report = checks.check_kv_write_kernel(make_kv_fn(shift=1))
    assert verdicts(report) == [False, True, False, False, False, False, True]
    assert "should hold token" in report.results[0].detail
    assert "Diagnosis: off by one slot" in report.results[0].detail


def test_ch05_kv_stub_is_not_implemented():
    def stub(*args):
        raise NotImplementedError

    report = checks.check_kv_write_kernel(stub)
    assert not report and len(report.results) == 1 and report.stub
    assert "not implemented yet" in report.results[0].detail
    report = checks.check_slot_mapping_kernel(stub)
    assert not report and len(report.results) == 1 and report.stub


# -- issue 20: answers that used to pass, messages, and the cost of a hang ----------------------------


@triton.jit
def _nothing_kernel(x_ptr):
    pass


def test_ch05_torch_answers_with_a_do_nothing_kernel_fail_the_kernel_property():
    def cheat_slots(block_table, req_indices, positions, block_size):
        real = req_indices >= 0
        blocks = block_table[torch.where(real, req_indices, 0), positions // block_size].long()
        out = torch.where(real, blocks * block_size + positions % block_size, -1)
        _nothing_kernel[(1,)](out)
        return out

    report = checks.check_slot_mapping_kernel(cheat_slots)
    assert verdicts(report) == [True] * 6 + [False]
    assert "with every Triton launch skipped, it still returned the right slots" in report.results[6].detail
    assert "Diagnosis: computed outside the kernel" in report.results[6].detail

    def cheat_kv(key, value, key_cache, value_cache, slot_mapping):
        real = slot_mapping >= 0
        key_cache.view(-1, *key.shape[1:])[slot_mapping[real]] = key[real]
        value_cache.view(-1, *value.shape[1:])[slot_mapping[real]] = value[real]
        _nothing_kernel[(1,)](key)

    report = checks.check_kv_write_kernel(cheat_kv)
    assert verdicts(report) == [True] * 6 + [False]
    assert "with every Triton launch skipped, slots" in report.results[6].detail
    assert "Diagnosis: computed outside the kernel" in report.results[6].detail


@triton.jit
def _key_only_kernel(k_ptr, kc_ptr, slot_ptr, width, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    cols = tl.arange(0, BLOCK)
    mask = (cols < width) & (slot >= 0)
    tl.store(kc_ptr + slot * width + cols, tl.load(k_ptr + t * width + cols, mask=mask), mask=mask)


def test_ch05_a_value_never_written_is_named_as_such():
    def key_only(key, value, key_cache, value_cache, slot_mapping):
        width = key.shape[1] * key.shape[2]
        _key_only_kernel[(key.shape[0],)](key, key_cache, slot_mapping, width,
                                          BLOCK=triton.next_power_of_2(width))

    report = checks.check_kv_write_kernel(key_only)
    detail = report.results[0].detail
    assert "value_cache slot" in detail and "Diagnosis: a cache never written" in detail, detail
    assert "dtype" not in detail


def test_ch05_a_hang_costs_one_timeout_per_check():
    import time

    def hangs(*args):
        while True:
            pass

    for check in (checks.check_slot_mapping_kernel, checks.check_kv_write_kernel):
        start = time.perf_counter()
        report = check(hangs, timeout=0.3)
        elapsed = time.perf_counter() - start
        assert not report and all("no answer within 0.3 s" in r.detail for r in report.results)
        assert elapsed < 0.3 + 3.0, (check.__name__, elapsed)


# -- exercise 4: condensing the batch, and what the table costs ----------------------------------


def condense(table, num_reqs, finished_rows, *, clear=True, reverse=False, stable=False,
             skip_finished=True):
    """vLLM's InputBatch.condense on a BlockTable, or one of its common mistakes."""
    if clear:
        for r in finished_rows:
            table.clear_row(r)
    moves = []
    if stable:
        live = [r for r in range(num_reqs) if r not in finished_rows]
        for tgt, src in enumerate(live):
            if src != tgt:
                table.move_row(src, tgt)
                moves.append((src, tgt))
        return moves
    holes, last = sorted(finished_rows), num_reqs - 1
    while holes:
        while skip_finished and last in holes:
            last -= 1
        if holes[0] >= last:
            break
        hole = holes.pop(0)
        src, tgt = (hole, last) if reverse else (last, hole)
        table.move_row(src, tgt)
        moves.append((src, tgt))
        last -= 1
    return moves


def by_hand(table, num_reqs, finished_rows):
    """Moves the cells with numpy: the lengths stay where they were."""
    for r in finished_rows:
        table.clear_row(r)
    holes, last, moves = sorted(finished_rows), num_reqs - 1, []
    while holes:
        while last in holes:
            last -= 1
        if holes[0] >= last:
            break
        hole = holes.pop(0)
        table.np[hole] = table.np[last]
        table.np[last] = 0
        moves.append((last, hole))
        last -= 1
    return moves


def test_condense_solution_passes(capsys):
    assert checks.check_condense(condense)
    out = capsys.readouterr().out
    assert "\u274c" not in out and out.count("\u2705") == 5


def test_condense_stub_prints_one_line(capsys):
    def stub(*args):
        raise NotImplementedError

    report = checks.check_condense(stub)
    assert report.stub and len(report.results) == 1
    assert capsys.readouterr().out.count("\n") == 1


@pytest.mark.parametrize("kwargs, name, verdict", [
    (dict(reverse=True), "moved the wrong way", [False, False, True, False, False]),
    (dict(clear=False), "stale rows left", [False, False, False, False, False]),
    (dict(stable=True), "the order kept", [False, False, True, False, False]),
    (dict(skip_finished=False), "a finished row moved", [True, False, False, False, False]),
])
def test_each_condense_mistake_is_named(kwargs, name, verdict):
    report = checks.check_condense(lambda *a: condense(*a, **kwargs))
    assert verdicts(report) == verdict
    failed = [r for r in report.results if not r.passed]
    assert all(f"Diagnosis: {name}" in r.detail for r in failed)


def test_condense_lengths_left_behind_are_named():
    report = checks.check_condense(by_hand)
    assert verdicts(report)[3] is False
    assert "Diagnosis: num_blocks_per_row not moved" in report.results[3].detail


def test_condense_must_return_the_moves():
    report = checks.check_condense(lambda *a: condense(*a) and None)
    assert not report
    assert "expected the list of moves" in report.results[0].detail


def table_bytes(max_num_seqs, max_model_len, block_size, *, align=True, floor=False,
                step=None, pad=1):
    blocks = max_model_len // block_size if floor else -(-max_model_len // block_size)
    if align:
        s = step(block_size) if step else 128 // math.gcd(128, block_size)
        blocks = -(-blocks // s) * s
    return max_num_seqs * blocks * 4, (max_num_seqs + pad) * max_model_len * 4


def test_table_bytes_solution_passes(capsys):
    assert checks.check_table_bytes(table_bytes)
    out = capsys.readouterr().out
    assert "\u274c" not in out and out.count("\u2705") == 5


def test_table_bytes_stub_prints_one_line():
    def stub(*args):
        raise NotImplementedError

    report = checks.check_table_bytes(stub)
    assert report.stub and len(report.results) == 1


@pytest.mark.parametrize("kwargs, name, verdict", [
    (dict(align=False), "no alignment", [True, False, False, True, False]),
    (dict(floor=True), "floor instead of cdiv", [True, False, False, True, False]),
    (dict(step=lambda b: max(128 // b, 1)), "alignment step 128 // block_size",
     [True, False, True, True, False]),
    (dict(pad=0), "SGLang's padding row forgotten", [False, True, True, False, False]),
])
def test_each_table_bytes_mistake_is_named(kwargs, name, verdict):
    report = checks.check_table_bytes(lambda *a: table_bytes(*a, **kwargs))
    assert verdicts(report) == verdict
    failed = [r for r in report.results if not r.passed]
    assert all(f"Diagnosis: {name}" in r.detail for r in failed)


def test_table_bytes_wrong_types_are_red_lines():
    report = checks.check_table_bytes(lambda *a: table_bytes(*a)[0])
    assert not report and "expected (vllm_bytes, sglang_bytes)" in report.results[0].detail
    report = checks.check_table_bytes(lambda *a: tuple(x / 1 for x in table_bytes(*a)))
    assert not report and "expected an integer, got float" in report.results[0].detail


# -- exercise 4, issue 36: gaps closed, and the prediction task -----------------------------------


def test_condense_that_takes_the_finished_rows_as_sorted_is_named():
    def unsorted(table, num_reqs, finished_rows):
        for r in finished_rows:
            table.clear_row(r)
        holes, last, moves = list(finished_rows), num_reqs - 1, []  # no sort
        while holes:
            while last in holes:
                last -= 1
            if holes[0] >= last:
                break
            hole = holes.pop(0)
            table.move_row(last, hole)
            moves.append((last, hole))
            last -= 1
        return moves

    report = checks.check_condense(unsorted)
    assert verdicts(report)[:2] == [True, False]
    assert "finished_rows [5, 0, 2] (in that order)" in report.results[1].detail
    assert "Diagnosis: finished rows taken as sorted" in report.results[1].detail
    assert "Diagnosis: finished rows taken as sorted" in report.results[4].detail


def test_rounding_the_window_to_128_tokens_first_is_named_as_such():
    def window_first(max_num_seqs, max_model_len, block_size):
        width = -(-(-(-max_model_len // 128) * 128) // block_size)
        return max_num_seqs * width * 4, (max_num_seqs + 1) * max_model_len * 4

    report = checks.check_table_bytes(window_first)
    failed = [r for r in report.results if not r.passed]
    assert verdicts(report) == [True, False, True, True, False]
    assert all("Diagnosis: window rounded to 128 tokens first" in r.detail for r in failed)
    assert not any("cdiv(" in r.detail or "128 // block_size" in r.detail.split("Diagnosis")[1]
                   for r in failed)


def test_table_bytes_block_sizes_are_multiples_of_16():
    from pagedkv.checks import ch04_block_table as ch4

    seen = []
    ch4_bytes = ch4.table_bytes_reference

    def spy(max_num_seqs, max_model_len, block_size):
        seen.append(block_size)
        return ch4_bytes(max_num_seqs, max_model_len, block_size)

    assert checks.check_table_bytes(spy)
    assert seen and all(b % 16 == 0 for b in seen)
    assert all(b % 16 == 0 for _, _, b in ch4._PROBES)


def test_the_exercise_does_not_import_what_it_asks_for():
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    nb = json.loads((root / "exercises" / "04_block_table.ipynb").read_text())
    code = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert "block_table_width" not in code


from pagedkv.checks import ch04_table_prediction as tp  # noqa: E402

ROWS = [[3, 7, 11], [5, 6, 13], [4, 9, 2], [12, 10], []]


def test_the_table_prediction_passes_and_an_empty_one_prints_one_line(capsys):
    assert checks.check_table_prediction(ROWS)
    assert checks.check_table_prediction([tuple(r) for r in ROWS])
    report = checks.check_table_prediction(None)
    assert report.stub and not report and report.picture is None
    assert capsys.readouterr().out.splitlines()[-1] == (
        "\u274c prediction: not made yet (write it into predicted_rows, then run this cell)")


def test_the_table_model_replays_the_library_trace():
    table = tp.run_table_trace()
    assert tp.table_model() == [table.row(r) for r in range(5)] == ROWS
    models = [m.model() for m in tp.TABLE_MISTAKES]
    assert ROWS not in models and len({repr(m) for m in models}) == len(models)


@pytest.mark.parametrize("predicted, said, name", [
    ([[3, 7, 11], [5, 6, 13], [4, 9, 2], [12, 10], [5, 6]], "row 4 (-): you predicted [5, 6]",
     "the moved row left in place"),
    ([[3, 7, 11], [13], [4, 9, 2], [12, 10], []], "row 1 (t): you predicted [13]",
     "the length left behind"),
    ([[11], [13], [4, 9, 2], [12, 10], []], "row 0 (p): you predicted [11]",
     "an append that overwrites"),
    ([[3, 7, 11], [5, 6, 13], [4, 9, 2], [8, 12, 10], []], "row 3 (u)", None),
])
def test_a_wrong_table_prediction_is_named_and_drawn_side_by_side(predicted, said, name):
    report = checks.check_table_prediction(predicted)
    detail = report.results[0].detail
    assert not report and said in detail
    assert (f"Diagnosis: {name}" in detail) if name else "Diagnosis" not in detail
    picture = report.picture
    assert picture.count("class='pagedkv-block-table'") == 2  # render_block_table, twice
    assert "What the trace leads to" in picture and "Your prediction" in picture
    assert picture.index("the trace") < picture.index("your prediction")


@pytest.mark.parametrize("predicted", ["rows", [[1]] * 4, [[1.5], [], [], [], []], 7])
def test_a_malformed_table_prediction_is_a_red_line(predicted):
    report = checks.check_table_prediction(predicted)
    assert not report and "expected rows 0-4 as a list of 5 lists" in report.results[0].detail


def test_the_exercise_no_longer_shows_the_v1_table_trace():
    # Exercise 4 predicts Model Runner V2's rows now (ch04_row_prediction); the V1 runner's
    # table trace stays a library checker, no longer a task of the notebook.
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for folder in ("exercises", "solutions"):
        nb = json.loads((root / folder / "04_block_table.ipynb").read_text())
        text = "".join("".join(c["source"]) for c in nb["cells"])
        assert tp.TABLE_TRACE not in text and "check_row_prediction" in text, folder
