"""The benchmarks page is rendered from the committed GPU, CPU and compile reports, never typed by hand."""

from __future__ import annotations

import json
from pathlib import Path

from pagedkv.bench import _report

ROOT = Path(__file__).resolve().parents[2]


def test_committed_page_is_what_the_report_renders():
    report_path = ROOT / _report.REPORT_JSON
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    compiled, on_cpu, predicted = (json.loads((ROOT / p).read_text()) if (ROOT / p).exists() else None
                                    for p in (_report.COMPILE_JSON, _report.CPU_JSON, _report.PERF_MODEL_JSON))
    assert (ROOT / _report.PAGE_MD).read_text() == _report.render(report, compiled, on_cpu, predicted), (
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


def test_cpu_notes_name_the_quantized_model_and_explain_the_smaller_pool():
    throughput = [dict(mode="batch 8", ratio=1.26), dict(mode="one by one", ratio=0.89)]
    page = _report.render(None, None, {"engine": dict(lines=[], experiment_2048_blocks=dict(num_blocks=2048),
                                                      throughput=throughput)})
    assert "Q4_1" in page and "dequantizes them to fp32" in page and "oneDNN" in page
    # The comparison with transformers is worded from the measured ratios, either way round.
    assert "1.26x transformers' speed (batch 8) and 0.89x transformers' speed (one by one)" in page
    assert "faster" not in page.split("The serving engine on a CPU")[1].split("\n\n")[1]
    # The benchmark's one-layer model has one KV head, chapter 8's two: half the bytes per block.
    assert "is 8.0 MiB here and 16.0 MiB in chapter 8" in page


def test_compile_notes_explain_32_register_rows_and_2_byte_spills():
    def fig(regs, spills):
        return dict(regs=regs, spills=spills, shared=1024, resident=1)

    rows = [dict(name="prefill fp32 d128", kind="prefill", dtype="fp32", head_dim=128,
                 sm_90=fig(32, 14_000), sm_80=fig(200, 0)),
            dict(name="decode fp32 d256", kind="decode", dtype="fp32", head_dim=256,
                 sm_90=fig(180, 0), sm_80=fig(150, 0)),
            dict(name="prefill bf16 d256", kind="prefill", dtype="bf16", head_dim=256,
                 sm_90=fig(200, 0), sm_80=fig(255, 64))]
    notes = "\n".join(_report._compile_notes(dict(rows=rows)))
    assert "1 fp32 rows on sm_90 and 0 on sm_80 report 32 registers with 14,000-14,000 B" in notes
    assert "use 150-200" in notes
    assert "fp16 and bf16 prefill at head_dim 256 spill 64-64 B on sm_80 (1 rows)" in notes
    assert _report._compile_notes(dict(rows=rows[1:2])) == []


def test_the_prediction_table_shows_the_measurement_beside_the_range():
    model = dict(constants=dict(device=dict(name="H200", sms=132, clock_ghz=1.98, bandwidth_gbs=4800.0),
                                bandwidth_share=[0.92, 0.7], issue_per_cycle=[4, 2], tensor_tflops=[989.0, 600.0],
                                hbm_latency_us=[0.5, 0.8], launch_us=[1.0, 3.0]),
                 rows=[dict(name="decode 64x4096", grid=[64, 8, 1], programs=512, capacity=792, num_splits=1,
                            bound="bandwidth", predicted_us=[120.0, 160.0]),
                       dict(name="prefill 4x2048", grid=[256, 8, 1], programs=2048, capacity=132,
                            num_splits=1, bound="tensor", predicted_us=[300.0, 500.0])])
    pending = _report.render(None, perf_model=model)
    assert "| decode 64x4096 | (64, 8, 1) | 512 / 792 | 1 | bandwidth | 120.0 - 160.0 | pending |" in pending
    row = dict(name="decode 64x4096", block_size=16, num_splits=1, kernel_ms=0.15, gbps=3500.0, pct_peak=0.73,
               tflops=1.0, sdpa_ms=0.45, sdpa_backend="flash_attention", time_vs_sdpa=1.11)
    page = _report.render({"attention": dict(device="GPU X", summary="s", copy_ceiling_gbps=4000.0,
                                             peak_gbps=4800.0, rows=[row], split_speedup=2.5)},
                          perf_model=model)
    assert "| 120.0 - 160.0 | 150.0 (inside) |" in page
    assert "| 300.0 - 500.0 | pending |" in page
