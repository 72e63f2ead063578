"""A hand-driven mixed batch for chapter 7: real allocator, real block table, one attention launch.

``MixedBatchDriver`` plays the scheduler's and the worker's parts for a few
requests chosen by hand, so that the chapter can show one ``paged_attention``
launch over prefill chunks and decode tokens whose blocks came from a real
``KVCacheManager`` (with prefix caching). Keys and values are a fixed
function of (token id, position), as a model's first layer would make them:
a block shared through the prefix cache then holds exactly what the new
request would have written, and a test can rebuild every K/V from tokens.

``kernel_main_loop_source()`` returns the kernel's main loop as text, read
from the library source, so the chapter prints the code that actually runs.
"""

from __future__ import annotations

import inspect
import textwrap

import torch

from ..block_table import BlockTable
from ..kernels import attention_kernel as _attention_module
from ..kernels import reshape_and_cache
from ..kv_cache_manager import KVCacheManager

__all__ = ["MixedBatchDriver", "kernel_main_loop_source"]


class MixedBatchDriver:
    """Schedule ``(request, new tokens)`` pairs by hand, write their K/V, return the launch metadata.

    Args:
        num_blocks, block_size: the pool (the null block included).
        num_kv_heads, head_dim: the cache's shape per token.
        generator: a seeded ``torch.Generator``; the token and position
            embeddings are drawn from it, in that order (keys, values, position).
        vocab_size, max_positions: sizes of those embedding tables.
        max_num_reqs, max_blocks_per_req: the block table's shape.
        device: where the caches and the table live.
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                 generator: torch.Generator, vocab_size: int = 1000, max_positions: int = 512,
                 max_num_reqs: int = 8, max_blocks_per_req: int = 16, device="cpu") -> None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        self.block_size = block_size
        self.embed_k = torch.randn(vocab_size, num_kv_heads, head_dim, generator=generator)
        self.embed_v = torch.randn(vocab_size, num_kv_heads, head_dim, generator=generator)
        self.position = torch.randn(max_positions, num_kv_heads, head_dim, generator=generator)
        self.manager = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
        self.block_table = BlockTable(max_num_reqs=max_num_reqs,
                                      max_num_blocks_per_req=max_blocks_per_req, device=device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key_cache = torch.zeros(shape, device=device)
        self.value_cache = torch.zeros(shape, device=device)

    def kv_of(self, tokens: torch.Tensor, positions: torch.Tensor):
        """Keys and values of ``tokens`` at ``positions``: embedding plus a position term."""
        pos = self.position[positions]
        return self.embed_k[tokens] + pos, self.embed_v[tokens] + pos

    def _allocate(self, request, num_new: int) -> int:
        """Blocks for ``num_new`` more tokens; returns how many of them the prefix cache served."""
        if request.num_computed_tokens:  # running: its earlier blocks are in place
            if self.manager.allocate_slots(request, num_new) is None:
                raise RuntimeError(f"the pool has no room for {request.request_id}")
            return 0
        hit, num_hit = self.manager.get_computed_blocks(request)  # new: look up the prefix cache
        if self.manager.allocate_slots(request, num_new - num_hit, num_hit, hit) is None:
            raise RuntimeError(f"the pool has no room for {request.request_id}")
        request.num_computed_tokens = num_hit
        return num_hit

    def step(self, batch):
        """Run one step over ``batch``, a list of ``(Request, num_new_tokens)``.

        Row ``i`` of the table is ``batch[i]``'s request. Writes this step's
        K/V through the slot mapping and returns ``(block_table, seq_lens,
        query_start_loc)`` on the device, ready for ``paged_attention``.
        """
        rows, positions, tokens = [], [], []
        for row, (req, n) in enumerate(batch):
            n -= self._allocate(req, n)
            self.block_table.add_row(self.manager.get_block_ids(req.request_id), row)
            start = req.num_computed_tokens
            rows += [row] * n
            positions += range(start, start + n)
            tokens += req.all_token_ids[start:start + n]
        self.block_table.commit(len(batch))
        pos = torch.tensor(positions)
        slot_mapping = self.block_table.compute_slot_mapping(torch.tensor(rows), pos, self.block_size)
        k, v = self.kv_of(torch.tensor(tokens), pos)
        device = self.key_cache.device
        reshape_and_cache(k.to(device), v.to(device), self.key_cache, self.value_cache, slot_mapping)
        counts = torch.bincount(torch.tensor(rows), minlength=len(batch))
        qsl = torch.cat([torch.zeros(1), counts.cumsum(0)]).to(torch.int32)
        for req, _ in batch:
            req.num_computed_tokens = req.num_tokens
        seq_lens = torch.tensor([r.num_tokens for r, _ in batch], dtype=torch.int32)
        return (self.block_table.get_device_tensor(len(batch)), seq_lens.to(device), qsl.to(device))


def kernel_main_loop_source(width: int = 79) -> str:
    """The paged-attention kernel's loop over key tiles, as it stands in ``kernels/attention_kernel.py``.

    Read from the module's source at call time (the first ``for`` statement
    after the first ``@triton.jit`` and its body), dedented, so the text is
    the code that runs. A line longer than ``width`` with a trailing comment
    gets its comment on a line of its own above it, so the excerpt fits the
    page.
    """
    lines = inspect.getsource(_attention_module).splitlines()
    jit = next(i for i, line in enumerate(lines) if line.startswith("@triton.jit"))
    start = next(i for i in range(jit, len(lines)) if lines[i].lstrip().startswith("for "))
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and (not lines[end].strip()
                                or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    out = []
    for line in textwrap.dedent("\n".join(lines[start:end]).rstrip()).splitlines():
        code, sep, comment = line.partition("  # ")
        if len(line) > width and sep:
            pad = " " * (len(code) - len(code.lstrip()))
            out += textwrap.wrap(comment, width, initial_indent=pad + "# ",
                                 subsequent_indent=pad + "# ")
            line = code
        out += _break_in_parentheses(line, width)
    return "\n".join(out)


def _break_in_parentheses(line: str, width: int) -> list[str]:
    """Split a long line after a comma inside parentheses (still valid Python)."""
    if len(line) <= width:
        return [line]
    cut = line.rfind(", ", 0, width)
    opened = line.find("(")
    if cut < 0 or opened < 0 or opened > cut:
        cut = line.rfind(" + ", 0, width - 2)  # else a backslash before an operator
        if cut < 0:
            return [line]
        pad = " " * (len(line) - len(line.lstrip()) + 4)
        return [line[:cut] + " \\"] + _break_in_parentheses(pad + line[cut + 1:], width)
    rest = " " * (line.rfind("(", 0, cut) + 1) + line[cut + 2:]
    return [line[:cut + 1]] + _break_in_parentheses(rest, width)
