"""vLLM 0.33.0's defaults that the scheduler and the engine follow.

Whole-prompt admission (``scheduler_reserve_full_isl``), prefix-cache
statistics recorded at admission, and the idle step that reports the last
finished requests.
"""

from __future__ import annotations

import pytest

from pagedkv.engine import EngineArgs, LLMEngine, ModelRunnerOutput, Scheduler, SchedulerOutput
from pagedkv.engine.request import EngineRequest
from pagedkv.kv_cache_manager import KVCacheManager, PrefixCacheStats
from pagedkv.model import Model, ModelConfig


def fake_step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    """Schedule, then 'sample' ``token`` for every request whose sequence is complete after the step."""
    out = sched.schedule()
    sampled = {rid: token for rid, n in out.num_scheduled_tokens.items()
               if out.num_computed_tokens[rid] + n == sched.requests[rid].num_tokens}
    sched.update_from_output(out, ModelRunnerOutput(sampled))
    sched.check()
    return out


def request(rid: str, token_ids: list[int], max_tokens: int = 50) -> EngineRequest:
    return EngineRequest(rid, token_ids, max_tokens, ignore_eos=True)


# ------------------------------------------------------------ whole-prompt admission


def issue_state(reserve_full_isl: bool) -> tuple[Scheduler, SchedulerOutput]:
    """Blocks of 16, 14 free; r1, r2 decoding, r3 36 tokens from the end of its prompt;
    waiting: r4 (35 tokens, 32 of them cached) and r6 (165 tokens, 11 blocks). Returns the step."""
    manager = KVCacheManager(num_blocks=25, block_size=16)  # 24 usable blocks
    sched = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                      scheduler_reserve_full_isl=reserve_full_isl)
    r3_prompt = list(range(1000, 1130))  # 130 tokens, 9 blocks
    sched.add_request(request("r1", list(range(1, 17))))
    sched.add_request(request("r2", list(range(101, 117))))
    sched.add_request(request("r3", r3_prompt))
    assert fake_step(sched).num_scheduled_tokens == {"r1": 16, "r2": 16, "r3": 32}
    assert fake_step(sched).num_scheduled_tokens == {"r1": 1, "r2": 1, "r3": 62}
    sched.add_request(request("r4", r3_prompt[:32] + [1, 2, 3]))  # hits r3's first two blocks
    sched.add_request(request("r6", list(range(2000, 2165))))
    assert manager.get_num_free_blocks() == 14 and sched.requests["r3"].num_computed_tokens == 94
    return sched, fake_step(sched)


def test_whole_prompt_admission_refuses_r6_the_chunk_alone_admits_it():
    sched, out = issue_state(reserve_full_isl=True)
    assert out.summary() == "step 3: +r1:1, +r2:1, +r3:36, new r4:3 (hit 32)"
    # r3 took 3 blocks and r4 one: 10 free, and r6's 165 tokens need 11.
    assert sched.kv_cache_manager.get_num_free_blocks() == 10
    assert [r.request_id for r in sched.waiting] == ["r6"]

    sched, out = issue_state(reserve_full_isl=False)
    assert out.summary() == "step 3: +r1:1, +r2:1, +r3:36, new r4:3 (hit 32), new r6:23"
    assert sched.kv_cache_manager.get_num_free_blocks() == 8 and not sched.waiting


def test_whole_prompt_admission_counts_what_allocate_slots_would_take():
    sched, _ = issue_state(reserve_full_isl=True)
    manager = sched.kv_cache_manager
    r6 = sched.waiting[0]
    hit, n = manager.get_computed_blocks(r6)
    assert (hit, n) == ([], 0) and not sched.whole_prompt_fits(r6, hit, n)  # 11 > 10
    manager.watermark_blocks = 0
    fits = EngineRequest("small", list(range(3000, 3160)), 5)  # 160 tokens: 10 blocks
    assert sched.whole_prompt_fits(fits, [], 0)
    manager.watermark_blocks = 1  # held back only while others run, as allocate_slots does
    assert not sched.whole_prompt_fits(fits, [], 0)
    sched.running, running = [], sched.running
    assert sched.whole_prompt_fits(fits, [], 0)
    sched.running = running


def test_scheduler_reserve_full_isl_is_vllms_flag_and_default():
    args = EngineArgs()
    assert args.scheduler_reserve_full_isl is True
    assert Scheduler(KVCacheManager(4, 4), 1, 8, 8).scheduler_reserve_full_isl is True
    assert "--scheduler-reserve-full-isl" in args.to_cli()
    assert "--no-scheduler-reserve-full-isl" in args.replace(scheduler_reserve_full_isl=False).to_cli()
    table = {f: flag for f, flag, _ in args.cli_table()}
    assert table["scheduler_reserve_full_isl"] == "--scheduler-reserve-full-isl"
    with pytest.raises(TypeError, match="scheduler_reserve_full_isl"):
        EngineArgs(scheduler_reserve_full_isl=1)
    with pytest.raises(TypeError, match="scheduler_reserve_full_isl"):
        Scheduler(KVCacheManager(4, 4), 1, 8, 8, scheduler_reserve_full_isl=None)


# ------------------------------------------------- prefix-cache statistics at admission


def test_a_request_refused_three_times_then_admitted_counts_once():
    manager = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable blocks
    sched = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32)
    sched.add_request(request("a", list(range(1, 9)), max_tokens=4))  # 2 blocks, then a third
    fake_step(sched)
    sched.add_request(request("b", list(range(1, 5)) + [50, 51, 52, 53, 54], max_tokens=1))  # 9 tokens
    refused = 0
    while "b" in sched.waiting:
        fake_step(sched)  # b's 3 blocks (one of them a's, cached) do not fit beside a
        refused += "b" in sched.waiting
    assert refused == 3
    stats = manager.prefix_cache_stats
    assert stats == PrefixCacheStats(requests=2, queries=8 + 9, hits=4)
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (17, 4)


def test_a_resumed_request_counts_as_preempted():
    manager = KVCacheManager(num_blocks=5, block_size=4)
    sched = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32)
    sched.add_request(request("A", list(range(1, 9)), max_tokens=2))
    sched.add_request(request("B", list(range(11, 19)), max_tokens=2))
    fake_step(sched)
    out = fake_step(sched)  # both need a third block; B (last) is preempted, A finishes
    assert out.preempted_req_ids == ["B"] and "A" not in sched.requests
    # B's blocks went back tail first and A's third block was B's second: its first is still cached.
    out = fake_step(sched)
    assert out.scheduled_resumed_reqs == ["B"] and out.num_prefix_hit_tokens == {"B": 4}
    stats = manager.prefix_cache_stats
    assert stats == PrefixCacheStats(requests=2, queries=16, hits=0, preempted_requests=1,
                                     preempted_queries=9, preempted_hits=4)
    assert stats.hit_rate == 0.0 and sched.prefix_cache_queries == 16  # new requests only


# ------------------------------------------------------------------------ the idle step


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(ModelConfig.preset("tiny"), seed=0)


def tiny_engine(model) -> LLMEngine:
    return LLMEngine(EngineArgs(block_size=4, num_gpu_blocks_override=64, max_model_len=96, max_num_seqs=8,
                                max_num_batched_tokens=64, kernel_backend="torch"), model)


def test_after_the_last_request_finishes_the_engine_steps_once_more(model):
    engine = tiny_engine(model)
    engine.add_request("A", [1, 2, 3], max_tokens=2)
    engine.add_request("B", [4, 5, 6, 7], max_tokens=2)
    while engine.has_unfinished_requests():
        engine.step()
    last = engine.last_scheduler_output
    assert engine.scheduler.has_requests() and not engine.has_unfinished_requests()
    assert engine.step() == []  # the idle step: nothing runs, the finished ids are reported
    idle = engine.last_scheduler_output
    assert idle.step == last.step + 1 and idle.total_num_scheduled_tokens == 0
    assert sorted(idle.finished_req_ids) == ["A", "B"] and idle.summary().endswith("nothing scheduled")
    assert not engine.scheduler.has_requests()
    assert engine.step() == [] and engine.last_scheduler_output is idle  # then step() does nothing
    engine.check()


def test_a_new_request_does_not_report_the_old_finished_ids(model):
    engine = tiny_engine(model)
    seen = []
    engine.add_step_listener(lambda e, out, outputs: seen.append(out))
    engine.generate([[1, 2, 3]], max_tokens=2)
    steps = len(seen)
    engine.add_request("C", [9, 8, 7], max_tokens=1)  # the engine takes its idle step first
    assert len(seen) == steps + 1 and seen[-1].finished_req_ids == ["generate-0"]
    assert seen[-1].total_num_scheduled_tokens == 0
    engine.step()
    assert seen[-1].scheduled_new_reqs == ["C"] and seen[-1].finished_req_ids == []


def test_an_abort_of_the_last_request_is_reported_by_an_idle_step(model):
    engine = tiny_engine(model)
    engine.add_request("A", [1, 2, 3], max_tokens=8)
    engine.step()
    engine.abort_request("A")
    outputs = engine.step()
    assert [o.finish_reason for o in outputs] == ["abort"]
    assert engine.last_scheduler_output.finished_req_ids == ["A"]
    assert engine.last_scheduler_output.total_num_scheduled_tokens == 0
    assert not engine.scheduler.has_requests()
