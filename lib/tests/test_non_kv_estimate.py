"""The non-KV estimate before a first start: its terms, its bad input, and its error against logged figures."""

import pytest

from pagedkv import budget, server_log
from pagedkv import non_kv_estimate as n

GiB = 2**30


def test_the_capture_sizes_follow_0_33_0s_default_list():
    sizes = n.cudagraph_capture_sizes(1024, 8192)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512 and len(sizes) == 3 + 31 + 17
    assert all(b - a == 16 for a, b in zip(sizes[34:], sizes[35:]))
    # the cap is 2 x max_num_seqs below 512; max_num_batched_tokens is added when it fits
    assert n.cudagraph_capture_sizes(100, 8192)[-1] == 200
    assert 100 in n.cudagraph_capture_sizes(256, 100) and max(n.cudagraph_capture_sizes(256, 100)) == 100
    assert n.cudagraph_capture_sizes(1024, 8192, data_center_blackwell=True)[-1] == 1024


def test_the_terms_are_the_dominant_tensors():
    # Llama-3-8B at 8,192 tokens: MLP half, 2 T H + 3 T I, in bf16
    assert n.layer_peak_bytes("Llama-3-8B", 8192) == 8192 * (2 * 4096 + 3 * 14336) * 2
    # tensor parallelism splits the MLP and attention widths, not the residual stream
    assert n.layer_peak_bytes("Llama-3-8B", 8192, 2) == 8192 * (2 * 4096 + 3 * 14336 // 2) * 2
    assert n.sampler_bytes("Llama-3-8B", 256) == 256 * 128256 * (2 + 4 + 4)
    e = n.estimate_non_kv("Llama-3-8B", max_num_batched_tokens=8192, max_num_seqs=1024)
    # the sampler runs on min(T, max_num_seqs) rows beside the T x H hidden states
    assert e.activation_bytes == max(e.layer_peak_bytes, 8192 * 4096 * 2 + n.sampler_bytes("Llama-3-8B", 1024))
    eager = n.estimate_non_kv("Llama-3-8B", enforce_eager=True)
    assert eager.cudagraph_bytes == 0 and eager.num_cudagraph_sizes == 0 and e.cudagraph_bytes > 0
    assert e.allowance_bytes == e.activation_bytes + e.cudagraph_bytes
    assert e.total_bytes == e.weight_bytes + e.allowance_bytes
    # a bigger batch budget never needs less
    assert n.estimate_non_kv("Llama-3-8B", max_num_batched_tokens=16384).activation_bytes > \
        n.estimate_non_kv("Llama-3-8B", max_num_batched_tokens=2048).activation_bytes


def test_the_estimate_feeds_the_plan_as_its_allowance():
    e = n.estimate_non_kv("Llama-3.1-8B")
    p = budget.plan(non_kv_gib=e.allowance_bytes / GiB)
    assert p.non_kv_bytes == pytest.approx(e.allowance_bytes)
    assert p.num_blocks > budget.plan().num_blocks  # 1.4 GiB modelled, against the round 6.0 GiB


def test_the_error_against_logged_figures_is_what_the_estimate_gives():
    rows = n.estimate_errors()
    assert [r["source"] for r in rows] == [f["source"] for f in n.LOGGED_FIGURES]
    for r in rows:
        assert r["weights_error"] == pytest.approx(r["est_weights_gib"] / r["weights_gib"] - 1)
        assert abs(r["weights_error"]) < 0.01  # parameters x bytes is the weights, to the log's rounding
    acts = [r for r in rows if "activation_gib" in r]
    assert acts and all(r["est_activation_gib"] < r["activation_gib"] for r in acts)  # it underestimates
    tp1 = acts[0]
    assert tp1["activation_error"] == pytest.approx(
        n.estimate_non_kv("Llama-3-8B", max_num_seqs=256).activation_bytes / GiB / 1.26 - 1)


def test_a_dry_run_log_is_compared_term_by_term():
    log = server_log.read_startup_log(
        "INFO Model loading took 14.99 GiB memory and 3.5 seconds\n"
        "INFO Available KV cache memory: 53.2 GiB\n"
        "INFO Free memory on device (78.6/79.19 GiB) on startup. Desired GPU memory utilization is "
        "(0.9, 71.27 GiB). Actual usage is 16.5 GiB for consumed memory (weights + non-torch), "
        "1.32 GiB for peak activation, and 0.25 GiB for CUDAGraph memory.")
    rows = n.compare_with_log(n.estimate_non_kv("Llama-3.1-8B"), log)
    assert [(name, logged) for name, _, logged in rows] == [
        ("weights", 14.99), ("activation peak + graph estimate", 1.32), ("CUDA graphs captured", 0.25)]
    e = n.estimate_non_kv("Llama-3.1-8B")
    assert rows[1][1] == pytest.approx(e.allowance_bytes / GiB)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(model="Llama-3-8B", max_num_batched_tokens=0), ValueError, "max_num_batched_tokens"),
    (dict(model="Llama-3-8B", max_num_seqs=1.5), TypeError, "max_num_seqs"),
    (dict(model="Llama-3-8B", weight_gib=-1), ValueError, "weight_gib"),
    (dict(model={"model_type": "gpt_oss", "num_hidden_layers": 2, "num_attention_heads": 8,
                 "num_key_value_heads": 8, "head_dim": 64, "hidden_size": 512, "sliding_window": 128,
                 "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 4096}),
     ValueError, "parameter count"),
    (dict(model={"model_type": "gpt_oss", "num_hidden_layers": 2, "num_attention_heads": 8,
                 "num_key_value_heads": 8, "head_dim": 64, "hidden_size": 512, "sliding_window": 128,
                 "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 4096},
          weight_gib=1.0), ValueError, "intermediate_size"),
])
def test_bad_input_is_named(kwargs, error, match):
    model = kwargs.pop("model")
    with pytest.raises(error, match=match):
        n.estimate_non_kv(model, **kwargs)
