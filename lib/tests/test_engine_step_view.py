"""The map of one engine step (pagedkv.views.engine_step): every value drawn is the engine's."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

from pagedkv.engine import EngineArgs, LLMEngine
from pagedkv.model import Model, ModelConfig
from pagedkv.views import StepTrace, render_async_overlap, render_engine_step
from pagedkv.views.engine_step import STAGE_CHAPTERS, stage_links

REPO = Path(__file__).resolve().parents[2]
BLOCK = 4


@pytest.fixture(scope="module")
def model():
    return Model(ModelConfig.preset("tiny"), seed=0)


def run(model, async_scheduling=True, attach=True):
    """A decodes; B arrives at the fourth call and is admitted while A runs.

    Returns (engine, trace, seen); ``engine.final`` holds each request's finished token ids.
    """
    args = EngineArgs(block_size=BLOCK, num_gpu_blocks_override=16, max_model_len=40,
                      max_num_batched_tokens=64, max_num_seqs=4, async_scheduling=async_scheduling)
    engine = LLMEngine(args, model)
    trace = StepTrace().attach(engine) if attach else None
    seen = {}  # an independent listener: what the manager and the worker hold after each step

    def keep(eng, out, outputs):
        seen[out.step] = ({r: eng.kv_cache_manager.get_block_ids(r) for r in out.num_scheduled_tokens
                           if r in eng.kv_cache_manager.req_to_blocks},
                          dict(eng.worker.req_states.req_id_to_index), list(eng.worker.last_idx_mapping))

    engine.add_step_listener(keep)
    engine.final = {}

    def step():
        engine.final.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)

    engine.add_request("A", list(range(10, 17)), max_tokens=6, ignore_eos=True)
    for i in range(3):
        step()
    engine.add_request("B", list(range(30, 39)), max_tokens=3, ignore_eos=True)
    while engine.has_unfinished_requests():
        step()
    step()
    return engine, trace, seen


def test_the_recorded_values_are_the_engines(model):
    engine, trace, seen = run(model)
    rec = trace.step_of("B")
    blocks, rows, idx = seen[rec.step]
    assert rec.running == ["A"] and rec.new == ["B"]  # running first, then waiting
    assert rec.block_ids["B"] == blocks["B"] and rec.new_block_ids["B"] == blocks["B"]
    assert rec.allocated == blocks["B"]  # what the pool handed out while the step was scheduled
    assert rec.free_before - rec.free_after == len(blocks["B"])
    assert rec.rows == rows and rec.idx_mapping == idx == [rows[r] for r in rec.req_ids]
    assert rec.req_ids == ["A", "B"]  # the decode first (sort_batch_req_ids)
    i = rec.batch_index("B")
    assert rec.gathered[i] == blocks["B"]
    # The slot of position p is block[p // B] * B + p % B, from the manager's blocks (an independent oracle).
    start, n = rec.num_computed_tokens["B"], rec.num_scheduled_tokens["B"]
    assert rec.slots_of("B") == [blocks["B"][p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]


def test_the_sampled_tokens_are_the_requests_outputs(model):
    engine, trace, _ = run(model)
    reference, _, _ = run(model, attach=False)
    assert engine.final == reference.final  # recording changes nothing the engine does
    for rid in ("A", "B"):
        sampled = [trace.steps[s].sampled[rid] for s in sorted(trace.steps) if rid in trace.steps[s].sampled]
        assert sampled == list(engine.final[rid])


def test_the_picture_draws_the_traced_values(model):
    engine, trace, _ = run(model)
    rec = trace.step_of("B")
    svg = render_engine_step(trace, "B", title="B's first step")
    assert f"step {rec.step}" in svg
    assert f"B -&gt; row {rec.rows['B']}" in svg and f"A -&gt; row {rec.rows['A']}" in svg
    assert f"idx_mapping {rec.idx_mapping}" in svg
    ids = "[" + ", ".join(map(str, rec.block_ids["B"])) + "]"
    assert f"B holds {ids}" in svg and f"entry 1: {ids}" in svg
    assert f"B: token {rec.sampled['B']}" in svg
    assert f"{trace.num_blocks} blocks of {BLOCK} tokens" in svg
    # The slots split where a block ends: a request's slots are contiguous only within a block.
    start, n = rec.num_computed_tokens["B"], rec.num_scheduled_tokens["B"]
    runs = {}
    for p, slot in zip(range(start, start + n), rec.slots_of("B")):
        runs.setdefault(p // BLOCK, []).append(slot)
    split = " | ".join(f"{r[0]}..{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs.values())
    assert len(runs) > 1 and f"B: {split}" in svg and f"slots {split}" in svg
    # The running request's blocks beside the new one's, and why the pool had that many free.
    held = "[" + ", ".join(map(str, rec.block_ids["A"])) + "]"
    assert f"A holds {held} | B holds {ids}" in svg
    assert rec.free_before == trace.num_blocks - 1 - len(rec.block_ids["A"])
    assert html.escape(f"({trace.num_blocks} less the null block and A's {len(rec.block_ids['A'])} = "
                       f"{rec.free_before})") in svg
    assert "B took the last free row" in svg and rec.rows["B"] < rec.rows["A"]
    assert "(not every step)" in svg
    # The allocate box's chapters in reading order, left to right.
    chips = re.findall(r"aria-label='allocate_slots[^:]*: (ch\. \d)' [^>]*><rect x='([\d.-]+)'", svg)
    assert [c for c, _ in sorted(chips, key=lambda c: float(c[1]))] == ["ch. 2", "ch. 3", "ch. 6", "ch. 9"], chips


def test_every_link_points_at_a_chapter_page(model):
    _, trace, _ = run(model)
    svg = render_engine_step(trace, "B") + render_async_overlap(trace, trace.step_of("B").step)
    hrefs = set(re.findall(r"href='([^']+)'", svg))
    assert hrefs
    for href in hrefs:
        assert re.fullmatch(r"\d\d_\w+\.html", href), href
        assert (REPO / "chapters" / href.replace(".html", ".ipynb")).is_file(), href
    # Every chapter of the book is some stage's.
    stems = {p.stem for p in (REPO / "chapters").glob("[0-9][1-9]_*.ipynb")}
    assert stems == {s for v in STAGE_CHAPTERS.values() for s in v}
    assert stage_links(lambda s: f"../x/{s}")["slots"] == [("ch. 5", "../x/05_slot_mapping")]


def test_the_pictures_scale_to_the_column(model):
    _, trace, _ = run(model)
    for svg in (render_engine_step(trace, "B"), render_async_overlap(trace, trace.step_of("B").step)):
        m = re.search(r"<svg [^>]*width='(\d+)' height='([\d.]+)' viewBox='0 0 (\d+) ([\d.]+)'", svg)
        assert m, svg[:200]
        assert int(m.group(1)) <= 688 and m.group(1) == m.group(3)
        assert "max-width:100%" in svg
        sizes = [float(s) for s in re.findall(r"font-size='([\d.]+)'", svg)]
        assert min(sizes) >= 11  # 10 px or more at the 620-px minimum width on a phone


def test_async_scheduling_overlaps_the_next_schedule_with_this_forward(model):
    _, trace, _ = run(model, async_scheduling=True)
    n = trace.step_of("B").step
    order = trace.order(n, n + 1)
    # Step n+1 is scheduled after step n was launched and before step n's output is applied.
    assert order.index(("execute", n)) < order.index(("schedule", n + 1)) < order.index(("update", n))
    assert trace.steps[n].placeholders == {"A": 1}  # A's previous token was not sampled yet
    window = trace.window(n)
    assert window[0] == ("schedule", n) and window[-1] == ("update", n + 1)
    assert window.index(("schedule", n + 2)) < window.index(("update", n + 1))
    svg = render_async_overlap(trace, n)
    assert f"in vLLM, schedule {n + 1} overlaps forward {n}" in svg
    # The legend and the caption: the picture does not claim the book's engine overlaps.
    for n_ in (n, n + 1, n + 2):
        assert f">step {n_}</text>" in svg
    assert "one colour per step" in svg and "thick outline: a schedule" in svg and "dashed: a forward" in svg
    text = html.unescape(" ".join(re.findall(r">([^<]*)</text>", svg)))
    assert "the GPU computes forward N while the CPU schedules N+1" in text
    assert "The book's engine runs the same stages one after the other" in text
    assert "runs inside" not in svg
    with pytest.raises(ValueError, match="not both"):
        trace.window(999)

    _, sync, _ = run(model, async_scheduling=False)
    m = sync.step_of("B").step
    order = sync.order(m, m + 1)
    assert order.index(("update", m)) < order.index(("schedule", m + 1))
    assert sync.steps[m].placeholders == {"A": 0}
    sync_svg = render_async_overlap(sync, m)
    assert "overlaps forward" not in sync_svg and "thick outline" not in sync_svg


def test_detach_leaves_the_engine_as_it_was(model):
    engine, trace, _ = run(model)
    before = len(trace.events)
    trace.detach()
    for obj in (engine.scheduler, engine.worker):
        assert not {"schedule", "execute_model", "update_from_output"} & set(vars(obj))
    engine.add_request("C", [5, 6, 7], max_tokens=2, ignore_eos=True)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(trace.events) == before


def test_bad_input_is_refused(model):
    _, trace, _ = run(model)
    with pytest.raises(TypeError, match="StepTrace"):
        render_engine_step(object(), "B")
    with pytest.raises(ValueError, match="'Z'"):
        render_engine_step(trace, "Z")
    with pytest.raises(ValueError, match="step 999"):
        render_engine_step(trace, "B", step=999)
    with pytest.raises(ValueError, match="not in step"):
        render_engine_step(trace, "B", step=1)
    with pytest.raises(ValueError, match="already attached"):
        trace.attach(trace.engine)
    with pytest.raises(TypeError, match="LLMEngine"):
        StepTrace().attach(object())
