"""``n > 1``: one prompt fanned out into n child requests, their outputs gathered into one.

As vLLM V1 does it (``vllm/v1/engine/parallel_sampling.py``): the engine
adds n ordinary requests with ids ``"{i}_{parent id}"``
(``f"{index}_{self.request_id}"``, ``v1/engine/parallel_sampling.py:94``) and
``SamplingParams`` copies with ``n=1``; a seeded parent gives child ``i``
the seed ``seed + i`` (``seed + index``, ``v1/engine/parallel_sampling.py:81``),
so the same seed gives the same n outputs.
The scheduler and the KV cache manager never learn that the children belong
together: with prefix caching on, the children's identical prompts hit the
blocks the first one computed, which is how the n samples share the prompt's
memory.

Outputs are gathered as vLLM's ``LLM.generate`` asks for them
(``RequestOutputKind.FINAL_ONLY``, ``entrypoints/common/offline.py:577``;
``ParentRequest.get_outputs``, ``v1/engine/parallel_sampling.py:102``): nothing is reported for
the parent until every child has finished, then one ``RequestOutput`` with
the parent's id whose ``outputs`` are the n completions, index 0..n-1.
"""

from __future__ import annotations

import dataclasses

from .request import CompletionOutput, RequestOutput
from .sampling import SamplingParams

__all__ = ["ParentRequest", "child_request_ids"]


def child_request_ids(request_id: str, n: int) -> list[str]:
    """The ids of the n children of ``request_id`` (vLLM's ``get_child_info``, ``v1/engine/parallel_sampling.py:84-96``)."""
    return [f"{i}_{request_id}" for i in range(n)]


class ParentRequest:
    """The n children of one request and their final outputs.

    Args:
        request_id: the id the caller gave (the aggregated output carries it).
        sampling_params: the caller's, with ``n > 1``.
    """

    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.child_ids = child_request_ids(request_id, sampling_params.n)
        self._pending = set(self.child_ids)  # children whose final output has not come yet
        self._finals: list[RequestOutput | None] = [None] * sampling_params.n

    @property
    def n(self) -> int:
        return self.sampling_params.n

    def child_params(self, index: int) -> SamplingParams:
        """Child ``index``'s parameters: the parent's with ``n=1`` and, if seeded, seed ``seed + index``."""
        seed = self.sampling_params.seed
        return dataclasses.replace(self.sampling_params, n=1, seed=None if seed is None else seed + index)

    def add_output(self, index: int, output: RequestOutput) -> RequestOutput | None:
        """Take child ``index``'s output of a step; the aggregated output once the last child finished, else None."""
        if not output.finished:
            return None
        self._finals[index] = output
        self._pending.discard(self.child_ids[index])
        if self._pending:
            return None
        completions = tuple(dataclasses.replace(o.outputs[0], index=i) for i, o in enumerate(self._finals))
        first: RequestOutput = self._finals[0]
        return dataclasses.replace(first, request_id=self.request_id, completions=completions)

    @property
    def finished(self) -> bool:
        return not self._pending
