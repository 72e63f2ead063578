"""``EngineArgs``: the engine's knobs, named as ``vllm serve`` names them.

Every field is validated when the object is built, so a typo fails at once
with the field and the value in the message, not deep inside a step. Fields
that need the model to check (``max_model_len`` against the model's context,
the pool against one ``max_model_len`` sequence) are checked by ``LLMEngine``.

``to_cli()`` prints the equivalent ``vllm serve`` command line, and
``cli_table()`` maps each field to its flag, so a chapter can put our
configuration next to a real server's.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass

from .._device import on_gpu
from ..common import check_bool, check_int, check_real

__all__ = ["EngineArgs", "KERNEL_BACKENDS", "KV_CACHE_DTYPES", "SCHEDULING_POLICIES", "CLI_FLAGS", "VLLM_GPU_CLASSES",
           "VLLM_SERVE_DEFAULTS", "vllm_default_limits"]

GiB = 2**30

#: ``"auto"``: compiled Triton kernels on a GPU, the PyTorch references elsewhere.
KERNEL_BACKENDS = ("auto", "triton", "torch")

#: field -> ``vllm serve`` flag (``None``: no flag; the note says what vLLM does instead).
CLI_FLAGS: dict[str, str | None] = {
    "block_size": "--block-size",
    "num_gpu_blocks_override": "--num-gpu-blocks-override",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "max_model_len": "--max-model-len",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "enable_prefix_caching": "--enable-prefix-caching",
    "enable_chunked_prefill": "--enable-chunked-prefill",
    "scheduler_reserve_full_isl": "--scheduler-reserve-full-isl",
    "async_scheduling": "--async-scheduling",
    "watermark": "--watermark",
    "kv_cache_memory_bytes": "--kv-cache-memory-bytes",
    "prefix_match_unit": "--prefix-match-unit",
    "kernel_backend": None,
    "seed": "--seed",
    "log_stats_interval": None,
    "tensor_parallel_size": "--tensor-parallel-size",
    "kv_cache_dtype": "--kv-cache-dtype",
    "long_prefill_token_threshold": "--long-prefill-token-threshold",
    "long_prefill_token_threshold_adaptive": "--long-prefill-token-threshold-adaptive",
    "scheduling_policy": "--scheduling-policy",
}

#: ``--scheduling-policy`` values (vLLM 0.33.0's ``SchedulerPolicy``).
SCHEDULING_POLICIES = ("fcfs", "priority")

#: ``--kv-cache-dtype`` values this library sizes (vLLM 0.33.0's ``CacheDType``
#: has more: quantized and MLA formats).
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")

#: What ``vllm serve`` 0.33.0 does for each field when no flag is given
#: (``EngineArgs`` in ``engine/arg_utils.py``, resolved by the configs in
#: ``config/``): ``to_cli(only_changed=True)`` leaves out a field equal to it.
#: ``max_num_seqs`` and ``max_num_batched_tokens`` depend on the GPU class
#: (``vllm_default_limits``); ``block_size`` None resolves to 16 on CUDA,
#: the two ``enable_*`` None to True, ``async_scheduling`` None to True for a
#: generative model on the default executor (``VllmConfig.__post_init__``).
VLLM_SERVE_DEFAULTS: dict[str, object] = {
    "block_size": 16,
    "num_gpu_blocks_override": None,
    "gpu_memory_utilization": 0.92,
    "max_model_len": None,
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
    "scheduler_reserve_full_isl": True,
    "async_scheduling": True,
    "watermark": 0.0,
    "kv_cache_memory_bytes": None,
    "prefix_match_unit": None,
    "seed": 0,
    "tensor_parallel_size": 1,
    "kv_cache_dtype": "auto",
    "long_prefill_token_threshold": 0,
    "long_prefill_token_threshold_adaptive": False,
    "scheduling_policy": "fcfs",
}

_NOTES = {
    "kernel_backend": "ours: vLLM picks an attention backend itself (--attention-backend)",
    "log_stats_interval": "ours, in steps: vLLM logs every VLLM_LOG_STATS_INTERVAL seconds",
    "kv_cache_memory_bytes": "None: profile on a GPU, 1 GiB on a CPU",
    "tensor_parallel_size": "the pool is per rank: this engine runs one (1)",
    "kv_cache_dtype": "auto: the model's dtype; others size the pool, this engine stores auto",
}


#: GPU classes vLLM 0.33.0 picks its scheduler defaults by
#: (``EngineArgs.get_batch_defaults``,
#: ``engine/arg_utils.py:2940-3006``): by total device memory,
#: with the A100 (and the GB10) kept in the small class.
VLLM_GPU_CLASSES = ("other", "H100/H200", ">=160 GiB")

# (entry point, GPU class) -> (max_num_seqs, max_num_batched_tokens)
_VLLM_LIMITS = {
    ("LLM", "other"): (256, 8192), ("serve", "other"): (256, 2048),
    ("LLM", "H100/H200"): (1024, 16384), ("serve", "H100/H200"): (1024, 8192),
    ("LLM", ">=160 GiB"): (1024, 16384), ("serve", ">=160 GiB"): (1024, 16384),
}


def vllm_default_limits(entry: str, gpu_class: str = "other") -> tuple[int, int]:
    """vLLM 0.33.0's default ``(max_num_seqs, max_num_batched_tokens)``.

    Args:
        entry: ``"LLM"`` (the offline class) or ``"serve"`` (``vllm serve``,
            the OpenAI-compatible server).
        gpu_class: one of ``VLLM_GPU_CLASSES``: ``"other"`` (below 70 GiB,
            or an A100), ``"H100/H200"`` (70 GiB or more), ``">=160 GiB"``
            (B200/B300).

    ``SchedulerConfig`` on its own says 128 and 2,048; the engine arguments
    replace both with these before the config is built.
    """
    if entry not in ("LLM", "serve"):
        raise ValueError(f"entry must be 'LLM' or 'serve', got {entry!r}")
    if gpu_class not in VLLM_GPU_CLASSES:
        raise ValueError(f"gpu_class must be one of {VLLM_GPU_CLASSES}, got {gpu_class!r}")
    return _VLLM_LIMITS[(entry, gpu_class)]





def single_group_match_unit_error(prefix_match_unit: int, block_size: int) -> str:
    """vLLM 0.33.0's startup error for a match unit other than the block size on a one-group model."""
    return (f"Invalid prefix_match_unit={prefix_match_unit}; with a single KV cache group, prefix-cache "
            f"hits land on the block size ({block_size}). Unset it or set it to {block_size}.")


@dataclass(frozen=True)
class EngineArgs:
    """The engine's configuration, with ``vllm serve``'s names and vLLM's defaults where it has them.

    ``max_num_seqs`` 256 and ``max_num_batched_tokens`` 8,192 are vLLM
    0.33.0's defaults for its offline ``LLM`` class on a GPU below the
    H100/H200 class; ``vllm serve`` uses other numbers (see
    ``vllm_default_limits``).

    Attributes:
        block_size: tokens per KV block.
        num_gpu_blocks_override: pool size in blocks, the null block included
            (as in vLLM: 2048 means 2047 usable blocks). None: size from memory.
        gpu_memory_utilization: fraction of the GPU's total memory the engine
            may use (weights, activations and KV together), as in vLLM V1.
        max_model_len: longest sequence (prompt + output); None: the model's
            ``max_position_embeddings``.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step.
        enable_prefix_caching: reuse cached blocks of identical prefixes.
        enable_chunked_prefill: split long prompts across steps; off, a prompt
            that does not fit the step's remaining budget waits.
        scheduler_reserve_full_isl: admit a waiting request only if its whole
            prompt fits the free blocks, not only the chunk this step
            computes (vLLM 0.33.0's default, True; ``SchedulerConfig``).
        async_scheduling: schedule step N+1 before step N's tokens are
            applied, counting each running decode's not-yet-sampled token as
            an output placeholder (``AsyncScheduler``). vLLM 0.33.0's field
            is None, which it resolves to True for a generative model on its
            default executor, as here; False: the synchronous ``Scheduler``.
        watermark: fraction of the pool an admission must leave free.
        kv_cache_memory_bytes: KV pool bytes; None: profile the GPU, or
            1 GiB on a CPU.
        prefix_match_unit: prefix-match granularity in tokens, a divisor of
            ``block_size`` (None: ``block_size``). Finer units make hits end
            inside a block, which the engine serves by copy-on-write. A
            teaching setting here: vLLM 0.33.0 accepts a unit other than the
            block size only for models with several KV-cache groups (hybrids),
            and refuses it for a single-group model such as Llama
            (``prefix_match_unit``, ``v1/core/kv_cache_utils.py:840-858``); so a finer unit
            warns, and ``to_cli`` refuses to print it.
        kernel_backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        seed: seeds torch before the engine runs anything.
        log_stats_interval: print a vLLM-like stats line every this many steps
            (0: never).
        tensor_parallel_size: GPUs the model is split across. Each rank
            holds 1/tp of the weights and of the KV heads and sizes its own
            pool (``pagedkv.budget.plan``): every block count vLLM logs is
            one rank's. For ``to_cli`` and sizing: ``LLMEngine`` runs one
            rank and refuses more.
        kv_cache_dtype: the KV cache's element type (``KV_CACHE_DTYPES``);
            ``"auto"`` is the model's. fp8 halves a block's bytes, so the
            same pool holds twice the blocks (``pagedkv.budget``).
            ``LLMEngine`` stores KV in the model's dtype and refuses another.
        long_prefill_token_threshold: most tokens one request computes in a
            step, so that a long prompt's chunks leave budget to the requests
            behind it (0, vLLM's default: no cap). Not applied while a single
            request is running or waiting. At most ``max_model_len``.
        long_prefill_token_threshold_adaptive: raise that cap to a fair share,
            ``max_num_batched_tokens // (running + waiting)``, when larger
            (vLLM's default False).
        scheduling_policy: ``"fcfs"`` (vLLM's default) or ``"priority"``:
            requests wait in ``(priority, arrival)`` order, a smaller priority
            first (``LLMEngine.add_request(..., priority=)``), and the
            running request of the largest is preempted first.

    vLLM 0.33.0 has no ``max_num_partial_prefills`` or
    ``max_long_partial_prefills``: up to 0.26.0 its ``SchedulerConfig``
    declared both (the V1 scheduler never read them; a value above 1 only set
    ``long_prefill_token_threshold`` to 4 % of ``max_model_len`` when it was
    0), and 0.27.0 removed them, flags included.
    """

    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.92
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduler_reserve_full_isl: bool = True
    async_scheduling: bool = True
    watermark: float = 0.0  # vLLM 0.33.0: SchedulerConfig.watermark defaults to 0.0 (off)
    kv_cache_memory_bytes: int | None = None
    prefix_match_unit: int | None = None
    kernel_backend: str = "auto"
    seed: int = 0
    log_stats_interval: int = 0
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        check_int(self.block_size, "EngineArgs.block_size", 1)
        if self.num_gpu_blocks_override is not None:
            check_int(self.num_gpu_blocks_override, "EngineArgs.num_gpu_blocks_override", 2)
        check_real(self.gpu_memory_utilization, "EngineArgs.gpu_memory_utilization", minimum=0, maximum=1,
                   open_min=True)
        if self.max_model_len is not None:
            check_int(self.max_model_len, "EngineArgs.max_model_len", 2)
        check_int(self.max_num_seqs, "EngineArgs.max_num_seqs", 1)
        check_int(self.max_num_batched_tokens, "EngineArgs.max_num_batched_tokens", 1)
        check_bool(self.enable_prefix_caching, "EngineArgs.enable_prefix_caching")
        check_bool(self.enable_chunked_prefill, "EngineArgs.enable_chunked_prefill")
        check_bool(self.scheduler_reserve_full_isl, "EngineArgs.scheduler_reserve_full_isl")
        check_bool(self.async_scheduling, "EngineArgs.async_scheduling")
        check_real(self.watermark, "EngineArgs.watermark", minimum=0, maximum=1, open_max=True)
        if self.kv_cache_memory_bytes is not None:
            check_int(self.kv_cache_memory_bytes, "EngineArgs.kv_cache_memory_bytes", 1)
        if self.prefix_match_unit is not None:
            check_int(self.prefix_match_unit, "EngineArgs.prefix_match_unit", 1)
        if self.prefix_match_unit is not None and self.block_size % self.prefix_match_unit:
            raise ValueError(f"EngineArgs.prefix_match_unit={self.prefix_match_unit} must divide "
                             f"block_size={self.block_size}")
        if self.prefix_match_unit not in (None, self.block_size):
            warnings.warn(f"{single_group_match_unit_error(self.prefix_match_unit, self.block_size)} "
                          "(vLLM 0.33.0 refuses this for a model with one KV-cache group; "
                          "this library allows it for teaching)", stacklevel=3)
        if not isinstance(self.kernel_backend, str):
            raise TypeError(f"EngineArgs.kernel_backend must be a str, got "
                            f"{type(self.kernel_backend).__name__} {self.kernel_backend!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"EngineArgs.kernel_backend must be one of {', '.join(KERNEL_BACKENDS)}, "
                             f"got {self.kernel_backend!r}")
        check_int(self.seed, "EngineArgs.seed", 0)
        check_int(self.log_stats_interval, "EngineArgs.log_stats_interval", 0)
        check_int(self.tensor_parallel_size, "EngineArgs.tensor_parallel_size", 1)
        if not isinstance(self.kv_cache_dtype, str):
            raise TypeError(f"EngineArgs.kv_cache_dtype must be a str, got "
                            f"{type(self.kv_cache_dtype).__name__} {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"EngineArgs.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        check_int(self.long_prefill_token_threshold, "EngineArgs.long_prefill_token_threshold", 0)
        check_bool(self.long_prefill_token_threshold_adaptive, "EngineArgs.long_prefill_token_threshold_adaptive")
        if not isinstance(self.scheduling_policy, str):
            raise TypeError(f"EngineArgs.scheduling_policy must be a str, got "
                            f"{type(self.scheduling_policy).__name__} {self.scheduling_policy!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"EngineArgs.scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        # vLLM's scheduler-config checks (SchedulerConfig.verify_max_model_len).
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs})")
        if self.max_model_len is not None:
            self.check_max_model_len(self.max_model_len)

    def check_max_model_len(self, max_model_len: int) -> None:
        """Without chunked prefill, one step must hold a whole max-length prompt (vLLM's rule)."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({max_model_len}) with chunked prefill disabled: longer prompts could never run. "
                "Increase max_num_batched_tokens, decrease max_model_len, or enable chunked prefill.")
        if self.long_prefill_token_threshold > max_model_len:
            raise ValueError(f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) cannot be "
                             f"greater than the max_model_len ({max_model_len}).")

    # ------------------------------------------------------------------ derived
    @property
    def hash_block_size(self) -> int:
        """The prefix-match unit the ``KVCacheManager`` hashes by."""
        return self.block_size if self.prefix_match_unit is None else self.prefix_match_unit

    def resolved_kernel_backend(self) -> str:
        """``"triton"`` or ``"torch"``: what ``"auto"`` means on this machine."""
        if self.kernel_backend == "auto":
            return "triton" if on_gpu() else "torch"
        return self.kernel_backend

    def replace(self, **changes) -> "EngineArgs":
        """A copy with some fields changed (validated again); the fields set
        by hand are this one's and ``changes``."""
        copy = dataclasses.replace(self, **changes)
        object.__setattr__(copy, "_set_by_hand", self.set_by_hand | frozenset(changes))
        return copy

    @property
    def set_by_hand(self) -> frozenset[str]:
        """The fields given to the constructor (or to :meth:`replace`), not
        left at their defaults: what ``to_cli(only_changed=True)`` may say."""
        return getattr(self, "_set_by_hand", frozenset(f.name for f in dataclasses.fields(self)))

    # ----------------------------------------------------------------- the CLI
    def cli_table(self) -> list[tuple[str, str, str]]:
        """``(field, vllm serve flag, value)`` for every field; flagless fields say why."""
        rows = []
        for f in dataclasses.fields(self):
            flag = CLI_FLAGS[f.name] or "-"
            value = getattr(self, f.name)
            note = _NOTES.get(f.name)
            shown = repr(value) if not isinstance(value, str) else value
            rows.append((f.name, flag, shown + (f"  ({note})" if note and (flag == "-" or value is None) else "")))
        return rows

    def vllm_refusals(self) -> list[str]:
        """Why ``vllm serve`` 0.33.0 would refuse these args for a single-group model on CUDA (empty: none).

        Two rules this library relaxes for teaching: a ``prefix_match_unit``
        other than the block size needs several KV-cache groups, and vLLM's
        CUDA attention backends (FlashAttention, Triton) take block sizes that
        are multiples of 16 (``get_supported_kernel_block_sizes`` in
        ``v1/attention/backends/flash_attn.py``, ``supports_block_size`` in
        ``triton_attn.py``).
        """
        problems = []
        if self.prefix_match_unit not in (None, self.block_size):
            problems.append(single_group_match_unit_error(self.prefix_match_unit, self.block_size))
        if self.block_size % 16:
            problems.append(f"block_size={self.block_size}: vLLM 0.33.0's FlashAttention and Triton "
                            "backends on CUDA take only multiples of 16")
        return problems

    def vllm_defaults(self, gpu_class: str = "other") -> dict[str, object]:
        """What ``vllm serve`` 0.33.0 uses for each flagged field when no flag is given, on ``gpu_class``."""
        seqs, tokens = vllm_default_limits("serve", gpu_class)
        return {**VLLM_SERVE_DEFAULTS, "max_num_seqs": seqs, "max_num_batched_tokens": tokens}

    def to_cli(self, model: str = "MODEL", only_changed: bool = False, gpu_class: str = "other") -> str:
        """The ``vllm serve`` command line for these args (fields left at None are omitted).

        ``only_changed``: say only what one chose, measured against what
        ``vllm serve`` 0.33.0 would use without the flag on a GPU of
        ``gpu_class`` (one of ``VLLM_GPU_CLASSES``; :meth:`vllm_defaults`).
        A field left at its default is vLLM's default, and ``vllm serve``
        picks its own: ``EngineArgs()``'s 256 sequences and 8,192 tokens are
        the offline ``LLM`` class's numbers, and the command leaves them out,
        so that the server uses its class's (2,048 tokens below the H100
        class). A field set by hand (:attr:`set_by_hand`) is left out when it
        equals the server's default, and said otherwise. The tensor-parallel
        size and the KV cache dtype are left out at 1 and ``"auto"`` either
        way. Without ``only_changed`` every field is said, the engine's own
        values included.

        Refuses (``ValueError``, naming the rule) args that vLLM 0.33.0 would
        refuse at startup; see :meth:`vllm_refusals`.
        """
        check_bool(only_changed, "only_changed")
        problems = self.vllm_refusals()
        if problems:
            raise ValueError("vllm serve would refuse these args: " + "; ".join(problems))
        defaults = self.vllm_defaults(gpu_class)
        parts = [f"vllm serve {model}"]
        for f in dataclasses.fields(self):
            flag, value = CLI_FLAGS[f.name], getattr(self, f.name)
            if flag is None or value is None:
                continue
            if only_changed and f.name not in self.set_by_hand:
                continue
            quiet = only_changed or f.name in ("tensor_parallel_size", "kv_cache_dtype")
            if quiet and defaults[f.name] == value and type(defaults[f.name]) is type(value):
                continue
            if isinstance(value, bool):
                parts.append(flag if value else "--no-" + flag[2:])
            else:
                parts.append(f"{flag} {value}")
        return " \\\n  ".join(parts)


def _recording_fields_set_by_hand(init):
    """Wrap the dataclass's ``__init__`` so that an ``EngineArgs`` knows which
    fields were given (:attr:`EngineArgs.set_by_hand`)."""
    names = [f.name for f in dataclasses.fields(EngineArgs)]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        given = frozenset(names[:len(args)]) | frozenset(kwargs)
        object.__setattr__(self, "_set_by_hand", given)
    return __init__


EngineArgs.__init__ = _recording_fields_set_by_hand(EngineArgs.__init__)
