"""Checks for exercises/01_memory_budget.ipynb.

The learner writes four functions from the chapter's arithmetic:

* ``kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes) -> int``
* ``kv_pool_blocks(total_mib, gpu_memory_utilization, weight_gib, non_kv_gib, model, block_size, dtype_bytes) -> int``
  where ``model`` is a :class:`pagedkv.budget.ModelSpec`.
* ``kv_bytes_per_rank(num_layers, num_kv_heads, head_dim, dtype_bytes,
  tensor_parallel_size) -> int``: one tensor-parallel rank's share, the KV
  heads split across ranks and replicated once there are more ranks than heads
  (``budget.kv_heads_per_rank``);
* ``startup_max_model_len(pool_bytes, model, block_size, dtype_bytes) -> int``:
  the longest ``max_model_len`` vLLM 0.33.0's startup check admits for a pool,
  the null block held back (``budget.usable_max_model_len``).

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
from ._harness import (Checker, CheckReport, Mistake, WrongAnswer, catalogue,
                       expect_int, name_mistake, wrong)

__all__ = ["check_kv_bytes_per_token", "check_kv_pool_blocks",
           "check_kv_bytes_per_rank", "check_startup_max_model_len"]


def _oracle_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    # K and V, for every layer, for every KV head, for every element of the head.
    return sum(dtype_bytes * head_dim * kv_heads for _layer in range(layers) for _kv in ("K", "V"))


def _oracle_blocks(total_mib, util, weight_gib, non_kv_gib, model, block_size, dtype_bytes) -> int:
    # Exact rationals: no float rounding can move the answer across a block
    # boundary. One floor, by one block's bytes across all layers, as vLLM
    # 0.33.0 divides (two floors, by the page then by the layers, agree).
    pool = Fraction(total_mib) * 2**20 * Fraction(str(util)) - (Fraction(str(weight_gib)) + Fraction(str(non_kv_gib))) * 2**30
    per_block = block_size * 2 * model.num_kv_heads * model.head_dim * dtype_bytes * model.num_layers
    return max(0, int(pool // per_block))


def _random_model(rng: random.Random) -> budget.ModelSpec:
    kv = rng.choice([1, 2, 4, 8, 16, 32])
    return budget.ModelSpec(name="random", num_layers=rng.randint(1, 96), num_attention_heads=kv * rng.choice([1, 2, 4, 8]),
                            num_kv_heads=kv, head_dim=rng.choice([64, 80, 96, 128, 256]), num_params=1,
                            native_context=4096, extended_context=4096)


# ------------------------------------------------------------------ mistakes
KV_MISTAKES = [
    Mistake("K only", "the count is half the cost: each token stores a key "
            "and a value in every layer (65,536 is half of Llama-3.1-8B's "
            "131,072)", lambda L, H, D, b: L * H * D * b),
    Mistake("bytes per element forgotten", "this counts elements, not "
            "bytes: an element of a bf16 cache is 2 bytes",
            lambda L, H, D, b: 2 * L * H * D),
    Mistake("one layer", "this is one layer's cost: every layer stores its "
            "own K and V", lambda L, H, D, b: 2 * H * D * b),
    Mistake("bits, not bytes", "eight times too much: dtype_bytes is "
            "already in bytes", lambda L, H, D, b: 16 * L * H * D * b),
    Mistake("dtype ignored", "the same answer for every dtype: an fp8 "
            "cache costs half a bf16 one", lambda L, H, D, b: 4 * L * H * D),
    Mistake("a constant", "the answer does not depend on the arguments "
            "(131,072 is Llama-3.1-8B's only)", lambda *a: 131_072),
]
_KV_PROBES = [(3, 5, 7, 1), (3, 5, 7, 4), (2, 1, 64, 2)]

MiB, GiB = 2**20, 2**30


def _float_blocks(total, util, w, n, m, bs, db, *, pool=None, page=None,
                  layers=True, div=None, minus=0):
    """The float computation a learner writes, with one piece swapped."""
    if pool is None:
        pool = total * MiB * util - w * GiB - n * GiB
    if page is None:
        page = bs * 2 * m.num_kv_heads * m.head_dim * db
    if div is not None:
        return div(pool / page / (m.num_layers if layers else 1))
    blocks = int(pool // page)
    return (blocks // m.num_layers if layers else blocks) - minus


POOL_MISTAKES = [
    Mistake("rounded total", "81,559 MiB is 79.647 GiB; rounded to 79.65 it "
            "is 2.6 MiB too much, and the reference setup gets 26,786 blocks "
            "instead of 26,785: a block count is a floor, and a rounded input "
            "moves it", lambda T, *r: _float_blocks(round(T / 1024, 2) * 1024, *r)),
    Mistake("the null block subtracted", "kv_pool_blocks is what vLLM "
            "allocates, num_gpu_blocks, and that count includes the null "
            "block: it is held back later, when blocks are handed out and at "
            "the startup check (26,785 here, 26,784 of them usable)",
            lambda *a: _float_blocks(*a, minus=1)),
    Mistake("utilization applied after subtracting", "the budget is a share "
            "of the whole GPU, and the weights and non-KV memory come out of "
            "it (27,644 is (total - weights - non-KV) x 0.92)",
            lambda T, u, w, n, *r: _float_blocks(
                T, u, w, n, *r, pool=(T * MiB - (w + n) * GiB) * u)),
    Mistake("utilization not applied", "the whole card was taken: vLLM's "
            "budget is total x gpu_memory_utilization",
            lambda T, u, w, n, *r: _float_blocks(
                T, u, w, n, *r, pool=T * MiB - (w + n) * GiB)),
    Mistake("non-KV memory not subtracted", "activations, CUDA graphs and "
            "workspace come out of the budget too, before the KV pool",
            lambda T, u, w, n, *r: _float_blocks(T, u, w, 0, *r)),
    Mistake("decimal units", "MiB and GiB are powers of 2 (2**20, 2**30 "
            "bytes), not 10**6 and 10**9", lambda T, u, w, n, *r: _float_blocks(
                T, u, w, n, *r, pool=T * 1e6 * u - (w + n) * 1e9)),
    Mistake("a ceil where a floor belongs", "a partial block was counted: a "
            "block is allocated whole or not at all", lambda *a: _float_blocks(
                *a, div=math.ceil)),
    Mistake("rounded to the nearest block", "a partial block was rounded up "
            "when it was over half: a block is allocated whole or not at "
            "all", lambda *a: _float_blocks(*a, div=round)),
    Mistake("K only", "twice the blocks: a block's page holds K and V",
            lambda T, u, w, n, m, bs, db: _float_blocks(
                T, u, w, n, m, bs, db,
                page=bs * m.num_kv_heads * m.head_dim * db)),
    Mistake("layers not divided out", "num_layers times the blocks: a block "
            "costs its page in every layer",
            lambda *a: _float_blocks(*a, layers=False)),
    Mistake("token slots, not blocks", "block_size times the blocks: this "
            "counts token slots, and a block holds block_size tokens",
            lambda T, u, w, n, m, bs, db: _float_blocks(T, u, w, n, m, 1, db)),
]
FLOAT_BLOCKS = Mistake(
    "a float block count", "`//` on a float pool gives a float (26785.0): a "
    "block count is a whole number, an int, as vLLM's num_gpu_blocks is")
UNFLOORED = Mistake(
    "no floor", "a fraction of a block came back (26785.62): the pool holds "
    "whole blocks only, so the quotient is floored")


def _pool_probes():
    llama = budget.model_spec("Llama-3.1-8B")
    qwen = budget.model_spec("Qwen2.5-7B")
    return [(81_559, 0.92, 14.96, 6.0, llama, 16, 2),
            (23_034, 0.9, 14.2, 1.5, qwen, 16, 2),
            (143_771, 0.85, 14.96, 3.0, llama, 32, 2),
            (81_920, 0.6, 2.0, 1.0, qwen, 48, 1),
            (24_564, 0.9, 2.0, 1.0, qwen, 48, 1)]  # a fraction under 0.5: ceil, not round


def check_kv_bytes_per_token(fn, cases: int = 200, seed: int = 0, timeout: float = 20.0) -> CheckReport:
    """Check ``fn(num_layers, num_kv_heads, head_dim, dtype_bytes) -> int``.

    ``timeout`` bounds each property, in seconds; after a hang the others fail at once.
    """
    rng = random.Random(seed)

    def compare(args, want, what):
        got = fn(*args)
        if isinstance(got, float) and got.is_integer():  # 131072.0 is a right count
            got = int(got)
        got = expect_int(got, what)
        if got != want:
            raise wrong(f"{what}: expected {want:,}, got {got:,}", got, args,
                        KV_MISTAKES, fn, _KV_PROBES)

    with Checker("kv_bytes_per_token", timeout=timeout) as c:
        c.probe(lambda: fn(32, 8, 128, 2))
        c.written_here("kv_bytes_per_token", lambda: fn(32, 8, 128, 2),
                       {"budget.kv_bytes_per_token": budget.kv_bytes_per_token})

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
               "the message names the shape: count its K and V by hand")
    return c.report


catalogue(check_kv_bytes_per_token, KV_MISTAKES)


def check_kv_pool_blocks(fn, cases: int = 200, seed: int = 0) -> CheckReport:
    """Check ``fn(total_mib, gpu_memory_utilization, weight_gib, non_kv_gib, model, block_size, dtype_bytes) -> int``.

    Block sizes are multiples of 16: vLLM's CUDA attention backends
    (FlashAttention, Triton) take no others.
    """
    rng = random.Random(seed)
    llama = budget.model_spec("Llama-3.1-8B")
    probes = _pool_probes()

    def compare(args, want, what):
        got = fn(*args)
        if isinstance(got, float):
            mistake = FLOAT_BLOCKS if got == want else (
                UNFLOORED if not got.is_integer() and math.floor(got) == want else None)
            raise WrongAnswer(f"{what}: expected the integer {want:,}, got {got!r}",
                              mistake.diagnosis() if mistake else name_mistake(
                                  got, args, POOL_MISTAKES, fn, probes))
        got = expect_int(got, what)
        if got != want:
            raise wrong(f"{what}: expected {want:,}, got {got:,}", got, args,
                        POOL_MISTAKES, fn, probes)

    with Checker("kv_pool_blocks") as c:
        c.probe(lambda: fn(81_559, 0.92, 14.96, 6.0, llama, 16, 2))
        # budget.plan and pool_from_free_memory count through num_gpu_blocks too.
        c.written_here("kv_pool_blocks", lambda: fn(81_559, 0.92, 14.96, 6.0, llama, 16, 2),
                       {"budget.num_gpu_blocks": budget.num_gpu_blocks})

        def reference():
            compare((81_559, 0.92, 14.96, 6.0, llama, 16, 2), 26_785,
                    "blocks for the book's reference setup")

        c.prop("the reference H100 setup gives 26,785 blocks of 16", reference,
               "what comes off the budget, and what does one block cost in "
               "all the layers together?")

        def rounded_total():
            # 79.65 GiB is what nvidia-smi's 81,559 MiB looks like rounded; it is 2.6 MiB too much.
            compare((79.65 * 1024, 0.92, 14.96, 6.0, llama, 16, 2), 26_786,
                    "blocks when the total is the rounded 79.65 GiB")

        c.prop("the rounded 79.65 GiB gives 26,786 (its extra 2.6 MiB crosses a block)", rounded_total,
               "round nothing before the division: MiB and GiB are powers of 2")

        def block_sizes():
            for bs in (16, 32, 48, 64, 128, 256):
                pool = budget.kv_pool_bytes(81_559 * budget.MiB, 0.92, 14.96 * budget.GiB, 6.0 * budget.GiB)
                compare((81_559, 0.92, 14.96, 6.0, llama, bs, 2),
                        budget.num_gpu_blocks(pool, llama, bs), f"blocks at block_size={bs}")

        c.prop("block sizes 16 to 256 match pagedkv.budget.num_gpu_blocks", block_sizes,
               "a block holds block_size tokens of K and V in every layer")

        def randomized():
            for _ in range(cases):
                m = _random_model(rng)
                args = (rng.choice([23_034, 24_564, 81_559, 81_920, 143_771]), round(rng.uniform(0.5, 1.0), 2),
                        round(rng.uniform(0, 10), 2), round(rng.uniform(0, 8), 1), m,
                        rng.choice([16, 32, 48, 64, 128, 256]), rng.choice([1, 2, 4]))
                want = _oracle_blocks(*args)
                if want == 0:
                    continue  # no room at all: the exercise leaves that case to the startup check
                compare(args, want, f"{m.num_layers} layers, {m.num_kv_heads} KV heads, "
                        f"head_dim {m.head_dim}, total {args[0]} MiB, utilization {args[1]}, "
                        f"weights {args[2]} GiB, non-KV {args[3]} GiB, block {args[5]}, "
                        f"{args[6]} B")

        c.prop(f"{cases} random GPUs and models match an exact-arithmetic oracle", randomized,
               "the message names the setup: work it through by hand")
    return c.report


catalogue(check_kv_pool_blocks, POOL_MISTAKES, [FLOAT_BLOCKS, UNFLOORED])


# ----------------------------------------------- (c) per tensor-parallel rank
def _oracle_heads_per_rank(kv_heads: int, tp: int) -> int:
    # Deal the heads out: rank r stores every head h with h * tp // kv_heads
    # == r. Count rank 0's.
    if tp <= kv_heads:
        return sum(1 for h in range(kv_heads) if h * tp // kv_heads == 0)
    return 1  # more ranks than heads: rank r keeps a replica of one head


def _oracle_bytes_per_rank(layers, kv_heads, head_dim, dtype_bytes, tp):
    per_rank = _oracle_heads_per_rank(kv_heads, tp)
    return sum(dtype_bytes * head_dim * per_rank
               for _layer in range(layers) for _kv in ("K", "V"))


RANK_MISTAKES = [
    Mistake("tensor parallelism ignored", "every rank was charged the whole "
            "token: each rank stores only its share of the KV heads",
            lambda L, H, D, b, tp: 2 * L * H * D * b),
    Mistake("heads split below one per rank", "with more ranks than KV "
            "heads a head cannot be split further: vLLM replicates it, so "
            "every rank keeps at least one whole head and the cost stops "
            "falling", lambda L, H, D, b, tp: 2 * L * H * D * b // tp),
    Mistake("zero heads per rank", "past the head count a rank got no head "
            "at all (0 bytes): every rank keeps at least one whole head",
            lambda L, H, D, b, tp: 2 * L * (H // tp) * D * b),
    Mistake("K only", "half the cost: each token stores a key and a value "
            "in every layer", lambda L, H, D, b, tp: L * max(1, H // tp) * D * b),
    Mistake("a constant", "the answer does not depend on the arguments",
            lambda *a: 16_384),
]
FLOAT_HEADS = Mistake(
    "a true division", "a fraction of a head came back (0.5 past the head "
    "count): heads are whole, and every rank keeps at least one")
_RANK_PROBES = [(3, 4, 5, 1, 2), (3, 2, 5, 1, 8), (1, 8, 64, 2, 16)]

#: Valid (num_kv_heads, tensor_parallel_size) pairs: tp divides the heads,
#: or the heads divide tp (vLLM then replicates).
_TPS = (1, 2, 4, 8, 16, 32, 64)


def _valid_tps(kv_heads: int) -> list[int]:
    return [tp for tp in _TPS if kv_heads % tp == 0 or tp % kv_heads == 0]


def check_kv_bytes_per_rank(fn, cases: int = 200, seed: int = 0,
                            timeout: float = 20.0) -> CheckReport:
    """Check ``fn(num_layers, num_kv_heads, head_dim, dtype_bytes,
    tensor_parallel_size) -> int``: one rank's KV bytes per token."""
    rng = random.Random(seed)

    def compare(args, want, what):
        got = fn(*args)
        if isinstance(got, float):
            raise WrongAnswer(f"{what}: expected the integer {want:,}, got "
                              f"{got!r}", FLOAT_HEADS.diagnosis())
        got = expect_int(got, what)
        if got != want:
            raise wrong(f"{what}: expected {want:,}, got {got:,}", got, args,
                        RANK_MISTAKES, fn, _RANK_PROBES)

    with Checker("kv_bytes_per_rank", timeout=timeout) as c:
        c.probe(lambda: fn(32, 8, 128, 2, 2))
        c.written_here("kv_bytes_per_rank", lambda: fn(32, 8, 128, 2, 2),
                       {"budget.kv_bytes_per_token": budget.kv_bytes_per_token,
                        "budget.kv_heads_per_rank": budget.kv_heads_per_rank})

        def split():
            for tp in (1, 2, 4, 8):
                compare((32, 8, 128, 2, tp),
                        budget.kv_bytes_per_token("Llama-3.1-8B", "bf16", tp),
                        f"Llama-3.1-8B in bf16 at tensor_parallel_size={tp}")

        c.prop("Llama-3.1-8B on 1, 2, 4, 8 ranks: 128, 64, 32, 16 KiB per "
               "token per rank", split,
               "which part of a token's KV does tensor parallelism divide "
               "among the ranks?")

        def replicated():
            for tp in (16, 32):
                compare((32, 8, 128, 2, tp),
                        budget.kv_bytes_per_token("Llama-3.1-8B", "bf16", tp),
                        f"Llama-3.1-8B in bf16 at tensor_parallel_size={tp}")

        c.prop("past 8 ranks each rank keeps one whole head: 16 KiB at "
               "TP 16 and 32", replicated,
               "a head is never split: past the head count, heads are "
               "replicated")

        def presets():
            for m in budget.MODELS.values():
                for tp in _valid_tps(m.num_kv_heads):
                    for name, nbytes in (("bf16", 2), ("fp8", 1)):
                        compare((m.num_layers, m.num_kv_heads, m.head_dim,
                                 nbytes, tp),
                                budget.kv_bytes_per_token(m, name, tp),
                                f"{m.name} in {name} at TP {tp}")

        c.prop("every preset model at every TP from 1 to 64 matches "
               "pagedkv.budget", presets,
               "how many whole heads does one rank keep at each TP size?")

        def randomized():
            for _ in range(cases):
                heads = rng.choice([1, 2, 4, 8, 16, 32, 64])
                args = (rng.randint(1, 128), heads,
                        rng.choice([64, 96, 128, 256]), rng.choice([1, 2, 4]),
                        rng.choice(_valid_tps(heads)))
                compare(args, _oracle_bytes_per_rank(*args), f"fn{args}")

        c.prop(f"{cases} random shapes and TP sizes match an independent "
               "count", randomized,
               "the message names the shape: count one rank's heads first")
    return c.report


catalogue(check_kv_bytes_per_rank, RANK_MISTAKES, [FLOAT_HEADS])


# ------------------------------------------- (d) the startup check's estimate
_DTYPE_NAME = {1: "fp8", 2: "bf16", 4: "fp32"}


def _oracle_startup(pool_bytes, model, block_size, dtype_bytes) -> int:
    # Count whole blocks of all layers in exact arithmetic; one of them is
    # the null block, which never holds a token.
    per_block = (block_size * 2 * model.num_kv_heads * model.head_dim
                 * dtype_bytes * model.num_layers)
    blocks = int(Fraction(pool_bytes) // per_block)
    return max(blocks - 1, 0) * block_size


def _page(m, db):
    """One token's K and V in one layer."""
    return 2 * m.num_kv_heads * m.head_dim * db


STARTUP_MISTAKES = [
    Mistake("null block forgotten", "block 0 is the null block and never "
            "holds a token: the startup check holds it back, so 2,048 "
            "blocks of 16 admit 2,047 x 16 = 32,752 tokens, not 32,768",
            lambda P, m, B, db: int(P // (B * _page(m, db) * m.num_layers))
            * B),
    Mistake("the null block as one token", "one token was held back: the "
            "null block is a whole block, block_size tokens",
            lambda P, m, B, db: int(P // (B * _page(m, db) * m.num_layers))
            * B - 1),
    Mistake("the null block held back twice", "two blocks were held back: "
            "there is one null block",
            lambda P, m, B, db: max(int(P // (B * _page(m, db)
                                             * m.num_layers)) - 2, 0) * B),
    Mistake("tokens, not whole blocks", "the pool's part block was counted "
            "in tokens: the pool holds whole blocks, and a part block admits "
            "no token",
            lambda P, m, B, db: max(int(P // (_page(m, db) * m.num_layers))
                                    - B, 0)),
    Mistake("rounded to the nearest block", "a part block over one half "
            "counted as a block: a block is whole or not there",
            lambda P, m, B, db: max(round(P / (B * _page(m, db)
                                                * m.num_layers)) - 1, 0) * B),
    Mistake("divided twice with different rounding", "a part block was "
            "rounded up somewhere (a ceil, or cdiv of the floored tokens): "
            "only whole blocks count",
            lambda P, m, B, db: max(-(-int(P // (_page(m, db) * m.num_layers))
                                      // B) - 1, 0) * B),
    Mistake("layers not divided out", "num_layers times too long: a block "
            "costs its page in every layer",
            lambda P, m, B, db: max(int(P // (B * _page(m, db))) - 1, 0) * B),
    Mistake("blocks, not tokens", "this counts blocks: max_model_len is in "
            "tokens, block_size to a block",
            lambda P, m, B, db: max(int(P // (B * _page(m, db)
                                             * m.num_layers)) - 1, 0)),
    Mistake("a constant", "the answer does not depend on the pool (32,752 "
            "is 2,048 blocks of Llama-3.1-8B's only)", lambda *a: 32_752),
]

NEGATIVE_LENGTH = Mistake(
    "a negative length", "a pool with room for the null block only admits "
    "no request: a length is never below 0")


def _startup_probes():
    llama = budget.model_spec("Llama-3.1-8B")
    qwen = budget.model_spec("Qwen2.5-7B")
    blk = budget.block_bytes(llama, 16)
    return [(2_048 * blk, llama, 16, 2),
            (2_048 * blk + blk * 0.7, llama, 16, 2),
            (1_000 * blk + blk * 0.3, llama, 16, 2),
            (5_000.6 * budget.block_bytes(qwen, 32, "fp8"), qwen, 32, 1),
            (3.2 * budget.block_bytes(qwen, 48), qwen, 48, 2)]


def check_startup_max_model_len(fn, cases: int = 200, seed: int = 0,
                                timeout: float = 20.0) -> CheckReport:
    """Check ``fn(pool_bytes, model, block_size, dtype_bytes) -> int``: the
    longest ``max_model_len`` the startup check admits for the pool."""
    rng = random.Random(seed)
    llama = budget.model_spec("Llama-3.1-8B")
    probes = _startup_probes()

    def compare(args, want, what):
        got = expect_int(fn(*args), what)
        if got < 0:
            raise WrongAnswer(f"{what}: expected {want:,}, got {got:,}",
                              NEGATIVE_LENGTH.diagnosis())
        if got != want:
            raise wrong(f"{what}: expected {want:,}, got {got:,}", got, args,
                        STARTUP_MISTAKES, fn, probes)
        return got

    with Checker("startup_max_model_len", timeout=timeout) as c:
        pinned = 2_048 * budget.block_bytes(llama, 16)
        c.probe(lambda: fn(pinned, llama, 16, 2))
        c.written_here("startup_max_model_len", lambda: fn(pinned, llama, 16, 2),
                       {"budget.usable_max_model_len": budget.usable_max_model_len,
                        "budget.num_gpu_blocks": budget.num_gpu_blocks})

        def override():
            compare((pinned, llama, 16, 2), 32_752,
                    "num_gpu_blocks_override=2048, Llama-3.1-8B, blocks of 16")

        c.prop("2,048 pinned blocks of 16 admit 32,752 tokens (the null "
               "block held back)", override,
               "how many of the 2,048 blocks can hold a token?")

        def startup_check():
            for args in probes:
                pool, m, B, db = args
                got = expect_int(fn(*args), "max_model_len")
                what = (f"{m.name}, {pool / budget.GiB:.3f} GiB pool, "
                        f"blocks of {B}, {db} B")
                try:
                    if got >= 1:
                        budget.check_enough_kv_cache_memory(
                            pool, m, got, B, _DTYPE_NAME[db])
                except ValueError:
                    raise wrong(f"{what}: the startup check refuses "
                                f"max_model_len={got:,}", got, args,
                                STARTUP_MISTAKES, fn, probes) from None
                try:
                    budget.check_enough_kv_cache_memory(
                        pool, m, got + 1, B, _DTYPE_NAME[db])
                except ValueError:
                    continue
                raise wrong(f"{what}: the startup check also admits "
                            f"max_model_len={got + 1:,}: {got:,} is not the "
                            "longest", got, args, STARTUP_MISTAKES, fn,
                            probes)

        c.prop("check_enough_kv_cache_memory admits your length, refuses "
               "one token more", startup_check,
               "how many whole blocks does the pool hold, and which of them "
               "never holds a token?")

        def tiny():
            for blocks in (0.5, 1, 1.9):
                pool = blocks * budget.block_bytes(llama, 16)
                compare((pool, llama, 16, 2), 0,
                        f"a pool of {blocks} blocks of 16")

        c.prop("a pool with room for the null block only admits 0 tokens",
               tiny, "the null block comes first; what is left may be "
               "nothing")

        def randomized():
            for _ in range(cases):
                m = _random_model(rng)
                B = rng.choice([16, 32, 48, 64, 128, 256])  # vLLM's CUDA sizes
                db = rng.choice([1, 2, 4])
                per_block = B * _page(m, db) * m.num_layers
                pool = per_block * rng.uniform(0, 50_000)
                if rng.random() < 0.3:  # a pinned pool: whole blocks
                    pool = per_block * rng.randint(1, 50_000)
                args = (pool, m, B, db)
                want = _oracle_startup(*args)
                assert want == budget.usable_max_model_len(
                    pool, m, B, _DTYPE_NAME[db])  # checker sanity
                compare(args, want, f"{m.num_layers} layers, "
                        f"{m.num_kv_heads} KV heads, head_dim {m.head_dim}, "
                        f"pool {pool:,.0f} B, block {B}, {db} B")

        c.prop(f"{cases} random pools, models, block sizes, dtypes match an "
               "exact oracle", randomized,
               "the message names the pool: work it through by hand")
    return c.report


catalogue(check_startup_max_model_len, STARTUP_MISTAKES,
          [NEGATIVE_LENGTH])
