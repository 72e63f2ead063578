"""The fuzz corpus replayed (tools/fuzz): every committed input keeps the contract.

Each target's inputs run in a subprocess (``python -m tools.fuzz replay``),
because the contract's 2 GiB address-space cap must not bind the rest of the
test session. The 1 s limit is CPU time, with a slack of 3 here: a 2-core CI
machine that runs other tests at once stretches even CPU time (caches,
frequency); the replay prints each target's slowest inputs, so a slow one
shows in the output before it breaks the fuzzer's strict limit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tools" / "fuzz" / "corpus"
TARGETS = ("gguf", "pretrained", "tokenizer", "sampling")


@pytest.mark.parametrize("target", TARGETS)
def test_the_corpus_keeps_the_contract(target):
    if target == "sampling":  # its inputs are decoded by atheris' FuzzedDataProvider
        pytest.importorskip("atheris", reason="atheris is not installed (pip install -r requirements.txt)")
    seeds = list((CORPUS / target).glob("seed-*"))
    assert len(seeds) >= 3, f"corpus/{target} lost its seeds (python -m tools.fuzz seeds)"
    proc = subprocess.run([sys.executable, "-m", "tools.fuzz", "replay", target, "--slack", "3", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])[target]
    print(f"{target}: {report['inputs']} inputs; slowest {', '.join(report['slowest'])}")
    assert report["inputs"] == len(list((CORPUS / target).iterdir()))
    assert report["violations"] == [], "\n".join(report["violations"])
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_every_fixed_violation_is_kept_and_the_corpus_stays_small():
    crashes = list(CORPUS.glob("*/crash-*"))
    assert len(crashes) >= 10  # the inputs the fuzzer found, with their fixes in the library
    total = sum(f.stat().st_size for f in CORPUS.glob("*/*"))
    assert total < 600_000, f"the committed corpus is {total:,} bytes; keep it to a few hundred KB"


def _hostile():
    from tools.fuzz.seeds import hostile

    return hostile()


@pytest.mark.parametrize("name", sorted(_hostile()))
def test_every_hostile_header_is_refused_at_every_stage_it_reaches(name, tmp_path):
    """Refused, not merely survived: each hand-written header breaks one rule of the reader."""
    from pagedkv.model import load_gguf, read_gguf
    from pagedkv.model.tokenizer import tokenizer_from_gguf_metadata

    path = tmp_path / name
    path.write_bytes(_hostile()[name])
    try:
        file = read_gguf(path)
    except ValueError as e:
        assert name in str(e)
        return
    with pytest.raises(ValueError, match=name):
        load_gguf(file, device="cpu")
    with pytest.raises(ValueError, match=name):
        tokenizer_from_gguf_metadata(file.metadata, path)
