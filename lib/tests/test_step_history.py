"""StepHistory (a step listener) and kv_usage_figure on a small preempting engine."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from pagedkv.engine import EngineArgs, LLMEngine  # noqa: E402
from pagedkv.engine.args import vllm_default_limits  # noqa: E402
from pagedkv.engine.stats import StepHistory  # noqa: E402
from pagedkv.views.figures import kv_usage_figure  # noqa: E402
from pagedkv.model import Model, ModelConfig  # noqa: E402


@pytest.fixture(scope="module")
def run():
    model = Model(ModelConfig.preset("tiny"), seed=0)
    engine = LLMEngine(EngineArgs(block_size=4, num_gpu_blocks_override=12, max_model_len=32,
                                  watermark=0.0, kernel_backend="torch"), model)
    history = StepHistory().attach(engine)
    for i in range(4):
        engine.add_request(f"R{i}", list(range(10 * i, 10 * i + 6)), max_tokens=16, ignore_eos=True)
    while engine.has_unfinished_requests():
        engine.step()
    return engine, history


def test_history_matches_the_engine(run):
    engine, history = run
    assert history.steps == list(range(1, engine.stats().step + 1))
    assert history.num_preemptions == engine.stats().num_preemptions > 0
    step, rid = history.first("preempted")
    resumed = history.first("resumed")
    assert resumed is not None and resumed[0] > step
    assert 0 < history.peak_usage <= 1 and history.usage[-1] == 0.0
    assert all(r.num_running <= 4 for r in history.records)


def test_history_detaches_and_caps():
    with pytest.raises(ValueError, match="max_steps"):
        StepHistory(max_steps=0)
    with pytest.raises(TypeError, match="max_steps"):
        StepHistory(max_steps=2.0)
    with pytest.raises(ValueError, match="kind"):
        StepHistory().first("finished")


def test_kv_usage_figure_marks_first_preemption(run):
    _, history = run
    fig = kv_usage_figure([history, history], labels=["a", "b"])
    texts = [t.get_text() for t in fig.axes[0].texts]
    step, rid = history.first("preempted")
    assert f"preempted {rid} (step {step})" in texts
    with pytest.raises(ValueError, match="labels"):
        kv_usage_figure(history, labels=["a", "b"])


def test_kv_usage_figure_keeps_its_key_outside_the_axes(run):
    _, history = run
    fig = kv_usage_figure([history] * 7, labels=[f"{n} requests" for n in range(2, 9)])
    fig.savefig(io.BytesIO(), format="png")  # lays the figure out, as the notebook's display does
    ax = fig.axes[0]
    key, plot = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert key.x0 >= plot.x1, (key, plot)  # right of the axes: it hides no line
    assert key.x1 <= fig.bbox.x1 + 0.5  # and still inside the figure


def test_kv_usage_figure_marks_every_event_with_all(run):
    _, history = run
    fig = kv_usage_figure(history, mark="all")
    lines = {line.get_label(): line for line in fig.axes[0].lines}
    preempted = [s for s, kind, _ in history.events() if kind == "preempted"]
    resumed = [s for s, kind, _ in history.events() if kind == "resumed"]
    assert list(lines[f"preempted ({len(preempted)})"].get_xdata()) == preempted
    assert list(lines[f"resumed ({len(resumed)})"].get_xdata()) == resumed
    with pytest.raises(ValueError, match="mark"):
        kv_usage_figure(history, mark="some")


def test_vllm_default_limits():
    assert vllm_default_limits("LLM") == (256, 8192)
    assert vllm_default_limits("serve") == (256, 2048)
    assert vllm_default_limits("serve", "H100/H200") == (1024, 8192)
    with pytest.raises(ValueError, match="entry"):
        vllm_default_limits("server")
