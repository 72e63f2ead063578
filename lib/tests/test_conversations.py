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


# The CPU offload tier (vLLM's --kv-offloading-size, its CPU backend's LRU policy).

def test_a_cpu_tier_never_changes_the_gpu_pool():
    quiet = ConversationWorkload(**MINUTES)
    plain = simulate(quiet)
    for cpu_blocks in (0, 5600):
        run = simulate(ConversationWorkload(**MINUTES, cpu_blocks=cpu_blocks), check_every=50)
        # Loads take GPU blocks as computed tokens do: the GPU's hits and evictions are the same.
        assert run.windows == plain.windows and run.conversation_windows == plain.conversation_windows
        assert run.idle_before_evict_s == plain.idle_before_evict_s
        assert run.recovery_s() == plain.recovery_s()
    empty = simulate(ConversationWorkload(**MINUTES, cpu_blocks=0))
    assert not any(n for _, n in empty.loaded_windows) and empty.cpu_stored_blocks == 0
    assert empty.cpu_failed_stores == empty.num_turns + quiet.burst_requests  # every offer refused
    assert plain.rate_between(0, 3600, source="cpu") == 0.0


def test_a_cpu_tier_several_times_the_pool_keeps_the_histories_through_the_burst():
    w = ConversationWorkload(**MINUTES)
    burst_prompt_blocks = w.burst_requests * (w.burst_prompt_len // w.block_size)
    runs = {n: simulate(ConversationWorkload(**MINUTES, cpu_blocks=n)) for n in (2 * w.num_blocks, 4 * w.num_blocks)}
    small, big = runs[2 * w.num_blocks], runs[4 * w.num_blocks]
    assert 2 * w.num_blocks < burst_prompt_blocks + w.working_set_blocks < 4 * w.num_blocks
    after = (1800, 1860)
    gpu = big.rate_between(*after, conversations_only=True)
    # The big tier holds the histories and the burst's prompts: the evicted histories load from CPU.
    assert big.rate_between(*after, conversations_only=True, source="cpu") > 0.6
    assert big.rate_between(*after, conversations_only=True, source="both") > 0.9 * big.rate_between(
        0, 1800, conversations_only=True, source="both") > gpu + 0.6
    assert big.recovery_s(source="both") < big.recovery_s()
    # The small one: the burst's prompts flush the histories out of CPU memory too.
    assert small.rate_between(*after, conversations_only=True, source="cpu") < 0.05
    assert small.cpu_evicted_blocks > burst_prompt_blocks
    # With the replies stored too, a turn loads its whole history but the reply's last token.
    full = simulate(ConversationWorkload(**MINUTES, cpu_blocks=4 * w.num_blocks, cpu_offload_prompt_only=False))
    assert full.rate_between(*after, True, "both") > big.rate_between(*after, True, "both")


def test_the_cpu_tier_is_lru_tail_first_and_stores_all_or_nothing():
    from pagedkv.sim.conversations import ConversationRun, _CPUTier

    run = ConversationRun(ConversationWorkload())
    tier = _CPUTier(5, run)
    tier.offer(["a0", "a1", "a2"])  # one request's prompt: its tail is evicted first
    assert list(tier.order) == ["a2", "a1", "a0"]
    tier.offer(["b0", "b1"])
    assert list(tier.order) == ["a2", "a1", "a0", "b1", "b0"]
    assert tier.lookup(["a0", "a1", "a2", "x"], 0, 4) == 3 and tier.lookup(["a0", "x", "a2"], 0, 3) == 1
    assert list(tier.order)[0] == "a2"  # a lookup changes no recency
    tier.offer(["a0", "c1"])  # a0 is held (refreshed, never evicted by its own offer); c1 evicts a2
    assert list(tier.order) == ["a1", "b1", "b0", "c1", "a0"] and run.cpu_evicted_blocks == 1
    before = list(tier.order)
    tier.offer(["b0", "d1", "d2", "d3", "d4", "d5"])  # 5 new blocks, room for 4 beside b0: none stored
    assert run.cpu_failed_stores == 1 and set(tier.order) == set(before)
    assert list(tier.order)[-1] == "b0"  # the held block is still refreshed
    assert run.cpu_stored_blocks == 6


def test_bad_cpu_tiers_are_refused_by_name():
    with pytest.raises(ValueError, match="cpu_blocks must be >= 0, got -1"):
        ConversationWorkload(cpu_blocks=-1)
    with pytest.raises(TypeError, match="cpu_blocks must be an int, got float 2.5"):
        ConversationWorkload(cpu_blocks=2.5)
    with pytest.raises(TypeError, match="cpu_blocks must be an int, got bool True"):
        ConversationWorkload(cpu_blocks=True)
    with pytest.raises(TypeError, match="cpu_offload_prompt_only must be a bool, got str 'yes'"):
        ConversationWorkload(cpu_blocks=10, cpu_offload_prompt_only="yes")
    run = simulate(ConversationWorkload(duration_s=60.0, burst_at_s=None, cpu_blocks=100))
    with pytest.raises(ValueError, match="source must be 'gpu', 'cpu' or 'both', got 'host'"):
        run.rate_between(0, 60, source="host")
    with pytest.raises(ValueError, match="got 'host'"):
        run.recovery_s(source="host")
