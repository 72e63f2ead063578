"""``AsyncScheduler``: schedule step N+1 while step N runs, as vLLM 0.33.0 does by default.

vLLM's ``AsyncScheduler`` (``vllm/v1/core/sched/async_scheduler.py``) is the
``Scheduler`` plus one rule, and so is ours. When a step is scheduled, each
request whose step will sample a token (its prompt, or recomputation, is
complete after it) gets one **output placeholder**: a token that exists for
the scheduler before it exists at all. The next ``schedule()`` then treats the
request as one token longer than the tokens it knows,

    num_new_tokens = num_tokens + num_output_placeholders - num_computed_tokens

so a running decode is scheduled again, one position further on, and its
next slot is allocated, before the step that samples the token in that slot
has even returned. The rest lives in the base class, where vLLM keeps it too:

* ``update_from_output`` resolves one placeholder per token that arrives, and
  caches the block the step's input filled (its token was a placeholder when
  the step was scheduled, so it had no hash then).
* A running request whose step in flight samples its ``max_tokens``-th token
  is not scheduled again (``num_computed_tokens + 2 - placeholders`` reaches
  ``num_prompt_tokens + max_tokens``): no step is wasted on a known length.
* A stop token cannot be foreseen: the next step was already scheduled, its
  slot allocated and its forward computed; when the stop token arrives the
  request finishes, its blocks are freed, and that step's token is dropped
  (the request is gone when its output arrives).
* An abort drops the request at once; the output of its steps in flight is
  dropped the same way.
* A preemption resets the placeholders to 0 and marks the request's tokens
  in flight *stale*: their output still arrives and its token is appended
  (the request recomputes it with the rest when it resumes), but it no longer
  moves the counters the preemption reset.

The engine drives it with a queue of two batches (``LLMEngine.step``).
"""

from __future__ import annotations

from .scheduler import Scheduler, SchedulerOutput

__all__ = ["AsyncScheduler"]


class AsyncScheduler(Scheduler):
    """vLLM's ``AsyncScheduler``: a ``Scheduler`` that counts output placeholders (same arguments)."""

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        """Advance progress (the base class), then give each request that samples this step a placeholder."""
        super()._update_after_schedule(out)
        for rid in out.num_scheduled_tokens:
            request = self.requests[rid]
            if request.num_computed_tokens < request.num_tokens + request.num_output_placeholders:
                continue  # a prompt chunk that is not the last: this step samples nothing
            request.num_output_placeholders += 1
