"""Chained block hashes for prefix caching, as vLLM V1 computes them.

A *full* block of ``block_size`` tokens is identified by a hash of three things:
the hash of the block before it (its *parent*), its own token ids, and optional
extra keys (a LoRA adapter name, a cache salt, image hashes...). Chaining the
parent in means a block hash names the whole prefix up to and including that
block, not just its own tokens: two requests share block ``i`` only if they
agree on every token before it. The first block of every chain uses the fixed
parent ``NONE_HASH``. Partial blocks are never hashed: their content is still
growing, so they cannot be shared.

Public API (stable; other modules build on it):

- ``BlockHash``: the hash type of the whole library: the 32 raw bytes of a
  SHA-256 digest, as made here, or an int (the pool takes both).
- ``NONE_HASH``: the parent of every first block. Fixed, not random, so hashes
  (and every output that shows them) are the same in every process and on every
  machine. So is vLLM 0.33.0's under its default algorithm, sha256: it derives
  ``NONE_HASH`` from the fixed seed ``"vllm-none-hash"``, and draws a random
  seed only for the non-cryptographic xxhash variants, whose collision
  resistance rests on the seed staying secret; ``PYTHONHASHSEED``, when set,
  overrides both (``resolve_none_hash_seed``,
  ``v1/core/kv_cache_utils.py:117-130``). Our value differs from vLLM's (our
  seed and byte encoding are our own), so the two never share hashes.
- ``hash_block_tokens(parent_block_hash, curr_block_token_ids, extra_keys=None)``
  -> ``BlockHash``.
- ``hash_checked_block_tokens(parent, tokens, extra_keys=None)``: the same,
  without checking its arguments again (a ``Request`` checks its tokens once,
  on the way in).
- ``hash_request_tokens(block_size, token_ids, extra_keys=None)`` -> one
  ``BlockHash`` per full block, chained from ``NONE_HASH``.
- ``short_hash(block_hash, n=6)``: a few hex digits for display.

Hashes never use Python's ``hash()``, whose value for strings and bytes
changes from one process to the next. Everything goes through SHA-256 over a
canonical byte encoding, so a hash computed today on a laptop equals the hash
computed tomorrow on a GPU server.
"""

from __future__ import annotations

import hashlib
import numbers
import struct
from collections.abc import Sequence
from typing import Union

__all__ = ["BlockHash", "NONE_HASH", "check_token_ids", "hash_block_tokens", "hash_checked_block_tokens",
           "hash_request_tokens", "short_hash"]

#: What a block hash may be: the 32 SHA-256 bytes made here, or an int (the pool takes both).
BlockHash = Union[bytes, int]

#: Parent hash of the first block of every request. A constant, for reproducibility.
NONE_HASH: bytes = hashlib.sha256(b"pagedkv/NONE_HASH/v1").digest()

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def check_token_ids(token_ids, name: str, vocab_size: int | None = None) -> list[int]:
    """``token_ids`` as a list of Python ints, or the error naming the first bad one.

    The library's one token validator (requests, hashes, the engine's
    prompts): each id an integer (never a bool) that fits in 64 bits, as the
    hashes pack them, and in ``0..vocab_size - 1`` when a vocabulary is given.
    It lives here, beside the packing, so that this module needs nothing else
    from the package.
    """
    if isinstance(token_ids, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of int token ids, got {type(token_ids).__name__} {token_ids!r}")
    try:
        tokens = list(token_ids)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of int token ids, got {type(token_ids).__name__} "
                        f"{token_ids!r}") from None
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{name}[{i}] = {t!r} is not an integer token id")
        if vocab_size is not None and not 0 <= t < vocab_size:
            raise ValueError(f"{name}[{i}] = {t} is not a token id of the model (0..{vocab_size - 1})")
        if not _INT64_MIN <= t <= _INT64_MAX:
            raise ValueError(f"{name}[{i}] = {t} does not fit in 64 bits (token ids are int64)")
    return [int(t) for t in tokens]



def _encode_key(value: object, out: bytearray) -> None:
    """Append a canonical, type-tagged encoding of one extra key to ``out``.

    Tags keep ``1``, ``"1"`` and ``b"1"`` apart, and length prefixes keep
    ``("ab", "c")`` apart from ``("a", "bc")``.
    """
    if value is None:
        out += b"N"
    elif isinstance(value, bool):  # before int: bool is an int subclass
        out += b"T" if value else b"F"
    elif isinstance(value, numbers.Integral):
        data = int(value).to_bytes((int(value).bit_length() + 8) // 8, "little", signed=True)
        out += b"i" + struct.pack("<I", len(data)) + data
    elif isinstance(value, str):
        data = value.encode("utf-8")
        out += b"s" + struct.pack("<I", len(data)) + data
    elif isinstance(value, (bytes, bytearray)):
        out += b"b" + struct.pack("<I", len(value)) + bytes(value)
    elif isinstance(value, (tuple, list)):
        out += b"t" + struct.pack("<I", len(value))
        for item in value:
            _encode_key(item, out)
    else:
        raise TypeError(
            f"extra key {value!r} of type {type(value).__name__} has no stable encoding; "
            "use None, bool, int, str, bytes, or tuples of these"
        )


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> BlockHash:
    """Hash one block: its parent's hash, its token ids and optional extra keys.

    ``parent_block_hash=None`` means "first block" and uses ``NONE_HASH``.
    The caller passes exactly one block's tokens; this function does not know
    the block size (``hash_request_tokens`` does).
    """
    if parent_block_hash is not None and (
            not isinstance(parent_block_hash, (bytes, bytearray)) or len(parent_block_hash) != 32):
        raise TypeError(
            f"parent_block_hash must be a 32-byte BlockHash or None, got {parent_block_hash!r}"
        )
    tokens = check_token_ids(curr_block_token_ids, "curr_block_token_ids")
    return hash_checked_block_tokens(parent_block_hash, tokens, extra_keys)


def hash_checked_block_tokens(parent_block_hash: bytes | None, tokens: list[int],
                              extra_keys: tuple | None = None) -> bytes:
    """``hash_block_tokens`` for arguments already checked (a ``Request``'s own tokens)."""
    payload = bytearray(b"pagedkv-block/v1")
    payload += NONE_HASH if parent_block_hash is None else bytes(parent_block_hash)
    payload += struct.pack(f"<I{len(tokens)}q", len(tokens), *tokens)
    if extra_keys is None:  # the usual case: _encode_key's encoding of None
        payload += b"N"
    else:
        _encode_key(extra_keys, payload)
    return hashlib.sha256(payload).digest()


def hash_request_tokens(
    block_size: int,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> list[BlockHash]:
    """One chained hash per *full* block of ``token_ids``; a partial tail block gets none.

    ``extra_keys`` (if given) enter every block's hash, so the same tokens
    under two different adapters never share a block.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
        raise TypeError(f"block_size must be an integer, got {block_size!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    tokens = check_token_ids(token_ids, "token_ids")  # all of them, before hashing any
    hashes: list[BlockHash] = []
    parent: bytes | None = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_checked_block_tokens(parent, tokens[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


def short_hash(block_hash: bytes | int | None, n: int = 6) -> str:
    """The first ``n`` hex digits of a block hash, for tables and pictures ("-" for none)."""
    if block_hash is None:
        return "-"
    if isinstance(block_hash, int):
        return format(block_hash & (2**64 - 1), "016x")[:n]
    return bytes(block_hash).hex()[:n]
