"""Exercise 4 without skeletons: a newcomer's plausible first attempts fail, each with a named red line.

Hint 3 now gives the idea and the invariant, not the loop; these are the
first attempts a reader who has only that writes (a queue where vLLM keeps
a stack, holes filled in the order given, the row restaged), and the
checker must reject each with a diagnosis that names the mistake.
"""

from pagedkv import checks


class RowsQueue:
    """The lowest free row first: a queue, where vLLM's free list is a stack."""

    def __init__(self, max_num_reqs):
        self.max_num_reqs = max_num_reqs
        self.req_id_to_index = {}
        self.free_indices = list(range(max_num_reqs))

    def add_request(self, req_id):
        if req_id in self.req_id_to_index or not self.free_indices:
            raise ValueError(req_id)
        row = self.free_indices.pop(0)
        self.req_id_to_index[req_id] = row
        return row

    def remove_request(self, req_id):
        row = self.req_id_to_index.pop(req_id, None)
        if row is not None:
            self.free_indices.append(row)
        return row

    def idx_mapping(self, req_ids):
        return [self.req_id_to_index[r] for r in req_ids]


def condense_in_given_order(table, num_reqs, finished_rows):
    """Each hole, as listed, takes the last row: no sort, no skipping a finished last row."""
    moves, last = [], num_reqs - 1
    for row in finished_rows:
        table.clear_row(row)
        if row < last:
            table.move_row(last, row)
            moves.append((last, row))
        last -= 1
    return moves


def append_restaging_the_row(table, num_blocks, req_index, new_block_ids, overwrite):
    start = 0 if overwrite else int(num_blocks[req_index])
    row = [int(x) for x in table.np[req_index, :start]] + list(new_block_ids)
    table.stage_write(req_index, 0, row)
    num_blocks[req_index] = len(row)


def test_a_queue_of_rows_is_named(capsys):
    report = checks.check_request_rows(RowsQueue)
    assert not report.passed
    assert "Diagnosis: the first free row instead of the last" in report.results[0].detail


def test_holes_filled_in_the_order_given_are_named(capsys):
    report = checks.check_condense(condense_in_given_order)
    assert not report.passed
    assert any("Diagnosis: finished rows taken as sorted" in r.detail for r in report.results)


def test_a_restaged_row_is_named(capsys):
    report = checks.check_staged_append(append_restaging_the_row)
    assert not report.passed
    assert "Diagnosis: the row's blocks restaged" in report.results[0].detail
