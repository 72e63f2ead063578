"""``SamplingParams`` (vLLM's names and defaults) and the batched sampler.

The parameters a request carries, checked when built (ValueError/TypeError
naming the field). ``temperature=0`` is greedy; otherwise the logits are
divided by the temperature, then ``min_p``, ``top_k`` and ``top_p`` cut the
distribution (in that order, as vLLM V1's sampler does), and a token is drawn.

The draw is one chain of tensor operations for the whole batch:
``argmax(probs / E)`` with ``E ~ Exponential(1)`` per (request, token) picks
token ``v`` with probability ``probs[v]`` (the "exponential race", which
vLLM also uses). Our noise is not drawn from a stateful generator: it is a
hash of (the request's seed, how many tokens it has generated, the token id),
computed with integer tensor arithmetic. So a seeded request draws the same
tokens whatever else shares its batch, and a preempted request that recomputes
draws exactly what it would have drawn. A request without a seed gets one from
the engine's seeded generator when it is added (the engine's ``seed``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

__all__ = ["SamplingParams", "sample", "mask_tokens", "gather_logprobs", "SAMPLING_EPS"]

#: Below this temperature a request is greedy (vLLM's ``_SAMPLING_EPS``).
SAMPLING_EPS = 1e-5


def _number(name, value, *, integer=False, optional=False):
    if optional and value is None:
        return
    ok = isinstance(value, numbers.Integral if integer else numbers.Real) and not isinstance(value, bool)
    if not ok:
        kind = "an int" if integer else "a number"
        raise TypeError(f"SamplingParams.{name} must be {kind}{' or None' if optional else ''}, "
                        f"got {type(value).__name__} {value!r}")


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop (vLLM 0.33's names and defaults).

    Args:
        temperature: 1.0; 0 is greedy (argmax), the rest sample.
        top_p: 1.0 (no cut): keep the most likely tokens whose mass reaches ``top_p``.
        top_k: 0 (no cut; -1 too): keep the ``top_k`` most likely tokens.
        min_p: 0.0: drop tokens less likely than ``min_p`` times the most likely one.
        seed: None; an int makes this request's draws reproducible.
        max_tokens: 16 generated tokens at most (None: up to ``max_model_len``).
        stop: strings that end the output (not included in ``text``).
        stop_token_ids: token ids that end the output (kept in ``token_ids``).
        ignore_eos: False; True keeps generating past EOS.
        skip_special_tokens: True: special tokens are left out of ``text``.
        n: 1; n > 1 samples n completions of the prompt, each a child request
            (vLLM V1's fan-out, ``vllm/v1/engine/parallel_sampling.py``); a
            seeded parent gives child ``i`` the seed ``seed + i`` (``seed + index``,
            ``v1/engine/parallel_sampling.py:81``). Greedy requests must have n == 1, as in
            vLLM (``_verify_greedy_sampling``, ``sampling_params.py:769-773``).
        min_tokens: 0; EOS and ``stop_token_ids`` can be neither sampled nor
            end the output before this many tokens were generated (their logits
            are masked, vLLM's ``MinTokensLogitsProcessor``), and a ``stop``
            string counts only once it ends in text after those tokens
            (``stop_check_offset``, ``v1/engine/detokenizer.py:134-136``).
        logprobs: None; an int k >= 0 returns, for every generated token, the
            log-probabilities of the sampled token and of the k most likely ones
            (-1: the whole vocabulary). They come from the raw logits, before
            temperature, cuts and the min_tokens mask: vLLM's default
            ``logprobs_mode="raw_logprobs"`` (``logprobs_mode: LogprobsMode = "raw_logprobs"``,
            ``config/model.py:291``; ``raw_logprobs = self.compute_logprobs(logits)``,
            ``v1/sample/sampler.py:142-150``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = field(default=1)
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p"):
            _number(name, getattr(self, name))
        _number("top_k", self.top_k, integer=True)
        _number("seed", self.seed, integer=True, optional=True)
        _number("max_tokens", self.max_tokens, integer=True, optional=True)
        _number("n", self.n, integer=True)
        _number("min_tokens", self.min_tokens, integer=True)
        if self.logprobs is True:  # vLLM reads True as 1 (``self.logprobs = 1``, ``sampling_params.py:592-593``)
            self.logprobs = 1
        _number("logprobs", self.logprobs, integer=True, optional=True)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 or 0 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be at least 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be at least 1, got {self.n}")
        if self.min_tokens < 0:
            raise ValueError(f"SamplingParams.min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens must be <= max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < -1:
            raise ValueError(f"SamplingParams.logprobs must be >= 0, or -1 (the whole vocabulary), "
                             f"got {self.logprobs}")
        if self.n > 1 and self.temperature < SAMPLING_EPS:  # vLLM's _verify_greedy_sampling
            raise ValueError(f"SamplingParams.n must be 1 when using greedy sampling (temperature=0), "
                             f"got {self.n}: the n outputs would be identical")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"SamplingParams.{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not (self.stop is None or isinstance(self.stop, (list, tuple))) or \
                not all(isinstance(s, str) and s for s in self.stop or []):
            raise TypeError(f"SamplingParams.stop must be a str or a list of non-empty str, got {self.stop!r}")
        self.stop = list(self.stop or [])
        if not (self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple))):
            raise TypeError(f"SamplingParams.stop_token_ids must be a list of int or None, "
                            f"got {type(self.stop_token_ids).__name__} {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for t in self.stop_token_ids:
            _number("stop_token_ids[...]", t, integer=True)
        if self.temperature < SAMPLING_EPS:  # greedy: the cuts change nothing (vLLM resets them too)
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 with the same bits (int64 products wrap around)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(v: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` keeps the sign)."""
    return (v >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 64-bit integer finaliser (SplitMix64's constants): nearby inputs give unrelated outputs."""
    x = (x ^ _shr(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _shr(x, 31)


def exponential_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exponential(1) noise ``[batch, vocab]``, a pure function of (seed, counter, token id)."""
    dev = seeds.device
    key = _mix(_mix(seeds.long()) + counters.long() * _signed(0x9E3779B97F4A7C15))
    bits = _mix(key[:, None] + torch.arange(vocab, device=dev, dtype=torch.int64)[None, :])
    uniform = (_shr(bits, 11).double() + 0.5) / float(1 << 53)  # 53 random bits, in (0, 1)
    return (-torch.log(uniform)).float()


def sample(logits: torch.Tensor, temperature, top_p, top_k, min_p, seeds, counters) -> torch.Tensor:
    """One token per row of ``logits [batch, vocab]`` (float32); every argument a ``[batch]`` tensor.

    Greedy rows (temperature < 1e-5) take the argmax of the raw logits.
    """
    greedy = temperature < SAMPLING_EPS
    argmax = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return argmax
    vocab = logits.shape[-1]
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    probs = scaled.softmax(dim=-1)
    if bool((min_p > 0).any()):
        floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab))
    if bool((k < vocab).any() | (top_p < 1.0).any()):
        ordered, order = scaled.sort(dim=-1, descending=True)
        keep = torch.arange(vocab, device=logits.device)[None, :] < k[:, None]
        p = ordered.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        keep &= (p.cumsum(dim=-1) - p) < top_p[:, None]  # the mass before a token is under top_p
        scaled = torch.full_like(scaled, float("-inf")).scatter(1, order, ordered.masked_fill(~keep, float("-inf")))
    probs = scaled.softmax(dim=-1)
    drawn = (probs / exponential_noise(seeds, counters, vocab)).argmax(dim=-1)
    return torch.where(greedy, argmax, drawn)


def mask_tokens(logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> torch.Tensor:
    """Set ``logits[rows[j], token_ids[j]]`` to -inf in place: those tokens cannot be drawn, even by argmax.

    min_tokens uses it for the stop tokens of rows still short of their minimum
    (vLLM's ``MinTokensLogitsProcessor``, ``v1/sample/logits_processor/builtin.py:165``).
    """
    if rows:
        dev = logits.device
        logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(token_ids, device=dev)),
                          torch.tensor(float("-inf"), device=dev))
    return logits


def gather_logprobs(raw_logits: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor):
    """Log-probabilities of the sampled tokens and the top ``num_logprobs``, for ``raw_logits [rows, vocab]``.

    One ``log_softmax`` and one ``topk`` for all rows (vLLM's ``Sampler.gather_logprobs``,
    ``v1/sample/sampler.py:373-420``). Returns ``(sampled [rows], ranks [rows],
    top_logprobs [rows, k], top_ids [rows, k])``; a sampled token's rank is the number of
    tokens at least as likely, itself included (1 = the most likely), as vLLM's
    ``batched_count_greater_than`` counts it (``vllm/v1/sample/ops/logprobs.py``).
    """
    logprobs = raw_logits.log_softmax(dim=-1, dtype=torch.float32)
    sampled = logprobs.gather(-1, token_ids[:, None])
    ranks = (logprobs >= sampled).sum(dim=-1)
    top, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return sampled[:, 0], ranks, top, top_ids
