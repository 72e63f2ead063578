"""PackedLinear: the CPU's packed products equal the layers' own, and follow every change to the weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pagedkv.model.cpu_linear as cpu_linear
from pagedkv.engine import EngineArgs, LLMEngine
from pagedkv.model import Model, ModelConfig, dense_logits
from pagedkv.model.cpu_linear import PackedLinear, plain_products

PACKS = cpu_linear._X86 and torch.backends.mkldnn.is_available()


def _layers(bias: bool, seed: int = 0):
    torch.manual_seed(seed)
    return [nn.Linear(48, n, bias=bias) for n in (32, 16, 16)]


def _plain(layers, x):
    return torch.cat([F.linear(x, layer.weight, layer.bias) for layer in layers], dim=-1)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (3, 48), (40, 48), (2, 5, 48), (1, 1, 48), (0, 48)])
def test_packed_products_equal_the_separate_products(bias, shape):
    layers = _layers(bias)
    packed = PackedLinear(*layers)
    x = torch.randn(shape)
    with torch.inference_mode():
        out, want = packed(x), _plain(layers, x)
    assert out.shape == want.shape == (*shape[:-1], 64)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_a_single_layer_and_an_embedding_as_the_head():
    torch.manual_seed(1)
    emb = nn.Embedding(100, 48)
    head = PackedLinear(emb, one_row_copy=False)
    x = torch.randn(4, 48)
    with torch.no_grad():
        torch.testing.assert_close(head(x), x @ emb.weight.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(head(x[:1]), x[:1] @ emb.weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 6])
def test_editing_or_replacing_a_weight_repacks(rows):
    layers = _layers(bias=True)
    packed = PackedLinear(*layers)
    x = torch.randn(rows, 48)
    with torch.no_grad():
        before = packed(x)
        layers[1].weight.mul_(2)  # in place: the version counter moves
        layers[2].bias.add_(1)
        torch.testing.assert_close(packed(x), _plain(layers, x), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(packed(x), before)
        layers[0].weight = nn.Parameter(torch.zeros(32, 48))  # a new tensor: new storage
        out = packed(x)
    torch.testing.assert_close(out, _plain(layers, x), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[:, :32], layers[0].bias.detach().expand(rows, 32))


def test_training_bf16_and_missing_onednn_use_the_layers_own_products(monkeypatch):
    layers = _layers(bias=True)
    packed = PackedLinear(*layers)
    x = torch.randn(3, 48, requires_grad=True)
    out = packed(x)  # autograd on: exactly the separate products, and gradients flow
    assert torch.equal(out, _plain(layers, x))
    out.sum().backward()
    assert layers[0].weight.grad is not None and x.grad is not None

    bf16 = [layer.to(torch.bfloat16) for layer in _layers(bias=False)]
    with torch.no_grad():
        xb = torch.randn(3, 48, dtype=torch.bfloat16)
        assert torch.equal(PackedLinear(*bf16)(xb), _plain(bf16, xb))

    def no_onednn(*args):
        raise RuntimeError("no oneDNN in this build")

    monkeypatch.setattr(cpu_linear, "_packing_works", None)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", no_onednn, raising=False)
    fresh = PackedLinear(*_layers(bias=False))
    with torch.no_grad():
        x3 = torch.randn(3, 48)
        assert torch.equal(fresh(x3), _plain(fresh.layers, x3))
    assert cpu_linear._packing_works is False or not PACKS


def test_no_layers_is_an_error():
    with pytest.raises(ValueError, match="at least one layer"):
        PackedLinear()


@pytest.mark.skipif(not PACKS, reason="packing needs an x86 CPU and a PyTorch with oneDNN")
def test_the_serving_path_packs_the_reference_path_does_not():
    model = Model(ModelConfig.preset("tiny"), seed=0)
    names = set(model.state_dict())
    prompt = [1, 2, 3, 4, 5]
    dense = dense_logits(model, [prompt])[0]
    attn = model.layers[0].self_attn
    assert attn.qkv._packed is None and attn.qkv._by_row is None  # the reference: plain products only
    engine = LLMEngine(EngineArgs(num_gpu_blocks_override=8, block_size=4, max_model_len=16,
                                  kernel_backend="torch"), model)
    engine.generate([prompt], max_tokens=2, ignore_eos=True)  # a 5-row prefill, then a 1-row decode
    assert attn.qkv._packed is not None and attn.qkv._by_row is not None
    assert model.head._packed is not None and model.head._by_row is None  # the head opts out of the row copy
    assert set(model.state_dict()) == names  # the copies are not parameters
    hidden = torch.randn(5, model.config.hidden_size)
    with torch.no_grad():
        packed = model.compute_logits(hidden)
        with plain_products():
            plain = model.compute_logits(hidden)
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    assert dense.shape == (5, model.config.vocab_size)
