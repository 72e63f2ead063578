"""Exercises 4 and 5 under Model Runner V2: each plausible wrong answer is fed to its checker
and must get a red line naming its mistake; the library's own code is refused; a crash is a
red line; the solutions the site shows pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import pagedkv  # noqa: F401  -- fixes the Triton mode before the kernel below is defined
from pagedkv import checks
from pagedkv.block_tables import BlockTables
from pagedkv.checks import ch04_row_prediction as rp
from pagedkv.checks import ch05_tasks as tasks
from pagedkv.checks.ch04_rows import RowsOracle
from pagedkv.kernels.gather_block_tables import gather_block_tables_ref
from pagedkv.kernels.slot_mapping import compute_slot_mapping_ref
from pagedkv.request_state import RequestState
from tools.notebooks import load_cell_function

FAIL = "\u274c"
ROOT = Path(__file__).resolve().parents[2]


def solution(notebook: str, name: str):
    """The solution the site shows: a function through load_cell_function, a class by its cell."""
    if name[0].isupper():
        nb = json.loads((ROOT / "solutions" / notebook).read_text())
        src = next("".join(c["source"]) for c in nb["cells"] if f"class {name}" in "".join(c["source"]))
        namespace: dict = {}
        exec(src, namespace)  # noqa: S102 -- the repository's own solution notebook
        return namespace[name]
    return load_cell_function(ROOT / "solutions" / notebook, name)


def failed(report):
    return [r for r in report.results if not r.passed]


def named(report, name):
    return [r for r in failed(report) if f"Diagnosis: {name}" in r.detail]


# ---------------------------------------------------------------- exercise 4: rows
def test_the_solution_rows_pass():
    assert checks.check_request_rows(solution("04_block_table.ipynb", "RequestRows"))


@pytest.mark.parametrize("rule, name", [
    (dict(take="first"), "the first free row instead of the last"),
    (dict(take="lowest"), "the lowest free row instead of the last"),
    (dict(give_back="front"), "a freed row queued behind the others"),
    (dict(free_on_remove=False), "a row never freed"),
    (dict(dense=True), "a row handed out twice"),
    (dict(batch="sorted"), "the rows sorted"),
    (dict(batch="positions"), "batch positions instead of rows"),
    (dict(unknown="raise"), "an unknown request refused with an exception"),
])
def test_each_rows_mistake_is_named(rule, name):
    report = checks.check_request_rows(lambda n: RowsOracle(n, **rule))
    assert not report and named(report, name), [r.line() for r in failed(report)]


def test_a_class_that_runs_the_librarys_request_state_is_refused(capsys):
    class Mine(RequestState):
        pass

    report = checks.check_request_rows(Mine)
    assert not report and len(report.results) == 1
    assert "is your own code" in report.results[0].name and "RequestState" in report.results[0].detail


def test_the_rows_stub_prints_one_line(capsys):
    class Stub:
        def __init__(self, n):
            pass

        def add_request(self, r):
            raise NotImplementedError

        def remove_request(self, r):
            raise NotImplementedError

        def idx_mapping(self, r):
            raise NotImplementedError

    report = checks.check_request_rows(Stub)
    assert report.stub and capsys.readouterr().out.count(FAIL) == 1


def test_a_crashing_rows_class_is_a_red_line():
    class Crash(RowsOracle):
        def add_request(self, req_id):
            return {}[req_id]

    report = checks.check_request_rows(Crash)
    assert not report and all("raised KeyError" in r.detail for r in failed(report)[:1])


# ---------------------------------------------------------- exercise 4: staged append
def _append(start="tail", update=True, whole=False, early=False, direct=False, apply=False):
    def fn(table, num_blocks, r, ids, overwrite):
        s = {"tail": 0 if overwrite else int(num_blocks[r]), "zero": 0, "append": int(num_blocks[r])}[start]
        e = s + len(ids)
        if early:
            num_blocks[r] = e
        if e > table.gpu.shape[1]:
            raise ValueError(f"row {r} overflows")
        if direct:
            table.gpu[r, s:e] = torch.tensor(ids, dtype=torch.int32)
        elif whole:
            row = table.np[r].copy()
            row[s:e] = ids
            table.stage_write(r, 0, row)
        else:
            table.stage_write(r, s, ids)
        if apply:
            table.apply_write()
        if update:
            num_blocks[r] = e
    return fn


def test_the_solution_append_passes():
    assert checks.check_staged_append(solution("04_block_table.ipynb", "append_block_ids"))


@pytest.mark.parametrize("kwargs, name", [
    (dict(start="append"), "overwrite ignored"),
    (dict(start="zero"), "an append that overwrites"),
    (dict(update=False), "the row length not updated"),
    (dict(whole=True), "the whole row staged"),
    (dict(early=True), "a refused append changed the row length"),
    (dict(direct=True), "written to the device directly"),
    (dict(apply=True), "applied inside the append"),
])
def test_each_append_mistake_is_named(kwargs, name):
    report = checks.check_staged_append(_append(**kwargs))
    assert not report and named(report, name), [r.line() for r in failed(report)]


def test_an_append_through_the_librarys_block_tables_is_refused():
    def cheat(table, num_blocks, r, ids, overwrite):
        state = RequestState(table.num_rows)
        for k in range(table.num_rows):
            state.add_request(str(k))
        BlockTables(state, [16], [table.gpu.shape[1]]).append_block_ids(r, [ids], overwrite)

    report = checks.check_staged_append(cheat)
    assert not report and "BlockTables.append_block_ids" in report.results[0].detail


def test_a_crashing_append_is_a_red_line_on_every_property():
    report = checks.check_staged_append(lambda *a: 1 / 0)
    assert len(report.results) == 5 and all("ZeroDivisionError" in r.detail for r in report.results)


# ------------------------------------------------------------ exercise 4: prediction
def test_the_row_prediction_is_the_librarys_trace():
    assert rp.run_row_trace() == rp.rows_model() == [1, 5, 4, 2, 3]
    assert checks.check_row_prediction([1, 5, 4, 2, 3])
    assert checks.check_row_prediction(None).stub


@pytest.mark.parametrize("m", rp.ROW_PREDICTION_MISTAKES, ids=lambda m: m.name)
def test_each_row_prediction_mistake_is_named_and_drawn(m):
    report = checks.check_row_prediction(m.model())
    assert not report and f"Diagnosis: {m.name}" in report.results[0].detail
    assert "What the trace leads to" in report.picture


def test_the_exercise_shows_the_row_trace_the_checker_runs():
    for folder in ("exercises", "solutions"):
        nb = json.loads((ROOT / folder / "04_block_table.ipynb").read_text())
        text = "".join("".join(c["source"]) for c in nb["cells"])
        assert rp.ROW_TRACE in text, folder


# -------------------------------------------------------------- exercise 5: the gather
def _gather(rows="idx", mask=True, pad=True, refuse=True, empty=False):
    def fn(table, num_blocks, idx, padded):
        if refuse:
            for r in idx.tolist():
                if not 0 <= r < table.shape[0]:
                    raise ValueError(f"row {r} is out of range")
            dup = [r for r in idx.tolist() if idx.tolist().count(r) > 1]
            if dup:
                raise ValueError(f"row {dup[0]} appears twice")
        n = idx.numel()
        src = {"idx": idx.long(), "positions": torch.arange(n, device=table.device),
               "sorted": idx.long().sort().values}[rows]
        alloc = torch.empty if empty else torch.zeros
        out = alloc((padded if pad else n, table.shape[1]), dtype=torch.int32, device=table.device)
        live = torch.arange(table.shape[1], device=table.device)[None, :] < num_blocks[src][:, None]
        out[:n] = torch.where(live, table[src], 0) if mask else table[src]
        return out
    return fn


def test_the_solution_gather_passes():
    assert checks.check_gather_block_tables(
        solution("05_slot_mapping.ipynb", "gather_block_tables"))


@pytest.mark.parametrize("kwargs, name", [
    (dict(rows="positions"), "gathered by batch position instead of row"),
    (dict(rows="sorted"), "the rows in table order"),
    (dict(mask=False), "a stale tail copied"),
    (dict(pad=False), "padding rows missing"),
    (dict(empty=True), "padding rows not zeroed"),
    (dict(refuse=False), "a repeated row gathered twice"),
])
def test_each_gather_mistake_is_named(kwargs, name):
    report = checks.check_gather_block_tables(_gather(**kwargs))
    assert not report and named(report, name), [r.line() for r in failed(report)]


def test_a_gather_that_refuses_only_repeats_is_told_about_row_minus_one():
    base = _gather(refuse=False)

    def fn(table, num_blocks, idx, padded):
        if len(set(idx.tolist())) != idx.numel():
            raise ValueError(f"row {idx.tolist()[0]} twice")
        return base(table, num_blocks, idx, padded)

    report = checks.check_gather_block_tables(fn)
    assert named(report, "row -1 read as the last row")


@pytest.mark.parametrize("cheat", [gather_block_tables_ref, pagedkv.kernels.gather_block_tables])
def test_the_librarys_gather_is_refused(cheat):
    report = checks.check_gather_block_tables(cheat)
    assert not report and "is your own code" in report.results[0].name


@triton.jit
def _gather_kernel(idx_ptr, src_ptr, src_stride, n_ptr, dst_ptr, dst_stride, num_reqs, width,
                   CHUNK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.arange(0, CHUNK)
    real = i < num_reqs
    row = tl.load(idx_ptr + i, mask=real, other=0).to(tl.int64)
    n = tl.load(n_ptr + row, mask=real, other=0)
    ids = tl.load(src_ptr + row * src_stride + cols, mask=(cols < width) & (cols < n) & real, other=0)
    tl.store(dst_ptr + i * dst_stride + cols, ids, mask=cols < width)


def _kernel_gather(table, num_blocks, idx, padded):
    rows = idx.tolist()
    if any(not 0 <= r < table.shape[0] for r in rows) or len(set(rows)) != len(rows):
        raise ValueError(f"row {rows} refused")
    out = torch.empty((padded, table.shape[1]), dtype=torch.int32, device=table.device)
    _gather_kernel[(padded,)](idx, table, table.stride(0), num_blocks, out, out.stride(0), len(rows),
                              table.shape[1], CHUNK=triton.next_power_of_2(table.shape[1]))
    return out


def test_a_triton_gather_passes_the_kernel_check():
    assert checks.check_gather_kernel(_kernel_gather)


def test_a_pytorch_gather_fails_the_kernel_property():
    report = checks.check_gather_kernel(_gather())
    assert [r.passed for r in report.results][-1] is False and named(report, "no kernel")


# ------------------------------------------------- exercise 5: slots from the gathered table
def _entries(qsl, n, right=True):
    return torch.searchsorted(qsl, torch.arange(n, device=qsl.device), right=right) - 1


def _slots(entries="right", column=lambda p, B: p // B, offset=lambda p, B: p % B, wide=True):
    def fn(table, qsl, pos, B):
        e = torch.arange(pos.numel(), device=pos.device) if entries == "token" else \
            _entries(qsl, pos.numel(), entries == "right")
        blocks = table[e, column(pos, B)]
        return (blocks.long() * B + offset(pos, B)) if wide else (blocks * B + offset(pos, B).int()).long()
    return fn


def test_the_solution_gathered_slots_pass():
    assert checks.check_gathered_slot_mapping(
        solution("05_slot_mapping.ipynb", "slot_mapping_gathered"))


@pytest.mark.parametrize("kwargs, name", [
    (dict(entries="token"), "one row per token"),
    (dict(entries="left"), "a token at an entry's start given to the entry before"),
    (dict(column=lambda p, B: (p + 1) // B), "off by one at a block boundary"),
    (dict(offset=lambda p, B: p), "the position used as the offset"),
    (dict(wide=False), "int32 wrap"),
])
def test_each_gathered_slot_mistake_is_named(kwargs, name):
    report = checks.check_gathered_slot_mapping(_slots(**kwargs))
    assert not report and named(report, name), [r.line() for r in failed(report)]


def test_the_librarys_slot_mapping_is_refused():
    def cheat(table, qsl, pos, B):
        return compute_slot_mapping_ref(table, _entries(qsl, pos.numel()), pos, B)

    report = checks.check_gathered_slot_mapping(cheat)
    assert not report and "compute_slot_mapping_ref" in report.results[0].detail


# ------------------------------------------------------------ exercise 5: the prediction
def test_the_slot_prediction_runs_on_model_runner_v2():
    blocks, entries, positions, slots = tasks.run_slot_trace()
    assert blocks == {"B": [5, 11], "D": [2, 7], "C": [4, 8, 1]}
    assert slots == [23, 44, 45, 46, 29, 5]


@pytest.mark.parametrize("m", tasks.TRACE_MISTAKES, ids=lambda m: m.name)
def test_each_misread_step_is_named(m):
    report = checks.check_slot_prediction(m.model(tasks._ENTRIES, tasks._POSITIONS))
    assert not report and f"Diagnosis: {m.name}" in report.results[0].detail
