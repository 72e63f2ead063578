"""tools/core_metrics.py: the line counter on known text, the profile on a real request."""

import textwrap

from tools import core_metrics

SOURCE = textwrap.dedent('''\
    """Module docstring,
    two lines."""

    # a comment
    import os  # counted: code before a comment


    def f(a,
          b):
        """One-line docstring."""
        s = """a string that is
        not a docstring"""
        return (a +
                b)
    ''')


def test_code_lines_skip_docstrings_comments_and_blank_lines():
    # import; def (2 lines); s = (2 lines); return (2 lines)
    assert core_metrics.code_lines(SOURCE) == 7


def test_every_area_file_exists():
    for files in core_metrics.AREAS.values():
        for f in files:
            assert (core_metrics.PACKAGE / f).is_file(), f


def test_comprehensions_are_not_functions():
    assert core_metrics.is_function("engine/worker.py:Worker.execute_model")
    assert not core_metrics.is_function("engine/worker.py:Worker.execute_model.<locals>.<listcomp>")
    assert not core_metrics.is_function("block_pool.py:<module>")


def test_one_request_touches_the_engine_the_pool_and_the_attention():
    names = core_metrics.functions_touched("torch")
    assert "engine/llm_engine.py:LLMEngine.generate" in names
    assert "block_pool.py:BlockPool.get_new_blocks" in names
    assert "block_pool.py:BlockPool.free_blocks" in names
    assert any(n.startswith("model/paged_attention.py:") for n in names)
    s = core_metrics.summarize_functions(names)
    assert s["functions"] == sum(s["per_area"].values()) == sum(s["per_file"].values())
