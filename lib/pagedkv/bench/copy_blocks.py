"""Achieved bandwidth of the block-copy kernel against a per-cache PyTorch loop.

``python -m pagedkv.bench copy_blocks [--layers 32] [--pairs 1 8 64 256] [--dtype bf16]``

The caches are shaped like Llama-3-8B's (32 layers, a key and a value cache
each, blocks of 16 tokens x 8 KV heads x 128 dims in bf16: 2 MiB per block
across all layers). For each number of copy pairs, the kernel (one launch for
every cache) and the reference (one fancy-index assignment per cache, 64
launches) copy the same pairs in the same process; the report gives their
ratio and the kernel's bandwidth against a plain device-to-device copy and the
device's datasheet peak. On a machine without CUDA the kernel runs in Triton's
interpreter, whose speed says nothing about a GPU: the script says so and only
checks that kernel and reference agree.
"""

from __future__ import annotations

import argparse
import random

import torch

import pagedkv
from pagedkv.bench._cuda_timing import device_ceilings, gbps, time_ms
from pagedkv.kernels.copy_blocks import copy_blocks, copy_blocks_ref, copy_launches

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _pairs(num_blocks: int, n: int, seed: int = 0) -> list[tuple[int, int]]:
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    return list(zip(ids[:n], ids[n : 2 * n]))


def _interpreter_check() -> bool:
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(10, 4, 2, 8, generator=g).to(torch.bfloat16) for _ in range(6)]
    ref = [c.clone() for c in caches]
    pairs = _pairs(10, 4)
    copy_blocks(caches, pairs)
    copy_blocks_ref(ref, pairs)
    return all(torch.equal(a, b) for a, b in zip(caches, ref))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.bench copy_blocks", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=1024, help="blocks per cache (default 1024)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    parser.add_argument("--pairs", type=int, nargs="+", default=[1, 8, 64, 256])
    args = parser.parse_args(argv)

    print(pagedkv.device_summary())
    if not pagedkv.on_gpu():
        print("These bandwidth figures need a GPU: on a CPU the kernel runs in")
        print("Triton's interpreter, whose speed says nothing about a GPU.")
        print("No GB/s are reported here.")
        verdict = "matches" if _interpreter_check() else "DOES NOT match"
        print(f"interpreter check: copy_blocks {verdict} its reference")
        return 0 if verdict == "matches" else 1

    dev, dtype = torch.device("cuda"), _DTYPES[args.dtype]
    shape = (args.blocks, args.block_size, args.heads, args.head_dim)
    caches = [torch.randn(shape, device=dev).to(dtype) for _ in range(2 * args.layers)]
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=dev)
    block_bytes_all = caches[0][0].numel() * caches[0].element_size() * len(caches)

    print(f"caches: {len(caches)} x {tuple(shape)} {args.dtype}; one block across all caches = "
          f"{block_bytes_all / 2**20:.2f} MiB")
    copy_gbps, gpu = device_ceilings(dev)
    peak = gpu.peak_bandwidth_gbs if gpu else None
    print(f"{'pairs':>6}{'triton GB/s':>13}{'torch GB/s':>12}{'triton/torch':>14}{'triton/copy':>13}"
          + (f"{'triton/peak':>13}" if peak else "") + f"{'triton us':>11}")
    for n in args.pairs:
        pairs = _pairs(args.blocks, n, seed=n)
        ref = [c.clone() for c in caches[:2]]
        copy_blocks(caches, pairs)
        copy_blocks_ref(ref, pairs)
        assert all(torch.equal(a, b) for a, b in zip(caches[:2], ref)), "kernel and reference disagree"
        pairs_t = torch.tensor(pairs, dtype=torch.int64, device=dev)
        src, dst = pairs_t[:, 0], pairs_t[:, 1]

        def torch_copy():
            for c in caches:
                c[dst] = c[src]

        # The launch is prepared once: the alignment check reads the address table
        # from the device (a synchronisation), so it stays outside the timed calls.
        (kernel, grid, kargs, kwargs), = copy_launches(ptrs, pairs_t, caches[0])
        ms_k = time_ms(lambda: kernel[grid](*kargs, **kwargs))
        ms_t = time_ms(torch_copy)
        nbytes = 2 * n * block_bytes_all  # read src, write dst
        k, t = gbps(nbytes, ms_k), gbps(nbytes, ms_t)
        print(f"{n:>6}{k:>13,.1f}{t:>12,.1f}{ms_t / ms_k:>13.2f}x{k / copy_gbps:>12.1%}"
              + (f"{k / peak:>12.1%}" if peak else "") + f"{ms_k * 1e3:>11.1f}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
