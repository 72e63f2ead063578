"""The committed performance model is what tools/perf_model.py computes from the compile report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import perf_model as pm  # noqa: E402


def test_the_committed_model_is_what_the_script_computes():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "perf_model.py"), "--check"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_model_follows_the_plan_and_the_compile_report():
    report = json.loads((ROOT / "book" / "compile_report.json").read_text())
    rows = {r["name"]: r for r in pm.model(report)["rows"]}
    decode = rows["decode 64x4096"]
    # 64 requests x 8 KV heads, one tile each; 4,097 keys (the context and the new token) in tiles of 32.
    assert decode["programs"] == 512 and decode["max_iterations"] == -(-4097 // 32)
    assert decode["bound"] == "bandwidth"
    lo, hi = decode["predicted_us"]
    # 64 x 4,097 tokens of K and V (8 heads x 128 x 2 bytes each) at 4,800 GB/s is at least 112 us.
    assert 112 < lo < hi
    # The mixed step launches only tiles with work: the chunk's 2,048 / 32 tiles and 63 decodes.
    assert rows["mixed 2048+63x4096"]["grid"] == [2048 // 32 + 63, 8, 1]
    # A single long sequence splits on an H200 (the split kernel's residency); forced unsplit, it does not.
    assert rows["decode 1x16384"]["num_splits"] > 1 and rows["decode 1x16384 unsplit"]["num_splits"] == 1
    assert rows["decode 1x16384"]["predicted_us"][1] < rows["decode 1x16384 unsplit"]["predicted_us"][0]


def test_more_registers_mean_fewer_resident_programs_and_a_slower_prediction():
    report = json.loads((ROOT / "book" / "compile_report.json").read_text())
    slow = json.loads(json.dumps(report))
    for row in slow["rows"]:
        if row["name"].startswith("split 1 x 16k bf16 d128 b16"):
            row["sm_90"]["resident"] = 1
    fast_row = pm.predict(report, "decode 1x16384", [1], [16384], None)
    slow_row = pm.predict(slow, "decode 1x16384", [1], [16384], None)
    assert slow_row["num_splits"] < fast_row["num_splits"]
    # Fewer segments: each program walks more keys, so the latency floor rises.
    assert slow_row["terms"]["low"]["latency"] > fast_row["terms"]["low"]["latency"]


def test_against_a_gpu_report_says_inside_or_outside(tmp_path):
    report = tmp_path / "gpu_report.json"
    report.write_text(json.dumps({"attention": {"rows": [
        {"name": "decode 64x4096", "kernel_ms": 1e-3},  # 1 us: far below any bandwidth floor
        {"name": "prefill 4x2048", "kernel_ms": 1e3}]}}))  # 1 s: far above
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "perf_model.py"), "--against", str(report)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "decode 64x4096" in done.stdout and "measured 1.0 us, OUTSIDE" in done.stdout
    assert "0 of 2 measured shapes inside the range" in done.stdout
