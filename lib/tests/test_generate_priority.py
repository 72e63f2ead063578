"""``priority`` on the offline API: ``LLM.generate`` and ``LLMEngine.generate``, vLLM 0.33.0's reading.

vLLM takes one int for all prompts or one per prompt and checks the length
(``_priority_to_seq``, ``vllm/entrypoints/common/offline.py:285-302``); under
``scheduling_policy="fcfs"`` the queue appends whatever the priority
(``FCFSRequestQueue``, ``vllm/v1/core/sched/request_queue.py:75-84``): no
check refuses it. Runs on the tiny seeded model, on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.engine import LLM, EngineArgs, LLMEngine, SamplingParams
from pagedkv.model import Model, ModelConfig

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14], [20, 21, 22, 23, 24]]
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return Model(ModelConfig.preset("tiny"), seed=0, device="cpu")


def _llm(model, policy):
    # One request at a time: the order the queue admits them is the order they finish.
    return LLM(model, block_size=4, num_gpu_blocks_override=64, max_model_len=64, max_num_seqs=1,
               max_num_batched_tokens=64, kernel_backend="torch", scheduling_policy=policy)


def _finish_order(llm, prompts, **kw):
    """(outputs, the prompt indices in the order their requests finished)."""
    finished = []
    llm.llm_engine.add_step_listener(
        lambda engine, out, outputs: finished.extend(o.request_id for o in outputs if o.finished))
    outs = llm.generate(prompts, GREEDY, **kw)
    index = {o.request_id: i for i, o in enumerate(outs)}
    return outs, [index[rid] for rid in finished if rid in index]


def test_priority_changes_the_order_of_completion_under_the_priority_policy(model):
    plain, order = _finish_order(_llm(model, "priority"), PROMPTS)
    assert order == [0, 1, 2]  # equal priorities (None: 0 for all): first come, first served
    ranked, order = _finish_order(_llm(model, "priority"), PROMPTS, priority=[2, 1, 0])
    assert order == [2, 1, 0]  # smaller first
    mixed, order = _finish_order(_llm(model, "priority"), PROMPTS, priority=[1, 0, 1])
    assert order == [1, 0, 2]  # ties keep their arrival order
    # Outputs stay in prompt order, and greedy tokens do not depend on when a request ran.
    for outs in (ranked, mixed):
        assert [o.prompt_token_ids for o in outs] == PROMPTS
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_priority_is_ignored_under_fcfs_as_vllm_does(model):
    _, order = _finish_order(_llm(model, "fcfs"), PROMPTS, priority=[2, 1, 0])
    assert order == [0, 1, 2]


def test_one_int_is_every_prompts_priority(model):
    llm = _llm(model, "priority")
    llm.llm_engine.add_request("early", [30, 31, 32], sampling_params=GREEDY, priority=1)
    seen = []
    llm.llm_engine.add_step_listener(
        lambda engine, out, outputs: seen.extend(o.request_id for o in outputs if o.finished))
    outs = llm.generate(PROMPTS, GREEDY, priority=0)  # all three go before "early", which came first
    assert seen == [o.request_id for o in outs]
    assert llm.llm_engine.has_unfinished_requests()  # "early" waits still
    engine = LLMEngine(EngineArgs(block_size=4, num_gpu_blocks_override=64, max_model_len=64, max_num_seqs=1,
                                  kernel_backend="torch", scheduling_policy="priority"), model)
    assert [r.priority for r in _queued(engine, PROMPTS[:2], np.int64(3))] == [3, 3]


def _queued(engine, prompts, priority):
    """The requests ``generate`` queued, caught at their first step."""
    caught = []
    engine.add_step_listener(lambda e, out, outputs: caught.extend(
        r for r in e.scheduler.requests.values() if r not in caught))
    engine.generate(prompts, max_tokens=1, ignore_eos=True, priority=priority)
    return caught


def _nothing_added(engine):
    return not engine.has_unfinished_requests() and not engine.scheduler.requests


@pytest.mark.parametrize("priority, error, match", [
    ([0, 1], ValueError, r"priority has 2 values for 3 prompts: .* got \[0, 1\]"),
    ([0, 1, 2, 3], ValueError, r"priority has 4 values for 3 prompts"),
    (True, TypeError, r"priority must be an int, got bool True"),
    ([0, False, 1], TypeError, r"priority\[1\] must be an int, got bool False"),
    (1.5, TypeError, r"priority must be an int, got float 1.5"),
    ([0, 1, 2.0], TypeError, r"priority\[2\] must be an int, got float 2.0"),
    ("012", TypeError, r"priority must be an int, got str '012'"),
    ({0: 1}, TypeError, r"priority must be an int, got dict"),
])
def test_bad_priority_is_refused_by_name_and_adds_nothing(model, priority, error, match):
    llm = _llm(model, "priority")
    with pytest.raises(error, match=match):
        llm.generate(PROMPTS, GREEDY, priority=priority)
    assert _nothing_added(llm.llm_engine)
    engine = llm.llm_engine
    with pytest.raises(error, match=match):
        engine.generate(PROMPTS, max_tokens=2, priority=priority)
    assert _nothing_added(engine)
    # The engine is unchanged: the same call with a good priority runs as on a fresh one.
    assert len(llm.generate(PROMPTS, GREEDY, priority=[0, 0, 0])) == 3


def test_a_single_prompt_takes_a_list_of_one(model):
    llm = _llm(model, "priority")
    assert len(llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, priority=[4])) == 1
    with pytest.raises(ValueError, match="priority has 2 values for 1 prompts"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, priority=[4, 5])
    assert _nothing_added(llm.llm_engine)
