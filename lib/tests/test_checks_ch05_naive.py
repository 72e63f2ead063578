"""Exercise 5 without skeletons: a newcomer's plausible first attempts fail, each with a named red line."""

import torch

from pagedkv import checks


def gather_whole_rows(block_table, num_blocks, idx_mapping, num_reqs_padded):
    """The batch's rows copied whole: no mask of the stale columns, no refusal."""
    out = torch.zeros(num_reqs_padded, block_table.shape[1], dtype=torch.int32)
    out[:len(idx_mapping)] = block_table[idx_mapping.long()]
    return out


def slots_in_int32(input_block_table, query_start_loc, positions, block_size):
    """Right entries and columns, but the product taken in the table's int32."""
    entry = torch.searchsorted(query_start_loc, torch.arange(len(positions)), right=True) - 1
    blocks = input_block_table[entry, positions // block_size]
    return blocks * block_size + positions % block_size


def test_a_gather_of_whole_rows_is_named(capsys):
    report = checks.check_gather_block_tables(gather_whole_rows)
    assert not report.passed
    details = " ".join(r.detail for r in report.results)
    assert "Diagnosis: a stale tail copied" in details
    assert "Diagnosis: a repeated row gathered twice" in details


def test_an_int32_product_is_named(capsys):
    report = checks.check_gathered_slot_mapping(slots_in_int32)
    assert not report.passed
    assert any("Diagnosis: int32 wrap" in r.detail for r in report.results)
