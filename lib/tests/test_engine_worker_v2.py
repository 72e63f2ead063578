"""The engine's worker holds its rows as Model Runner V2 does, checked against vLLM 0.33.0's own code.

The engine runs real steps (arrivals, chunked prompts, preemptions and
resumptions, finishes, aborts); after every step the same ``SchedulerOutput``
drives vLLM's ``RequestState`` and ``BlockTables``, executed from the wheel
(``test_block_tables.load_vllm_worker_modules``), in the order its
``GPUModelRunner.execute_model`` takes them: ``finish_requests`` frees the
finished and the preempted rows in sorted order, ``add_requests`` adds the
new requests, then the resumed ones (0.33.0's scheduler sends those as new
under V2), with ``overwrite=True``, ``update_requests`` appends a running
request's new blocks. The batch order is vLLM's ``sort_batch_req_ids``, taken
from ``v1/worker/gpu/model_runner.py`` with ``ast`` and executed alone.
"""

from __future__ import annotations

import ast
import random
import zipfile

import pytest
import torch

from pagedkv.engine import EngineArgs, LLMEngine
from pagedkv.engine.worker import sort_batch_req_ids
from pagedkv.model import Model, ModelConfig
from test_block_tables import DEV, load_vllm_worker_modules  # noqa: E402
from vllm_wheel import vllm_wheel  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return Model(ModelConfig.preset("tiny"), seed=0)


def vllm_sort_batch_req_ids(wheel):
    """``sort_batch_req_ids`` alone, out of 0.33.0's model_runner.py (the rest of that module needs CUDA)."""
    with zipfile.ZipFile(wheel) as z:
        tree = ast.parse(z.read("vllm/v1/worker/gpu/model_runner.py"))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "sort_batch_req_ids")
    fn.returns = None
    for a in fn.args.args:
        a.annotation = None
    namespace: dict = {}
    exec(compile(ast.Module([fn], []), "vllm-0.33.0/vllm/v1/worker/gpu/model_runner.py", "exec"), namespace)
    return namespace["sort_batch_req_ids"]


class VllmRunnerRows:
    """vLLM's RequestState and BlockTables, driven by a SchedulerOutput as ``execute_model`` drives them."""

    def __init__(self, modules, max_num_reqs: int, block_size: int, width: int):
        self.req_states = modules["states"].RequestState(max_num_reqs, 4096, 256, 0, 100, DEV)
        self.tables = modules["block_table"].BlockTables([block_size], max_num_reqs, 256, [width], DEV)

    def apply(self, out) -> None:
        for rid in sorted(set(out.finished_req_ids) | set(out.preempted_req_ids)):  # finish_requests
            self.req_states.remove_request(rid)
        for rid in out.scheduled_new_reqs + out.scheduled_resumed_reqs:  # add_requests
            self.req_states.remove_request(rid)
            self.req_states.add_request(rid, 1, [0], 0, 8)
            self.tables.append_block_ids(self.req_states.req_id_to_index[rid], (out.new_block_ids[rid],),
                                         overwrite=True)
        for rid in out.scheduled_running_reqs:  # update_requests
            if out.new_block_ids.get(rid):
                self.tables.append_block_ids(self.req_states.req_id_to_index[rid], (out.new_block_ids[rid],),
                                             overwrite=False)
        self.tables.apply_staged_writes()


@pytest.mark.parametrize("seed", range(3))
def test_the_workers_rows_batch_and_table_are_vllm_0_33_0s(seed, model, monkeypatch):
    wheel = vllm_wheel()
    vllm_sort = vllm_sort_batch_req_ids(wheel)
    modules = load_vllm_worker_modules(wheel, monkeypatch)
    rng = random.Random(seed)
    args = EngineArgs(block_size=4, num_gpu_blocks_override=11, max_model_len=40, max_num_seqs=4,
                      max_num_batched_tokens=14, kernel_backend="torch")
    engine = LLMEngine(args, model, log_fn=lambda line: None)
    worker = engine.worker
    width = worker.block_tables.block_tables[0].gpu.shape[1]
    theirs = VllmRunnerRows(modules, args.max_num_seqs, args.block_size, width)
    seen = {"preempted": 0, "resumed": 0, "reused row": 0, "mixed batch": 0}
    arrivals, used = 0, set()  # used: rows handed out so far
    for _ in range(200):
        for _ in range(rng.randrange(0, 3)):
            if arrivals < 12:
                engine.add_request(f"q{arrivals}", [rng.randrange(1, 200) for _ in range(rng.randrange(2, 13))],
                                   max_tokens=rng.randrange(1, 16), ignore_eos=True)
                arrivals += 1
        if engine.scheduler.requests and rng.random() < 0.05:
            engine.abort_request(rng.choice(sorted(engine.scheduler.requests)))
        if not engine.scheduler.has_requests():
            continue  # step() would do nothing
        engine.step()
        engine.check()
        out = engine.last_scheduler_output
        theirs.apply(out)
        assert worker.req_states.req_id_to_index == theirs.req_states.req_id_to_index
        for rid, row in worker.req_states.req_id_to_index.items():
            n = int(theirs.tables.num_blocks.np[0, row])
            assert worker.block_tables.block_ids(row)[0] == theirs.tables.block_tables[0].gpu[row, :n].tolist()
        if out.total_num_scheduled_tokens:
            assert worker.last_req_ids == vllm_sort(out.num_scheduled_tokens, {}, 1)
            assert worker.last_idx_mapping == [theirs.req_states.req_id_to_index[r] for r in worker.last_req_ids]
            idx = torch.tensor(worker.last_idx_mapping, dtype=torch.int64, device=DEV)
            (their_table,) = theirs.tables.gather_block_tables(idx, len(worker.last_req_ids))
            ours = worker.last_metadata.block_table
            for i, row in enumerate(worker.last_idx_mapping):  # vLLM leaves the columns past a row as they were
                n = int(theirs.tables.num_blocks.np[0, row])
                assert ours[i, :n].tolist() == their_table[i, :n].tolist()
            seen["mixed batch"] += len(set(out.num_scheduled_tokens.values())) > 1
        seen["preempted"] += len(out.preempted_req_ids)
        seen["resumed"] += len(out.scheduled_resumed_reqs)
        rows = {worker.req_states.req_id_to_index[r] for r in out.scheduled_new_reqs}
        seen["reused row"] += bool(rows & used)
        used |= rows
        if arrivals == 12 and not engine.scheduler.has_requests():
            break
    assert not engine.scheduler.has_requests() and worker.num_reqs == 0  # the idle step freed the last rows
    assert all(seen.values()), seen  # the run exercised what it claims to


def test_sort_batch_req_ids_puts_decodes_first_then_shorter_chunks():
    assert sort_batch_req_ids({"p": 7, "d1": 1, "c": 3, "d2": 1, "e": 3}) == ["d1", "d2", "c", "e", "p"]


def test_a_scheduler_output_that_does_not_fit_the_rows_changes_nothing(model):
    from pagedkv.engine.scheduler import SchedulerOutput

    engine = LLMEngine(EngineArgs(block_size=4, num_gpu_blocks_override=32, max_model_len=40, max_num_seqs=2,
                                  kernel_backend="torch"), model)
    engine.add_request("a", [1, 2, 3], max_tokens=4, ignore_eos=True)
    engine.step()
    worker = engine.worker
    before = (dict(worker.req_states.req_id_to_index), list(worker.req_states.free_indices), worker.rows())
    bad = [
        (SchedulerOutput(step=9, scheduled_running_reqs=["ghost"], num_scheduled_tokens={"ghost": 1},
                         total_num_scheduled_tokens=1), "'ghost' holds no row"),
        (SchedulerOutput(step=9, scheduled_new_reqs=["b", "c"], num_scheduled_tokens={"b": 1, "c": 1},
                         new_block_ids={"b": [5], "c": [6]}, total_num_scheduled_tokens=2),
         "2 requests join but only 1 rows are free"),
        (SchedulerOutput(step=9, scheduled_running_reqs=["a"], num_scheduled_tokens={"a": 1},
                         new_block_ids={"a": list(range(1, 11))}, total_num_scheduled_tokens=1),
         "past the table's 10 columns"),
        (SchedulerOutput(step=9, num_scheduled_tokens={"b": 1}, total_num_scheduled_tokens=1),
         "neither new, resumed nor running"),
    ]
    for out, message in bad:
        with pytest.raises(ValueError, match=message):
            worker.execute_model(out, engine.scheduler.requests)
        assert (dict(worker.req_states.req_id_to_index), list(worker.req_states.free_indices),
                worker.rows()) == before
    engine.check()
