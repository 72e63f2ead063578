"""Workloads and request traces: what chapter 2's simulator replays.

A ``Workload`` is a mixture of request kinds, each with a prompt and an
output length law (``Dist``); ``WORKLOADS`` names the book's three (``chat``,
``heavy-tailed``, ``long-context``). ``make_request_trace`` draws a seeded
``Trace``: arrival step, prompt length, output length and ``max_new_tokens``
of every request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..common import check_int

__all__ = ["Dist", "Component", "Workload", "WORKLOADS", "workload", "Trace", "make_request_trace"]


@dataclass(frozen=True)
class Dist:
    """A named token-length distribution: ``constant`` a, ``lognormal`` median a / sigma b, ``uniform`` [a, b]."""

    kind: str
    a: float
    b: float = 0.0

    def __post_init__(self):
        if self.kind not in ("constant", "lognormal", "uniform"):
            raise ValueError(f"unknown distribution {self.kind!r}; choose constant, lognormal or uniform")
        if self.a < 1 or (self.kind == "uniform" and self.b < self.a) or (self.kind == "lognormal" and self.b < 0):
            raise ValueError(f"bad parameters for {self.kind}: a={self.a}, b={self.b}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "constant":
            x = np.full(n, self.a)
        elif self.kind == "lognormal":
            x = rng.lognormal(math.log(self.a), self.b, n)
        else:
            x = rng.integers(int(self.a), int(self.b) + 1, n)
        return np.maximum(np.rint(x), 1).astype(np.int64)

    def __str__(self) -> str:
        if self.kind == "constant":
            return f"constant {self.a:g}"
        if self.kind == "lognormal":
            return f"lognormal(median {self.a:g}, sigma {self.b:g})"
        return f"uniform[{self.a:g}, {self.b:g}]"


@dataclass(frozen=True)
class Component:
    """One kind of request in a mixture: its share, and its prompt and output length laws."""

    label: str
    weight: float
    prompt: Dist
    output: Dist


@dataclass(frozen=True)
class Workload:
    """A mixture of request kinds.

    ``max_new_tokens`` is what every client asks for (the reservation a
    variable-extent allocator must honour); None means each request asks for
    exactly the tokens it will produce. Outputs are clipped to it, prompts to
    ``max_model_len - max_new_tokens``.
    """

    name: str
    components: tuple[Component, ...]
    max_new_tokens: int | None = None

    def describe(self) -> str:
        cap = "= its output length" if self.max_new_tokens is None else f"{self.max_new_tokens}"
        lines = [f"workload {self.name!r}: max_new_tokens {cap}"]
        for c in self.components:
            lines.append(f"  {c.weight:.0%} {c.label}: prompt {c.prompt}, output {c.output}")
        return "\n".join(lines)

    def sample(self, rng: np.random.Generator, n: int, max_model_len: int) -> tuple[np.ndarray, ...]:
        """(prompt_len, output_len, max_new_tokens), n of each."""
        weights = np.array([c.weight for c in self.components], float)
        kind = rng.choice(len(self.components), size=n, p=weights / weights.sum())
        prompt = np.empty(n, np.int64)
        output = np.empty(n, np.int64)
        for i, c in enumerate(self.components):  # vectorised per component
            idx = np.flatnonzero(kind == i)
            prompt[idx] = c.prompt.sample(rng, idx.size)
            output[idx] = c.output.sample(rng, idx.size)
        if self.max_new_tokens is None:
            max_new = output.copy()
        else:
            if self.max_new_tokens >= max_model_len:
                raise ValueError(f"max_new_tokens {self.max_new_tokens} leaves no room for a prompt in {max_model_len}")
            max_new = np.full(n, self.max_new_tokens, np.int64)
            output = np.minimum(output, max_new)
        prompt = np.minimum(prompt, max_model_len - max_new)
        if (prompt < 1).any():
            raise ValueError(f"outputs of up to {int(max_new.max())} tokens leave no room for a prompt in {max_model_len}")
        return prompt, output, max_new


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        # The book's running chat turn: a 512-token prompt and 100 generated tokens, every time.
        Workload("chat", (Component("chat turn", 1.0, Dist("constant", 512), Dist("constant", 100)),)),
        # Mostly short requests and a heavy tail of long ones; clients ask for up to 2,048 tokens.
        Workload(
            "heavy-tailed",
            (
                Component("short", 0.85, Dist("lognormal", 400, 0.8), Dist("lognormal", 120, 0.9)),
                Component("long", 0.15, Dist("lognormal", 3000, 0.7), Dist("lognormal", 500, 0.8)),
            ),
            max_new_tokens=2048,
        ),
        # Chat turns mixed with documents of 8k-30k tokens to summarise.
        Workload(
            "long-context",
            (
                Component("chat", 0.7, Dist("lognormal", 600, 0.6), Dist("lognormal", 150, 0.7)),
                Component("document", 0.3, Dist("uniform", 8192, 30000), Dist("lognormal", 300, 0.5)),
            ),
            max_new_tokens=1024,
        ),
    ]
}


def workload(name: str | Workload) -> Workload:
    """A named workload (``"chat"``, ``"heavy-tailed"``, ``"long-context"``) or a Workload passed through."""
    if isinstance(name, Workload):
        return name
    try:
        return WORKLOADS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}") from None


@dataclass(frozen=True)
class Trace:
    """Requests sorted by arrival step; request ``i`` is row ``i`` of every array."""

    arrival: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    max_new_tokens: np.ndarray
    description: str = ""

    def __post_init__(self):
        for name in ("arrival", "prompt_len", "output_len", "max_new_tokens"):
            arr = np.asarray(getattr(self, name))
            if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
                raise ValueError(f"{name} must be a 1-D array of integers, got {arr.dtype} of shape {arr.shape}")
            object.__setattr__(self, name, arr.astype(np.int64))
        n = len(self.arrival)
        for name in ("prompt_len", "output_len", "max_new_tokens"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, arrival has {n}")
        if n and ((self.prompt_len < 1).any() or (self.output_len < 1).any()):
            raise ValueError("every request needs prompt_len >= 1 and output_len >= 1")
        if n and ((self.output_len > self.max_new_tokens).any() or (np.diff(self.arrival) < 0).any()
                  or self.arrival[0] < 0):
            raise ValueError("outputs must fit max_new_tokens and arrivals must be sorted and >= 0")

    def __len__(self) -> int:
        return len(self.arrival)

    @property
    def final_len(self) -> np.ndarray:
        """Tokens each request holds when it finishes."""
        return self.prompt_len + self.output_len

    def describe(self) -> str:
        return (f"{self.description}\n{len(self)} requests: mean prompt {self.prompt_len.mean():.0f}, "
                f"mean output {self.output_len.mean():.0f}, mean final length {self.final_len.mean():.0f} tokens")


def make_request_trace(workload_name: str | Workload = "chat", num_requests: int = 1000, *, arrival_rate: float | None = 8.0,
               seed: int = 0, max_model_len: int = 32_768) -> Trace:
    """A seeded trace: Poisson arrivals at ``arrival_rate`` requests per step (None: all at step 0)."""
    w = workload(workload_name)
    n = check_int(num_requests, "num_requests", 1)
    check_int(seed, "seed", 0)
    max_model_len = check_int(max_model_len, "max_model_len", 2)
    if arrival_rate is not None and not (isinstance(arrival_rate, (int, float)) and arrival_rate > 0):
        raise ValueError(f"arrival_rate must be a positive number or None, got {arrival_rate!r}")
    rng = np.random.default_rng(seed)
    prompt, output, max_new = w.sample(rng, n, max_model_len)
    if arrival_rate is None:
        arrival = np.zeros(n, np.int64)
        rate = "all at step 0"
    else:
        arrival = np.floor(np.cumsum(rng.exponential(1 / arrival_rate, n))).astype(np.int64)
        rate = f"Poisson arrivals, {arrival_rate:g} per step"
    desc = f"{w.describe()}\n{rate}; seed {seed}; max_model_len {max_model_len}"
    return Trace(arrival, prompt, output, max_new, desc)
