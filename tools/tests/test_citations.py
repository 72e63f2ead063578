"""The citation check, on a tiny fake vLLM wheel: no network, no real wheel."""

import json
import zipfile

import pytest

from tools import citations

BLOCK_POOL = "\n".join([
    '"""Block pool."""',                                   # 1
    "",                                                    # 2
    "class BlockPool:",                                    # 3
    "    def free_blocks(self, blocks):",                  # 4
    "        # Free blocks go to the tail,",               # 5
    "        # in reverse order.",                         # 6
    "        for b in reversed(blocks):",                  # 7
    "            self.queue.append(b)",                    # 8
    *[""] * 11,                                            # 9-19
    "    def touch(self, blocks):",                        # 20
    "        pass",                                        # 21
]) + "\n"
SAMPLING = "class SamplingParams:\n    n: int = 1\n    seed: int | None = None\n"
MESSAGE = ('raise ValueError(\n    f"Invalid prefix_match_unit={unit}; "\n'
           '    "with a single KV cache group, prefix-cache hits land on the "\n'
           '    f"block size ({bs})."\n)\n')


@pytest.fixture
def wheel_path(tmp_path):
    path = tmp_path / "cache" / f"vllm-{citations.VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
    path.parent.mkdir()
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("vllm/v1/core/block_pool.py", BLOCK_POOL)
        z.writestr("vllm/sampling_params.py", SAMPLING)
        z.writestr("vllm/v1/core/kv_cache_utils.py", MESSAGE)
        z.writestr("vllm/v1/attention/ops/triton_unified_attention.py", "MAX_3D_QUERY_LEN = 8\n")
        z.writestr("vllm/v1/attention/ops/ultraquant/triton_unified_attention.py", "MAX_3D_QUERY_LEN = 8\n")
    return path


@pytest.fixture
def wheel(wheel_path):
    return citations.Wheel(wheel_path)


def problems_in(tmp_path, wheel, name, content):
    """Check one file of a book rooted at tmp_path; the problems found."""
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    return citations.check([path], tmp_path, wheel)[0]


def notebook(*cells):
    nb = {"cells": [{"cell_type": kind, "id": f"c{i:03d}", "metadata": {},
                     "source": src.splitlines(keepends=True),
                     **({"execution_count": None, "outputs": []} if kind == "code" else {})}
                    for i, (kind, src) in enumerate(cells)],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    return citations.dump_notebook(nb)


# --- the check ---------------------------------------------------------------

def test_good_citations_in_every_form_pass(tmp_path, wheel):
    page = ("The pool frees in reverse (`free_blocks`, `v1/core/block_pool.py:4-8`), and\n"
            "`BlockPool.touch` (`v1/core/block_pool.py:20`) does nothing; as its comment says\n"
            "(\"Free blocks go to the tail, ... reverse order\", `v1/core/block_pool.py:5-6`).\n")
    assert problems_in(tmp_path, wheel, "book/a.md", page) == []


def test_a_quoted_message_may_span_literals_and_cut_with_an_ellipsis(tmp_path, wheel):
    page = ('vLLM raises "Invalid prefix_match_unit=…; with a single KV cache group,\n'
            'prefix-cache hits land on the block size" (`v1/core/kv_cache_utils.py:1-5`).\n')
    assert problems_in(tmp_path, wheel, "a.md", page) == []
    [problem] = problems_in(tmp_path, wheel, "b.md", page.replace("land on", "fall on"))
    assert "not in lines 1-5 of `v1/core/kv_cache_utils.py`; not in the file at all" in problem


def test_the_name_may_sit_three_lines_outside_the_range_but_not_four(tmp_path, wheel):
    assert problems_in(tmp_path, wheel, "a.md", "(`touch`, `v1/core/block_pool.py:14-17`)") == []
    [problem] = problems_in(tmp_path, wheel, "a.md", "(`touch`, `v1/core/block_pool.py:13-16`)")
    assert problem == "a.md:1: `touch` not in lines 13-16 of `v1/core/block_pool.py`; found at line 20"


def test_a_shifted_range_fails_and_says_where_the_name_is(tmp_path, wheel):
    [problem] = problems_in(tmp_path, wheel, "a.md", "x\n(`free_blocks`, `v1/core/block_pool.py:12-14`)")
    assert problem == "a.md:2: `free_blocks` not in lines 12-14 of `v1/core/block_pool.py`; found at line 4"


def test_a_range_past_the_end_fails(tmp_path, wheel):
    [problem] = problems_in(tmp_path, wheel, "a.md", "(`touch`, `v1/core/block_pool.py:20-22`)")
    assert problem == "a.md:1: `v1/core/block_pool.py` has 21 lines; the citation runs to line 22"


def test_a_reversed_range_fails(tmp_path, wheel):
    [problem] = problems_in(tmp_path, wheel, "a.md", "(`touch`, `v1/core/block_pool.py:20-18`)")
    assert "the range 20-18 of `v1/core/block_pool.py` is reversed" in problem


def test_a_missing_file_fails_with_a_hint(tmp_path, wheel):
    [missing, prefixed] = problems_in(tmp_path, wheel, "a.md",
                                      "(`touch`, `v1/core/pool.py:20`) (`n`, `vllm/sampling_params.py:2`)")
    assert missing == "a.md:1: `v1/core/pool.py` is not a file of the vLLM 0.33.0 wheel"
    assert "drop the leading vllm/" in prefixed


def test_a_wrong_name_fails(tmp_path, wheel):
    [problem] = problems_in(tmp_path, wheel, "a.md", "(`allocate`, `v1/core/block_pool.py:4-8`)")
    assert problem == "a.md:1: `allocate` not in lines 4-8 of `v1/core/block_pool.py`; not in the file at all"


def test_names_match_whole_words_and_a_missing_name_fails(tmp_path, wheel):
    text = "(`free_block`, `v1/core/block_pool.py:4`) (`v1/core/block_pool.py:4`)"
    part, nameless = problems_in(tmp_path, wheel, "a.md", text)
    assert "`free_block` not in line 4" in part
    assert "names nothing before it" in nameless


def test_older_forms_fail_the_check(tmp_path, wheel):
    problems = problems_in(tmp_path, wheel, "a.md", "(`v1/core/block_pool.py`, line 4) and (lines\n7-8)")
    assert [p.split(": ")[0] for p in problems] == ["a.md:1", "a.md:1"]
    assert all("older citation form" in p for p in problems)


def test_sglang_citations_are_recognised_and_never_carry_lines(tmp_path, wheel):
    path = tmp_path / "a.md"
    path.write_text("(`ReqToTokenPool`, `sglang/srt/mem_cache/memory_pool.py`)\n"
                    "(`alloc`, `sglang/srt/mem_cache/allocator.py:12`)\n")
    problems, counts = citations.check([path], tmp_path, wheel)
    assert counts["sglang"] == 2 and counts["vllm"] == 0
    assert problems == ["a.md:2: SGLang pins no release: cite `sglang/srt/mem_cache/allocator.py` "
                        "by a function, without line numbers"]


# --- the parser, in each kind of file ----------------------------------------

def test_notebook_cells_markdown_and_code_comments(tmp_path, wheel):
    text = notebook(("markdown", "# Title\n\nIt frees (`free_blocks`,\n`v1/core/block_pool.py:40`).\n"),
                    ("code", "x = 1\n# `n` (`sampling_params.py:2`)\n# `seed` (`sampling_params.py:9`)\n"))
    assert problems_in(tmp_path, wheel, "chapters/01.ipynb", text) == [
        "chapters/01.ipynb, cell 0, line 4: `v1/core/block_pool.py` has 21 lines; the citation runs to line 40",
        "chapters/01.ipynb, cell 1, line 3: `sampling_params.py` has 3 lines; the citation runs to line 9"]


def test_python_docstrings_comments_and_strings(tmp_path, wheel):
    source = ('"""Pool.\n\nAs vLLM (``free_blocks``,\n``v1/core/block_pool.py:4-8``) and\n'
              '(``touch``, ``v1/core/block_pool.py:2``)."""\n'
              "# vLLM reads it as 1 (``touch``,\n#: ``v1/core/block_pool.py:9``)\n"
              'FORMAT = "`x` (`v1/core/block_pool.py:99`)"  # a string of code is prose too\n'
              "y = 2\n")
    problems = problems_in(tmp_path, wheel, "lib/pagedkv/pool.py", source)
    assert problems == [
        "lib/pagedkv/pool.py:5: `touch` not in line 2 of `v1/core/block_pool.py`; found at line 20",
        "lib/pagedkv/pool.py:7: `touch` not in line 9 of `v1/core/block_pool.py`; found at line 20",
        "lib/pagedkv/pool.py:8: `v1/core/block_pool.py` has 21 lines; the citation runs to line 99"]


def test_markdown_counts(tmp_path, wheel):
    path = tmp_path / "book" / "a.md"
    path.parent.mkdir()
    path.write_text("(`free_blocks`, `v1/core/block_pool.py:4`); `touch` (`v1/core/block_pool.py:20-21`)\n"
                    "A pointer, `v1/core/block_pool.py`, is no citation.\n")
    problems, counts = citations.check([path], tmp_path, wheel)
    assert problems == [] and counts["vllm"] == 2 and counts["files"] == {"book/a.md"}


# --- the wheel: cached, skipped, or required ----------------------------------

def test_main_checks_with_the_cached_wheel(tmp_path, wheel_path, monkeypatch, capsys):
    monkeypatch.setenv("PAGEDKV_CACHE", str(wheel_path.parent))
    (tmp_path / "README.md").write_text("(`free_blocks`, `v1/core/block_pool.py:4`)\n")
    assert citations.main(["--check", "--root", str(tmp_path)]) == 0
    assert "1 vLLM citations in 1 files" in capsys.readouterr().out


def test_without_wheel_or_network_the_check_is_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path))
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(citations, "download_wheel", lambda directory: None)
    assert citations.main(["--check", "--root", str(tmp_path)]) == 0
    assert "citations: skipped: no vLLM 0.33.0 wheel in" in capsys.readouterr().err


def test_under_ci_a_missing_wheel_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path))
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(citations, "download_wheel", lambda directory: None)
    assert citations.main(["--check", "--root", str(tmp_path)]) == 1
    assert "CI=true" in capsys.readouterr().err


# --- rewriting the older forms ------------------------------------------------

def test_rewrite_converts_a_markdown_page(tmp_path, wheel):
    page = tmp_path / "a.md"
    page.write_text("It frees them in reverse (`free_blocks`, `v1/core/block_pool.py`,\n"
                    "lines 4-8) and `touch` does nothing (same file, line\n20). Then more.\n"
                    "Unnamed (`v1/core/block_pool.py`, line 6).\n")
    record = citations.rewrite_file(page, tmp_path, wheel)
    assert page.read_text() == ("It frees them in reverse (`free_blocks`, `v1/core/block_pool.py:4-8`)\n"
                                "and `touch` does nothing (`touch`, `v1/core/block_pool.py:20`).\nThen more.\n"
                                "Unnamed (`v1/core/block_pool.py`, line 6).\n")
    assert [c.new is None for c in record] == [False, False, True]
    assert "no name before it occurs in line 6" in record[2].why
    assert problems_in(tmp_path, wheel, "b.md", page.read_text().rsplit("Unnamed", 1)[0]) == []


def test_rewrite_resolves_short_paths_and_keeps_comment_lines(tmp_path, wheel):
    source = tmp_path / "m.py"
    source.write_text('"""As ``MAX_3D_QUERY_LEN`` (``triton_unified_attention.py``, line 1).\n\n'
                      'See ``v1/attention/ops/triton_unified_attention.py``."""\n'
                      "x = 1  # ``seed`` in\n#: vllm/sampling_params.py, line 3, as vLLM\n")
    citations.rewrite_file(source, tmp_path, wheel)
    assert source.read_text() == (
        '"""As ``MAX_3D_QUERY_LEN`` (``v1/attention/ops/triton_unified_attention.py:1``).\n\n'
        'See ``v1/attention/ops/triton_unified_attention.py``."""\n'
        "x = 1  # ``seed``,\n#: ``sampling_params.py:3``, as vLLM\n")


def test_rewrite_changes_a_notebooks_cell_sources_only(tmp_path, wheel):
    path = tmp_path / "nb.ipynb"
    original = notebook(("markdown", "Frees (`free_blocks`, `v1/core/block_pool.py`, lines 4-8).\n"),
                        ("code", "n = 1  # `n`, vllm/sampling_params.py, line 2\n"))
    nb = json.loads(original)
    nb["cells"][1]["outputs"] = [{"name": "stdout", "output_type": "stream", "text": ["line 2 \u00e9\n"]}]
    original = citations.dump_notebook(nb)
    path.write_text(original)
    citations.rewrite_file(path, tmp_path, wheel)
    expected = (original.replace("`v1/core/block_pool.py`, lines 4-8", "`v1/core/block_pool.py:4-8`")
                .replace("vllm/sampling_params.py, line 2", "`sampling_params.py:2`"))
    assert path.read_text() == expected


def test_rewrite_leaves_several_ranges_and_unknown_files_to_a_person(tmp_path, wheel):
    page = tmp_path / "a.md"
    text = "(`free_blocks`, `v1/core/block_pool.py`, lines 4 and 20) (`x`, `v1/nope.py`, line 3)\n"
    page.write_text(text)
    record = citations.rewrite_file(page, tmp_path, wheel)
    assert page.read_text() == text
    assert [c.why for c in record] == ["several ranges: give each its own name",
                                       "`v1/nope.py`: not a file of the wheel"]
