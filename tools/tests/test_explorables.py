"""The explorables' JavaScript and the library agree exactly, on generated inputs.

node runs each module (the very script the page inlines, ``module_script``)
in one long-lived process per module; hypothesis generates the inputs; the
library (``explorables.KINDS[kind].figures``) computes the expected figures.
Without node these tests skip, except under CI=true, where node must be there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv import budget
from pagedkv.views import explorables

NODE = shutil.which("node") or shutil.which("nodejs")
if NODE is None:
    if os.environ.get("CI") == "true":
        raise RuntimeError("the explorables' agreement tests need node (apt-get install nodejs), "
                           "and CI must run them")
    pytest.skip("node is not installed (apt-get install nodejs): the explorables' JavaScript "
                "is not compared with the library here", allow_module_level=True)

# Reads one JSON call a line ({"fn": "compute", "args": [...]} on pkvExplore.kinds[kind],
# or {"fn": "fixed", ...} on pkvExplore itself) and answers {"ok": value} or {"error": text}.
RUNNER = r"""
const readline = require('readline');
const kind = pkvExplore.kinds[process.argv[1]];
readline.createInterface({input: process.stdin}).on('line', line => {
  const call = JSON.parse(line);
  let answer;
  try {
    const target = call.fn in kind ? kind : pkvExplore;
    answer = {ok: target[call.fn](...call.args)};
  } catch (e) {
    answer = {error: String(e && e.stack || e)};
  }
  process.stdout.write(JSON.stringify(answer) + '\n');
});
"""


class Node:
    def __init__(self, kind: str) -> None:
        script = explorables.module_script(kind) + RUNNER
        self.proc = subprocess.Popen([NODE, "-e", script, kind], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)

    def __call__(self, fn: str, *args):
        self.proc.stdin.write(json.dumps({"fn": fn, "args": args}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        if "error" in answer:
            raise AssertionError(f"node: {fn}{args!r} threw {answer['error']}")
        return answer["ok"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def budget_js():
    node = Node("budget")
    yield node
    node.close()


EXAMPLES = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------- Python's formatting

finite = st.floats(min_value=-1e15, max_value=1e15, allow_nan=False)
ties = st.integers(-10**6, 10**6).map(lambda k: k / 8)  # x.125, x.375...: where toFixed rounds up


@EXAMPLES
@given(x=st.one_of(finite, ties), digits=st.integers(0, 4))
def test_fixed_is_pythons_format_half_to_even(budget_js, x, digits):
    assert budget_js("fixed", x, digits, False) == f"{x:.{digits}f}"
    assert budget_js("fixed", x, digits, ",") == f"{x:,.{digits}f}"


@EXAMPLES
@given(x=st.one_of(st.floats(min_value=0, max_value=1e6, allow_nan=False), ties))
def test_round2_and_repr_are_pythons(budget_js, x):
    assert budget_js("round2", x) == f"{round(x, 2)}"
    assert budget_js("repr", x) == repr(x)


@EXAMPLES
@given(a=st.one_of(st.floats(min_value=-1e18, max_value=1e18, allow_nan=False), st.integers(-2**52, 2**52)),
       b=st.one_of(st.floats(min_value=1e-3, max_value=1e9), st.integers(1, 2**40)))
def test_floor_div_is_pythons(budget_js, a, b):
    expected = float(a) // float(b)
    got = budget_js("floorDiv", a, b)
    assert float(got) == expected, (a, b)  # JSON writes a large double as an integer


# ---------------------------------------------------------------- chapter 1: the budget

# Spread over the verdicts: about 40 % pass, 30 % are refused by a check (the model's
# context, or one max_model_len request that does not fit), 30 % leave no pool.
_budget_settings = st.fixed_dictionaries({
    "gpu": st.sampled_from(list(budget.GPUS)),
    "gpu_mib": st.one_of(st.just(0), st.just(0), st.integers(1, 1_000_000), st.integers(8_000, 200_000)),
    "model": st.sampled_from([*budget.MODELS, "custom"]),
    "custom_layers": st.integers(1, 1_000),
    "custom_kv_heads": st.one_of(st.sampled_from([1, 2, 4, 8, 16, 32]), st.integers(1, 1_000)),
    "custom_head_dim": st.one_of(st.sampled_from([64, 128, 256]), st.integers(1, 4_096)),
    "custom_params_b": st.one_of(st.integers(0, 20_000).map(lambda k: k / 10),
                                 st.floats(min_value=0, max_value=2_000)),
    "custom_sliding_layers": st.one_of(st.just(0), st.just(0), st.integers(0, 64), st.integers(0, 1_000)),
    "custom_window": st.one_of(st.sampled_from([128, 512, 1_024, 4_096]), st.integers(1, 131_072)),
    "custom_chunked_layers": st.one_of(st.just(0), st.just(0), st.integers(0, 64), st.integers(0, 1_000)),
    "custom_chunk": st.one_of(st.sampled_from([1_024, 8_192]), st.integers(1, 131_072)),
    "max_num_batched_tokens": st.sampled_from([2_048, 8_192, 16_384]),
    "max_concurrent_batches": st.sampled_from([1, 2]),
    "dtype": st.sampled_from(["bf16", "fp16", "fp8", "fp32"]),
    "tensor_parallel_size": st.sampled_from([1, 2, 4, 8, 1, 2, 4, 8, 3, 16]),
    "gpu_memory_utilization": st.one_of(st.integers(50, 100).map(lambda k: k / 100),
                                        st.floats(min_value=0.05, max_value=1.0)),
    "non_kv_gib": st.one_of(st.integers(0, 24).map(lambda k: k / 2), st.floats(min_value=0, max_value=20)),
    "block_size": st.one_of(st.sampled_from([1, 8, 16, 32, 64, 128]), st.integers(1, 256)),
    "request_len": st.integers(1, 2**17),
    "weight_gib": st.one_of(st.none(), st.none(), st.just(14.96), st.floats(min_value=0, max_value=100)),
})


@st.composite
def budget_inputs(draw):
    """A setting; max_model_len mostly within the model's context, so the memory check gets to speak."""
    inputs = draw(_budget_settings)
    context = budget.model_spec(explorables.budget_specs(inputs)[1]).native_context
    inputs["max_model_len"] = draw(st.one_of(st.sampled_from(explorables.BUDGET_MAX_MODEL_LENS),
                                             st.integers(1, 2**18), st.integers(context // 8, context),
                                             st.integers(context // 8, context)))
    if draw(st.integers(0, 2)) == 0:  # weights that leave a small pool (under 24 GiB per GPU)
        per_gpu = (budget.gpu_spec(explorables.budget_specs(inputs)[0]).total_bytes
                   * inputs["gpu_memory_utilization"] / budget.GiB
                   - inputs["non_kv_gib"] - draw(st.floats(min_value=0.001, max_value=24)))
        inputs["weight_gib"] = max(0.0, per_gpu * inputs["tensor_parallel_size"])
    return inputs


BUDGET_CONFIG = explorables.budget_config()


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inputs=budget_inputs())
def test_budget_module_gives_the_librarys_figures(budget_js, inputs):
    expected = explorables.budget_figures(inputs)
    assert budget_js("compute", inputs, BUDGET_CONFIG) == expected
    # ... and draws them as the page without script shows them
    assert budget_js("render", expected, BUDGET_CONFIG) == explorables.render_budget(expected, BUDGET_CONFIG)


def test_budget_module_reproduces_the_books_reference_and_refusals(budget_js):
    """Named cases, so a reader sees what the generated ones cover: chapter 1's pool, the
    max_model_len refusal, the startup check's message with the null block held back."""
    config = explorables.budget_config(weights={"Llama-3.1-8B": 14.96})
    ref = {"gpu": "H100 SXM 80GB", "model": "Llama-3.1-8B", "dtype": "bf16", "tensor_parallel_size": 1,
           "gpu_memory_utilization": 0.92, "max_model_len": 32_768, "block_size": 16}
    figures = budget_js("compute", explorables.budget_inputs(ref, config), config)
    assert figures["verdict"] == "ok"
    assert ["blocks of 16", "26,785"] in figures["rows"]
    assert figures["log"] == ["Available KV cache memory: 52.32 GiB",
                              "GPU KV cache size: 428,560 tokens, Maximum concurrency for 32,768 "
                              "tokens per request: 13.08x"]
    too_long = budget_js("compute", explorables.budget_inputs({**ref, "model": "Llama-3-8B"}, config), config)
    assert too_long["verdict"] == "refused" and too_long["message"].startswith(
        "User-specified max_model_len (32768) is greater than the derived max_model_len "
        "(max_position_embeddings=8192")
    # An RTX 4090 at 0.92: 22.07 GiB - 14.96 GiB of weights - 6 GiB = 1.11 GiB of pool.
    tight = {**ref, "gpu": "RTX 4090", "max_model_len": 131_072}
    f = budget_js("compute", explorables.budget_inputs(tight, config), config)
    assert f == explorables.budget_figures(explorables.budget_inputs(tight, config))
    assert f["verdict"] == "refused" and f["message"].startswith(
        "To serve at least one request with the model's max seq len (131072)")
    # A pool smaller than one block: nothing is left once the null block is held back.
    crumbs = {**ref, "gpu_memory_utilization": 1.0}
    config = explorables.budget_config(non_kv_gib=0.0, weights={"Llama-3.1-8B": 81_559 / 1024 - 0.001})
    f = budget_js("compute", explorables.budget_inputs(crumbs, config), config)
    assert f == explorables.budget_figures(explorables.budget_inputs(crumbs, config))
    assert f["verdict"] == "refused" and f["message"] == budget.NO_MEMORY_MESSAGE


def test_budget_module_sizes_a_servers_own_figures_as_the_library_does(budget_js):
    """Typed figures: the non-KV GiB a server logged, a GPU's memory in MiB, a custom model's
    shape (a Llama-3.1-8B typed in by hand sizes as the preset does)."""
    config = explorables.budget_config()
    ref = {"gpu": "H100 SXM 80GB", "model": "Llama-3.1-8B", "dtype": "bf16", "tensor_parallel_size": 1,
           "gpu_memory_utilization": 0.92, "max_model_len": 32_768, "block_size": 16}
    by_hand = {"model": "custom", "custom_layers": 32, "custom_kv_heads": 8, "custom_head_dim": 128,
               "custom_params_b": 8.030261248}
    cases = [{"non_kv_gib": 4.3}, {"gpu_mib": 46_068}, {"gpu_mib": 143_771, "gpu": "L4"},
             {**by_hand, "non_kv_gib": 0.0}, {**by_hand, "tensor_parallel_size": 3},
             {**by_hand, "custom_params_b": 70.6, "custom_layers": 80, "gpu_mib": 40_000}]
    for case in cases:
        inputs = explorables.budget_inputs({**ref, **case}, config)
        assert budget_js("inputs", {**ref, **case}, config) == inputs
        assert budget_js("compute", inputs, config) == explorables.budget_figures(inputs), case
    f = lambda **v: explorables.budget_figures(explorables.budget_inputs({**ref, **v}, config))  # noqa: E731
    assert ["non-KV allowance", "4.30 GiB"] in f(non_kv_gib=4.3)["rows"]
    assert ["GPU memory", "140.40 GiB"] in f(gpu_mib=143_771, gpu="L4")["rows"]
    assert f(gpu_mib=143_771, gpu="L4")["rows"] == f(gpu="H200")["rows"]
    assert f(**by_hand)["rows"] == f()["rows"]
    assert f(**by_hand, tensor_parallel_size=3)["message"] == (
        "8 KV heads of the custom model do not split evenly across tensor_parallel_size=3")
    big = f(**{**by_hand, "custom_params_b": 70.6, "custom_layers": 80, "gpu_mib": 40_000})
    assert big["verdict"] == "invalid" and big["message"].startswith("no memory left for the KV cache: 39.06 GiB")


def test_budget_module_refuses_a_bad_typed_figure_in_the_librarys_words(budget_js):
    """Negative, too large, fractional where whole, or no number at all (an empty field reads as
    NaN in the page, null once through JSON): the same refusal in both."""
    config = explorables.budget_config()
    ref = {"gpu": "H100 SXM 80GB", "model": "custom", "dtype": "bf16", "tensor_parallel_size": 1,
           "gpu_memory_utilization": 0.92, "max_model_len": 32_768, "block_size": 16}
    cases = [({"non_kv_gib": -1}, "non-KV GiB must be a number from 0 to 40"),
             ({"non_kv_gib": None}, "non-KV GiB must be a number from 0 to 40"),
             ({"non_kv_gib": "6"}, "non-KV GiB must be a number from 0 to 40"),
             ({"non_kv_gib": 40.5}, "non-KV GiB must be a number from 0 to 40"),
             ({"gpu_mib": -5}, "GPU MiB (0: preset) must be a whole number from 0 to 1,000,000"),
             ({"gpu_mib": 80.5}, "GPU MiB (0: preset) must be a whole number from 0 to 1,000,000"),
             ({"custom_layers": 0}, "custom layers must be a whole number from 1 to 1,000"),
             ({"custom_kv_heads": None}, "custom KV heads must be a whole number from 1 to 1,000"),
             ({"custom_head_dim": 12.5}, "custom head_dim must be a whole number from 1 to 4,096"),
             ({"custom_params_b": -0.1}, "custom params (B) must be a number from 0 to 2,000"),
             ({"custom_sliding_layers": 2.5}, "custom sliding layers must be a whole number from 0 to 1,000"),
             ({"custom_window": 0}, "custom sliding window must be a whole number from 1 to 131,072"),
             ({"custom_sliding_layers": 33}, "custom sliding layers (33) must be at most custom layers (32)"),
             ({"custom_chunked_layers": -1}, "custom chunked layers must be a whole number from 0 to 1,000"),
             ({"custom_chunk": 131_073}, "custom chunk size must be a whole number from 1 to 131,072"),
             ({"custom_chunked_layers": 33}, "custom chunked layers (33) must be at most custom layers (32)"),
             ({"custom_sliding_layers": 4, "custom_chunked_layers": 1_000},
              "custom chunked layers (1,000) must be at most custom layers (32)"),
             ({"custom_sliding_layers": 16, "custom_chunked_layers": 8},
              "custom sliding layers (16) and custom chunked layers (8) cannot both be set: the custom "
              "model has one kind of local attention beside its full-attention layers")]
    for case, message in cases:
        inputs = explorables.budget_inputs({**ref, **case}, config)
        expected = explorables.budget_figures(inputs)
        assert expected == {"verdict": "invalid", "message": message, "rows": [], "log": [], "parts": [],
                            "groups": []}
        assert budget_js("compute", inputs, config) == expected, case
        assert budget_js("render", expected, config) == explorables.render_budget(expected, config)
    # a preset model ignores the custom fields, whatever they hold
    preset = explorables.budget_inputs({**ref, "model": "Llama-3.1-8B", "custom_layers": -3}, config)
    assert budget_js("compute", preset, config) == explorables.budget_figures(preset)
    assert explorables.budget_figures(preset)["verdict"] == "ok"


# ------------------------------------------ chapter 1's budget: sliding-window and chunked hybrids

@st.composite
def hybrid_inputs(draw, kind="sliding"):
    """A custom model with sliding-window (``kind`` "sliding") or chunked local ("chunked") layers,
    mostly of shapes that leave a pool and pass the heads check, so the group plan gets to speak;
    windows and chunks on and off a block boundary (window - 1, or chunk, + in flight = k x B)."""
    layers = draw(st.integers(1, 100))
    block_size = draw(st.one_of(st.sampled_from([1, 8, 16, 32, 64, 128]), st.integers(1, 256)))
    max_model_len = draw(st.one_of(st.sampled_from(explorables.BUDGET_MAX_MODEL_LENS), st.integers(1, 2**17)))
    batched, batches = draw(st.sampled_from([2_048, 8_192, 16_384])), draw(st.sampled_from([1, 2]))
    on_boundary = block_size * draw(st.integers(1, 64)) - batched * batches
    boundary = max(1, on_boundary + (kind == "sliding"))
    span = draw(st.one_of(st.sampled_from([128, 512, 1_024, 4_096, 8_192, boundary]),
                          st.integers(1, max_model_len), st.integers(1, 131_072)))
    local = draw(st.integers(1, layers))
    return {"gpu": draw(st.sampled_from(list(budget.GPUS))), "gpu_mib": 0, "model": "custom",
            "custom_layers": layers, "custom_sliding_layers": local if kind == "sliding" else 0,
            "custom_window": span if kind == "sliding" else 128,
            "custom_chunked_layers": local if kind == "chunked" else 0,
            "custom_chunk": span if kind == "chunked" else 8_192,
            "custom_kv_heads": draw(st.sampled_from([1, 2, 4, 8, 16])),
            "custom_head_dim": draw(st.sampled_from([64, 128, 256])),
            "custom_params_b": draw(st.integers(0, 400).map(lambda k: k / 10)),
            "dtype": draw(st.sampled_from(["bf16", "fp16", "fp8", "fp32"])),
            "tensor_parallel_size": draw(st.sampled_from([1, 2, 4, 8])),
            "gpu_memory_utilization": draw(st.integers(50, 100).map(lambda k: k / 100)),
            "non_kv_gib": draw(st.integers(0, 24).map(lambda k: k / 2)), "block_size": block_size,
            "request_len": draw(st.integers(1, 2**17)), "weight_gib": None, "max_model_len": max_model_len,
            "max_num_batched_tokens": batched, "max_concurrent_batches": batches}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inputs=hybrid_inputs())
def test_a_custom_hybrid_gets_the_librarys_groups_blocks_and_concurrency(budget_js, inputs):
    expected = explorables.budget_figures(inputs)
    assert budget_js("compute", inputs, BUDGET_CONFIG) == expected
    assert budget_js("render", expected, BUDGET_CONFIG) == explorables.render_budget(expected, BUDGET_CONFIG)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inputs=hybrid_inputs("chunked"))
def test_a_custom_chunked_model_gets_the_librarys_groups_blocks_and_concurrency(budget_js, inputs):
    expected = explorables.budget_figures(inputs)
    assert budget_js("compute", inputs, BUDGET_CONFIG) == expected
    assert budget_js("render", expected, BUDGET_CONFIG) == explorables.render_budget(expected, BUDGET_CONFIG)


# Shapes from the models' config.json files (the KV-cache shape only; the weights are typed).
# https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json
GPT_OSS_20B = {"model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
               "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
               "layer_types": ["sliding_attention", "full_attention"] * 12,
               "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
# https://huggingface.co/google/gemma-3-1b-it/blob/main/config.json
# https://huggingface.co/meta-llama/Llama-4-Scout-17B-16E-Instruct/blob/main/config.json (text_config):
# every fourth layer global (no_rope_layers empty), the others chunked local in chunks of 8,192
LLAMA4_SCOUT = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
                "torch_dtype": "bfloat16",
                "text_config": {"model_type": "llama4_text", "hidden_size": 5120, "num_hidden_layers": 48,
                                "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
                                "attention_chunk_size": 8192, "no_rope_layers": [],
                                "max_position_embeddings": 10485760, "vocab_size": 202048,
                                "num_local_experts": 16}}


def _llama4(**text):
    return dict(LLAMA4_SCOUT, text_config={**LLAMA4_SCOUT["text_config"], **text})


GEMMA3_1B = {"model_type": "gemma3_text", "hidden_size": 1152, "num_hidden_layers": 26, "num_attention_heads": 4,
             "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512, "sliding_window_pattern": 6,
             "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("config, gpu, tp, max_model_len, block_size, dtype, weight_gib, batched, batches", [
    (GPT_OSS_20B, "H100 SXM 80GB", 1, 131_072, 16, "bf16", 13.0, 8_192, 2),
    (GPT_OSS_20B, "L4", 1, 131_072, 16, "bf16", 13.0, 2_048, 2),      # refused: the check by groups
    (GPT_OSS_20B, "H200", 2, 65_536, 32, "fp8", 13.0, 8_192, 1),
    (GPT_OSS_20B, "H100 SXM 80GB", 1, 1_000, 16, "bf16", 13.0, 8_192, 2),  # window + in flight > length
    (dict(GPT_OSS_20B, sliding_window=129), "H100 SXM 80GB", 1, 131_072, 16, "bf16", 13.0, 8_192, 2),
    # 129 - 1 + 16,384 tokens fill 1,032 blocks exactly: the window's extra block still counts
    (GEMMA3_1B, "L4", 1, 32_768, 16, "bf16", 2.0, 2_048, 2),
    (GEMMA3_1B, "RTX 4090", 1, 32_768, 64, "fp32", 2.0, 8_192, 1),
    (dict(GPT_OSS_20B, layer_types=["sliding_attention"] * 24), "A100 SXM 40GB", 1, 131_072, 16, "bf16",
     13.0, 8_192, 2),                                                   # every layer windowed: one group
    # Llama 4 Scout (weights as typed: 109B parameters in bf16, about 203 GiB): 36 chunked layers in
    # three groups of 12, 12 full in one
    (LLAMA4_SCOUT, "H100 SXM 80GB", 8, 131_072, 16, "bf16", 203.0, 8_192, 2),
    (LLAMA4_SCOUT, "H200", 4, 16_384, 16, "bf16", 203.0, 8_192, 2),   # chunk + in flight > length
    (LLAMA4_SCOUT, "A100 SXM 40GB", 8, 131_072, 16, "fp32", 230.0, 8_192, 2),  # refused: by groups
    (_llama4(attention_chunk_size=8193), "L40S", 8, 65_536, 16, "fp8", 203.0, 2_048, 1),  # 1 past a block
    (LLAMA4_SCOUT, "H200", 8, 65_536, 64, "bf16", 203.0, 2_048, 1),   # 8,192 + 2,048 = 160 blocks of 64
    (_llama4(no_rope_layers=[1] * 48), "H100 SXM 80GB", 8, 131_072, 16, "bf16", 203.0, 8_192, 2),
    # every layer chunked: one group
])
def test_the_calculator_plans_real_hybrids_as_kv_cache_planning_does(budget_js, config, gpu, tp, max_model_len,
                                                                     block_size, dtype, weight_gib, batched,
                                                                     batches):
    """A real config's layer counts typed into the custom model give kv_cache_planning's plan of the
    config itself: its groups, blocks, "Maximum concurrency" line and startup verdict."""
    from pagedkv.kv_cache_planning import check_enough_memory, plan_kv_cache
    m = budget.model_spec_from_config(config)
    values = {"gpu": gpu, "model": "custom", "dtype": dtype, "tensor_parallel_size": tp,
              "gpu_memory_utilization": 0.9, "max_model_len": max_model_len, "block_size": block_size,
              "custom_layers": m.num_layers, "custom_kv_heads": m.num_kv_heads, "custom_head_dim": m.head_dim,
              "custom_sliding_layers": m.layer_kinds.count("sliding_attention"),
              "custom_window": m.config.get("sliding_window", 128),
              "custom_chunked_layers": m.layer_kinds.count("chunked_attention"),
              "custom_chunk": m.config.get("attention_chunk_size", 8_192), "max_num_batched_tokens": batched,
              "max_concurrent_batches": batches}
    config_js = explorables.budget_config(weights={"custom": weight_gib})
    inputs = explorables.budget_inputs(values, config_js)
    figures = budget_js("compute", inputs, config_js)
    assert figures == explorables.budget_figures(inputs)

    pool = budget.kv_pool_bytes(budget.gpu_spec(gpu).total_bytes, 0.9, weight_gib * budget.GiB / tp,
                                6.0 * budget.GiB)
    plan = plan_kv_cache(config, pool, max_model_len=max_model_len, block_size=block_size,
                         kv_cache_dtype={"fp32": "float32"}.get(dtype, dtype), tensor_parallel_size=tp,
                         max_num_batched_tokens=batched, max_concurrent_batches=batches, check=False)
    assert figures["groups"] == [list(r) for r in plan.group_rows()]
    assert [f"blocks of {block_size}", f"{plan.num_blocks:,}"] in figures["rows"]
    assert figures["log"][1] == plan.log_line()
    try:
        check_enough_memory(plan)
        assert figures["verdict"] == "ok"
    except ValueError as exc:
        assert figures["verdict"] == "refused" and figures["message"] == str(exc)
    assert len(plan.groups) > 1 or "full_attention" not in m.layer_kinds


def test_the_calculator_refuses_a_window_longer_than_the_context_naming_the_layer(budget_js):
    config = explorables.budget_config()
    inputs = explorables.budget_inputs({"gpu": "H100 SXM 80GB", "model": "custom", "dtype": "bf16",
                                        "tensor_parallel_size": 1, "gpu_memory_utilization": 0.9,
                                        "max_model_len": 4_096, "block_size": 16, "custom_sliding_layers": 20,
                                        "custom_window": 8_192}, config)
    figures = budget_js("compute", inputs, config)
    assert figures == explorables.budget_figures(inputs)
    assert figures["verdict"] == "invalid" and figures["message"] == (
        "layer model.layers.0.self_attn: sliding_window=8192 is larger than max_model_len=4096, "
        "so the window never slides")


def test_the_calculator_refuses_a_chunk_longer_than_the_context_naming_the_layer(budget_js):
    config = explorables.budget_config()
    inputs = explorables.budget_inputs({"gpu": "H100 SXM 80GB", "model": "custom", "dtype": "bf16",
                                        "tensor_parallel_size": 1, "gpu_memory_utilization": 0.9,
                                        "max_model_len": 4_096, "block_size": 16, "custom_chunked_layers": 24,
                                        "custom_chunk": 8_192}, config)
    figures = budget_js("compute", inputs, config)
    assert figures == explorables.budget_figures(inputs)
    assert figures["verdict"] == "invalid" and figures["message"] == (
        "layer model.layers.0.self_attn: attention_chunk_size=8192 is larger than max_model_len=4096, "
        "so no chunk ever ends")
    # the library's planner says the same of Llama 4 Scout's own config
    from pagedkv.kv_cache_planning import plan_kv_cache
    with pytest.raises(ValueError) as exc:
        plan_kv_cache(LLAMA4_SCOUT, 10 * budget.GiB, max_model_len=4_096)
    assert str(exc.value) == figures["message"]


def test_the_static_output_is_the_default_settings_figures_and_the_controls_wait_for_the_script():
    ex = explorables.budget_explorer(weight_gib=14.96)
    page = ex.html()
    figures = ex.figures()
    assert figures["verdict"] == "ok" and ["blocks of 16", "26,785"] in figures["rows"]
    assert explorables.render_budget(figures, ex.config) in page
    assert "class='pkv-controls' hidden" in page and "pkvExplore.mount('pkv-budget-" in page
    assert "http" not in page.replace("https://docs.vllm.ai", "")  # nothing to fetch


# ---------------------------------------------------------------- chapter 2: tail waste


@pytest.fixture(scope="module")
def tail_js():
    node = Node("tail")
    yield node
    node.close()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(length=st.integers(1, 2**17), block_size=st.one_of(st.sampled_from([1, 16, 64, 65, 128, 256]),
                                                             st.integers(1, 512)),
       model=st.sampled_from(list(budget.MODELS)), dtype=st.sampled_from(["bf16", "fp8", "fp32"]))
def test_tail_module_gives_the_librarys_figures(tail_js, length, block_size, model, dtype):
    config = explorables.tail_config(model, dtype)
    inputs = explorables.tail_inputs({"length": length, "block_size": block_size}, config)
    expected = explorables.tail_figures(inputs)
    assert tail_js("compute", inputs, config) == expected
    assert tail_js("render", expected, config) == explorables.render_tail(expected, config)


def test_tail_module_reproduces_chapter_2s_lengths(tail_js):
    """1, 15, 16, 17 tokens at block size 16 leave 15, 1, 0, 15 slots; 15 of them are 1.875 MiB."""
    config = explorables.tail_config()
    tails = [tail_js("compute", {"length": n, "block_size": 16, **config["fixed"]}, config)["tail"]
             for n in (1, 15, 16, 17)]
    assert tails == [15, 1, 0, 15]
    worst = tail_js("compute", {"length": 17, "block_size": 16, **config["fixed"]}, config)["rows"][5]
    assert worst == ["worst case, B - 1 slots", "1.88 MiB"]


# ---------------------------------------------------------------- chapters 3 and 6: prefix-cache hits


@pytest.fixture(scope="module")
def prefix_js():
    node = Node("prefix")
    yield node
    node.close()


# Shared prompts ending on, just before and just after a block boundary, and long ones.
_shared = st.one_of(st.integers(1, 300), st.integers(1, 40).map(lambda k: 16 * k + 1),
                    st.integers(1, 40).map(lambda k: 16 * k), st.integers(1, 5000))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared=_shared, own=st.one_of(st.just(0), st.integers(0, 3), st.integers(0, 64)),
       block_size=st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]),
       match_unit=st.one_of(st.none(), st.sampled_from([1, 2, 3, 4, 8, 16, 64])),
       a_own=st.integers(1, 20))
def test_prefix_module_gives_the_librarys_figures(prefix_js, shared, own, block_size, match_unit, a_own):
    config = explorables.prefix_config(a_own, match_unit)
    inputs = explorables.prefix_inputs({"shared": shared, "own": own, "block_size": block_size}, config)
    expected = explorables.prefix_figures(inputs)
    assert prefix_js("compute", inputs, config) == expected
    assert prefix_js("render", expected, config) == explorables.render_prefix(expected, config)


def test_prefix_module_keeps_vllms_two_rules(prefix_js):
    """Chapter 3's 14 shared tokens in blocks of 4 hit 3 blocks; a prompt that is exactly
    the shared 16 tokens hits 3, not 4 (its last token is computed); chapter 6's
    4,100-token document with a match unit of 4 hits 256 blocks and 4 slots of a copy."""
    config = explorables.prefix_config()
    at = lambda **v: prefix_js("compute", explorables.prefix_inputs(v, config), config)  # noqa: E731
    assert at(shared=14, own=3, block_size=4)["states"] == ["hit"] * 3 + ["new"] * 2
    whole = at(shared=16, own=0, block_size=4)
    assert whole["states"] == ["hit"] * 3 + ["new"] and whole["why"].startswith("At most L - 1 = 15")
    doc = at(shared=4100, own=12, block_size=16, match_unit=4)
    assert doc["states"].count("hit") == 256 and doc["states"][256] == "copy"
    assert ["partial block hit", "4 of 16 slots, copied"] in doc["rows"]
    assert at(shared=10, own=2, block_size=16, match_unit=5)["verdict"] == "invalid"


# ---------------------------------------------------------------- chapter 5: the slot mapping


@pytest.fixture(scope="module")
def slots_js():
    node = Node("slots")
    yield node
    node.close()


SLOTS_CONFIG = explorables.slots_config()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.integers(1, 40), block_size=st.sampled_from(explorables.SLOT_BLOCK_SIZES),
       chunk=st.one_of(st.integers(1, 40), st.integers(1, 4)), step=st.integers(1, 16))
def test_slots_module_gives_the_librarys_figures(slots_js, prompt, block_size, chunk, step):
    inputs = explorables.slots_inputs({"prompt": prompt, "block_size": block_size, "chunk": chunk,
                                       "step": step}, SLOTS_CONFIG)
    expected = explorables.slots_figures(inputs)
    assert slots_js("compute", inputs, SLOTS_CONFIG) == expected
    assert slots_js("render", expected, SLOTS_CONFIG) == explorables.render_slots(expected, SLOTS_CONFIG)


def test_slots_module_follows_the_free_queue_across_steps(slots_js):
    """Blocks of 4, a 10-token prompt in chunks of 6: step 1 takes the queue's first two
    blocks, step 2 one more, step 3 (a decode) none; every slot is block * 4 + offset."""
    queue = SLOTS_CONFIG["queues"]["4"]
    steps = [slots_js("compute", {"prompt": 10, "block_size": 4, "chunk": 6, "step": k}, SLOTS_CONFIG)
             for k in (1, 2, 3)]
    assert [s["new"] for s in steps] == [queue[:2], queue[2:3], []]
    assert steps[2]["title"] == "step 3: decode, the token at position 10"
    assert all(t[4] == t[2] * 4 + t[3] and t[2] == s["row"][t[1]] for s in steps for t in s["tokens"])
