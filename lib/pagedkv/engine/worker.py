"""The worker (vLLM's model runner, Model Runner V2's design): request rows, KV caches, one forward pass per step.

Per step, from the scheduler's decisions, in the order Model Runner V2 takes them:

1. **Rows.** A request takes a row of the worker's tables (``RequestState``)
   the first time it is scheduled and keeps it, wherever it sits, until it
   finishes, is aborted or is preempted: no row ever moves. The rows of the
   step's ``finished_req_ids`` and ``preempted_req_ids`` go back to the free
   pool first, in sorted id order; then every new request, and every resumed
   one (its row went at preemption; it comes back as a new request with its
   whole block list), takes the last free row and has its blocks written from
   column 0; a running request only appends the blocks it got this step
   (``BlockTables.append_block_ids``). The edits are staged, and only the
   changed entries go to the device (``apply_staged_writes``). A request that
   finishes keeps its row until the next step's ``finished_req_ids`` frees it,
   as vLLM's runner learns of it only then.
2. **Copies.** Pending copy-on-write pairs run before the forward pass reads
   the cache (``copy_blocks``); the engine acknowledges them after the step.
3. **Inputs.** The step's batch order: decodes (one token) first, then the
   others by tokens scheduled, ties in the scheduler's order. ``idx_mapping``
   lists each batch entry's row; token ids and positions of every scheduled
   token follow the batch order; the backend's ``prepare_attn`` gathers the
   step's block table through ``idx_mapping`` and computes the slot mapping
   from it; ``AttentionMetadata`` carries the gathered table.
4. **Forward and sample.** ``model.forward``, then one token from the last
   scheduled token's logits of each request whose prompt (or recomputation)
   is complete after this step, all rows in one batched ``sampling.sample``
   (argmax alone when every row is greedy). A request in the middle of a
   chunked prefill gets no token. Rows short of their ``min_tokens`` get their
   stop tokens masked first; rows that asked for ``logprobs`` get them from
   the raw logits, the others cost nothing extra. The step's tokens and
   logprobs go back as one ``ModelRunnerOutput``.

In vLLM 0.33.0 this is Model Runner V2's ``GPUModelRunner``, the default
worker (``use_v2_model_runner``, ``config/vllm.py:731-767``). Its
``execute_model`` (``v1/worker/gpu/model_runner.py:1764-1786``) calls
``finish_requests`` (``v1/worker/gpu/model_runner.py:1188-1200``), which
frees the rows of the finished and the preempted requests in sorted order,
then ``add_requests`` (``v1/worker/gpu/model_runner.py:1215-1268``), which
gives each new request a row and writes its blocks with ``overwrite=True``,
then ``update_requests`` (``v1/worker/gpu/model_runner.py:1270-1305``), which
appends a running request's new blocks, then ``apply_staged_writes``. Under
V2 the scheduler sends a resumed request as a new one
(``use_v2_model_runner``, ``v1/core/sched/scheduler.py:1642-1644``), after the
new ones of the step. ``gather_batch_req_state``
(``v1/worker/gpu/model_runner.py:1306-1335``) orders the batch with
``sort_batch_req_ids`` (``v1/worker/gpu/model_runner.py:2507-2519``) and maps
it to rows; ``prepare_attn`` (``v1/worker/gpu/model_runner.py:1595-1615``)
gathers the tables and computes the slot mappings. Where we differ: no
padding of the batch, and a ``SchedulerOutput`` that does not fit the rows is
refused (``ValueError``) before any row changes, where vLLM trusts its
scheduler.

KV-cache groups: a model whose layers form several groups (sliding-window
layers beside full attention) gets one table per group, filled from the
scheduler's ``new_block_ids_by_group``, one slot mapping per group, and one
``AttentionMetadata`` per group, handed to the model by layer name
(``metadata_by_layer``). The manager frees a window's old blocks while the
request runs and puts the null block in its own table; the worker's row
keeps the old ids (it only appends, as vLLM's does), and the gathered table
nulls every entry below the window before the kernels read it
(``BlockTables.null_below_window``). Layers of different groups share KV
tensors (``Model.allocate_kv_cache(..., kv_cache_groups)``): one block id
belongs to one group at a time. The deprecated V1 runner's persistent batch, whose
rows stay dense (``pagedkv.block_table``), is what chapters 4 and 5 also show.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from ..block_tables import BlockTables
from ..request_state import RequestState
from .request import EngineRequest
from .sampling import gather_logprobs, mask_tokens, sample
from .scheduler import ModelRunnerOutput, SchedulerOutput
from ..common import cdiv, require

__all__ = ["Worker", "sort_batch_req_ids"]


def sort_batch_req_ids(num_scheduled_tokens: Mapping[str, int]) -> list[str]:
    """The step's batch order: decodes (one token) first, then by tokens scheduled, ties in the given order.

    vLLM's ``sort_batch_req_ids`` (``v1/worker/gpu/model_runner.py:2507-2519``),
    without speculative decoding (a decode is one token).
    """
    return sorted(num_scheduled_tokens, key=lambda r: (num_scheduled_tokens[r] != 1, num_scheduled_tokens[r]))


class Worker:
    """Runs the model on the scheduler's decisions.

    Args:
        model: a ``pagedkv.model.Model`` (or anything with its
            ``allocate_kv_cache``/``forward``/``compute_logits`` contract).
        num_blocks: blocks in every layer's KV tensors (the null block included).
        block_size: tokens per block.
        max_num_reqs: rows of the tables (``max_num_seqs``).
        max_model_len: sizes the tables' columns, ``cdiv(max_model_len, block_size)``.
        kernel_backend: ``"triton"``, ``"torch"`` or ``"torch-ref"``, parsed
            once into the ``attention_backend`` the model attends with and the
            worker gathers tables, computes slots and copies blocks with.
        kv_cache_groups: the model's KV-cache groups when there are several
            kinds of layers (``pagedkv.kv_cache_spec.KVCacheGroupSpec``, each
            of ``block_size``); None for one group of every layer.

    Attributes:
        req_states: ``RequestState``, which request holds which row.
        block_tables: ``BlockTables``, the rows' block ids and the step's gathered table.
        last_req_ids, last_idx_mapping: the latest step's batch, in batch
            order, and each entry's row.
        last_metadata: the ``AttentionMetadata`` of the latest step.
    """

    def __init__(self, model, num_blocks: int, block_size: int, max_num_reqs: int, max_model_len: int,
                 kernel_backend: str, kv_cache_groups=None) -> None:
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.kernel_backend = kernel_backend  # sets attention_backend (see the property)
        self.kv_cache_groups = kv_cache_groups
        if kv_cache_groups is None:
            self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)
            sizes, reach = [block_size], None
        else:
            self.kv_caches = model.allocate_kv_cache(num_blocks, block_size, kv_cache_groups=kv_cache_groups)
            sizes = [g.kv_cache_spec.block_size for g in kv_cache_groups]
            reach = [getattr(g.kv_cache_spec, "sliding_window", 1) - 1 for g in kv_cache_groups]
        self.req_states = RequestState(max_num_reqs)
        self.block_tables = BlockTables(self.req_states, sizes, [cdiv(max_model_len, b) for b in sizes],
                                        device=self.device, sliding_window_reach=reach)
        self.last_metadata = None
        self.last_metadata_by_group: list | None = None  # several groups: each group's metadata
        self.last_req_ids: list[str] = []
        self.last_idx_mapping: list[int] = []

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
        """Requests holding a row."""
        return self.req_states.num_reqs

    def rows(self, by_group: bool = False) -> dict[str, list[int]] | dict[str, tuple[list[int], ...]]:
        """``{request id: block ids}`` of every held row, in the order the rows were handed out:
        group 0's, or with ``by_group`` one list per group.

        ``req_states.req_id_to_index`` says which row each one is.
        """
        return {rid: self.block_tables.block_ids(row) if by_group else self.block_tables.block_ids(row)[0]
                for rid, row in self.req_states.req_id_to_index.items()}

    def _check_rows(self, out: SchedulerOutput) -> tuple[list[str], list[str], dict[str, tuple]]:
        """``(leaving, joining, block ids per group by request)`` of ``out``, once every edit it asks
        for is known to fit; ``ValueError`` if not."""
        leaving = sorted(set(out.finished_req_ids) | set(out.preempted_req_ids))
        joining = list(out.scheduled_new_reqs) + list(out.scheduled_resumed_reqs)
        held = self.req_states.req_id_to_index
        tables = self.block_tables
        for rid in out.num_scheduled_tokens:
            if rid not in joining and rid not in out.scheduled_running_reqs:
                raise ValueError(f"request {rid!r} is scheduled but neither new, resumed nor running")
        # One list per group: the scheduler's by-group ids, or (one group) its plain list.
        new_ids = {rid: out.new_block_ids_by_group.get(rid) or (out.new_block_ids.get(rid, []),)
                   for rid in joining + list(out.scheduled_running_reqs)}
        for rid, ids in new_ids.items():
            if len(ids) != tables.num_kv_cache_groups:
                raise ValueError(f"request {rid!r} has block ids for {len(ids)} KV-cache groups, "
                                 f"the tables have {tables.num_kv_cache_groups}")
            running = rid in out.scheduled_running_reqs
            if running and (rid not in held or rid in leaving):
                raise ValueError(f"running request {rid!r} holds no row (it was never added, or it left)")
            for g, group_ids in enumerate(ids):
                n = len(group_ids) + (int(tables.num_blocks[g, held[rid]]) if running else 0)
                if n > tables.block_tables[g].gpu.shape[1]:
                    raise ValueError(f"request {rid!r} would hold {n} blocks in group {g}, past the table's "
                                     f"{tables.block_tables[g].gpu.shape[1]} columns")
        free = len(self.req_states.free_indices) + sum(r in held for r in set(leaving) | set(joining))
        if len(joining) > free:
            raise ValueError(f"{len(joining)} requests join but only {free} rows are free")
        return leaving, joining, new_ids

    def _update_rows(self, out: SchedulerOutput) -> None:
        """Leaving requests free their rows; joining ones take one; running ones append blocks; then one apply."""
        leaving, joining, new_ids = self._check_rows(out)
        for rid in leaving:  # finish_requests: sorted, as vLLM frees them
            self.req_states.remove_request(rid)
        for rid in joining:  # add_requests: new, then resumed
            self.req_states.remove_request(rid)  # vLLM's runner re-adds a request it holds afresh
            row = self.req_states.add_request(rid)
            self.block_tables.append_block_ids(row, new_ids[rid], overwrite=True)
        for rid in out.scheduled_running_reqs:  # update_requests: only this step's blocks
            if any(new_ids[rid]):
                self.block_tables.append_block_ids(self.req_states.req_id_to_index[rid], new_ids[rid],
                                                   overwrite=False)
        self.block_tables.apply_staged_writes()  # only the changed entries reach the device

    # ----------------------------------------------------------------- a step
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput, requests: Mapping[str, EngineRequest]) -> ModelRunnerOutput:
        """Run one step; the tokens sampled for requests that complete a prompt or decode, and their logprobs.

        A ``SchedulerOutput`` that does not fit the rows (a running request
        without a row, more arrivals than free rows, a row past the table's
        width) is refused with ``ValueError`` before any row changes.
        """
        from ..model import AttentionMetadata

        self._update_rows(out)
        if out.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput()
        backend = self.attention_backend
        if out.cow_pairs:  # before anything reads the cache
            backend.copy_blocks(self.kv_caches, out.cow_pairs)

        # The batch: decodes first; idx_mapping[i] is the row of batch entry i.
        sched = sort_batch_req_ids(out.num_scheduled_tokens)
        idx_mapping = self.req_states.idx_mapping(sched)
        q_lens = np.fromiter((out.num_scheduled_tokens[r] for r in sched), dtype=np.int64, count=len(sched))
        starts = np.fromiter((out.num_computed_tokens[r] for r in sched), dtype=np.int64, count=len(sched))
        token_ids: list[int] = []
        for rid, s, n in zip(sched, starts.tolist(), q_lens.tolist()):
            token_ids.extend(requests[rid].all_token_ids[s:s + n])
        cu = np.zeros(len(sched) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        total = int(cu[-1])
        # position of token t of batch entry i: starts[i] + (t - cu[i])
        positions = torch.from_numpy(np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - starts, q_lens))
        query_start_loc = torch.from_numpy(cu.astype(np.int32))

        # The step's table, gathered through idx_mapping; the slots read from it.
        tables, slot_mappings = backend.prepare_attn(self.block_tables, idx_mapping, query_start_loc, positions)
        dev = self.device
        seq_lens = torch.from_numpy((starts + q_lens).astype(np.int32)).to(dev)
        qsl = query_start_loc.to(dev)
        if self.kv_cache_groups is None:
            meta = AttentionMetadata(slot_mapping=slot_mappings[0].to(dev), block_table=tables[0],
                                     seq_lens=seq_lens, query_start_loc=qsl)
            self.last_metadata = meta  # what the kernels read this step (chapter 8 prints it)
        else:
            if self.block_tables.has_sliding_window_groups:  # entries below each window: the null block
                self.block_tables.null_below_window(tables, starts)
            metas = [AttentionMetadata(slot_mapping=slot_mappings[g].to(dev), block_table=tables[g],
                                       seq_lens=seq_lens, query_start_loc=qsl) for g in range(len(tables))]
            self.last_metadata = metas[0]
            self.last_metadata_by_group = metas
            from ..model import metadata_by_layer  # the model that serves several groups brings it

            meta = metadata_by_layer(self.kv_cache_groups, metas)
        self.last_req_ids, self.last_idx_mapping = sched, idx_mapping
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=dev)
        hidden = self.model.forward(input_ids, positions.to(dev), self.kv_caches, meta, kernel_backend=backend)

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
    def check(self, expected: Mapping[str, list[int]], waiting=()) -> None:
        """Every running request (``expected``: id -> block ids) holds a row with exactly its blocks.

        ``InvariantError`` if not. Also the tables' own invariants, and that no request in ``waiting``
        holds a row (a preempted one gave its row back). Other held rows are
        those of requests finished since the last step: the next step frees them.
        """
        self.block_tables.check()
        held = self.req_states.req_id_to_index
        missing = sorted(set(expected) - set(held))
        require(not missing, "every running request holds a row", lambda: f"no row for {missing}")
        rows = self.rows(by_group=True)
        for rid, ids in expected.items():
            # One list, or (several groups) a tuple of lists; a manager's null entry (0, a window's
            # freed block) matches whatever id the row kept there: the gather nulls it.
            want = tuple(ids) if isinstance(ids, tuple) else (list(ids),)
            ok = len(want) == len(rows[rid]) and all(
                len(w) == len(r) and all(a == b or (a == 0 and reach) for a, b in zip(w, r))
                for w, r, reach in zip(want, rows[rid], self.block_tables.sliding_window_reach))
            require(ok, "a row holds its request's blocks",
                    lambda: f"row {held[rid]} of {rid!r} holds {rows[rid]}, the manager says {want}")
        stale = sorted(set(waiting) & set(held))
        require(not stale, "a waiting request holds no row",
                lambda: f"{stale[0]!r} still holds row {held[stale[0]]}")
