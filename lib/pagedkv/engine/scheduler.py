"""The scheduler: which requests compute how many tokens this step, and who is preempted.

This is vLLM V1's ``Scheduler.schedule`` (``vllm/v1/core/sched/scheduler.py``)
for a single-GPU, text-only engine; ``AsyncScheduler`` (``async_scheduler``)
adds async scheduling's output placeholders. There is no prefill phase and no
decode phase: every request has ``num_tokens`` and ``num_computed_tokens``,
and a step hands each request some tokens so the second catches up with the
first. A prompt is one long catch-up (split across steps by chunked prefill),
a decode is a catch-up of one.

One step, in order:

1. **Running requests**, in admission order, each within the token budget:
   ``allocate_slots`` for its next tokens. When the pool says ``None``, the
   *last* running request is preempted (its blocks freed, tail first; it goes
   back to the *front* of the waiting queue with its tokens kept and
   ``num_computed_tokens = 0``, to be recomputed) and the allocation is
   retried, until it fits or the request has preempted itself. That loop is
   ``preempt_last_running``, a replaceable function.
2. **Waiting requests**, only if nobody was preempted this step (a pool that
   just had to preempt has no room to admit): front first, while
   ``max_num_seqs`` and the budget allow, each looked up in the prefix cache
   (``get_computed_blocks``) and given slots for the rest of its prompt, or
   for the chunk the budget allows. With ``scheduler_reserve_full_isl`` (on
   by default, as in vLLM) a request is admitted only if its *whole* prompt
   fits the free blocks, even when this step computes one chunk of it. The
   first that does not fit stops the admissions (first come, first served).
   An admitted request's prefix-cache lookup is counted then, not before: a
   request refused three times counts once.

Once decided, every scheduled request's ``num_computed_tokens`` advances at
once, before the step runs (``_update_after_schedule``, as vLLM does), so the
next ``schedule()`` could be called before this step's tokens arrive. The
decisions of a step come back as a ``SchedulerOutput``, which the worker
executes and a chapter can print; ``update_from_output`` applies its tokens.

Two of vLLM's latency knobs change the steps above. ``long_prefill_token_threshold``
caps the tokens any one request computes in a step (a long prompt then takes
several steps and leaves budget to the others). ``policy="priority"`` orders
the waiting queue by ``(priority, arrival)`` instead of arrival alone, and
step 1 preempts the running request of the largest ``(priority, arrival)``
instead of the last admitted; a request that preempted itself no longer stops
the loop, since the requests after it rank higher.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..common import cdiv, check_bool, check_int, require
from ..free_queue import KVCacheBlock
from ..kv_cache_manager import KVCacheBlocks, KVCacheManager
from .request import EngineRequest, RequestStatus
from .request_queue import SCHEDULING_POLICIES, PriorityWaitingQueue, WaitingQueue

__all__ = ["SchedulerOutput", "ModelRunnerOutput", "Scheduler", "WaitingQueue", "preempt_last_running",
           "preempt_lowest_priority", "AllocateWithPreemption"]

#: ``(scheduler, request, num_new_tokens) -> new blocks, or None``: see ``preempt_last_running``.
AllocateWithPreemption = Callable[["Scheduler", EngineRequest, int], "list[KVCacheBlock] | None"]


def preempt_last_running(scheduler: "Scheduler", request: EngineRequest,
                         num_new_tokens: int) -> list[KVCacheBlock] | None:
    """Find room for a running request's next tokens, preempting from the back (vLLM V1, FCFS).

    Contract of any replacement (``Scheduler(allocate_with_preemption=...)``):

    * call ``scheduler.kv_cache_manager.allocate_slots(request, num_new_tokens)``
      and return its blocks once it succeeds;
    * to make room, call ``scheduler.preempt(victim)`` for a request in
      ``scheduler.running`` (it frees the victim's blocks and requeues it);
    * return ``None`` when the request cannot run this step; by vLLM's rule
      this happens exactly when the request has preempted itself.
    """
    while True:
        new_blocks = scheduler.kv_cache_manager.allocate_slots(request, num_new_tokens)
        if new_blocks is not None:
            return new_blocks
        victim = scheduler.running[-1]  # the latest admitted: the least work lost
        scheduler.preempt(victim)
        if victim is request:
            return None


def preempt_lowest_priority(scheduler: "Scheduler", request: EngineRequest,
                            num_new_tokens: int) -> list[KVCacheBlock] | None:
    """``--scheduling-policy priority``'s loop: the victim is the running request of the largest
    ``(priority, arrival)``, wherever it sits in ``running``, even one already given tokens this
    step (``preempt`` gives its tokens back to the budget). Same contract as ``preempt_last_running``."""
    while True:
        new_blocks = scheduler.kv_cache_manager.allocate_slots(request, num_new_tokens)
        if new_blocks is not None:
            return new_blocks
        victim = max(scheduler.running, key=lambda r: (r.priority, r.arrival))
        scheduler.preempt(victim)
        if victim is request:
            return None


@dataclass
class ModelRunnerOutput:
    """What the worker hands back after a step (vLLM's name), applied by ``Scheduler.update_from_output``.

    Attributes:
        sampled_token_ids: request id -> the token sampled for it, for each
            request whose prompt (or recomputation) is complete after the step.
        logprobs: request id -> ``(logprob, rank, [(token id, logprob), ...top k])``
            of its sampled token, taken from the raw logits (before the
            ``min_tokens`` mask), for the requests that asked for logprobs.
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, tuple[float, int, list[tuple[int, float]]]] = field(default_factory=dict)


@dataclass
class SchedulerOutput:
    """What one ``schedule()`` decided, in the order it decided it.

    Attributes:
        step: 1 for the first step.
        scheduled_new_reqs: requests admitted for the first time.
        scheduled_resumed_reqs: preempted requests admitted again (recomputed).
        scheduled_running_reqs: requests that were running and got tokens.
        num_scheduled_tokens: request id -> tokens computed this step; running
            requests first, in running order, then the admitted ones.
        total_num_scheduled_tokens: their sum, set by ``schedule`` (0: nothing
            runs this step).
        num_computed_tokens: request id -> tokens already in the cache when the
            step starts (its first position this step; prefix hits included).
        num_prefix_hit_tokens: admitted request id -> tokens served by the
            prefix cache instead of computed.
        new_block_ids: request id -> blocks for the worker's table: an admitted
            request's whole block list (hits included), a running request's
            newly appended blocks (possibly none); KV-cache group 0's.
        new_block_ids_by_group: the same, one list per KV-cache group, as
            vLLM's ``SchedulerOutput`` carries them (what the worker reads).
        preempted_req_ids: preempted this step, in order.
        finished_req_ids: finished or aborted since the previous step.
        cow_pairs: ``(src, dst)`` block copies to run before the forward pass.
    """

    step: int
    scheduled_new_reqs: list[str] = field(default_factory=list)
    scheduled_resumed_reqs: list[str] = field(default_factory=list)
    scheduled_running_reqs: list[str] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    num_computed_tokens: dict[str, int] = field(default_factory=dict)
    num_prefix_hit_tokens: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    new_block_ids_by_group: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    cow_pairs: list[tuple[int, int]] = field(default_factory=list)

    def decisions(self) -> tuple:
        """The decisions alone, comparable across implementations (the checker compares these)."""
        return (tuple(self.scheduled_new_reqs), tuple(self.scheduled_resumed_reqs),
                tuple(self.scheduled_running_reqs), tuple(self.num_scheduled_tokens.items()),
                tuple(self.preempted_req_ids),
                tuple((r, tuple(b)) for r, b in self.new_block_ids.items()))

    def summary(self) -> str:
        """One line: who ran how many tokens, who was admitted or preempted."""
        parts = []
        for rid, n in self.num_scheduled_tokens.items():
            tag = "+" if rid in self.scheduled_running_reqs else ("resume " if rid in self.scheduled_resumed_reqs
                                                                   else "new ")
            hit = self.num_prefix_hit_tokens.get(rid, 0)
            parts.append(f"{tag}{rid}:{n}" + (f" (hit {hit})" if hit else ""))
        text = f"step {self.step}: " + (", ".join(parts) if parts else "nothing scheduled")
        if self.preempted_req_ids:
            text += f"; preempted {', '.join(self.preempted_req_ids)}"
        if self.cow_pairs:
            text += f"; copy {', '.join(f'{s}->{d}' for s, d in self.cow_pairs)}"
        return text

    def describe(self) -> str:
        """Several lines, one per decision, as a chapter prints them."""
        lines = [f"step {self.step}: {self.total_num_scheduled_tokens} tokens"]
        for rid, n in self.num_scheduled_tokens.items():
            kind = ("running" if rid in self.scheduled_running_reqs
                    else "resumed" if rid in self.scheduled_resumed_reqs else "new")
            start = self.num_computed_tokens[rid]
            line = f"  {kind:8}{rid}: positions {start}..{start + n - 1} ({n} tokens)"
            if self.num_prefix_hit_tokens.get(rid):
                line += f", {self.num_prefix_hit_tokens[rid]} from the prefix cache"
            if self.new_block_ids.get(rid):
                line += f", blocks {'+' if kind == 'running' else ''}{self.new_block_ids[rid]}"
            lines.append(line)
        if self.preempted_req_ids:
            lines.append(f"  preempted: {', '.join(self.preempted_req_ids)}")
        if self.cow_pairs:
            lines.append(f"  copy-on-write: {self.cow_pairs}")
        if self.finished_req_ids:
            lines.append(f"  finished since last step: {', '.join(self.finished_req_ids)}")
        return "\n".join(lines)


class Scheduler:
    """vLLM V1's scheduler over a ``KVCacheManager``: a running list and a waiting queue.

    Args:
        kv_cache_manager: the pool's manager (its ``free`` and ``allocate_slots`` are used).
        max_num_seqs: most running requests.
        max_num_batched_tokens: token budget of a step.
        max_model_len: longest sequence; prompts must be shorter.
        enable_chunked_prefill: split prompts across steps.
        allocate_with_preemption: the preemption loop,
            ``(scheduler, request, num_new_tokens) -> blocks | None``
            (default ``preempt_last_running``).
        scheduler_reserve_full_isl: vLLM's name and default (True): admit a
            waiting request only if its whole prompt (its full input
            sequence length) fits the free blocks, not just this step's
            chunk; False checks only the chunk (see ``whole_prompt_fits``).
        long_prefill_token_threshold: vLLM's name and default (0: off). A
            request computes at most this many tokens a step, so a long
            prompt leaves budget to the requests behind it; not applied
            when only one request is running or waiting (nobody to starve).
        long_prefill_token_threshold_adaptive: vLLM's (False): raise the cap
            to ``max_num_batched_tokens // (running + waiting)`` when larger.
        policy: ``"fcfs"`` (vLLM's default) or ``"priority"``: the waiting
            queue is ordered by ``(priority, arrival)`` (smaller first), and
            the running request of the largest is the one preempted
            (``preempt_lowest_priority``).

    ``running`` is a list in admission order (a resumed request rejoins at the
    end); ``waiting`` a ``WaitingQueue``; ``requests`` every unfinished request
    by id.
    """

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True,
                 allocate_with_preemption: AllocateWithPreemption | None = None,
                 scheduler_reserve_full_isl: bool = True, long_prefill_token_threshold: int = 0,
                 long_prefill_token_threshold_adaptive: bool = False, policy: str = "fcfs") -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        check_int(long_prefill_token_threshold, "long_prefill_token_threshold", 0)
        if long_prefill_token_threshold > max_model_len:  # vLLM's SchedulerConfig refuses it too
            raise ValueError(f"long_prefill_token_threshold ({long_prefill_token_threshold}) cannot be "
                             f"greater than max_model_len ({max_model_len})")
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.scheduler_reserve_full_isl = check_bool(scheduler_reserve_full_isl, "scheduler_reserve_full_isl")
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.long_prefill_token_threshold_adaptive = check_bool(
            long_prefill_token_threshold_adaptive, "long_prefill_token_threshold_adaptive")
        self.policy = policy
        default = preempt_lowest_priority if policy == "priority" else preempt_last_running
        self.allocate_with_preemption: AllocateWithPreemption = allocate_with_preemption or default
        self.running: list[EngineRequest] = []
        self.waiting = PriorityWaitingQueue() if policy == "priority" else WaitingQueue()
        self.requests: dict[str, EngineRequest] = {}
        self.step_count = 0
        self.num_preemptions = 0  # total, since the scheduler was built
        # Prefix-cache hits counted at admission of never-preempted requests (vLLM's rule).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._finished_since_last_step: list[str] = []
        self._out: SchedulerOutput | None = None  # the step being decided
        self._token_budget = 0
        self.prefill_cap = 0  # the long_prefill_token_threshold of the step being decided (0: no cap)

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineRequest) -> None:
        """Queue a new request (validated here; on error nothing changes)."""
        if not isinstance(request, EngineRequest):
            raise TypeError(f"expected an EngineRequest, got {type(request).__name__} {request!r}")
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use by an unfinished request")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(f"request {rid!r}: the prompt ({request.num_tokens} tokens) plus at least one "
                             f"generated token does not fit max_model_len={self.max_model_len}")
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> EngineRequest:
        """Finish an unfinished request now: its blocks go back, its status becomes aborted."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}")
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"request {request_id!r} is not an unfinished request (unknown, finished or "
                           "already aborted)")
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request_id)
        request.status = RequestStatus.FINISHED_ABORTED
        self._free_request(request)
        return request

    def _free_request(self, request: EngineRequest) -> None:
        """A finished request (its status already says so) gives back its blocks and leaves ``requests``.

        It is out of ``running`` and ``waiting`` already; the next
        ``SchedulerOutput`` lists it in ``finished_req_ids``.
        """
        self.kv_cache_manager.free(request)  # a request that holds no blocks frees nothing
        del self.requests[request.request_id]
        self._finished_since_last_step.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_finished_requests(self) -> bool:
        """Requests finished (or aborted) since the last step, whose ids the next ``schedule()`` reports."""
        return bool(self._finished_since_last_step)

    def has_requests(self) -> bool:
        """vLLM's test for whether the engine must step: unfinished requests, or finished ones not yet reported.

        So after the last request finishes there is one more step, an idle
        one: nothing is scheduled and its ``finished_req_ids`` names them.
        """
        return self.has_unfinished_requests() or self.has_finished_requests()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---------------------------------------------------------------- preemption
    def preempt(self, victim: EngineRequest) -> None:
        """Preempt a running request: free its blocks (tail first), requeue it at the front.

        Its tokens are kept and ``num_computed_tokens`` goes back to 0: on
        resumption everything is recomputed (prefix caching may find its freed
        blocks still cached). If it was already given tokens this step, that
        is undone and the budget restored.
        """
        if victim not in self.running:  # identity: requests compare by object
            raise ValueError(f"only a running request can be preempted, got {victim!r}")
        if self.running[-1] is victim:
            self.running.pop()
        else:
            self.running.remove(victim)
        out, rid = self._out, victim.request_id
        if out is not None and rid in out.num_scheduled_tokens:
            self._token_budget += out.num_scheduled_tokens.pop(rid)
            out.num_computed_tokens.pop(rid, None)
            out.new_block_ids.pop(rid, None)
            out.new_block_ids_by_group.pop(rid, None)
            out.scheduled_running_reqs.remove(rid)
        self.kv_cache_manager.free(victim)
        victim.num_computed_tokens = 0
        # Async scheduling: the output of its steps in flight is stale; it still arrives, but no
        # longer moves the counters just reset.
        victim.num_stale_output_tokens = victim.num_in_flight_tokens
        victim.num_output_placeholders = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        if out is not None:
            out.preempted_req_ids.append(rid)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Decide this step (see the module docstring); the returned output is executed by the worker."""
        self.step_count += 1
        out = self._out = SchedulerOutput(step=self.step_count,
                                          finished_req_ids=self._finished_since_last_step)
        self._finished_since_last_step = []
        self._token_budget = self.max_num_batched_tokens
        # vLLM: the cap protects the others from a long prefill; alone, a request takes the budget.
        eligible = len(self.running) + len(self.waiting)
        cap = self.long_prefill_token_threshold if eligible > 1 else 0
        if cap and self.long_prefill_token_threshold_adaptive:
            cap = max(cap, self.max_num_batched_tokens // eligible)
        self.prefill_cap = cap
        try:
            self._schedule_running(out)
            if not out.preempted_req_ids:  # vLLM V1: no admissions in a step that preempted
                self._schedule_waiting(out)
        finally:
            self._out = None
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        out.cow_pairs = self.kv_cache_manager.take_pending_copies()
        self._update_after_schedule(out)
        return out

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        """Advance each scheduled request's ``num_computed_tokens`` now, before the step runs (vLLM's)."""
        for rid, n in out.num_scheduled_tokens.items():
            request = self.requests[rid]
            request.num_computed_tokens += n
            request.num_in_flight_tokens += n

    def _schedule_running(self, out: SchedulerOutput) -> None:
        req_index = 0
        while req_index < len(self.running) and self._token_budget > 0:
            request = self.running[req_index]
            # Async scheduling: if a step in flight samples its last token, no step goes past it.
            placeholders = request.num_output_placeholders
            max_len = request.num_prompt_tokens + request.max_tokens
            last_in_flight = request.num_computed_tokens + 2 - placeholders >= max_len
            if placeholders and last_in_flight:
                req_index += 1
                continue
            num_new_tokens = request.num_tokens + placeholders - request.num_computed_tokens
            if 0 < self.prefill_cap < num_new_tokens:
                num_new_tokens = self.prefill_cap
            num_new_tokens = min(num_new_tokens, self._token_budget,
                                 self.max_model_len - request.num_computed_tokens - 1)
            if num_new_tokens <= 0:  # nothing to compute (only under async scheduling)
                req_index += 1
                continue
            num_preempted = len(out.preempted_req_ids)
            ahead = self.running[:req_index]
            new_blocks = self.allocate_with_preemption(self, request, num_new_tokens)
            if new_blocks is None:
                if self.policy == "priority" and request.status == RequestStatus.PREEMPTED:
                    # It was the lowest priority and preempted itself; those after it rank higher and
                    # may fit in what it freed (vLLM's): go on with the next.
                    req_index = sum(1 for r in ahead if r in self.running)
                    continue
                break  # it could not be scheduled, and nobody after it will be
            if len(out.preempted_req_ids) != num_preempted:  # victims may have sat before it
                req_index = self.running.index(request)
            out.scheduled_running_reqs.append(request.request_id)
            out.num_scheduled_tokens[request.request_id] = num_new_tokens
            out.num_computed_tokens[request.request_id] = request.num_computed_tokens
            ids = (new_blocks.get_block_ids() if isinstance(new_blocks, KVCacheBlocks)
                   else ([b.block_id for b in new_blocks],))  # a plain list: one group
            out.new_block_ids_by_group[request.request_id] = ids
            out.new_block_ids[request.request_id] = ids[0]
            self._token_budget -= num_new_tokens
            req_index += 1

    def _schedule_waiting(self, out: SchedulerOutput) -> None:
        manager = self.kv_cache_manager
        while self.waiting and self._token_budget > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            request = self.waiting[0]
            hit_blocks, num_hit = manager.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_hit
            if 0 < self.prefill_cap < num_new_tokens:
                num_new_tokens = self.prefill_cap
            if not self.enable_chunked_prefill and num_new_tokens > self._token_budget:
                break  # the whole prompt must fit this step: it waits
            num_new_tokens = min(num_new_tokens, self._token_budget)
            if self.scheduler_reserve_full_isl and not self.whole_prompt_fits(request, hit_blocks, num_hit):
                break  # its whole prompt does not fit: it waits, and so does everyone behind it
            # vLLM's watermark applies only when other requests are scheduled.
            new_blocks = manager.allocate_slots(request, num_new_tokens, num_hit, hit_blocks,
                                                has_scheduled_reqs=bool(self.running))
            if new_blocks is None:
                break  # first come, first served: nobody overtakes the front
            self.waiting.popleft()
            resumed = request.status == RequestStatus.PREEMPTED
            # Counted at admission, as vLLM does, so lookups of a request that waits are not.
            manager.record_prefix_cache_stats(request, num_hit)
            if not resumed and manager.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_hit
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            rid = request.request_id
            (out.scheduled_resumed_reqs if resumed else out.scheduled_new_reqs).append(rid)
            out.num_scheduled_tokens[rid] = num_new_tokens
            out.num_computed_tokens[rid] = num_hit
            out.num_prefix_hit_tokens[rid] = num_hit
            ids = manager.get_blocks(rid).get_block_ids()
            out.new_block_ids_by_group[rid] = ids
            out.new_block_ids[rid] = ids[0]
            self._token_budget -= num_new_tokens

    def whole_prompt_fits(self, request: EngineRequest, hit_blocks: list[KVCacheBlock], num_hit: int) -> bool:
        """vLLM's admission gate: do the free blocks hold the request's whole sequence, past its prefix hit?

        The blocks ``allocate_slots`` would take for all ``request.num_tokens``
        tokens (capped at ``max_model_len``) at once: those past the hit, the
        private copy of a hit that ends inside a block, the hit blocks that
        sit in the free queue (touching takes them off it), and the
        watermark when other requests run. Nothing changes. vLLM asks it of
        ``allocate_slots(..., full_sequence_must_fit=True)``; ours asks it
        here, so a manager whose ``allocate_slots`` is replaced (the
        exercises') keeps its signature.
        """
        manager = self.kv_cache_manager
        if getattr(manager, "coordinator", None) is not None:  # groups: the coordinator counts them
            return manager.whole_sequence_fits(request, hit_blocks, num_hit, self.max_model_len,
                                               has_scheduled_reqs=bool(self.running))
        if isinstance(hit_blocks, KVCacheBlocks):
            hit_blocks = hit_blocks.blocks[0]
        B = manager.block_size
        num_tokens = min(request.num_tokens, self.max_model_len)
        needed = max(cdiv(num_tokens, B) - len(hit_blocks), 0)
        needed += bool(hit_blocks) and num_hit % B != 0
        needed += sum(1 for b in hit_blocks if b.ref_cnt == 0)
        watermark = manager.watermark_blocks if self.running else 0
        return needed + watermark <= manager.block_pool.get_num_free_blocks()

    # ----------------------------------------------------------------- update
    def update_from_output(self, out: SchedulerOutput, model_runner_output: ModelRunnerOutput,
                           decode_token: Callable[[int], str] | None = None) -> list[EngineRequest]:
        """Apply a step's results: append sampled tokens and logprobs, finish requests.

        Returns the requests that got a token, in scheduling order; finished
        ones have a finished status, their blocks freed and they left
        ``running`` (or ``waiting``). ``decode_token`` gives a logprob entry
        its token's text. Progress was advanced when the step was scheduled;
        under async scheduling the token resolves one output placeholder. A
        request finished or aborted since the step was scheduled is skipped;
        one preempted since gets its (stale) token, which moves no counter.
        """
        progressed: list[EngineRequest] = []
        finished: list[EngineRequest] = []
        sampled, logprobs = model_runner_output.sampled_token_ids, model_runner_output.logprobs
        for rid, n in out.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is None or request.is_finished:  # finished or aborted while the step ran
                continue
            request.num_in_flight_tokens -= n
            stale = request.num_stale_output_tokens > 0
            if stale:
                request.num_stale_output_tokens -= n
            token = sampled.get(rid)
            if token is None:
                continue
            placeholders = request.num_output_placeholders
            if not stale and request.num_computed_tokens - max(placeholders - 1, 0) != request.num_tokens:
                raise RuntimeError(f"request {rid!r} got a token before its {request.num_tokens} tokens "
                                   f"were computed ({request.num_computed_tokens})")
            was_running = request.status == RequestStatus.RUNNING
            request.append_output_token_ids(token)
            if rid in logprobs:
                request.append_logprobs(token, *logprobs[rid], decode_token)
            progressed.append(request)
            stopped = request.check_stop(self.max_model_len)
            if not stale and placeholders:
                request.num_output_placeholders -= 1
                if was_running:  # the block its last input filled: cache it now the step has run
                    self.kv_cache_manager.cache_blocks(
                        request, request.num_computed_tokens - request.num_in_flight_tokens)
            if stopped:
                finished.append(request)
        for request in finished:
            if request in self.running:
                self.running.remove(request)
            else:  # preempted while its last step ran: its stale token was a stop
                self.waiting.remove(request.request_id)
            self._free_request(request)
        return progressed

    # ----------------------------------------------------------------- checks
    def check(self) -> None:
        """The scheduler's invariants plus the manager's ``check()``; ``InvariantError`` names the broken one."""
        self.kv_cache_manager.check()
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        require(len(set(running_ids)) == len(running_ids), "running holds each request once",
                lambda: f"running is {running_ids}")
        require(not set(running_ids) & set(waiting_ids), "no request both running and waiting",
                lambda: f"{sorted(set(running_ids) & set(waiting_ids))}")
        require(set(running_ids) | set(waiting_ids) == set(self.requests),
                "every unfinished request is running or waiting",
                lambda: f"requests {sorted(self.requests)}, running {running_ids}, waiting {waiting_ids}")
        require(len(self.running) <= self.max_num_seqs, "at most max_num_seqs running",
                lambda: f"{len(self.running)} running > {self.max_num_seqs}")
        held = set(self.kv_cache_manager.req_to_blocks)
        require(held == set(running_ids), "the running requests hold blocks, no others",
                lambda: f"blocks held by {sorted(held)}, running {sorted(running_ids)}")
        for r in self.running:
            require(r.status == RequestStatus.RUNNING, "running requests are RUNNING", lambda: f"{r!r}")
            require(0 < r.num_computed_tokens <= r.num_tokens + r.num_output_placeholders,
                    "a running request has computed 1..num_tokens (output placeholders included)",
                    lambda: f"{r!r}, {r.num_output_placeholders} placeholders")
        for r in self.waiting:
            require(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED),
                    "waiting requests are WAITING or PREEMPTED", lambda: f"{r!r}")
            require(r.num_computed_tokens == 0, "a waiting request has computed nothing", lambda: f"{r!r}")
