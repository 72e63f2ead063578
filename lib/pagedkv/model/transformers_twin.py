"""Our model's weights inside transformers' ``LlamaForCausalLM``: the reference to compare against.

A config with sliding-window layers gets ``Qwen2ForCausalLM`` instead, which
takes ``layer_types`` and ``sliding_window`` (transformers' Llama has no
window); ``ModelConfig`` allows such layers only in a Qwen2 config.

``transformers_twin(model)`` builds transformers' own implementation around
*our* parameter tensors (no copy). Whatever our engine computes, paged or
dense, its tokens must equal what that implementation computes from the same
weights: the check every chapter-8 comparison and the engine benchmark make.
(Loading a file is checked separately: the tests compare ``load_gguf`` with
transformers loading the same GGUF file itself.)
"""

from __future__ import annotations

import torch

from .decoder import Model

__all__ = ["transformers_twin"]


def transformers_twin(model: Model):
    """A transformers ``LlamaForCausalLM`` (``Qwen2ForCausalLM`` for a sliding-window config)
    whose parameters *are* ours (no copy), or None without transformers."""
    try:
        import transformers
    except ImportError:
        return None
    c = model.config
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling:
        rope = {**c.rope_scaling, "rope_theta": c.rope_theta}
    common = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=rope, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if any(w is not None for w in c.layer_windows):  # Qwen2 biases q/k/v, as ModelConfig requires here
        # use_sliding_window switches Qwen2's window on; layer_types says which layers have it.
        hf_config = transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=c.sliding_window,
                                             layer_types=list(c.layer_types))
        cls = transformers.Qwen2ForCausalLM
    else:
        hf_config = transformers.LlamaConfig(**common, attention_bias=c.attention_bias)
        cls = transformers.LlamaForCausalLM
    hf_config._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = cls(hf_config)
    state = {("lm_head.weight" if name == "lm_head.weight" else "model." + name): p
             for name, p in model.named_parameters()}
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    if unexpected or [k for k in missing if "rotary" not in k and not (c.tie_word_embeddings and "lm_head" in k)]:
        raise RuntimeError(f"weights do not map onto transformers: missing {missing}, unexpected {unexpected}")
    # Non-persistent buffers (RoPE frequencies) are still on the meta device: rebuild them for real.
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_config).to(model.device)
    if c.tie_word_embeddings:
        hf.tie_weights()
    return hf.to(model.device).eval()
