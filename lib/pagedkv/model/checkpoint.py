"""Hugging Face checkpoint directories: ``config.json`` plus safetensors, one file or sharded."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .config import ModelConfig
from .decoder import Model

__all__ = ["load_pretrained", "load_tokenizer"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _read_json(file: Path) -> dict:
    """A JSON object from ``file``; ValueError naming it for anything else (bad UTF-8, bad JSON, too deep)."""
    try:
        value = json.loads(file.read_bytes())
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{file} is not valid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(value).__name__}")
    return value


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) and Path(f).name == f
                                                       for f in weight_map.values()):
            raise ValueError(f"{index}: weight_map must map tensor names to file names in {path}")
        files = [path / f for f in sorted(set(weight_map.values()))]
    elif (path / "model.safetensors").exists():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no model.safetensors, model.safetensors.index.json or *.safetensors in {path}")
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"shard {f.name} listed in model.safetensors.index.json is missing from {path}")
    return files


def _open_safetensors(file: Path):
    """``safe_open`` with a ValueError naming the file when it is not a whole safetensors file."""
    from safetensors import SafetensorError, safe_open  # imported here: only loading needs it

    try:
        return safe_open(str(file), framework="pt")
    except SafetensorError as e:
        raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): {e}") from None


_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def _check_header_entry(st, name: str, file: Path) -> int:
    """The element count of tensor ``name`` from the header alone (no data read); ValueError unless a float."""
    from safetensors import SafetensorError

    try:
        view = st.get_slice(name)
        dtype, shape = view.get_dtype(), view.get_shape()
    except SafetensorError as e:
        raise ValueError(f"{file}: tensor {name!r} cannot be read (truncated or corrupt?): {e}") from None
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{file}: tensor {name!r} has dtype {dtype}; weights must be one of {', '.join(_FLOAT_DTYPES)}")
    return math.prod(shape)


def _read_tensor(st, name: str, file: Path) -> torch.Tensor:
    from safetensors import SafetensorError

    try:
        return st.get_tensor(name)
    except SafetensorError as e:
        raise ValueError(f"{file}: tensor {name!r} cannot be read (truncated or corrupt?): {e}") from None


def load_pretrained(path, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> Model:
    """A ``Model`` with the weights of a local Hugging Face checkpoint directory.

    Reads ``config.json`` and the safetensors file(s), one or sharded; nothing
    is downloaded. ``dtype`` defaults to the checkpoint's. The LM head is tied
    to the embeddings when the config says so or the checkpoint has none.

    The directory is untrusted input: config.json and the safetensors headers
    are checked before the model is allocated (its parameters must fit the
    tensors the files hold).

    Raises:
        FileNotFoundError: no config.json, no safetensors file, or a listed shard missing.
        ValueError: anything wrong inside the files (not JSON, an unsupported
            or inconsistent config, a corrupt safetensors file, tensors that do
            not fit the config); each message names the file or directory.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    hf = _read_json(path / "config.json")
    generation = path / "generation_config.json"
    if generation.is_file():  # what generate() stops on, where a model sets it
        hf = dict(hf, eos_token_id=_read_json(generation).get("eos_token_id", hf.get("eos_token_id")))
    try:
        config = ModelConfig.from_hf_config(hf)
    except (TypeError, ValueError) as e:  # an unsupported or inconsistent config: say which file
        raise ValueError(f"{path / 'config.json'}: {e}") from None
    if dtype is None:
        name = hf.get("dtype") or hf.get("torch_dtype")
        dtype = _DTYPES.get(name, torch.float32) if isinstance(name, str) else torch.float32

    files = _safetensors_files(path)
    names, held = {}, 0
    for f in files:
        with _open_safetensors(f) as st:
            for n in st.keys():
                names[n] = f
                held += _check_header_entry(st, n, f)
    if "lm_head.weight" not in names:
        config.tie_word_embeddings = True
    if config.num_parameters > held:  # before Model() allocates anything sized from config.json
        raise ValueError(f"{path}: config.json describes {config.num_parameters:,} parameters, the safetensors "
                         f"files hold {held:,}")
    model = Model(config, seed=None, dtype=dtype, device=device)

    ours = dict(model.named_parameters())  # HF name = "model." + ours, except lm_head
    missing = set(ours)
    unexpected = [n for n in names if n.removeprefix("model.") not in ours
                  and n != "lm_head.weight" and not n.endswith("rotary_emb.inv_freq")]  # old checkpoints kept it
    if unexpected:
        raise ValueError(f"{path}: {len(unexpected)} checkpoint tensors have no place in the model, "
                         f"e.g. {unexpected[:3]}")
    with torch.no_grad():
        for f in files:
            with _open_safetensors(f) as st:
                for name in st.keys():
                    key = name.removeprefix("model.")
                    if key not in ours:  # lm_head.weight of a tied model (the embedding is the head)
                        continue
                    tensor = _read_tensor(st, name, f)
                    if tensor.shape != ours[key].shape:
                        raise ValueError(f"{name} has shape {tuple(tensor.shape)} in {f}, "
                                         f"the config implies {tuple(ours[key].shape)}")
                    ours[key].copy_(tensor)
                    missing.discard(key)
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    return model.eval()


def load_tokenizer(path):
    """The ``tokenizers.Tokenizer`` in ``path/tokenizer.json``, or None when there is none."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))
