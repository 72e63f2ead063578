"""A server's own startup log, read back: the lines vLLM 0.33.0 prints, and the pool they imply.

``read_startup_log`` picks out "Model loading took", "Total non KV cache
memory" (printed at DEBUG only), "Available KV cache memory", the capacity
line ("GPU KV cache size: N tokens", "Maximum concurrency for ... tokens per
request"), the startup refusal about free memory and the usage summary after
CUDA-graph capture ("Actual usage is ...", in every wording from 0.10.2 to
0.33.0: ``USAGE_WORDINGS``); ``size_from_log`` turns
them, with the model's spec, into the pool, its blocks and the concurrency for
a workload, with the arithmetic of :mod:`pagedkv.budget`; ``server_log_lines``
prints what a plan would make a server log.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .budget import (GiB, KiB, BudgetPlan, ModelSpec, block_bytes, blocks_per_request, format_gib,
                     model_spec, paged_ceiling, resolve_kv_dtype, startup_log_lines)
from .common import cdiv, check_int, check_real


_NUM = r"([0-9][0-9,]*(?:\.[0-9]+)?)"
_LOG_PATTERNS = {
    "model_loading_gib": re.compile(r"Model loading took " + _NUM + r" ?GiB"),
    "non_kv_gib": re.compile(r"Total non KV cache memory: " + _NUM + r" ?GiB"),
    "available_kv_gib": re.compile(r"Available KV cache memory: " + _NUM + r" ?GiB"),
    "kv_cache_tokens": re.compile(r"KV cache size: " + _NUM + r" tokens"),
    "concurrency": re.compile(r"Maximum concurrency for " + _NUM + r" tokens per request: " + _NUM + r"x"),
    # The usage summary's first two sentences; any whitespace for a space, as its
    # third ("Actual usage is", below), so a wrapped summary reads whole.
    "free_total": re.compile(r"Free\s+memory\s+on\s+device[^(]*\(" + _NUM + "/" + _NUM
                             + r"\s+GiB\)\s+on\s+startup"),
    "utilization": re.compile(r"Desired\s+GPU\s+memory\s+utilization\s+is\s+\(" + _NUM + r",\s+" + _NUM
                              + r"\s+GiB\)"),
    "cudagraph_estimate_gib": re.compile(r"CUDA graph pool memory: " + _NUM + r" GiB \(actual\), " + _NUM
                                         + r" GiB \(estimated\)"),
}

# The summary the worker prints once the CUDA graphs are captured, without
# --kv-cache-memory: "Free memory on device (F/T GiB) on startup. Desired GPU
# memory utilization is (U, R GiB). Actual usage is ... Replace
# gpu_memory_utilization config with `--kv-cache-memory=N` ... Current kv cache
# memory in use is ...". Its "Actual usage is" sentence, by release, each read
# from that release's wheel (v1/worker/gpu_worker.py, the f-string assigned to
# ``msg`` and logged in ``compile_or_warm_up_model``, ``_compile_or_warm_up_model`` in 0.33.0; every figure
# rendered as str(round(bytes / 2**30, 2)), by a ``GiB`` lambda up to 0.13.0
# and ``format_gib`` from 0.14.0, which print the same):
#
#   releases         "Actual usage is ..."                       rest of the message      level
#   to 0.10.1.1      (no such line)
#   0.10.2           W GiB for weight, P GiB for peak            `--kv-cache-memory=N`,   INFO
#                    activation, N GiB for non-torch memory,     "... in use is B bytes."
#                    and G GiB for CUDAGraph memory
#                    (gpu_worker.py:372-391)
#   0.11.0-0.26.0    the same four figures                       "(X GiB)" after each N,  DEBUG to 0.25.1,
#                    (0.11.0 gpu_worker.py:372-393,              "... in use is X GiB."   INFO from 0.26.0
#                    0.26.0 gpu_worker.py:835-857)
#   0.27.0-0.33.0    C GiB for consumed memory (weights +        as 0.11.0                INFO
#                    non-torch), P GiB for peak activation, and
#                    G GiB for CUDAGraph memory
#                    (0.27.0 gpu_worker.py:767-789,
#                    0.33.0 gpu_worker.py:1044-1066)
#
# Only the sentence is read (the rest of the message adds nothing to size
# with, and a line cut after "CUDAGraph memory." still reads). Spaces match
# any whitespace, so a wrapped line reads too; a figure may be negative
# (non-torch memory can shrink while profiling). A sentence in no wording
# here is refused by name: it is not silently taken for another.
_FIGURE = r"(-?[0-9][0-9,]*(?:\.[0-9]+)?)"


def _wording(template: str) -> re.Pattern:
    """The sentence ``template`` (each figure a ``{}``) as a pattern: literal text, any whitespace for a space."""
    parts = [re.sub(r"\\ ", r"\\s+", re.escape(part)) for part in template.split("{}")]
    return re.compile(_FIGURE.join(parts))


#: (releases, the figures in their order, pattern) for each wording of "Actual usage is ...".
USAGE_WORDINGS = (
    ("0.10.2-0.26.0", ("weights_gib", "activation_gib", "non_torch_gib", "cudagraph_gib"),
     _wording("Actual usage is {} GiB for weight, {} GiB for peak activation, {} GiB for non-torch memory, "
              "and {} GiB for CUDAGraph memory")),
    ("0.27.0-0.33.0", ("consumed_gib", "activation_gib", "cudagraph_gib"),
     _wording("Actual usage is {} GiB for consumed memory (weights + non-torch), {} GiB for peak activation, "
              "and {} GiB for CUDAGraph memory")),
)
_USAGE_START = re.compile(r"Actual\s+usage\s+is\b")


def _read_usage(text: str) -> dict:
    """The last "Actual usage is" sentence's figures (with ``usage_releases``), or {} when there is none.

    ``ValueError`` naming the sentence when one of them is in no known wording.
    """
    found: dict = {}
    for start in _USAGE_START.finditer(text):
        for releases, names, pattern in USAGE_WORDINGS:
            m = pattern.match(text, start.start())
            if m:
                found = dict(zip(names, map(_number, m.groups())), usage_releases=releases)
                break
        else:
            end = text.find("\n", start.start())
            sentence = text[start.start():end if end >= 0 else len(text)][:200]
            raise ValueError(f"the 'Actual usage is ...' sentence {sentence!r} is in none of the wordings vLLM "
                             f"{USAGE_WORDINGS[0][0].split('-')[0]} to {USAGE_WORDINGS[-1][0].split('-')[1]} "
                             f"prints ({'; '.join(w[0] for w in USAGE_WORDINGS)}): is it cut, edited, or from "
                             f"another release?")
    if "weights_gib" in found:  # the four-figure wording: consumed is weights + non-torch, as 0.27.0 names it
        found["consumed_gib"] = round(found["weights_gib"] + found["non_torch_gib"], 2)
    return found


def _number(text: str) -> float:
    return float(text.replace(",", ""))


@dataclass(frozen=True)
class StartupLog:
    """The sizing figures a vLLM 0.33.0 server printed at startup (None: the line was not there).

    All GiB figures are vLLM's, rounded to two decimals (``format_gib``):

    * ``model_loading_gib``: "Model loading took X GiB memory" (INFO): the
      weights on this rank.
    * ``non_kv_gib``: "Total non KV cache memory: X GiB" (DEBUG: only with
      ``VLLM_LOGGING_LEVEL=DEBUG``): weights, non-torch memory and the
      activation peak of the profiling pass. Not the CUDA-graph estimate:
      vLLM profiles the graphs after this figure is taken and subtracts
      their estimate from the budget separately.
    * ``cudagraph_estimate_gib``: the estimate in "CUDA graph pool memory: X
      GiB (actual), Y GiB (estimated)" (INFO, printed after the graphs are
      captured, when the estimate was not 0).
    * ``available_kv_gib``: "Available KV cache memory: X GiB" (INFO): the pool.
    * ``kv_cache_tokens``, ``max_model_len``, ``max_concurrency``: "GPU KV cache
      size: N tokens, Maximum concurrency for L tokens per request: C x" (INFO).
    * ``free_gib``, ``total_gib``, ``gpu_memory_utilization``,
      ``requested_gib``, ``consumed_gib``, ``activation_gib``,
      ``cudagraph_gib``: the INFO message after CUDA graphs are captured
      ("Free memory on device (F/T GiB) on startup. Desired GPU memory
      utilization is (U, R GiB). Actual usage is ..."). ``consumed_gib`` is
      weights + non-torch memory: printed as one figure from 0.27.0; from
      0.10.2 to 0.26.0 the sentence prints ``weights_gib`` and
      ``non_torch_gib`` apart (None from later releases) and
      ``consumed_gib`` is their sum, to the log's rounding (0.01 GiB).
      There, the peak activation is torch's peak increase alone; from 0.27.0
      it holds the CUDA-graph estimate vLLM subtracted, when applied.
      ``usage_releases`` names the wording read (``USAGE_WORDINGS``).
    """

    model_loading_gib: float | None = None
    non_kv_gib: float | None = None
    available_kv_gib: float | None = None
    kv_cache_tokens: int | None = None
    max_model_len: int | None = None
    max_concurrency: float | None = None
    free_gib: float | None = None
    total_gib: float | None = None
    gpu_memory_utilization: float | None = None
    requested_gib: float | None = None
    consumed_gib: float | None = None
    activation_gib: float | None = None
    cudagraph_gib: float | None = None
    cudagraph_estimate_gib: float | None = None
    weights_gib: float | None = None
    non_torch_gib: float | None = None
    usage_releases: str | None = None

    @property
    def derived_non_kv_gib(self) -> float | None:
        """What the budget gave everything but the pool, weights included:
        what :func:`pagedkv.budget.plan` takes as ``logged_non_kv_gib``.

        vLLM 0.33.0's pool is ``requested - non-KV - CUDA-graph estimate``,
        so this is, in order of preference: requested - available (both
        INFO, exact to the log's rounding); else the DEBUG line's "Total non
        KV cache memory" plus the estimate of the "CUDA graph pool memory"
        line; else None. The DEBUG line alone is not enough: it leaves out
        the estimate, which is on by default, and a log without the estimate
        line does not say whether it was 0.
        """
        if self.requested_gib is not None and self.available_kv_gib is not None:
            return round(self.requested_gib - self.available_kv_gib, 2)
        if self.non_kv_gib is not None and self.cudagraph_estimate_gib is not None:
            return round(self.non_kv_gib + self.cudagraph_estimate_gib, 2)
        return None

    @property
    def allowance_gib(self) -> float | None:
        """Non-KV memory without the weights: what :func:`plan` calls
        ``non_kv_gib`` (activation peak, non-torch memory, CUDA-graph
        estimate): :attr:`derived_non_kv_gib` minus "Model loading took"."""
        total = self.derived_non_kv_gib
        if total is None or self.model_loading_gib is None:
            return None
        return round(total - self.model_loading_gib, 2)


def read_startup_log(text: str) -> StartupLog:
    """The sizing figures in a server's startup log (any prefix, any order; the last of each wins).

    ``ValueError`` when the text holds none of them, when "Available KV
    cache memory" is missing (without the pool there is nothing to size), or
    when an "Actual usage is" sentence is in none of ``USAGE_WORDINGS``.
    """
    if not isinstance(text, str):
        raise TypeError(f"the log must be a str, got {type(text).__name__}")
    found: dict = {}
    for key, pattern in _LOG_PATTERNS.items():
        matches = pattern.findall(text)
        if not matches:
            continue
        last = matches[-1]
        if key == "concurrency":
            found["max_model_len"], found["max_concurrency"] = int(_number(last[0])), _number(last[1])
        elif key == "free_total":
            found["free_gib"], found["total_gib"] = _number(last[0]), _number(last[1])
        elif key == "utilization":
            found["gpu_memory_utilization"], found["requested_gib"] = _number(last[0]), _number(last[1])
        elif key == "cudagraph_estimate_gib":
            found[key] = _number(last[1])
        elif key == "kv_cache_tokens":
            found[key] = int(_number(last))
        else:
            found[key] = _number(last)
    found.update(_read_usage(text))
    if "available_kv_gib" not in found:
        raise ValueError("the log has no 'Available KV cache memory: X GiB' line (vLLM prints it at INFO "
                         "once the pool is sized); without the pool there is nothing to size")
    return StartupLog(**found)


def blocks_from_log_tokens(kv_cache_tokens: int, max_model_len: int, block_size: int) -> int:
    """The pool's blocks (null block included) behind "GPU KV cache size: N tokens".

    vLLM prints ``int(num_blocks / cdiv(L, B) * L)`` for ``L = max_model_len``
    (one KV-cache group); this inverts it exactly, float rounding included.
    """
    check_int(kv_cache_tokens, "kv_cache_tokens", 0)
    per_request = cdiv(check_int(max_model_len, "max_model_len", 1), check_int(block_size, "block_size", 1))
    guess = kv_cache_tokens * per_request // max_model_len
    for n in range(max(guess - 2, 0), guess + 4):
        if int(n / per_request * max_model_len) == kv_cache_tokens:
            return n
    raise ValueError(f"no block count prints {kv_cache_tokens:,} tokens at max_model_len={max_model_len:,} "
                     f"and block_size={block_size}: is block_size the server's?")


@dataclass(frozen=True)
class LogSizing:
    """Pool, blocks and concurrency for one workload, read from a server's startup log.

    ``num_blocks`` includes the null block; ``usable_blocks`` does not. When
    the log has the capacity line, ``num_blocks`` comes from it exactly and
    ``blocks_from_pool`` (the pool's GiB, rounded by the log, divided by one
    block's bytes) is a cross-check: a mismatch of more than a few blocks
    means the model, dtype, block size or TP given here is not the server's.
    """

    model: str
    kv_cache_dtype: str
    tensor_parallel_size: int
    block_size: int
    pool_bytes: float
    block_bytes: int
    num_blocks: int
    blocks_from_pool: int
    request_len: int
    blocks_per_request: int
    concurrency: int
    non_kv_gib: float | None
    log: StartupLog

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def consistent(self) -> bool:
        """The capacity line's blocks agree with the pool's within the log's rounding (0.005 GiB)."""
        slack = math.ceil(0.005 * GiB / self.block_bytes) + 1
        return abs(self.num_blocks - self.blocks_from_pool) <= slack

    def rows(self) -> list[tuple[str, str]]:
        rows = [("KV pool per GPU (Available KV cache memory)", f"{self.pool_bytes / GiB:.2f} GiB"),
                ("one block, all layers", f"{self.block_bytes / KiB:,.0f} KiB"),
                ("blocks (null block included)", f"{self.num_blocks:,}"),
                (f"blocks per {self.request_len:,}-token request", f"{self.blocks_per_request:,}"),
                ("requests at full length, at once", f"{self.concurrency:,}")]
        if self.non_kv_gib is not None:
            rows.insert(1, ("non-KV memory (weights, activations, graphs)", f"{self.non_kv_gib:.2f} GiB"))
        return rows


def size_from_log(log: str | StartupLog, model: str | ModelSpec, request_len: int, block_size: int = 16,
                  kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1) -> LogSizing:
    """The sizing procedure, from a server's own startup lines.

    1. The pool is "Available KV cache memory" (per GPU: each rank sizes
       its own).
    2. One block costs ``block_size x 2 x kv_heads_per_rank x head_dim x
       bytes x layers`` (:func:`block_bytes`).
    3. The blocks are the capacity line's tokens turned back into blocks
       (:func:`blocks_from_log_tokens`), or, without it, the pool divided by
       one block.
    4. A request of ``request_len`` tokens (prompt + output) holds
       ``cdiv(request_len, block_size)`` blocks at its end; the usable blocks
       (the null block held back) over that is how many run at full length
       at once. More are admitted (admission looks at the prompt), and then
       preempted as they grow.
    """
    entry = log if isinstance(log, StartupLog) else read_startup_log(log)
    m = model_spec(model)
    dtype = resolve_kv_dtype(kv_cache_dtype, m)
    tp = check_int(tensor_parallel_size, "tensor_parallel_size", 1)
    per_block = block_bytes(m, block_size, dtype, tp)
    pool = entry.available_kv_gib * GiB
    from_pool = int(pool // per_block)
    if entry.kv_cache_tokens is not None and entry.max_model_len is not None:
        blocks = blocks_from_log_tokens(entry.kv_cache_tokens, entry.max_model_len, block_size)
    else:
        blocks = from_pool
    per_request = blocks_per_request(request_len, block_size)
    return LogSizing(model=m.name, kv_cache_dtype=str(dtype), tensor_parallel_size=tp, block_size=block_size,
                     pool_bytes=pool, block_bytes=per_block, num_blocks=blocks, blocks_from_pool=from_pool,
                     request_len=request_len, blocks_per_request=per_request,
                     concurrency=paged_ceiling(blocks, request_len, block_size), non_kv_gib=entry.derived_non_kv_gib,
                     log=entry)


def server_log_lines(p: BudgetPlan, load_seconds: float = 0.0, profile_seconds: float = 0.0,
                     kv_cache_device: str = "GPU", cudagraph_gib: float = 0.0) -> list[str]:
    """The startup lines vLLM 0.33.0 prints for a plan, as :func:`read_startup_log` reads them.

    In the order a server prints them: the model-loading line (INFO), the
    profiling result (DEBUG), the pool and the capacity line (INFO), the
    CUDA-graph line (INFO, only when ``cudagraph_gib`` > 0) and the usage
    summary after capture (INFO, "Free memory on device ... Actual usage
    is ...").

    The plan's non-KV allowance is split as vLLM splits it: ``cudagraph_gib``
    of it is the CUDA-graph estimate (its actual pool taken equal to it) and
    the rest the activation peak, which is all the DEBUG line's "Total non KV
    cache memory" adds to the weights (non-torch memory is modelled as 0, and
    the GPU as idle at startup: free = total). These are *our* arithmetic in
    vLLM's words: on a real server, read its own lines instead.
    """
    graphs = check_real(cudagraph_gib, "cudagraph_gib", minimum=0) * GiB
    if graphs > p.non_kv_bytes:
        raise ValueError(f"cudagraph_gib must be at most the plan's non-KV allowance "
                         f"({p.non_kv_bytes / GiB:.2f} GiB), got {cudagraph_gib!r}")
    activation = p.non_kv_bytes - graphs
    w = format_gib(p.weight_bytes)
    lines = [f"Model loading took {w} GiB memory and {load_seconds:.6f} seconds",
             f"Memory profiling takes {profile_seconds:.2f} seconds. Total non KV cache memory: "
             f"{format_gib(p.weight_bytes + activation)}GiB; torch peak memory increase: "
             f"{format_gib(activation)}GiB; total consumed (from mem_get_info): {w}GiB; "
             f"weights memory: {w}GiB.",
             *startup_log_lines(p)]
    if kv_cache_device != "GPU":
        lines[-1] = lines[-1].replace("GPU KV cache size", f"{kv_cache_device} KV cache size", 1)
    if graphs > 0:
        g = format_gib(graphs)
        lines.append(f"CUDA graph pool memory: {g} GiB (actual), {g} GiB (estimated), "
                     f"difference: 0.0 GiB (0.0%).")
    # vLLM's summary adds the actual graph pool to a peak that already holds
    # the estimate, then keeps 150 MiB spare (gpu_worker.py, compile_or_warm_up).
    requested = math.ceil(p.total_bytes * p.gpu_memory_utilization)
    non_kv = p.weight_bytes + activation + 2 * graphs
    to_requested = int(requested - non_kv - 150 * 2**20)
    to_gpu = int(p.total_bytes - non_kv - 150 * 2**20)
    total = format_gib(p.total_bytes)
    lines.append(
        f"Free memory on device ({total}/{total} GiB) on startup. Desired GPU memory utilization is "
        f"({p.gpu_memory_utilization}, {format_gib(requested)} GiB). Actual usage is {w} GiB for "
        f"consumed memory (weights + non-torch), {format_gib(activation + graphs)} GiB for peak "
        f"activation, and {format_gib(graphs)} GiB for CUDAGraph memory. Replace "
        f"gpu_memory_utilization config with `--kv-cache-memory={to_requested}` "
        f"({format_gib(to_requested)} GiB) to fit into requested memory, or "
        f"`--kv-cache-memory={to_gpu}` ({format_gib(to_gpu)} GiB) to fully utilize gpu memory. "
        f"Current kv cache memory in use is {format_gib(p.pool_bytes)} GiB.")
    return lines
