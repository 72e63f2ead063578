"""Explorables: a chapter's figures recomputed in the page as the reader moves the controls.

Each explorable is a small JavaScript module shipped as package data
(``explore_<kind>.js``, on the shared ``explore.js``) and inlined into one
self-contained HTML string: the controls, the output drawn for the default
settings, and the script. No kernel, no network: the built site runs it, and
so does JupyterLab for a trusted notebook (its output's script runs there, as
the replay's does). Where no script runs, the controls stay hidden and the
output drawn here, for the settings named under it, remains.

For every kind the library computes the same figures in Python
(``KINDS[kind].figures(inputs)``): the agreement test runs the module in
node on generated inputs, and the site check moves the controls in Chromium,
and both compare with these, string for string.
"""

from __future__ import annotations

import dataclasses

from .. import budget, sim
from .explorable_core import KINDS, Control, Explorable, Kind, esc, module_script  # noqa: F401
from .explore_budget import (BUDGET_FIELDS, BUDGET_MAX_MODEL_LENS, budget_config,  # noqa: F401
                             budget_explorer, budget_figures, budget_inputs, budget_refusal,
                             budget_specs, render_budget)

__all__ = ["Control", "Explorable", "KINDS", "budget_explorer", "budget_figures", "module_script",
           "prefix_explorer", "prefix_figures", "slots_explorer", "slots_figures", "tail_explorer",
           "tail_figures"]


# ---------------------------------------------------------------- chapter 2: tail waste


def tail_inputs(values: dict, config: dict) -> dict:
    return {**config["fixed"], **values}


def tail_figures(inputs: dict) -> dict:
    """The library's figures for one request's last block: its unused tail, in slots and bytes."""
    L, B, model, dtype = inputs["length"], inputs["block_size"], inputs["model"], inputs["dtype"]
    per_token = budget.kv_bytes_per_token(model, dtype)
    blocks = budget.blocks_per_request(L, B)
    tail = int(sim.unused_tail_slots(L, B))
    slots = budget.token_slots(blocks, B)
    return {"written": B - tail, "tail": tail, "block_size": B, "rows": [
        [f"blocks of {B}", f"{blocks:,}"],
        ["slots held", f"{slots:,}"],
        ["unused slots in the last block", f"{tail:,}"],
        ["share of the slots held", f"{100 * tail / slots:.2f} %"],
        [f"unused KV ({model}, {dtype})", f"{tail * per_token / budget.MiB:,.2f} MiB"],
        ["worst case, B - 1 slots", f"{(B - 1) * per_token / budget.MiB:,.2f} MiB"],
        ["mean if lengths mod B are uniform", f"{sim.uniform_tail_waste(B):.1f} slots"],
    ]}


def render_tail(f: dict, config: dict | None = None) -> str:
    """The tail explorable's output, exactly as the module's ``render`` draws it."""
    if f["block_size"] <= 64:
        cells = "".join(f"<span class='{'pkv-w' if i < f['written'] else 'pkv-u'}'></span>"
                        for i in range(f["block_size"]))
    else:
        cells = (f"<span class='pkv-w' style='flex-grow:{f['written']}'></span>"
                 f"<span class='pkv-u' style='flex-grow:{f['tail']}'></span>")
    return (f"<div class='pkv-caption'>the last block: {f['written']} written, {f['tail']} unused</div>"
            f"<div class='pkv-slots'>{cells}</div><table class='pkv-table'>"
            + "".join(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in f["rows"]) + "</table>")


def tail_config(model: str = budget.REFERENCE_MODEL, dtype: str = "bf16") -> dict:
    return {"models": {name: dataclasses.asdict(m) for name, m in budget.MODELS.items()},
            "dtype_bytes": dict(budget.DTYPE_BYTES), "fixed": {"model": model, "dtype": dtype}}


def tail_explorer(length: int = 612, block_size: int = 16, model: str = budget.REFERENCE_MODEL,
                  dtype: str = "bf16", max_length: int = 2048) -> Explorable:
    """Chapter 2's tail waste: a request's length and the block size -> its last block's
    unused slots, their share and their bytes, against the worst case and the mean."""
    controls = [
        Control("length", "request length", length, range=(1, max_length, 1)),
        Control("block_size", "block_size", block_size, options=[1, 2, 4, 8, 16, 32, 64, 128, 256]),
    ]
    return Explorable("tail", "Tail waste: move the length and the block size", controls,
                      tail_config(model, dtype))


# ---------------------------------------------------------------- chapters 3 and 6: prefix-cache hits


def prefix_config(a_own: int = 3, match_unit: int | None = None) -> dict:
    """Request A's own tokens after the shared prompt (at least 1, so B's last shared token
    is never A's last), and the match unit when no control sets it (``None``: the block size)."""
    fixed = {"a_own": a_own}
    if match_unit is not None:
        fixed["match_unit"] = match_unit
    return {"fixed": fixed}


def prefix_inputs(values: dict, config: dict) -> dict:
    inputs = {**config["fixed"], **values}
    if inputs.get("match_unit") is None:  # vLLM's default: the match unit is the block
        inputs["match_unit"] = inputs["block_size"]
    return inputs


def prefix_figures(inputs: dict) -> dict:
    """The library's figures for request B arriving after A, both opening with the same prompt.

    A (the shared prompt and ``a_own`` tokens of its own) is prefilled and
    decodes one token, as a scheduler runs it; then B (the shared prompt and
    ``own`` tokens of its own) is looked up (``get_computed_blocks``) and
    admitted (``allocate_slots``) by a real ``KVCacheManager``.
    """
    from ..common import cdiv
    from ..kv_cache_manager import KVCacheManager
    from ..request import Request

    S, own, B, h = inputs["shared"], inputs["own"], inputs["block_size"], inputs["match_unit"]
    a_tokens = list(range(1, S + inputs["a_own"] + 1))
    b_tokens = a_tokens[:S] + list(range(100_000, 100_000 + own))  # B parts from A at token S
    L = len(b_tokens)
    try:
        manager = KVCacheManager(num_blocks=cdiv(len(a_tokens) + 1, B) + cdiv(L, B) + 2,
                                 block_size=B, hash_block_size=h)
    except ValueError as exc:
        return {"verdict": "invalid", "message": str(exc), "states": [], "rows": [], "why": ""}
    a = Request("A", a_tokens, max_tokens=8)
    hit, n = manager.get_computed_blocks(a)
    manager.allocate_slots(a, a.num_tokens - n, n, hit)
    a.num_computed_tokens = a.num_tokens  # the step ran
    a.append_output_token_ids(42)  # A decodes one token: its computed prefix is matchable
    manager.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    b = Request("B", b_tokens, max_tokens=8)
    hit, num_hit = manager.get_computed_blocks(b)
    new_blocks = manager.allocate_slots(b, L - num_hit, num_hit, hit)
    copies = len(manager.take_pending_copies())
    full, partial = num_hit // B, num_hit % B
    blocks = cdiv(L, B)
    states = ["hit"] * full + ["copy"] * (partial > 0) + ["new"] * (blocks - full - (partial > 0))
    rows = [
        ["B's prompt", f"{L:,} tokens, {blocks:,} blocks of {B}"],
        ["full blocks hit", f"{full:,}"],
        ["partial block hit", f"{partial} of {B} slots, copied" if partial else "none"],
        ["tokens from the cache", f"{num_hit:,} of {L:,} ({100 * num_hit / L:.1f} %)"],
        ["tokens B computes", f"{L - num_hit:,}"],
        ["new blocks for B", f"{len(new_blocks):,}"],
        ["copy-on-write copies", f"{copies}"],
    ]
    most = min(S, L - 1)
    if L - 1 < S:
        why = (f"At most L - 1 = {L - 1:,} tokens may hit: B's last token is computed, "
               "for the logits of its first output token.")
    else:
        why = f"B parts from A at token {S:,}: a block hits only if every token in it is shared."
    if num_hit < most:
        unit = "block" if h == B else f"match unit of {h}"
        why += f" {most - num_hit:,} shared tokens are recomputed: they do not fill a whole {unit}."
    return {"verdict": "ok", "message": "", "states": states, "rows": rows, "why": why}


_PREFIX_CELL = {"hit": ("pkv-w", "H", "hit: shared with A"),
                "copy": ("pkv-c", "C", "partial hit: a private copy"),
                "new": ("pkv-u", "", "computed by B")}


def _table(rows) -> str:
    return "<table class='pkv-table'>" + "".join(
        f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in rows) + "</table>"


def render_prefix(f: dict, config: dict | None = None) -> str:
    """The prefix explorable's output, exactly as the module's ``render`` draws it."""
    if f["verdict"] == "invalid":
        return (f"<div class='pkv-verdict pkv-invalid' data-verdict='invalid'><b>\u2718 not a valid "
                f"setting: </b><span class='pkv-message'>{esc(f['message'])}</span></div>")
    states = f["states"]
    counts = {k: states.count(k) for k in _PREFIX_CELL}
    if len(states) <= 64:  # one cell per block of B, lettered as well as filled
        cells = "".join(f"<span class='{_PREFIX_CELL[s][0]}' title='block {i}: {_PREFIX_CELL[s][2]}'>"
                        f"{_PREFIX_CELL[s][1]}</span>" for i, s in enumerate(states))
    else:
        cells = "".join(f"<span class='{_PREFIX_CELL[k][0]}' style='flex-grow:{counts[k]}'>"
                        f"{_PREFIX_CELL[k][1]}</span>" for k in _PREFIX_CELL if counts[k])
    legend = " ".join(f"<span><i class='{c}'>{letter}</i>{esc(text)}: {counts[k]}</span>"
                      for k, (c, letter, text) in _PREFIX_CELL.items())
    return (f"<div class='pkv-caption'>B's blocks, in order:</div><div class='pkv-slots pkv-blocks'>{cells}</div>"
            f"<div class='pkv-legend'>{legend}</div>{_table(f['rows'])}<div class='pkv-why'>{esc(f['why'])}</div>")


def prefix_explorer(shared: int = 14, own: int = 3, block_size: int = 4, match_unit: int | None = None,
                    max_shared: int = 256, a_own: int = 3) -> Explorable:
    """Chapters 3 and 6: request A has run a prompt; B arrives opening with the same
    ``shared`` tokens and ``own`` of its own. How much of B hits the prefix cache,
    block by block, and what B computes and allocates.

    With ``match_unit`` (vLLM's ``prefix_match_unit``) a control sets the unit of
    the match; without it, the unit is the block, as for every one-group model.
    """
    if a_own < 1:
        raise ValueError(f"a_own must be at least 1 (A needs a token of its own), got {a_own!r}")
    controls = [
        Control("shared", "shared prompt (tokens)", shared, range=(1, max_shared, 1)),
        Control("own", "B's own tokens", own, range=(0, 64, 1)),
        Control("block_size", "block_size", block_size, options=[1, 2, 4, 8, 16, 32, 64]),
    ]
    if match_unit is not None:
        controls.append(Control("match_unit", "prefix_match_unit", match_unit,
                                options=[1, 2, 4, 8, 16, 32, 64]))
    return Explorable("prefix", "Prefix-cache hits: move the shared prompt and the block size",
                      controls, prefix_config(a_own))


# ---------------------------------------------------------------- chapter 5: the slot mapping, step by step

SLOT_BLOCK_SIZES = [1, 2, 4, 8, 16]
BULLET = "\u2022"  # marks the slots written this step, besides their colour


SLOT_MAX_TOKENS = 56  # the longest prompt (40) and one token a step after it, for 16 steps


def _slots_manager(block_size: int):
    """A pool with a history, so that a new request's blocks are not consecutive: three
    requests ran; X and Z finished (their hashed full blocks went to the tail of the free
    queue, X's partial last block to its head), Y still holds its blocks. The pool is just
    big enough for the longest request the controls allow, which then recycles X's and
    Z's cached blocks from the tail."""
    from ..common import cdiv
    from ..kv_cache_manager import KVCacheManager
    from ..request import Request

    B = block_size
    lengths = {"X": 5 * B + 1, "Y": 3 * B + 2, "Z": 4 * B}
    held = {name: cdiv(n, B) for name, n in lengths.items()}
    fresh = max(3, cdiv(SLOT_MAX_TOKENS, B) - held["X"] - held["Z"])
    manager = KVCacheManager(num_blocks=1 + sum(held.values()) + fresh, block_size=B)
    others = {}
    for k, (name, n) in enumerate(lengths.items()):
        others[name] = Request(name, list(range(10_000 * (k + 1), 10_000 * (k + 1) + n)))
        manager.allocate_slots(others[name], n)
        others[name].num_computed_tokens = n
    manager.free(others["X"])
    manager.free(others["Z"])
    return manager


def slots_config() -> dict:
    """The free queue (block ids, head first) each block size starts from, from the library's pool."""
    queues = {}
    for B in SLOT_BLOCK_SIZES:
        queue = _slots_manager(B).block_pool.free_block_queue.get_all_free_blocks()
        queues[str(B)] = [b.block_id for b in queue]
    return {"queues": queues, "fixed": {}}


def slots_inputs(values: dict, config: dict) -> dict:
    return {**config["fixed"], **values}


def slots_figures(inputs: dict) -> dict:
    """The library's figures for one step of a request: the manager allocates its blocks,
    the worker's ``BlockTable`` appends them, and the reference slot mapping gives the slots.

    The request's prompt runs in chunks of ``chunk`` tokens a step, then it
    decodes one token a step; ``step`` (from 1) is the step shown.
    """
    from ..block_table import BlockTable
    from ..kernels.slot_mapping import compute_slot_mapping_ref
    from ..request import Request

    P, B, chunk, step = inputs["prompt"], inputs["block_size"], inputs["chunk"], inputs["step"]
    manager = _slots_manager(B)
    r = Request("R", list(range(1, P + 1)), max_tokens=step + 1)
    table = BlockTable(max_num_reqs=1, max_num_blocks_per_req=SLOT_MAX_TOKENS)
    for k in range(1, step + 1):
        start = r.num_computed_tokens
        if start < P:
            n = min(chunk, P - start)
        else:
            r.append_output_token_ids(7)  # sampled by the step before
            n = 1
        new_ids = [b.block_id for b in manager.allocate_slots(r, n)]
        table.append_row(new_ids, 0)
        table.commit(1)
        if k == step:
            positions = list(range(start, start + n))
            slots = compute_slot_mapping_ref(table.get_device_tensor(1), [0] * n, positions, B).tolist()
        r.num_computed_tokens += n
    row = table.row(0)
    what = (f"prefill, tokens {start:,} to {start + n - 1:,}" if start < P
            else f"decode, the token at position {start:,}")
    return {"title": f"step {step}: {what}", "block_size": B, "row": row, "new": new_ids,
            "start": start, "end": start + n,
            "tokens": [[p, p // B, row[p // B], p % B, s] for p, s in zip(positions, slots)]}


def render_slots(f: dict, config: dict | None = None) -> str:
    """The slot explorable's output, exactly as the module's ``render`` draws it."""
    B, blocks = f["block_size"], ""
    for j, block_id in enumerate(f["row"]):
        cells = ""
        for o in range(B):
            p = j * B + o
            state = "pkv-w" if p < f["start"] else "pkv-now" if p < f["end"] else "pkv-u"
            cells += f"<span class='{state}'>{BULLET if state == 'pkv-now' else ''}</span>"
        mark = " new" if block_id in f["new"] else ""
        blocks += (f"<div class='pkv-blockrow'><span class='pkv-id'>{j} \u2192 block {block_id}{mark}</span>"
                   f"<span class='pkv-slots'>{cells}</span></div>")
    head = "<tr><td>position</td><td>p // B</td><td>block</td><td>p % B</td><td>slot</td></tr>"
    body = "".join("<tr>" + "".join(f"<td>{v}</td>" for v in t) + "</tr>" for t in f["tokens"])
    new = ", ".join(str(b) for b in f["new"]) or "none"
    return (f"<div class='pkv-caption'>{esc(f['title'])}; new blocks: {new}</div>"
            f"<div class='pkv-rowview'>{blocks}</div>"
            f"<div class='pkv-legend'><span><i class='pkv-w'></i>written before</span>"
            f"<span><i class='pkv-now'>\u2022</i>written this step</span>"
            f"<span><i class='pkv-u'></i>not yet written</span></div>"
            f"<div class='pkv-scroll'><table class='pkv-table pkv-grid'>{head}{body}</table></div>")


def slots_explorer(prompt: int = 10, block_size: int = 4, chunk: int = 6, step: int = 1) -> Explorable:
    """Chapter 5: one request, step by step. Its prompt runs in chunks, then it decodes
    a token a step; each step shows the blocks the manager appends to its row and the
    slot of every token the step computes, ``block_table[p // B] * B + p % B``."""
    controls = [
        Control("prompt", "prompt (tokens)", prompt, range=(1, 40, 1)),
        Control("block_size", "block_size", block_size, options=SLOT_BLOCK_SIZES),
        Control("chunk", "tokens per step", chunk, range=(1, 40, 1)),
        Control("step", "step", step, range=(1, 16, 1)),
    ]
    return Explorable("slots", "The slot mapping, step by step", controls, slots_config())


KINDS.update({
    "tail": Kind(tail_inputs, tail_figures, render_tail),
    "prefix": Kind(prefix_inputs, prefix_figures, render_prefix),
    "slots": Kind(slots_inputs, slots_figures, render_slots),
})
