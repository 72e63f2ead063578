"""Hugging Face checkpoint directories: ``config.json`` plus safetensors, one file or sharded."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import ModelConfig
from .decoder import Model

__all__ = ["load_pretrained", "load_tokenizer"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
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
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    hf = json.loads((path / "config.json").read_text())
    try:
        config = ModelConfig.from_hf_config(hf)
    except ValueError as e:  # an unsupported or inconsistent config: say which file
        raise ValueError(f"{path / 'config.json'}: {e}") from None
    generation = path / "generation_config.json"
    if generation.is_file():  # what generate() stops on, where a model sets it
        config.eos_token_id = json.loads(generation.read_text()).get("eos_token_id", config.eos_token_id)
    if dtype is None:
        dtype = _DTYPES.get(hf.get("dtype") or hf.get("torch_dtype"), torch.float32)

    files = _safetensors_files(path)
    names = {}
    for f in files:
        with _open_safetensors(f) as st:
            names.update((n, f) for n in st.keys())
    if "lm_head.weight" not in names:
        config.tie_word_embeddings = True
    model = Model(config, seed=None, dtype=dtype, device=device)

    ours = dict(model.named_parameters())  # HF name = "model." + ours, except lm_head
    missing = set(ours)
    unexpected = [n for n in names if n.removeprefix("model.") not in ours
                  and n != "lm_head.weight" and not n.endswith("rotary_emb.inv_freq")]  # old checkpoints kept it
    if unexpected:
        raise ValueError(f"{len(unexpected)} checkpoint tensors have no place in the model, e.g. {unexpected[:3]}")
    with torch.no_grad():
        for f in files:
            with _open_safetensors(f) as st:
                for name in st.keys():
                    key = name.removeprefix("model.")
                    if key not in ours:  # lm_head.weight of a tied model (the embedding is the head)
                        continue
                    tensor = _read_tensor(st, name, f)
                    if tensor.shape != ours[key].shape:
                        raise ValueError(f"{name} has shape {tuple(tensor.shape)} in {f.name}, "
                                         f"the config implies {tuple(ours[key].shape)}")
                    ours[key].copy_(tensor)
                    missing.discard(key)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    return model.eval()


def load_tokenizer(path):
    """The ``tokenizers.Tokenizer`` in ``path/tokenizer.json``, or None when there is none."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))
