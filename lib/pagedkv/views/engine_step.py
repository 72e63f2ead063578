"""One engine step, whole: a live trace of every stage, drawn as the map of the book.

``StepTrace`` watches an ``LLMEngine`` and keeps, for every step, what each
stage of the step decided, with the engine's own values:

- the scheduler's ``SchedulerOutput`` (who ran, in which order, how many
  tokens, which blocks), and the block pool's events while it scheduled
  (which blocks ``allocate_slots`` took from the free queue, free blocks
  before and after);
- the worker's side of the same step (Model Runner V2): each request's row,
  the step's ``idx_mapping``, the gathered table, the slot mapping, and the
  tokens the sampler drew;
- ``update_from_output``: the tokens applied, and the text each one
  detokenizes to;
- the order the engine ran the stages in (``events``): with async
  scheduling, step N+1 is scheduled before step N's output is applied.

It attaches through the engine's public surface only: a step listener, a
block-pool subscription, and thin wrappers, set on the engine's own
``scheduler`` and ``worker`` instances, around the three public calls a step
makes (``schedule``, ``execute_model``, ``update_from_output``). They record
and pass every argument and result through unchanged; ``detach()`` removes
them. The engine knows nothing of it.

``render_engine_step`` draws one request through one step as an SVG (a
``viewBox``, scaled to the column), each stage a box with the trace's values
and a link to the chapter that builds it; ``render_async_overlap`` draws the
engine's event order on a time axis.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Callable, Sequence

from .style import MONO_FONT, escape, fit, owner_color

__all__ = ["StepTrace", "StepRecord", "STAGE_CHAPTERS", "render_engine_step", "render_async_overlap",
           "stage_links"]

#: Each stage of a step, the chapter that builds it (the notebook's stem under ``chapters/``).
STAGE_CHAPTERS: dict[str, tuple[str, ...]] = {
    "startup": ("01_memory_budget",),
    "api": ("08_serving_engine",),
    "schedule": ("08_serving_engine",),
    "allocate": ("02_fragmentation", "03_block_pool", "06_copy_on_write", "09_kv_cache_groups"),
    "scheduler_output": ("08_serving_engine",),
    "rows": ("04_block_table",),
    "gather": ("04_block_table",),
    "slots": ("05_slot_mapping",),
    "kv_write": ("05_slot_mapping",),
    "attention": ("07_paged_attention",),
    "sample": ("08_serving_engine",),
    "update": ("08_serving_engine",),
    "detokenize": ("08_serving_engine",),
}


@dataclasses.dataclass
class StepRecord:
    """What one step did, stage by stage (filled as the stages run).

    Attributes:
        step: the step's number (``SchedulerOutput.step``).
        running, new, resumed: request ids, as the scheduler took them
            (running requests first, then the ones it admitted).
        num_scheduled_tokens, num_computed_tokens, num_prefix_hit_tokens,
        new_block_ids: the ``SchedulerOutput``'s maps.
        allocated: block ids the pool handed out while this step was
            scheduled, in order.
        free_before, free_after: free blocks when ``schedule()`` began and
            ended.
        block_ids: request id -> its blocks in the ``KVCacheManager`` right
            after ``schedule()``.
        rows: request id -> its worker row, after the step's rows were updated.
        req_ids, idx_mapping: the worker's batch order and each entry's row.
        gathered: batch entry -> the gathered table's live columns.
        slot_mapping: one slot per scheduled token, in batch order.
        query_start_loc: where each batch entry's tokens start in it.
        sampled: request id -> the token the sampler drew this step.
        texts: request id -> ``(the token's text, the whole output's text)``,
            once ``update_from_output`` applied it.
        prompt_lens: request id -> prompt tokens.
        placeholders: running request id -> its tokens scheduled but not yet
            sampled when ``schedule()`` began (async scheduling's output
            placeholders; 0 without it).
    """

    step: int
    running: list[str] = dataclasses.field(default_factory=list)
    new: list[str] = dataclasses.field(default_factory=list)
    resumed: list[str] = dataclasses.field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    num_computed_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    num_prefix_hit_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    allocated: list[int] = dataclasses.field(default_factory=list)
    free_before: int | None = None
    free_after: int | None = None
    block_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    rows: dict[str, int] = dataclasses.field(default_factory=dict)
    req_ids: list[str] = dataclasses.field(default_factory=list)
    idx_mapping: list[int] = dataclasses.field(default_factory=list)
    gathered: list[list[int]] = dataclasses.field(default_factory=list)
    slot_mapping: list[int] = dataclasses.field(default_factory=list)
    query_start_loc: list[int] = dataclasses.field(default_factory=list)
    sampled: dict[str, int] = dataclasses.field(default_factory=dict)
    texts: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    prompt_lens: dict[str, int] = dataclasses.field(default_factory=dict)
    placeholders: dict[str, int] = dataclasses.field(default_factory=dict)

    def batch_index(self, request_id: str) -> int:
        """The request's entry in the worker's batch (``ValueError`` if it did not run)."""
        if request_id not in self.req_ids:
            raise ValueError(f"request {request_id!r} is not in step {self.step}'s batch {self.req_ids}")
        return self.req_ids.index(request_id)

    def slots_of(self, request_id: str) -> list[int]:
        """The slots of the request's tokens this step."""
        i = self.batch_index(request_id)
        return self.slot_mapping[self.query_start_loc[i]:self.query_start_loc[i + 1]]


class StepTrace:
    """Records every step of an engine, stage by stage; ``attach(engine)`` then step it.

    ``steps`` maps step number -> ``StepRecord``; ``events`` lists
    ``(stage, step)`` in the order the engine ran them, stage one of
    ``"schedule"``, ``"execute"``, ``"update"``.
    """

    def __init__(self) -> None:
        self.steps: dict[int, StepRecord] = {}
        self.events: list[tuple[str, int]] = []
        self.engine = None
        self.async_scheduling: bool | None = None
        self.num_blocks: int | None = None
        self.block_size: int | None = None
        self._undo: list[Callable[[], None]] = []
        self._scheduling: StepRecord | None = None

    # ------------------------------------------------------------ attaching
    def attach(self, engine) -> "StepTrace":
        """Start recording ``engine`` (a ``pagedkv.engine.LLMEngine``); returns self."""
        for attr in ("scheduler", "worker", "kv_cache_manager", "add_step_listener"):
            if not hasattr(engine, attr):
                raise TypeError(f"engine must be a pagedkv.engine.LLMEngine (it lacks .{attr}), "
                                f"got {type(engine).__name__}")
        if self.engine is not None:
            raise ValueError("this StepTrace is already attached; detach() it first")
        self.engine = engine
        self.async_scheduling = bool(getattr(engine.args, "async_scheduling", False))
        self.num_blocks = int(engine.pool.num_blocks)
        self.block_size = int(engine.args.block_size)
        self._wrap(engine.scheduler, "schedule", self._on_schedule)
        self._wrap(engine.worker, "execute_model", self._on_execute)
        self._wrap(engine.scheduler, "update_from_output", self._on_update)
        pool = engine.kv_cache_manager.block_pool
        pool.subscribe(self._on_pool)
        self._undo.append(lambda: pool.unsubscribe(self._on_pool))
        self._undo.append(engine.add_step_listener(self._on_step))
        return self

    def detach(self) -> None:
        """Stop recording; the engine is exactly as it was before ``attach``."""
        while self._undo:
            self._undo.pop()()
        self.engine = None

    def _wrap(self, obj, name: str, after: Callable[..., None]) -> None:
        original = getattr(obj, name)

        def wrapper(*args, **kwargs):
            if name == "schedule":
                self._before_schedule()
            result = original(*args, **kwargs)
            after(result, *args, **kwargs)
            return result

        setattr(obj, name, wrapper)
        self._undo.append(lambda: delattr(obj, name) if name in vars(obj) else None)

    # ------------------------------------------------------------- stages
    def _before_schedule(self) -> None:
        self._free_at_start = self.engine.kv_cache_manager.get_num_free_blocks()
        self._allocated: list[int] = []
        self._scheduling = True
        self._placeholders = {r.request_id: int(getattr(r, "num_output_placeholders", 0))
                              for r in self.engine.scheduler.running}

    def _on_pool(self, pool, event) -> None:
        if self._scheduling and event.kind == "allocate":
            self._allocated.extend(int(b) for b in event.block_ids)

    def _on_schedule(self, out, *args, **kwargs) -> None:
        self._scheduling = False
        engine = self.engine
        manager = engine.kv_cache_manager
        record = StepRecord(
            out.step, list(out.scheduled_running_reqs), list(out.scheduled_new_reqs),
            list(out.scheduled_resumed_reqs), dict(out.num_scheduled_tokens), dict(out.num_computed_tokens),
            dict(out.num_prefix_hit_tokens), {r: list(b) for r, b in out.new_block_ids.items()},
            list(self._allocated), self._free_at_start, manager.get_num_free_blocks())
        record.placeholders = {r: n for r, n in self._placeholders.items() if r in out.num_scheduled_tokens}
        for rid in out.num_scheduled_tokens:
            record.block_ids[rid] = list(manager.get_block_ids(rid))
            request = engine.scheduler.requests.get(rid)
            if request is not None:
                record.prompt_lens[rid] = request.num_prompt_tokens
        self.steps[out.step] = record
        self.events.append(("schedule", out.step))

    def _on_execute(self, result, out, *args, **kwargs) -> None:
        self.events.append(("execute", out.step))
        record = self.steps.get(out.step)
        worker = self.engine.worker
        if record is None or out.total_num_scheduled_tokens == 0 or worker.last_metadata is None:
            return
        meta = worker.last_metadata
        record.rows = dict(worker.req_states.req_id_to_index)
        record.req_ids = list(worker.last_req_ids)
        record.idx_mapping = [int(r) for r in worker.last_idx_mapping]
        record.query_start_loc = [int(x) for x in meta.query_start_loc.cpu().tolist()]
        record.slot_mapping = [int(x) for x in meta.slot_mapping.cpu().tolist()]
        table = meta.block_table.cpu()
        lengths = worker.block_tables.num_blocks[0]
        record.gathered = [table[i, :int(lengths[r])].tolist() for i, r in enumerate(record.idx_mapping)]
        record.sampled = {r: int(t) for r, t in getattr(result, "sampled_token_ids", {}).items()}

    def _on_update(self, progressed, out, model_runner_output, *args, **kwargs) -> None:
        self.events.append(("update", out.step))
        record = self.steps.get(out.step)
        tokenizer = getattr(self.engine, "tokenizer", None)
        if record is None or tokenizer is None:
            return
        for request in progressed:
            rid = request.request_id
            if rid in record.sampled:
                token = record.sampled[rid]
                record.texts[rid] = (tokenizer.decode([token], skip_special_tokens=False),
                                     tokenizer.decode(list(request.output_token_ids)))

    def _on_step(self, engine, out, outputs) -> None:
        """The step listener: nothing to add (the stages recorded themselves); kept so views see every step."""

    # ------------------------------------------------------------- reading
    def step_of(self, request_id: str, kind: str = "new") -> StepRecord:
        """The first recorded step in which ``request_id`` was ``kind`` ("new", "running" or "resumed")."""
        if kind not in ("new", "running", "resumed"):
            raise ValueError(f"kind must be 'new', 'running' or 'resumed', got {kind!r}")
        for step in sorted(self.steps):
            if request_id in getattr(self.steps[step], kind):
                return self.steps[step]
        raise ValueError(f"no recorded step has {request_id!r} as {kind}")

    def window(self, step: int) -> list[tuple[str, int]]:
        """Every event from ``schedule(step)`` to the update that applies step ``step + 1``, in order.

        ``ValueError`` unless both were recorded.
        """
        try:
            first = self.events.index(("schedule", step))
            last = self.events.index(("update", step + 1))
        except ValueError:
            raise ValueError(f"steps {step} and {step + 1} were not both scheduled and applied in the trace "
                             f"(recorded: {sorted(self.steps)})") from None
        return self.events[first:last + 1]

    def order(self, first: int, last: int) -> list[tuple[str, int]]:
        """The events of steps ``first..last``, in the order the engine ran them."""
        return [(s, n) for s, n in self.events if first <= n <= last]


# ------------------------------------------------------------------- drawing
_W = 680  # the viewBox's width: the 688-px column less a margin
_PAD = 10
_LINE = 15


def stage_links(href: Callable[[str], str] | None = None) -> dict[str, list[tuple[str, str]]]:
    """Each stage's links: ``[(label, url)]``, ``href(stem)`` giving the url (default ``stem + ".html"``)."""
    href = href or (lambda stem: f"{stem}.html")
    return {stage: [(f"ch. {int(stem[:2])}", href(stem)) for stem in stems]
            for stage, stems in STAGE_CHAPTERS.items()}


def _ids(ids: Sequence[int], n: int = 8) -> str:
    ids = list(ids)
    if len(ids) <= n:
        return "[" + ", ".join(map(str, ids)) + "]"
    return "[" + ", ".join(map(str, ids[:n - 2])) + f", \u2026 {ids[-1]}]"


def _run(slots: Sequence[int], block_size: int | None = None) -> str:
    """Slots as runs: ``32..52`` for consecutive ones; with ``block_size``,
    split where a block ends (``32..47 | 48..52``), joined by ``|``."""
    slots = list(slots)
    if not slots:
        return "[]"
    runs, start = [], slots[0]
    for a, b in zip(slots, slots[1:] + [None]):
        if b != a + 1 or (block_size and b % block_size == 0):
            runs.append(str(start) if a == start else f"{start}..{a}")
            start = b
    return (" | " if block_size else ", ").join(runs)


class _Svg:
    def __init__(self) -> None:
        self.parts: list[str] = []

    def text(self, x, y, s, size=12, weight="normal", anchor="start", color="#212529") -> None:
        self.parts.append(f"<text x='{x:g}' y='{y:g}' font-size='{size}' font-weight='{weight}' "
                          f"text-anchor='{anchor}' fill='{color}' style='{MONO_FONT}'>{escape(s)}</text>")

    def rect(self, x, y, w, h, fill="#ffffff", stroke="#868e96", dash=False, rx=5, width=1.0) -> None:
        d = " stroke-dasharray='5 3'" if dash else ""
        self.parts.append(f"<rect x='{x:g}' y='{y:g}' width='{w:g}' height='{h:g}' rx='{rx}' fill='{fill}' "
                          f"stroke='{stroke}' stroke-width='{width}'{d}/>")

    def arrow(self, x, y0, y1, label="") -> None:
        self.parts.append(f"<path d='M{x:g},{y0:g} L{x:g},{y1 - 6:g}' stroke='#495057' stroke-width='1.5'/>"
                          f"<path d='M{x - 5:g},{y1 - 7:g} L{x + 5:g},{y1 - 7:g} L{x:g},{y1:g} Z' "
                          f"fill='#495057'/>")
        if label:
            self.text(x + 10, (y0 + y1) / 2 + 4, label, 11, color="#495057")

    def link(self, x, y, label, url, stage) -> float:
        """A chapter link drawn as a tag ending at ``x``; returns its left edge."""
        w = 8 * len(label) + 10
        self.parts.append(f"<a href='{escape(url)}' aria-label='{escape(f'{stage}: {label}')}' "
                          f"class='pkv-step-link'><rect x='{x - w:g}' y='{y - 12:g}' width='{w}' height='17' "
                          f"rx='8' fill='#e7f1ff' stroke='#0b5ed7' stroke-width='1'/>")
        self.text(x - w / 2, y + 1, label, 11, "bold", "middle", "#0a58ca")
        self.parts.append("</a>")
        return x - w - 4


def _svg_frame(body: list[str], height: float, label: str) -> str:
    # role='group', not 'img': the picture holds links, and an image may hold nothing a reader can focus.
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{_W}' height='{height:g}' "
            f"viewBox='0 0 {_W} {height:g}' style='max-width:100%;height:auto' role='group' "
            f"aria-label='{escape(label)}'><rect width='{_W}' height='{height:g}' fill='#ffffff'/>"
            + "".join(body) + "</svg>")


def render_engine_step(trace: StepTrace, request_id: str, step: int | None = None, *,
                       prompt_text: str | None = None, href: Callable[[str], str] | None = None,
                       title: str | None = None) -> str:
    """One request through one recorded step, every stage a box with the trace's values and its chapter.

    Args:
        trace: a ``StepTrace`` that recorded the step.
        request_id: the request to follow.
        step: which step (default: the step that admitted the request).
        prompt_text: the prompt as the user wrote it (drawn in the first box).
        href: chapter stem -> url of its page (default ``stem + ".html"``:
            pages beside this one).
        title: a caption above the picture.
    """
    if not isinstance(trace, StepTrace):
        raise TypeError(f"trace must be a StepTrace, got {type(trace).__name__}")
    rec = trace.step_of(request_id) if step is None else trace.steps.get(step)
    if rec is None:
        raise ValueError(f"step {step} was not recorded (recorded: {sorted(trace.steps)})")
    i = rec.batch_index(request_id)
    links = stage_links(href)
    rid = request_id
    kind = "new" if rid in rec.new else "resumed" if rid in rec.resumed else "running"
    start, n = rec.num_computed_tokens[rid], rec.num_scheduled_tokens[rid]
    color = owner_color(rid)

    # Each box: (stage, heading, lines); frames group them by process.
    others_running = [r for r in rec.running if r != rid]
    sched_lines = []
    if rec.running:
        def pending(r):
            k = rec.placeholders.get(r, 0)
            return f"; {k} token{'s' * (k != 1)} not yet sampled" if k else ""

        sched_lines.append("running first: " + ", ".join(
            f"{r} +{rec.num_scheduled_tokens[r]} (position {rec.num_computed_tokens[r]}{pending(r)})"
            for r in rec.running))
    admitted = rec.resumed + rec.new
    if admitted:
        sched_lines.append("then waiting:  " + ", ".join(
            f"{r} admitted, {rec.num_scheduled_tokens[r]} tokens" for r in admitted))
    hit = rec.num_prefix_hit_tokens.get(rid, 0)
    new_ids = rec.new_block_ids.get(rid, [])
    alloc_lines = [f"{rid}: {len(new_ids)} block{'s' * (len(new_ids) != 1)} {_ids(new_ids)}"
                   + (f", {hit} tokens from the prefix cache" if kind != "running" else "")]
    others = [r for r in rec.req_ids if r != rid and r in rec.block_ids]
    alloc_lines.append("after: " + " | ".join(f"{r} holds {_ids(rec.block_ids[r], 6)}"
                                             for r in [*others, rid]))
    held = sum(len(rec.block_ids[r]) - len(rec.new_block_ids.get(r, [])) for r in others)
    why = ""
    if others and trace.num_blocks is not None and rec.free_before == trace.num_blocks - 1 - held:
        why = (f" ({trace.num_blocks} less the null block and {', '.join(others)}'s "
               f"{held} = {rec.free_before})")
    alloc_lines.append(f"free blocks {rec.free_before} -> {rec.free_after}" + why)
    so_lines = ["num_scheduled_tokens " + fit(str(rec.num_scheduled_tokens), 56),
                "new_block_ids " + fit("{" + ", ".join(f"'{r}': {_ids(b, 5)}" for r, b in
                                                       rec.new_block_ids.items() if b) + "}", 62)]
    row = rec.rows[rid]
    rows_lines = [", ".join(f"{r} -> row {rec.rows[r]}" for r in rec.req_ids)
                  + (f"  ({rid} took the last free row now)" if kind != "running" else "")]
    gather_lines = [f"idx_mapping {rec.idx_mapping}: entry {i} <- row {row}",
                    f"entry {i}: {_ids(rec.gathered[i])}"]
    slots = rec.slots_of(rid)
    bs = trace.block_size
    first_block = rec.gathered[i][start // bs] if bs else None
    slot_lines = [f"{rid}: {_run(slots, bs)}"
                  + (f"  (block {first_block} x {bs} + {start % bs} = {slots[0]})" if bs else "")]
    kv_lines = [f"{n} token{'s' * (n != 1)} of {rid}: K and V of every layer into "
                f"slot{'s' * (n != 1)} {_run(slots, bs)}"]
    attn_lines = [(f"{rid}'s {n} queries read up to {start + n} keys (causal)" if n > 1 else
                   f"{rid}'s query reads {start + n} keys") + f" in blocks {_ids(rec.gathered[i], 6)}"]
    token = rec.sampled.get(rid)
    sample_lines = [f"{rid}: token {token}" if token is not None else f"{rid}: no token (prompt not complete)"]
    upd_lines = [f"{rid}: output token {start + n - rec.prompt_lens.get(rid, 0)} is {token}; "
                 f"computed {start + n} of its tokens"] if token is not None else [f"{rid}: nothing to apply"]
    piece, text = rec.texts.get(rid, ("", ""))
    detok_lines = [f"{token} -> {piece!r}; text so far {fit(repr(text), 28)}"] if token is not None else []
    prompt_lines = [f"{fit(repr(prompt_text), 44)} -> " if prompt_text else ""]
    plen = rec.prompt_lens.get(rid)
    prompt_lines[0] += f"{plen} token ids" if plen is not None else ""

    frames = [
        ("API server process", None, [("api", "tokenize, add_request", prompt_lines)]),
        ("EngineCore process", "EngineCoreRequest ->", [
            ("startup", "once, at start-up (not every step): the KV pool", [
                f"{trace.num_blocks} blocks of {trace.block_size} tokens (block 0 is the null block)"]),
            ("schedule", f"Scheduler.schedule(): step {rec.step}", sched_lines),
            ("allocate", "allocate_slots -> coordinator -> BlockPool", alloc_lines),
            ("scheduler_output", "SchedulerOutput -> the worker", so_lines),
            ("worker", "the worker: Model Runner V2", [
                ("rows", "request rows", rows_lines),
                ("gather", "gather the step's block table", gather_lines),
                ("slots", "slot mapping", slot_lines),
                ("kv_write", "KV write", kv_lines),
                ("attention", "paged attention", attn_lines),
                ("sample", "sampler", sample_lines)]),
            ("update", "update_from_output", upd_lines)]),
        ("API server process", "<- EngineCoreOutputs", [("detokenize", "detokenize", detok_lines)]),
    ]

    svg = _Svg()
    y = 8.0
    if title:
        svg.text(_PAD, y + 14, fit(title, 84), 13, "bold")
        y += 24
    number = [0]

    def box(stage, heading, lines, x0, x1, y):
        h = 22 + _LINE * len(lines) + 4
        once = stage == "startup"  # not a stage of every step: dashed
        svg.rect(x0, y, x1 - x0, h, fill="#ffffff" if once else "#f8f9fa",
                 stroke="#868e96" if once else "#adb5bd", dash=once)
        svg.rect(x0, y, 5, h, fill=color, stroke="none", rx=2)
        number[0] += 1
        svg.text(x0 + 12, y + 16, f"{number[0]}. {heading}", 12, "bold")
        lx = x1 - 6
        for label, url in reversed(links.get(stage, [])):
            lx = svg.link(lx, y + 15, label, url, heading)
        for k, line in enumerate(lines):
            svg.text(x0 + 24, y + 16 + _LINE * (k + 1), fit(line, int((x1 - x0 - 30) / 7.25)), 11.5,
                     color="#343a40")
        return h

    for f, (name, arrow, boxes) in enumerate(frames):
        if arrow:
            svg.arrow(_W / 2, y, y + 26, arrow)
            y += 28
        top = y
        body = []  # measure first: the frame goes under its boxes
        inner_y = top + 22
        saved, svg.parts = svg.parts, body
        for stage, heading, lines in boxes:
            if stage == "worker":
                wy = inner_y
                inner = wy + 22
                for s, hd, ln in lines:
                    inner += box(s, hd, ln, 2 * _PAD + 8, _W - 2 * _PAD - 8, inner) + 5
                body.insert(0, "")
                worker_h = inner - wy + 3
                frame = _Svg()
                frame.rect(2 * _PAD, wy, _W - 4 * _PAD, worker_h, fill="#ffffff", stroke="#6c757d", dash=True)
                frame.text(2 * _PAD + 8, wy + 15, heading, 11, "bold", color="#495057")
                body[:0] = frame.parts
                inner_y = inner + 8
            else:
                inner_y += box(stage, heading, lines, 2 * _PAD, _W - 2 * _PAD, inner_y) + 6
        svg.parts = saved
        svg.rect(_PAD / 2, top, _W - _PAD, inner_y - top + 2, fill="#ffffff", stroke="#495057", dash=True)
        svg.text(_PAD + 4, top + 15, name + ("  (in vLLM; the book's engine is one process)" if f == 0 else ""),
                 11, "bold",
                 color="#495057")
        svg.parts.extend(body)
        y = inner_y + 4
    height = y + 6
    label = title or f"one engine step: request {rid} through step {rec.step}"
    return f"<div class='pagedkv-step' style='font-size:0;line-height:0'>{_svg_frame(svg.parts, height, label)}</div>"


def render_async_overlap(trace: StepTrace, step: int, title: str | None = None,
                         href: Callable[[str], str] | None = None) -> str:
    """Steps ``step`` and ``step + 1`` on a time axis, in the order the engine ran their stages.

    The axis runs from ``schedule(step)`` to the update that applies step
    ``step + 1``'s output, each event taking the next slot in the trace's
    order. Two lanes: the engine core (``schedule``, ``update_from_output``)
    and the GPU, where each step's forward runs from its launch
    (``execute_model``) until its output is applied. A ``schedule`` drawn
    inside the previous step's forward is the overlap async scheduling buys
    in vLLM; it is outlined thick. A legend says what the colours and
    outlines mean, and a caption under it that the picture is drawn as vLLM
    overlaps the stages, while the book's engine runs them one after the
    other in the same order.
    """
    if not isinstance(trace, StepTrace):
        raise TypeError(f"trace must be a StepTrace, got {type(trace).__name__}")
    events = trace.window(step)
    links = stage_links(href)
    label_w = 104
    slot_w = (_W - label_w - 2 * _PAD) / len(events)
    svg = _Svg()
    y = 8.0
    if title:
        svg.text(_PAD, y + 14, fit(title, 72), 13, "bold")
    svg.link(_W - _PAD, y + 14, links["schedule"][0][0], links["schedule"][0][1], "async scheduling")
    y += 26
    lanes = {"cpu": y + 6, "gpu": y + 56}
    svg.text(_PAD, lanes["cpu"] + 20, "EngineCore", 12, "bold")
    svg.text(_PAD, lanes["gpu"] + 20, "GPU", 12, "bold")
    x0 = _PAD + label_w
    spans: dict[int, list[int]] = {}  # step -> [first slot, last slot] of its forward
    for k, (stage, n) in enumerate(events):
        if stage == "execute":
            spans.setdefault(n, [k, len(events) - 1])[0] = k
        elif stage == "update":
            spans.setdefault(n, [0, k])[1] = k
    overlapped = {n - 1 for k, (stage, n) in enumerate(events) if stage == "schedule"
                  and n - 1 in spans and spans[n - 1][0] < k < spans[n - 1][1]}
    for n, (a, b) in sorted(spans.items()):
        x = x0 + a * slot_w + (slot_w / 2 if events[a] == ("execute", n) else 0)
        w = x0 + b * slot_w + slot_w / 2 - x
        svg.rect(x + 1, lanes["gpu"], max(w - 2, 8), 30, fill=owner_color(f"s{n}"), stroke="#495057",
                 dash=a == 0 and events[0] != ("execute", n))
        svg.text(x + 8, lanes["gpu"] + 19, f"forward {n}", 11.5)
    for k, (stage, n) in enumerate(events):
        if stage == "execute":
            continue
        x = x0 + k * slot_w
        bold = stage == "schedule" and n - 1 in overlapped
        svg.rect(x + 2, lanes["cpu"], slot_w - 4, 34, fill=owner_color(f"s{n}"), stroke="#212529" if bold
                 else "#495057", width=2.5 if bold else 1)
        svg.text(x + slot_w / 2, lanes["cpu"] + 15, "schedule" if stage == "schedule" else "update", 11,
                 "bold" if bold else "normal", "middle")
        svg.text(x + slot_w / 2, lanes["cpu"] + 28, f"step {n}", 11, anchor="middle")
    axis = lanes["gpu"] + 44
    svg.parts.append(f"<path d='M{x0:g},{axis:g} L{_W - _PAD:g},{axis:g}' stroke='#495057' stroke-width='1.2'/>")
    svg.text(_W - _PAD, axis + 15, "the engine's order ->", 11, anchor="end", color="#495057")
    if overlapped:
        n = min(overlapped)
        svg.text(x0, axis + 15, f"in vLLM, schedule {n + 1} overlaps forward {n}", 11, "bold",
                 color="#212529")
    # The legend: one colour per step, the thick outline, the dashed forward.
    y = axis + 34
    x = _PAD
    for n in sorted({n for _, n in events}):
        svg.rect(x, y - 10, 14, 12, fill=owner_color(f"s{n}"), stroke="#495057", rx=2)
        svg.text(x + 19, y, f"step {n}", 11)
        x += 19 + 7 * len(f"step {n}") + 14
    svg.text(x, y, "one colour per step", 11, color="#495057")
    legend = []
    if overlapped:
        legend.append(("thick", "thick outline: a schedule that falls inside the previous forward"))
    if any(a == 0 and events[0] != ("execute", n) for n, (a, _) in spans.items()):
        legend.append(("dash", "dashed: a forward launched before this window begins"))
    for kind, words in legend:
        y += 18
        svg.rect(_PAD, y - 10, 14, 12, fill="#ffffff", stroke="#212529" if kind == "thick" else "#495057",
                 dash=kind == "dash", rx=2, width=2.5 if kind == "thick" else 1)
        svg.text(_PAD + 19, y, words, 11)
    caption = ("Drawn as vLLM runs it: the GPU computes forward N while the CPU schedules N+1, so the "
               "two overlap in time. The book's engine runs the same stages one after the other, in "
               "this same order: the picture shows the order the trace recorded, not measured times.")
    y += 8
    for line in textwrap.wrap(caption, 94):
        y += 15
        svg.text(_PAD, y, line, 11, color="#343a40")
    height = y + 10
    label = title or f"async scheduling: steps {step} and {step + 1} in the engine's order"
    return f"<div class='pagedkv-step' style='font-size:0;line-height:0'>{_svg_frame(svg.parts, height, label)}</div>"
