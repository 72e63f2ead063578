"""Sizing hybrid models by KV-cache groups, checked against vLLM 0.33.0's own planning code.

The configs are the real ``config.json`` fields of each model (the keys the
sizing reads), each with its source. vLLM's ``v1/core/kv_cache_planning.py``
(``get_kv_cache_groups``, ``get_kv_cache_config_from_groups``,
``_max_memory_usage_bytes_from_groups``, ``_estimate_max_model_len_from_groups``)
and ``v1/core/kv_cache_utils.py`` (``get_max_concurrency_for_kv_cache_config``,
``get_kv_cache_capacity``) run from the release wheel beside ours, on the same
layer specs, and must agree on the groups, the page size, the block count,
the blocks one request needs, the "Maximum concurrency" and the token
capacity vLLM logs, and on the startup check's verdict and estimate.
"""

from __future__ import annotations

import sys
import types
import zipfile

import pytest

from pagedkv import budget
from pagedkv.kv_cache_planning import layer_specs_from_config, plan_kv_cache
from pagedkv.kv_cache_spec import (ChunkedLocalAttentionSpec, MambaSpec, MLAAttentionSpec,
                                   SlidingWindowSpec)
from test_kv_cache_groups import vllm  # noqa: F401  (the fixture: vLLM's specs from the wheel)
from vllm_wheel import vllm_wheel

GiB = 2**30

# https://huggingface.co/google/gemma-3-1b-it/blob/main/config.json
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
             "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
             "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512, "sliding_window_pattern": 6,
             "max_position_embeddings": 32768, "vocab_size": 262144, "torch_dtype": "bfloat16"}
# https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json
GPT_OSS_20B = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
               "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
               "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
               "max_position_embeddings": 131072, "vocab_size": 201088, "num_local_experts": 32,
               "torch_dtype": "bfloat16"}
# https://huggingface.co/meta-llama/Llama-4-Scout-17B-16E-Instruct/blob/main/config.json (text_config)
LLAMA4_SCOUT = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
                "torch_dtype": "bfloat16",
                "text_config": {"model_type": "llama4_text", "hidden_size": 5120, "num_hidden_layers": 48,
                                "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
                                "attention_chunk_size": 8192, "no_rope_layers": [],
                                "max_position_embeddings": 10485760, "vocab_size": 202048,
                                "num_local_experts": 16}}
# https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json
QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
              "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
              "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
              "max_position_embeddings": 262144, "vocab_size": 151936, "num_experts": 512,
              "torch_dtype": "bfloat16"}
# https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
               "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
               "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
               "q_lora_rank": 1536, "max_position_embeddings": 163840, "vocab_size": 129280,
               "torch_dtype": "bfloat16"}
# https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json: every layer one window
MISTRAL_7B_V01 = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
                  "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
                  "sliding_window": 4096, "torch_dtype": "bfloat16"}

# (config, max_model_len, block_size, tensor_parallel_size, mamba_cache_mode)
CASES = {
    "gemma-3-1b": (GEMMA3_1B, 32_768, 16, 1, "none"),
    "gpt-oss-20b": (GPT_OSS_20B, 131_072, 16, 1, "none"),
    "gpt-oss-20b tp2": (GPT_OSS_20B, 8_192, 16, 2, "none"),
    "llama-4-scout tp8": (LLAMA4_SCOUT, 1_000_000, 16, 8, "none"),
    "qwen3-next": (QWEN3_NEXT, 262_144, 16, 1, "none"),
    "qwen3-next tp4 align": (QWEN3_NEXT, 32_768, 16, 4, "align"),
    "deepseek-v3 (block 64)": (DEEPSEEK_V3, 163_840, 64, 8, "none"),
    "mistral-7b-v0.1": (MISTRAL_7B_V01, 32_768, 16, 1, "none"),
}


@pytest.fixture
def planning(vllm, monkeypatch):  # noqa: F811
    """vLLM 0.33.0's kv_cache_planning (and its layout module), from the wheel.

    Its imports that planning never exercises here are stubbed: the
    speculative config, HiSparse (off: no groups of its own), the config
    builder's base class, ``format_gib`` from ``mem_utils``.
    """
    import logging

    def stub(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    class Builder:
        def _get_pool_bytes_per_block(self, vllm_config, groups):
            return None

    class MultipleOf:
        def __init__(self, base):
            self.base = base

    monkeypatch.setattr(sys.modules["vllm.config"], "SpeculativeConfig", object, raising=False)
    stub("vllm.utils.mem_utils", format_gib=lambda b: f"{round(b / GiB, 2)}")
    stub("vllm.v1.core.kv_cache_config_builder", KVCacheConfigBuilder=Builder)
    stub("vllm.v1.attention.backend", MultipleOf=MultipleOf)
    stub("vllm.v1.hisparse.layout", get_hisparse_host_pool_bytes=None, get_hisparse_kv_cache_config=None,
         get_hisparse_kv_cache_groups=lambda config, spec: None)
    sys.modules["vllm.logger"].init_logger = logging.getLogger
    name = "vllm.v1.core.kv_cache_planning"
    with zipfile.ZipFile(vllm_wheel()) as z:
        m = types.ModuleType(name)
        m.__file__ = "vllm-0.33.0/vllm/v1/core/kv_cache_planning.py"
        monkeypatch.setitem(sys.modules, name, m)
        exec(compile(z.read("vllm/v1/core/kv_cache_planning.py"), m.__file__, "exec"), m.__dict__)
    vllm.kv_cache_planning = m
    return vllm


def their_spec(vllm, spec):  # noqa: F811
    """vLLM's spec with our spec's fields (torch dtypes: ``get_dtype_size`` reads ``itemsize``)."""
    import torch

    I = vllm.kv_cache_interface
    if isinstance(spec, MambaSpec):
        return I.MambaSpec(block_size=spec.block_size, shapes=spec.shapes,
                           dtypes=tuple(getattr(torch, d) for d in spec.dtypes),
                           page_size_padded=spec.page_size_padded, mamba_cache_mode=spec.mamba_cache_mode)
    common = dict(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                  dtype=getattr(torch, spec.dtype), page_size_padded=spec.page_size_padded)
    if isinstance(spec, MLAAttentionSpec):
        return I.MLAAttentionSpec(**common)
    if isinstance(spec, SlidingWindowSpec):
        return I.SlidingWindowSpec(sliding_window=spec.sliding_window, **common)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return I.ChunkedLocalAttentionSpec(attention_chunk_size=spec.attention_chunk_size, **common)
    return I.FullAttentionSpec(**common)


def vllm_config(vllm, max_model_len, in_flight, mamba_cache_mode="none", layout="BLHNC"):  # noqa: F811
    ns = types.SimpleNamespace
    return ns(model_config=ns(max_model_len=max_model_len, supports_kv_cache_grouping=False),
              scheduler_config=ns(disable_hybrid_kv_cache_manager=False),
              attention_config=ns(hisparse_config=None),
              parallel_config=ns(decode_context_parallel_size=1),
              cache_config=ns(mamba_cache_mode=mamba_cache_mode, num_gpu_blocks_override=None,
                              prefix_cache_retention_interval=None,
                              get_resolved_kv_cache_layout=lambda: vllm.kv_cache_layout.KVCacheLayout[layout]),
              max_in_flight_tokens=in_flight)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("pool_gib", [3.0, 41.7])
def test_groups_blocks_and_concurrency_are_vllm_0_33_0s(planning, case, pool_gib):
    config, max_len, block_size, tp, mode = CASES[case]
    pool = int(pool_gib * GiB) // tp
    ours = plan_kv_cache(config, pool, max_model_len=max_len, block_size=block_size,
                         tensor_parallel_size=tp, mamba_cache_mode=mode, check=False)
    P, U = planning.kv_cache_planning, planning.kv_cache_utils
    specs = {name: their_spec(planning, s) for name, s in ours.layer_specs.items()}
    for layout in ("BLHNC", "LBHNC"):  # block-outermost and layer-outermost give one answer here
        config_ = vllm_config(planning, max_len, ours.max_in_flight_tokens, mode, layout)
        groups = P.get_kv_cache_groups(config_, dict(specs))
        assert [g.layer_names for g in groups] == [g.layer_names for g in ours.groups]
        assert [g.kv_cache_spec.page_size_bytes for g in groups] == \
            [g.kv_cache_spec.page_size_bytes for g in ours.groups]
        assert [g.kv_cache_spec.block_size for g in groups] == [g.kv_cache_spec.block_size for g in ours.groups]
        kv_config = P.get_kv_cache_config_from_groups(config_, groups, pool)
        assert kv_config.num_blocks == ours.num_blocks
        assert P._pool_bytes_per_block(config_, groups) == ours.bytes_per_block
        assert U.get_max_concurrency_for_kv_cache_config(config_, kv_config) == ours.max_concurrency
        assert U.get_kv_cache_capacity(config_, kv_config) == (ours.kv_cache_tokens, ours.max_concurrency)
        builder = P.DefaultKVCacheConfigBuilder()
        needed = P._max_memory_usage_bytes_from_groups(builder, config_, groups)
        available = pool - ours.bytes_per_block  # the null block held back, as get_kv_cache_configs does
        try:
            P._check_enough_kv_cache_memory(
                available, lambda: needed, max_len,
                lambda am: P._estimate_max_model_len_from_groups(builder, config_, groups, am))
        except ValueError as theirs:
            with pytest.raises(ValueError) as mine:
                plan_kv_cache(config, pool, max_model_len=max_len, block_size=block_size,
                              tensor_parallel_size=tp, mamba_cache_mode=mode)
            assert str(mine.value) == str(theirs)
        else:
            plan_kv_cache(config, pool, max_model_len=max_len, block_size=block_size,
                          tensor_parallel_size=tp, mamba_cache_mode=mode)


def test_the_groups_each_model_gets():
    rows = {case: plan_kv_cache(c, 40 * GiB, max_model_len=n, block_size=b, tensor_parallel_size=tp,
                                mamba_cache_mode=mode, check=False)
            for case, (c, n, b, tp, mode) in CASES.items()}
    # Gemma 3 1B: 22 sliding + 4 full layers; groups of 4, so 6 sliding groups (2 padding slots).
    g = rows["gemma-3-1b"]
    assert [k for k, *_ in g.group_rows()] == ["sliding window 512"] * 6 + ["full attention"]
    assert g.padding_layers == 2 and g.bytes_per_block == 4 * 16 * 1 * 2 * 256 * 2
    # gpt-oss: 12 + 12, two groups; the window's blocks: cdiv(127 + 2 x 8,192, 16) + 1.
    o = rows["gpt-oss-20b"]
    assert [(k, n, bs, need) for k, n, bs, need in o.group_rows()] == [
        ("sliding window 128", 12, 16, -(-(127 + 16_384) // 16) + 1), ("full attention", 12, 16, 8_192)]
    # Llama 4 Scout: 36 chunked + 12 global layers -> 3 chunked groups and one full.
    s = rows["llama-4-scout tp8"]
    assert [k for k, *_ in s.group_rows()] == ["chunked local 8,192"] * 3 + ["full attention"]
    # Qwen3-Next: one 2 KiB-per-token attention page must hold a 1,097,728-byte state:
    # block size 16 x cdiv(1,097,728, 16 x 2,048) = 544 tokens.
    q = rows["qwen3-next"]
    assert q.groups[-1].kv_cache_spec.block_size == 544 and q.page_size_bytes == 544 * 2_048
    assert [k for k, *_ in q.group_rows()] == ["linear attention (state)"] * 3 + ["full attention"]
    assert q.blocks_per_request() == [1, 1, 1, 262_144 // 544 + 1]
    d = rows["deepseek-v3 (block 64)"]
    assert len(d.groups) == 1 and d.page_size_bytes == 64 * 576 * 2
    assert [k for k, *_ in rows["mistral-7b-v0.1"].group_rows()] == ["sliding window 4,096"]


def test_budget_plan_takes_a_hybrid_config_and_prints_vllms_lines():
    p = budget.plan(gpu="H100 SXM 80GB", model=GPT_OSS_20B, weight_gib=13.0, max_model_len=131_072,
                    request_len=4_000)
    assert p.kv_plan is not None and p.num_blocks == p.kv_plan.num_blocks
    line = budget.startup_log_lines(p)[1]
    assert line == p.kv_plan.log_line()
    assert f"{p.kv_plan.max_concurrency:.2f}x" in line
    # one request of 4,000 tokens: 250 full blocks; the window's group holds at most
    # min(127 + 16,384 in flight, 4,000) tokens, plus one block for the window's offset
    assert p.blocks_per_request == 250 + 251
    assert p.paged_ceiling == (p.num_blocks - 1) // (250 + 251)
    # a plain Llama is planned as before: no groups
    assert budget.plan().kv_plan is None
    # without async scheduling one batch is in flight, and the window needs fewer blocks
    one = budget.plan(gpu="H100 SXM 80GB", model=GPT_OSS_20B, weight_gib=13.0, max_model_len=131_072,
                      max_concurrent_batches=1)
    assert one.kv_plan.blocks_per_request()[0] == -(-(127 + 8_192) // 16) + 1
    assert one.logged_max_concurrency > p.logged_max_concurrency


def test_config_reading_per_family():
    m = budget.model_spec_from_config(DEEPSEEK_V3)
    assert (m.num_kv_heads, m.head_dim, m.layer_kinds[0]) == (1, 576, "mla")
    assert budget.kv_bytes_per_token(m, "auto") == 61 * 576 * 2  # one latent, no separate V
    q = budget.model_spec_from_config(QWEN3_NEXT)
    assert budget.kv_bytes_per_token(q, "auto") == 12 * 2 * 2 * 256 * 2  # 12 attention layers only
    assert budget.model_spec_from_config(LLAMA4_SCOUT).layer_kinds.count("full_attention") == 12
    with pytest.raises(ValueError, match="parameter count .* not known"):
        budget.plan(model=GPT_OSS_20B)  # MoE: weights must be given


@pytest.mark.parametrize("config,match", [
    (dict(GPT_OSS_20B, layer_types=["sliding_attention", "mamba"] * 12),
     r"layer model.layers.1: unknown layer type 'mamba'"),
    (dict(GPT_OSS_20B, sliding_window=None), r"layer model.layers.0: a sliding_attention layer needs"),
    ({"model_type": "nemotron_h", "num_hidden_layers": 4}, r"model_type 'nemotron_h' is not one"),
    (dict(QWEN3_NEXT, linear_num_key_heads=None) | {"linear_num_key_heads": None}, r"linear_num_key_heads"),
])
def test_configs_it_cannot_group_are_refused_by_name(config, match):
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        plan_kv_cache(config, 10 * GiB, max_model_len=4_096)


def test_a_window_longer_than_the_context_is_refused_naming_the_layer():
    with pytest.raises(ValueError, match=r"layer model.layers.0.self_attn: sliding_window=512 is larger "
                                         r"than max_model_len=256"):
        layer_specs_from_config(GEMMA3_1B, max_model_len=256)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn: attention_chunk_size=8192"):
        plan_kv_cache(LLAMA4_SCOUT, 10 * GiB, max_model_len=4_096)


def test_page_sizes_that_cannot_be_unified_are_refused_naming_the_layer():
    from pagedkv.kv_cache_spec import FullAttentionSpec, get_kv_cache_groups

    specs = {"model.layers.0.self_attn": MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576,
                                                          dtype="bfloat16"),
             "model.layers.1.self_attn": FullAttentionSpec(block_size=16, num_kv_heads=7, head_size=128,
                                                           dtype="bfloat16")}
    before = dict(specs)
    with pytest.raises(ValueError, match=r"layer model.layers.0.self_attn: its page of 18432 bytes does "
                                         r"not divide .* cannot be unified"):
        get_kv_cache_groups(specs)
    assert specs == before


def test_the_startup_check_by_groups_names_the_length_that_fits():
    # 22 MiB holds the window groups' blocks but not 32,768 tokens of the full group
    with pytest.raises(ValueError, match=r"max seq len \(32768\).*estimated maximum model length is"):
        plan_kv_cache(GEMMA3_1B, 200 * 2**20, max_model_len=32_768)
    with pytest.raises(ValueError, match="No available memory"):
        plan_kv_cache(GEMMA3_1B, 1_000, max_model_len=32_768)


def test_the_calculator_shows_the_groups_and_runs_the_check_by_groups():
    from pagedkv.views.calculator import groups_html, plan_html, startup_error

    p = budget.plan(model=GEMMA3_1B, weight_gib=1.9, max_model_len=32_768)
    page = plan_html(p, with_figure=False)
    assert "6: full attention" in page and "sliding window 512" in page
    assert budget.startup_log_lines(p)[1] in page and startup_error(p) is None
    assert groups_html(budget.plan()) == ""  # one group: the table of chapter 1, unchanged
    # a pool too small for one 32,768-token request in every group is refused with vLLM's words
    tight = budget.plan(gpu="1000 MiB", model=GEMMA3_1B, weight_gib=0.2, non_kv_gib=0.5,
                        gpu_memory_utilization=0.9, max_model_len=32_768)
    assert startup_error(tight).startswith("To serve at least one request with the model's max seq len (32768)")


def test_every_dtype_spelling_budget_takes_plans_a_hybrid_the_same():
    """'fp32' is budget's spelling of float32; the group planner takes it too."""
    kw = dict(gpu="H100 SXM 80GB", model=GPT_OSS_20B, weight_gib=13.0, max_model_len=131_072)
    assert budget.plan(dtype="fp32", **kw).num_blocks == budget.plan(dtype="float32", **kw).num_blocks
    assert budget.plan(dtype="fp32", **kw).num_blocks < budget.plan(dtype="bf16", **kw).num_blocks
