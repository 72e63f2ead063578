"""Exercise 5's experiment (pad to a power of two): the policy, the padding share for it, the prediction."""

import math

import pytest

from pagedkv.checks.ch05_measure import check_pow2_padding_experiment as check, padding_share
from pagedkv.sim import decode_batch_sizes, pad_vllm, padded_slot_mappings, vllm_capture_sizes


def pow2(n):
    if n > 512:
        return n
    return 2 ** math.ceil(math.log2(n))


TRUE = padding_share(pow2)
VLLM = padding_share(pad_vllm)


def test_vllm_sizes_are_its_default_list():
    sizes = vllm_capture_sizes()
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 512 and 248 in sizes and 264 not in sizes
    assert pad_vllm(249) == 256 and pad_vllm(257) == 272 and pad_vllm(600) == 600


def test_the_policies_differ_on_this_workload():
    assert TRUE - VLLM > 0.1


def test_a_padding_function_that_shrinks_a_step_is_refused():
    with pytest.raises(ValueError, match="fewer than the step's"):
        padded_slot_mappings(lambda n: n - 1, [5])
    with pytest.raises(ValueError, match="must return an int"):
        padded_slot_mappings(lambda n: float(n), [5])


def test_right_policy_measurement_and_prediction_pass():
    report = check(pow2, 0.25, TRUE, verbose=False)
    assert report.passed, [r.detail for r in report.results]


def test_strictly_greater_no_cap_and_float_are_named():
    assert "Diagnosis: strictly greater" in check(
        lambda n: 1 << n.bit_length() if n <= 512 else n, None, None, verbose=False).results[0].detail
    assert "Diagnosis: no largest size" in check(
        lambda n: 1 << (n - 1).bit_length(), None, None, verbose=False).results[0].detail
    assert "Diagnosis: not an int" in check(
        lambda n: 2.0 ** math.ceil(math.log2(n)), None, None, verbose=False).results[0].detail


def test_wrong_measurements_are_named():
    assert "Diagnosis: vLLM's sizes measured" in check(pow2, 0.25, VLLM,
                                                       verbose=False).results[1].detail
    assert "Diagnosis: padding over real tokens" in check(
        pow2, 0.25, TRUE / (1 - TRUE), verbose=False).results[1].detail
    assert "Diagnosis: a percentage" in check(pow2, 0.25, 100 * TRUE,
                                              verbose=False).results[1].detail


def test_far_predictions_say_what_they_missed():
    low = check(pow2, 0.02, TRUE, verbose=False).results[2]
    high = check(pow2, 0.5, TRUE, verbose=False).results[2]
    assert not low.passed and "twice the step" in low.detail
    assert not high.passed and "gap to the next size" in high.detail


def test_calling_vllms_policy_is_refused_and_a_crash_named():
    report = check(lambda n: pad_vllm(n), 0.25, TRUE, verbose=False)
    assert "calls the library's pad_vllm" in report.results[0].detail

    def crash(n):
        return [1, 2, 4][n]

    report = check(crash, 0.25, TRUE, verbose=False)
    assert "IndexError" in report.results[0].detail
    assert "Diagnosis: a crash in your policy" in report.results[0].detail


def test_the_workload_is_seeded():
    assert decode_batch_sizes() == decode_batch_sizes()
