"""What a worker's block-table writes cost: replay a request trace through an ``append`` function.

Exercise 4's experiment. Model Runner V2 keeps a row of the block table per
request for its life and *stages* each change on the host, copying only the
staged cells to the device once per step (``pagedkv.staged_write``). How
many cells reach the device over a trace depends on what the append stages,
and ``replay_table_writes(append)`` counts them for any function of the
signature exercise 4 asks for::

    append(table, num_blocks, req_index, new_block_ids, overwrite) -> None

The trace: requests of a seeded workload arrive as rows free up (at most
``max_num_reqs`` run at once); a request's first step hands it the blocks
of its prompt (``overwrite=True``, it may reuse a finished request's row);
then it writes one token a step and gets one more block each time a token
starts a block (``overwrite=False``), up to ``prompt + output`` tokens, so
it ends holding ``cdiv(prompt + output, block_size)`` blocks; then it
finishes and frees its row. After every step the worker
applies the staged writes, and the driver checks that each running row
starts with that request's blocks: an ``append`` that loses or misplaces a
block is a ``ValueError`` naming the row, not a number.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..common import cdiv, check_int
from ..staged_write import StagedWriteTensor
from .workloads import make_request_trace

__all__ = ["TableWorkload", "TABLE_WORKLOAD", "replay_table_writes"]


@dataclass(frozen=True)
class TableWorkload:
    """The trace and the worker's table (lengths in tokens)."""

    workload: str = "heavy-tailed"
    num_requests: int = 120
    seed: int = 5
    block_size: int = 16
    max_num_reqs: int = 8
    max_model_len: int = 8_192

    def __post_init__(self):
        for name in ("num_requests", "block_size", "max_num_reqs", "max_model_len"):
            check_int(getattr(self, name), name, 1)
        check_int(self.seed, "seed", 0)

    def lengths(self) -> list[tuple[int, int]]:
        """(prompt tokens, final tokens) of each request, in arrival order."""
        trace = make_request_trace(self.workload, self.num_requests, arrival_rate=None,
                                   seed=self.seed, max_model_len=self.max_model_len)
        return [(int(p), int(p + o)) for p, o in zip(trace.prompt_len, trace.output_len)]


#: The workload exercise 4 measures on.
TABLE_WORKLOAD = TableWorkload()


def replay_table_writes(append, workload: TableWorkload = TABLE_WORKLOAD) -> int:
    """Cells copied to the device over the whole trace, with ``append`` staging each change."""
    if not callable(append):
        raise TypeError(f"append must be a function, got {type(append).__name__} {append!r}")
    w, B = workload, workload.block_size
    width = cdiv(w.max_model_len, B)
    table = StagedWriteTensor((w.max_num_reqs, width), torch.int32, "cpu")
    num_blocks = np.zeros(w.max_num_reqs, dtype=np.int32)
    pending = list(reversed(w.lengths()))  # pop() takes the oldest
    free_rows = list(range(w.max_num_reqs))
    running: dict[int, list] = {}  # row -> [tokens written, final tokens, its blocks]
    next_block = 1
    while pending or running:
        for row, state in list(running.items()):  # one token each; a new block when it needs one
            if state[0] >= state[1]:  # wrote its last token in the previous step
                del running[row]
                free_rows.append(row)
                continue
            state[0] += 1
            if len(state[2]) < cdiv(state[0], B):
                state[2].append(next_block)
                append(table, num_blocks, row, [next_block], False)
                next_block += 1
        while pending and free_rows:
            prompt, final = pending.pop()
            row = free_rows.pop()
            blocks = list(range(next_block, next_block + cdiv(prompt, B)))
            next_block += len(blocks)
            running[row] = [prompt, final, blocks]
            append(table, num_blocks, row, blocks, True)
        table.apply_write()
        for row, (_, _, blocks) in running.items():
            got = table.gpu[row, :len(blocks)].tolist()
            if got != blocks or int(num_blocks[row]) != len(blocks):
                raise ValueError(f"after a step, row {row} holds {got} with num_blocks "
                                 f"{int(num_blocks[row])}; the request's blocks are {blocks}")
    return int(table.num_copied_elements)
