"""EngineArgs' tensor-parallel size and KV cache dtype, and to_cli with only what differs (issue 39 §2)."""

import pytest
import torch

from pagedkv import budget
from pagedkv.engine import EngineArgs, LLMEngine
from pagedkv.engine.args import KV_CACHE_DTYPES, VLLM_GPU_CLASSES, VLLM_SERVE_DEFAULTS, vllm_default_limits


def test_tp_and_fp8_are_fields_with_vllms_defaults_and_flags():
    a = EngineArgs()
    assert (a.tensor_parallel_size, a.kv_cache_dtype) == (1, "auto")
    table = {f: flag for f, flag, _ in a.cli_table()}
    assert table["tensor_parallel_size"] == "--tensor-parallel-size"
    assert table["kv_cache_dtype"] == "--kv-cache-dtype"
    cli = a.replace(tensor_parallel_size=4, kv_cache_dtype="fp8").to_cli("meta-llama/Llama-3.1-70B-Instruct")
    assert "--tensor-parallel-size 4" in cli and "--kv-cache-dtype fp8" in cli
    # At 1 and "auto" they stay out even of the full command (vLLM's defaults).
    assert "tensor-parallel" not in a.to_cli() and "kv-cache-dtype" not in a.to_cli()
    assert set(KV_CACHE_DTYPES) - {"auto"} <= set(budget.DTYPE_BYTES)


def test_only_changed_leaves_out_vllms_defaults():
    a = EngineArgs(tensor_parallel_size=4, kv_cache_dtype="fp8", gpu_memory_utilization=0.9,
                   max_model_len=32_768)
    cli = a.to_cli("meta-llama/Llama-3.1-70B-Instruct", only_changed=True, gpu_class="H100/H200")
    assert cli.split(" \\\n  ") == [
        "vllm serve meta-llama/Llama-3.1-70B-Instruct", "--gpu-memory-utilization 0.9",
        "--max-model-len 32768", "--tensor-parallel-size 4", "--kv-cache-dtype fp8"]
    for absent in ("--seed", "--watermark", "--block-size", "--enable-prefix-caching", "--max-num-seqs",
                   "--max-num-batched-tokens", "--scheduler-reserve-full-isl"):
        assert absent not in cli
    # Issue 42 item 5: the offline class's 8,192 that EngineArgs() runs with is
    # nobody's choice; set by hand on a GPU where `vllm serve` batches 2,048, it is said.
    assert "--max-num-batched-tokens" not in a.to_cli(only_changed=True)
    assert "--max-num-batched-tokens 8192" in a.replace(max_num_batched_tokens=8192).to_cli(only_changed=True)
    assert EngineArgs(max_num_seqs=1024, max_num_batched_tokens=16384).to_cli(
        only_changed=True, gpu_class=">=160 GiB") == "vllm serve MODEL"
    off = EngineArgs(enable_prefix_caching=False, seed=1).to_cli(only_changed=True, gpu_class="H100/H200")
    assert "--no-enable-prefix-caching" in off and "--seed 1" in off
    d = a.vllm_defaults("other")
    assert (d["max_num_seqs"], d["max_num_batched_tokens"]) == vllm_default_limits("serve", "other")
    assert set(VLLM_SERVE_DEFAULTS) | {"max_num_seqs", "max_num_batched_tokens"} == \
        {f for f, flag, _ in a.cli_table() if flag != "-"}
    with pytest.raises(TypeError, match="only_changed"):
        a.to_cli(only_changed=1)
    with pytest.raises(ValueError, match="gpu_class"):
        a.to_cli(only_changed=True, gpu_class="A100")


@pytest.mark.parametrize("field,value,exc", [
    ("tensor_parallel_size", 0, ValueError), ("tensor_parallel_size", 2.0, TypeError),
    ("kv_cache_dtype", "int8", ValueError), ("kv_cache_dtype", None, TypeError),
])
def test_bad_tp_and_dtype_are_named(field, value, exc):
    with pytest.raises(exc, match=field):
        EngineArgs(**{field: value})


def test_the_engine_runs_one_rank_in_the_models_dtype():
    from pagedkv.model import Model, ModelConfig

    model = Model(ModelConfig.preset("tiny"), seed=0)
    base = dict(block_size=4, num_gpu_blocks_override=64, max_model_len=64, kernel_backend="torch")
    with pytest.raises(ValueError, match="tensor_parallel_size=2: this engine runs one rank"):
        LLMEngine(EngineArgs(**base, tensor_parallel_size=2), model)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        LLMEngine(EngineArgs(**base, kv_cache_dtype="fp8"), model)
    assert LLMEngine(EngineArgs(**base, kv_cache_dtype="auto"), model).pool.num_blocks == 64
    half = Model(ModelConfig.preset("tiny"), seed=0, dtype=torch.bfloat16)
    assert LLMEngine(EngineArgs(**base, kv_cache_dtype="bfloat16"), half).pool.num_blocks == 64


def test_fp8_halves_a_blocks_bytes_so_the_plan_doubles_the_requests():
    # The question 1: Llama-3.1-70B, 4 x H100, TP 4, 0.9, 32k, 2,000 + 500 tokens.
    kw = dict(model="Llama-3.1-70B", tensor_parallel_size=4, gpu_memory_utilization=0.9, request_len=2_500)
    bf16, fp8 = budget.plan(**kw), budget.plan(**kw, dtype="fp8")
    assert (bf16.paged_ceiling, fp8.paged_ceiling) == (171, 342)
    assert budget.block_bytes("Llama-3.1-70B", 16, "fp8", 4) * 2 == budget.block_bytes("Llama-3.1-70B", 16, "bf16", 4)


def _serve_default_args(gpu_class):
    d = EngineArgs().vllm_defaults(gpu_class)
    return {k: v for k, v in d.items() if v is not None}


@pytest.mark.parametrize("gpu_class", VLLM_GPU_CLASSES)
def test_only_changed_says_nothing_for_defaults_on_every_gpu_class(gpu_class):
    """Issue 42 item 5: EngineArgs() and every field set to `vllm serve`'s own
    default for the class give a bare command; each field set to something
    else gives exactly its flag."""
    assert EngineArgs().to_cli("m", only_changed=True, gpu_class=gpu_class) == "vllm serve m"
    serve = _serve_default_args(gpu_class)
    assert EngineArgs(**serve).to_cli("m", only_changed=True, gpu_class=gpu_class) == "vllm serve m"
    seqs, tokens = vllm_default_limits("serve", gpu_class)
    assert (serve["max_num_seqs"], serve["max_num_batched_tokens"]) == (seqs, tokens)
    table = {f: flag for f, flag, _ in EngineArgs().cli_table()}
    others = {"block_size": 32, "gpu_memory_utilization": 0.8, "max_model_len": 4096,
              "max_num_seqs": 64, "max_num_batched_tokens": 4096, "enable_prefix_caching": False,
              "enable_chunked_prefill": False, "scheduler_reserve_full_isl": False, "watermark": 0.01,
              "async_scheduling": False, "num_gpu_blocks_override": 100, "kv_cache_memory_bytes": 2**30, "prefix_match_unit": 16,
              "seed": 7, "tensor_parallel_size": 2, "kv_cache_dtype": "fp8",
              "long_prefill_token_threshold": 512, "long_prefill_token_threshold_adaptive": True,
              "scheduling_policy": "priority"}
    assert set(others) == set(VLLM_SERVE_DEFAULTS) | {"max_num_seqs", "max_num_batched_tokens"}
    for name, value in others.items():
        args = EngineArgs(**{"max_num_batched_tokens": 8192, **{name: value}}) \
            if name in ("enable_chunked_prefill",) else EngineArgs(**{name: value})
        cli = args.to_cli("m", only_changed=True, gpu_class=gpu_class).split(" \\\n  ")[1:]
        flags = [part.split(" ")[0] for part in cli]
        want = table[name] if not isinstance(value, bool) or value else "--no-" + table[name][2:]
        assert want in flags, (name, cli)
        extra = [f for f in flags if f != want]
        if name == "enable_chunked_prefill" and tokens != 8192:
            assert extra == ["--max-num-batched-tokens"], cli
        else:
            assert extra == [], (name, cli)


def test_set_by_hand_survives_replace():
    a = EngineArgs(seed=3)
    assert a.set_by_hand == {"seed"}
    b = a.replace(max_num_seqs=64)
    assert b.set_by_hand == {"seed", "max_num_seqs"} and b == EngineArgs(seed=3, max_num_seqs=64)
    assert EngineArgs(16).set_by_hand == {"block_size"}


def test_the_latency_knobs_are_checked_as_vllm_checks_them():
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, got 'lifo'"):
        EngineArgs(scheduling_policy="lifo")
    with pytest.raises(ValueError, match=r"long_prefill_token_threshold \(5000\) cannot be greater than the "
                                         r"max_model_len \(4096\)"):
        EngineArgs(max_model_len=4096, long_prefill_token_threshold=5000)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        EngineArgs(long_prefill_token_threshold=-1)
    with pytest.raises(TypeError):
        EngineArgs(long_prefill_token_threshold_adaptive=1)
    cli = EngineArgs(long_prefill_token_threshold=512, scheduling_policy="priority").to_cli("m", only_changed=True)
    assert cli.split(" \\\n  ")[1:] == ["--long-prefill-token-threshold 512", "--scheduling-policy priority"]
