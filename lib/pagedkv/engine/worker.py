"""The worker (vLLM's model runner): block-table rows, KV caches, one forward pass per step.

Per step, from the scheduler's decisions:

1. **Rows.** Each running request owns one row of the ``BlockTable``; rows
   stay dense (``0..num_reqs-1``). A request that leaves (finished, aborted,
   preempted) gives its row to the last row's request (``move_row``), as
   vLLM's ``InputBatch.condense`` does. The worker drops the rows of the
   step's ``finished_req_ids`` and ``preempted_req_ids``, as vLLM's runner
   does; the engine drops a finished or aborted request's row earlier, as
   soon as it finishes, so that between steps the table holds the running
   requests. A request entering gets the next row with its whole block list
   (``add_row``); a running one only appends the blocks it got this step
   (``append_row``): the table is append-only.
2. **Copies.** Pending copy-on-write pairs run before the forward pass reads
   the cache (``copy_blocks``); the engine acknowledges them after the step.
3. **Inputs.** Token ids and positions of every scheduled token, grouped by
   row; the slot mapping from the committed table; ``AttentionMetadata``.
4. **Forward and sample.** ``model.forward``, then one token from the last
   scheduled token's logits of each request whose prompt (or recomputation)
   is complete after this step, all rows in one batched ``sampling.sample``
   (argmax alone when every row is greedy). A request in the middle of a
   chunked prefill gets no token. Rows short of their ``min_tokens`` get their
   stop tokens masked first; rows that asked for ``logprobs`` get them from
   the raw logits, the others cost nothing extra. The step's tokens and
   logprobs go back as one ``ModelRunnerOutput``.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np
import torch

from ..block_table import BlockTable
from .request import EngineRequest
from .sampling import gather_logprobs, mask_tokens, sample
from .scheduler import ModelRunnerOutput, SchedulerOutput
from ..common import cdiv, require

__all__ = ["Worker"]


class Worker:
    """Runs the model on the scheduler's decisions.

    Args:
        model: a ``pagedkv.model.Model`` (or anything with its
            ``allocate_kv_cache``/``forward``/``compute_logits`` contract).
        num_blocks: blocks in every layer's KV tensors (the null block included).
        block_size: tokens per block.
        max_num_reqs: rows of the block table (``max_num_seqs``).
        max_model_len: sizes the table's columns, ``cdiv(max_model_len, block_size)``.
        kernel_backend: ``"triton"``, ``"torch"`` or ``"torch-ref"``, parsed
            once into the ``attention_backend`` the model attends with and the
            worker computes slots and copies blocks with.
    """

    def __init__(self, model, num_blocks: int, block_size: int, max_num_reqs: int, max_model_len: int,
                 kernel_backend: str) -> None:
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.kernel_backend = kernel_backend  # sets attention_backend (see the property)
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)
        self.last_metadata = None  # the AttentionMetadata of the latest step
        self.block_table = BlockTable(max_num_reqs, cdiv(max_model_len, block_size), device=self.device)
        self.req_ids: list[str] = []  # row -> request id; rows 0..len-1 are in use
        self.row_of: dict[str, int] = {}

    @property
    def kernel_backend(self) -> str:
        """The backend's name; setting a name chooses the backend anew."""
        return self.attention_backend.name

    @kernel_backend.setter
    def kernel_backend(self, name: str) -> None:
        from ..model.paged_attention import attention_backend  # pagedkv.model is loaded with the model

        self.attention_backend = attention_backend(name)

    # ------------------------------------------------------------------- rows
    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def rows(self) -> dict[str, list[int]]:
        """``{request id: block ids}`` of every row, in row order (what the table holds)."""
        return {rid: self.block_table.row(r) for r, rid in enumerate(self.req_ids)}

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        """Free the rows of requests that left; the last row moves into each hole (rows stay dense)."""
        for rid in req_ids:
            row = self.row_of.pop(rid, None)
            if row is None:
                continue  # never had a row, or already removed
            last = len(self.req_ids) - 1
            if row != last:
                moved = self.req_ids[last]
                self.block_table.move_row(last, row)
                self.req_ids[row] = moved
                self.row_of[moved] = row
            self.block_table.clear_row(last)
            self.req_ids.pop()

    def _update_rows(self, out: SchedulerOutput) -> None:
        """Finished and preempted requests leave; new and resumed ones get a row; running ones append blocks.

        Under ``LLMEngine`` the finished ones have left already (see the
        module docstring); a worker fed ``SchedulerOutput``s alone needs this.
        """
        self.remove_requests(out.finished_req_ids)
        self.remove_requests(out.preempted_req_ids)
        for rid in out.num_scheduled_tokens:
            ids = out.new_block_ids.get(rid, [])
            row = self.row_of.get(rid)
            if row is None:
                row = len(self.req_ids)
                self.block_table.add_row(ids, row)
                self.req_ids.append(rid)
                self.row_of[rid] = row
            elif ids:
                self.block_table.append_row(ids, row)

    # ----------------------------------------------------------------- a step
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput, requests: Mapping[str, EngineRequest]) -> ModelRunnerOutput:
        """Run one step; the tokens sampled for requests that complete a prompt or decode, and their logprobs."""
        from ..model import AttentionMetadata

        self._update_rows(out)
        if out.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput()
        num_reqs = len(self.req_ids)  # rows 0..num_reqs-1 are in use
        self.block_table.commit(num_reqs)
        backend = self.attention_backend
        if out.cow_pairs:  # before anything reads the cache
            backend.copy_blocks(self.kv_caches, out.cow_pairs)

        # Requests in row order, so the table's first rows can be passed without a copy.
        sched = sorted(out.num_scheduled_tokens, key=self.row_of.__getitem__)
        rows = np.fromiter((self.row_of[r] for r in sched), dtype=np.int64, count=len(sched))
        q_lens = np.fromiter((out.num_scheduled_tokens[r] for r in sched), dtype=np.int64, count=len(sched))
        starts = np.fromiter((out.num_computed_tokens[r] for r in sched), dtype=np.int64, count=len(sched))
        token_ids: list[int] = []
        for rid, s, n in zip(sched, starts.tolist(), q_lens.tolist()):
            token_ids.extend(requests[rid].all_token_ids[s:s + n])
        cu = np.zeros(len(sched) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        total = int(cu[-1])
        # position of token t of request i: starts[i] + (t - cu[i])
        positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - starts, q_lens)
        req_indices = np.repeat(rows, q_lens)

        slot_mapping = backend.slot_mapping(self.block_table, num_reqs, req_indices, positions, self.block_size)
        if np.array_equal(rows, np.arange(len(sched))):
            table = self.block_table.get_device_tensor(len(sched))
        else:  # some running requests sit this step out: gather the scheduled rows
            table = self.block_table.get_device_tensor().index_select(
                0, torch.from_numpy(rows).to(self.device))
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            block_table=table,
            seq_lens=torch.from_numpy((starts + q_lens).astype(np.int32)).to(dev),
            query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(dev),
        )
        self.last_metadata = meta  # what the kernels read this step (chapter 8 prints it)
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=dev)
        hidden = self.model.forward(input_ids, torch.from_numpy(positions).to(dev), self.kv_caches, meta,
                                    kernel_backend=backend)

        # Sample only where the whole sequence is now computed (the last token's logits are the next token's).
        done = [i for i, rid in enumerate(sched) if starts[i] + q_lens[i] == requests[rid].num_tokens]
        if not done:
            return ModelRunnerOutput()
        last = torch.from_numpy(cu[1:][done] - 1).to(dev)
        logits = self.model.compute_logits(hidden.index_select(0, last))
        reqs = [requests[sched[i]] for i in done]
        # Raw logits of the rows that want logprobs, copied before the min_tokens mask touches them.
        want = [i for i, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
        raw = logits.index_select(0, torch.tensor(want, device=dev)) if want else None
        sampled = self._sample(logits, reqs)
        logprobs = self._logprobs(raw, sampled, [reqs[i] for i in want], want) if want else {}
        return ModelRunnerOutput({sched[i]: t for i, t in zip(done, sampled.tolist())}, logprobs)

    @staticmethod
    def _logprobs(raw: torch.Tensor, sampled: torch.Tensor, reqs: list[EngineRequest],
                  rows: list[int]) -> dict[str, tuple[float, int, list[tuple[int, float]]]]:
        """Logprobs for the rows that asked: one ``log_softmax`` and one ``topk`` (the largest k asked)."""
        vocab = raw.shape[-1]
        ks = [vocab if r.sampling_params.logprobs == -1 else min(r.sampling_params.logprobs, vocab)
              for r in reqs]
        rows_t = torch.tensor(rows, device=raw.device)
        lp, rank, top, top_ids = gather_logprobs(raw, max(ks), sampled.index_select(0, rows_t))
        lp, rank, top, top_ids = lp.tolist(), rank.tolist(), top.tolist(), top_ids.tolist()
        return {r.request_id: (lp[j], rank[j], list(zip(top_ids[j][:k], top[j][:k])))
                for j, (r, k) in enumerate(zip(reqs, ks))}

    def _sample(self, logits: torch.Tensor, reqs: list[EngineRequest]) -> torch.Tensor:
        """One token per row of ``logits`` (modified in place), row ``i`` for ``reqs[i]``.

        First the ``min_tokens`` mask: a row whose request has generated fewer
        than ``min_tokens`` cannot draw EOS or a stop token, whose logits become
        -inf, one scatter for all such rows (the loop runs over requests and
        their few stop ids, never over the vocabulary). Then argmax when every
        row is greedy; otherwise the parameters go to the device as ``[batch]``
        tensors and one op chain samples.
        """
        vocab = logits.shape[-1]
        rows, ids = [], []
        for i, r in enumerate(reqs):
            if r.num_output_tokens < r.sampling_params.min_tokens:
                stop = [t for t in r.all_stop_token_ids if 0 <= t < vocab]
                rows += [i] * len(stop)
                ids += stop
        if rows:
            mask_tokens(logits, rows, ids)
        params = [r.sampling_params for r in reqs]
        if all(p.greedy for p in params):
            return torch.argmax(logits, dim=-1)
        dev = logits.device

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=dev)

        return sample(logits, column([p.temperature for p in params], torch.float32),
                      column([p.top_p for p in params], torch.float32),
                      column([min(p.top_k, vocab) for p in params], torch.int64),  # fits int64
                      column([p.min_p for p in params], torch.float32),
                      column([r.seed % (1 << 63) for r in reqs], torch.int64),
                      column([r.num_output_tokens for r in reqs], torch.int64))

    # ----------------------------------------------------------------- checks
    def check(self, expected: Mapping[str, list[int]]) -> None:
        """The table holds exactly ``expected`` (request id -> block ids), rows dense; ``InvariantError`` if not."""
        self.block_table.check()
        require(len(self.req_ids) == len(self.row_of)
                and all(self.row_of.get(r) == i for i, r in enumerate(self.req_ids)),
                "row index agrees with the row list", lambda: f"rows {self.req_ids}, index {self.row_of}")
        require(int(self.block_table.num_blocks_per_row[self.num_reqs:].sum()) == 0,
                "rows past the batch are empty", f"{self.num_reqs} rows in use")
        rows = self.rows()
        require(set(rows) == set(expected), "one row per running request",
                lambda: f"table rows {sorted(rows)}, running {sorted(expected)}")
        for rid, ids in expected.items():
            require(rows[rid] == list(ids), "a row holds its request's blocks",
                    lambda: f"row of {rid!r} holds {rows[rid]}, the manager says {list(ids)}")
