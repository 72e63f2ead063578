"""The fuzz targets: each takes the fuzzer's bytes and raises ``Violation`` when the contract breaks.

* ``gguf``: the bytes are a GGUF file. ``read_gguf``; then ``load_gguf`` (the
  metadata-to-config path and the weights) and a forward pass of what it
  accepted; then the tokenizer of the same file, its encoding and chat template.
* ``pretrained``: ``config.json``, a ``SEPARATOR`` line, then ``model.safetensors``:
  ``load_pretrained`` on that directory and a forward pass of what it accepted.
  An input that starts with a zero byte instead picks values for a valid tiny
  checkpoint's config and safetensors header (``_structured_checkpoint``).
* ``tokenizer``: a GGUF file (it starts with ``GGUF``) whose metadata carries a
  tokenizer and chat template; anything else is a chat template's source,
  rendered with the tiny tokenizer.
* ``sampling``: ``atheris.FuzzedDataProvider`` picks values of any type for
  ``SamplingParams``' fields, prompts and conversations, and calls
  ``LLM.generate`` or ``LLM.chat`` on a tiny model. After every call the
  engine holds no request and passes its invariant check.

Errors about a file must name it (its path); errors about an argument must
name the argument.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .contract import Violation, attempt, no_exception
from . import tiny

__all__ = ["TARGETS", "Target", "SEPARATOR"]

SEPARATOR = b"\n--model.safetensors--\n"
CONVERSATION = [{"role": "system", "content": "BE BRIEF"}, {"role": "user", "content": "HI <|im_end|> 42"},
                {"role": "assistant", "content": "HELLO"}, {"role": "user", "content": "AB"}]

_scratch: Path | None = None


def _scratch_file(name: str, data: bytes) -> Path:
    """``data`` written to ``name`` in this process's scratch directory (one directory, reused)."""
    global _scratch
    if _scratch is None:
        _scratch = Path(tempfile.mkdtemp(prefix="pagedkv-fuzz-"))
    path = _scratch / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _forward(model) -> None:
    from pagedkv.model import dense_logits

    with no_exception("a forward pass of the model the loader accepted"):
        logits = dense_logits(model, [[0, model.config.vocab_size - 1]])[0]
        assert logits.shape == (2, model.config.vocab_size), logits.shape


def _use_tokenizer(tok, *names: str) -> None:
    """Encode, decode and (if it has one) render the chat template of a tokenizer a file produced."""
    with no_exception("encoding and decoding with the tokenizer the file produced"):
        ids = tok.encode("HELLO <|im_end|> 2024 \u00e9\u4e2d").ids
        tok.decode(ids)
        tok.decode(ids, skip_special_tokens=False)
    if tok.chat_template is not None:
        for tokenize in (False, True):
            attempt(lambda: tok.apply_chat_template(CONVERSATION, tokenize=tokenize), *names, "chat template")


# ---------------------------------------------------------------------------- gguf
def fuzz_gguf(data: bytes) -> None:
    from pagedkv.model import load_gguf, read_gguf
    from pagedkv.model.tokenizer import tokenizer_from_gguf_metadata

    path = _scratch_file("model.gguf", data)
    name = str(path)
    file = attempt(lambda: read_gguf(path), name)
    if file is None:
        return
    with no_exception("dequantizing the tensors the reader accepted"):
        for t in file.tensors:  # bounded: every tensor lies inside the (small) file
            file.tensor(t)
    model = attempt(lambda: load_gguf(file, device="cpu"), name)
    if model is not None:
        _forward(model)
    tok = attempt(lambda: tokenizer_from_gguf_metadata(file.metadata, path), name)
    if tok is not None:
        _use_tokenizer(tok, name)


# ---------------------------------------------------------------------- pretrained
_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
                "max_position_embeddings", "tie_word_embeddings", "attention_bias", "eos_token_id",
                "architectures", "model_type", "torch_dtype", "hidden_act", "mlp_bias")
_DTYPES = ("F32", "F16", "BF16", "F64", "I8", "U8", "I64", "BOOL", "F8_E4M3", "XX")
_base_checkpoint: tuple[dict, dict, bytes] | None = None


def _structured_checkpoint(data: bytes) -> bytes:
    """A valid tiny checkpoint with a few config values and safetensors header fields replaced.

    Byte mutations of JSON rarely stay JSON; this half of the target reaches the
    checks behind the parser: config values of any type, and a safetensors
    header whose dtypes, shapes and data offsets disagree with the data.
    """
    import json
    import struct

    import atheris

    global _base_checkpoint
    if _base_checkpoint is None:
        from pagedkv.model import Model
        from safetensors.torch import save

        model = Model(tiny.CONFIG, seed=0, device="cpu")
        blob = save({"model." + n if n != "lm_head.weight" else n: p.detach().contiguous()
                     for n, p in model.named_parameters()})
        n = struct.unpack("<Q", blob[:8])[0]
        config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16, "intermediate_size": 16,
                  "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                  "eos_token_id": tiny.EOS}
        _base_checkpoint = (config, json.loads(blob[8:8 + n]), blob[8 + n:])
    base_config, base_header, payload = _base_checkpoint
    fdp = atheris.FuzzedDataProvider(data[1:])
    config, header = dict(base_config), {k: dict(v) if isinstance(v, dict) else v for k, v in base_header.items()}
    for _ in range(fdp.ConsumeIntInRange(0, 3)):
        key = fdp.PickValueInList(list(_CONFIG_KEYS))
        config[key] = _value(fdp) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(-1, 70)
    names = sorted(k for k in header if k != "__metadata__")
    for _ in range(fdp.ConsumeIntInRange(0, 3)):
        entry = header[fdp.PickValueInList(names)]
        field = fdp.ConsumeIntInRange(0, 3)
        if field == 0:
            entry["dtype"] = fdp.PickValueInList(list(_DTYPES))
        elif field == 1:
            entry["shape"] = [fdp.ConsumeIntInRange(0, 1 << 20) for _ in range(fdp.ConsumeIntInRange(0, 3))]
        elif field == 2:
            entry["data_offsets"] = [fdp.ConsumeIntInRange(0, len(payload) + 64) for _ in range(2)]
        else:
            entry[fdp.PickValueInList(["shape", "dtype", "data_offsets"])] = _value(fdp)
    try:
        text = json.dumps(config).encode()
        head = json.dumps(header).encode()
    except (TypeError, ValueError):  # a value JSON cannot hold (a tensor, bytes): not a file anyone can write
        text, head = b"{}", json.dumps(base_header).encode()
    cut = 16 * fdp.ConsumeIntInRange(1, 4) if fdp.ConsumeIntInRange(0, 7) == 0 else 0  # sometimes cut short
    return text + SEPARATOR + struct.pack("<Q", len(head)) + head + payload[:len(payload) - cut]


def fuzz_pretrained(data: bytes) -> None:
    from pagedkv.model import load_pretrained

    if data.startswith(b"\0"):
        data = _structured_checkpoint(data)
    config, _, weights = data.partition(SEPARATOR)
    _scratch_file("checkpoint/config.json", config)
    directory = _scratch_file("checkpoint/model.safetensors", weights).parent
    model = attempt(lambda: load_pretrained(directory, device="cpu"), str(directory))
    if model is not None:
        _forward(model)


# ----------------------------------------------------------------------- tokenizer
_tiny_tokenizer = None


def fuzz_tokenizer(data: bytes) -> None:
    from pagedkv.model import Tokenizer, read_gguf
    from pagedkv.model.tokenizer import tokenizer_from_gguf_metadata

    global _tiny_tokenizer
    if data.startswith(b"GGUF"):
        path = _scratch_file("tokenizer.gguf", data)
        name = str(path)
        file = attempt(lambda: read_gguf(path), name)
        tok = file and attempt(lambda: tokenizer_from_gguf_metadata(file.metadata, path), name)
        if tok is not None:
            _use_tokenizer(tok, name)
        return
    if _tiny_tokenizer is None:
        _tiny_tokenizer = tokenizer_from_gguf_metadata(tiny.tokenizer_metadata(None), "tiny")
    tok = Tokenizer(_tiny_tokenizer.backend, bos_token_id=62, eos_token_id=tiny.EOS,
                    chat_template=data.decode("utf-8", errors="replace"))
    _use_tokenizer(tok, "chat template")


# ------------------------------------------------------------------------ sampling
_llm = None
# The harness asks for no more work than this many generated tokens per call:
# a valid request for more (n = 10**6) is the caller's choice, not a hang.
_MAX_WORK = 64


def _value(fdp, depth: int = 0):
    """A value of any of the types a caller might pass by mistake, or a plausible one."""
    kind = fdp.ConsumeIntInRange(0, 17 if depth < 2 else 12)
    if kind == 0:
        return fdp.ConsumeIntInRange(-3, 40)
    if kind == 1:
        return fdp.ConsumeInt(9)  # up to +-2**71: past int64
    if kind == 2:
        return fdp.ConsumeRegularFloat()
    if kind == 3:
        return fdp.PickValueInList([0.0, -0.0, 1.0, 0.5, 1e-6, 2.0, float("nan"), float("inf"), -float("inf"), 1e308])
    if kind == 4:
        return fdp.ConsumeBool()
    if kind == 5:
        return None
    if kind == 6:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 12))
    if kind == 7:
        return np.int64(fdp.ConsumeIntInRange(-3, 70))
    if kind == 8:
        with np.errstate(over="ignore"):  # a double past float32's range becomes inf, on purpose
            return np.float32(fdp.ConsumeRegularFloat())
    if kind == 9:
        return b"AB"
    if kind == 10:
        return np.bool_(fdp.ConsumeBool())
    if kind == 11:
        return torch.tensor(fdp.ConsumeIntInRange(-3, 70))
    if kind == 12:
        return 3 + 4j
    if kind == 13:
        return [_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3))]
    if kind == 14:
        return [fdp.ConsumeIntInRange(-2, 70) for _ in range(fdp.ConsumeIntInRange(0, 6))]
    if kind == 15:
        return tuple(_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3)))
    if kind == 16:
        return {fdp.PickValueInList(["role", "content", "prompt", "prompt_token_ids", "x"]): _value(fdp, depth + 1)
                for _ in range(fdp.ConsumeIntInRange(0, 3))}
    return torch.tensor([fdp.ConsumeIntInRange(-3, 70) for _ in range(fdp.ConsumeIntInRange(0, 4))])


def _prompt(fdp):
    kind = fdp.ConsumeIntInRange(0, 4)
    if kind == 0:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 40))
    if kind == 1:
        return [fdp.ConsumeIntInRange(0, 63) for _ in range(fdp.ConsumeIntInRange(0, 40))]
    if kind == 2:
        return {"prompt_token_ids": [fdp.ConsumeIntInRange(0, 63) for _ in range(fdp.ConsumeIntInRange(1, 8))]}
    if kind == 3:
        return {"prompt": fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 20))}
    return _value(fdp)


def _message(fdp):
    if fdp.ConsumeIntInRange(0, 7) == 0:
        return _value(fdp)
    role = fdp.PickValueInList(["user", "assistant", "system", "tool", ""])
    content = fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 20)) if fdp.ConsumeBool() else _value(fdp)
    return {"role": role, "content": content}


def _work(params, prompts) -> int:
    """Generated tokens a valid call could ask for, at most (max_model_len is 32)."""
    per = [params] * len(prompts) if not isinstance(params, list) else params
    return sum((p.max_tokens or 32) * p.n for p in per if p is not None)


def fuzz_sampling(data: bytes) -> None:
    import atheris

    from pagedkv.engine import LLM, SamplingParams
    from pagedkv.model import Model
    from pagedkv.model.tokenizer import tokenizer_from_gguf_metadata

    global _llm
    if _llm is None:
        tok = tokenizer_from_gguf_metadata(tiny.tokenizer_metadata(), "tiny")
        _llm = LLM(Model(tiny.CONFIG, seed=0, device="cpu"), tokenizer=tok, max_model_len=32,
                   num_gpu_blocks_override=16, block_size=4, kernel_backend="torch", seed=0)
    fdp = atheris.FuzzedDataProvider(data)

    def params():
        kwargs = {f.name: _value(fdp) for f in fields(SamplingParams) if fdp.ConsumeIntInRange(0, 3) == 0}
        names = [f"SamplingParams.{k}" for k in kwargs] or ["SamplingParams"]
        return attempt(lambda: SamplingParams(**kwargs), *names)

    shape = fdp.ConsumeIntInRange(0, 4)
    sp = None if shape == 0 else params() if shape < 4 else [params() for _ in range(fdp.ConsumeIntInRange(0, 3))]
    if shape and (sp is None or (isinstance(sp, list) and None in sp)):
        return  # refused, correctly: nothing to call
    if fdp.ConsumeBool():
        prompts = [_prompt(fdp) for _ in range(fdp.ConsumeIntInRange(0, 3))] if fdp.ConsumeBool() else _prompt(fdp)
        count = len(prompts) if isinstance(prompts, list) else 1
        call = lambda: _llm.generate(prompts, sp)  # noqa: E731
    else:
        one = [_message(fdp) for _ in range(fdp.ConsumeIntInRange(0, 4))]
        messages = one if fdp.ConsumeBool() else [one, [_message(fdp) for _ in range(fdp.ConsumeIntInRange(1, 3))]]
        count = len(messages)
        call = lambda: _llm.chat(messages, sp)  # noqa: E731
    if sp is not None and _work(sp, [None] * count) > _MAX_WORK:
        return
    attempt(call, "prompt", "sampling_params", "SamplingParams", "messages", "chat template", "conversation")
    engine = _llm.llm_engine
    with no_exception("the engine after the call"):
        assert not engine.has_unfinished_requests(), "a refused or finished call left requests behind"
        engine.check()


@dataclass(frozen=True)
class Target:
    name: str
    run: Callable[[bytes], None]
    max_len: int  # libFuzzer's -max_len: the largest input it builds
    instrument: tuple[str, ...]  # the packages whose code atheris traces for coverage


TARGETS = {t.name: t for t in (
    Target("gguf", fuzz_gguf, 1 << 16, ("pagedkv.model",)),
    Target("pretrained", fuzz_pretrained, 1 << 15, ("pagedkv.model",)),
    Target("tokenizer", fuzz_tokenizer, 1 << 13, ("pagedkv.model", "jinja2")),
    Target("sampling", fuzz_sampling, 1 << 12, ("pagedkv.engine", "pagedkv.model.tokenizer")),
)}


def run(target: str, data: bytes) -> None:
    """One input through one target (``Violation`` if it breaks the contract)."""
    TARGETS[target].run(data)

