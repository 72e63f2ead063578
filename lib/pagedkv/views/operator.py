"""The operator's side of the book: a symptom -> cause -> change -> metric table, and a reader of what a server prints.

``SYMPTOMS`` holds one ``Symptom`` per row of the operator's page: what a
server shows (its periodic log line, a startup refusal), why, what to change
(``vllm serve`` flags), and which of vLLM 0.33.0's Prometheus metrics shows
the change working. ``diagnose`` reads a periodic log line (and, if given,
the one before it) and names the rows that apply; ``refusal`` names the row
of a startup error. It extends exercise 8's verdicts: "pool too small"
(preemptions) is ``"preempting"``, "memory-bound" is ``"memory-bound"``,
"queue-bound" splits into ``"queue-bound"`` (no memory pressure) and
``"draining"`` (usage falls while the queue grows), and a low prefix hit rate
and the startup refusals are rows of their own. ``symptom_table`` renders
the rows as HTML for the page.

``version_table`` renders the version matrix (``book/version_matrix.json``,
checked against the releases' wheels by ``python -m tools.versions --check``):
each claim's value in each release read, linked to its lines at that
release's tag, and ``changed_in`` says where it changed.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass

__all__ = ["Symptom", "SYMPTOMS", "LogLine", "read_log_line", "diagnose", "refusal", "symptom_table", "burst_figure",
           "HIGH_USAGE", "LOW_HIT_RATE", "without_clock", "release_link", "changed_in", "version_table"]

#: KV cache usage (percent, as the line prints it) from which the pool counts as full.
HIGH_USAGE = 90.0
#: Prefix cache hit rate (percent) below which a workload that shares a system prompt loses hits.
LOW_HIT_RATE = 50.0


@dataclass(frozen=True)
class Symptom:
    """One row: what is seen, why, what to change, what to watch."""

    key: str
    symptom: str
    cause: str
    change: str
    metric: str


SYMPTOMS: dict[str, Symptom] = {s.key: s for s in [
    Symptom("memory-bound",
            "KV cache usage 90 % or more, requests waiting, no preemptions",
            "the running requests hold the pool; a waiting request is admitted only when its whole prompt "
            "fits the free blocks",
            "more KV memory per GPU: --gpu-memory-utilization up (to 0.95 at most), --kv-cache-dtype fp8 "
            "(twice the blocks), --tensor-parallel-size up, less non-KV memory (--enforce-eager, a smaller "
            "--max-num-batched-tokens), or another replica; a smaller --max-model-len buys nothing here",
            "vllm:num_requests_waiting falls; vllm:kv_cache_usage_perc stays high"),
    Symptom("preempting",
            "'Preemptions: N' in the log line",
            "admission looks at the prompt; running requests grow by a block every block_size tokens and "
            "the pool runs out: the newest running request loses its blocks and is recomputed later",
            "more KV memory (as above), or fewer requests at once (--max-num-seqs down)",
            "rate(vllm:num_preemptions_total) goes to 0"),
    Symptom("low hit rate",
            "'Prefix cache hit rate' low although requests share a system prompt",
            "per-request text (a date, a name, an id) early in the prompt: nothing after it can hit; or "
            "long unique documents dominate the tokens; or the pool evicts the shared prefix between turns",
            "move per-request text after the shared part of the template; block size is not the lever for "
            "long prompts",
            "rate(vllm:prefix_cache_hits_total) / rate(vllm:prefix_cache_queries_total) rises"),
    Symptom("queue-bound",
            "requests waiting while KV cache usage is well below 90 %",
            "the running queue is at --max-num-seqs (or one step's token budget is spent)",
            "--max-num-seqs up (and --max-num-batched-tokens with it)",
            "vllm:num_requests_running reaches the new limit; vllm:num_requests_waiting falls"),
    Symptom("draining",
            "KV cache usage falls while the queue grows",
            "the request at the head of the queue needs more free blocks than the pool has; first come, "
            "first served, so everyone behind it waits while the running requests finish",
            "more KV memory; or a separate instance for long prompts (a lower --max-model-len there "
            "refuses the longest instead of queueing them)",
            "vllm:kv_cache_usage_perc falls and vllm:num_requests_waiting rises in the same interval"),
    Symptom("long prompts first",
            "short requests' time to first token jumps whenever long prompts arrive",
            "chunked prefill hands the step's token budget out in queue order: long prompts ahead take "
            "all of --max-num-batched-tokens for several steps, and the short prompts behind them wait",
            "--long-prefill-token-threshold N: no request computes more than N tokens a step, so the rest "
            "goes to the others (the long prompts' own first token comes later, the short ones' decodes "
            "share steps with their chunks); or --scheduling-policy priority, interactive requests given "
            "a smaller priority",
            "histogram_quantile(0.99, rate(vllm:time_to_first_token_seconds_bucket[5m])) falls"),
    Symptom("preempt or queue",
            "inter-token latency spikes with 'Preemptions: N'; a lower --max-num-seqs ends them but "
            "time to first token grows",
            "more requests run than the pool holds at their full length: each preemption stalls a request "
            "until it is recomputed; fewer at once never preempt, but the rest wait in the queue",
            "--max-num-seqs near what the pool holds at full length (usable blocks // blocks per "
            "request); more KV memory to have both",
            "vllm:inter_token_latency_seconds against vllm:request_queue_time_seconds"),
    Symptom("hit rate after a burst",
            "a chat service's 'Prefix cache hit rate' collapses for minutes after a burst of one-off "
            "prompts, then recovers",
            "the burst's allocations take the free queue's head, where the conversations' idle histories "
            "sit; each conversation then recomputes its history at its next turn, evicting the histories "
            "of others, idle longer than the burst's blocks",
            "send bursts (batch jobs, crawlers) to another instance; KV memory for the histories and the "
            "burst together; KV offloading to CPU memory (--kv-offloading-size GiB), which loads an "
            "evicted history back instead of recomputing it",
            "vllm:kv_block_idle_before_evict_seconds (--kv-cache-metrics): its median falls below the "
            "users' time between turns"),
    Symptom("refused: max_model_len",
            "at startup: 'To serve at least one request with the model's max seq len (L), (X GiB KV cache "
            "is needed, ...'",
            "one request of max_model_len tokens must fit the pool (the null block held back)",
            "--max-model-len down to the estimate the message gives, or more KV memory",
            "the startup log's 'Maximum concurrency for L tokens per request' is at least 1"),
    Symptom("refused: no memory",
            "at startup: 'No available memory for the cache blocks.'",
            "weights and non-KV memory fill the budget total x utilization",
            "--gpu-memory-utilization up, --tensor-parallel-size up, a quantized checkpoint, --enforce-eager",
            "'Available KV cache memory' in the startup log is positive"),
    Symptom("refused: context",
            "at startup: 'User-specified max_model_len (L) is greater than the derived max_model_len'",
            "max_model_len is beyond the model's own context (max_position_embeddings)",
            "--max-model-len down to the model's context",
            "the server starts"),
    Symptom("refused: free memory",
            "at startup: 'Free memory on device ... is less than desired GPU memory utilization'",
            "another process holds memory: the budget is a share of the total, and must be free",
            "--gpu-memory-utilization down to what is free, or free the GPU",
            "the server starts; each instance's budget is its own share of the total"),
]}

_FIELDS = {
    "running": re.compile(r"Running: (\d+)"),
    "waiting": re.compile(r"Waiting: (\d+)"),
    "preemptions": re.compile(r"Preemptions: (\d+)"),
    "usage": re.compile(r"KV cache usage: ([\d.]+) ?%"),
    "hit_rate": re.compile(r"(?<!External )(?<!MM )Prefix cache hit rate: ([\d.]+) ?%"),
}


@dataclass(frozen=True)
class LogLine:
    """The fields of vLLM's periodic log line (percentages as printed; absent Preemptions is 0)."""

    running: int
    waiting: int
    preemptions: int
    usage: float
    hit_rate: float | None


def read_log_line(line: str) -> LogLine:
    """The fields of one periodic log line; ``ValueError`` if it has no running, waiting or usage field."""
    if not isinstance(line, str):
        raise TypeError(f"the log line must be a str, got {type(line).__name__}")
    found = {k: p.search(line) for k, p in _FIELDS.items()}
    missing = [k for k in ("running", "waiting", "usage") if found[k] is None]
    if missing:
        raise ValueError(f"not vLLM's periodic log line (no {', '.join(missing)} field): {line[:80]!r}")
    hit = found["hit_rate"]
    return LogLine(int(found["running"].group(1)), int(found["waiting"].group(1)),
                   int(found["preemptions"].group(1)) if found["preemptions"] else 0,
                   float(found["usage"].group(1)), float(hit.group(1)) if hit else None)


def diagnose(line: str, previous: str | None = None, high: float = HIGH_USAGE,
             shared_prefix: bool = False, low_hit_rate: float = LOW_HIT_RATE) -> list[str]:
    """The ``SYMPTOMS`` keys that a periodic log line shows (empty: healthy).

    ``previous``: the line before it, which ``"draining"`` needs (usage lower,
    queue longer). ``"low hit rate"`` applies only when the requests share a
    prefix (``shared_prefix``: the line cannot say) and the line reports a hit
    rate below ``low_hit_rate`` percent.
    """
    now = read_log_line(line)
    keys = []
    if now.preemptions:
        keys.append("preempting")
    if now.waiting and now.usage >= high and not now.preemptions:
        keys.append("memory-bound")
    if previous is not None:
        before = read_log_line(previous)
        if now.usage < before.usage and now.waiting > before.waiting:
            keys.append("draining")
    if now.waiting and now.usage < high and "draining" not in keys:
        keys.append("queue-bound")
    if shared_prefix and now.hit_rate is not None and now.hit_rate < low_hit_rate:
        keys.append("low hit rate")
    return keys


_REFUSALS = [
    ("refused: max_model_len", "To serve at least one request with the model's max seq len"),
    ("refused: no memory", "No available memory for the cache blocks"),
    ("refused: context", "is greater than the derived max_model_len"),
    ("refused: free memory", "is less than desired GPU memory utilization"),
]


def without_clock(line: str) -> str:
    """A log line with its throughputs blanked (they depend on the machine and the clock)."""
    return re.sub(r"[\d.]+ tokens/s", "... tokens/s", line)


def refusal(message: str) -> str | None:
    """The ``SYMPTOMS`` key of a startup error message (vLLM 0.33.0's words), or None."""
    for key, words in _REFUSALS:
        if words in message:
            return key
    return None


def symptom_table(keys=None, evidence: dict[str, str] | None = None) -> str:
    """The rows (all, or ``keys``) as an HTML table that fits the column.

    ``evidence``: key -> what a cell on the page measured for that row,
    shown under the symptom.
    """
    rows = []
    for key in (keys or list(SYMPTOMS)):
        s = SYMPTOMS[key]
        seen = html.escape(s.symptom)
        if evidence and key in evidence:
            seen += f"<br/><small><i>{html.escape(evidence[key])}</i></small>"
        rows.append("<tr>" + "".join(f"<td style='vertical-align:top;padding:3px 6px'>{c}</td>" for c in (
            seen, html.escape(s.cause), html.escape(s.change), f"<code>{html.escape(s.metric)}</code>"))
                    + "</tr>")
    head = "".join(f"<th style='text-align:left;padding:3px 6px'>{h}</th>"
                   for h in ("symptom", "cause", "what to change", "metric to watch"))
    return (f"<table class='pagedkv-symptoms' style='font-size:85%;max-width:100%'>"
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")


def burst_figure(runs: dict, burst_at_s: float | None = None):
    """Conversation hit rate per window against minutes, one line per ``sim.conversations`` run.

    ``runs``: label -> ``ConversationRun``; ``burst_at_s`` draws a dashed
    line where the burst arrives.
    """
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("runs must hold at least one ConversationRun, got none")
    fig, ax = plt.subplots(figsize=(6.8, 2.8), constrained_layout=True)
    for label, run in runs.items():
        points = [(t / 60, r * 100) for t, r in run.hit_rates(conversations_only=True) if r is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], lw=1.3, label=label)
    if burst_at_s is not None:
        ax.axvline(burst_at_s / 60, color="grey", ls="--", lw=1)
        ax.annotate("burst", (burst_at_s / 60, 5), textcoords="offset points", xytext=(4, 0), fontsize=8)
    ax.set_xlabel("minutes")
    ax.set_ylabel("conversation hit rate (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8, loc="lower right")
    plt.close(fig)  # shown where the notebook returns it, not twice
    return fig


# ------------------------------------------------- the releases in between

VLLM_REPOSITORY = "https://github.com/vllm-project/vllm"


def release_link(release: str, path: str, first: int, last: int | None = None) -> str:
    """A link to lines of a file of the ``vllm`` package at a release's tag."""
    anchor = f"#L{first}" + (f"-L{last}" if last not in (None, first) else "")
    return f"{VLLM_REPOSITORY}/blob/v{release}/vllm/{path}{anchor}"


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def changed_in(row: dict, order: list[str]) -> str:
    """Where a matrix row's value changed, from its cells (oldest first) and PyPI's release order.

    ``"0.20.0"`` when the last release with the old value and the first with
    the new one are consecutive releases; ``"between 0.24.0 and 0.28.0"``
    when releases between them were not read; ``"-"`` when every cell agrees.
    """
    cells = sorted(row["cells"], key=lambda c: _version_key(c["release"]))
    changes = []
    for before, after in zip(cells, cells[1:]):
        if before["value"] == after["value"]:
            continue
        a, b = order.index(before["release"]), order.index(after["release"])
        changes.append(after["release"] if b == a + 1 else f"between {before['release']} and {after['release']}")
    return "; ".join(changes) or "-"


def version_table(matrix: dict) -> str:
    """The version matrix as an HTML table of three columns that fits the page: the claim, its
    value in each release read (each linked to its source lines at that release's tag), and
    where it changed."""
    head = "".join(f"<th style='text-align:left;padding:3px 6px'>{h}</th>"
                   for h in ("claim", "in the releases read", "changed in"))
    body = []
    for row in matrix["rows"]:
        cells = sorted(row["cells"], key=lambda c: _version_key(c["release"]))
        values = "<br/>".join(
            f"{html.escape(c['release'])}: <a href='{html.escape(release_link(c['release'], c['path'], c['first'], c['last']))}'>"
            f"{html.escape(c['value'])}</a>" for c in cells)
        body.append(f"<tr><td style='vertical-align:top;padding:3px 6px'>{html.escape(row['claim'])}</td>"
                    f"<td style='vertical-align:top;padding:3px 6px'>{values}</td>"
                    f"<td style='vertical-align:top;padding:3px 6px'>"
                    f"{html.escape(changed_in(row, matrix['pypi_order']))}</td></tr>")
    return (f"<table class='pagedkv-versions' style='font-size:85%;max-width:100%'><thead><tr>{head}</tr>"
            f"</thead><tbody>{''.join(body)}</tbody></table>")
