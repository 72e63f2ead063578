"""The memory budget: known answers from the book's reference setup, and bad input."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from pagedkv import budget as b
from pagedkv import server_log
from pagedkv.budget import GiB, KiB, MiB

H100_POOL = 81_559 * MiB * 0.92 - 14.96 * GiB - 6.0 * GiB  # the reference budget


def test_kv_bytes_per_token_llama3_8b_is_128_kib():
    assert b.kv_bytes_per_token("Llama-3-8B") == 2 * 32 * 8 * 128 * 2 == 128 * KiB


@pytest.mark.parametrize("dtype,expected", [("fp32", 256 * KiB), ("fp16", 128 * KiB), ("bf16", 128 * KiB),
                                            ("fp8", 64 * KiB), (torch.float8_e4m3fn, 64 * KiB),
                                            (torch.bfloat16, 128 * KiB)])
def test_kv_bytes_per_token_scales_with_dtype(dtype, expected):
    assert b.kv_bytes_per_token("Llama-3-8B", dtype) == expected


def test_mha_model_costs_four_times_its_gqa_sibling():
    # Llama-2-7B keeps 32 KV heads; Llama-3-8B shares 8 among 32 query heads.
    assert b.kv_bytes_per_token("Llama-2-7B") == 4 * b.kv_bytes_per_token("Llama-3-8B")
    assert b.model_spec("Llama-2-7B").attention == "MHA"
    assert b.model_spec("Llama-3-8B").attention == "GQA"


def test_every_preset_is_consistent():
    for m in b.MODELS.values():
        assert m.num_attention_heads % m.num_kv_heads == 0
        assert m.extended_context >= m.native_context
        assert b.kv_bytes_per_token(m) == 2 * m.num_layers * m.num_kv_heads * m.head_dim * 2
    assert b.gpu_spec("H100 SXM 80GB").total_mib == 81_559
    assert b.gpu_spec("H200").total_mib == 143_771
    assert {"A100 SXM 80GB", "L4", "RTX 4090"} <= set(b.GPUS)


def test_reference_pool_blocks_and_slots():
    pool = b.kv_pool_bytes(81_559 * MiB, 0.92, 14.96 * GiB, 6.0 * GiB)
    assert round(pool / GiB, 4) == 52.3157
    assert b.num_gpu_blocks(pool, "Llama-3-8B", 16) == 26_785
    assert b.token_slots(26_785, 16) == 428_560


def test_rounded_total_gives_one_more_block():
    # 79.65 GiB is 81,561.6 MiB, 2.6 MiB more than the card reports: enough to cross a block.
    pool = b.kv_pool_bytes(79.65 * GiB, 0.92, 14.96 * GiB, 6.0 * GiB)
    assert b.num_gpu_blocks(pool, "Llama-3-8B", 16) == 26_786


def test_block_count_is_two_floor_divisions():
    page = b.page_bytes_per_layer("Llama-3-8B", 16)
    assert page == 64 * KiB and b.block_bytes("Llama-3-8B", 16) == 2 * MiB
    # A pool one byte short of 10 whole blocks in every layer holds 9.
    assert b.num_gpu_blocks(10 * 2 * MiB - 1, "Llama-3-8B") == 9
    assert b.num_gpu_blocks(10 * 2 * MiB, "Llama-3-8B") == 10


def test_contiguous_reservations_and_paged_ceiling():
    assert 32_768 * b.kv_bytes_per_token("Llama-3-8B") == 4 * GiB
    assert b.contiguous_reservations(H100_POOL, "Llama-3-8B", 32_768) == 13
    assert b.blocks_per_request(612, 16) == 39
    assert b.paged_ceiling(26_785, 612, 16) == 686
    assert b.blocks_per_request(4_097, 16) == 257


def test_plan_matches_the_pieces():
    p = b.plan(weight_gib=14.96)
    assert (p.num_blocks, p.token_slots, p.contiguous_reservations, p.paged_ceiling) == (26_785, 428_560, 13, 686)
    assert math.isclose(p.headroom_bytes, 81_559 * MiB * 0.08)
    assert dict(p.rows())["KV pool"] == "52.32 GiB"
    # Without the override, weights come from the parameter count (14.958 GiB).
    assert round(b.weight_bytes("Llama-3-8B") / GiB, 2) == 14.96


def test_tensor_parallel_splits_then_replicates_kv_heads():
    assert b.kv_heads_per_rank("Llama-3.1-70B", 1) == 8
    assert b.kv_heads_per_rank("Llama-3.1-70B", 4) == 2
    assert b.kv_heads_per_rank("Llama-3.1-70B", 8) == 1
    assert b.kv_heads_per_rank("Llama-3.1-70B", 16) == 1  # replicated: per-rank KV stops shrinking
    assert b.kv_bytes_per_token("Llama-3.1-70B", "bf16", 4) == b.kv_bytes_per_token("Llama-3.1-70B") // 4
    assert b.weight_bytes("Llama-3.1-70B", "bf16", 4) == b.weight_bytes("Llama-3.1-70B") // 4
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        b.kv_heads_per_rank("Llama-3.1-70B", 3)
    with pytest.raises(ValueError, match="tensor_parallel_size=12"):
        b.kv_heads_per_rank("Llama-3.1-70B", 12)


@given(util=st.floats(0.05, 1.0), nonkv=st.floats(0, 10), bs=st.sampled_from([1, 8, 16, 32, 128]))
def test_blocks_never_exceed_the_pool(util, nonkv, bs):
    total = 81_559 * MiB
    try:
        pool = b.kv_pool_bytes(total, util, 14.96 * GiB, nonkv * GiB)
    except ValueError:
        assert total * util <= (14.96 + nonkv) * GiB
        return
    n = b.num_gpu_blocks(pool, "Llama-3-8B", bs)
    assert n * b.block_bytes("Llama-3-8B", bs) <= pool < (n + 1) * b.block_bytes("Llama-3-8B", bs)


def test_startup_check_passes_when_one_request_fits():
    b.check_enough_kv_cache_memory(H100_POOL, "Llama-3.1-8B", 32_768)


def test_startup_check_message_names_both_sizes_the_fit_and_the_knobs():
    pool = 2_048 * b.block_bytes("Llama-3.1-8B", 16)  # --num-gpu-blocks-override 2048
    with pytest.raises(ValueError) as info:
        b.check_enough_kv_cache_memory(pool, "Llama-3.1-8B", 131_072)
    msg = str(info.value)
    # vLLM 0.33.0's wording (kv_cache_planning.py), its stray "(" included.
    assert msg.startswith("To serve at least one request with the model's max seq len (131072), "
                          "(16.0 GiB KV cache is needed")
    assert "available KV cache memory (4.0 GiB)" in msg  # 4 GiB - 2 MiB, rounded as vLLM's format_gib
    assert "maximum model length is 32752" in msg  # 2,047 usable blocks: the null block is held back
    assert "`gpu_memory_utilization`" in msg and "`max_model_len`" in msg


def test_the_null_block_is_held_back_before_the_check():
    one = b.block_bytes("Llama-3.1-8B", 16)
    with pytest.raises(ValueError, match=r"max seq len \(32768\)"):
        b.check_enough_kv_cache_memory(2_048 * one, "Llama-3.1-8B", 32_768)
    b.check_enough_kv_cache_memory(2_048 * one, "Llama-3.1-8B", 32_752)
    b.check_enough_kv_cache_memory(2_049 * one, "Llama-3.1-8B", 32_768)
    assert b.usable_max_model_len(2_048 * one, "Llama-3.1-8B") == 32_752
    with pytest.raises(ValueError, match="No available memory for the cache blocks"):
        b.check_enough_kv_cache_memory(one, "Llama-3.1-8B", 16)


def _vllm_estimate(check_memory, per_block, block_size, max_model_len):
    """vLLM 0.33.0's estimate_max_model_len, transcribed: a binary search over
    lengths whose cdiv(len, block_size) blocks fit ``check_memory``."""
    def fits(n):
        return -(-n // block_size) * per_block <= check_memory
    if not fits(1):
        return 0
    left, right, result = 1, max_model_len, 1
    while left <= right:
        mid = (left + right) // 2
        if fits(mid):
            result, left = mid, mid + 1
        else:
            right = mid - 1
    return result


@given(blocks=st.integers(2, 5_000), extra=st.integers(0, 2 * MiB - 1),
       block_size=st.sampled_from([1, 8, 16, 32, 128]), max_model_len=st.integers(1, 200_000))
def test_startup_check_agrees_with_vllms_search(blocks, extra, block_size, max_model_len):
    per_block = b.block_bytes("Llama-3.1-8B", block_size)
    pool = blocks * per_block + extra  # a profiled pool need not be whole blocks
    check_memory = pool - per_block
    fits = -(-max_model_len // block_size) * per_block <= check_memory
    try:
        b.check_enough_kv_cache_memory(pool, "Llama-3.1-8B", max_model_len, block_size)
    except ValueError as error:
        assert not fits
        estimate = _vllm_estimate(check_memory, per_block, block_size, max_model_len)
        assert f"the estimated maximum model length is {estimate}. " in str(error)
    else:
        assert fits


def test_max_model_len_beyond_the_context_is_refused_as_vllm_does():
    with pytest.raises(ValueError, match=r"max_model_len \(32768\) is greater than the derived "
                                         r"max_model_len \(max_position_embeddings=8192"):
        b.check_max_model_len("Llama-3-8B", 32_768)
    assert b.check_max_model_len("Llama-3.1-8B", 32_768) == 32_768
    assert b.check_max_model_len("Llama-3-8B", 8_192) == 8_192


def test_startup_message_drops_the_estimate_when_nothing_fits():
    msg = b.startup_error_message(1024, 3 * GiB, 0.5 * GiB, 0)
    assert "estimated maximum" not in msg and "(3.0 GiB KV cache is needed" in msg


@pytest.mark.parametrize("util", [0, -0.1, 1.01, float("nan"), True, "0.9"])
def test_utilization_outside_unit_interval_is_refused(util):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        b.kv_pool_bytes(80 * GiB, util, 0, 0)


def test_pool_with_nothing_left_names_the_arithmetic():
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        b.kv_pool_bytes(16 * GiB, 0.9, 14.96 * GiB, 6 * GiB)


@pytest.mark.parametrize("call,error,needle", [
    (lambda: b.kv_pool_bytes(-1, 0.9, 0, 0), ValueError, "total_bytes must be a finite number in [0, inf), got -1"),
    (lambda: b.kv_pool_bytes(80 * GiB, 0.9, -5, 0), ValueError, "weight_bytes must be a finite number in [0, inf), got -5"),
    (lambda: b.num_gpu_blocks(1 * GiB, "Llama-3-8B", 0), ValueError, "block_size must be >= 1, got 0"),
    (lambda: b.num_gpu_blocks(1 * GiB, "Llama-3-8B", 16.0), TypeError, "block_size must be an int, got float 16.0"),
    (lambda: b.token_slots(10, -4), ValueError, "block_size must be >= 1, got -4"),
    (lambda: b.paged_ceiling(100, 0, 16), ValueError, "request_len must be >= 1, got 0"),
    (lambda: b.contiguous_reservations(1 * GiB, "Llama-3-8B", -1), ValueError, "max_model_len must be >= 1, got -1"),
    (lambda: b.kv_bytes_per_token("Llama-4-9000B"), ValueError, "unknown model 'Llama-4-9000B'"),
    (lambda: b.plan(gpu="H900"), ValueError, "unknown GPU 'H900'"),
    (lambda: b.kv_bytes_per_token("Llama-3-8B", "int3"), ValueError, "unknown KV cache dtype 'int3'"),
    (lambda: b.plan(non_kv_gib=-1), ValueError, "non_kv_gib must be a finite number in [0, inf), got -1"),
    (lambda: b.token_slots(2.5, 16), TypeError, "num_blocks must be an int, got float 2.5"),
    (lambda: b.token_slots(True, 16), TypeError, "num_blocks must be an int, got bool True"),
    (lambda: b.token_slots(-1, 16), ValueError, "num_blocks must be >= 0, got -1"),
    (lambda: b.paged_ceiling(100.0, 612, 16), TypeError, "num_blocks must be an int, got float 100.0"),
    (lambda: b.blocks_per_request(612, 16.0), TypeError, "block_size must be an int, got float 16.0"),
    (lambda: b.kv_heads_per_rank("Llama-3-8B", 2.0), TypeError, "tensor_parallel_size must be an int, got float 2.0"),
    (lambda: b.check_enough_kv_cache_memory(float("nan"), "Llama-3-8B", 1024), ValueError,
     "pool_bytes must be a finite number in [0, inf), got nan"),
    (lambda: b.check_enough_kv_cache_memory(-1.0, "Llama-3-8B", 1024), ValueError,
     "pool_bytes must be a finite number in [0, inf), got -1.0"),
    (lambda: b.check_enough_kv_cache_memory(float("inf"), "Llama-3-8B", 1024), ValueError,
     "pool_bytes must be a finite number in [0, inf), got inf"),
    (lambda: b.check_enough_kv_cache_memory("8 GiB", "Llama-3-8B", 1024), TypeError,
     "pool_bytes must be a number, got str '8 GiB'"),
    (lambda: b.kv_bytes_per_token("Llama-3-8B", ["bf16"]), ValueError, "unknown KV cache dtype ['bf16']"),
])
def test_bad_input_is_named(call, error, needle):
    """TypeError for a wrong type (bool and float where an int belongs), ValueError for a wrong value."""
    with pytest.raises(error) as info:
        call()
    assert needle in str(info.value)


def test_counts_are_integers_and_numpy_integers_are_welcome():
    assert b.token_slots(2_048, 16) == 32_768 and type(b.token_slots(2_048, 16)) is int
    assert b.token_slots(np.int64(3), np.int32(16)) == 48 and type(b.token_slots(np.int64(3), 16)) is int
    assert b.paged_ceiling(np.int64(26_785), 612, 16) == 686
    assert b.token_slots(0, 16) == 0


def test_free_memory_sizing_needs_a_gpu_or_measures_one():
    if torch.cuda.is_available():
        r = b.pool_from_free_memory(gpu_memory_utilization=0.5, non_kv_gib=0.5)
        assert 0 < r["pool_gib"] < r["total_gib"] and r["num_blocks"] > 0
    else:
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            b.pool_from_free_memory()


H100_TOTAL = 81_559 * MiB


def test_free_memory_budget_is_a_share_of_the_total_not_of_what_is_free():
    # vLLM 0.33.0: requested = ceil(total x util); other processes' memory is
    # not subtracted, so any free memory >= requested gives the same pool.
    idle = b.pool_from_free_memory(free_and_total=(H100_TOTAL - GiB, H100_TOTAL),
                                   gpu_memory_utilization=0.5)
    busy = b.pool_from_free_memory(free_and_total=(math.ceil(H100_TOTAL * 0.5), H100_TOTAL),
                                   gpu_memory_utilization=0.5)
    assert idle["pool_gib"] == busy["pool_gib"] and idle["num_blocks"] == busy["num_blocks"]
    assert busy["in_use_gib"] == pytest.approx(H100_TOTAL * 0.5 / GiB, abs=1e-6)
    expected = math.ceil(H100_TOTAL * 0.5) - b.weight_bytes("Llama-3-8B") - 6 * GiB
    assert idle["pool_gib"] * GiB == expected
    assert idle["num_blocks"] == b.num_gpu_blocks(expected, "Llama-3-8B")


def test_free_memory_below_the_request_refuses_to_start():
    free = math.ceil(H100_TOTAL * 0.92) - 1
    with pytest.raises(ValueError) as info:
        b.pool_from_free_memory(free_and_total=(free, H100_TOTAL))
    msg = str(info.value)
    assert "less than desired GPU memory utilization (0.92, 73.28 GiB)" in msg
    assert "Free memory on device cuda:0 (73.28/79.65 GiB)" in msg
    # Two instances at 0.46 each fit where one at 0.92 left the rest in use.
    r = b.pool_from_free_memory(free_and_total=(H100_TOTAL // 2 + GiB, H100_TOTAL),
                                gpu_memory_utilization=0.46)
    assert r["num_blocks"] > 0


@pytest.mark.parametrize("free_and_total,needle", [
    ((-1, H100_TOTAL), r"free memory must be a finite number in \[0, inf\)"),
    ((H100_TOTAL + 1, H100_TOTAL), "exceeds total"),
])
def test_free_memory_bad_figures_are_named(free_and_total, needle):
    with pytest.raises(ValueError, match=needle):
        b.pool_from_free_memory(free_and_total=free_and_total)


def test_plan_with_tensor_parallelism_is_per_rank():
    one = b.plan(model="Llama-3.1-70B", tensor_parallel_size=4)
    assert one.tensor_parallel_size == 4
    assert one.weight_bytes == b.weight_bytes("Llama-3.1-70B", "bf16", 4)
    assert one.bytes_per_token == 80 * KiB
    pool = 81_559 * MiB * 0.92 - one.weight_bytes - 6 * GiB
    assert one.pool_bytes == pytest.approx(pool)
    assert one.num_blocks == b.num_gpu_blocks(pool, "Llama-3.1-70B", 16, "bf16", 4)
    assert one.contiguous_reservations == int(pool // (32_768 * 80 * KiB))
    assert dict(one.rows())["tensor_parallel_size"] == "4"
    assert "KV pool per GPU" in dict(one.rows())
    # The weight override is the whole model's, split across ranks.
    assert b.plan(weight_gib=14.96, tensor_parallel_size=2).weight_bytes == 7.48 * GiB
    # 70B's weights alone overflow one H100; on two 1.57 GiB is left per rank.
    with pytest.raises(ValueError, match="no memory left"):
        b.plan(model="Llama-3.1-70B")
    assert round(b.plan(model="Llama-3.1-70B", tensor_parallel_size=2).pool_bytes / GiB, 2) == 1.57
    assert b.plan(model="Llama-3.1-70B", tensor_parallel_size=8).num_blocks > one.num_blocks
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        b.plan(model="Llama-3.1-70B", tensor_parallel_size=3)
    assert b.plan(weight_gib=14.96) == b.plan(weight_gib=14.96, tensor_parallel_size=1)


@pytest.mark.parametrize("name,preset", [("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100 SXM 80GB"),
                                         ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB"), ("NVIDIA L4", "L4"),
                                         ("NVIDIA GeForce RTX 4090", "RTX 4090"), ("NVIDIA L40S", "L40S"),
                                         ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"),
                                         ("Tesla T4", None)])
def test_device_names_find_their_preset(name, preset):
    gpu = b.gpu_for_device_name(name)
    assert (gpu.name if gpu else None) == preset


# ------------------------------------------------- production inputs (issue 39)

LLAMA_31_70B = {  # meta-llama/Llama-3.1-70B-Instruct's config.json, the keys sizing reads
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "rope_scaling": {"factor": 8.0, "rope_type": "llama3", "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
QWEN25_7B = {  # Qwen/Qwen2.5-7B-Instruct
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
    "sliding_window": 131072, "use_sliding_window": False, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False}
MISTRAL_7B_V01 = {  # mistralai/Mistral-7B-v0.1: every layer a 4,096-token window
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
    "sliding_window": 4096, "torch_dtype": "bfloat16"}


def test_config_json_gives_the_presets_shapes_and_parameter_counts():
    for cfg, preset in [(LLAMA_31_70B, "Llama-3.1-70B"), (QWEN25_7B, "Qwen2.5-7B")]:
        got, want = b.model_spec_from_config(cfg), b.model_spec(preset)
        assert (got.num_layers, got.num_attention_heads, got.num_kv_heads, got.head_dim) == \
            (want.num_layers, want.num_attention_heads, want.num_kv_heads, want.head_dim)
        assert got.num_params == want.num_params and got.native_context == want.native_context
        assert b.kv_bytes_per_token(got) == b.kv_bytes_per_token(preset)
    # Mistral v0.3 drops the window: sized, vocabulary 32,768.
    v03 = dict(MISTRAL_7B_V01, sliding_window=None, vocab_size=32768)
    assert b.model_spec_from_config(v03).num_params == 7_248_023_552
    assert b.model_spec_from_config(dict(v03, vocab_size=32000)).num_params == b.model_spec("Mistral-7B").num_params


def test_config_json_dtype_head_dim_and_file(tmp_path):
    import json

    cfg = dict(LLAMA_31_70B, torch_dtype="float16", head_dim=64)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = b.ModelSpec.from_hf_config(path, name="mine")
    assert (m.name, m.torch_dtype, m.head_dim) == ("mine", "float16", 64)
    # "auto" is the checkpoint's dtype; transformers 5 writes "dtype".
    v5 = {k: v for k, v in LLAMA_31_70B.items() if k != "torch_dtype"}
    p = b.plan(model=dict(v5, dtype="float32"), dtype="auto", tensor_parallel_size=8,
               gpu="H200", weight_gib=140)
    assert p.dtype == "float32" and p.bytes_per_token == 2 * 80 * 1 * 128 * 4
    assert b.plan(model=LLAMA_31_70B, tensor_parallel_size=4).num_blocks == \
        b.plan(model="Llama-3.1-70B", tensor_parallel_size=4).num_blocks


@pytest.mark.parametrize("change,kinds", [
    (MISTRAL_7B_V01, {"sliding_attention"}),
    (dict(LLAMA_31_70B, layer_types=["full_attention", "sliding_attention"] * 40, sliding_window=4096),
     {"full_attention", "sliding_attention"}),
    (dict(LLAMA_31_70B, model_type="deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64), {"mla"}),
])
def test_config_json_sizes_windowed_and_mla_models_by_their_layer_kinds(change, kinds):
    assert b.unsized_reason(change) is None
    m = b.model_spec_from_config(change)
    assert set(m.layer_kinds) == kinds and m.grouped


@pytest.mark.parametrize("change,words", [
    (dict(QWEN25_7B, use_sliding_window=True), "use_sliding_window=true"),
    (dict(LLAMA_31_70B, layer_types=["full_attention", "sliding_attention"] * 40), "needs sliding_window"),
    (dict(LLAMA_31_70B, layer_types=["full_attention", "mamba"] * 40), "unknown layer type 'mamba'"),
    (dict(LLAMA_31_70B, model_type="nemotron_h", hybrid_override_pattern="M-M*"), "model_type 'nemotron_h'"),
])
def test_config_json_refuses_what_it_cannot_size_by_name(change, words):
    assert words in b.unsized_reason(change)
    with pytest.raises(ValueError) as e:
        b.model_spec_from_config(change)
    assert words in str(e.value)


@pytest.mark.parametrize("bad,match", [
    ({k: v for k, v in LLAMA_31_70B.items() if k != "num_hidden_layers"}, "lacks 'num_hidden_layers'"),
    (dict(LLAMA_31_70B, num_key_value_heads=7), "not a multiple"),
    (dict(LLAMA_31_70B, torch_dtype="int4"), "torch_dtype 'int4'"),
    (dict(LLAMA_31_70B, num_hidden_layers=0), "num_hidden_layers"),
])
def test_config_json_bad_keys_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        b.model_spec_from_config(bad)
    with pytest.raises(TypeError):
        b.model_spec_from_config(42)
    with pytest.raises(ValueError, match="cannot read"):
        b.model_spec_from_config("no/such/config.json")


SERVER_LOG = """\
(EngineCore pid=4242) INFO 11-20 10:01:02 [gpu_model_runner.py:5089] Model loading took 32.86 GiB memory and 41.207311 seconds
(EngineCore pid=4242) INFO 11-20 10:01:40 [gpu_worker.py:773] Available KV cache memory: 31.2 GiB
(EngineCore pid=4242) INFO 11-20 10:01:41 [kv_cache_utils.py:1149] GPU KV cache size: 408,896 tokens, Maximum concurrency for 32,768 tokens per request: 12.48x
"""


def test_startup_log_is_read_with_any_prefix():
    log = server_log.read_startup_log(SERVER_LOG)
    assert (log.model_loading_gib, log.available_kv_gib, log.kv_cache_tokens, log.max_model_len,
            log.max_concurrency) == (32.86, 31.2, 408_896, 32_768, 12.48)
    assert log.non_kv_gib is None and log.derived_non_kv_gib is None
    s = server_log.size_from_log(SERVER_LOG, "Llama-3.1-70B", request_len=2_500, tensor_parallel_size=4)
    assert s.num_blocks == 408_896 // 16 == 25_556 and s.consistent
    assert s.concurrency == 25_555 // 157 == 162
    # The wrong TP shows: blocks from the pool disagree with the capacity line.
    assert not server_log.size_from_log(SERVER_LOG, "Llama-3.1-70B", 2_500, tensor_parallel_size=2).consistent
    with pytest.raises(ValueError, match="Available KV cache memory"):
        server_log.read_startup_log("INFO Model loading took 3 GiB memory")


def test_startup_log_non_kv_from_debug_or_info_lines():
    debug = ("DEBUG Memory profiling takes 9.10 seconds. Total non KV cache memory: 38.9GiB; torch peak "
             "memory increase: 5.1GiB; total consumed (from mem_get_info): 33.2GiB; weights memory: 32.86GiB.")
    log = server_log.read_startup_log(SERVER_LOG + debug)
    # Issue 42 item 2: the DEBUG figure leaves out the CUDA-graph estimate
    # (on by default), so on its own it gives no total ...
    assert log.non_kv_gib == 38.9 and log.derived_non_kv_gib is None and log.allowance_gib is None
    # ... and with the estimate line the two add up.
    graphs = "INFO CUDA graph pool memory: 1.3 GiB (actual), 1.21 GiB (estimated), difference: 0.09 GiB (6.9%)."
    log = server_log.read_startup_log(SERVER_LOG + debug + "\n" + graphs)
    assert log.cudagraph_estimate_gib == 1.21 and log.derived_non_kv_gib == round(38.9 + 1.21, 2)
    assert log.allowance_gib == round(38.9 + 1.21 - 32.86, 2)
    info = ("INFO Free memory on device (78.9/79.19 GiB) on startup. Desired GPU memory utilization is "
            "(0.9, 71.27 GiB). Actual usage is 34.1 GiB for consumed memory (weights + non-torch), 4.2 GiB "
            "for peak activation, and 1.31 GiB for CUDAGraph memory. Replace ...")
    log = server_log.read_startup_log(SERVER_LOG + info)
    assert (log.free_gib, log.total_gib, log.gpu_memory_utilization, log.requested_gib) == (78.9, 79.19, 0.9, 71.27)
    assert (log.consumed_gib, log.activation_gib, log.cudagraph_gib) == (34.1, 4.2, 1.31)
    assert log.derived_non_kv_gib == round(71.27 - 31.2, 2)
    # Requested - available is preferred to the DEBUG line, even with it.
    assert server_log.read_startup_log(SERVER_LOG + debug + "\n" + info).derived_non_kv_gib == round(71.27 - 31.2, 2)


@given(st.integers(2, 400_000), st.sampled_from([16, 32, 64, 128]), st.integers(1, 131_072))
def test_capacity_line_inverts_to_the_blocks(blocks, block_size, max_model_len):
    per = b.cdiv(max_model_len, block_size)
    tokens = int(blocks / per * max_model_len)
    got = server_log.blocks_from_log_tokens(tokens, max_model_len, block_size)
    assert int(got / per * max_model_len) == tokens


def test_plan_round_trips_through_its_own_log_lines():
    # The book's question 1: Llama-3.1-70B on 4 x H100, TP 4, 0.9, 32k, 2k + 500 tokens: 171 in bf16.
    p = b.plan(model=LLAMA_31_70B, tensor_parallel_size=4, gpu_memory_utilization=0.9,
               request_len=2_500, max_model_len=32_768)
    assert (p.num_blocks, p.blocks_per_request, p.paged_ceiling) == (26_893, 157, 171)
    lines = server_log.server_log_lines(p, load_seconds=41.2)
    s = server_log.size_from_log("\n".join(lines), LLAMA_31_70B, 2_500, tensor_parallel_size=4)
    assert s.num_blocks == p.num_blocks and s.concurrency == 171 and s.consistent
    assert s.log.allowance_gib == 6.0
    fp8 = server_log.size_from_log("\n".join(server_log.server_log_lines(b.plan(
        model=LLAMA_31_70B, tensor_parallel_size=4, gpu_memory_utilization=0.9, dtype="fp8",
        request_len=2_500))), LLAMA_31_70B, 2_500, kv_cache_dtype="fp8", tensor_parallel_size=4)
    assert fp8.concurrency == 342


def test_auto_kv_dtype_is_the_checkpoints_everywhere():
    half = b.model_spec_from_config(dict(LLAMA_31_70B, torch_dtype="float32"))
    assert b.kv_bytes_per_token(half, "auto") == 2 * b.kv_bytes_per_token("Llama-3.1-70B", "auto")
    assert b.block_bytes(half, 16, "auto", 4) == b.block_bytes(half, 16, "fp32", 4)
    assert b.num_gpu_blocks(2**30, "Llama-3.1-70B", 16, "auto") == b.num_gpu_blocks(2**30, "Llama-3.1-70B", 16)


# ---------------------------------------------------------------- issue 42

def test_logged_non_kv_is_taken_as_logged_and_the_weights_are_not_subtracted_twice():
    """Item 1: the figure a server logs includes the weights; plan() takes it as
    logged_non_kv_gib and gives the same pool as the allowance without them."""
    kw = dict(model="Llama-3.1-70B", tensor_parallel_size=4, gpu_memory_utilization=0.9, request_len=2_500)
    by_allowance = b.plan(**kw, non_kv_gib=6.0)
    lines = server_log.server_log_lines(by_allowance, cudagraph_gib=1.0)
    log = server_log.read_startup_log("\n".join(lines))
    assert log.non_kv_gib == 37.85 and log.cudagraph_estimate_gib == 1.0      # DEBUG excludes graphs
    assert log.derived_non_kv_gib == 38.85 and log.allowance_gib == 6.0
    by_log = b.plan(**kw, logged_non_kv_gib=log.derived_non_kv_gib)
    # The same pool, to the log's rounding (0.005 GiB: 4 blocks of 1,280 KiB).
    assert abs(by_log.pool_bytes - by_allowance.pool_bytes) <= 0.005 * GiB
    assert abs(by_log.num_blocks - by_allowance.num_blocks) <= 4 and by_allowance.num_blocks == 26_893
    assert round(by_log.non_kv_bytes / GiB, 2) == 6.0
    # The double count the API used to allow: the logged total as an allowance.
    with pytest.raises(ValueError, match="- 32.85 GiB weights - 38.85 GiB non-KV = -0.02 GiB"):
        b.plan(**kw, non_kv_gib=log.derived_non_kv_gib)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(non_kv_gib=6.0, logged_non_kv_gib=20.0), ValueError,
     "not both: got non_kv_gib=6.0 and logged_non_kv_gib=20.0"),
    (dict(logged_non_kv_gib=10.0), ValueError,
     r"logged_non_kv_gib must hold the weights \(14.96 GiB per GPU\), got 10.0"),
    (dict(logged_non_kv_gib="21"), TypeError, "logged_non_kv_gib must be a number, got str '21'"),
    (dict(logged_non_kv_gib=True), TypeError, "logged_non_kv_gib must be a number, got bool True"),
    (dict(logged_non_kv_gib=float("nan")), ValueError, "logged_non_kv_gib"),
    (dict(logged_non_kv_gib=-1.0), ValueError, "logged_non_kv_gib"),
])
def test_logged_non_kv_bad_input_is_named(kw, exc, match):
    with pytest.raises(exc, match=match):
        b.plan(model="Llama-3.1-8B", **kw)


def test_capacity_line_is_the_releases_formula_at_32760():
    """Item 3: vLLM prints int(num_blocks / cdiv(L, B) * L) tokens, fewer than
    blocks x 16 when max_model_len is not a multiple of 16."""
    assert b.logged_kv_cache_tokens(2_000, 32_760, 16) == 31_992 < 2_000 * 16
    assert b.logged_kv_cache_tokens(2_000, 32_768, 16) == 32_000 == b.token_slots(2_000, 16)
    assert server_log.blocks_from_log_tokens(31_992, 32_760, 16) == 2_000
    p = b.plan(max_model_len=32_760)
    line = b.startup_log_lines(p)[1]
    tokens = int(p.num_blocks / b.cdiv(32_760, 16) * 32_760)
    assert f"GPU KV cache size: {tokens:,} tokens" in line and tokens < p.token_slots
    log = server_log.read_startup_log("\n".join(server_log.server_log_lines(p)))
    assert server_log.blocks_from_log_tokens(log.kv_cache_tokens, 32_760, 16) == p.num_blocks


def test_what_vllm_logs_and_what_fits_differ_by_the_null_block():
    """Item 4, an operator's case: 2.797 GiB non-KV, 8,400-token requests. vLLM
    logs 7.00x (all 3,675 blocks / 525); the null block held back, 6 fit."""
    p = b.plan(gpu=b.GPUSpec("a 22,895-MiB GPU", 22_895, 0.0), model="Qwen2.5-7B",
               gpu_memory_utilization=0.9, non_kv_gib=2.797, max_model_len=8_400, request_len=8_400)
    assert (p.num_blocks, p.blocks_per_request) == (3_675, 525)
    assert p.logged_max_concurrency == b.logged_max_concurrency(3_675, 8_400, 16) == 7.0
    assert p.paged_ceiling == b.paged_ceiling(3_675, 8_400, 16) == 6
    assert "Maximum concurrency for 8,400 tokens per request: 7.00x" in b.startup_log_lines(p)[1]
    s = server_log.size_from_log("\n".join(server_log.server_log_lines(p)), "Qwen2.5-7B", 8_400)
    assert (s.log.max_concurrency, s.concurrency) == (7.0, 6)
    # The book's reference pool: 26,785 blocks, 26,784 usable, 686 either way at 612 tokens.
    assert b.paged_ceiling(26_785, 612, 16) == 26_784 // 39 == 686
    assert b.paged_ceiling(1, 16, 16) == 0 and b.paged_ceiling(0, 16, 16) == 0
    with pytest.raises(TypeError, match="num_blocks must be an int, got float 3675.0"):
        b.logged_max_concurrency(3_675.0, 8_400, 16)
    with pytest.raises(ValueError, match="max_model_len must be >= 1, got 0"):
        b.logged_max_concurrency(3_675, 0, 16)
