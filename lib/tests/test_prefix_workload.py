"""The prefix hit-rate estimate against the engine serving the same prompts (issue 39 §3)."""

import pytest

from pagedkv.sim.prefix_workload import ChatWorkload, estimate, position_for_rate, run_on_engine


@pytest.fixture(scope="module")
def model():
    from pagedkv.model import Model, ModelConfig

    return Model(ModelConfig.preset("tiny"), seed=0)


def test_the_operators_cases_at_full_size():
    # A 1,500-token system prompt, a 250-token user turn: block size costs under 2 %,
    # eight per-request tokens before the system prompt cost everything.
    base = ChatWorkload(1_500, 250, block_size=32)
    fixed32, fixed16 = estimate(base).steady, estimate(ChatWorkload(1_500, 250, block_size=16)).steady
    assert round(fixed32, 4) == round(1_472 / 1_750, 4) and round(fixed16, 4) == round(1_488 / 1_750, 4)
    assert 0 < fixed16 - fixed32 < 0.02
    top = ChatWorkload(1_500, 250, varying_len=8, varying_at=0, block_size=32)
    assert estimate(top).steady == 0.0
    mid = ChatWorkload(1_500, 250, varying_len=8, varying_at=1_200, block_size=32)
    assert estimate(mid).steady == pytest.approx(1_184 / 1_758)
    docs = ChatWorkload(1_500, 250, document_len=6_000, document_share=0.2, block_size=32)
    assert estimate(docs).steady == pytest.approx(1_472 / (1_750 + 0.2 * 6_000), rel=1e-3)
    assert estimate(docs).steady < 0.6 * fixed32
    # 20 %: per-request text about 350 tokens in.
    assert position_for_rate(base, 0.20) == 320


@pytest.mark.parametrize("w", [
    ChatWorkload(150, 25, block_size=8),
    ChatWorkload(150, 25, block_size=4),
    ChatWorkload(150, 25, varying_len=2, varying_at=0, block_size=8),
    ChatWorkload(150, 25, varying_len=2, varying_at=120, block_size=8),
    ChatWorkload(150, 25, document_len=600, document_share=0.2, block_size=8),
    ChatWorkload(7, 1, block_size=8),  # shorter than a block: nothing to share
    ChatWorkload(16, 1, block_size=8),  # the num_tokens - 1 cap
])
def test_estimate_equals_the_engine_with_room_for_all(model, w):
    got, est = run_on_engine(w, 10, model), estimate(w, 10)
    assert (got["hits"], got["queries"]) == (est.hits, est.queries)
    assert got["num_preemptions"] == 0


@pytest.mark.parametrize("w", [
    ChatWorkload(64, 12, block_size=4, num_system_prompts=3),
    ChatWorkload(64, 13, block_size=4, num_system_prompts=3, output_len=3),  # a partial last block
    ChatWorkload(32, 8, block_size=4, num_system_prompts=2, document_len=40, document_share=0.5,
                 output_len=2),
])
def test_eviction_under_prompts_taken_in_turn_matches_the_engine(model, w):
    full = estimate(w, 12, pool_blocks=10_000)
    need = full.blocks_needed
    longest = max(w.prompt_len(i) for i in range(12)) + w.output_len
    smallest = -(-(longest + 1) // w.block_size)  # the engine's max_model_len must fit
    for pool in sorted({max(p, smallest) for p in (need // 2, need - 5, need - 1, need)}):
        est = estimate(w, 12, pool_blocks=pool)
        got = run_on_engine(w, 12, model, pool_blocks=pool, one_at_a_time=True)
        assert got["hits"] == est.hits, pool
        assert est.fits == (pool >= need)
    assert estimate(w, 12, pool_blocks=need).hits == full.hits == estimate(w, 12).hits


def test_resumed_requests_are_left_out_of_the_hit_rate(model):
    # A pool too small for everyone at once: requests are preempted and
    # admitted again; their second lookups count apart, as in vLLM 0.33.0.
    w = ChatWorkload(32, 16, block_size=4, output_len=16)
    got = run_on_engine(w, 6, model, pool_blocks=40)
    assert got["num_preemptions"] > 0 and got["preempted_queries"] > 0
    assert got["requests"] == 6 and got["queries"] == sum(w.prompt_len(i) for i in range(6))


def test_bad_descriptions_are_named():
    with pytest.raises(ValueError, match="varying_at=20 is past the system prompt"):
        ChatWorkload(10, 5, varying_len=1, varying_at=20)
    with pytest.raises(ValueError, match="document_share"):
        ChatWorkload(10, 5, document_share=1.5)
    with pytest.raises(TypeError):
        ChatWorkload(10.0, 5)
    with pytest.raises(ValueError, match="pool_blocks"):
        estimate(ChatWorkload(10, 5), pool_blocks=0)
