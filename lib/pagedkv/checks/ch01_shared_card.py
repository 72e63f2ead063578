"""Exercise 1's prediction and design tasks: instances sharing one card.

Both follow chapter 1's rules for a budget per instance
(``budget.pool_from_free_memory``): an instance first creates its CUDA
context (0.5 GiB here, outside its budget), takes a snapshot of the free
memory, asks for ``ceil(total x gpu_memory_utilization)`` bytes and refuses
to start when less than that is free; its pool is what it asked for minus
its weights and its non-KV allowance, floored to blocks. What other
processes hold is never subtracted; it only has to fit beside it. Once an
instance runs, it holds what it asked for.

* The prediction, ``check_card_prediction(predicted_blocks)``: the notebook
  shows ``CARD_TRACE``, three instances started one after another on an H100;
  the reader writes each one's block count (``None`` for one that refuses)
  before running it. On a mismatch the checker draws the card as the trace
  leaves it beside the card as predicted (the book's ``plot_shared_card``).
* The design, ``check_two_instances(two_instances)``: the reader picks the
  utilizations of two instances so that both start and each meets its
  target; any valid pair passes, an invalid one fails with its reason.
"""

from __future__ import annotations

import math
import numbers

from .. import budget
from ..budget import GiB, MiB
from ._harness import Checker, CheckReport, Mistake, WrongAnswer, catalogue
from .predict_harness import PredictionReport, check_prediction

__all__ = ["check_card_prediction", "check_two_instances", "plot_two_instances",
           "CARD_TRACE", "run_card_trace", "start_instances"]

CONTEXT = GiB // 2  # each instance's CUDA context, outside its budget
TOTAL = budget.gpu_spec("H100 SXM 80GB").total_bytes  # 81,559 MiB

#: The trace, as the notebook shows it (and as the checker runs it).
CARD_TRACE = """\
total = 81_559 * MiB                  # an H100 SXM 80 GB, idle
in_use = 0                            # bytes other processes hold
blocks = []


def start(model, utilization, weight_gib):
    global in_use
    in_use += GiB // 2                # its CUDA context, outside its budget
    try:
        r = budget.pool_from_free_memory(
            model, gpu_memory_utilization=utilization, non_kv_gib=6.0,
            free_and_total=(total - in_use, total), weight_gib=weight_gib)
    except ValueError:                # refused at startup: it exits
        in_use -= GiB // 2
        return None
    in_use += math.ceil(total * utilization)  # it holds what it asked for
    return r["num_blocks"]


blocks.append(start("Llama-3.1-8B", 0.46, weight_gib=14.96))  # A
blocks.append(start("Qwen2.5-7B", 0.46, weight_gib=14.2))     # B
blocks.append(start("Qwen2.5-7B", 0.30, weight_gib=14.2))     # C
"""

_STARTS = [("A", "Llama-3.1-8B", 0.46, 14.96), ("B", "Qwen2.5-7B", 0.46, 14.2),
           ("C", "Qwen2.5-7B", 0.30, 14.2)]


def run_card_trace() -> list[int | None]:
    """Run ``CARD_TRACE`` on the library: the block counts of A, B and C."""
    namespace: dict = {"budget": budget, "math": math, "MiB": MiB, "GiB": GiB}
    exec(CARD_TRACE, namespace)  # noqa: S102 -- the module's own constant
    return namespace["blocks"]


def start_instances(starts, *, share_of_free=False, others_subtracted=False,
                    no_free_check=False, null_held_back=False) -> list[dict]:
    """The instances of ``starts`` ((name, model, utilization, weight_gib)), in order.

    Each is a dict: ``name``, ``model``, ``started``, ``why`` (a refusal's
    reason), ``requested``, ``weights``, ``pool`` (bytes) and ``blocks``.
    The flags change one rule, to model a misunderstanding.
    """
    in_use, out = 0, []
    for name, model, util, weight_gib in starts:
        in_use += CONTEXT
        free = TOTAL - in_use
        requested = math.ceil((free if share_of_free else TOTAL) * util)
        weights, non_kv = weight_gib * GiB, 6.0 * GiB
        pool = requested - weights - non_kv - (in_use - CONTEXT if others_subtracted else 0)
        one = {"name": name, "model": model, "started": False, "requested": requested,
               "weights": weights, "pool": pool, "blocks": None, "why": ""}
        if not no_free_check and free < requested:
            one["why"] = (f"{name} asks for {requested / GiB:.2f} GiB but only "
                          f"{free / GiB:.2f} GiB are free when it starts")
        elif pool <= 0:
            one["why"] = (f"{name}'s weights and non-KV allowance fill its "
                          f"{requested / GiB:.2f} GiB budget")
        else:
            blocks = budget.num_gpu_blocks(pool, model)
            one.update(started=True, blocks=blocks - 1 if null_held_back else blocks)
            in_use += requested
        if not one["started"]:
            in_use -= CONTEXT
        out.append(one)
    return out


def _counts(instances) -> list[int | None]:
    return [one["blocks"] for one in instances]


CARD_MISTAKES = [
    Mistake("the null block held back", "num_blocks counts every block the "
            "pool allocates, the null block included; it is held back later, "
            "when blocks are handed out",
            lambda: _counts(start_instances(_STARTS, null_held_back=True))),
    Mistake("a share of the free memory", "gpu_memory_utilization is a "
            "share of the card's total, not of what is free when the "
            "instance starts: each instance asks for total x utilization",
            lambda: _counts(start_instances(_STARTS, share_of_free=True))),
    Mistake("other instances subtracted from the pool", "what other "
            "processes hold is never subtracted from an instance's budget: "
            "it only has to fit beside it, in the free-memory check",
            lambda: _counts(start_instances(_STARTS, others_subtracted=True))),
    Mistake("no free-memory check", "an instance refuses to start when less "
            "than total x utilization is free, however little of that its "
            "KV would need", lambda: _counts(start_instances(_STARTS, no_free_check=True))),
    Mistake("the same pool for both models", "Qwen2.5-7B has lighter "
            "weights and 4 KV heads in 28 layers, 56 KiB a token against "
            "Llama's 128: the same budget gives it more than twice the blocks",
            lambda: [8_027, 8_027, None]),
]


def _read(predicted) -> list[int | None]:
    shape = ("expected a list of three block counts, A's, B's and C's, with "
             "None for an instance that refuses to start, such as [1000, 2000, None]")
    if isinstance(predicted, (str, bytes)) or not hasattr(predicted, "__iter__"):
        raise AssertionError(f"{shape}; got {type(predicted).__name__} {predicted!r:.40}")
    got = list(predicted)
    if len(got) != 3 or any(g is not None and (isinstance(g, bool) or not isinstance(g, numbers.Integral))
                            for g in got):
        raise AssertionError(f"{shape}; got {got!r:.60}")
    return [None if g is None else int(g) for g in got]


def _say(n) -> str:
    return "refuses to start" if n is None else f"{n:,} blocks"


def _compare(got, want) -> str | None:
    if got == want:
        return None
    first = next(i for i in range(3) if got[i] != want[i])
    name = "ABC"[first]
    words = f"{name}: you predicted {_say(got[first])}, the trace gives {_say(want[first])}"
    if got[first] is not None and want[first] is not None and abs(got[first] - want[first]) <= 2:
        words += (" (a count off by a block or two: an input was rounded, or the null "
                  "block taken off)")
    return words


def _diagnose(got) -> str | None:
    for m in CARD_MISTAKES:
        if m.model() == got:
            return m.diagnosis()
    return None


def _card_rows(instances):
    """``plot_shared_card`` parts for a run of instances (refused ones leave nothing).

    Parts past the card's end (an instance predicted to start that would
    not fit) are cut at the end.
    """
    parts = []
    for one in instances:
        if not one["started"]:
            continue
        kv = one["pool"]
        unused = one["requested"] - one["weights"] - 6.0 * GiB - kv
        parts += [("other processes", CONTEXT), ("weights", one["weights"]),
                  ("non-KV allowance", 6.0 * GiB), ("KV pool", kv)]
        if unused > 0:
            parts.append(("free, outside the budget", unused))
    cut, left = [], TOTAL
    for label, num_bytes in parts:
        if left <= 0:
            break
        cut.append((label, min(num_bytes, left)))
        left -= num_bytes
    return cut


def _titled(fig, lines):
    """The block counts in words, under the bars (the key sits above them)."""
    fig.axes[0].set_xlabel("\n".join(["GiB of GPU memory", *lines]), fontsize=8)
    fig.set_figheight(fig.get_figheight() + 0.15 * len(lines))
    fig.tight_layout()
    return fig


def _card_picture(got):
    import matplotlib.pyplot as plt

    from ..views.calculator import plot_shared_card

    actual = start_instances(_STARTS)
    predicted = []
    for one, n in zip(actual, got):
        guess = dict(one)
        if n is None:
            guess.update(started=False)
        else:
            guess.update(started=True, pool=n * budget.block_bytes(one["model"], 16))
            if not one["started"]:  # predicted to start: it would hold its budget
                guess["pool"] = min(guess["pool"], max(one["requested"] - one["weights"] - 6 * GiB, 0))
        predicted.append(guess)
    fig = plot_shared_card(TOTAL, {"the trace": _card_rows(actual),
                                   "your prediction": _card_rows(predicted)})
    _titled(fig, ["the trace: " + ", ".join(f"{o['name']} {_say(o['blocks'])}" for o in actual),
                  "your prediction: " + ", ".join(f"{o['name']} {_say(n)}"
                                                  for o, n in zip(actual, got))])
    plt.close(fig)  # shown once, by the checker, not again at the end of the cell
    return fig


def check_card_prediction(predicted_blocks) -> PredictionReport:
    """Grade a prediction of the block counts ``CARD_TRACE`` gives A, B and C (``None``: refused)."""
    want = run_card_trace()
    return check_prediction(
        "prediction", "predicted_blocks", predicted_blocks, want,
        read=_read, compare=_compare, draw=_card_picture, diagnose=_diagnose,
        name="your block counts for A, B and C are the trace's",
        hint="replay the trace one instance at a time: what is free when it "
             "starts, what it asks for, what its pool is")


catalogue(check_card_prediction, CARD_MISTAKES)


# --------------------------------------------------------------- the design
#: The targets of the design task (the notebook states them).
LLAMA = ("Llama-3.1-8B", 14.96)
QWEN = ("Qwen2.5-7B", 14.2)
MAX_MODEL_LEN = 32_768
TURNS, TURN_LEN = 256, 612  # Llama must hold 256 chat turns of 612 tokens at once


def _design_pair(value) -> tuple[float, float]:
    shape = "expected a pair (llama_utilization, qwen_utilization) of numbers in (0, 1]"
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise AssertionError(f"{shape}; got {type(value).__name__} {value!r:.40}")
    for u in value:
        if isinstance(u, bool) or not isinstance(u, numbers.Real) or not 0 < u <= 1:
            raise AssertionError(f"{shape}; got {value!r:.40}")
    return float(value[0]), float(value[1])


def _admits(one, max_model_len) -> str | None:
    """Why the startup check refuses ``max_model_len`` on this instance's pool, or ``None``."""
    try:
        budget.check_enough_kv_cache_memory(one["pool"], one["model"], max_model_len)
    except ValueError:
        usable = one["blocks"] - 1
        return (f"{one['name']}'s pool of {one['pool'] / GiB:.2f} GiB holds {one['blocks']:,} "
                f"blocks, {usable:,} usable after the null block: one request of "
                f"{max_model_len:,} tokens needs {budget.blocks_per_request(max_model_len, 16):,}")
    return None


DESIGN_MISTAKES = [
    Mistake("Qwen asks for more than is left", "the second instance needs "
            "total x its utilization free at startup, and the first one "
            "holds its whole request plus a CUDA context: the two shares and "
            "the contexts must fit in the card together"),
    Mistake("a pool too small for max_model_len", "the startup check wants "
            "one request of max_model_len tokens to fit in the usable "
            "blocks, the null block held back"),
    Mistake("too few chat turns", "the concurrent turns are the usable "
            "blocks divided by one turn's blocks (a partial block counts "
            "whole): this budget leaves too few blocks for the target"),
    Mistake("a budget the weights fill", "a budget must hold the weights "
            "and the non-KV allowance before a single block of KV"),
]


def check_two_instances(two_instances, timeout: float = 20.0) -> CheckReport:
    """Check ``two_instances() -> (llama_utilization, qwen_utilization)``, any valid design."""
    with Checker("two_instances", timeout=timeout) as c:
        c.probe(two_instances)
        state: dict = {}

        def design():
            if "pair" not in state:
                state["pair"] = _design_pair(two_instances())
                u1, u2 = state["pair"]
                state["run"] = start_instances([("Llama", LLAMA[0], u1, LLAMA[1]),
                                                ("Qwen", QWEN[0], u2, QWEN[1])])
            return state["run"]

        def llama_starts():
            llama = design()[0]
            if not llama["started"]:
                raise WrongAnswer(llama["why"], DESIGN_MISTAKES[3].diagnosis()
                                  if "fill" in llama["why"] else None)
            why = _admits(llama, MAX_MODEL_LEN)
            if why:
                raise WrongAnswer(why, DESIGN_MISTAKES[1].diagnosis())

        c.prop(f"Llama-3.1-8B starts on the idle card and admits max_model_len="
               f"{MAX_MODEL_LEN:,}", llama_starts,
               "its pool is its request less 14.96 GiB of weights and 6 GiB")

        def llama_turns():
            llama = design()[0]
            if not llama["started"]:
                raise AssertionError("Llama does not start (see the line above)")
            per_turn = budget.blocks_per_request(TURN_LEN, 16)
            turns = (llama["blocks"] - 1) // per_turn
            if turns < TURNS:
                raise WrongAnswer(
                    f"Llama's {llama['blocks'] - 1:,} usable blocks hold {turns} turns of "
                    f"{TURN_LEN} tokens ({per_turn} blocks each), not {TURNS}",
                    DESIGN_MISTAKES[2].diagnosis())

        c.prop(f"Llama's pool holds {TURNS} chat turns of {TURN_LEN} tokens at once",
               llama_turns, "how many blocks does one turn hold?")

        def qwen_starts():
            llama, qwen = design()
            if not qwen["started"]:
                mistake = DESIGN_MISTAKES[0] if "free" in qwen["why"] else DESIGN_MISTAKES[3]
                raise WrongAnswer(qwen["why"], mistake.diagnosis())
            why = _admits(qwen, MAX_MODEL_LEN)
            if why:
                raise WrongAnswer(why, DESIGN_MISTAKES[1].diagnosis())

        c.prop(f"Qwen2.5-7B then starts beside it and admits max_model_len="
               f"{MAX_MODEL_LEN:,}", qwen_starts,
               "what is free once Llama holds its request and two contexts exist?")
    return c.report


catalogue(check_two_instances, DESIGN_MISTAKES)


def plot_two_instances(llama_utilization: float, qwen_utilization: float):
    """The card with the two instances of the design task, as ``plot_shared_card`` draws it."""
    from ..views.calculator import plot_shared_card

    run = start_instances([("Llama", LLAMA[0], llama_utilization, LLAMA[1]),
                           ("Qwen", QWEN[0], qwen_utilization, QWEN[1])])
    fig = plot_shared_card(TOTAL, {f"Llama {llama_utilization:g}, Qwen {qwen_utilization:g}":
                                   _card_rows(run)})
    return _titled(fig, [", ".join(f"{o['name']}: {_say(o['blocks'])}" if o["started"]
                                   else f"{o['name']} refuses to start" for o in run)])
