"""A small serving engine over the paged KV cache, shaped like vLLM V1.

One concept per module:

- ``args``: ``EngineArgs``, the knobs with ``vllm serve``'s names and a CLI mapping;
- ``request``: ``EngineRequest`` (status, stop rules) and ``RequestOutput``;
- ``scheduler``: ``Scheduler`` (running list, waiting queue, preemption,
  prefix hits, chunked prefill) and its per-step ``SchedulerOutput``;
- ``sizing``: how many blocks the pool gets, and the startup check;
- ``worker``: block-table rows, KV caches, the forward pass and greedy sampling;
- ``stats``: ``EngineStats`` and vLLM's periodic log line;
- ``llm_engine``: ``LLMEngine``, which ties them together and calls step
  listeners after every step (the views in ``pagedkv.views`` attach there; the
  engine never imports them).

Where we differ from vLLM 0.33's V1 engine (each choice, in one sentence):

- Greedy decoding only, one process, synchronous steps: ``num_computed_tokens``
  advances after the forward pass, where vLLM advances it at scheduling time
  for its asynchronous scheduler; a synchronous engine cannot tell the difference.
- ``watermark`` defaults to 0.01 (vLLM 0.33's scheduler default is 0.0).
- ``kv_cache_memory_bytes`` left at None means "profile" on a GPU and 1 GiB on a CPU.
- The prefix-cache hit rate is cumulative since the engine started (vLLM's
  logger reports the last 1,000 requests); like vLLM it counts admissions of
  requests never preempted.
- The stats interval is counted in steps and throughput is tokens per second
  of step time (vLLM: seconds between log lines, wall time).
- When some running requests sit a step out, the worker hands the attention
  kernel only the scheduled rows of the block table (vLLM passes every row).
- An aborted request's final output (``finish_reason="abort"``) arrives with
  the next ``step()``.
- A request that cannot be admitted even into an empty batch raises
  ``RuntimeError`` instead of waiting forever.
"""

from .args import CLI_FLAGS, KERNEL_BACKENDS, EngineArgs
from .llm_engine import LLMEngine
from .request import EngineRequest, RequestOutput, RequestStatus
from .scheduler import Scheduler, SchedulerOutput, WaitingQueue, preempt_last_running
from .sizing import PoolSize
from .stats import EngineStats
from .worker import Worker

__all__ = [
    "CLI_FLAGS", "KERNEL_BACKENDS", "EngineArgs", "LLMEngine", "EngineRequest", "RequestOutput",
    "RequestStatus", "Scheduler", "SchedulerOutput", "WaitingQueue", "preempt_last_running", "PoolSize",
    "EngineStats", "Worker",
]
