"""A request as the engine tracks it, and what the engine hands back each step.

``EngineRequest`` extends the manager's ``Request`` (tokens, progress, block
hashes) with what a serving loop needs: a status, greedy-decoding stop rules,
and a preemption count. ``RequestOutput`` is the caller's view: the tokens
generated so far, the new ones of this step, and why the request finished.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Collection, Sequence

from ..request import Request

__all__ = ["RequestStatus", "EngineRequest", "RequestOutput"]


class RequestStatus(enum.Enum):
    """vLLM V1's request states (``vllm/v1/request.py``), the ones a greedy engine uses."""

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
    """A ``Request`` plus status, stop rules and counters.

    ``num_computed_tokens`` is reset to 0 on preemption; the tokens generated so
    far are kept and recomputed on resumption (vLLM V1's recompute preemption).
    """

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int = 16,
                 *, ignore_eos: bool = False, eos_token_ids: Collection[int] = (), arrival: int = 0,
                 hash_block_size: int | None = None):
        super().__init__(request_id, prompt_token_ids, max_tokens, hash_block_size=hash_block_size)
        if not isinstance(ignore_eos, bool):
            raise TypeError(f"ignore_eos must be True or False, got {type(ignore_eos).__name__} {ignore_eos!r}")
        self.ignore_eos = ignore_eos
        self.eos_token_ids = frozenset(eos_token_ids)
        self.arrival = arrival
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finish_reason(self) -> str | None:
        """``"stop"``, ``"length"`` or ``"abort"`` once finished, else None."""
        return self.status.value if self.status.is_finished else None

    def check_stop(self, max_model_len: int) -> bool:
        """After a token is appended: set a finished status and return True if the request is done.

        The order is vLLM's ``check_stop``: EOS first (unless ``ignore_eos``),
        then the length caps (``max_tokens``, ``max_model_len``).
        """
        last = self.output_token_ids[-1]
        if not self.ignore_eos and last in self.eos_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
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
    output when the engine has a tokenizer.
    """

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    text: str | None = None
