"""How far one step may compute a request: its tokens, its draft tokens, its placeholders.

Both managers' ``allocate_slots`` (``pagedkv.kv_cache_manager``,
``pagedkv.grouped_kv_cache_manager``) give slots to the tokens at positions
``num_computed .. num_computed + num_new_tokens - 1``. That range may run past
the request's own tokens (``num_tokens``) by two kinds of token that are not
in ``all_token_ids`` yet:

- its draft tokens (``spec_token_ids``): speculative decoding computes a
  step's drafts beside its last real token, to verify them. They get slots,
  but caching stops at ``num_tokens``, so a draft never enters the prefix
  cache: once the step has run, the scheduler appends the accepted drafts and
  a bonus token as real tokens and moves ``num_computed_tokens`` back by the
  rejected ones, whose slots the next step overwrites;
- async scheduling's placeholders (``num_output_placeholders``): tokens a
  scheduled step will sample.

Anything further is the caller's mistake (more drafts scheduled than the
request carries, or no drafts at all), refused before any change. The
bound is vLLM 0.33.0's: its scheduler schedules up to
``num_tokens_with_spec + num_output_placeholders`` and its manager caches up
to ``num_tokens``.
"""

from __future__ import annotations

from .request import Request

__all__ = ["check_step_tokens"]


def check_step_tokens(request: Request, num_computed: int, num_new_tokens: int) -> None:
    """Refuse ``num_new_tokens`` after ``num_computed`` past the request's tokens, drafts and placeholders."""
    placeholders = getattr(request, "num_output_placeholders", 0)
    drafts = request.num_tokens_with_spec - request.num_tokens
    if num_computed + num_new_tokens <= request.num_tokens_with_spec + placeholders:
        return
    has = f"{request.num_tokens + placeholders} tokens{' with placeholders' * (placeholders > 0)}"
    if drafts:
        why = f"and {drafts} draft tokens; cannot compute {num_new_tokens} after {num_computed}"
        hint = "more than its drafts: a step runs past num_tokens by its spec_token_ids at most"
    else:
        why = f"; cannot compute {num_new_tokens} after {num_computed}"
        hint = "a step runs past num_tokens only by the request's spec_token_ids, and it has none"
    raise ValueError(f"request {request.request_id!r} has {has}{' ' * bool(drafts)}{why} ({hint})")
