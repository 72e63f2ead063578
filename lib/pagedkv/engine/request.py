"""A request as the engine tracks it, and what the engine hands back each step.

``EngineRequest`` extends the manager's ``Request`` (tokens, progress, block
hashes) with what a serving loop needs: a status, its ``SamplingParams``
(how to pick tokens, when to stop), and a preemption count. ``RequestOutput`` is the caller's view: the tokens
generated so far, the new ones of this step, and why the request finished.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

from ..request import Request
from .sampling import SamplingParams

__all__ = ["RequestStatus", "EngineRequest", "RequestOutput", "CompletionOutput", "Logprob", "find_stop"]


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's ``Logprob``, ``logprobs.py:13``).

    ``rank``: 1 for the most likely token; ``decoded_token``: the token's
    text when the engine has a tokenizer, else None.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def find_stop(text: str, stop: str, floor: int) -> int:
    """Where ``stop`` starts in ``text`` if it ends past character ``floor``, else -1.

    ``floor`` is the length of the text of the first ``min_tokens`` tokens: a
    stop string counts only once it ends after them, as vLLM's detokenizer
    checks only the text past that offset (``stop_check_offset``, ``v1/engine/detokenizer.py:134-136``).
    """
    return text.find(stop, max(0, floor - len(stop) + 1))


class RequestStatus(enum.Enum):
    """vLLM V1's request states (``vllm/v1/request.py``), the ones this engine uses.

    A finished state's value is the ``finish_reason`` its output reports.
    """

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH_CAPPED = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


class EngineRequest(Request):
    """A ``Request`` plus status, sampling parameters, stop rules and counters.

    ``num_computed_tokens`` is reset to 0 on preemption; the tokens generated so
    far are kept and recomputed on resumption (vLLM V1's recompute preemption).
    ``sampling_params`` defaults to greedy with ``max_tokens``/``ignore_eos``;
    ``seed`` is the one its draws use (the params' seed, or one the engine
    drew). ``detokenize`` (ids -> text) is needed only for ``stop`` strings.
    ``priority`` matters only under ``scheduling_policy="priority"``.
    """

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int = 16,
                 *, ignore_eos: bool = False, eos_token_ids: Collection[int] = (), arrival: int = 0,
                 hash_block_size: int | None = None, sampling_params: SamplingParams | None = None,
                 seed: int = 0, detokenize: Callable[[list[int]], str] | None = None, priority: int = 0):
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {type(priority).__name__} {priority!r}")
        if sampling_params is None:
            sampling_params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        elif not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
        if sampling_params.max_tokens is not None:
            max_tokens = sampling_params.max_tokens
        super().__init__(request_id, prompt_token_ids, max_tokens, hash_block_size=hash_block_size)
        if not isinstance(sampling_params.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be True or False, got {sampling_params.ignore_eos!r}")
        if sampling_params.n != 1:
            raise ValueError(f"an EngineRequest is one completion (n=1), got n={sampling_params.n}; "
                             "LLMEngine.add_request fans n > 1 out into child requests")
        if sampling_params.stop and detokenize is None:
            raise ValueError("stop strings need a tokenizer to read the text; give stop_token_ids instead")
        self.sampling_params = sampling_params
        self.num_prompt_tokens = len(self.prompt_token_ids)  # an attribute, as in vLLM: the prompt never changes
        self.ignore_eos = sampling_params.ignore_eos
        self.eos_token_ids = frozenset(eos_token_ids)
        # What min_tokens masks: the stop ids and EOS, even with ignore_eos (vLLM adds EOS to
        # _all_stop_token_ids whatever ignore_eos says: ``self._all_stop_token_ids.add(eos_token_id)``,
        # ``sampling_params.py:787``).
        self.all_stop_token_ids = sorted(self.eos_token_ids | set(sampling_params.stop_token_ids))
        # One {token id: Logprob} per generated token when logprobs were asked for, else None.
        self.logprobs: list[dict[int, Logprob]] | None = None if sampling_params.logprobs is None else []
        self.cumulative_logprob: float | None = None if sampling_params.logprobs is None else 0.0
        self.seed = sampling_params.seed if sampling_params.seed is not None else seed
        self.detokenize = detokenize
        self.arrival = arrival
        # --scheduling-policy priority: a smaller value is served first, and preempted last (vLLM's).
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        # Async scheduling's bookkeeping (vLLM's names): tokens of scheduled steps whose output has
        # not arrived, and how many of them a preemption made stale (their tokens still arrive and
        # are appended, but they no longer move the counters the preemption reset).
        self.num_in_flight_tokens = 0
        self.num_stale_output_tokens = 0
        self.stop_reason: int | str | None = None  # the stop token id or string that finished it

    @property
    def is_finished(self) -> bool:
        """True once the request has a finished status, whatever stopped it (EOS, a stop rule, a
        length cap, an abort); ``Request.is_finished`` knows only ``max_tokens``."""
        return self.status.is_finished

    def min_tokens_text_len(self, decode: Callable[[list[int]], str]) -> int:
        """Length of the text of the first ``min_tokens`` tokens (0 without min_tokens): a stop string ends after it."""
        n = self.sampling_params.min_tokens
        return len(decode(list(self.output_token_ids[:n]))) if n else 0

    def append_logprobs(self, token: int, logprob: float, rank: int, top: list[tuple[int, float]],
                        decode: Callable[[int], str] | None = None) -> None:
        """Record the logprobs of the token just appended: the sampled one first, then the top k.

        A sampled token that is also in the top k keeps its top-k entry (vLLM
        builds the same dict, ``append_logprobs_for_next_position``, ``logprobs.py:178-209``).
        """
        def text(t):
            return None if decode is None else decode(t)

        entry = {token: Logprob(logprob, rank, text(token))}
        for r, (t, lp) in enumerate(top, start=1):
            entry[t] = Logprob(lp, r, text(t))
        self.logprobs.append(entry)
        self.cumulative_logprob += logprob

    def check_stop(self, max_model_len: int) -> bool:
        """After a token is appended: set a finished status and return True if the request is done.

        The order is vLLM's ``check_stop``: EOS (unless ``ignore_eos``), the
        ``stop_token_ids``, then the length caps (``max_tokens``,
        ``max_model_len``); ``stop`` strings are checked on the text last.
        ``min_tokens`` needs no test here for EOS and stop ids: the sampler
        masked them until then (vLLM's ``check_stop`` relies on the same mask,
        ``check_stop``, ``v1/core/sched/utils.py:98-126``); stop strings are
        searched only in the text after the first ``min_tokens`` tokens.
        """
        last = self.output_token_ids[-1]
        if not self.ignore_eos and last in self.eos_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in self.sampling_params.stop_token_ids:
            self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, last
            return True
        if self.sampling_params.stop and self.num_output_tokens > self.sampling_params.min_tokens:
            text = self.detokenize(list(self.output_token_ids))
            floor = self.min_tokens_text_len(self.detokenize)
            for s in self.sampling_params.stop:
                if find_stop(text, s, floor) >= 0:
                    self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, s
                    return True
        if self.num_tokens >= max_model_len or self.num_output_tokens >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def __repr__(self) -> str:
        return (f"EngineRequest({self.request_id!r}, {self.status.name}, num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens}, outputs={self.num_output_tokens}/"
                f"{self.max_tokens})")


@dataclass(frozen=True)
class RequestOutput:
    """One request's progress after a step.

    ``token_ids`` holds every token generated so far (not the prompt);
    ``new_token_ids`` the ones this step added. ``finish_reason`` is
    ``"stop"`` (EOS), ``"length"`` (``max_tokens`` or ``max_model_len``) or
    ``"abort"``, and None while the request runs. ``text`` is the decoded
    output when the engine has a tokenizer (cut before a ``stop`` string).
    ``stop_reason`` is the stop token id or string that ended it, if any.

    ``logprobs`` (one ``{token id: Logprob}`` per generated token) and
    ``cumulative_logprob`` are set when ``SamplingParams.logprobs`` asked for them.

    vLLM's ``RequestOutput`` shape is here too: ``prompt``,
    ``prompt_token_ids`` and ``outputs`` (one ``CompletionOutput``), so code
    written for ``vllm.LLM.generate`` reads ours unchanged. A request with
    ``n > 1`` gives one final output whose ``outputs`` holds its n completions
    (``completions``, index 0..n-1); its other fields are completion 0's.
    """

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    text: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    # Added fields stay out of the repr, so the n == 1 output prints as it always did.
    logprobs: list[dict[int, Logprob]] | None = field(default=None, repr=False)
    cumulative_logprob: float | None = field(default=None, repr=False)
    completions: tuple["CompletionOutput", ...] | None = field(default=None, repr=False)

    @property
    def outputs(self) -> list["CompletionOutput"]:
        if self.completions is not None:
            return list(self.completions)
        return [CompletionOutput(0, self.text, list(self.token_ids), self.finish_reason, self.stop_reason,
                                 self.logprobs, self.cumulative_logprob)]


@dataclass(frozen=True)
class CompletionOutput:
    """One completion of a request, as vLLM's ``CompletionOutput`` (``text``, ``token_ids``, ``finish_reason``,
    ``logprobs``, ``cumulative_logprob``); ``index`` is its place among the request's n."""

    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = field(default=None, repr=False)
    cumulative_logprob: float | None = field(default=None, repr=False)

    def finished(self) -> bool:
        """vLLM's ``CompletionOutput.finished()``."""
        return self.finish_reason is not None
