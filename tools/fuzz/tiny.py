"""The tiny model, vocabulary and chat templates the seeds and the targets share.

The vocabulary is the one ``lib/tests/test_model_gguf.py`` writes: 60 printable
ASCII characters (their own byte-level spelling), two merges, two special tokens.
"""

from __future__ import annotations

from pagedkv.model import ModelConfig

TOKENS = [chr(c) for c in range(ord("A"), ord("A") + 60)] + ["AB", "ABC", "<|im_start|>", "<|im_end|>"]
TOKEN_TYPES = [1] * 62 + [3, 3]  # 3: control (special)
MERGES = ["A B", "AB C"]
EOS = 63

# The test's template, a ChatML one with a default system prompt (SmolLM2's shape)
# and a Llama-3-like one that checks roles with raise_exception.
TEMPLATES = {
    "plain": ("{% for m in messages %}<|im_start|>{{ m['role'] }}:{{ m['content'] }}<|im_end|>{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}"),
    "chatml": ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
               "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
               "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "roles": ("{{ bos_token }}{% for message in messages %}"
              "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
              "{% endif %}{% set content = message['content'] | trim %}"
              "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + content + eos_token }}"
              "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"),
}

# Every inner dimension 16 (32 for the quantized seed: Q8_0 blocks are 32 wide).
CONFIG = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-5,
                     rope_theta=10000.0, max_position_embeddings=64, eos_token_id=EOS)


def tokenizer_metadata(template: str | None = TEMPLATES["plain"], pre: str = "smollm") -> dict:
    """The GGUF metadata of the tiny tokenizer (as ``read_gguf`` returns it)."""
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": list(TOKENS),
          "tokenizer.ggml.token_type": list(TOKEN_TYPES), "tokenizer.ggml.merges": list(MERGES),
          "tokenizer.ggml.bos_token_id": 62, "tokenizer.ggml.eos_token_id": EOS}
    if template is not None:
        md["tokenizer.chat_template"] = template
    return md
