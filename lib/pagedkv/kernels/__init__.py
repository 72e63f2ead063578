"""Triton kernels, each beside its PyTorch reference (``*_ref``) with the same signature.

``pagedkv`` has already chosen the Triton mode (compiled on CUDA, interpreted
elsewhere) before this package is imported. Every wrapper validates shapes,
dtypes and index ranges before launching: in the interpreter an out-of-bounds
load kills the process, and on a GPU it silently corrupts memory.
"""

from .. import _device  # noqa: F401  -- fixes TRITON_INTERPRET before triton.jit runs
from .slot_mapping import PAD_SLOT_ID, compute_slot_mapping, compute_slot_mapping_ref  # noqa: F401
from .kv_write import reshape_and_cache, reshape_and_cache_flash, reshape_and_cache_ref  # noqa: F401
from .gather_block_tables import gather_block_tables, gather_block_tables_ref  # noqa: F401
from .copy_blocks import copy_blocks, copy_blocks_ref  # noqa: F401
from .attention import dense_attention_ref, paged_attention, paged_attention_ref  # noqa: F401
