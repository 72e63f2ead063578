"""Exercise 6's design tasks, checked by property: any valid design passes.

* ``check_resume_design(steps)``: a trace of admissions, preemptions,
  finishes and one resumption on ``KVCacheManager(12, block_size=4)`` in
  which request V (17 prompt tokens) resumes with exactly ``RESUME_HITS`` of
  its blocks still in the prefix cache. The trace is run on the library; a
  step the rules do not allow (an unknown request, a preemption of one that
  is not running, an admission the pool refuses, ...) rejects the design
  with its reason. On a miss the pool picture at the resumption is drawn:
  where V's blocks sit in the free queue, and which were evicted.
* ``check_block_size_design(prompts)``: a prefix-sharing workload on which
  block size 32 finds fewer prefix-cache hits than block size 16, every
  prompt after the first sharing at least 32 tokens with an earlier one.
  The prompts are admitted in order on one roomy manager per block size
  (nothing is evicted) and the hit tokens are counted; on a miss the two
  managers are drawn side by side (``render_paged_layout``).

Both return a ``PredictionReport`` (``predict_harness``): the design's
variable still ``None`` prints one line; a rejected design is a red line
with the reason.
"""

from __future__ import annotations

import numbers

from ..kv_cache_manager import KVCacheManager
from ..request import Request
from ..views.paged_layout import render_paged_layout
from ..views.pool_picture import render_pool
from .predict_harness import PredictionReport, check_prediction, side_by_side

__all__ = ["check_resume_design", "check_block_size_design", "run_resume_design",
           "run_block_size_design", "RESUME_HITS"]

# ============================================== a resumption with k cached blocks
#: The blocks V's resumption must find cached, of the 4 its 17 tokens can hit.
RESUME_HITS = 2
_POOL, _B, _V_TOKENS, _MAX_STEPS, _MAX_TOKENS = 12, 4, 17, 12, 64
_OPS = {"admit": 3, "preempt": 2, "finish": 2, "resume": 2}


class Rejected(AssertionError):
    """A design that breaks the task's rules (the message says which)."""


def _tokens(name: str, n: int) -> list[int]:
    """A request's own tokens: shared with nobody else's."""
    base = 1000 * (1 + sum(ord(ch) * 31 ** i for i, ch in enumerate(name)) % 997)
    return [base + i for i in range(n)]


def _step(k: int, step) -> tuple:
    if isinstance(step, (str, bytes)) or not isinstance(step, (tuple, list)) or not step:
        raise Rejected(f"step {k} is {step!r:.40}: a step is a tuple such as "
                       "('admit', 'X', 8) or ('preempt', 'V')")
    op = step[0]
    if op not in _OPS:
        raise Rejected(f"step {k}: {op!r:.20} is no step; the steps are "
                       f"{', '.join(_OPS)}")
    if len(step) != _OPS[op]:
        form = "('admit', name, num_tokens)" if op == "admit" else f"({op!r}, name)"
        raise Rejected(f"step {k}: {step!r:.40} -- write {form}")
    if not isinstance(step[1], str) or not step[1]:
        raise Rejected(f"step {k}: a request's name is a non-empty str, got {step[1]!r:.20}")
    if op == "admit":
        n = step[2]
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= _MAX_TOKENS:
            raise Rejected(f"step {k}: num_tokens must be an int from 1 to {_MAX_TOKENS}, got {n!r:.20}")
        if step[1] == "V" and n != _V_TOKENS:
            raise Rejected(f"step {k}: V's prompt is {_V_TOKENS} tokens, not {n}")
        return op, step[1], int(n)
    return op, step[1]


def run_resume_design(steps, result: dict | None = None) -> dict:
    """Run a design on the library: V's hit at its resumption, and the pool just before it.

    Fills and returns ``result`` (a new dict by default): ``hits``, the hit
    blocks, V's blocks before its preemption, the step, and ``pool``, the
    pool picture as V resumes (kept even when that resumption is refused).
    Raises ``Rejected`` (an ``AssertionError``) naming the first step the
    task's rules do not allow.
    """
    result = {} if result is None else result
    if isinstance(steps, (str, bytes, dict)) or not hasattr(steps, "__iter__"):
        raise Rejected(f"expected a list of steps, got {type(steps).__name__}")
    steps = list(steps)
    if len(steps) > _MAX_STEPS:
        raise Rejected(f"{len(steps)} steps: at most {_MAX_STEPS}")
    m = KVCacheManager(_POOL, _B)
    running: dict[str, Request] = {}
    waiting: dict[str, Request] = {}
    done: set[str] = set()
    v_blocks: list[int] = []
    for k, raw in enumerate(steps):
        step = _step(k, raw)
        op, name = step[0], step[1]
        if op == "admit":
            if name in running or name in waiting or name in done:
                raise Rejected(f"step {k}: {name} was admitted before; a name is one request")
            request = Request(name, _tokens(name, step[2]), hash_block_size=_B)
        elif op == "resume":
            if name not in waiting:
                raise Rejected(f"step {k}: {name} is not preempted, so it cannot resume")
            if name == "V" and "hits" in result:
                raise Rejected(f"step {k}: V resumes once; the check counts that resumption")
            request = waiting.pop(name)
        else:
            if name not in running:
                raise Rejected(f"step {k}: {name} is not running, so it cannot {op}")
            request = running.pop(name)
            if name == "V":
                v_blocks = m.get_block_ids("V")
            m.free(request)  # tail first, as the scheduler frees a victim
            request.num_computed_tokens = 0
            if op == "preempt":
                waiting[name] = request
            else:
                done.add(name)
            continue
        if op == "resume" and name == "V":
            result["pool"] = render_pool(
                m.block_pool, {n: m.get_block_ids(n) for n in running},
                f"step {k}: the pool V resumes on (V's old blocks outlined)",
                highlight=v_blocks)
        hit_blocks, hit = m.get_computed_blocks(request)
        free = m.get_num_free_blocks()
        if m.allocate_slots(request, request.num_tokens - hit, hit, hit_blocks) is None:
            raise Rejected(f"step {k}: the pool cannot {op} {name}: it needs more "
                           f"blocks than the {free} free (a resumption needs room, "
                           "as an admission does)")
        request.num_computed_tokens = request.num_tokens
        running[name] = request
        if op == "resume" and name == "V":
            result.update(hits=len(hit_blocks), hit_ids=[b.block_id for b in hit_blocks],
                          v_blocks=v_blocks, step=k)
    if "hits" not in result:
        missing = ("admit V" if "V" not in running and "V" not in waiting and "V" not in done
                   else "preempt V" if "V" in running else "resume V")
        raise Rejected(f"the trace never resumes V: {missing} somewhere")
    return result


def check_resume_design(resume_trace, hits: int = RESUME_HITS) -> PredictionReport:
    """Check a trace in which preempted V resumes with exactly ``hits`` of its blocks cached."""
    seen: dict = {}

    def read(steps):
        return run_resume_design(steps, seen)

    def compare(got, want):
        if got["hits"] == want:
            return None
        return (f"V resumed at step {got['step']} and hit {got['hits']} of its old blocks "
                f"{got['v_blocks']} ({got['hit_ids']}), not {want}")

    return check_prediction(
        "design", "resume_trace", resume_trace, hits, read=read, compare=compare,
        draw=lambda got: seen.get("pool"),
        name=f"V resumes with exactly {hits} of its blocks still cached",
        hint="V's blocks wait in the free queue in the order its free put them; "
             "which of them does each later allocation take, and does a hit "
             "survive a miss before it?")


# ================================================= block size 32 against 16
_MIN_SHARED, _MAX_PROMPTS, _MAX_PROMPT = 32, 8, 256


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _read_prompts(prompts) -> list[list[int]]:
    if isinstance(prompts, (str, bytes, dict)) or not hasattr(prompts, "__iter__"):
        raise Rejected(f"expected a list of prompts (lists of token ids), got {type(prompts).__name__}")
    out = []
    for k, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not hasattr(p, "__iter__"):
            raise Rejected(f"prompt {k} is {type(p).__name__}, not a list of token ids")
        p = list(p)
        if not 1 <= len(p) <= _MAX_PROMPT:
            raise Rejected(f"prompt {k} has {len(p)} tokens: from 1 to {_MAX_PROMPT}")
        for t in p:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < 50_000:
                raise Rejected(f"prompt {k} holds {t!r:.20}: token ids are ints from 0 to 49,999")
        out.append([int(t) for t in p])
    if not 2 <= len(out) <= _MAX_PROMPTS:
        raise Rejected(f"{len(out)} prompts: from 2 to {_MAX_PROMPTS}")
    for k in range(1, len(out)):
        shared = max(_common_prefix(out[k], out[j]) for j in range(k))
        if shared < _MIN_SHARED:
            raise Rejected(f"prompt {k} shares {shared} tokens with an earlier prompt at most: "
                           f"the task asks for at least {_MIN_SHARED}")
    return out


def run_block_size_design(prompts, block_sizes=(16, 32)) -> dict:
    """Admit ``prompts`` in order on one roomy manager per block size; the hit tokens of each."""
    prompts = _read_prompts(prompts)
    got = {}
    for B in block_sizes:
        m = KVCacheManager(sum(-(-len(p) // B) for p in prompts) + 2, B)
        requests, hits = [], []
        for k, p in enumerate(prompts):
            r = Request(f"P{k}", p, hash_block_size=B)
            hit_blocks, hit = m.get_computed_blocks(r)
            assert m.allocate_slots(r, r.num_tokens - hit, hit, hit_blocks) is not None
            r.num_computed_tokens = r.num_tokens
            requests.append(r)
            hits.append(hit)
        got[B] = {"manager": m, "requests": requests, "hits": hits}
    return got


def check_block_size_design(prefix_workload) -> PredictionReport:
    """Check a workload on which block size 32 loses prefix-cache hits that 16 keeps."""
    def compare(got, _):
        h16, h32 = got[16]["hits"], got[32]["hits"]
        if sum(h32) < sum(h16):
            return None
        return (f"hit tokens per prompt: {h16} at block size 16, {h32} at 32 "
                f"({sum(h16)} and {sum(h32)}): 32 loses nothing here")

    def draw(got):
        return side_by_side(*(render_paged_layout(got[B]["manager"], got[B]["requests"],
                                                  title=f"block size {B}: hits {got[B]['hits']}",
                                                  max_blocks=6)
                              for B in (16, 32)), min_px=480)

    return check_prediction(
        "design", "prefix_workload", prefix_workload, None, read=run_block_size_design,
        compare=compare, draw=draw,
        name="block size 32 finds fewer prefix-cache hits than 16",
        hint="a hit is whole blocks, and never the last prompt token: where "
             "must a shared prefix end for 16 to cover more of it than 32?")
