"""A small serving engine over the paged KV cache, shaped like vLLM V1.

One concept per module:

- ``args``: ``EngineArgs``, the knobs with ``vllm serve``'s names and a CLI mapping;
- ``sampling``: ``SamplingParams`` (vLLM's names and defaults) and the batched sampler;
- ``request``: ``EngineRequest`` (status, sampling parameters, stop rules), ``RequestOutput``
  and ``Logprob``;
- ``parallel_sampling``: ``n > 1``, one prompt fanned out into n child requests, their
  outputs gathered into one;
- ``scheduler``: ``Scheduler`` (running list, waiting queue, preemption,
  prefix hits, chunked prefill) and its per-step ``SchedulerOutput``;
- ``async_scheduler``: ``AsyncScheduler``, the scheduler with output placeholders
  that lets the engine schedule step N+1 before step N's tokens arrive;
- ``sizing``: how many blocks the pool gets, and the startup check;
- ``worker``: block-table rows, KV caches, the forward pass and sampling;
- ``stats``: ``EngineStats`` and vLLM's periodic log line;
- ``llm_engine``: ``LLMEngine``, which ties them together and calls step
  listeners after every step (the views in ``pagedkv.views`` attach there; the
  engine never imports them).
- ``llm``: ``LLM``, vLLM's offline API (``generate``, ``chat``) over ``LLMEngine``.

Where we differ from vLLM 0.33's V1 engine (each choice, in one sentence):

- One process: under async scheduling (on by default, as in vLLM) a
  ``step()`` schedules step N+1, applies step N's output, then runs N+1's
  forward pass; vLLM runs N+1's forward on the GPU while it applies N's output.
- Each ``step()`` is called by the caller, as in vLLM's in-process engine
  core: after the last request finishes, the idle step that reports the
  finished ids (vLLM's background engine core takes it on its own) comes with
  the next ``step()``, or before the next request is queued.
- ``kv_cache_memory_bytes`` left at None means "profile" on a GPU and 1 GiB on a CPU.
- The prefix-cache hit rate is cumulative since the engine started (vLLM's
  logger reports the last 1,000 requests); like vLLM it counts admissions of
  requests never preempted.
- The stats interval is counted in steps and throughput is tokens per second
  of step time (vLLM: seconds between log lines, wall time).
- When some running requests sit a step out, the worker hands the attention
  kernel only the scheduled rows of the block table (vLLM passes every row).
- A finished or aborted request's block-table row goes as soon as it
  finishes (vLLM's runner drops it at the next step, from
  ``finished_req_ids``), so between steps the table holds the running requests.
- An aborted request's final output (``finish_reason="abort"``) arrives with
  the next ``step()``.
- ``LLMEngine.add_request`` and ``LLMEngine.generate`` without
  ``SamplingParams`` are greedy, so that token-id runs are deterministic
  (vLLM's default temperature is 1.0; ``SamplingParams()`` and
  ``LLM.generate``'s default here have it too).
- Sampling noise is a hash of (seed, tokens generated so far, token id), not
  a generator's stream, so a seeded output does not depend on its batch.
- A request that cannot be admitted even into an empty batch raises
  ``RuntimeError`` instead of waiting forever.
- ``n > 1`` is reported as ``LLM.generate`` gets it in vLLM (``FINAL_ONLY``):
  ``step()`` returns one aggregated output when the last child finishes; vLLM's
  ``LLMEngine.step`` (``CUMULATIVE`` by default) streams each child's output.
  There is no ``SamplingParams.output_kind``.
- ``logprobs`` is not capped: up to the vocabulary size, -1 included (vLLM
  rejects more than ``max_logprobs`` (``config/model.py:286``), 20 by default).
"""

from .args import CLI_FLAGS, KERNEL_BACKENDS, EngineArgs
from .llm import LLM
from .llm_engine import LLMEngine
from .parallel_sampling import ParentRequest
from .request import CompletionOutput, EngineRequest, Logprob, RequestOutput, RequestStatus
from .sampling import SamplingParams
from .async_scheduler import AsyncScheduler
from .scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput, WaitingQueue, preempt_last_running
from .sizing import PoolSize
from .stats import EngineStats
from .worker import Worker

__all__ = [
    "CLI_FLAGS", "KERNEL_BACKENDS", "EngineArgs", "LLM", "LLMEngine", "SamplingParams", "EngineRequest",
    "RequestOutput", "CompletionOutput", "Logprob", "ParentRequest",
    "RequestStatus", "Scheduler", "AsyncScheduler", "SchedulerOutput", "ModelRunnerOutput", "WaitingQueue", "preempt_last_running", "PoolSize",
    "EngineStats", "Worker",
]
