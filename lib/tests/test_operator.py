"""The operator's symptom table and log-line reader (issue 39 §1)."""

import pytest

from pagedkv import budget
from pagedkv.engine import EngineStats
from pagedkv.views.operator import SYMPTOMS, diagnose, read_log_line, refusal, symptom_table

QUESTION_3 = ("INFO 11-20 10:22:31 [loggers.py:283] Engine 000: Avg prompt throughput: 0.0 tokens/s, "
              "Avg generation throughput: 2101.4 tokens/s, Running: 48 reqs, Waiting: 40 reqs, "
              "GPU KV cache usage: 95.0%, Prefix cache hit rate: 61.2%")


def line(running, waiting, usage, preemptions=0, hit=None):
    return EngineStats(step=1, num_running=running, num_waiting=waiting, kv_cache_usage=usage,
                       num_preemptions=preemptions, num_preemptions_interval=preemptions,
                       prefix_cache_hit_rate=hit, prompt_throughput=1.0, generation_throughput=1.0).log_line()


def test_the_readers_line_is_memory_bound():
    got = read_log_line(QUESTION_3)
    assert (got.running, got.waiting, got.preemptions, got.usage, got.hit_rate) == (48, 40, 0, 95.0, 61.2)
    assert diagnose(QUESTION_3) == ["memory-bound"]


@pytest.mark.parametrize("now,before,want", [
    (line(12, 0, 0.95), None, []),                                   # full and serving everyone: healthy
    (line(9, 3, 0.99, preemptions=2), None, ["preempting"]),
    (line(4, 7, 0.31), None, ["queue-bound"]),
    (line(4, 9, 0.31), line(8, 5, 0.70), ["draining"]),
])
def test_each_row_of_the_table_from_lines_our_engine_prints(now, before, want):
    assert diagnose(now, before) == want


def test_a_low_hit_rate_counts_only_where_requests_share_a_prefix():
    low, high = line(8, 0, 0.40, hit=0.2), line(8, 0, 0.40, hit=0.8)
    assert diagnose(low) == [] and diagnose(low, shared_prefix=True) == ["low hit rate"]
    assert diagnose(high, shared_prefix=True) == []
    from pagedkv.views.operator import without_clock
    assert "... tokens/s" in without_clock(low) and "1.0 tokens/s" not in without_clock(low)


def test_startup_refusals_are_named_from_vllms_words():
    with pytest.raises(ValueError) as e:
        budget.check_enough_kv_cache_memory(3 * budget.GiB, "Llama-3.1-8B", 131_072)
    assert refusal(str(e.value)) == "refused: max_model_len"
    assert refusal(budget.NO_MEMORY_MESSAGE) == "refused: no memory"
    with pytest.raises(ValueError) as e:
        budget.check_max_model_len("Llama-3-8B", 32_768)
    assert refusal(str(e.value)) == "refused: context"
    with pytest.raises(ValueError) as e:
        budget.pool_from_free_memory(free_and_total=(40 * budget.GiB, 80 * budget.GiB), weight_gib=15)
    assert refusal(str(e.value)) == "refused: free memory"
    assert refusal("CUDA error: an illegal memory access") is None


def test_the_table_has_every_row_and_fits_the_column():
    html = symptom_table(evidence={"memory-bound": "measured: 3 waiting at 100 %"})
    assert html.count("<tr>") == len(SYMPTOMS) + 1 and "measured: 3 waiting" in html
    assert "vllm:num_requests_waiting" in html and "max-width:100%" in html
    for s in SYMPTOMS.values():
        assert s.metric.count("vllm:") >= 1 or s.key.startswith("refused")
    with pytest.raises(ValueError, match="not vLLM's periodic log line"):
        read_log_line("INFO Avg prompt throughput: 3 tokens/s")


def test_burst_figure_draws_one_line_per_run_and_the_burst():
    from pagedkv.sim.conversations import ConversationWorkload, simulate
    from pagedkv.views.operator import burst_figure
    w = ConversationWorkload(num_conversations=4, duration_s=300.0, burst_at_s=150.0, burst_requests=4,
                             burst_prompt_len=128, num_blocks=400)
    fig = burst_figure({"a": simulate(w), "b": simulate(ConversationWorkload(
        num_conversations=4, duration_s=300.0, burst_at_s=None, num_blocks=400))}, w.burst_at_s)
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.get_lines()][:2] == ["a", "b"]
    assert ax.get_lines()[2].get_xdata()[0] == w.burst_at_s / 60  # the dashed burst line
    with pytest.raises(ValueError, match="at least one"):
        burst_figure({})
