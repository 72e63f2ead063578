"""How broad the core is: functions one request touches, code lines per area, the pool against vLLM's.

    python -m tools.core_metrics [--json FILE] [--backend torch triton] [--no-pool]

Three measurements, each printed as a table (``--json`` also writes them):

1. **Functions one request touches.** A tiny random Llama model
   (``ModelConfig.preset("tiny")``, ``Model(..., seed=0)``, float32 on the
   CPU, as ``lib/tests/test_engine.py`` builds it) behind an ``LLMEngine``
   with the test suite's small engine arguments (``block_size=4``,
   ``num_gpu_blocks_override=64``, ``max_model_len=96``, ``max_num_seqs=8``,
   ``max_num_batched_tokens=64``) and one ``kernel_backend`` (``torch``, the
   CPU's default, and ``triton``, the GPU's, here in Triton's interpreter).
   A warm-up ``engine.generate([WARMUP_PROMPT], max_tokens=4)`` runs first,
   so that lazy imports and first-call caches do not count. Then
   ``sys.setprofile`` records every Python ``call`` event during
   ``engine.generate([PROMPT], max_tokens=MAX_TOKENS)``: one 10-token prompt
   of token ids, greedy (``LLMEngine.generate``'s default), no prefix hit
   (it shares no block with the warm-up prompt), one prefill step and three
   decode steps. A function counts once, by ``file:qualname`` of its code
   object, when its file is inside the ``pagedkv`` package. Comprehensions,
   generator expressions and module bodies are not functions a reader
   follows: they are left out (``code_objects`` keeps them). Counted per
   file and per area (``AREAS``).

2. **Code lines per area.** A code line holds a Python token that is not a
   comment and not part of a docstring (the first string statement of a
   module, class or function, found with ``ast``). Blank lines, comments and
   docstrings do not count; every line of a multi-line expression does.

3. **The block pool against vLLM 0.33.0's.** ``pagedkv.bench.block_pool``'s
   seeded trace (20,000 blocks, 200,000 operations: allocate 1-8 blocks, or
   free a held batch reversed) replayed on our ``BlockPool`` and on vLLM
   0.33.0's own ``BlockPool`` (``enable_caching=True``, ``hash_block_size``
   16), best of 5 interleaved rounds of process CPU time. vLLM is never
   installed or imported as a package: ``vllm/v1/core/kv_cache_utils.py`` and
   ``vllm/v1/core/block_pool.py`` are read from the wheel that
   ``tools/citations.py`` caches (or ``--vllm``: that wheel, or a folder
   holding the ``vllm`` package's sources) and executed with every other
   ``vllm.*`` import replaced by an inert stub; nothing the trace runs
   (``get_new_blocks``, ``free_blocks`` without events or metrics) touches
   a stub.
"""

from __future__ import annotations

import argparse
import ast
import collections
import importlib.machinery
import io
import json
import sys
import tokenize
import types
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lib" / "pagedkv"

#: The book's four areas of the core, as files relative to ``lib/pagedkv``.
AREAS: dict[str, tuple[str, ...]] = {
    "memory manager": ("free_queue.py", "block_pool.py", "pool_events.py", "kv_cache_manager.py",
                       "request.py", "hashing.py"),
    "scheduler": ("engine/scheduler.py", "engine/request.py"),
    "worker + model": ("engine/worker.py", "model/decoder.py", "model/paged_attention.py"),
    "engine": ("engine/llm_engine.py", "engine/llm.py", "engine/args.py", "engine/sizing.py",
               "engine/stats.py", "engine/parallel_sampling.py"),
}

WARMUP_PROMPT = [11, 12, 13, 14, 15, 16, 17]
PROMPT = [101, 7, 58, 230, 42, 9, 77, 150, 3, 64]
MAX_TOKENS = 4
ENGINE_ARGS = dict(block_size=4, num_gpu_blocks_override=64, max_model_len=96, max_num_seqs=8,
                   max_num_batched_tokens=64)
_NOT_FUNCTIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<module>")


# --- 1. Functions one request touches -----------------------------------------

def functions_touched(backend: str = "torch") -> list[str]:
    """Sorted ``file:qualname`` of every pagedkv code object one request's ``generate`` calls."""
    from pagedkv.engine import EngineArgs, LLMEngine
    from pagedkv.model import Model, ModelConfig

    model = Model(ModelConfig.preset("tiny"), seed=0)
    engine = LLMEngine(EngineArgs(kernel_backend=backend, **ENGINE_ARGS), model)
    engine.generate([WARMUP_PROMPT], max_tokens=MAX_TOKENS)
    root = str(PACKAGE) + "/"
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(root):
                seen.add(f"{code.co_filename[len(root):]}:{code.co_qualname}")

    sys.setprofile(profile)
    try:
        out = engine.generate([PROMPT], max_tokens=MAX_TOKENS)
    finally:
        sys.setprofile(None)
    if len(out[0].outputs[0].token_ids) != MAX_TOKENS:
        raise RuntimeError(f"the measured request did not run to max_tokens: {out[0]}")
    return sorted(seen)


def is_function(name: str) -> bool:
    return not name.rsplit(".", 1)[-1].rsplit(":", 1)[-1] in _NOT_FUNCTIONS


def area_of(file: str) -> str:
    for area, files in AREAS.items():
        if file in files:
            return area
    return "kernels" if file.startswith("kernels/") else "other core"


def summarize_functions(names: list[str]) -> dict:
    functions = [n for n in names if is_function(n)]
    per_file = collections.Counter(n.split(":", 1)[0] for n in functions)
    per_area = collections.Counter()
    for file, count in per_file.items():
        per_area[area_of(file)] += count
    return {"functions": len(functions), "code_objects": len(names), "files": len(per_file),
            "per_area": dict(sorted(per_area.items())), "per_file": dict(sorted(per_file.items())),
            "names": functions}


# --- 2. Code lines -------------------------------------------------------------

def docstring_lines(tree: ast.AST) -> set[int]:
    """Line numbers of every docstring (module, class, function)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def code_lines(source: str) -> int:
    """Lines holding a token that is not a comment and not part of a docstring."""
    skip = docstring_lines(ast.parse(source))
    ignored = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
               tokenize.ENDMARKER, tokenize.ENCODING}
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in ignored:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - skip)


def area_lines(package: Path = PACKAGE) -> dict:
    out = {}
    for area, files in AREAS.items():
        per_file = {f: code_lines((package / f).read_text()) for f in files if (package / f).exists()}
        out[area] = {"code_lines": sum(per_file.values()), "per_file": per_file}
    return out


# --- 3. The pool against vLLM's -------------------------------------------------

class _StubType(type):
    """A stand-in for any name a stubbed vLLM module exports: usable as a type, callable, inert."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(name)

    def __or__(cls, other):
        return cls

    __ror__ = __or__

    def __getitem__(cls, key):
        return cls

    def __call__(cls, *args, **kwargs):
        return _stub("result")


def _stub(name: str) -> type:
    return _StubType(name, (), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _stub(name)
        setattr(self, name, value)
        return value


class _StubFinder:
    """Finds every ``vllm.*`` module not in ``real`` and makes it a stub package."""

    def __init__(self, real: set[str]):
        self.real = real

    def find_spec(self, fullname, path, target=None):
        if (fullname == "vllm" or fullname.startswith("vllm.")) and fullname not in self.real:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def _vllm_source(where: Path | None, path: str) -> str:
    if where is None:
        from tools import citations

        where = citations.find_wheel()
        if where is None:
            raise FileNotFoundError("no vLLM 0.33.0 wheel cached and none downloadable; pass --vllm")
    if where.is_dir():
        return (where / "vllm" / path if (where / "vllm").is_dir() else where / path).read_text()
    with zipfile.ZipFile(where) as z:
        return z.read("vllm/" + path).decode()


def vllm_block_pool_class(where: Path | None = None) -> type:
    """vLLM 0.33.0's ``BlockPool``, executed from its sources with the rest of vLLM stubbed."""
    files = {"vllm.v1.core.kv_cache_utils": "v1/core/kv_cache_utils.py",
             "vllm.v1.core.block_pool": "v1/core/block_pool.py"}
    finder = _StubFinder(set(files))
    saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    sys.meta_path.insert(0, finder)
    try:
        for name, path in files.items():
            module = types.ModuleType(name)
            module.__file__ = f"vllm/{path}"
            sys.modules[name] = module
            exec(compile(_vllm_source(where, path), f"vllm/{path}", "exec"), module.__dict__)
        return sys.modules["vllm.v1.core.block_pool"].BlockPool
    finally:
        sys.meta_path.remove(finder)
        for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def pool_against_vllm(where: Path | None = None, blocks: int = 20_000, ops: int = 200_000,
                      repeats: int = 5) -> dict:
    from pagedkv.block_pool import BlockPool
    from pagedkv.sim.deque_pool import blocks_moved_per_second, make_alloc_free_trace

    VllmBlockPool = vllm_block_pool_class(where)
    trace = make_alloc_free_trace(blocks, ops)
    rates = blocks_moved_per_second(
        {"ours": lambda: BlockPool(blocks),
         "vllm": lambda: VllmBlockPool(blocks, enable_caching=True, hash_block_size=16)},
        trace, repeats)
    return {"blocks": blocks, "ops": ops, "repeats": repeats, "ours_blocks_per_s": rates["ours"],
            "vllm_blocks_per_s": rates["vllm"], "ratio": rates["ours"] / rates["vllm"]}


# --- The report -------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.core_metrics", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", nargs="*", default=["torch", "triton"], help="kernel backends to profile")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--no-pool", action="store_true", help="skip the comparison with vLLM's pool")
    parser.add_argument("--vllm", type=Path, help="vLLM 0.33.0's wheel or source folder")
    args = parser.parse_args(argv)
    report: dict = {"functions": {}, "lines": area_lines()}
    for backend in args.backend:
        s = summarize_functions(functions_touched(backend))
        report["functions"][backend] = s
        print(f"backend {backend}: {s['functions']} functions in {s['files']} files "
              f"({s['code_objects']} code objects with comprehensions)")
        for area, n in s["per_area"].items():
            print(f"  {area:<16} {n:>4}")
        for file, n in s["per_file"].items():
            print(f"    {file:<34} {n:>4}")
    print("code lines:")
    for area, d in report["lines"].items():
        print(f"  {area:<16} {d['code_lines']:>5}  " + ", ".join(f"{f} {n}" for f, n in d["per_file"].items()))
    if not args.no_pool:
        p = pool_against_vllm(args.vllm)
        report["pool"] = p
        print(f"block pool, {p['ops']:,} operations on {p['blocks']:,} blocks, best of {p['repeats']}: "
              f"ours {p['ours_blocks_per_s'] / 1e6:.2f} M blocks/s, vLLM 0.33.0 "
              f"{p['vllm_blocks_per_s'] / 1e6:.2f} M blocks/s, ratio {p['ratio']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
