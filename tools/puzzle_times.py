"""Time each kernel puzzle's check on its committed solution (exercise 7b).

    python -m tools.puzzle_times            a markdown table, one row per puzzle

Each check runs once, on this process's Triton (the interpreter on a CPU:
run it under ``taskset -c 0`` for one core). The issue's budget is about
20 s per check on one CPU core; the first call of a check also builds its
cases, and that is counted.
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from pathlib import Path

import pagedkv  # noqa: F401  -- fixes the Triton mode before the solutions' kernels are defined
from pagedkv import checks
from pagedkv.checks import ch07b_kernel_puzzles as puzzles
from tools.notebooks import load_cell_function

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "07b_kernel_puzzles.ipynb"
WRAPPERS = {1: "slots_per_request", 2: "gather_k", 3: "attend_one_tile", 4: "row_logsumexp",
            5: "decode_mha", 6: "decode_gqa", 7: "prefill_chunk", 8: "split_partials",
            9: "merge_splits", 10: "copy_blocks_all_layers", 11: "decode_unmasked"}


def main() -> int:
    print(f"{pagedkv.device_summary()}\n")
    print("| puzzle | check (s) | properties |\n|---:|---:|:---|")
    for n in puzzles.PUZZLES:
        fn = load_cell_function(SOLUTION, WRAPPERS[n])
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            report = checks.check_kernel_puzzle(n, fn)
        elapsed = time.perf_counter() - start
        print(f"| {n} | {elapsed:.1f} | {report.summary()} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
