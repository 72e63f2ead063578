"""Exercise 5's prediction task, and the check of its two kernels together.

* ``check_slot_prediction(predicted_slots)``: the notebook shows
  ``SLOT_TRACE``, a worker's rows and tables under Model Runner V2 (three
  requests take rows and blocks, one finishes, a new one takes its row,
  another grows at its tail; the step's rows are gathered) and one step's
  tokens (a chunk of B's prompt, a token of D, C's decode token); the reader
  writes the step's slot mapping before running it. The checker runs the
  trace on the library (``RequestState``, ``BlockTables``), compares, and on
  a mismatch draws chapter 5's block-major picture twice, side by side: each
  token of the step at the slot the trace gives it, and at the slot
  predicted. A wrong mapping is named by the slot-formula mistakes
  (``SLOT_MISTAKES``) or by a misread step (D's overwrite taken for an
  append, B's append for a replacement, the per-request rows read by batch
  entry).
* ``check_both_kernels(slot_mapping, kv_write)``: the learner's two kernels
  in one step (three requests, block size 4), compared with the library's,
  without the notebook importing them.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from .._device import default_device
from ..block_tables import BlockTables
from ..kernels.kv_write import reshape_and_cache_ref
from ..kernels.slot_mapping import compute_slot_mapping_ref
from ..request_state import RequestState
from ..views.style import owner_color
from ._harness import Checker, CheckReport, Mistake, catalogue, name_mistake
from .predict_harness import PredictionReport, check_prediction
from .slot_mistakes import SLOT_MISTAKES

__all__ = ["check_slot_prediction", "check_both_kernels", "SLOT_TRACE", "run_slot_trace"]

# ============================================================ the prediction
#: The trace, as the notebook shows it (and as the checker runs it).
SLOT_TRACE = """\
rows = RequestState(max_num_reqs=4)
tables = BlockTables(rows, block_sizes=[4], max_num_blocks_per_group=[4])
for name, blocks in [("A", [9, 2]), ("B", [5]), ("C", [4, 8, 1])]:
    row = rows.add_request(name)
    tables.append_block_ids(row, [blocks], overwrite=True)
rows.remove_request("A")                 # A finishes
row = rows.add_request("D")              # D arrives: 6 tokens
tables.append_block_ids(row, [[2, 7]], overwrite=True)
b_row = rows.idx_mapping(["B"])[0]       # B's prompt needs a second block
tables.append_block_ids(b_row, [[11]], overwrite=False)
tables.apply_staged_writes()

# This step: positions 3..6 of B's prompt, D's position 5, C's position 9.
idx_mapping = rows.idx_mapping(["B", "D", "C"])
tables.gather_block_tables(idx_mapping)
slots = tables.compute_slot_mappings(idx_mapping, query_start_loc=[0, 4, 5, 6],
                                     positions=[3, 4, 5, 6, 5, 9])[0]
"""

_B, _NUM_BLOCKS = 4, 12
_BATCH = ["B", "D", "C"]
_QSL = [0, 4, 5, 6]
_ENTRIES = np.array([0, 0, 0, 0, 1, 2])
_POSITIONS = np.array([3, 4, 5, 6, 5, 9])
#: Each request's blocks once the trace has run.
_BLOCKS = {"B": [5, 11], "D": [2, 7], "C": [4, 8, 1]}


def run_slot_trace():
    """Run ``SLOT_TRACE`` on the library: (blocks by request, each token's batch entry, positions, slots)."""
    namespace: dict = {"RequestState": RequestState, "BlockTables": BlockTables}
    exec(SLOT_TRACE, namespace)  # noqa: S102 -- the module's own constant
    rows, tables = namespace["rows"], namespace["tables"]
    blocks = {name: tables.block_ids(rows.idx_mapping([name])[0])[0] for name in _BATCH}
    return blocks, _ENTRIES.copy(), _POSITIONS.copy(), [int(s) for s in namespace["slots"].cpu()]


def _gathered(*, d_appended=False, b_replaced=False) -> np.ndarray:
    """The step's gathered table (entries B, D, C), one edit misread."""
    rows = np.zeros((3, 4), dtype=np.int32)
    b = [11] if b_replaced else [5, 11]
    d = [9, 2, 2, 7] if d_appended else [2, 7]
    for i, ids in enumerate((b, d, [4, 8, 1])):
        rows[i, :len(ids)] = ids
    return rows


def _by_request_row() -> np.ndarray:
    """The per-request table read by batch entry: rows 0 (never held), 1 (C), 2 (B)."""
    rows = np.zeros((3, 4), dtype=np.int32)
    rows[1, :3] = [4, 8, 1]
    rows[2, :2] = [5, 11]
    return rows


def _formula(rows, entries, positions) -> list[int]:
    return [int(rows[e, p // _B]) * _B + p % _B for e, p in zip(entries.tolist(), positions.tolist())]


TRACE_MISTAKES = [
    Mistake("D's overwrite read as an append", "D takes the row A left, and "
            "overwrite=True writes its blocks from column 0: A's old ids are "
            "not D's, and D's position 5 is in its own block 7",
            lambda entries, pos: _formula(_gathered(d_appended=True), entries, pos)),
    Mistake("the tail append read as a replacement", "overwrite=False adds "
            "B's block 11 after block 5, at column 1; the entries already in "
            "the row never move",
            lambda entries, pos: _formula(_gathered(b_replaced=True), entries, pos)),
    Mistake("the per-request rows read by batch entry", "entry i of the "
            "step is row idx_mapping[i] of the per-request table; the gather "
            "puts it at row i of the step's table, which is what the slot "
            "mapping reads", lambda entries, pos: _formula(_by_request_row(), entries, pos)),
]


def _read_slots(predicted, n: int) -> list[int]:
    shape = f"expected predicted_slots as a list of {n} ints, one slot per token"
    if isinstance(predicted, (str, bytes, dict)) or not hasattr(predicted, "__iter__"):
        raise AssertionError(f"{shape}; got {type(predicted).__name__} {predicted!r:.40}")
    got = list(predicted)
    for s in got:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral):
            raise AssertionError(f"{shape}; got {got!r:.60}")
    if len(got) != n:
        raise AssertionError(f"{shape}; got {len(got)}")
    return [int(s) for s in got]


def _describe(k: int, entries, positions) -> str:
    return f"{_BATCH[int(entries[k])]}'s position {int(positions[k])}"


def _compare_slots(got, want, reqs, positions) -> str | None:
    if got == want:
        return None
    k = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    return (f"you predicted {got}, the trace maps {want}: token {k} ("
            f"{_describe(k, reqs, positions)}) goes to slot {want[k]}, not {got[k]}")


def _pale(colour: str) -> str:
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{(c + 255) // 2:02x}" for c in (r, g, b))


def plot_step_slots(blocks, reqs, positions, sides: dict[str, list[int]], block_size: int = _B,
                    num_blocks: int = _NUM_BLOCKS, names=tuple(_BATCH)):
    """Chapter 5's block-major picture of one step, once per entry of ``sides``.

    One row per physical block, one column per offset; the blocks the
    table's rows hold are pale and hatched (allocated), and each token of the
    step is drawn at the slot ``sides[title]`` gives it, in its request's
    colour. A slot two tokens share is outlined red; padding and slots
    outside the cache are listed under the grid.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    owners = {}
    for name, ids in blocks.items():
        for b in ids:
            owners[b] = name
    fig, axes = plt.subplots(1, len(sides), figsize=(3.4 * len(sides), 0.9 + 0.34 * num_blocks))
    axes = np.atleast_1d(axes)
    for ax, (title, slots) in zip(axes, sides.items()):
        for b in range(num_blocks):
            for o in range(block_size):
                name = owners.get(b)
                fill = _pale(owner_color(name)) if name else "#e9ecef"
                ax.add_patch(Rectangle((o, b), 1, 1, facecolor=fill, hatch="///" if name else None,
                                       edgecolor="white", linewidth=2))
        notes, cells = [], {}
        for k, s in enumerate(slots):
            r = int(reqs[k])
            if r == -1 and s == -1:
                continue
            label = "pad" if r == -1 else f"{names[r]}{int(positions[k])}"
            if not 0 <= s < num_blocks * block_size:
                notes.append(f"{label}: slot {s}")
                continue
            colour = "#adb5bd" if r == -1 else owner_color(names[r])
            cells.setdefault(s, (colour, []))[1].append(label)
        for s, (colour, labels) in cells.items():
            shared = len(labels) > 1
            ax.add_patch(Rectangle((s % block_size, s // block_size), 1, 1, facecolor=colour,
                                   edgecolor="#d7191c" if shared else "white",
                                   linewidth=2.5 if shared else 2))
            ax.text(s % block_size + 0.5, s // block_size + 0.5, f"{'/'.join(labels)}\n{s}",
                    ha="center", va="center", fontsize=6)
        ax.set_xlim(0, block_size)
        ax.set_ylim(num_blocks, 0)
        ax.set_xticks([o + 0.5 for o in range(block_size)], [str(o) for o in range(block_size)],
                      fontsize=7)
        ax.set_yticks([b + 0.5 for b in range(num_blocks)], [str(b) for b in range(num_blocks)],
                      fontsize=7)
        ax.set_xlabel("offset in block" + ("\n" + "; ".join(notes) if notes else ""), fontsize=8)
        ax.set_ylabel("physical block id", fontsize=8)
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    plt.close(fig)
    return fig


def check_slot_prediction(predicted_slots) -> PredictionReport:
    """Grade a prediction of the slot mapping ``SLOT_TRACE``'s step gives its six tokens."""
    blocks, reqs, positions, want = run_slot_trace()
    assert want == _formula(_gathered(), reqs, positions), "the trace and its model disagree (a bug in pagedkv)"

    def diagnose(got):
        for m in TRACE_MISTAKES:
            if m.model(reqs, positions) == got:
                return m.diagnosis()
        return name_mistake(got, (_gathered(), reqs, positions, _B), SLOT_MISTAKES)

    return check_prediction(
        "prediction", "predicted_slots", predicted_slots, want,
        read=lambda p: _read_slots(p, len(want)),
        compare=lambda got, w: _compare_slots(got, w, reqs, positions),
        draw=lambda got: plot_step_slots(blocks, reqs, positions,
                                         {"the trace's slots": want, "your slots": got}),
        diagnose=diagnose,
        name="your slot mapping is the step's",
        hint="first each request's blocks as the appends leave them; then, token "
             "by token, the block at position // 4 and the offset in that block")


catalogue(check_slot_prediction, TRACE_MISTAKES, SLOT_MISTAKES)


# ====================================================== both kernels together
def _pipeline_case():
    g = torch.Generator().manual_seed(0)
    table = torch.tensor([[5, 2, 0], [7, 0, 0], [1, 6, 3]], dtype=torch.int32)
    reqs = torch.tensor([0] * 5 + [1] * 2 + [2] * 10 + [-1])
    positions = torch.tensor([*range(5), *range(2), *range(10), 0])
    key = torch.randn(len(positions), 2, 8, generator=g)
    value = torch.randn(len(positions), 2, 8, generator=g)
    return table, reqs, positions, key, value


def check_both_kernels(slot_mapping, kv_write, timeout: float = 60.0) -> CheckReport:
    """Your two kernels in one step, against the library's: the slots, then both caches."""
    table, reqs, positions, key, value = _pipeline_case()
    dev = default_device()
    want_slots = compute_slot_mapping_ref(table, reqs, positions, _B)
    want_k, want_v = (torch.zeros(8, _B, 2, 8) for _ in range(2))
    reshape_and_cache_ref(key, value, want_k, want_v, want_slots)
    got: dict = {}
    with Checker("both kernels", timeout=timeout) as c:
        c.probe(lambda: slot_mapping(table.to(dev), reqs.to(dev), positions.to(dev), _B))

        def slots():
            out = slot_mapping(table.to(dev), reqs.to(dev), positions.to(dev), _B)
            if not isinstance(out, torch.Tensor) or out.shape != want_slots.shape:
                raise AssertionError(f"expected {len(want_slots)} slots as a tensor, got "
                                     f"{type(out).__name__} {getattr(out, 'shape', '')}")
            got["slots"] = out
            if out.cpu().tolist() != want_slots.tolist():
                raise AssertionError(f"your slots {out.cpu().tolist()}, the library's "
                                     f"{want_slots.tolist()}")

        c.prop("three requests' slots, as the library maps them", slots,
               "check_slot_mapping_kernel above names what differs")

        def caches():
            s = got.get("slots", want_slots.to(dev))
            k, v = (torch.zeros(8, _B, 2, 8, device=dev) for _ in range(2))
            kv_write(key.to(dev), value.to(dev), k, v, s.to(dev))
            if not (torch.equal(k.cpu(), want_k) and torch.equal(v.cpu(), want_v)):
                raise AssertionError("your caches differ from the library's after the "
                                     "same step")

        c.prop("their keys and values in both caches, as the library writes them", caches,
               "check_kv_write_kernel above names what differs")
    return c.report
