"""Compile every Triton kernel of the book ahead of time for an H200 (sm_90) and an A100 (sm_80).

    python tools/compile_check.py [--quick] [--write | --check] [-j N]

No GPU is needed: ``triton.compile(ASTSource(...), target=GPUTarget("cuda",
cap, 32))`` produces PTX and a cubin on any machine, and the bundled
``ptxas -v`` (its log, which Triton prints on request) gives registers and
spills; the compiled metadata gives shared memory. Each case is bound with
Triton's own argument binder, from the arguments a real launch passes
(``pagedkv.kernels.attention.kernel_launches`` for attention, tensors on
PyTorch's ``meta`` device), so the specialisation (dtypes, 16-divisible
integers, integers equal to 1) is the one a launch gets.

A case FAILS on a compile error, on shared memory over the target's opt-in
maximum per program, on more than 255 registers, or on any spill in a
bf16/fp16 attention kernel with head_dim <= 128. The check also reads the
attention kernel's structure, and fails when it is wrong even if it fits:

- every K/V copy of the main loop is a 16-byte ``cp.async`` (counted in the
  PTX: ``cp.async.*.shared.global [..], [..], 16``), not only ``ld.global.v4``;
- a 2-byte decode or split-KV loop keeps at least two K/V buffers in flight
  (fp32, the exactness path, has one at head_dim 256: three stages of its
  tiles would not fit an A100's shared memory);
- no tensor-core (MMA) layout is replicated: the rows one layout covers
  (``warpsPerCTA[0] x instrShape[0]`` in the TTGIR) are at most the tile's
  ``BLOCK_M``; more means several warps compute the same rows (on sm_90 a
  64-row tile with 8 warps computed QK^T and the softmax twice).

It records the main loop's instruction count (the cubin disassembled with the
``nvdisasm`` bundled in the triton wheel; the loop is the longest backward
branch) per target, so a change in the loop shows in the report. ``--quick`` compiles the
representative subset ``make test`` runs; the full set is ``make
test-compile``. ``--write`` stores the report as ``book/compile_report.json``
and re-renders ``book/benchmarks.md``; ``--check`` fails if a compiled case
differs from the committed report (same Triton version only).

The cases themselves, and the launch arguments of every notebook's kernels,
are built in ``tools/compile_cases.py``; this module compiles and judges them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORT_JSON = ROOT / "book" / "compile_report.json"
TARGETS = {"sm_90": (90, "H200"), "sm_80": (80, "A100")}
MAX_REGISTERS = 255

# Triton prints ptxas's log (registers, spills) on stdout when asked.
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

if str(ROOT / "tools") not in sys.path:  # compile_cases sits beside this file, however it was started
    sys.path.insert(0, str(ROOT / "tools"))
# What to compile (after triton: it imports pagedkv). INTERPRETER_ONLY and the *_cases are
# re-exported for tools/tests, which reach everything through this module.
from compile_cases import (  # noqa: E402
    HEADS, INTERPRETER_ONLY, KV_HEADS, Case, CompileCheckError, all_cases, attn, library_cases,  # noqa: F401
    notebook_cases, sliding_window_cases,  # noqa: F401
)
from compile_cases import meta as _meta  # noqa: E402


# ----------------------------------------------------------------- compiling

def _as_jit(kernel) -> JITFunction:
    """The compiler's view of a kernel; on a CPU ``@triton.jit`` made an interpreter wrapper.

    The wrapper keeps the decorator's arguments: ``do_not_specialize`` changes
    the compiled kernel (and how many a serving run compiles), so it is passed on.
    """
    if isinstance(kernel, JITFunction):
        return kernel
    given = getattr(kernel, "kwargs", None) or {}
    keep = {k: given[k] for k in ("do_not_specialize", "do_not_specialize_on_alignment") if given.get(k)}
    return JITFunction(kernel.fn, **keep)


@contextlib.contextmanager
def _private_cache():
    """An empty Triton cache for one compile: a cached kernel would skip ptxas and print no log."""
    before = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="compile_check_") as d:
        os.environ["TRITON_CACHE_DIR"] = d
        try:
            yield
        finally:
            if before is None:
                del os.environ["TRITON_CACHE_DIR"]
            else:
                os.environ["TRITON_CACHE_DIR"] = before


def _ptxas_figures(log: str, name: str) -> tuple[int, int]:
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    if regs is None or spills is None:
        raise CompileCheckError(f"{name}: no ptxas report in the compiler's log:\n{log}")
    return int(regs.group(1)), int(spills.group(1))


def kv_buffers(ttgir: str, tile_n: int, head_dim: int) -> int:
    """K/V buffers of the decode loop: the leading dimension of the pipeliner's
    mutable shared-memory allocations of [n, TILE_N, HEAD_DIM] tiles (0: none)."""
    pat = re.compile(rf"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x{tile_n}x{head_dim}x")
    counts = [int(n) for n in pat.findall(ttgir)]
    return min(counts) if counts else 0


_VEC16 = re.compile(r"ld\.global(?:\.[a-z0-9_:]+)*\.(?:v4\.[bfu]32|v2\.[bfu]64)\b")
# cp.async.{ca,cg}.shared.global [dst], [src], BYTES(, src_size)?; BYTES as 16 or 0x10
_CP_ASYNC = re.compile(r"cp\.async\.c[ag]\.shared\.global(?:\.[a-z0-9_:]+)*\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-fA-F]+|\d+)")
_MMA_LAYOUT = re.compile(r"#ttg\.nvidia_mma<\{([^}]*)\}>")


def cp_async_sizes(ptx: str) -> dict[int, int]:
    """How many ``cp.async`` copies of each size (bytes) the PTX holds."""
    sizes: dict[int, int] = {}
    for n in _CP_ASYNC.findall(ptx):
        sizes[int(n, 0)] = sizes.get(int(n, 0), 0) + 1
    return sizes


def mma_rows(ttgir: str) -> list[int]:
    """Rows each tensor-core layout of the TTGIR covers: warpsPerCTA[0] x instrShape[0]."""
    rows = []
    for body in _MMA_LAYOUT.findall(ttgir):
        warps = re.search(r"warpsPerCTA = \[(\d+),", body)
        instr = re.search(r"instrShape = \[(\d+),", body)
        if warps and instr:
            rows.append(int(warps.group(1)) * int(instr.group(1)))
    return rows


def _nvdisasm() -> str:
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not path.exists():
        raise CompileCheckError(f"no nvdisasm in the triton wheel at {path}")
    return str(path)


def main_loop(cubin: bytes) -> list[str]:
    """The SASS instructions of the kernel's main loop: the longest backward branch (empty: no loop)."""
    import subprocess

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_nvdisasm(), "-c", f.name], capture_output=True, text=True, check=True).stdout
    ins, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            addr = int(m.group(1), 16)
            labels.update((p, addr) for p in pending)
            pending = []
            ins.append((addr, m.group(2)))
    best = None
    for addr, text in ins:
        b = re.search(r"\bBRA\b.*?\((\.L_x_\d+)\)", text)
        if b and b.group(1) in labels and labels[b.group(1)] < addr:
            if best is None or addr - labels[b.group(1)] > best[1] - best[0]:
                best = (labels[b.group(1)], addr)
    return [] if best is None else [t for a, t in ins if best[0] <= a <= best[1]]


def compile_case(case: Case, target: str) -> dict:
    """Compile one case for one target; return its figures (raises CompileCheckError)."""
    if not isinstance(triton.language.standard.max, JITFunction):
        raise RuntimeError("triton.language was imported under TRITON_INTERPRET=1 (its tl.max is the "
                           "interpreter's): compile in a process that imports this module before pagedkv")
    cap = TARGETS[target][0]
    gpu = GPUTarget("cuda", cap, 32)
    backend = make_backend(gpu)
    jf = _as_jit(case.kernel)
    binder = create_function_from_signature(jf.signature, jf.params, backend)
    log = io.StringIO()
    try:
        bound, spec, opts = binder(*case.args, **case.kwargs)
        options, signature, constexprs, attrs = jf._pack_args(backend, case.kwargs, bound, spec, opts)
        with _private_cache(), contextlib.redirect_stdout(log):
            kernel = triton.compile(ASTSource(jf, signature, constexprs, attrs), target=gpu,
                                    options=options.__dict__)
    except Exception as exc:  # any compiler error is a failed case, reported with its cause
        raise CompileCheckError(f"{case.name} [{target}]: does not compile: "
                                f"{type(exc).__name__}: {str(exc)[:2000]}") from exc
    regs, spills = _ptxas_figures(log.getvalue(), f"{case.name} [{target}]")
    shared = int(kernel.metadata.shared)
    warps = int(kernel.metadata.num_warps)
    limits = attn.SM_LIMITS[cap]
    out = dict(regs=regs, spills=spills, shared=shared, num_warps=warps,
               resident=attn.resident_programs(regs, shared, warps, limits),
               vec16_loads=len(_VEC16.findall(kernel.asm["ptx"])))
    tiles = case.info.get("tiles")
    if case.info.get("kind") in ("decode", "prefill", "split") and tiles:
        head_dim_p2 = triton.next_power_of_2(case.info["head_dim"])
        out["kv_buffers"] = kv_buffers(kernel.asm["ttgir"], tiles["tile_n"], head_dim_p2)
        sizes = cp_async_sizes(kernel.asm["ptx"])
        out["cp_async16"] = sizes.pop(16, 0)
        out["cp_async_narrow"] = sum(sizes.values())  # copies of 4 or 8 bytes
        out["mma_rows"] = max(mma_rows(kernel.asm["ttgir"]), default=0)
        out["loop_sass"] = len(main_loop(kernel.asm["cubin"]))
    return out


def violations(case: Case, target: str, fig: dict) -> list[str]:
    """What makes a compiled case fail, in words (empty: it passes)."""
    cap = TARGETS[target][0]
    limit = attn.SM_LIMITS[cap].shared_per_block
    bad = []
    if fig["shared"] > limit:
        bad.append(f"{fig['shared']:,} B of shared memory, over {target}'s {limit:,} B per program")
    if fig["regs"] > MAX_REGISTERS:
        bad.append(f"{fig['regs']} registers, over {MAX_REGISTERS}")
    if case.strict_spills and fig["spills"]:
        bad.append(f"{fig['spills']} B of spills (bf16/fp16 attention at head_dim <= 128 may not spill)")
    tiles = case.info.get("tiles")
    if "cp_async16" in fig:
        if not fig["cp_async16"] or fig["cp_async_narrow"]:
            bad.append(f"K/V copies are not all 16 bytes: {fig['cp_async16']} cp.async of 16 B, "
                       f"{fig['cp_async_narrow']} narrower")
        if (case.info.get("kind") in ("decode", "split") and case.info.get("dtype") in ("bf16", "fp16")
                and fig["kv_buffers"] < 2):
            bad.append(f"{fig['kv_buffers']} K/V buffer(s) in the decode loop: at least 2 keep a copy "
                       "in flight while a tile computes")
        if tiles and fig["mma_rows"] > tiles["block_m"]:
            bad.append(f"replicated MMA layout: it covers {fig['mma_rows']} rows of a {tiles['block_m']}-row "
                       "tile, so warps compute the same rows twice")
    return [f"{case.name} [{target}]: {b}" for b in bad]


def run_cases(cases: list[Case], targets=tuple(TARGETS), jobs: int = 1):
    """Compile every case for every target. Returns (rows, failures)."""
    work = [(i, t) for i in range(len(cases)) for t in targets]
    if jobs > 1:
        global _POOL_CASES
        _POOL_CASES = cases  # inherited by the forked workers
        import multiprocessing

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            results = list(pool.map(_pool_compile, work))
    else:
        results = [_try_compile(cases[i], t) for i, t in work]
    rows = {}
    failures = []
    for (i, t), (fig, error) in zip(work, results):
        case = cases[i]
        row = rows.setdefault(case.name, dict(name=case.name, **{k: v for k, v in case.info.items()
                                                                  if k != "attention"}))
        if error:
            failures.append(error)
            continue
        row[t] = fig
        failures += violations(case, t, fig)
    return list(rows.values()), failures


_POOL_CASES: list[Case] = []


def _try_compile(case, target):
    try:
        return compile_case(case, target), None
    except CompileCheckError as exc:
        return None, str(exc)


def _pool_compile(item):
    i, target = item
    return _try_compile(_POOL_CASES[i], target)


# ----------------------------------------------------------------- variants a serving run compiles

def serving_variants(per_sm: int, num_sms: int = 132) -> dict:
    """Distinct compiled kernels a decode serving run on an H200 asks for: batch 1-64 x context 1k-32k.

    Each launch is planned as the runtime plans it (the split count from
    ``choose_splits`` with ``per_sm`` resident programs per SM, the decode row's
    figure) and bound with Triton's own binder; two launches share a compiled
    kernel when their specialisation (constexprs, dtypes, integer and alignment
    properties) and options are equal. The block table has an engine's fixed
    width (32k tokens of blocks of 16, plus one column).
    """
    backend = make_backend(GPUTarget("cuda", 90, 32))
    keys: dict[str, set] = {}
    splits = set()
    width = 32768 // 16 + 1
    for batch in range(1, 65):
        for ctx in range(1024, 32769, 1024):
            tile_n = attn.plan_attention(HEADS, KV_HEADS, [1] * batch, [ctx + 1] * batch, 1).tile_n
            n = attn.choose_splits(batch * KV_HEADS, ctx + 1, tile_n, per_sm * num_sms)
            splits.add(n)
            plan = attn.plan_attention(HEADS, KV_HEADS, [1] * batch, [ctx + 1] * batch, n)
            q, cache = _meta(batch, HEADS, 128), _meta(1, 16, KV_HEADS, 128)
            for kernel, _grid, args, kwargs in attn.kernel_launches(
                    plan, q, cache, cache, _meta(batch, width, dtype=torch.int32),
                    _meta(batch, dtype=torch.int32), _meta(batch + 1, dtype=torch.int32), 128 ** -0.5, q,
                    interpreted=False):
                jf = _as_jit(kernel)
                _bound, spec, opts = create_function_from_signature(jf.signature, jf.params, backend)(*args, **kwargs)
                keys.setdefault(jf.fn.__name__, set()).add(str(spec) + str(opts))
    return dict(per_sm=per_sm, split_counts=sorted(splits), kernels={k: len(v) for k, v in sorted(keys.items())},
                total=sum(len(v) for v in keys.values()))


# ----------------------------------------------------------------- the report

def make_report(rows: list[dict]) -> dict:
    targets = {t: dict(cap=cap, gpu=gpu, **vars(attn.SM_LIMITS[cap])) for t, (cap, gpu) in TARGETS.items()}
    report = dict(triton=triton.__version__, targets=targets, rows=rows)
    decode = next((r for r in rows if r["name"] == "decode 64 x 4k bf16 d128 b16"), None)
    if decode is not None:
        report["serving_variants"] = serving_variants(decode["sm_90"]["resident"])
    return report


def stale_rows(rows: list[dict], committed: dict) -> list[str]:
    """Rows compiled now that differ from the committed report (names and targets)."""
    if committed.get("triton") != triton.__version__:
        return []  # another compiler: figures may differ legitimately
    known = {r["name"]: r for r in committed.get("rows", [])}
    diffs = []
    for row in rows:
        old = known.get(row["name"])
        for t in TARGETS:
            if t in row and (old is None or old.get(t) != row[t]):
                diffs.append(f"{row['name']} [{t}]: now {row[t]}, committed {None if old is None else old.get(t)}")
    return diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the representative subset make test runs")
    ap.add_argument("--write", action="store_true", help="store book/compile_report.json and the page")
    ap.add_argument("--check", action="store_true", help="fail if a case differs from the committed report")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    opts = ap.parse_args(argv)
    t0 = time.time()
    cases = all_cases(opts.quick)
    rows, failures = run_cases(cases, jobs=opts.jobs)
    print(f"compiled {len(cases)} kernels x {len(TARGETS)} targets in {time.time() - t0:.0f} s "
          f"(triton {triton.__version__})")
    if opts.check:
        committed = json.loads(REPORT_JSON.read_text())
        if committed.get("triton") != triton.__version__:
            print(f"note: the committed report is from triton {committed.get('triton')}; not compared")
        failures += [f"differs from {REPORT_JSON.name} (run `make test-compile`): {d}"
                     for d in stale_rows(rows, committed)]
    for f in failures:
        print("FAIL", f)
    if opts.write and not failures:
        REPORT_JSON.write_text(json.dumps(make_report(rows), indent=1) + "\n")
        from pagedkv.bench import _report

        os.chdir(ROOT)  # the page's paths are relative to the repository
        _report.main([])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
