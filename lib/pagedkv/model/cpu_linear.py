"""The model's products on an x86 CPU: oneDNN over prepacked weights, as vLLM's CPU worker runs them.

vLLM 0.33.0 packs every unquantized linear weight for oneDNN once, when the
model loads, and calls the packed product at every step
(``dispatch_cpu_unquantized_gemm``, ``model_executor/layers/utils.py:532``;
``handler = ops.create_onednn_mm(origin_weight.t(), 32)``,
``model_executor/layers/utils.py:643-656``), and its Llama runs q/k/v as one
product and gate/up as another (``qkv_proj``, ``model_executor/models/llama.py:165``;
``gate_up_proj``, ``model_executor/models/llama.py:95``). PyTorch ships the two
oneDNN steps as operators, the ones its compiler emits for a frozen CPU model:
``torch.ops.mkldnn._reorder_linear_weight`` packs and
``torch.ops.mkldnn._linear_pointwise`` multiplies. ``F.linear`` instead hands
the weight as stored to the BLAS, which blocks it poorly for the few rows of
a decode step; ``python -m pagedkv.bench engine`` measures what packing buys.

Invariants:

* Packing is used only where it computes the same products: an x86 CPU,
  float32, no autograd. Anywhere else (a GPU, bf16, training, another
  architecture, a PyTorch without oneDNN) and inside ``plain_products()`` (the
  model's dense reference path) a ``PackedLinear`` is the layers' own
  ``F.linear`` products, side by side; on a GPU nothing is copied.
* The packed copy is keyed by every weight's and bias's storage, version
  counter and shape, so loading or editing one in place repacks before the
  next product.
* Packed and plain products differ in rounding only (the sums run in another
  order): about 1e-6 relative in float32, as between two BLAS libraries.
* Each copy costs as much memory as the weights it holds, and the weights
  stay (the state dict, transformers' twin and the dense reference read
  them): up to three times the weights on a CPU, built only when first used.
"""

from __future__ import annotations

import platform
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PackedLinear", "plain_products"]

_PACK_FOR_ROWS = 32  # oneDNN's blocking hint; vLLM passes 32 too. Any row count is still correct.
_X86 = platform.machine().lower() in ("x86_64", "amd64")
_packing_works: bool | None = None  # learnt at the first pack: None = not tried yet
_plain_depth = 0  # > 0 inside plain_products()


@contextmanager
def plain_products():
    """Within this block every ``PackedLinear`` runs its layers' own ``F.linear``: what transformers computes."""
    global _plain_depth
    _plain_depth += 1
    try:
        yield
    finally:
        _plain_depth -= 1


class PackedLinear:
    """Layers that read the same input (q/k/v, or gate/up), run as one product: ``[..., sum of out_features]``.

    ``PackedLinear(q_proj, k_proj, v_proj)(x)`` equals
    ``torch.cat([q_proj(x), k_proj(x), v_proj(x)], -1)``. Where packing applies
    (see the module's invariants) it is one product over the weights side by
    side; anywhere else it is exactly those separate products. The layers stay
    the model's own (their parameters, their state dict): this object only
    holds copies. A layer is anything with ``.weight`` and an optional
    ``.bias`` (the tied head is an ``nn.Embedding``).

    Two copies, each built at its first use:

    * several rows (a prefill, a batch of decodes): oneDNN's packed weight;
    * one row (a lone decode), if ``one_row_copy``: the weight transposed,
      ``[in, out]`` contiguous, which the BLAS streams faster than either the
      packed copy or the weight as stored. The head over a 49,152-word
      vocabulary opts out: there the packed copy is the faster of the two.
    """

    def __init__(self, *layers: nn.Module, one_row_copy: bool = True):
        if not layers:
            raise ValueError("PackedLinear needs at least one layer")
        self.layers, self.one_row_copy = layers, one_row_copy
        self._key = None
        self._packed = self._by_row = self._bias = None

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        outs = [F.linear(x, layer.weight, getattr(layer, "bias", None)) for layer in self.layers]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def _refresh(self) -> None:
        """Drop the copies if a weight or bias was replaced or edited since they were made."""
        biases = [getattr(layer, "bias", None) for layer in self.layers]
        tensors = [t for layer, b in zip(self.layers, biases) for t in (layer.weight, b) if t is not None]
        key = tuple((t.data_ptr(), t._version, t.shape) for t in tensors)
        if key != self._key:
            self._packed = self._by_row = None
            self._bias = (None if all(b is None for b in biases) else  # a missing bias adds zeros
                          torch.cat([torch.zeros(layer.weight.shape[0]) if b is None else b.detach()
                                     for layer, b in zip(self.layers, biases)]))
            self._key = key

    def _weights(self) -> torch.Tensor:
        return torch.cat([layer.weight.detach() for layer in self.layers])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        global _packing_works
        # The copies compute this product only where the module's first invariant says so.
        if not (_X86 and _packing_works is not False and not _plain_depth and not torch.is_grad_enabled()
                and x.device.type == "cpu" and x.dtype == torch.float32 and self.layers[0].weight.dtype == x.dtype):
            return self._plain(x)
        self._refresh()
        if self.one_row_copy and x.numel() == x.shape[-1]:
            if self._by_row is None:
                self._by_row = self._weights().t().contiguous()
            out = x @ self._by_row
            return out if self._bias is None else out.add_(self._bias)
        if self._packed is None:
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self._weights(), _PACK_FOR_ROWS)
            except (AttributeError, RuntimeError, NotImplementedError):  # this build of PyTorch has no oneDNN
                _packing_works = False
                return self._plain(x)
            _packing_works = True
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self._bias, "none", [], "")
