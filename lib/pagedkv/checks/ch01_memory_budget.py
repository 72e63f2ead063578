"""Checks for exercises/01_memory_budget.ipynb.

The learner writes two functions from the chapter's arithmetic:

* ``kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes) -> int``
* ``kv_pool_blocks(total_mib, gpu_memory_utilization, weight_gib, non_kv_gib, model, block_size, dtype_bytes) -> int``
  where ``model`` is a :class:`pagedkv.budget.ModelSpec`.

Each is compared with the library (``pagedkv.budget``) and with an independent
oracle written here in exact rational arithmetic, on known answers and on
seeded random configurations. A wrong answer is compared with the answers of
the common mistakes (K without V, the rounded total, the utilization applied
after subtracting, a ceil or round where the floor belongs...), so the line
names the mistake.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

from .. import budget
from ._harness import (Checker, CheckReport, Mistake, catalogue, expect_int,
                       wrong)

__all__ = ["check_kv_bytes_per_token", "check_kv_pool_blocks"]


def _oracle_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    # K and V, for every layer, for every KV head, for every element of the head.
    return sum(dtype_bytes * head_dim * kv_heads for _layer in range(layers) for _kv in ("K", "V"))


def _oracle_blocks(total_mib, util, weight_gib, non_kv_gib, model, block_size, dtype_bytes) -> int:
    # Exact rationals: no float rounding can move the answer across a block boundary.
    pool = Fraction(total_mib) * 2**20 * Fraction(str(util)) - (Fraction(str(weight_gib)) + Fraction(str(non_kv_gib))) * 2**30
    page = block_size * 2 * model.num_kv_heads * model.head_dim * dtype_bytes
    return max(0, int(pool // page) // model.num_layers)


def _random_model(rng: random.Random) -> budget.ModelSpec:
    kv = rng.choice([1, 2, 4, 8, 16, 32])
    return budget.ModelSpec(name="random", num_layers=rng.randint(1, 96), num_attention_heads=kv * rng.choice([1, 2, 4, 8]),
                            num_kv_heads=kv, head_dim=rng.choice([64, 80, 96, 128, 256]), num_params=1,
                            native_context=4096, extended_context=4096)


# ------------------------------------------------------------------ mistakes
KV_MISTAKES = [
    Mistake("K only", "each token stores a key and a value in every layer: "
            "x 2 (65,536 is half of Llama-3.1-8B's 131,072)",
            lambda L, H, D, b: L * H * D * b),
    Mistake("bytes per element forgotten", "this counts elements: multiply "
            "by dtype_bytes", lambda L, H, D, b: 2 * L * H * D),
    Mistake("one layer", "every layer stores its own K and V: multiply by "
            "num_layers", lambda L, H, D, b: 2 * H * D * b),
    Mistake("bits, not bytes", "dtype_bytes is already in bytes: drop the "
            "x 8", lambda L, H, D, b: 16 * L * H * D * b),
    Mistake("dtype ignored", "2 bytes hard-coded: use dtype_bytes",
            lambda L, H, D, b: 4 * L * H * D),
    Mistake("a constant", "the answer must depend on the arguments "
            "(131,072 is Llama-3.1-8B's only)", lambda *a: 131_072),
]
_KV_PROBES = [(3, 5, 7, 1), (3, 5, 7, 4), (2, 1, 64, 2)]

MiB, GiB = 2**20, 2**30


def _float_blocks(total, util, w, n, m, bs, db, *, pool=None, page=None,
                  layers=True, div=None):
    """The float computation a learner writes, with one piece swapped."""
    if pool is None:
        pool = total * MiB * util - w * GiB - n * GiB
    if page is None:
        page = bs * 2 * m.num_kv_heads * m.head_dim * db
    if div is not None:
        return div(pool / page / (m.num_layers if layers else 1))
    blocks = int(pool // page)
    return blocks // m.num_layers if layers else blocks


POOL_MISTAKES = [
    Mistake("rounded total", "81,559 MiB is 79.647 GiB; rounded to 79.65 it "
            "is 2.6 MiB too much, and the reference setup gets 26,786 blocks "
            "instead of 26,785: keep the exact MiB", lambda T, *r: _float_blocks(round(T / 1024, 2) * 1024, *r)),
    Mistake("utilization applied after subtracting", "vLLM takes the "
            "fraction of the whole GPU, then subtracts weights and non-KV "
            "memory (27,644 is (total - weights - non-KV) x 0.92)",
            lambda T, u, w, n, *r: _float_blocks(
                T, u, w, n, *r, pool=(T * MiB - (w + n) * GiB) * u)),
    Mistake("utilization not applied", "multiply the total by "
            "gpu_memory_utilization", lambda T, u, w, n, *r: _float_blocks(
                T, u, w, n, *r, pool=T * MiB - (w + n) * GiB)),
    Mistake("non-KV memory not subtracted", "activations and other non-KV "
            "memory come off the budget too",
            lambda T, u, w, n, *r: _float_blocks(T, u, w, 0, *r)),
    Mistake("decimal units", "MiB and GiB are powers of 2 (2**20, 2**30), "
            "not 10**6 and 10**9", lambda T, u, w, n, *r: _float_blocks(
                T, u, w, n, *r, pool=T * 1e6 * u - (w + n) * 1e9)),
    Mistake("a ceil where a floor belongs", "a partial block cannot be "
            "allocated: floor-divide", lambda *a: _float_blocks(
                *a, div=math.ceil)),
    Mistake("rounded to the nearest block", "a partial block cannot be "
            "allocated: floor-divide, do not round", lambda *a:
            _float_blocks(*a, div=round)),
    Mistake("K only", "a block's page holds K and V: the factor 2",
            lambda T, u, w, n, m, bs, db: _float_blocks(
                T, u, w, n, m, bs, db,
                page=bs * m.num_kv_heads * m.head_dim * db)),
    Mistake("layers not divided out", "the page is per layer: divide by "
            "num_layers as well", lambda *a: _float_blocks(*a, layers=False)),
    Mistake("token slots, not blocks", "divide by the block size: a block "
            "holds block_size tokens", lambda T, u, w, n, m, bs, db:
            _float_blocks(T, u, w, n, m, 1, db)),
]


def _pool_probes():
    llama = budget.model_spec("Llama-3.1-8B")
    qwen = budget.model_spec("Qwen2.5-7B")
    return [(81_559, 0.92, 14.96, 6.0, llama, 16, 2),
            (23_034, 0.9, 14.2, 1.5, qwen, 16, 2),
            (143_771, 0.85, 14.96, 3.0, llama, 32, 2),
            (81_920, 0.6, 2.0, 1.0, qwen, 8, 1)]


def check_kv_bytes_per_token(fn, cases: int = 200, seed: int = 0, timeout: float = 20.0) -> CheckReport:
    """Check ``fn(num_layers, num_kv_heads, head_dim, dtype_bytes) -> int``.

    ``timeout`` bounds each property, in seconds; after a hang the others fail at once.
    """
    rng = random.Random(seed)

    def compare(args, want, what):
        got = expect_int(fn(*args), what)
        if got != want:
            raise wrong(f"{what}: expected {want:,}, got {got:,}", got, args,
                        KV_MISTAKES, fn, _KV_PROBES)

    with Checker("kv_bytes_per_token", timeout=timeout) as c:
        c.probe(lambda: fn(32, 8, 128, 2))

        def llama():
            compare((32, 8, 128, 2), budget.kv_bytes_per_token("Llama-3.1-8B", "bf16"),
                    "Llama-3.1-8B in bf16 (bytes)")

        c.prop("Llama-3.1-8B in bf16 costs 131,072 bytes (128 KiB) per token", llama,
               "count K and V, in every layer, for every KV head (not every query head)")

        def presets():
            for m in budget.MODELS.values():
                for name, nbytes in (("fp32", 4), ("bf16", 2), ("fp8", 1)):
                    compare((m.num_layers, m.num_kv_heads, m.head_dim, nbytes),
                            budget.kv_bytes_per_token(m, name), f"{m.name} in {name}")

        c.prop("every preset model in fp32, bf16 and fp8 matches pagedkv.budget", presets,
               "the dtype enters as bytes per element, a plain factor")

        def randomized():
            for _ in range(cases):
                args = (rng.randint(1, 128), rng.choice([1, 2, 4, 8, 16, 64]), rng.choice([64, 96, 128, 256]),
                        rng.choice([1, 2, 4]))
                compare(args, _oracle_bytes_per_token(*args), f"fn{args}")

        c.prop(f"{cases} random shapes match an independent count", randomized,
               "2 x layers x kv_heads x head_dim x dtype_bytes")
    return c.report


catalogue(check_kv_bytes_per_token, KV_MISTAKES)


def check_kv_pool_blocks(fn, cases: int = 200, seed: int = 0) -> CheckReport:
    """Check ``fn(total_mib, gpu_memory_utilization, weight_gib, non_kv_gib, model, block_size, dtype_bytes) -> int``."""
    rng = random.Random(seed)
    llama = budget.model_spec("Llama-3.1-8B")
    probes = _pool_probes()

    def compare(args, want, what):
        got = expect_int(fn(*args), what)
        if got != want:
            raise wrong(f"{what}: expected {want:,}, got {got:,}", got, args,
                        POOL_MISTAKES, fn, probes)

    with Checker("kv_pool_blocks") as c:
        c.probe(lambda: fn(81_559, 0.92, 14.96, 6.0, llama, 16, 2))

        def reference():
            compare((81_559, 0.92, 14.96, 6.0, llama, 16, 2), 26_785,
                    "blocks for the book's reference setup")

        c.prop("the reference H100 setup gives 26,785 blocks of 16", reference,
               "pool = total x utilization - weights - non-KV; then // page bytes // layers")

        def rounded_total():
            # 79.65 GiB is what nvidia-smi's 81,559 MiB looks like rounded; it is 2.6 MiB too much.
            compare((79.65 * 1024, 0.92, 14.96, 6.0, llama, 16, 2), 26_786,
                    "blocks when the total is the rounded 79.65 GiB")

        c.prop("feeding the rounded 79.65 GiB gives 26,786 (the extra 2.6 MiB crosses a block)", rounded_total,
               "do not round the total before dividing; convert MiB and GiB with powers of 2")

        def block_sizes():
            for bs in (1, 8, 16, 32, 128):
                pool = budget.kv_pool_bytes(81_559 * budget.MiB, 0.92, 14.96 * budget.GiB, 6.0 * budget.GiB)
                compare((81_559, 0.92, 14.96, 6.0, llama, bs, 2),
                        budget.num_gpu_blocks(pool, llama, bs), f"blocks at block_size={bs}")

        c.prop("block sizes 1 to 128 match pagedkv.budget.num_gpu_blocks", block_sizes,
               "a block's page is block_size x 2 x kv_heads x head_dim x dtype_bytes, per layer")

        def randomized():
            for _ in range(cases):
                m = _random_model(rng)
                args = (rng.choice([23_034, 24_564, 81_559, 81_920, 143_771]), round(rng.uniform(0.5, 1.0), 2),
                        round(rng.uniform(0, 10), 2), round(rng.uniform(0, 8), 1), m, rng.choice([1, 8, 16, 32, 128]),
                        rng.choice([1, 2, 4]))
                want = _oracle_blocks(*args)
                if want == 0:
                    continue  # no room at all: the exercise leaves that case to the startup check
                compare(args, want, f"{m.num_layers} layers, {m.num_kv_heads} KV heads, "
                        f"head_dim {m.head_dim}, total {args[0]} MiB, utilization {args[1]}, "
                        f"weights {args[2]} GiB, non-KV {args[3]} GiB, block {args[5]}, "
                        f"{args[6]} B")

        c.prop(f"{cases} random GPUs and models match an exact-arithmetic oracle", randomized,
               "floor-divide by the per-layer page first, then by the layer count")
    return c.report


catalogue(check_kv_pool_blocks, POOL_MISTAKES)
