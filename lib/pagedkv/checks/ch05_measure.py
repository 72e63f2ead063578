"""Exercise 5, modify and measure: pad every step to a power of two.

A step runs as a captured CUDA graph of the smallest captured size that
holds it; vLLM 0.33.0 captures 1, 2, 4, then multiples of 8 and of 16. The
reader writes another capture policy, ``pad_pow2(num_tokens)`` (the next
power of two, unpadded past 512), hands it to
``sim.padded_slot_mappings`` (the function is the extension point),
predicts the share of slot-mapping entries that are padding (-1) over the
notebook's decode steps, then measures it. The checker builds the same
slot mappings with the reader's function, so the measurement is graded for
*their* policy.
"""

from __future__ import annotations

import functools
import numbers

from ..sim.step_padding import decode_batch_sizes, pad_vllm, padded_slot_mappings
from ._harness import Mistake, WrongAnswer, catalogue
from .measure_harness import Experiment, check_experiment, percent_mistake

__all__ = ["check_pow2_padding_experiment", "padding_share"]

LARGEST = 512  # the largest captured size: past it a step runs unpadded


def padding_share(pad) -> float:
    """Entries of -1 over all entries of the notebook's steps' slot mappings, under ``pad``."""
    maps = padded_slot_mappings(pad, decode_batch_sizes())
    return sum(int((m == -1).sum()) for m in maps) / sum(len(m) for m in maps)


@functools.lru_cache(maxsize=None)
def _vllm_share() -> float:
    return padding_share(pad_vllm)


def _pow2(n):
    if n > LARGEST:
        return n
    p = 1
    while p < n:
        p *= 2
    return p


RULE_MISTAKES = [
    Mistake("strictly greater", "a step that already has a power-of-two size runs as it is: "
            "the smallest power of two >= n", lambda n: 1 << n.bit_length() if n <= LARGEST else n),
    Mistake("no largest size", f"past {LARGEST} tokens no graph is captured: the step runs "
            "unpadded, pad(n) = n", lambda n: 1 << (n - 1).bit_length()),
    Mistake("the exponent", "return the padded size (a number of tokens), not its log2",
            lambda n: (n - 1).bit_length() if n <= LARGEST else n),
]

MEASUREMENT_MISTAKES = [
    Mistake("vLLM's sizes measured", "build the slot mappings with your pad_pow2, not "
            "sim.pad_vllm", lambda t: _vllm_share()),
    Mistake("padding over real tokens", "the share is of the slot mapping's entries: -1 "
            "entries over all entries, real and padding", lambda t: t / (1 - t)),
    percent_mistake("share"),
]


def check_pow2_padding_experiment(pad_pow2, predicted_padding=None, measured_padding=None,
                                  verbose: bool = True):
    """Grade exercise 5's experiment: the policy, the padding share, the prediction."""

    def check_rule():
        cases = [1, 2, 3, 4, 5, 7, 8, 9, 100, 128, 129, 255, 256, 257, 511, 512, 513, 600, 4096]
        for n in cases:
            got = pad_pow2(n)
            want = _pow2(n)
            if isinstance(got, bool) or not isinstance(got, numbers.Integral):
                raise WrongAnswer(f"pad_pow2({n}) returned {type(got).__name__} {got!r}",
                                  "not an int -- a size is a whole number of tokens: "
                                  "2 ** math.ceil(math.log2(n)) is exact, 2.0 ** ... is a float")
            if got != want:
                mistake = None
                for m in RULE_MISTAKES:
                    if all(pad_pow2(k) == m.model(k) for k in cases):
                        mistake = m.diagnosis()
                        break
                raise WrongAnswer(f"pad_pow2({n}) = {got}, expected {want}", mistake)

    def lesson(pred, true):
        vllm = _vllm_share()
        if pred < true:
            return (f"vLLM's sizes pad {vllm:.1%} here, powers of two {true:.1%}: these steps "
                    "hold a couple of hundred tokens, and past 128 the next power of two is up "
                    "to twice the step. The gaps between captured sizes grow with the size, so "
                    "the padding follows where the batches sit, not the smallest steps")
        return ("padding is at most the gap to the next size: a step just under a power of two "
                "pads almost nothing. Look at where this workload's batch sizes sit before "
                "assuming the worst case of half")

    e = Experiment(
        title="experiment: pad to a power of two",
        rule=f"pad_pow2 gives the smallest power of two >= n, n itself past {LARGEST}",
        check_rule=check_rule, probe=lambda: pad_pow2(5),
        library={"pad_vllm": pad_vllm},
        remeasure=lambda: padding_share(pad_pow2),
        what="the share of slot-mapping entries that are padding", measured=measured_padding,
        predicted=predicted_padding, measured_name="measured_padding",
        predicted_name="predicted_padding", lesson=lesson, fmt=lambda v: f"{v:.2%}",
        tolerance=5e-4, prediction_tolerance=0.05, measurement_mistakes=MEASUREMENT_MISTAKES,
        rule_hint="double from 1 until the size holds n",
        measure_hint="count the -1 entries of sim.padded_slot_mappings(pad_pow2, sizes) over "
                     "all their entries")
    return check_experiment(e, verbose)


catalogue(check_pow2_padding_experiment, RULE_MISTAKES, MEASUREMENT_MISTAKES)
