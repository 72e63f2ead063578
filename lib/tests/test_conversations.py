"""Growing conversations and a burst (sim/conversations.py): every turn hits its own history, a burst
larger than the pool collapses the hit rate for minutes, a pool that holds both does not."""

import pytest

from pagedkv.sim.conversations import ConversationWorkload, simulate

MINUTES = dict(think_time_s=120.0, duration_s=3600.0, window_s=60.0, burst_at_s=1800.0)


def test_each_turn_hits_the_whole_blocks_its_previous_turn_computed():
    w = ConversationWorkload(num_conversations=1, system_len=20, message_len=7, reply_len=11, turns=3,
                             think_time_s=10.0, burst_at_s=None, num_blocks=200, block_size=4,
                             duration_s=200.0, window_s=1000.0)
    run = simulate(w, check_every=1)
    B, step = w.block_size, w.message_len + w.reply_len
    want_q = want_h = 0
    for i in range(run.num_turns):
        k = i % w.turns  # the turn within its conversation
        want_q += w.system_len + k * step + w.message_len
        if k:  # the previous turn computed its prompt and all of its reply but the last token
            want_h += (w.system_len + k * step - 1) // B * B
        elif i:  # a new conversation finds the system prompt's whole blocks
            want_h += w.system_len // B * B
    (_, queried, hits), = [r for r in run.windows if r[1]]
    assert run.num_turns >= 10 and (queried, hits) == (want_q, want_h)


def test_a_burst_larger_than_the_pool_collapses_the_hit_rate_for_minutes():
    w = ConversationWorkload(**MINUTES)
    assert w.burst_requests * (w.burst_prompt_len + w.burst_output_len) // w.block_size > w.num_blocks
    burst, quiet = simulate(w), simulate(ConversationWorkload(**{**MINUTES, "burst_at_s": None}))
    before = burst.rate_between(0, 1800, conversations_only=True)
    # The same users, the same tokens: identical until the burst.
    assert burst.conversation_windows[:30] == quiet.conversation_windows[:30]
    assert burst.rate_between(1800, 1860, conversations_only=True) < 0.2 * before
    assert burst.rate_between(1860, 1920, conversations_only=True) < 0.5 * before
    assert quiet.rate_between(1800, 1920, conversations_only=True) > 0.8 * before
    assert 120 <= burst.recovery_s() <= 600
    # What the idle-before-evict histogram shows: histories evicted younger than a think time.
    assert burst.idle_quantile(0.5, 0, 1800) > 2 * w.think_time_s
    assert burst.idle_quantile(0.5, 1800, 2400) < w.think_time_s


def test_a_pool_that_holds_the_histories_and_the_burst_does_not_collapse():
    w = ConversationWorkload(**MINUTES)
    burst_blocks = w.burst_requests * -(-(w.burst_prompt_len + w.burst_output_len) // w.block_size)
    big = ConversationWorkload(**{**MINUTES, "num_blocks": w.working_set_blocks + burst_blocks + 1})
    run = simulate(big)
    before = run.rate_between(0, 1800, conversations_only=True)
    assert run.rate_between(1800, 1920, conversations_only=True) > 0.9 * before
    assert run.recovery_s() == 60.0  # the first window after the burst's
    # Only the working set without the burst: the collapse stays.
    mid = simulate(ConversationWorkload(**{**MINUTES, "num_blocks": w.working_set_blocks + 1}))
    assert mid.rate_between(1800, 1860, conversations_only=True) < 0.2 * before


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="num_blocks=10 cannot hold the longest request"):
        ConversationWorkload(num_blocks=10)
    with pytest.raises(ValueError, match="think_time_s"):
        ConversationWorkload(think_time_s=0)
    with pytest.raises(TypeError, match="ConversationWorkload"):
        simulate({"num_blocks": 100})
    run = simulate(ConversationWorkload(duration_s=60.0, burst_at_s=None))
    with pytest.raises(ValueError, match="no request between 100"):
        run.rate_between(100, 200)
