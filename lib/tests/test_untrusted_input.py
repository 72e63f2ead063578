"""What a model file from a hub can carry, refused or bounded: chat templates, tokenizer metadata, configs.

The fuzz harness (tools/fuzz) drives these paths with millions of inputs; here
each rule has one readable case, so a regression names the rule it broke.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest

from pagedkv.engine import SamplingParams
from pagedkv.model import ModelConfig, PRESETS, load_pretrained
from pagedkv.model.chat_template import MAX_SIZE, render_chat_template
from pagedkv.model.tokenizer import tokenizer_from_gguf_metadata

MESSAGES = [{"role": "user", "content": "HI"}]


def render(source, limit=0.2):
    return render_chat_template(source, "model.gguf", time_limit_s=limit, messages=MESSAGES)


@pytest.mark.parametrize("source,why", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran out of time"),
    ("{% macro f(n) %}{{ f(n) }}{{ f(n) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
    ("{{ 'a' * 10**9 }}", r"a repetition \(\*\) would build 1,000,000,000"),
    ("{{ [1, 2] * 10**8 }}", r"a repetition \(\*\)"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     r"a concatenation \(~\)"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     r"a concatenation \(\+\)"),
    ("{{ 'a'.ljust(10**9) }}", "got the integer 1000000000"),
    ("{{ 'x'|center(10**9) }}", "the filter center got the integer"),
    ("{{ '%999999999d' % 1 }}", "has the width 999999999"),
    ("{{ '{:999999999}'.format(1) }}", "has the width 999999999"),
    ("{{ 2 ** 1000000000 }}", r"a power \(\*\*\)"),
    # 1,000 characters a turn reach the size bound after about 1,050 turns,
    # long before the clock's: the outcome does not depend on the machine's speed.
    ("{% for i in range(99999) %}{{ 'x' * 1000 }}{% endfor %}", "the rendered prompt"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "failed: "),  # the sandbox
    ("{% for m in messages %}{{ m.content", "failed: TemplateSyntaxError"),
    ("{{ raise_exception('roles must alternate') }}", "failed: TemplateError: roles must alternate"),
    ("{{ 1 / 0 }}", "failed: ZeroDivisionError"),
])
def test_a_hostile_chat_template_is_stopped_with_a_value_error_naming_the_file(source, why):
    before = sys.gettrace()
    with pytest.raises(ValueError, match=f"the chat template of model.gguf .*{why}"):
        render(source)
    assert sys.gettrace() is before  # the deadline's tracer is gone, whatever was installed before stays


def test_ordinary_templates_still_render():
    source = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}{% endfor %}"
              "{{ '%5d' % 42 }}{{ 'ab' * 3 }}{{ 'x'|center(5) }}{{ 2 ** 10 }}")
    assert render(source) == "<user>HI   42ababab  x  1024"
    big = [{"role": "user", "content": "123456789012345 " * 1000}]  # long numbers in content are fine
    text = render_chat_template("{{ messages[0].content | trim | upper }}", "f", messages=big)
    assert len(text) == 16 * 1000 - 1
    assert MAX_SIZE >= 1 << 20  # a prompt longer than any context we serve still renders


def _metadata(**changes):
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["A", "B", "AB"],
          "tokenizer.ggml.merges": ["A B"], "tokenizer.ggml.token_type": [1, 1, 1]}
    md.update(changes)
    return {k: v for k, v in md.items() if v is not None}


@pytest.mark.parametrize("changes,why", [
    (dict(**{"tokenizer.ggml.tokens": None}), "tokenizer.ggml.tokens must be a non-empty array of strings"),
    (dict(**{"tokenizer.ggml.tokens": [1, 2]}), "tokenizer.ggml.tokens must be a non-empty array of strings"),
    (dict(**{"tokenizer.ggml.merges": ["A C"]}), "tokenizer.ggml.merges holds 'A C'"),
    (dict(**{"tokenizer.ggml.merges": [7]}), "tokenizer.ggml.merges holds 7"),
    (dict(**{"tokenizer.ggml.pre": ["gpt2"]}), r"tokenizer.ggml.pre \['gpt2'\] is not supported"),
    (dict(**{"tokenizer.ggml.eos_token_id": 3}), r"tokenizer.ggml.eos_token_id 3 is not a token id \(0..2\)"),
    (dict(**{"tokenizer.chat_template": [1]}), "tokenizer.chat_template must be a string"),
])
def test_tokenizer_metadata_is_checked_before_tokenizers_sees_it(changes, why):
    with pytest.raises(ValueError, match=f"model.gguf: {why}"):
        tokenizer_from_gguf_metadata(_metadata(**changes), "model.gguf")
    assert tokenizer_from_gguf_metadata(_metadata(), "model.gguf").encode("AB").ids == [2]


def test_model_config_checks_every_field_a_file_sets():
    tiny = PRESETS["tiny"]
    with pytest.raises(ValueError, match="ModelConfig.rms_norm_eps must be a finite number in"):
        replace(tiny, rms_norm_eps=-1.0)
    with pytest.raises(ValueError, match="ModelConfig.rope_theta"):
        replace(tiny, rope_theta=float("nan"))
    with pytest.raises(TypeError, match="ModelConfig.eos_token_id must be an int, got str"):
        replace(tiny, eos_token_id="2")
    with pytest.raises(TypeError, match=r"ModelConfig.eos_token_id\[1\] must be an int"):
        replace(tiny, eos_token_id=[2, None])
    llama3 = dict(PRESETS["llama-3-8b"].rope_scaling, high_freq_factor=1.0)  # equal to low: RoPE divides by 0
    with pytest.raises(ValueError, match="rope_scaling.high_freq_factor must be a finite number in \\(1, inf\\)"):
        replace(tiny, rope_scaling=llama3)


def test_load_pretrained_names_config_json_for_whatever_is_wrong_in_it(tmp_path):
    file = tmp_path / "config.json"
    for text, why in [("", "is not valid JSON: JSONDecodeError"), ("[1]", "must hold a JSON object, got list"),
                      (b"\xff", "is not valid JSON: UnicodeDecodeError"), ("[" * 100_000, "is not valid JSON"),
                      (json.dumps({"vocab_size": "64", "hidden_size": 8, "intermediate_size": 8,
                                   "num_hidden_layers": 1, "num_attention_heads": 0}), "vocab_size must be an int"),
                      (json.dumps({"vocab_size": 64, "hidden_size": 8, "intermediate_size": 8,
                                   "num_hidden_layers": 1, "num_attention_heads": 0}),
                       "num_attention_heads must be >= 1"),
                      (json.dumps({"architectures": "LlamaForCausalLM"}), "architectures must be a list")]:
        file.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ValueError, match=f"config.json.*{why}"):
            load_pretrained(tmp_path)


def test_sampling_params_refuse_a_stop_that_is_not_a_list():
    with pytest.raises(TypeError, match="SamplingParams.stop must be a str or a list of non-empty str"):
        SamplingParams(stop=5)
    with pytest.raises(TypeError, match="SamplingParams.stop_token_ids must be a list of int or None, got int 3"):
        SamplingParams(stop_token_ids=3)
    assert SamplingParams(stop=("x",), stop_token_ids=(2,)).stop_token_ids == [2]


def test_model_config_default_still_builds():
    assert ModelConfig.preset("tiny").num_parameters > 0
