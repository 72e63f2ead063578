"""Reading a GGUF file: its metadata, its tensor directory, and tensors as float32.

GGUF (llama.cpp's single-file format) is a little-endian header (magic
``GGUF``, version, tensor count, metadata count), typed key/value metadata
(the architecture's shapes, the tokenizer's vocabulary and chat template),
a directory of tensors (name, dims innermost first, element type, offset),
then the tensor data, aligned to ``general.alignment`` bytes (32 by default).

The header is parsed here with ``struct`` (a 49,152-token vocabulary is read
in a fraction of a second); quantized blocks are decoded by the ``gguf``
package's ``gguf.quants.dequantize``, so every type it knows is supported.
Every way a file can be wrong (not GGUF, cut short, an unknown value type, a
tensor past the end) raises one ``ValueError`` naming the file, before any
model is built. The file is untrusted input: a count or a size read from it is
checked against the bytes that remain before anything is allocated from it,
and what llama.cpp's reader (``ggml/src/gguf.cpp``) refuses is refused here
too: nested arrays, a repeated key or tensor name, more than 4 dimensions, an
empty or overflowing shape, an alignment that is not a power of two, a tensor
offset that is not aligned. Keys and tensor names must be UTF-8, as the format
says and as the ``gguf`` package's ``GGUFReader`` requires: one that is not is
refused with its offset (replacement characters could make two names one).
String values are decoded with replacement characters.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from ..common import cdiv

__all__ = ["GGUFFile", "GGUFTensorInfo", "read_gguf"]

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS
_ELEMENTS_LIMIT = 1 << 62  # a tensor's element count must fit int64 with room (gguf.cpp checks the same)


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One directory entry: ``shape`` is numpy's order (outermost first), ``nbytes`` its data size."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int  # from the start of the file
    nbytes: int

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"type {self.type_id}"


class _Cursor:
    """Sequential little-endian reads over the file's bytes; running off the end is a truncation."""

    def __init__(self, data: np.ndarray, path: Path):
        self.data, self.pos, self.path = memoryview(data), 0, path  # a memoryview slices without copying

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise ValueError(f"{self.path} is truncated: the GGUF header ends at byte {len(self.data)}")
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += size
        return value

    def string(self, name: str | None = None) -> str:
        """A length-prefixed string. ``name`` (what it is) makes it strict: bytes that are not UTF-8
        are refused, naming it and its offset; without, they become replacement characters."""
        n = self.unpack("<Q")
        if self.pos + n > len(self.data):
            raise ValueError(f"{self.path} is truncated: the GGUF header ends at byte {len(self.data)}")
        start, raw = self.pos, bytes(self.data[self.pos:self.pos + n])
        self.pos += n
        if name is None:
            return raw.decode("utf-8", errors="replace")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.path}: the {name} {raw[:64]!r} at byte {start:,} is not valid UTF-8 "
                             f"({e.reason} at byte {start + e.start:,}); GGUF keys and names are UTF-8") from None

    def value(self, type_id: int, key: str, in_array: bool = False):
        if type_id in _SCALARS:
            return self.unpack(_SCALARS[type_id])
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY and in_array:  # gguf.cpp refuses them too; unbounded nesting would recurse
            raise ValueError(f"{self.path}: metadata {key!r} is an array of arrays, which GGUF readers refuse")
        if type_id == _ARRAY:
            elem, n = self.unpack("<I"), self.unpack("<Q")
            if elem in _NUMPY:  # numbers in one read
                size = np.dtype(_NUMPY[elem]).itemsize * n
                if self.pos + size > len(self.data):
                    raise ValueError(f"{self.path} is truncated: the GGUF header ends at byte {len(self.data)}")
                arr = np.frombuffer(self.data, dtype=_NUMPY[elem], count=n, offset=self.pos).tolist()
                self.pos += size
                return arr
            # Strings: each takes at least its 8-byte length, so n is bounded by the bytes left
            # before a list of n is built (a header claiming 2**60 strings must not loop 2**60 times).
            if self.pos + 8 * n > len(self.data):
                raise ValueError(f"{self.path} is truncated: metadata {key!r} claims {n:,} values, more than "
                                 f"the {len(self.data) - self.pos:,} bytes left can hold")
            return [self.value(elem, key, in_array=True) for _ in range(n)]
        raise ValueError(f"{self.path}: metadata {key!r} has an unknown GGUF value type {type_id}")


@dataclass
class GGUFFile:
    """A parsed GGUF file: ``metadata`` (key -> value) and ``tensors`` (name -> info); data read on demand."""

    path: Path
    version: int
    metadata: dict
    tensors: dict[str, GGUFTensorInfo]
    _data: np.ndarray  # the whole file, memory-mapped

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 ``[rows, bytes per row]`` (rows: every dim but the innermost)."""
        t = self.tensors[name]
        rows = int(np.prod(t.shape[:-1], dtype=np.int64)) if len(t.shape) > 1 else 1
        return self._data[t.offset:t.offset + t.nbytes].reshape(rows, t.nbytes // rows)

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantized to a float32 array of its shape."""
        from gguf.quants import dequantize

        t = self.tensors[name]
        return np.asarray(dequantize(self.raw(name), t.type_id), dtype=np.float32).reshape(t.shape)


def _quant_sizes(type_id: int, name: str, path: Path) -> tuple[int, int]:
    """(elements per block, bytes per block) of a tensor type the ``gguf`` package can dequantize."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    try:
        qtype = GGMLQuantizationType(type_id)
        block, size = GGML_QUANT_SIZES[qtype]
        dequantize(np.zeros((1, size), dtype=np.uint8), qtype)  # raises where gguf has no decoder
    except (ValueError, KeyError, NotImplementedError):
        kind = GGUFTensorInfo(name, (), type_id, 0, 0).type_name
        raise ValueError(f"{path}: tensor {name!r} has type {kind}, which the gguf package cannot dequantize; "
                         f"supported types include F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K and Q6_K") from None
    return block, size


def read_gguf(path) -> GGUFFile:
    """Parse ``path``'s header and tensor directory (no tensor data is read yet).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a GGUF file, an unsupported version, a truncated file,
            or a tensor whose type the ``gguf`` package cannot dequantize.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    data = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    if bytes(data[:4]) != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file: it starts with {bytes(data[:4])!r}, not b'GGUF'")
    cur = _Cursor(data, path)
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    num_tensors, num_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata = {}
    for _ in range(num_kv):  # each pass reads bytes or raises: the loop ends with the file
        key = cur.string("metadata key")
        if key in metadata:
            raise ValueError(f"{path}: metadata key {key!r} appears twice")
        metadata[key] = cur.value(cur.unpack("<I"), key)
    infos, names = [], set()
    for _ in range(num_tensors):
        name = cur.string("tensor name")
        if name in names:
            raise ValueError(f"{path}: tensor {name!r} appears twice in the tensor directory")
        names.add(name)
        n_dims = cur.unpack("<I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"{path}: tensor {name!r} has {n_dims} dimensions; GGUF allows 1 to {_MAX_DIMS}")
        dims = [cur.unpack("<Q") for _ in range(n_dims)]
        infos.append((name, tuple(reversed(dims)), cur.unpack("<I"), cur.unpack("<Q")))
    align = metadata.get("general.alignment", 32)
    if type(align) is not int or align < 1 or align & (align - 1) or align >= 1 << 32:
        raise ValueError(f"{path}: general.alignment must be a power of two (a uint32), got {align!r}")
    start = cdiv(cur.pos, align) * align
    tensors = {}
    for name, shape, type_id, offset in infos:
        block, size = _quant_sizes(type_id, name, path)
        count = math.prod(shape)  # Python ints: an overflowing shape cannot wrap around to a small size
        if not all(shape) or count >= _ELEMENTS_LIMIT:
            raise ValueError(f"{path}: tensor {name!r} has shape {shape}: a dimension is 0 or the size overflows")
        if shape[-1] % block:
            raise ValueError(f"{path}: tensor {name!r} rows of {shape[-1]} are not whole blocks of {block}")
        if offset % align:
            raise ValueError(f"{path}: tensor {name!r} has offset {offset}, not a multiple of the alignment {align}")
        info = GGUFTensorInfo(name, shape, type_id, start + offset, count // block * size)
        if info.offset + info.nbytes > len(data):
            raise ValueError(f"{path} is truncated: tensor {name!r} ends at byte {info.offset + info.nbytes:,}, "
                             f"the file has {len(data):,} bytes")
        tensors[name] = info
    return GGUFFile(path, version, metadata, tensors, data)
