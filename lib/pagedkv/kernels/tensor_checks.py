"""The argument checks every kernel wrapper shares, before anything is launched.

A kernel cannot report a bad argument: in Triton's interpreter an out-of-bounds
load kills the process, and on a GPU it reads or corrupts another request's
memory. So each wrapper refuses, with a message naming the argument, anything
its kernel could not read safely: non-tensors, tensors without data (PyTorch's
``meta`` device), non-contiguous tensors (the kernels compute flat offsets), and
tensors on different devices.
"""

from __future__ import annotations

import torch

__all__ = ["refuse_meta_tensor", "check_tensor_args", "as_index_tensor"]

_INDEX_DTYPES = (torch.int32, torch.int64)


def refuse_meta_tensor(tensor: torch.Tensor, name: str) -> None:
    """Refuse a tensor on PyTorch's ``meta`` device, naming the argument.

    A meta tensor has a shape and a dtype but no data, so validation cannot
    read it (PyTorch's own error would not say which argument) and a kernel
    could not either.
    """
    if tensor.device.type == "meta":
        raise ValueError(
            f"{name} is on the meta device, which holds no data; the kernels need real tensors "
            f"(create it on pagedkv.default_device())"
        )


def check_tensor_args(named: dict) -> None:
    """The checks every kernel wrapper starts with: tensors, with data, contiguous, on one device."""
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        refuse_meta_tensor(t, name)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")
    devices = {str(t.device) for t in named.values()}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(devices)}")


def as_index_tensor(x, name: str, device: torch.device) -> torch.Tensor:
    """Accept a tensor, numpy array or sequence of integers; return a 1-D integer tensor."""
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
        if x.numel() == 0:
            x = x.to(torch.int64)
    refuse_meta_tensor(x, name)
    if x.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must hold int32 or int64 values, got dtype {x.dtype}")
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
    return x.to(device).contiguous()
