"""The CPU/GPU rule: one Triton mode chosen at import, and kernels refuse tensors it cannot read."""

import os

import pytest
import torch

import pagedkv
from pagedkv import _device
from pagedkv.kernels import compute_slot_mapping, copy_blocks, reshape_and_cache


def test_mode_matches_the_machine():
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        assert pagedkv.on_gpu() and pagedkv.default_device().type == "cuda"
        assert pagedkv.device_summary().startswith("GPU: ")
    else:
        assert os.environ["TRITON_INTERPRET"] == "1" and not pagedkv.on_gpu()
        assert pagedkv.default_device() == torch.device("cpu")
        assert pagedkv.device_summary().startswith("CPU: Triton kernels run in the interpreter")
    assert "\n" not in pagedkv.device_summary()


@pytest.fixture
def pretend_compiled(monkeypatch):
    """Make the library believe kernels are compiled, to test the guard without a GPU."""
    monkeypatch.setattr(_device, "on_gpu", lambda: True)


def test_compiled_kernels_refuse_cpu_tensors_before_launch(pretend_compiled):
    caches = [torch.zeros(4, 2, 1, 2)]
    with pytest.raises(ValueError, match=r"kv_caches is on cpu, but the kernels run compiled on the GPU"):
        copy_blocks(caches, [(1, 2)])
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_table is on cpu.*pagedkv.default_device\(\)"):
        compute_slot_mapping(table, [0], [0], 4)
    k = torch.zeros(1, 1, 2)
    with pytest.raises(ValueError, match=r"key_cache is on cpu"):
        reshape_and_cache(k, k, torch.zeros(2, 2, 1, 2), torch.zeros(2, 2, 1, 2), torch.tensor([0]))
    assert torch.count_nonzero(caches[0]) == 0
