"""Exercise 2's design task: the largest block size under a waste budget.

The learner writes ``largest_block_size(lengths, probs, max_share)``: among
the block sizes vLLM's CUDA attention backends accept (multiples of 16, here
16 to 1,024), the largest whose tail waste stays within ``max_share`` of the
slots the sequences hold, or ``None`` when even 16 is over. The tail waste
share of block size ``B`` is

    E[(B - n % B) % B] / E[ceil(n / B) x B]

for a sequence of ``n`` tokens with probability ``probs[i]`` for
``lengths[i]``: the unwritten slots of the last block, against every slot
held. A larger block means fewer table cells and longer kernel tiles, and
more waste: the design question is how far one can go.

The check grades the size returned, not the code: on the heavy-tailed trace
of chapter 2, on one chat turn of 612 tokens (where the answer is a block
larger than the request), and on seeded random distributions, the size must
be a candidate, keep the waste within the share, and no larger candidate may
keep it too. A size that fails says which rule it breaks, with the shares.
"""

from __future__ import annotations

import numbers
import random

from ._harness import Checker, CheckReport, Mistake, WrongAnswer, catalogue

__all__ = ["check_largest_block_size", "waste_share", "CANDIDATES"]

#: The block sizes the design chooses from: multiples of 16, as vLLM's CUDA
#: attention backends (FlashAttention, Triton) require, up to 1,024.
CANDIDATES = tuple(range(16, 1025, 16))


def waste_share(lengths, probs, block_size: int) -> float:
    """Expected unwritten slots of the last block over expected slots held."""
    waste = sum(p * ((-n) % block_size) for n, p in zip(lengths, probs))
    held = sum(p * (-(-n // block_size) * block_size) for n, p in zip(lengths, probs))
    return waste / held


def _best(lengths, probs, max_share):
    fits = [b for b in CANDIDATES if waste_share(lengths, probs, b) <= max_share]
    return max(fits) if fits else None


def _share_of_tokens(lengths, probs, b):
    """The waste over the tokens written, not over the slots held (a common slip)."""
    return (sum(p * ((-n) % b) for n, p in zip(lengths, probs))
            / sum(p * n for n, p in zip(lengths, probs)))


DESIGN_MISTAKES = [
    Mistake("the first size under the share", "the search stopped at the "
            "smallest size that keeps the waste within the share: the design "
            "wants the largest, the fewest table cells for the waste it "
            "allows"),
    Mistake("stopped at the first size over the share", "the search "
            "stopped when one size went over: waste is not monotone in the "
            "block size, so a larger size can come back under the share "
            "(612 tokens: 4.4 % at 160, 20 % at 192, 4.4 % at 640)"),
    Mistake("the share of the tokens", "the waste was divided by the tokens "
            "written: the share is of the slots held, the tokens plus the "
            "waste"),
    Mistake("not a block size vLLM takes", "the size must be a multiple of "
            "16 from 16 to 1,024: vLLM's CUDA attention backends take no "
            "other"),
    Mistake("None while a size fits", "None means that even 16 tokens a "
            "block waste more than the share"),
]


def _first_under(lengths, probs, max_share):
    return next((b for b in CANDIDATES if waste_share(lengths, probs, b) <= max_share), None)


def _stop_at_first_over(lengths, probs, max_share):
    best = None
    for b in CANDIDATES:
        if waste_share(lengths, probs, b) > max_share:
            break
        best = b
    return best


def _by_tokens(lengths, probs, max_share):
    fits = [b for b in CANDIDATES if _share_of_tokens(lengths, probs, b) <= max_share]
    return max(fits) if fits else None


_MODELS = [(DESIGN_MISTAKES[0], _first_under), (DESIGN_MISTAKES[1], _stop_at_first_over),
           (DESIGN_MISTAKES[2], _by_tokens)]


def _cases(seed: int, n: int):
    from ..sim import make_request_trace

    heavy = make_request_trace("heavy-tailed", 5_000, seed=1).final_len.tolist()
    cases = [("the heavy-tailed trace (5,000 requests, seed 1), 5 %", heavy,
              [1 / len(heavy)] * len(heavy), 0.05),
             ("one chat turn of 612 tokens, 5 %", [612], [1.0], 0.05)]
    cases.append(("lengths 1, 2 and 3, 2 %", [1, 2, 3], [0.2, 0.3, 0.5], 0.02))
    rng = random.Random(seed)
    for k in range(n):
        lengths = [rng.randint(1, 4_000) for _ in range(rng.randint(1, 6))]
        weights = [rng.random() + 0.05 for _ in lengths]
        probs = [w / sum(weights) for w in weights]
        cases.append((f"random distribution {k}: lengths {lengths}", lengths, probs,
                      rng.choice([0.02, 0.05, 0.1, 0.2])))
    return cases


def _judge(got, lengths, probs, max_share, what):
    want = _best(lengths, probs, max_share)
    args = (lengths, probs, max_share)
    mistake = next((m.diagnosis() for m, model in _MODELS if got != want and model(*args) == got), None)
    if got is None:
        if want is not None:
            raise WrongAnswer(f"{what}: got None, but {want} keeps the waste at "
                              f"{waste_share(lengths, probs, want):.2%}",
                              mistake or DESIGN_MISTAKES[4].diagnosis())
        return
    share = waste_share(lengths, probs, got)
    if share > max_share:
        raise WrongAnswer(f"{what}: block size {got} wastes {share:.2%} of the slots held, "
                          f"over {max_share:.0%}", mistake)
    if want is not None and want > got:
        raise WrongAnswer(f"{what}: {got} keeps the waste at {share:.2%}, but the larger "
                          f"{want} keeps it at {waste_share(lengths, probs, want):.2%}, "
                          f"within {max_share:.0%} too", mistake)


def _size(value, what):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise WrongAnswer(f"{what}: expected a block size (an int) or None, got "
                          f"{type(value).__name__} {value!r:.40}", None)
    if int(value) not in CANDIDATES:
        raise WrongAnswer(f"{what}: {value} is not a multiple of 16 from 16 to 1,024",
                          DESIGN_MISTAKES[3].diagnosis())
    return int(value)


def check_largest_block_size(fn, cases: int = 40, seed: int = 0,
                             timeout: float = 60.0) -> CheckReport:
    """Check ``fn(lengths, probs, max_share) -> block size or None`` by what it returns."""
    all_cases = _cases(seed, cases)
    with Checker("largest_block_size", timeout=timeout) as c:
        c.probe(lambda: fn([612], [1.0], 0.05))

        def one(index):
            what, lengths, probs, max_share = all_cases[index]
            _judge(_size(fn(list(lengths), list(probs), max_share), what),
                   lengths, probs, max_share, what)

        c.prop("heavy-tailed trace, 5 %: within the share, and no larger size is",
               lambda: one(0), "which sizes keep the waste within the share, and "
               "which is the largest of them?")
        c.prop("one turn of 612 tokens, 5 %: the largest size may exceed the request",
               lambda: one(1), "waste is not monotone in the block size: try them all")

        c.prop("lengths 1, 2 and 3 at 2 %: no size is within the share (None)",
               lambda: one(2), "what does a 3-token sequence waste at 16 tokens a block?")

        def randomized():
            for k in range(3, len(all_cases)):
                one(k)

        c.prop(f"{cases} random distributions: within the share, no larger size is",
               randomized, "the message names the distribution: list its shares")
    return c.report


catalogue(check_largest_block_size, DESIGN_MISTAKES)
