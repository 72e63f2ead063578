"""Chapter 1's calculator: the static rendering carries the plan, the widget redraws on change."""

import importlib.util

import matplotlib

matplotlib.use("Agg")

import pytest

from pagedkv import budget
from pagedkv.views.calculator import (BudgetCalculator, budget_parts, fmt_fraction, plan_html,
                                plot_budget, startup_error)

needs_widgets = pytest.mark.skipif(importlib.util.find_spec("ipywidgets") is None,
                                   reason="the live calculator needs ipywidgets")


def test_parts_sum_to_the_card():
    p = budget.plan(weight_gib=14.96)
    assert sum(budget_parts(p).values()) == pytest.approx(p.total_bytes / budget.GiB)


def test_static_html_holds_the_table_and_an_inline_figure():
    html = plan_html(budget.plan(weight_gib=14.96))
    assert "52.32 GiB" in html and "26,785" in html and "428,560" in html and ">13<" in html and "686" in html
    assert "data:image/png;base64," in html and "<script" not in html and "http" not in html


def test_figure_has_labelled_parts():
    fig = plot_budget(budget.plan(weight_gib=14.96))
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels[2] == "KV pool: 52.32 GiB" and fig.axes[0].get_xlabel() == "GiB of GPU memory"


def _overlap(a, b):
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_figure_fits_the_column_and_nothing_overlaps():
    fig = plot_budget(budget.plan(weight_gib=14.96, tensor_parallel_size=1))
    assert fig.get_size_inches()[0] * 100 <= 688  # the inline backend draws at 100 dpi
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    ax = fig.axes[0]
    legend, xlabel, title = (ax.get_legend().get_window_extent(r), ax.xaxis.label.get_window_extent(r),
                             ax.title.get_window_extent(r))
    assert not _overlap(legend, xlabel) and not _overlap(legend, title)
    assert not _overlap(legend, ax.get_window_extent(r))
    fig_box = fig.bbox
    for box in (legend, xlabel, title):
        assert box.x0 >= 0 and box.x1 <= fig_box.x1 and box.y0 >= 0 and box.y1 <= fig_box.y1


def test_numbers_are_formatted_for_people():
    assert fmt_fraction(0.5 + 0.42) == "0.92" and fmt_fraction(0.9) == "0.9"
    p = budget.plan(weight_gib=14.96, gpu_memory_utilization=0.5 + 0.42)
    html = plan_html(p, with_figure=False)
    assert "0.9199999" not in html and "gpu_memory_utilization 0.92" in html
    assert "0.9199999" not in plot_budget(p).axes[0].get_title()


def test_startup_check_is_applied_and_shown_in_red():
    assert startup_error(budget.plan(weight_gib=14.96)) is None
    ok = plan_html(budget.plan(weight_gib=14.96), with_figure=False)
    assert "b00020" not in ok and "fits" in ok
    # 4 GiB of pool: max_model_len 32768 (4 GiB) fits, 131072 does not.
    small = budget.plan(model="Llama-3.1-8B", weight_gib=14.96, non_kv_gib=54.3, max_model_len=131_072)
    msg = startup_error(small)
    assert msg is not None and "(131072)" in msg and "(16.0 GiB KV cache is needed" in msg
    html = plan_html(small, with_figure=False)
    assert "color:#b00020" in html and "vLLM would refuse to start" in html and "16.0 GiB" in html


def test_tensor_parallel_plans_check_one_rank():
    # Llama-3.1-70B: two H100s leave 1.57 GiB per rank, too little for 32,768 tokens
    # at 160 KiB/token/rank (5 GiB); four leave 34.42 GiB at 80 KiB/token/rank.
    two = budget.plan(model="Llama-3.1-70B", tensor_parallel_size=2)
    assert "(5.0 GiB KV cache is needed" in startup_error(two)
    four = budget.plan(model="Llama-3.1-70B", tensor_parallel_size=4)
    assert startup_error(four) is None
    html = plan_html(four, with_figure=False)
    assert "tensor_parallel_size 4" in html and "KV pool per GPU" in html and "34.42 GiB" in html
    # Replicated heads (16 ranks, 8 KV heads) cost each rank one head's KV.
    assert startup_error(budget.plan(gpu="H200", model="Llama-3.1-70B", tensor_parallel_size=16)) is None


@needs_widgets
def test_widget_redraws_on_change_and_offers_a_static_rendering():
    pytest.importorskip("ipywidgets")  # a bare GPU machine has no Jupyter
    calc = BudgetCalculator(weight_gib=14.96)
    assert "26,785" in calc.out.value
    calc.block.value = 32
    assert "blocks of 32" in calc.out.value and "13,392" in calc.out.value
    bundle = calc._repr_mimebundle_()
    assert "blocks of 32" in bundle["text/html"]
    assert "application/vnd.jupyter.widget-view+json" in bundle


@needs_widgets
def test_a_configuration_that_does_not_fit_is_explained_not_raised():
    pytest.importorskip("ipywidgets")  # a bare GPU machine has no Jupyter
    calc = BudgetCalculator(gpu="L4", model="Llama-3.1-70B")
    assert "does not fit" in calc.out.value and "no memory left for the KV cache" in calc.out.value
    assert "L4 · Llama-3.1-70B" in calc.out.value


@needs_widgets
def test_widget_tensor_parallel_control_makes_70b_fit():
    pytest.importorskip("ipywidgets")  # a bare GPU machine has no Jupyter
    calc = BudgetCalculator(model="Llama-3.1-70B")
    assert "no memory left for the KV cache" in calc.out.value
    calc.tp.value = 2
    assert "vLLM would refuse to start" in calc.out.value
    calc.tp.value = 4
    assert "b00020" not in calc.out.value and "34.42 GiB" in calc.out.value
    calc.tp.value = 8
    assert "tensor_parallel_size 8" in calc._repr_mimebundle_()["text/html"]


@needs_widgets
def test_widget_labels_are_not_cut_off_and_values_are_rounded():
    pytest.importorskip("ipywidgets")  # a bare GPU machine has no Jupyter
    calc = BudgetCalculator(weight_gib=14.96)
    assert calc.util.description == "gpu_memory_utilization"
    assert int(calc.util.style.description_width.rstrip("px")) >= 170
    calc.util.value = 0.5 + 0.42
    assert "0.9199999" not in calc.out.value


def test_a_max_model_len_beyond_the_context_is_vllms_first_refusal():
    # Llama-3-8B stops at 8,192 tokens: vLLM refuses 32,768 before it sizes any pool.
    msg = startup_error(budget.plan(model="Llama-3-8B", weight_gib=14.96))
    assert msg.startswith("User-specified max_model_len (32768) is greater than the derived max_model_len")
    assert startup_error(budget.plan(model="Llama-3.1-8B", weight_gib=14.96)) is None


# ------------------------------------------------- one's own numbers (issue 39)

QWEN_LIKE = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
             "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "vocab_size": 152064, "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}


def test_a_plan_from_a_config_json_is_checked_as_its_own_model():
    p = budget.plan(model=budget.model_spec_from_config(QWEN_LIKE, "my-qwen"), weight_gib=14.2,
                    max_model_len=32_768)
    assert startup_error(p) is None
    assert "my-qwen" in plan_html(p, with_figure=False)
    long = budget.plan(model=budget.model_spec_from_config(QWEN_LIKE, "my-qwen"), max_model_len=65_536)
    assert startup_error(long).startswith("User-specified max_model_len (65536)")


@needs_widgets
def test_widget_takes_custom_numbers():
    pytest.importorskip("ipywidgets")
    calc = BudgetCalculator(gpu=95_830, model=QWEN_LIKE, non_kv_gib=4.37, weight_gib=14.2)
    p = calc.current_plan()
    assert calc.gpu.value == "custom" and p.total_bytes == 95_830 * budget.MiB
    assert p.non_kv_bytes == pytest.approx(4.37 * budget.GiB) and p.weight_bytes == pytest.approx(14.2 * budget.GiB)
    assert calc.model.value == "qwen2" and "a 95,830-MiB GPU" in calc.out.value
    assert "non-KV 4.37 GiB" in calc.out.value
    # Picking a preset fills its memory; typing another number selects "custom" again.
    calc.gpu.value = "H200"
    assert calc.gpu_mib.value == 143_771 and calc.current_plan().total_bytes == 143_771 * budget.MiB
    calc.gpu_mib.value = 81_000
    assert calc.gpu.value == "custom" and calc.current_plan().total_bytes == 81_000 * budget.MiB
    calc.non_kv.value = 7.5
    assert "non-KV 7.5 GiB" in calc.out.value
    # The memory as nvidia-smi prints it, and a preset by name, both work too.
    by_text = BudgetCalculator(gpu="95830 MiB")
    assert by_text.gpu.value == "custom" and by_text.gpu_mib.value == 95_830
    assert BudgetCalculator(gpu="L40S").gpu_mib.value == 46_068
    calc.max_len.value = 20_000  # any number, not only powers of two
    assert "max_model_len 20,000" in calc.out.value
