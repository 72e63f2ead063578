"""Checks for exercise 8's section 4: ``diagnose(line)``, a verdict on vLLM's periodic log line.

Checked on lines the engine printed in runs with known settings and on lines
built with ``EngineStats.log_line``, two of them on either side of the
threshold (90.0% and 89.9% while requests wait), where a strict ``>`` and
``>=`` part. A wrong verdict that a known mistake explains is named
(``Mistake``).
"""

from __future__ import annotations

import random
import re

from ..engine import EngineStats, LLMEngine
from ._harness import (Checker, CheckReport, Mistake, WrongAnswer, catalogue,
                       name_mistake, one_thread)
from .ch08_fixtures import engine_args, random_prompt, short_repr, tiny_model

__all__ = ["check_diagnose", "VERDICTS", "HIGH_USAGE", "DIAGNOSE_MISTAKES"]


# ================================================== 4. reading a log line

#: The verdicts ``diagnose`` may return.
VERDICTS = ("pool too small", "memory-bound", "queue-bound", "healthy")
#: KV cache usage, in percent as the line prints it, that counts as full.
HIGH_USAGE = 90.0

_FIELD = {
    "running": re.compile(r"Running: (\d+) reqs"),
    "waiting": re.compile(r"Waiting: (\d+) reqs"),
    "preemptions": re.compile(r"Preemptions: (\d+)"),
    "usage": re.compile(r"KV cache usage: ([\d.]+)%"),
}


def _fields(line: str) -> dict:
    got = {}
    for key, pattern in _FIELD.items():
        m = pattern.search(line)
        got[key] = float(m.group(1)) if m else 0.0
    return got


def _verdict(line: str, order=("pre", "wait"), high=HIGH_USAGE,
             by_usage=False, strict=False) -> str:
    f = _fields(line)
    full = (lambda u: u > high) if strict else (lambda u: u >= high)
    if by_usage:
        return "pool too small" if full(f["usage"]) else (
            "queue-bound" if f["waiting"] else "healthy")
    for rule in order:
        if rule == "pre" and f["preemptions"]:
            return "pool too small"
        if rule == "wait" and f["waiting"]:
            return "memory-bound" if full(f["usage"]) else "queue-bound"
    return "healthy"


DIAGNOSE_MISTAKES = [
    Mistake("looked at the waiting queue before the preemptions",
            "a preempted request waits too, so a line with preemptions "
            "usually has waiting requests: test Preemptions first",
            lambda line: _verdict(line, order=("wait", "pre"))),
    Mistake("read the usage as a fraction",
            "the line prints a percentage (\"KV cache usage: 42.0%\"): "
            "compare it with 90, not 0.9",
            lambda line: _verdict(line, high=0.9)),
    Mistake("judged by the usage alone",
            "a pool may run at 95% and serve everyone: it is too small only "
            "when it preempts; high usage with a queue is memory-bound",
            lambda line: _verdict(line, by_usage=True)),
    Mistake("a strict > at the threshold",
            "the rule is a usage of at least 90%: a line at exactly 90.0% "
            "with requests waiting is memory-bound, not queue-bound",
            lambda line: _verdict(line, strict=True)),
    Mistake("ignored the preemptions",
            "\"Preemptions: N\" appears only when the interval had some: "
            "look for it, and treat its absence as 0",
            lambda line: _verdict(line, order=("wait",))),
]


def _engine_lines(seed: int = 0) -> list:
    """Log lines from engine runs with known settings; each comes with the
    ``EngineStats`` it prints."""
    rng = random.Random(seed)
    runs = [
        # too small: 4 long requests in 11 usable blocks
        (engine_args(num_gpu_blocks_override=12, max_model_len=32), 6, 20, 3),
        # queue-bound: room for all, but max_num_seqs 2
        (engine_args(num_gpu_blocks_override=80, max_model_len=32, max_num_seqs=2,
               max_num_batched_tokens=16), 6, 10, 2),
        # healthy, prefix caching on
        (engine_args(num_gpu_blocks_override=80, max_model_len=32,
               enable_prefix_caching=True), 3, 8, 2),
        # memory-bound moments: the pool nearly full, requests waiting
        (engine_args(num_gpu_blocks_override=16, max_model_len=40,
               max_num_batched_tokens=16), 5, 24, 2),
    ]
    lines = []
    for args, count, max_tokens, every in runs:
        printed = []
        engine = LLMEngine(args, tiny_model(), log_fn=printed.append)
        for i in range(count):
            engine.add_request(f"r{i}", random_prompt(rng, rng.randrange(4, 9)),
                               max_tokens=max_tokens, ignore_eos=True)
        step = 0
        while engine.has_unfinished_requests():
            engine.step()
            step += 1
            if step % every == 0:
                stats = engine.log_stats()
                lines.append((printed[-1], stats))
    return lines


def _built_lines() -> list:
    """Lines built from chosen numbers, one or more per verdict."""
    def line(run, wait, pre, usage, hit=None):
        stats = EngineStats(step=40, num_running=run, num_waiting=wait,
                            kv_cache_usage=usage, num_preemptions=pre,
                            num_preemptions_interval=pre,
                            prefix_cache_hit_rate=hit,
                            prompt_throughput=812.4,
                            generation_throughput=355.0)
        return stats.log_line(), stats
    return [line(12, 0, 0, 0.95), line(12, 5, 0, 0.97, 0.31),
            line(4, 7, 0, 0.31), line(9, 3, 2, 0.99), line(9, 3, 1, 0.62),
            line(3, 0, 0, 0.05, 0.0), line(8, 0, 1, 0.70),
            line(6, 2, 0, 0.90), line(6, 2, 0, 0.899)]


def _expected_verdict(stats: EngineStats) -> str:
    usage = round(stats.kv_cache_usage * 100, 1)
    if stats.num_preemptions_interval:
        return "pool too small"
    if stats.num_waiting:
        return "memory-bound" if usage >= HIGH_USAGE else "queue-bound"
    return "healthy"


MISSING_PREEMPTIONS = Mistake(
    "expected a Preemptions part in every line",
    "vLLM prints \"Preemptions: N\" only when the interval had some "
    "(\"if self.num_preemptions > 0\"): when it is missing, N is 0")


def _check_lines(fn, lines) -> None:
    probes = [(line,) for line, _ in _built_lines()]
    for line, stats in lines:
        want = _expected_verdict(stats)
        if _verdict(line) != want:
            raise RuntimeError(f"the oracles disagree on {line!r}")
        where = f"on \u00ab{line}\u00bb"
        try:
            got = fn(line)
        except Exception as exc:  # noqa: BLE001 -- a crash on this line
            if "Preemptions" in line:
                raise
            tb = exc.__traceback__
            while tb.tb_next is not None:
                tb = tb.tb_next
            raise WrongAnswer(
                f"{where}: raised {type(exc).__name__}: {exc} (line "
                f"{tb.tb_lineno} in {tb.tb_frame.f_code.co_name})",
                MISSING_PREEMPTIONS.diagnosis()) from None
        if got != want:
            if got not in VERDICTS:
                raise AssertionError(f"{where}: returned {short_repr(got)}, not "
                                     f"one of {VERDICTS}")
            raise WrongAnswer(f"{where}: you said {got!r}, expected "
                              f"{want!r}",
                              name_mistake(got, (line,), DIAGNOSE_MISTAKES,
                                           call=fn, probes=probes))


def check_diagnose(diagnose, seed: int = 0,
                   timeout: float = 20.0) -> CheckReport:
    """Check ``diagnose(line) -> verdict`` on lines the engine printed and
    on lines built from chosen numbers."""
    c = Checker("diagnose", timeout=timeout)
    built = _built_lines()

    def engine_lines():
        lines = _engine_lines(seed)
        kinds = {_expected_verdict(s) for _, s in lines}
        if kinds != set(VERDICTS):
            raise RuntimeError(f"the runs show only {sorted(kinds)}")
        _check_lines(diagnose, lines)

    with one_thread(), c:
        c.probe(lambda: diagnose(built[0][0]))
        c.prop("healthy and queue-bound (no preemptions; 89.9% is not full)",
               lambda: _check_lines(diagnose, [built[0], built[2],
                                               built[5], built[8]]))
        c.prop("memory-bound: a queue behind a full pool (90.0% included)",
               lambda: _check_lines(diagnose, [built[1], built[7]]))
        c.prop("pool too small: the interval preempted",
               lambda: _check_lines(diagnose, [built[3], built[4],
                                               built[6]]))
        c.prop("lines from engine runs with known settings", engine_lines)
    return c.report


catalogue(check_diagnose, [MISSING_PREEMPTIONS], DIAGNOSE_MISTAKES)
