"""Achieved bandwidth of the slot-mapping and KV-write kernels against PyTorch indexing.

``python -m pagedkv.bench slot_mapping [--tokens N] [--block-size B] [--dtype bf16]``

Both sides run on the same data in the same process, and the report gives
their ratio. The kernels are timed through their launchers alone (validation
is a separate, one-off cost). As a practical ceiling the report also times a
plain device-to-device copy of a large tensor, since both ops are pure memory
traffic. On a machine without CUDA the kernels run in Triton's interpreter,
whose speed says nothing about a GPU: the script then says so, and only checks
that both kernels agree with their references.
"""

from __future__ import annotations

import argparse

import torch

import pagedkv
from pagedkv.bench._cuda_timing import device_ceilings, gbps, time_ms
from pagedkv.kernels.kv_write import launch_reshape_and_cache, reshape_and_cache, reshape_and_cache_ref
from pagedkv.kernels.slot_mapping import launch_slot_mapping, compute_slot_mapping, compute_slot_mapping_ref
from ..common import cdiv

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _interpreter_check() -> bool:
    """Small-shape agreement of both kernels with their references (runs anywhere)."""
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(64, generator=g)[:48].reshape(4, 12).to(torch.int32)
    reqs = torch.randint(-1, 4, (32,), generator=g)
    pos = torch.randint(0, 12 * 16, (32,), generator=g)
    dev = pagedkv.default_device()
    ok = torch.equal(
        compute_slot_mapping(table.to(dev), reqs, pos, 16), compute_slot_mapping_ref(table.to(dev), reqs, pos, 16)
    )
    key = torch.randn(8, 2, 16, generator=g).to(torch.bfloat16).to(dev)
    value = torch.randn(8, 2, 16, generator=g).to(torch.bfloat16).to(dev)
    caches = [torch.zeros(6, 16, 2, 16, dtype=torch.bfloat16, device=dev) for _ in range(4)]
    slots = torch.randperm(96, generator=g)[:8].to(dev)
    slots[3] = -1
    reshape_and_cache(key, value, caches[0], caches[1], slots)
    reshape_and_cache_ref(key, value, caches[2], caches[3], slots)
    return ok and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.bench slot_mapping", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens in the step (default 16384)")
    parser.add_argument("--reqs", type=int, default=256, help="block-table rows (default 256)")
    parser.add_argument("--max-model-len", type=int, default=32768, help="context window (default 32768)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8, help="KV heads (Llama-3-8B: 8)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    args = parser.parse_args(argv)

    print(pagedkv.device_summary())
    if not pagedkv.on_gpu():
        print("These bandwidth figures need a GPU: on a CPU the kernels run in")
        print("Triton's interpreter, whose speed says nothing about a GPU.")
        print("No GB/s are reported here.")
        verdict = "match" if _interpreter_check() else "DO NOT match"
        print(f"interpreter check: slot mapping and KV write {verdict} their references")
        return 0 if verdict == "match" else 1

    dev = torch.device("cuda")
    dtype = _DTYPES[args.dtype]
    bs, n_tok = args.block_size, args.tokens
    max_blocks = args.max_model_len // bs
    g = torch.Generator(device=dev).manual_seed(0)

    # --- slot mapping: a decode-and-prefill mix spread over every row ---------------------------
    num_blocks = args.reqs * max_blocks
    table = torch.randperm(num_blocks, device=dev, generator=g).to(torch.int32).reshape(args.reqs, max_blocks)
    req = torch.randint(0, args.reqs, (n_tok,), device=dev, generator=g)
    pos = torch.randint(0, args.max_model_len, (n_tok,), device=dev, generator=g)
    out = torch.empty(n_tok, dtype=torch.int64, device=dev)
    assert torch.equal(compute_slot_mapping(table, req, pos, bs), compute_slot_mapping_ref(table, req, pos, bs))

    def torch_slots():
        return table[req, pos // bs].long() * bs + pos % bs

    # Bytes that must move: read req and pos (int64), one int32 table cell, write one int64 slot.
    sm_bytes = n_tok * (8 + 8 + 4 + 8)
    ms_sm_kernel = time_ms(lambda: launch_slot_mapping(table, req, pos, bs, out))
    ms_sm_torch = time_ms(torch_slots)

    # --- KV write: every token to a distinct random slot -----------------------------------------
    kv_blocks = max(cdiv(n_tok, bs) * 2, 1)  # room for every token, twice over
    shape = (kv_blocks, bs, args.heads, args.head_dim)
    key_cache = torch.zeros(shape, dtype=dtype, device=dev)
    value_cache = torch.zeros_like(key_cache)
    key = torch.randn(n_tok, args.heads, args.head_dim, device=dev, generator=g).to(dtype)
    value = torch.randn_like(key)
    slots = torch.randperm(kv_blocks * bs, device=dev, generator=g)[:n_tok]
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    kc_ref, vc_ref = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    reshape_and_cache_ref(key, value, kc_ref, vc_ref, slots)
    assert torch.equal(key_cache, kc_ref) and torch.equal(value_cache, vc_ref)

    flat_k, flat_v = key_cache.view(-1, args.heads, args.head_dim), value_cache.view(-1, args.heads, args.head_dim)

    def torch_write():
        flat_k.index_copy_(0, slots, key)
        flat_v.index_copy_(0, slots, value)

    # Read K and V, write them into the caches, read the slots.
    kv_bytes = 2 * 2 * key.numel() * key.element_size() + n_tok * 8
    ms_kv_kernel = time_ms(lambda: launch_reshape_and_cache(key, value, key_cache, value_cache, slots))
    ms_kv_torch = time_ms(torch_write)

    print(f"shapes: {n_tok} tokens, table {args.reqs} x {max_blocks}, block_size {bs}, "
          f"{args.heads} KV heads x {args.head_dim}, {args.dtype}")
    copy_gbps, gpu = device_ceilings(dev)
    peak = gpu.peak_bandwidth_gbs if gpu else None
    rows = [
        ("slot mapping", sm_bytes, ms_sm_kernel, ms_sm_torch),
        ("KV write", kv_bytes, ms_kv_kernel, ms_kv_torch),
    ]
    print(f"{'op':<14}{'triton GB/s':>13}{'torch GB/s':>12}{'triton/torch':>14}{'triton/copy':>13}"
          + (f"{'triton/peak':>13}" if peak else "") + f"{'triton us':>11}")
    for name, nbytes, ms_k, ms_t in rows:
        k, t = gbps(nbytes, ms_k), gbps(nbytes, ms_t)
        print(f"{name:<14}{k:>13,.1f}{t:>12,.1f}{ms_t / ms_k:>13.2f}x{k / copy_gbps:>12.1%}"
              + (f"{k / peak:>13.1%}" if peak else "") + f"{ms_k * 1e3:>11.1f}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
