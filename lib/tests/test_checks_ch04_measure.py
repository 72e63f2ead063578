"""Exercise 4's experiment (the whole row restaged): the rule, the copy ratio for it, the prediction."""

from pagedkv.block_tables import BlockTables
from pagedkv.checks.ch04_measure import check_whole_row_experiment as check, copy_ratio
from pagedkv.sim import TABLE_WORKLOAD, replay_table_writes


def new_only(table, num_blocks, req_index, new_block_ids, overwrite):
    start = 0 if overwrite else int(num_blocks[req_index])
    if start + len(new_block_ids) > table.gpu.shape[1]:
        raise ValueError("full")
    table.stage_write(req_index, start, new_block_ids)
    num_blocks[req_index] = start + len(new_block_ids)


def whole_row(table, num_blocks, req_index, new_block_ids, overwrite):
    start = 0 if overwrite else int(num_blocks[req_index])
    if start + len(new_block_ids) > table.gpu.shape[1]:
        raise ValueError("full")
    row = [int(x) for x in table.np[req_index, :start]] + list(new_block_ids)
    table.stage_write(req_index, 0, row)
    num_blocks[req_index] = len(row)


TRUE = copy_ratio(whole_row)


def arithmetic_ratio():
    """The ratio from the trace's lengths alone: the prompt staged once, then p+1, ..., n."""
    B, new, whole = TABLE_WORKLOAD.block_size, 0, 0
    for prompt, final in TABLE_WORKLOAD.lengths():
        p, n = -(-prompt // B), -(-final // B)
        new += n
        whole += p + sum(range(p + 1, n + 1))
    return whole / new


def test_the_driver_counts_what_the_arithmetic_says():
    assert replay_table_writes(new_only) == sum(-(-f // TABLE_WORKLOAD.block_size)
                                                for _, f in TABLE_WORKLOAD.lengths())
    assert abs(TRUE - arithmetic_ratio()) < 1e-9 and TRUE > 5


def test_the_driver_names_an_append_that_loses_a_block():
    def drops(table, num_blocks, req_index, new_block_ids, overwrite):
        new_only(table, num_blocks, req_index, new_block_ids[:-1] if len(new_block_ids) > 1
                 else new_block_ids, overwrite)

    try:
        replay_table_writes(drops)
    except ValueError as exc:
        assert "the request's blocks are" in str(exc)
    else:
        raise AssertionError("a lost block went unnoticed")


def test_right_rule_measurement_and_prediction_pass():
    report = check(whole_row, round(TRUE), TRUE, verbose=False)
    assert report.passed, [r.detail for r in report.results]


def test_new_ids_only_is_named_and_measured_for_itself():
    report = check(new_only, 20, 1.0, verbose=False)
    assert "Diagnosis: new ids only" in report.results[0].detail
    assert report.results[1].passed


def test_upside_down_and_twice_measured_ratios_are_named():
    assert "Diagnosis: the ratio upside down" in check(whole_row, 20, 1 / TRUE,
                                                       verbose=False).results[1].detail
    assert "Diagnosis: one function measured twice" in check(whole_row, 20, 1.0,
                                                             verbose=False).results[1].detail


def test_far_predictions_are_told_what_they_missed():
    low = check(whole_row, 2, TRUE, verbose=False).results[2]
    high = check(whole_row, 100, TRUE, verbose=False).results[2]
    assert not low.passed and "quadratic" not in low.detail and "prompt's blocks" in low.detail
    assert not high.passed and "staged once" in high.detail


def test_calling_the_library_is_refused_by_name():
    def cheat(table, num_blocks, req_index, new_block_ids, overwrite):
        BlockTables.append_block_ids(None, req_index, [new_block_ids], overwrite)

    report = check(cheat, 20, TRUE, verbose=False)
    assert "calls the library's BlockTables.append_block_ids" in report.results[0].detail
    assert "Diagnosis: a crash in your policy" in report.results[1].detail
