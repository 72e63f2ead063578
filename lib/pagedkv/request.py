"""``Request``: a request as the scheduler tracks it, its tokens, its progress, its block hashes.

vLLM keeps it in ``vllm/v1/request.py``, apart from the manager that gives it
blocks; so do we. The engine's ``EngineRequest`` adds the serving state
(status, sampling, stop rules) on top of it.
"""

from __future__ import annotations

import numbers
from typing import Sequence

from .common import check_int
from .hashing import BlockHash, check_token_ids, hash_checked_block_tokens

__all__ = ["Request"]


class Request:
    """A request as the scheduler tracks it: its tokens, its progress, its block hashes.

    ``block_hashes`` holds one chained hash per full *hash block* of
    ``all_token_ids`` (``hash_block_size`` tokens each) and is kept current as
    output tokens are appended. A request created without ``hash_block_size``
    takes its manager's unit on first contact.

    ``num_computed_tokens`` counts tokens whose KV is in the cache, or is
    being computed by a step already scheduled: the scheduler advances it as
    soon as it schedules a step, as vLLM's does (the manager only reads it).
    ``num_output_placeholders`` (vLLM's name) counts generated tokens that a
    scheduled step will sample but that are not in ``all_token_ids`` yet:
    always 0 without async scheduling; under it, a running decode's next
    token, whose slot the next step allocates before it is sampled.

    ``spec_token_ids`` (vLLM's name) are draft tokens proposed for the next
    step: a step may compute them beside the last real token, so the manager
    gives them slots, but they are not in ``all_token_ids``, have no hash and
    are never cached. A scheduler that models drafts sets them before a step
    and clears them once it is scheduled, as vLLM's does; nothing in this
    library proposes any (the engine has no drafter), so they stay empty
    unless a caller sets them. ``num_tokens_with_spec`` is ``num_tokens``
    plus the drafts.
    """

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int = 16,
                 *, hash_block_size: int | None = None):
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}")
        prompt = check_token_ids(prompt_token_ids, "prompt_token_ids")
        if not prompt:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.max_tokens = check_int(max_tokens, "max_tokens", 1)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self._spec_token_ids: list[int] = []
        self.hash_block_size: int | None = (None if hash_block_size is None
                                            else check_int(hash_block_size, "hash_block_size", 1))
        self.block_hashes: list[BlockHash] = []
        self.update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def spec_token_ids(self) -> list[int]:
        """Draft tokens for the next step (empty without speculative decoding); assign to change them."""
        return self._spec_token_ids

    @spec_token_ids.setter
    def spec_token_ids(self, token_ids: Sequence[int]) -> None:
        # Validated as any token ids (vLLM's -1 for an invalid draft fits in int64), then copied.
        self._spec_token_ids = check_token_ids(token_ids, "spec_token_ids")

    @property
    def num_tokens_with_spec(self) -> int:
        """``num_tokens`` plus the draft tokens: how far a step may compute, placeholders aside (vLLM's name)."""
        return len(self.all_token_ids) + len(self._spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        """True once ``max_tokens`` tokens were generated, a plain ``Request``'s only end
        (an ``EngineRequest`` also stops on EOS and stop rules: see its ``is_finished``)."""
        return self.num_output_tokens >= self.max_tokens

    def bind_hash_block_size(self, hash_block_size: int) -> None:
        """Fix the prefix-match unit and compute the hashes (refused if a different unit is bound)."""
        hash_block_size = check_int(hash_block_size, "hash_block_size", 1)
        if self.hash_block_size is not None:
            if self.hash_block_size != hash_block_size:
                raise ValueError(f"request {self.request_id!r} hashes {self.hash_block_size}-token blocks, "
                                 f"not {hash_block_size}")
            return
        self.hash_block_size = hash_block_size
        self.update_block_hashes()

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append sampled tokens (one int or a list); full hash blocks get their hash at once.

        Every token is validated (an int that fits in 64 bits) and the count is
        checked against ``max_tokens`` before anything is appended.
        """
        tokens = check_token_ids([token_ids] if isinstance(token_ids, numbers.Integral) and not isinstance(token_ids, bool)
                               else token_ids, "token_ids")
        if self.num_output_tokens + len(tokens) > self.max_tokens:
            raise ValueError(f"request {self.request_id!r}: {len(tokens)} more tokens would exceed "
                             f"max_tokens={self.max_tokens} (it has {self.num_output_tokens})")
        self.output_token_ids.extend(tokens)
        self.all_token_ids.extend(tokens)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Hash the full hash blocks not hashed yet (none until a ``hash_block_size`` is bound)."""
        h = self.hash_block_size
        if h is None:
            return
        parent = self.block_hashes[-1] if self.block_hashes else None
        for start in range(len(self.block_hashes) * h, self.num_tokens - h + 1, h):
            # the tokens were checked on the way in: hash them without a second check
            parent = hash_checked_block_tokens(parent, self.all_token_ids[start:start + h])
            self.block_hashes.append(parent)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens}, max_tokens={self.max_tokens})")
