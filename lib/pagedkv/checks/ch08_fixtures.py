"""What exercise 8's checks share: a small engine on the tiny model, prompts, short reprs."""

from __future__ import annotations

import functools

from ..engine import EngineArgs

__all__ = ["tiny_model", "engine_args", "random_prompt", "short_repr"]


@functools.cache
def tiny_model():
    """The tiny preset, seed 0, built once per process."""
    from ..model import Model, ModelConfig

    return Model(ModelConfig.preset("tiny"), seed=0)


def engine_args(**kw) -> EngineArgs:
    """Small engine arguments (blocks of 4, torch backend, no prefix caching, no logging), overridden by ``kw``."""
    base = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                enable_prefix_caching=False, watermark=0.0,
                kernel_backend="torch", log_stats_interval=0)
    base.update(kw)
    return EngineArgs(**base)


def random_prompt(rng, n):
    """``n`` random token ids from ``rng``."""
    return [rng.randrange(1, 512) for _ in range(n)]


def short_repr(value) -> str:
    """``repr(value)``, cut to 70 characters."""
    text = repr(value)
    return text if len(text) <= 70 else text[:67] + "..."
