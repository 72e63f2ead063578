#!/usr/bin/env bash
# Every GPU check of the book, for a bare CUDA machine that has torch, triton,
# numpy, matplotlib, pytest and hypothesis but no Jupyter (no venv, no network):
#   1. the library's tests with the kernels compiled for the GPU;
#   2. every notebook's code, run without Jupyter, its printed text compared with
#      the committed (CPU-executed) outputs -- see `python -m tools.notebooks`;
#   3. the benchmarks (GB/s of the kernels against PyTorch, as ratios in one run;
#      paged attention against SDPA and the datasheet peak; the engine against
#      Hugging Face generate when transformers is importable there).
# Reports go to $OUT (or _build/gpu). GPU_CHECK_ALLOW_CPU=1 rehearses it on a CPU.
# Usage: .ci/gpu-check.sh [STEP...] with STEP among tests, notebooks, bench
# (default: all three). The steps can go into separate device calls when one
# call's time limit is tight: each writes its own report files.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-_build/gpu}"
mkdir -p "$out"
export PYTHONPATH="$PWD/lib${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"

$py - <<'PY' 2>&1 | tee "$out/device.txt" || exit 1
import os, sys, torch, pagedkv
print(pagedkv.device_summary())
print("torch", torch.__version__, "| python", sys.version.split()[0])
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}: {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
if not pagedkv.on_gpu() and os.environ.get("GPU_CHECK_ALLOW_CPU") != "1":
    sys.exit("no CUDA GPU here: the kernels would run interpreted (set GPU_CHECK_ALLOW_CPU=1 to rehearse)")
PY

steps="${*:-tests notebooks bench}"
wants() { case " $steps " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
status=0
if wants tests; then
    $py -m pytest lib/tests -q -p no:cacheprovider 2>&1 | tee "$out/tests.txt" || status=1
fi
if wants notebooks; then
    $py -m tools.notebooks run-plain chapters/*.ipynb exercises/*.ipynb solutions/*.ipynb 2>&1 \
        | tee "$out/notebooks.txt" || status=1
fi
if wants bench; then
    # Benchmarks one by one; those that report figures for the book (attention,
    # engine) also merge them into gpu_report.json, which is committed as
    # book/gpu_report.json and shown on the benchmarks page.
    for bench in $($py -c "from pagedkv.bench.__main__ import available; print(*available())"); do
        case $bench in
            attention|engine) extra=(--json "$out/gpu_report.json") ;;
            *) extra=() ;;
        esac
        echo "== $bench ==" | tee -a "$out/bench.txt"
        $py -m pagedkv.bench "$bench" "${extra[@]}" 2>&1 | tee -a "$out/bench.txt" || status=1
    done
fi
echo "gpu-check: $([ $status = 0 ] && echo all checks passed || echo SOME CHECKS FAILED); reports in $out"
exit $status
