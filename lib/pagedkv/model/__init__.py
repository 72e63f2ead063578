"""A Llama-family decoder over a paged KV cache, and the ways to fill its weights.

One concept per module:

- ``config``: ``ModelConfig`` (shapes, named as in ``config.json``) and ``PRESETS``;
- ``decoder``: ``Model`` (paged ``forward`` and the dense reference),
  ``AttentionMetadata``, ``metadata_by_layer`` (one per KV-cache group's
  layers, for a model mixing sliding-window and full attention), ``dense_logits``;
- ``paged_attention``: the batched PyTorch paged attention the CPU path runs;
- ``cpu_linear``: ``PackedLinear``, fused products; on a CPU, oneDNN over packed weights;
- ``checkpoint``: ``load_pretrained`` (a Hugging Face safetensors directory);
- ``gguf_file`` and ``gguf``: reading a llama.cpp GGUF file, ``load_gguf``;
- ``tokenizer``: the tokenizer and chat template stored in a GGUF file;
- ``chat_template``: rendering a file's chat template, sandboxed and bounded;
- ``smollm2``: where the book's real model (SmolLM2-135M-Instruct) is installed.
"""

from .checkpoint import load_pretrained, load_tokenizer
from .config import PRESETS, SUPPORTED_ARCHITECTURES, ModelConfig
from .decoder import AttentionMetadata, Model, apply_rope, dense_logits, metadata_by_layer, rope_inv_freq
from .gguf import GGUF_ARCHITECTURES, config_from_gguf, load_gguf
from .gguf_file import GGUFFile, read_gguf
from .smollm2 import SMOLLM2_INSTALL, smollm2_available, smollm2_path
from .tokenizer import Tokenizer, load_gguf_tokenizer

__all__ = [
    "ModelConfig", "PRESETS", "SUPPORTED_ARCHITECTURES", "AttentionMetadata", "Model", "apply_rope",
    "dense_logits", "metadata_by_layer", "rope_inv_freq", "load_pretrained", "load_tokenizer", "load_gguf", "config_from_gguf",
    "GGUF_ARCHITECTURES", "GGUFFile", "read_gguf", "Tokenizer", "load_gguf_tokenizer", "SMOLLM2_INSTALL",
    "smollm2_available", "smollm2_path",
]
