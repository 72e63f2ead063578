"""How many library functions one request's path touches on a plain Llama (one KV-cache group).

KV-cache groups (``pagedkv.kv_cache_coordinator``) must not lengthen the path
a reader of chapters 3-6 follows: adding one request to ``LLMEngine`` and
stepping it to its end calls a set of distinct ``pagedkv`` functions, counted
here with ``sys.setprofile``. ``PATH_BUDGET`` is that count before the
groups came in (run this file as a script to print the count); the test fails
if the path grows past it.
"""

from __future__ import annotations

import os
import sys

import pagedkv

#: Distinct pagedkv functions on one request's path before per-group KV caches (measured with
#: ``python lib/tests/test_request_path.py`` on the engine of that time).
PATH_BUDGET = 111

_ROOT = os.path.dirname(os.path.abspath(pagedkv.__file__))


def functions_on_request_path() -> set[tuple[str, str]]:
    """``(module file, qualified name)`` of every pagedkv function called while one
    request is added to a plain-Llama engine and stepped until it finishes."""
    from pagedkv.engine import EngineArgs, LLMEngine
    from pagedkv.model import Model, ModelConfig

    model = Model(ModelConfig.preset("tiny"), seed=0)
    engine = LLMEngine(EngineArgs(block_size=4, num_gpu_blocks_override=64, max_model_len=96,
                                         max_num_seqs=8, max_num_batched_tokens=64, kernel_backend="torch"), model)
    prompt = list(range(3, 13))  # 10 tokens: two full blocks and a partial one
    seen: set[tuple[str, str]] = set()

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(_ROOT) and not code.co_name.startswith("<"):
                seen.add((os.path.relpath(code.co_filename, _ROOT), code.co_qualname))

    sys.setprofile(profile)
    try:
        engine.add_request("r", prompt, max_tokens=6)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        sys.setprofile(None)
    return seen


def test_request_path_is_no_longer():
    seen = functions_on_request_path()
    assert len(seen) >= 50, f"the counter saw only {len(seen)} functions: is the profiler hooked?"
    if PATH_BUDGET is not None:
        assert len(seen) <= PATH_BUDGET, (
            f"one request's path touches {len(seen)} pagedkv functions, past the {PATH_BUDGET} it touched "
            "before KV-cache groups")


if __name__ == "__main__":
    names = sorted(functions_on_request_path())
    if "-v" in sys.argv:
        for f, q in names:
            print(f"{f}:{q}")
    print(len(names), "distinct pagedkv functions on one request's path")
