"""``LLMEngine``: requests in, tokens out, one scheduler step and one forward pass at a time.

The loop of vLLM's ``LLMEngine``/``EngineCore`` (with async scheduling, vLLM's
default, each step is scheduled before the previous one's tokens are applied):

    add_request(...)          queue a prompt (token ids, or text with a tokenizer)
                              with its SamplingParams (greedy by default)
    step()                    schedule -> execute -> update (async: schedule N+1,
                              update N, execute N+1); returns RequestOutputs
    has_unfinished_requests()
    generate(prompts, ...)    add them, step until they finish, return them in order

Building the engine sizes the KV pool (``sizing``), runs chapter 1's startup
check, and allocates the caches. Everything the engine decides is visible:
``engine.scheduler`` (queues and the last ``SchedulerOutput``),
``engine.kv_cache_manager`` (the pool), ``engine.block_tables`` (the worker's
rows, Model Runner V2's ``BlockTables``), ``engine.stats()``, and step
listeners, where live views and the trace recorder of ``pagedkv.views`` attach.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from functools import partial
from typing import Callable, Sequence

import torch

from ..common import check_bool, check_int
from ..hashing import check_token_ids
from ..grouped_kv_cache_manager import GroupedKVCacheManager
from ..kv_cache_manager import KVCacheManager
from .args import EngineArgs
from .parallel_sampling import ParentRequest, child_request_ids
from .request import EngineRequest, RequestOutput, find_stop
from .sampling import SamplingParams
from .async_scheduler import AsyncScheduler
from .scheduler import AllocateWithPreemption, Scheduler, SchedulerOutput
from .sizing import PoolSize, check_startup, determine_num_blocks, kv_cache_groups_of
from .stats import EngineStats, StatsCollector
from .worker import Worker

__all__ = ["LLMEngine", "StepListener"]


def _priorities(priority, num_prompts: int) -> list[int]:
    """``generate``'s ``priority`` as one int per prompt, checked; nothing is queued yet.

    vLLM's reading (``_priority_to_seq``, ``entrypoints/common/offline.py:285-302``):
    None is 0 for all, an int is that int for all, a sequence pairs one with
    each prompt and must be as long as the prompts. vLLM checks only the
    length; here a bool, a str or a non-int value is refused as well.
    """
    if priority is None:
        return [0] * num_prompts
    if isinstance(priority, (str, bytes)) or not isinstance(priority, Sequence):
        return [check_int(priority, "priority")] * num_prompts  # TypeError names a bool or a non-int
    if len(priority) != num_prompts:
        raise ValueError(f"priority has {len(priority)} values for {num_prompts} prompts: give one int for all "
                         f"or one per prompt, got {list(priority)!r}")
    return [check_int(p, f"priority[{i}]") for i, p in enumerate(priority)]

#: Called after every step with ``(engine, scheduler_output, outputs)``.
StepListener = Callable[["LLMEngine", SchedulerOutput, "list[RequestOutput]"], None]


class LLMEngine:
    """A small serving engine over a paged KV cache.

    Args:
        args: ``EngineArgs`` (default ``EngineArgs()``).
        model: a ``pagedkv.model.Model``.
        tokenizer: optional ``tokenizers.Tokenizer``; lets prompts be text and
            fills ``RequestOutput.text``.
        allocate_with_preemption: replace the scheduler's preemption loop
            (see ``pagedkv.engine.scheduler.preempt_last_running``).
        log_fn: where the stats line goes every ``args.log_stats_interval``
            steps (default ``print``).

    Raises:
        ValueError: ``max_model_len`` beyond the model's context, or chapter
            1's startup error when one ``max_model_len`` request cannot fit the pool;
            ``tensor_parallel_size`` other than 1 or a ``kv_cache_dtype`` other
            than the model's (both size pools and go into ``to_cli``; this
            engine runs one rank, in the model's dtype).
    """

    def __init__(self, args: EngineArgs | None, model, tokenizer=None, *,
                 allocate_with_preemption: AllocateWithPreemption | None = None,
                 log_fn: Callable[[str], None] | None = None) -> None:
        args = EngineArgs() if args is None else args
        if not isinstance(args, EngineArgs):
            raise TypeError(f"args must be EngineArgs, got {type(args).__name__} {args!r}")
        for attr in ("config", "allocate_kv_cache", "forward", "compute_logits"):
            if not hasattr(model, attr):
                raise TypeError(f"model must be a pagedkv.model.Model (it lacks .{attr}), got {type(model).__name__}")
        if args.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={args.tensor_parallel_size}: this engine runs one rank; "
                             "the field sizes pools (pagedkv.budget.plan) and goes into to_cli()")
        if args.kv_cache_dtype not in ("auto", str(model.dtype).removeprefix("torch.")):
            raise ValueError(f"kv_cache_dtype={args.kv_cache_dtype!r}: this engine stores KV in the model's "
                             f"dtype ({str(model.dtype).removeprefix('torch.')}); the field sizes pools "
                             "(pagedkv.budget) and goes into to_cli()")
        config = model.config
        max_model_len = args.max_model_len or config.max_position_embeddings
        if max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len ({max_model_len}) is greater than the model's context "
                             f"(max_position_embeddings={config.max_position_embeddings})")
        args.check_max_model_len(max_model_len)
        self.args = args
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.kernel_backend = args.resolved_kernel_backend()
        eos = config.eos_token_id
        self.eos_token_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        torch.manual_seed(args.seed)

        # Several kinds of layers (sliding window beside full attention): one group per kind, each
        # with its own manager and block tables over one pool; None on a plain Llama (one group).
        groups = self.kv_cache_groups = kv_cache_groups_of(model, args.block_size, max_model_len)
        self.pool: PoolSize = determine_num_blocks(args, model, max_model_len, self.kernel_backend, groups)
        check_startup(self.pool, model, max_model_len, groups, args.max_num_batched_tokens)
        if groups is None:
            self.kv_cache_manager = KVCacheManager(self.pool.num_blocks, args.block_size,
                                                   enable_caching=args.enable_prefix_caching,
                                                   hash_block_size=args.hash_block_size, watermark=args.watermark)
        else:
            self.kv_cache_manager = GroupedKVCacheManager(
                groups, self.pool.num_blocks, max_model_len, enable_caching=args.enable_prefix_caching,
                hash_block_size=args.hash_block_size, watermark=args.watermark,
                max_in_flight_tokens=args.max_num_batched_tokens)
        scheduler_cls = AsyncScheduler if args.async_scheduling else Scheduler  # vLLM's get_scheduler_cls
        self.scheduler = scheduler_cls(self.kv_cache_manager, args.max_num_seqs, args.max_num_batched_tokens,
                                   max_model_len, args.enable_chunked_prefill, allocate_with_preemption,
                                   scheduler_reserve_full_isl=args.scheduler_reserve_full_isl,
                                   long_prefill_token_threshold=args.long_prefill_token_threshold,
                                   long_prefill_token_threshold_adaptive=args.long_prefill_token_threshold_adaptive,
                                   policy=args.scheduling_policy)
        self.worker = Worker(model, self.pool.num_blocks, args.block_size, args.max_num_seqs, max_model_len,
                             self.kernel_backend, kv_cache_groups=groups)
        self.block_tables = self.worker.block_tables
        self.last_scheduler_output: SchedulerOutput | None = None
        self._stats = StatsCollector()
        self._log_fn = log_fn or print
        self._listeners: list[StepListener] = []
        self._pending_outputs: list[RequestOutput] = []
        self._in_flight: tuple | None = None  # async scheduling: the step that has run, its output not applied
        self._arrivals = itertools.count()
        self._generate_ids = itertools.count()
        self._seeds = random.Random(args.seed)  # a seed for each request that brings none
        # n > 1: parent id -> ParentRequest, and child id -> (parent, index); both emptied when
        # the parent's aggregated output is handed out.
        self._parents: dict[str, ParentRequest] = {}
        self._child_of: dict[str, tuple[ParentRequest, int]] = {}

    # ----------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt, max_tokens: int = 16, ignore_eos: bool = False,
                    sampling_params: SamplingParams | None = None, priority: int = 0) -> None:
        """Queue a request. Bad input raises (TypeError/ValueError) and leaves the engine untouched.

        ``prompt``: token ids, or text when the engine has a tokenizer. The
        prompt must be non-empty and shorter than ``max_model_len``; ids must
        be unique among unfinished requests. ``sampling_params`` (vLLM's)
        decides how tokens are picked and when to stop; without it the request
        is greedy with ``max_tokens`` (>= 1) and ``ignore_eos``. With
        ``sampling_params.n > 1`` the request becomes n child requests
        ``"{i}_{request_id}"`` (``parallel_sampling``); ``step()`` reports
        them as one output under ``request_id`` once all have finished.
        ``priority`` (vLLM's) orders the queue under
        ``EngineArgs(scheduling_policy="priority")``: smaller first.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}")
        check_int(priority, "priority")
        token_ids, params = self._prepare(prompt, sampling_params, max_tokens, ignore_eos)
        taken = self._ids_taken(request_id, params.n)
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use by an unfinished request")
        self._enqueue(request_id, token_ids, params, priority)

    def _prepare(self, prompt, sampling_params, max_tokens, ignore_eos) -> tuple[list[int], SamplingParams]:
        """One prompt's token ids (text is encoded) and parameters, every check passed: ``(token_ids, params)``.

        Changes nothing: the caller enqueues only once every prompt it was
        given passed. Without ``max_tokens`` the length cap is
        ``max_model_len``, and ``min_tokens`` must fit it, as vLLM checks
        (``sampling_params.min_tokens > sampling_params.max_tokens``,
        ``v1/engine/input_processor.py:477-486``).
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TypeError("a text prompt needs a tokenizer; pass token ids or LLMEngine(..., tokenizer=...)")
            token_ids = list(self.tokenizer.encode(prompt).ids)
        else:
            if isinstance(prompt, torch.Tensor):
                prompt = prompt.tolist()
            if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, bytearray)):
                raise TypeError(f"prompt must be a list of token ids or a str, got {type(prompt).__name__}")
            token_ids = check_token_ids(prompt, "prompt", self.model.config.vocab_size)
        if sampling_params is None:  # LLMEngine's default: greedy
            check_int(max_tokens, "max_tokens", 1)
            check_bool(ignore_eos, "ignore_eos")
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        elif not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
        elif sampling_params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer to read the text; use stop_token_ids")
        else:
            params = sampling_params
        if not token_ids:
            raise ValueError("the prompt is empty: a request needs at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt ({len(token_ids)} tokens) plus at least one generated token does not "
                             f"fit max_model_len={self.max_model_len}")
        room = self.max_model_len - len(token_ids)
        if params.max_tokens is None and params.min_tokens > room:
            raise ValueError(f"SamplingParams.min_tokens must be <= max_tokens={room} (max_model_len "
                             f"{self.max_model_len} minus a {len(token_ids)}-token prompt), got {params.min_tokens}")
        return token_ids, params

    def _enqueue(self, request_id: str, token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Queue a prepared request (its n children for n > 1) under a free id.

        An engine that has gone idle owing its idle step (every request
        finished, their ids not yet reported) takes that step first: vLLM's
        engine core runs it as soon as the last request finishes, so a new
        request's first step never reports the ids of requests gone before it.
        """
        if self.scheduler.has_finished_requests() and not self.scheduler.has_unfinished_requests():
            self._pending_outputs = self.step()  # the idle step; outputs waiting for step() stay waiting
        parent = ParentRequest(request_id, params) if params.n > 1 else None
        ids = [request_id] if parent is None else parent.child_ids
        detokenize = None if self.tokenizer is None else self.tokenizer.decode
        # Every child is built before any is queued: a failure leaves no half-added request.
        requests = [EngineRequest(rid, token_ids, self.max_model_len, eos_token_ids=self.eos_token_ids,
                                  arrival=next(self._arrivals), hash_block_size=self.kv_cache_manager.hash_block_size,
                                  sampling_params=params if parent is None else parent.child_params(i),
                                  seed=self._seeds.getrandbits(63), detokenize=detokenize, priority=priority)
                    for i, rid in enumerate(ids)]
        for request in requests:
            self.scheduler.add_request(request)
        if parent is not None:
            self._parents[request_id] = parent
            self._child_of.update((rid, (parent, i)) for i, rid in enumerate(ids))

    def _ids_taken(self, request_id: str, n: int) -> list[str]:
        """Which of ``request_id`` and, for n > 1, its children's ids an unfinished request already uses."""
        ids = [request_id] + (child_request_ids(request_id, n) if n > 1 else [])
        return [r for r in ids if r in self.scheduler.requests or r in self._parents]

    def abort_request(self, request_id: str) -> None:
        """Stop an unfinished request now (KeyError if it is not one); its blocks return to the pool.

        Its final ``RequestOutput`` (``finish_reason="abort"``) comes with the next ``step()``.
        The id of an ``n > 1`` request aborts its unfinished children.
        """
        parent = self._parents.get(request_id) if isinstance(request_id, str) else None
        ids = [request_id] if parent is None else [c for c in parent.child_ids if c in self.scheduler.requests]
        for rid in ids:
            request = self.scheduler.abort_request(rid)
            self._pending_outputs.extend(self._outputs([request], new_token=False))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    def _outputs(self, requests: list[EngineRequest], new_token: bool = True) -> list[RequestOutput]:
        """A ``RequestOutput`` for each request (``new_token``: its last token came this step).

        A child of an ``n > 1`` request reports nothing itself: its final
        output goes to its ``ParentRequest``, and when the last child has
        finished the parent's one aggregated output takes its place.
        """
        outputs = []
        for request in requests:
            tokens = list(request.output_token_ids)
            text = None
            if self.tokenizer is not None:
                decode = partial(self.tokenizer.decode,
                                 skip_special_tokens=request.sampling_params.skip_special_tokens)
                text = decode(tokens)
                if isinstance(request.stop_reason, str):  # the output ends before the stop string
                    text = text[:find_stop(text, request.stop_reason, request.min_tokens_text_len(decode))]
            finished = request.status.is_finished
            output = RequestOutput(request.request_id, tokens[-1:] if new_token else [], tokens, finished,
                                   request.status.value if finished else None, text, request.stop_reason,
                                   list(request.prompt_token_ids),
                                   logprobs=None if request.logprobs is None else list(request.logprobs),
                                   cumulative_logprob=request.cumulative_logprob)
            child = self._child_of.get(request.request_id)
            if child is None:
                outputs.append(output)
                continue
            parent, index = child
            aggregate = parent.add_output(index, output)
            if aggregate is not None:  # the last child finished: forget the family
                outputs.append(aggregate)
                del self._parents[parent.request_id]
                for rid in parent.child_ids:
                    del self._child_of[rid]
        return outputs

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One scheduler step and one forward pass; outputs of every request that got a token (or was aborted).

        It steps while the scheduler has requests, unfinished or finished
        but not yet reported (vLLM's ``EngineCore.step``, which asks
        ``Scheduler.has_requests``): the step after the last request finishes
        is an idle one, with nothing scheduled and their ids in
        ``finished_req_ids``. Then, and only then, ``step()`` does nothing.

        With ``async_scheduling`` (vLLM's default) a call schedules step N+1
        *before* step N's tokens are applied, as vLLM's engine core does with
        its queue of two batches (``EngineCore.step_with_batch_queue``): it
        schedules N+1 (each running decode one output placeholder ahead), then
        applies step N's output and returns it, then runs N+1, whose output the
        next call applies. The first call returns no tokens, and a call after
        the last step has run only applies it.
        """
        outputs, self._pending_outputs = self._pending_outputs, []
        if not self.scheduler.has_requests() and self._in_flight is None:
            return outputs
        t0 = time.perf_counter()
        scheduled = self._schedule() if self.scheduler.has_requests() else None
        if self.args.async_scheduling:
            done, self._in_flight = self._in_flight, None
            progressed = self._apply(*done) if done is not None else []
            if scheduled is not None:
                self._in_flight = self._execute(*scheduled)
        else:
            progressed = self._apply(*self._execute(*scheduled))
        outputs.extend(self._outputs(progressed))
        if scheduled is None:  # only the last step's output was applied: no step was taken
            return outputs
        out, num_decode_tokens = scheduled
        self._stats.record_step(out.total_num_scheduled_tokens - num_decode_tokens, len(progressed),
                                len(out.preempted_req_ids), time.perf_counter() - t0)
        for listener in list(self._listeners):
            listener(self, out, outputs)
        n = self.args.log_stats_interval
        if n and self._stats.num_steps % n == 0:
            self.log_stats()
        return outputs

    def _schedule(self) -> tuple[SchedulerOutput, int]:
        """Schedule a step: ``(its SchedulerOutput, how many of its tokens are decodes)``."""
        out = self.scheduler.schedule()
        self.last_scheduler_output = out
        if (out.total_num_scheduled_tokens == 0 and not self.scheduler.running and not out.preempted_req_ids
                and self.scheduler.waiting):
            head = self.scheduler.waiting[0]
            raise RuntimeError(
                f"request {head.request_id!r} ({head.num_tokens} tokens) cannot be admitted even into an empty "
                f"batch: {self.kv_cache_manager.get_num_free_blocks()} blocks free, watermark "
                f"{self.kv_cache_manager.watermark_blocks} blocks. Lower the watermark or enlarge the pool.")
        # For the stats, counted while every scheduled request is in scheduler.requests: a decode is one
        # token of a running request past its prompt; every other token is prompt (or recomputation).
        num_decode_tokens = sum(
            1 for rid in out.scheduled_running_reqs
            if out.num_scheduled_tokens[rid] == 1
            and out.num_computed_tokens[rid] >= self.scheduler.requests[rid].num_prompt_tokens)
        return out, num_decode_tokens

    def _execute(self, out: SchedulerOutput, num_decode_tokens: int) -> tuple:
        """Run a scheduled step on the worker: ``(out, its ModelRunnerOutput, num_decode_tokens)``.

        Under async scheduling a request scheduled in this step may have
        finished since (a stop token arrived with the previous step's output):
        vLLM still computes its forward and drops the token; here it is left
        out of the forward pass, and its output is dropped the same way.
        """
        requests = self.scheduler.requests
        gone = [rid for rid in out.num_scheduled_tokens if rid not in requests]
        run = out
        if gone:
            keep = {rid: n for rid, n in out.num_scheduled_tokens.items() if rid not in gone}
            run = dataclasses.replace(
                out, num_scheduled_tokens=keep, total_num_scheduled_tokens=sum(keep.values()),
                scheduled_running_reqs=[r for r in out.scheduled_running_reqs if r not in gone],
                num_computed_tokens={r: n for r, n in out.num_computed_tokens.items() if r not in gone},
                new_block_ids={r: b for r, b in out.new_block_ids.items() if r not in gone},
                new_block_ids_by_group={r: b for r, b in out.new_block_ids_by_group.items() if r not in gone})
        model_runner_output = self.worker.execute_model(run, requests)
        if out.cow_pairs:  # the step has run: the copies' extra references can go
            self.kv_cache_manager.acknowledge_copies(out.cow_pairs)
        return out, model_runner_output, num_decode_tokens

    def _apply(self, out: SchedulerOutput, model_runner_output, num_decode_tokens: int) -> list[EngineRequest]:
        """Apply a step's output to the scheduler; the requests that got a token."""
        return self.scheduler.update_from_output(
            out, model_runner_output, None if self.tokenizer is None else self._decode_token)

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def generate(self, prompts: Sequence, max_tokens: int = 16, ignore_eos: bool = False,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        """Generation for a batch: add every prompt, step until they all finish.

        ``sampling_params``: one for all prompts or one per prompt (default:
        greedy with ``max_tokens`` and ``ignore_eos``: this engine-level call
        takes token ids and its outputs are compared token for token with the
        dense model, so its default is deterministic; ``LLM.generate``, vLLM's
        user-facing call, defaults to ``SamplingParams()`` as vLLM does,
        temperature 1.0). Returns one finished
        ``RequestOutput`` per prompt, in prompt order (with ``n > 1``, its
        ``outputs`` holds the n completions). Requests added earlier
        by ``add_request`` also advance meanwhile; their outputs are not
        returned here.

        ``priority`` (vLLM's ``LLM.generate``): one int for all prompts, one
        per prompt, or None (0 for all); as in :meth:`add_request`, it orders
        the queue under ``EngineArgs(scheduling_policy="priority")``, smaller
        first, and is taken and ignored under ``"fcfs"``, as vLLM 0.33.0 does
        (no check refuses it there: ``add_request``
        (``v1/core/sched/request_queue.py:80-82``) of the FCFS queue just
        appends). Every argument is checked
        before any request is added: bad input adds none.
        """
        if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence):
            raise TypeError("prompts must be a list of prompts (each a list of token ids or a str)")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        priorities = _priorities(priority, len(prompts))
        prepared = []
        for i, (p, sp) in enumerate(zip(prompts, params)):  # check all before adding any: a bad prompt adds none
            try:
                prepared.append(self._prepare(p, sp, max_tokens, ignore_eos))
            except (TypeError, ValueError) as e:
                raise type(e)(f"prompts[{i}]: {e}") from None
        ids = []
        for (token_ids, sp), rank in zip(prepared, priorities):
            rid = f"generate-{next(self._generate_ids)}"
            while self._ids_taken(rid, sp.n):
                rid = f"generate-{next(self._generate_ids)}"
            self._enqueue(rid, token_ids, sp, rank)
            ids.append(rid)
        wanted = set(ids)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for o in self.step():
                if o.finished and o.request_id in wanted:
                    final[o.request_id] = o
        return [final[rid] for rid in ids]

    # -------------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        """Queues, KV usage, preemptions, prefix-cache hit rate and throughput of the current interval."""
        s = self.scheduler
        return self._stats.snapshot(
            num_running=s.num_running, num_waiting=s.num_waiting, kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=s.num_preemptions,
            prefix_cache_hit_rate=(None if not self.args.enable_prefix_caching else
                                   s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0))

    def log_stats(self) -> EngineStats:
        """Print the stats line now and start a new interval."""
        stats = self.stats()
        self._log_fn(stats.log_line())
        self._stats.end_interval()
        return stats

    # -------------------------------------------------------------- listeners
    def add_step_listener(self, listener: StepListener) -> Callable[[], None]:
        """Call ``listener(engine, scheduler_output, outputs)`` after every step; returns an unsubscribe function."""
        if not callable(listener):
            raise TypeError(f"listener must be callable, got {listener!r}")
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe


    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Every invariant: the manager's, the scheduler's, and the worker's table against the manager."""
        self.scheduler.check()
        self.worker.check({r.request_id: self.kv_cache_manager.get_block_ids(r.request_id)
                           for r in self.scheduler.running}, [r.request_id for r in self.scheduler.waiting])

    def __repr__(self) -> str:
        return (f"LLMEngine({self.pool.num_blocks} blocks of {self.args.block_size}, max_model_len="
                f"{self.max_model_len}, backend={self.kernel_backend}, running={self.scheduler.num_running}, "
                f"waiting={self.scheduler.num_waiting})")
