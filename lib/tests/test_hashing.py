"""Chained block hashes: deterministic, chained, full blocks only, stable across processes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from pagedkv.hashing import NONE_HASH, hash_block_tokens, hash_request_tokens, short_hash


def test_none_hash_is_32_bytes_and_the_default_parent():
    assert isinstance(NONE_HASH, bytes) and len(NONE_HASH) == 32
    assert hash_block_tokens(None, [1, 2]) == hash_block_tokens(NONE_HASH, [1, 2])


def test_hashes_are_stable_across_processes_with_different_hash_seeds():
    # Load hashing.py on its own in the child (it needs nothing else from the
    # package), so the child starts fast: no torch import.
    import pagedkv.hashing as hashing_module

    code = (
        "import importlib.util, sys;"
        f"spec = importlib.util.spec_from_file_location('h', {hashing_module.__file__!r});"
        "h = importlib.util.module_from_spec(spec); spec.loader.exec_module(h);"
        "hs = h.hash_request_tokens(4, list(range(10)), extra_keys=('lora-a', 7, b'x'));"
        "print(h.NONE_HASH.hex(), *[x.hex() for x in hs])"
    )
    outputs = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        outputs.add(out.stdout.strip())
    here = hash_request_tokens(4, list(range(10)), extra_keys=("lora-a", 7, b"x"))
    assert outputs == {" ".join([NONE_HASH.hex(), *[h.hex() for h in here]])}


def test_request_hashes_chain_block_hashes_over_full_blocks_only():
    tokens = [5, 6, 7, 8, 9, 10, 11]
    hashes = hash_request_tokens(3, tokens)
    assert len(hashes) == 2  # 7 tokens -> two full blocks of 3, a partial one unhashed
    first = hash_block_tokens(None, [5, 6, 7])
    assert hashes == [first, hash_block_tokens(first, [8, 9, 10])]
    assert hash_request_tokens(3, tokens[:2]) == []


def test_a_block_hash_names_its_whole_prefix():
    a = hash_request_tokens(2, [1, 2, 3, 4, 5, 6])
    b = hash_request_tokens(2, [1, 2, 3, 4, 9, 9])
    c = hash_request_tokens(2, [0, 2, 3, 4, 5, 6])
    assert a[:2] == b[:2] and a[2] != b[2]  # diverge only where the tokens do
    assert all(x != y for x, y in zip(a, c))  # a change in block 0 changes every later hash
    # Same tokens in block 1, different parents: different hashes.
    assert a[1] != hash_block_tokens(None, [3, 4])


def test_extra_keys_separate_otherwise_equal_blocks_and_are_typed():
    base = hash_block_tokens(None, [1, 2])
    variants = [
        hash_block_tokens(None, [1, 2], extra_keys=(1,)),
        hash_block_tokens(None, [1, 2], extra_keys=("1",)),
        hash_block_tokens(None, [1, 2], extra_keys=(b"1",)),
        hash_block_tokens(None, [1, 2], extra_keys=(True,)),
        hash_block_tokens(None, [1, 2], extra_keys=("ab", "c")),
        hash_block_tokens(None, [1, 2], extra_keys=("a", "bc")),
    ]
    assert len({base, *variants}) == 7
    assert hash_request_tokens(2, [1, 2, 3, 4], ("x",)) != hash_request_tokens(2, [1, 2, 3, 4], ("y",))


def test_token_boundaries_are_unambiguous():
    # [1, 2] + [3] must not collide with [1] + [2, 3] and the like.
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2, 0])
    assert hash_block_tokens(None, []) != hash_block_tokens(None, [0])


def test_numpy_integers_hash_like_python_ints():
    tokens = np.arange(8, dtype=np.int64)
    assert hash_request_tokens(4, tokens) == hash_request_tokens(4, list(range(8)))


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: hash_request_tokens(0, [1, 2]), ValueError, "block_size"),
        (lambda: hash_request_tokens(2.0, [1, 2]), TypeError, "2.0"),
        (lambda: hash_request_tokens(2, [1, "2"]), TypeError, "token_ids[1]"),
        (lambda: hash_request_tokens(2, [1, 2**70]), ValueError, "64 bits"),
        (lambda: hash_block_tokens(None, [1.5]), TypeError, "1.5"),
        (lambda: hash_block_tokens(b"short", [1]), TypeError, "parent_block_hash"),
        (lambda: hash_block_tokens(None, [1], extra_keys=(object,)), TypeError, "extra key"),
        (lambda: hash_block_tokens(None, [1], extra_keys=({"a": 1},)), TypeError, "dict"),
    ],
)
def test_bad_input_is_named(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value)


def test_short_hash_for_display():
    h = hash_block_tokens(None, [1])
    assert short_hash(h) == h.hex()[:6]
    assert short_hash(None) == "-"
    assert short_hash(255, n=4) == "0000"
    assert len(short_hash(h, n=10)) == 10
