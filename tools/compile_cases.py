"""What the compile check compiles: every Triton kernel of the book, with the arguments a launch passes.

``tools/compile_check.py`` compiles these cases and judges them; this module
only builds them. Three kinds:

- the library's kernels (``library_cases``), bound from the launches the
  library itself plans (``pagedkv.kernels.attention.kernel_launches`` and the
  other launchers) at the chapters' GPU shapes: 64 requests, 4k tokens,
  Llama-3-8B's heads;
- every ``@triton.jit`` kernel a notebook defines (``notebook_cases``), each
  cell decorated in compiled mode as on a GPU, with the launch arguments
  ``NOTEBOOK_LAUNCHES`` gives by kernel name (a kernel missing there fails);
- the exercise solutions' kernels across dtypes and head sizes
  (``solution_cases``).

Arguments are tensors on PyTorch's ``meta`` device: shapes and dtypes
without memory, which is all Triton's binder reads. Import this module after
``triton`` (``compile_check`` does): importing ``pagedkv`` first would select
Triton's interpreter on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton
from triton.runtime.jit import JITFunction

ROOT = Path(__file__).resolve().parents[1]
for _path in (str(ROOT / "lib"), str(ROOT)):  # pagedkv, and tools.notebooks for the notebooks' kernels
    if _path not in sys.path:
        sys.path.insert(0, _path)

# The modules, not the package's functions of the same names.
attn, cb, kvw, sm, gbt = (importlib.import_module(f"pagedkv.kernels.{m}")
                          for m in ("attention", "copy_blocks", "kv_write", "slot_mapping", "gather_block_tables"))


DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
HEADS, KV_HEADS = 32, 8  # Llama-3-8B


class CompileCheckError(Exception):
    """A case failed to compile; the message names the case and the target."""


@dataclass
class Case:
    """One kernel launch to compile: the kernel, its launch arguments and what it is."""

    name: str
    kernel: object  # a JITFunction, or the interpreter's wrapper of one
    args: tuple
    kwargs: dict
    info: dict = field(default_factory=dict)  # kernel, kind, dtype, head_dim, block_size, tiles
    quick: bool = False

    @property
    def strict_spills(self) -> bool:
        """Attention in a 2-byte type at head_dim <= 128 may not spill at all."""
        return (self.info.get("attention", False) and self.info.get("dtype") in ("bf16", "fp16")
                and self.info.get("head_dim", 0) <= 128)


def meta(*shape, dtype=torch.bfloat16):
    """An argument of a launch: a tensor of that shape and dtype on the ``meta`` device (no memory)."""
    return torch.empty(shape, dtype=dtype, device="meta")


# ----------------------------------------------------------------- the cases

def _attention_cases(dtype_name, head_dim, block_size, kind, quick, sliding_window=None):
    """Decode 64 x 4k, prefill 4 x 2k, or split-KV decode 1 x 16k (16 splits, then the merge)."""
    dtype = DTYPES[dtype_name]
    batch, q_len, seq, splits = {"decode": (64, 1, 4096, 1), "prefill": (4, 2048, 2048, 1),
                                 "split": (1, 1, 16384, 16)}[kind]
    plan = attn.plan_attention(HEADS, KV_HEADS, [q_len] * batch, [seq] * batch, splits,
                               head_dim=head_dim, dtype=dtype, sliding_window=sliding_window)
    tokens, max_blocks = batch * q_len, -(-seq // block_size) + 1  # paginate's spare column
    q = meta(tokens, HEADS, head_dim, dtype=dtype)
    cache = meta(1, block_size, KV_HEADS, head_dim, dtype=dtype)
    table = meta(batch, max_blocks, dtype=torch.int32)
    launches = attn.kernel_launches(plan, q, cache, cache, table, meta(batch, dtype=torch.int32),
                                    meta(batch + 1, dtype=torch.int32), head_dim ** -0.5, q,
                                    interpreted=False)
    tiles = dict(block_m=plan.block_m, tile_n=plan.tile_n, num_warps=plan.num_warps,
                 num_stages=plan.num_stages, num_splits=plan.num_splits)
    info = dict(attention=True, dtype=dtype_name, head_dim=head_dim, block_size=block_size, tiles=tiles)
    shape = {"decode": "64 x 4k", "prefill": "4 x 2k", "split": "1 x 16k"}[kind]
    cases = []
    for kernel, _grid, args, kwargs in launches:
        merge = kernel.fn.__name__ == "_merge_splits_kernel"
        name = (f"merge {shape} {dtype_name} d{head_dim} ({splits} splits)" if merge
                else f"{kind} {shape} {dtype_name} d{head_dim} b{block_size}")
        if sliding_window is not None:
            name += f" window {sliding_window}"
        row = dict(info, kernel=kernel.fn.__name__, kind="merge" if merge else kind)
        if merge:  # one program per (token, head): no tiles of its own
            del row["tiles"], row["block_size"]
        cases.append(Case(name, kernel, args, kwargs, row, quick))
    return cases


# The quick set (make test): every dtype at head_dim 128, bf16 at 64 and 256,
# fp32's largest prefill (the shared-memory risk), split-KV and the merge,
# the three block sizes once, and bf16 decode at a padded head_dim (96).
_QUICK_ATTENTION = {
    *((dt, 128, 16, kind) for dt in DTYPES for kind in ("decode", "prefill")),
    *(("bf16", hd, 16, kind) for hd in (64, 256) for kind in ("decode", "prefill")),
    ("fp32", 256, 16, "prefill"), ("bf16", 128, 16, "split"),
    ("bf16", 128, 1, "decode"), ("bf16", 128, 128, "decode"),
}


def library_cases():
    cases = []
    for dt in DTYPES:
        for hd in (64, 128, 256):
            for block in (1, 16, 128):
                for kind in ("decode", "prefill", "split"):
                    quick = (dt, hd, block, kind) in _QUICK_ATTENTION
                    cases += [c for c in _attention_cases(dt, hd, block, kind, quick)
                              if not (c.info["kind"] == "merge" and block != 16)]  # merge ignores blocks
    for kind in ("decode", "prefill", "split"):  # a padded head_dim (Phi-3's 96): 128 with a mask
        cases += [c for c in _attention_cases("bf16", 96, 16, kind, kind == "decode")]
    for elem, dtype in ((1, torch.int8), (2, torch.bfloat16), (4, torch.float32), (8, torch.float64)):
        for block in (1, 16, 128):
            like = meta(2, block, KV_HEADS, 128, dtype=dtype)
            (kernel, grid, args, kwargs), = cb.copy_launches(meta(64, dtype=torch.int64),
                                                             meta(4, 2, dtype=torch.int64), like, True)
            cases.append(Case(f"copy_blocks {elem}-byte b{block}", kernel, args, kwargs,
                              dict(kernel="_copy_blocks_kernel", kind="copy", dtype=f"{elem}-byte",
                                   block_size=block), quick=elem == 2 and block == 16))
    for dt, dtype in DTYPES.items():
        for hd in (64, 128, 256):
            key = meta(64, KV_HEADS, hd, dtype=dtype)
            cache = meta(8, 16, KV_HEADS, hd, dtype=dtype)
            chunk = min(triton.next_power_of_2(KV_HEADS * hd), 1024)  # as kv_write's launcher
            cases.append(Case(f"kv_write {dt} d{hd}", kvw._reshape_and_cache_kernel,
                              (key, key, cache, cache, meta(64, dtype=torch.int64), KV_HEADS * hd),
                              dict(CHUNK=chunk), dict(kernel="_reshape_and_cache_kernel", kind="kv_write",
                                                      dtype=dt, head_dim=hd), quick=(dt, hd) == ("bf16", 128)))
    for block in (1, 16, 128):
        cases.append(Case(f"slot_mapping b{block}", sm._slot_mapping_kernel,
                          (meta(64, 257, dtype=torch.int32), 257, meta(4096, dtype=torch.int32),
                           meta(4096, dtype=torch.int32), meta(4096, dtype=torch.int64), 4096, block),
                          dict(TOKENS_PER_PROGRAM=256),  # as slot_mapping's launcher
                          dict(kernel="_slot_mapping_kernel", kind="slot_mapping", block_size=block),
                          quick=block == 16))
    for width in (257, 2049):  # 4k and 32k tokens at block 16, plus a spare column; 2049 takes three chunks
        rows = meta(256, width, dtype=torch.int32)  # max_num_reqs rows; 64 of them in the step
        cases.append(Case(f"gather_block_tables w{width}", gbt._gather_block_tables_kernel,
                          (meta(64, dtype=torch.int64), rows, width, meta(256, dtype=torch.int32), rows, width,
                           64, width),
                          dict(CHUNK=min(gbt.MAX_CHUNK, triton.next_power_of_2(width))),  # as its launcher
                          dict(kernel="_gather_block_tables_kernel", kind="gather_block_tables"),
                          quick=width == 257))
    return cases


def sliding_window_cases():
    """The sliding-window variant (``SLIDING``) of the bf16 d128 b16 rows, window 1024.

    Compiled and held to the same rules by the tests (``tools/tests``); kept
    out of ``all_cases`` and so out of the committed report and its page.
    """
    return [c for kind in ("decode", "prefill", "split")
            for c in _attention_cases("bf16", 128, 16, kind, False, sliding_window=1024)
            if c.info["kind"] != "merge"]  # the merge has no window


# Launch arguments (meta tensors) of the kernels the notebooks define, by kernel
# name: what the notebooks' launchers pass, at the chapters' GPU shapes (64
# requests, 4k tokens, Llama-3-8B's heads). An exercise's stub and its solution
# share a name and a signature.
def _slot_mapping_args():
    i64 = torch.int64
    return ((meta(64, 257, dtype=torch.int32), 257, meta(4096, dtype=i64), meta(4096, dtype=i64),
             meta(4096, dtype=i64), 4096, 16), dict(TILE=128))


def _kv_write_args():
    key, cache = meta(64, KV_HEADS, 128), meta(8, 16, KV_HEADS, 128)
    return (key, key, cache, cache, meta(64, dtype=torch.int64), KV_HEADS * 128), dict(WIDTH_P2=KV_HEADS * 128)


def _decode_args(dtype=torch.bfloat16, hd=128):
    q, cache = meta(64, HEADS, hd, dtype=dtype), meta(1, 16, KV_HEADS, hd, dtype=dtype)
    return ((q, cache, cache, meta(64, 257, dtype=torch.int32), meta(64, dtype=torch.int32), q,
             hd ** -0.5, HEADS, KV_HEADS, 16, 257), dict(GROUP=4, GROUP_P2=4, HEAD_DIM=hd, TILE=16))


# The kernel puzzles (exercise 7b) are fp32 at the chapters' GPU shapes; the
# constexprs are what the solutions' wrappers pass.
def _puzzle_args():
    f32, i32, i64 = torch.float32, torch.int32, torch.int64
    hd, reqs, width = 128, 64, 257
    q, cache = meta(reqs, HEADS, hd, dtype=f32), meta(1, 16, HEADS, hd, dtype=f32)
    gqa_cache = meta(1, 16, KV_HEADS, hd, dtype=f32)
    table, lens = meta(reqs, width, dtype=i32), meta(reqs, dtype=i32)
    qsl = meta(reqs + 1, dtype=i32)
    tokens = meta(4096, HEADS, hd, dtype=f32)
    scale = hd ** -0.5
    return {
        "slots_per_request_kernel": ((qsl, meta(4096, dtype=i64), table, width, meta(4160, dtype=i64),
                                      4096, 4160, 16), dict(PAD_ID=-1, TILE=16)),
        "decode_unmasked_kernel": ((q, cache, cache, meta(reqs, 264, dtype=i32), lens, q, scale, HEADS, 16,
                                    264), dict(HEAD_DIM=hd, TILE=128)),
        "gather_kernel": ((meta(1, 16, KV_HEADS, hd, dtype=f32), meta(width, dtype=i32),
                           meta(4096, KV_HEADS, hd, dtype=f32), 4096, 16),
                          dict(WIDTH=KV_HEADS * hd, SLOTS=16)),
        "attend_kernel": ((meta(hd, dtype=f32), meta(32, hd, dtype=f32), meta(32, hd, dtype=f32),
                           meta(hd, dtype=f32), 32, scale), dict(HEAD_DIM=hd, TILE=32)),
        "logsumexp_kernel": ((meta(64, 4096, dtype=f32), meta(64, dtype=f32), 4096, 4096),
                             dict(TILE=16)),
        "logsumexp_two_pass_kernel": ((meta(64, 4096, dtype=f32), meta(64, dtype=f32), 4096, 4096),
                                      dict(TILE=16)),
        "decode_mha_kernel": ((q, cache, cache, table, lens, q, scale, HEADS, 16, width),
                              dict(HEAD_DIM=hd, TILE=16)),
        "decode_gqa_kernel": ((q, gqa_cache, gqa_cache, table, lens, q, scale, HEADS, KV_HEADS, 16, width),
                              dict(GROUP=HEADS // KV_HEADS, ROWS=16, HEAD_DIM=hd, TILE=16)),
        "prefill_kernel": ((tokens, cache, cache, table, lens, qsl, tokens, scale, HEADS, 16, width),
                           dict(HEAD_DIM=hd, BLOCK_Q=16, TILE=16)),
        "split_kernel": ((q, cache, cache, table, lens, meta(8, reqs, HEADS, hd, dtype=f32),
                          meta(8, reqs, HEADS, dtype=f32), scale, reqs, HEADS, 16, width, 512),
                         dict(HEAD_DIM=hd, TILE=16)),
        "merge_kernel": ((meta(8, reqs, HEADS, hd, dtype=f32), meta(8, reqs, HEADS, dtype=f32), q,
                          reqs * HEADS, 8), dict(SPLITS=8, HEAD_DIM=hd)),
        "copy_blocks_kernel": ((meta(64, dtype=i64), meta(4, 2, dtype=i64), 16 * KV_HEADS * hd),
                               dict(TILE=1024)),
    }


def _table_gather_args():
    i32 = torch.int32
    return ((meta(64, dtype=i32), meta(256, 257, dtype=i32), 257, meta(256, dtype=i32),
             meta(64, 257, dtype=i32), 257, 64, 257), dict(CHUNK=512))


# The find-the-bug kernels (exercises 7 and 7b): the merge shares the puzzle
# merge's signature; the window gather reads a 128-token window of 128-wide
# K rows through the chapters' 64 x 257 table.
def _window_gather_args():
    f32, i32 = torch.float32, torch.int32
    return ((meta(1, 16, 128, dtype=f32), meta(64, 257, dtype=i32), meta(64, dtype=i32),
             meta(64, 128, 128, dtype=f32), 16, 257, 128), dict(ROW=128, W=128))


NOTEBOOK_LAUNCHES = {"slot_mapping_kernel": _slot_mapping_args, "kv_write_kernel": _kv_write_args,
                     "decode_kernel": _decode_args, "table_gather_kernel": _table_gather_args,
                     **{name: (lambda name=name: _puzzle_args()[name]) for name in _puzzle_args()},
                     "merge_fixed_kernel": lambda: _puzzle_args()["merge_kernel"],
                     "window_gather_kernel": _window_gather_args,
                     "window_gather_fixed_kernel": _window_gather_args}

# Kernels written to be stepped in Triton's interpreter, never compiled: they
# call Python (pdb, print of a traced value) from inside the kernel, and the
# notebooks launch them only through ``ch07b_find_bug.interpreted``, which runs
# the interpreter on a GPU machine too.
INTERPRETER_ONLY = {"double_kernel", "merge_traced", "window_gather_traced"}


@contextlib.contextmanager
def _compiled_mode():
    """Decorate as a GPU machine does: without the TRITON_INTERPRET=1 that pagedkv set on this CPU."""
    before = os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if before is not None:
            os.environ["TRITON_INTERPRET"] = before


def notebook_kernels() -> list[tuple[str, int, JITFunction]]:
    """Every ``@triton.jit`` kernel a notebook defines: ``(notebook, cell index, kernel)``.

    Each kernel cell runs as ``python -m tools.notebooks run-plain`` runs it
    (``run_cell``, under the cell's own file name) with Triton in compiled
    mode, so a cell that would not decorate on a GPU raises here.
    """
    import triton.language as tl
    from tools.notebooks import NOTEBOOK_DIRS, cell_filename, run_cell

    found = []
    for path in sorted(p for d in NOTEBOOK_DIRS for p in (ROOT / d).glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            src = "".join(cell["source"])
            if cell["cell_type"] != "code" or "@triton.jit" not in src:
                continue
            ns = {"__name__": "__main__", "torch": torch, "triton": triton, "tl": tl}
            with _compiled_mode(), contextlib.redirect_stdout(io.StringIO()):
                run_cell(src, ns, cell_filename(path, i))
            rel = f"{path.parent.name}/{path.name}"
            found += [(rel, i, v) for k, v in ns.items() if isinstance(v, JITFunction) and k == v.fn.__name__]
    return found


def notebook_cases() -> list[Case]:
    """A case per notebook kernel, with the launch arguments ``NOTEBOOK_LAUNCHES`` names."""
    cases = []
    for notebook, cell, kernel in notebook_kernels():
        name = kernel.fn.__name__
        if name in INTERPRETER_ONLY:
            continue
        if name not in NOTEBOOK_LAUNCHES:
            raise CompileCheckError(f"{notebook} cell {cell} defines {name}, which has no launch "
                                    "arguments: add it to NOTEBOOK_LAUNCHES in tools/compile_cases.py")
        args, kwargs = NOTEBOOK_LAUNCHES[name]()
        cases.append(Case(f"{notebook} cell {cell}: {name}", kernel, args, kwargs,
                          dict(kernel=name, kind="notebook", notebook=notebook, cell=cell)))
    return cases


def solution_cases():
    """The exercise solutions' kernels, decorated from the committed notebooks as run-plain does."""
    kernels = {(nb, k.fn.__name__): k for nb, _, k in notebook_kernels() if nb.startswith("solutions/")}
    slots, write = (kernels["solutions/05_slot_mapping.ipynb", n] for n in ("slot_mapping_kernel", "kv_write_kernel"))
    decode = kernels["solutions/07_paged_attention.ipynb", "decode_kernel"]
    cases = [Case("solution slot_mapping b16", slots, *_slot_mapping_args(),
                  dict(kernel="slot_mapping_kernel", kind="solution 05"), quick=True),
             Case("solution kv_write bf16 d128", write, *_kv_write_args(),
                  dict(kernel="kv_write_kernel", kind="solution 05", dtype="bf16", head_dim=128), quick=True)]
    for dt, dtype in DTYPES.items():
        for hd in (64, 128, 256):
            cases.append(Case(f"solution decode 64 x 4k {dt} d{hd} b16", decode, *_decode_args(dtype, hd),
                              dict(kernel="decode_kernel", kind="solution 07", dtype=dt, head_dim=hd,
                                   block_size=16), quick=(dt, hd) == ("bf16", 128)))
    return cases


def all_cases(quick: bool):
    cases = library_cases() + solution_cases()
    return [c for c in cases if c.quick] if quick else cases

