"""Chapter 8 prints the scheduler from its source: every part is valid Python, fits the column, holds its lines."""

from __future__ import annotations

import ast

import pytest

from pagedkv.views.kernel_source import fit_to_column
from pagedkv.views.scheduler_source import SCHEDULER_PARTS, scheduler_part

# A line each part must show, as the chapter's annotations quote it.
KEY_LINES = {
    "schedule": "if not out.preempted_req_ids:",
    "running": "new_blocks = self.allocate_with_preemption(self, request,",
    "preempt_last_running": "victim = scheduler.running[-1]",
    "preempt": "self.waiting.appendleft(victim)",
    "waiting": "manager.record_prefix_cache_stats(request, num_hit)",
    "whole_prompt_fits": "needed += sum(1 for b in hit_blocks if b.ref_cnt == 0)",
    "output": "preempted_req_ids: list[str] = field(default_factory=list)",
}


@pytest.mark.parametrize("name", SCHEDULER_PARTS)
def test_each_part_is_python_that_fits_the_column(name):
    text = scheduler_part(name)
    ast.parse(text)
    assert max(map(len, text.splitlines())) <= 79
    assert KEY_LINES[name] in [line.strip() for line in text.splitlines()]
    assert '"""' not in text  # the docstring is left out: the chapter explains it


def test_a_part_is_read_from_the_code_that_runs():
    text = scheduler_part("schedule")
    assert text.startswith("def schedule(self) -> SchedulerOutput:")
    assert "self._schedule_running(out)" in text and "self._schedule_waiting(out)" in text
    assert scheduler_part("output").startswith("@dataclass\nclass SchedulerOutput:\n    step: int")


def test_an_unknown_part_is_refused_by_name():
    with pytest.raises(ValueError, match="schedule, running"):
        scheduler_part("admission")


def test_fit_to_column_never_breaks_inside_a_string():
    line = '        raise ValueError(f"a message, with a comma, that is far too long for one line {x!r}")'
    with pytest.raises(ValueError, match="cannot fit"):
        fit_to_column(line)  # its only commas are in the string: refused, never cut there
    assert fit_to_column("    f(alpha, beta)", 79) == "    f(alpha, beta)"
