"""A request as the engine tracks it, and what the engine hands back each step.

``EngineRequest`` extends the manager's ``Request`` (tokens, progress, block
hashes) with what a serving loop needs: a status, its ``SamplingParams``
(how to pick tokens, when to stop), and a preemption count. ``RequestOutput`` is the caller's view: the tokens
generated so far, the new ones of this step, and why the request finished.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Collection, Sequence

from ..request import Request
from .sampling import SamplingParams

__all__ = ["RequestStatus", "EngineRequest", "RequestOutput", "CompletionOutput"]


class RequestStatus(enum.Enum):
    """vLLM V1's request states (``vllm/v1/request.py``), the ones this engine uses."""

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
    """

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int = 16,
                 *, ignore_eos: bool = False, eos_token_ids: Collection[int] = (), arrival: int = 0,
                 hash_block_size: int | None = None, sampling_params: SamplingParams | None = None,
                 seed: int = 0, detokenize: Callable[[list[int]], str] | None = None):
        if sampling_params is None:
            sampling_params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        elif not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
        if sampling_params.max_tokens is not None:
            max_tokens = sampling_params.max_tokens
        super().__init__(request_id, prompt_token_ids, max_tokens, hash_block_size=hash_block_size)
        if not isinstance(sampling_params.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be True or False, got {sampling_params.ignore_eos!r}")
        if sampling_params.stop and detokenize is None:
            raise ValueError("stop strings need a tokenizer to read the text; give stop_token_ids instead")
        self.sampling_params = sampling_params
        self.ignore_eos = sampling_params.ignore_eos
        self.eos_token_ids = frozenset(eos_token_ids)
        self.seed = sampling_params.seed if sampling_params.seed is not None else seed
        self.detokenize = detokenize
        self.arrival = arrival
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None  # the stop token id or string that finished it

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finish_reason(self) -> str | None:
        """``"stop"``, ``"length"`` or ``"abort"`` once finished, else None."""
        return self.status.value if self.status.is_finished else None

    def check_stop(self, max_model_len: int) -> bool:
        """After a token is appended: set a finished status and return True if the request is done.

        The order is vLLM's ``check_stop``: EOS (unless ``ignore_eos``), the
        ``stop_token_ids``, then the length caps (``max_tokens``,
        ``max_model_len``); ``stop`` strings are checked on the text last.
        """
        last = self.output_token_ids[-1]
        if not self.ignore_eos and last in self.eos_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in self.sampling_params.stop_token_ids:
            self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, last
            return True
        if self.sampling_params.stop:
            text = self.detokenize(list(self.output_token_ids))
            for s in self.sampling_params.stop:
                if s in text:
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

    vLLM's ``RequestOutput`` shape is here too: ``prompt``,
    ``prompt_token_ids`` and ``outputs`` (one ``CompletionOutput``), so code
    written for ``vllm.LLM.generate`` reads ours unchanged.
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

    @property
    def outputs(self) -> list["CompletionOutput"]:
        return [CompletionOutput(0, self.text, list(self.token_ids), self.finish_reason, self.stop_reason)]


@dataclass(frozen=True)
class CompletionOutput:
    """One completion of a request, as vLLM's ``CompletionOutput`` (``text``, ``token_ids``, ``finish_reason``)."""

    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
