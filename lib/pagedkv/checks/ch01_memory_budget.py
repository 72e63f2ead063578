"""Checks for exercises/01_memory_budget.ipynb.

The learner writes two functions from the chapter's arithmetic:

* ``kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes) -> int``
* ``kv_pool_blocks(total_mib, gpu_memory_utilization, weight_gib, non_kv_gib, model, block_size, dtype_bytes) -> int``
  where ``model`` is a :class:`pagedkv.budget.ModelSpec`.

Each is compared with the library (``pagedkv.budget``) and with an independent
oracle written here in exact rational arithmetic, on known answers and on
seeded random configurations.
"""

from __future__ import annotations

import random
from fractions import Fraction

from .. import budget
from ._harness import Checker, CheckReport, expect_equal, expect_int

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


def check_kv_bytes_per_token(fn, cases: int = 200, seed: int = 0) -> CheckReport:
    """Check ``fn(num_layers, num_kv_heads, head_dim, dtype_bytes) -> int``."""
    rng = random.Random(seed)
    with Checker("kv_bytes_per_token") as c:
        def llama():
            got = expect_int(fn(32, 8, 128, 2), "Llama-3-8B in bf16")
            expect_equal(got, budget.kv_bytes_per_token("Llama-3-8B", "bf16"), "Llama-3-8B in bf16 (bytes)")

        c.prop("Llama-3-8B in bf16 costs 131,072 bytes (128 KiB) per token", llama,
               "count K and V, in every layer, for every KV head (not every query head)")

        def presets():
            for m in budget.MODELS.values():
                for name, nbytes in (("fp32", 4), ("bf16", 2), ("fp8", 1)):
                    got = expect_int(fn(m.num_layers, m.num_kv_heads, m.head_dim, nbytes), m.name)
                    expect_equal(got, budget.kv_bytes_per_token(m, name), f"{m.name} in {name}")

        c.prop("every preset model in fp32, bf16 and fp8 matches pagedkv.budget", presets,
               "the dtype enters as bytes per element, a plain factor")

        def randomized():
            for _ in range(cases):
                args = (rng.randint(1, 128), rng.choice([1, 2, 4, 8, 16, 64]), rng.choice([64, 96, 128, 256]),
                        rng.choice([1, 2, 4]))
                expect_equal(expect_int(fn(*args), f"fn{args}"), _oracle_bytes_per_token(*args), f"fn{args}")

        c.prop(f"{cases} random shapes match an independent count", randomized,
               "2 x layers x kv_heads x head_dim x dtype_bytes")
    return c.report


def check_kv_pool_blocks(fn, cases: int = 200, seed: int = 0) -> CheckReport:
    """Check ``fn(total_mib, gpu_memory_utilization, weight_gib, non_kv_gib, model, block_size, dtype_bytes) -> int``."""
    rng = random.Random(seed)
    llama = budget.model_spec("Llama-3-8B")
    with Checker("kv_pool_blocks") as c:
        def reference():
            got = expect_int(fn(81_559, 0.92, 14.96, 6.0, llama, 16, 2), "H100 / Llama-3-8B / block 16")
            expect_equal(got, 26_785, "blocks for the book's reference setup")

        c.prop("the reference H100 setup gives 26,785 blocks of 16", reference,
               "pool = total x utilization - weights - non-KV; then // page bytes // layers")

        def rounded_total():
            # 79.65 GiB is what nvidia-smi's 81,559 MiB looks like rounded; it is 2.6 MiB too much.
            got = expect_int(fn(79.65 * 1024, 0.92, 14.96, 6.0, llama, 16, 2), "total given as 79.65 GiB")
            expect_equal(got, 26_786, "blocks when the total is the rounded 79.65 GiB")

        c.prop("feeding the rounded 79.65 GiB gives 26,786 (the extra 2.6 MiB crosses a block)", rounded_total,
               "do not round the total before dividing; convert MiB and GiB with powers of 2")

        def block_sizes():
            for bs in (1, 8, 16, 32, 128):
                pool = budget.kv_pool_bytes(81_559 * budget.MiB, 0.92, 14.96 * budget.GiB, 6.0 * budget.GiB)
                expect_equal(expect_int(fn(81_559, 0.92, 14.96, 6.0, llama, bs, 2), f"block_size={bs}"),
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
                got = expect_int(fn(*args), "random configuration")
                if got != want:
                    raise AssertionError(f"{m.num_layers} layers, {m.num_kv_heads} KV heads, head_dim {m.head_dim}, "
                                         f"total {args[0]} MiB, utilization {args[1]}, weights {args[2]} GiB, "
                                         f"non-KV {args[3]} GiB, block {args[5]}, {args[6]} B: expected {want}, got {got}")

        c.prop(f"{cases} random GPUs and models match an exact-arithmetic oracle", randomized,
               "floor-divide by the per-layer page first, then by the layer count")
    return c.report
