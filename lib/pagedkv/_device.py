"""Choose the device and the Triton mode once, before any kernel is defined.

The rule of the book: the same notebook runs on a laptop and on a GPU instance.
On a machine with CUDA the Triton kernels are compiled for the GPU; anywhere
else they run in Triton's interpreter (``TRITON_INTERPRET=1``), on CPU tensors.
Triton reads that variable when a kernel is decorated, so this module must be
imported before any ``@triton.jit`` in the package -- ``pagedkv/__init__.py``
imports it first.
"""

from __future__ import annotations

import os

import torch

_CUDA = torch.cuda.is_available()

# A reader may force the interpreter on a GPU machine (TRITON_INTERPRET=1);
# we never force compilation where there is no GPU to compile for.
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


def on_gpu() -> bool:
    """True when kernels run compiled on a CUDA device; gate GPU-only cells on it."""
    return _CUDA and not INTERPRETED


def default_device() -> torch.device:
    """Where tensors for the kernels live: the GPU when compiled, else the CPU."""
    return torch.device("cuda") if on_gpu() else torch.device("cpu")


def require_kernel_device(tensor: torch.Tensor, name: str) -> None:
    """Refuse a tensor the current Triton mode cannot read, before any launch.

    Compiled kernels dereference device pointers, so a CPU tensor would be read
    as garbage (or rejected deep inside Triton); put it on ``default_device()``.
    """
    if on_gpu() and tensor.device.type != "cuda":
        raise ValueError(
            f"{name} is on {tensor.device}, but the kernels run compiled on the GPU: "
            f"create it on pagedkv.default_device() ({default_device()})"
        )


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:  # a laptop without Triton can still run everything but kernels
        return None
    return triton.__version__


def device_summary() -> str:
    """One line: which device, which Triton mode, which versions."""
    tv = triton_version()
    triton_part = "Triton not installed" if tv is None else f"triton {tv}"
    if on_gpu():
        name = torch.cuda.get_device_name(0)
        return f"GPU: {name}; Triton kernels compiled ({triton_part}, torch {torch.__version__})"
    return f"CPU: Triton kernels run in the interpreter ({triton_part}, torch {torch.__version__})"
