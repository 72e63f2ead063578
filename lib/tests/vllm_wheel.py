"""The vLLM 0.33.0 wheel for the differential tests that execute vLLM's own code from it.

Not a test module: ``test_block_tables``, ``test_kv_cache_groups`` and
``test_scheduler_async_vs_vllm`` import ``vllm_wheel()``. The wheel comes from
``tools.citations``' cache (downloaded once); without it a test skips, except
under ``CI=true``, where a skip would let the differential pass unseen.
"""

import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def vllm_wheel():
    """The path of the vLLM 0.33.0 wheel, or a skip (a failure under CI)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from tools import citations

    path = citations.find_wheel(citations.VLLM)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("the vLLM 0.33.0 wheel could not be fetched; the differential test would pass unseen")
        pytest.skip("the vLLM 0.33.0 wheel is not cached and cannot be downloaded")
    return path
