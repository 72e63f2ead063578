"""Chapter 1's calculator: the static rendering carries the plan, the widget redraws on change."""

import importlib.util

import matplotlib

matplotlib.use("Agg")

import pytest

from pagedkv import budget
from pagedkv.calculator import BudgetCalculator, budget_parts, plan_html, plot_budget

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


@needs_widgets
def test_widget_redraws_on_change_and_offers_a_static_rendering():
    calc = BudgetCalculator(weight_gib=14.96)
    assert "26,785" in calc.out.value
    calc.block.value = 32
    assert "blocks of 32" in calc.out.value and "13,392" in calc.out.value
    bundle = calc._repr_mimebundle_()
    assert "blocks of 32" in bundle["text/html"]
    assert "application/vnd.jupyter.widget-view+json" in bundle


@needs_widgets
def test_a_configuration_that_does_not_fit_is_explained_not_raised():
    calc = BudgetCalculator(gpu="L4", model="Llama-3-70B")
    assert "does not fit" in calc.out.value and "no memory left for the KV cache" in calc.out.value
