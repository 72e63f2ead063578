"""The benchmarks page is rendered from the committed GPU, CPU and compile reports, never typed by hand."""

from __future__ import annotations

import json
from pathlib import Path

from pagedkv.bench import _report

ROOT = Path(__file__).resolve().parents[2]


def test_committed_page_is_what_the_report_renders():
    report_path = ROOT / _report.REPORT_JSON
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    compiled, on_cpu = (json.loads((ROOT / p).read_text()) if (ROOT / p).exists() else None
                         for p in (_report.COMPILE_JSON, _report.CPU_JSON))
    assert (ROOT / _report.PAGE_MD).read_text() == _report.render(report, compiled, on_cpu), (
        "book/benchmarks.md is stale: run `python -m pagedkv.bench._report`")


def test_pending_page_says_so_and_a_report_fills_the_table():
    assert "pending" in _report.render(None)
    row = dict(name="decode 64x4096", block_size=16, num_splits=1, kernel_ms=0.5, gbps=3500.0, pct_peak=0.73,
               tflops=1.0, sdpa_ms=0.45, sdpa_backend="flash_attention", time_vs_sdpa=1.11)
    page = _report.render({"attention": dict(device="GPU X", summary="s", copy_ceiling_gbps=4000.0,
                                             peak_gbps=4800.0, rows=[row], split_speedup=2.5)})
    assert "| decode 64x4096 | 16 | 1 | 500.0 | 3,500 | 73% |" in page
    assert "2.50x faster" in page and "pending" not in page


def test_a_cpu_report_adds_the_engine_section_on_a_cpu():
    page = _report.render(None, None, {"engine": dict(lines=["   batch 8   59.5   35.1   1.70x"])})
    assert "## The serving engine on a CPU" in page and "1.70x" in page and "pending" in page
