"""The citation check, on a tiny fake vLLM wheel: no network, no real wheel."""

import subprocess
import zipfile
from pathlib import Path

import pytest

from tools import citations, myst

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
VL = "https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/core/block_pool.py"
SG = "https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/mem_cache/allocator.py"
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


ALLOCATOR = "\n".join([
    "import torch",                                        # 1
    "",                                                    # 2
    "class TokenToKVPoolAllocator:",                       # 3
    "    def alloc(self, need_size: int):",                # 4
    "        if need_size > len(self.free_pages):",        # 5
    "            return None",                             # 6
    "        select_index = self.free_pages[:need_size]",  # 7
    *[""] * 4,                                             # 8-11
    "    def free(self, free_index):",                     # 12
    "        pass",                                        # 13
]) + "\n"


@pytest.fixture
def sglang_wheel_path(wheel_path):
    path = wheel_path.parent / f"sglang-{citations.SGLANG.version}-cp311-cp311-manylinux_2_34_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("sglang/srt/mem_cache/allocator.py", ALLOCATOR)
        z.writestr("sglang/srt/mem_cache/memory_pool.py", "class ReqToTokenPool:\n    pass\n")
    return path


@pytest.fixture
def sglang_wheel(sglang_wheel_path):
    return citations.Wheel(sglang_wheel_path, "sglang")


@pytest.fixture
def wheels(wheel, sglang_wheel):
    return {"vllm": wheel, "sglang": sglang_wheel}


def _write(root, name, content):
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    return path


def problems_in(tmp_path, wheel, name, content):
    """Check one file of a book rooted at tmp_path; the problems found."""
    return citations.check([_write(tmp_path, name, content)], tmp_path, wheel)[0]


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


def test_sglang_spans_with_lines_are_checked_and_without_lines_fail(tmp_path, wheel, sglang_wheel):
    path = tmp_path / "a.md"
    path.write_text("(`ReqToTokenPool`, `sglang/srt/mem_cache/memory_pool.py`)\n"
                    "(`alloc`, `sglang/srt/mem_cache/allocator.py:3-4`)\n"
                    "(`free`, `sglang/srt/mem_cache/allocator.py:3-4`)\n")
    problems, counts = citations.check([path], tmp_path, {"vllm": wheel, "sglang": sglang_wheel})
    assert counts["sglang"] == 3 and counts["vllm"] == 0 and counts["checked"]["sglang"] == 2
    assert [c.name for c in counts["to_convert"]] == ["ReqToTokenPool"]
    assert problems == ["a.md:1: ReqToTokenPool in `sglang/srt/mem_cache/memory_pool.py` has no lines: "
                        "link to them at v0.5.23",
                        "a.md:3: `free` not in lines 3-4 of `sglang/srt/mem_cache/allocator.py`; found at line 12"]


# --- links to the lines at the release tag -----------------------------------

def test_good_links_pass_in_markdown_and_in_a_docstring(tmp_path, wheels):
    page = (f"It frees in reverse ([`free_blocks`]({VL}#L4-L8)); [`BlockPool.touch`]({VL}#L20)\n"
            f'does nothing, as [\"Free blocks go to the tail, ... reverse order\"]({VL}#L5-L6) says;\n'
            f"SGLang's [`TokenToKVPoolAllocator.alloc`]({SG}#L4-L7) takes the head.\n")
    problems, counts = citations.check([_write(tmp_path, "book/a.md", page)], tmp_path, wheels)
    assert problems == [] and counts["links"] == 4 and counts["vllm"] == 3 and counts["sglang"] == 1
    source = f'"""Pool.\n\nAs vLLM frees (`free_blocks <{VL}#L4-L8>`_).\n"""\nx = 1  # [`touch`]({VL}#L20)\n'
    assert problems_in(tmp_path, wheels, "lib/pagedkv/pool.py", source) == []


def test_a_link_whose_range_misses_the_name_fails_and_says_where_it_is(tmp_path, wheels):
    [problem] = problems_in(tmp_path, wheels, "a.md", f"x\nIt frees ([`free_blocks`]({VL}#L12-L14)).")
    assert problem == "a.md:2: `free_blocks` not in lines 12-14 of `v1/core/block_pool.py`; found at line 4"
    [problem] = problems_in(tmp_path, wheels, "a.md", f"[`alloc`]({SG}#L9-L13)")
    assert problem == "a.md:1: `alloc` not in lines 9-13 of `sglang/srt/mem_cache/allocator.py`; found at line 4"


def test_a_link_with_a_wrong_name_fails(tmp_path, wheels):
    [problem] = problems_in(tmp_path, wheels, "a.md", f"[`allocate`]({VL}#L4-L8)")
    assert problem == "a.md:1: `allocate` not in lines 4-8 of `v1/core/block_pool.py`; not in the file at all"


def test_a_link_past_the_end_or_to_a_missing_file_fails(tmp_path, wheels):
    end, missing = problems_in(tmp_path, wheels, "a.md",
                               f"[`touch`]({VL}#L20-L22) [`x`]({VL.replace('block_pool', 'pool')}#L2)")
    assert end == "a.md:1: `v1/core/block_pool.py` has 21 lines; the citation runs to line 22"
    assert missing == "a.md:1: `v1/core/pool.py` is not a file of the vLLM 0.33.0 wheel"


def test_a_link_to_another_tag_or_branch_fails(tmp_path, wheels):
    old, main, sglang = problems_in(tmp_path, wheels, "a.md",
                                    f"[`touch`]({VL.replace('v0.33.0', 'v0.9.2')}#L20)\n"
                                    f"[`touch`]({VL.replace('v0.33.0', 'main')}#L20)\n"
                                    f"[`alloc`]({SG.replace('v0.5.23', 'v0.4.0')}#L4)\n")
    assert old == ("a.md:1: vLLM link to `vllm/v1/core/block_pool.py` at 'v0.9.2': "
                   "link to the release's tag, v0.33.0")
    assert "at 'main'" in main
    assert sglang.startswith("a.md:3: SGLang link to `python/sglang/srt/mem_cache/allocator.py` at 'v0.4.0'")


def test_a_link_without_lines_or_with_a_malformed_anchor_fails(tmp_path, wheels):
    bare, short, colon, word = problems_in(tmp_path, wheels, "a.md",
                                           f"[`touch`]({VL}) [`touch`]({VL}#L20-21)\n"
                                           f"[`touch`]({VL}#L20:L21) [`touch`]({VL}#touch)\n")
    assert bare == ("a.md:1: vLLM link to `vllm/v1/core/block_pool.py` without lines: "
                    "add #L<first>-L<last> (or #L<line>)")
    assert short == ("a.md:1: vLLM link to `vllm/v1/core/block_pool.py`: the anchor #L20-21 is not "
                     "#L<first>-L<last> or #L<line>")
    assert "#L20:L21 is not" in colon and "#touch is not" in word


def test_a_link_outside_the_package_or_without_a_name_fails(tmp_path, wheels):
    outside, nameless, prose = problems_in(
        tmp_path, wheels, "a.md",
        "[`paged_attention`](https://github.com/vllm-project/vllm/blob/v0.33.0/csrc/attention.cu#L5)\n"
        f"see {VL}#L4 and [the pool]({VL}#L4)\n")
    assert outside == ("a.md:1: vLLM link to `csrc/attention.cu`: not in the vllm package (vllm/), "
                       "which is all the wheel holds")
    assert nameless.startswith("a.md:2: the link to `v1/core/block_pool.py` names nothing: write [`name`](")
    assert prose == ("a.md:2: vLLM link to `vllm/v1/core/block_pool.py`: its text 'the pool' is not the "
                     "cited name in a code span (or a \"quoted fragment\")")


def test_links_that_are_no_citations_pass(tmp_path, wheels):
    page = ("vLLM (https://github.com/vllm-project/vllm), its pull request\n"
            "[#47361](https://github.com/vllm-project/vllm/pull/47361) and its folder\n"
            "[`v1/core/`](https://github.com/vllm-project/vllm/tree/v0.33.0/vllm/v1/core); the form\n"
            "`https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/<path>#L<first>`, shown.\n")
    problems, counts = citations.check([_write(tmp_path, "a.md", page)], tmp_path, wheels)
    assert problems == [] and counts["links"] == 0
    [problem] = problems_in(tmp_path, wheels, "b.md", "[`core`](https://github.com/vllm-project/vllm/tree/main/vllm)")
    assert "at 'main': link to the release's tag" in problem


def test_a_link_text_may_hold_brackets(tmp_path, wheels):
    page = f"The pool appends to\n[`self.queue[-1]`]({VL}#L8) ([`reversed(blocks)`]({VL}#L7)).\n"
    [problem] = problems_in(tmp_path, wheels, "a.md", page)
    assert problem == "a.md:2: `self.queue[-1]` not in line 8 of `v1/core/block_pool.py`; not in the file at all"
    assert problems_in(tmp_path, wheels, "b.md", page.replace("[-1]", ".append(b)")) == []


# --- asides, answers and each chapter's budget --------------------------------

ASIDE = "In vLLM 0.33.0"


def test_citations_are_counted_where_they_stand(tmp_path, wheels):
    chapter = notebook(
        ("markdown", f"# One\n\nThe pool frees in reverse ([`free_blocks`]({VL}#L4-L8)).\n\n"
                     f":::{{dropdown}} {ASIDE}\nvLLM's [`touch`]({VL}#L20) and\n"
                     "(`touch`, `v1/core/block_pool.py:20`).\n:::\n"),
        ("markdown", "::::{dropdown} Answer\nIt is 4.\n:::{dropdown} In SGLang 0.5.23\n"
                     f"[`alloc`]({SG}#L4)\n:::\n[`touch`]({VL}#L20)\n::::\n"),
        ("code", f"x = 1  # (`touch`, `v1/core/block_pool.py:20`)\n"),
        ("markdown", f"```python\n[`touch`]({VL}#L20)\n```\n"))
    path = _write(tmp_path, "chapters/01_one.ipynb", chapter)
    stats = citations.chapter_stats(path, tmp_path)
    assert {k: [c.name for c in v] for k, v in stats.citations.items()} == {
        "main": ["free_blocks"], "aside": ["touch", "touch", "alloc"], "answer": ["touch"],
        "code": ["touch"]}  # the fenced block shows a link's source, no link
    assert stats.as_spans == 1
    assert citations.check([path], tmp_path, wheels)[0] == []


def test_main_text_words_leave_out_asides_answers_and_code(tmp_path):
    chapter = notebook(
        ("markdown", "# The pool\n\nOne two three `four` $5$ [six seven](https://example.com/x).\n\n"
                     f":::{{dropdown}} {ASIDE}\nnot these words\n:::\n\n:::{{note}}\n:class: tip\neight nine\n:::\n"),
        ("markdown", ":::{dropdown} Answer\nnor these\n:::\n\n$$\nx = y + z\n$$\n\n| ten | eleven |\n| --- | --- |\n"),
        ("code", "# no words here count\nprint('none')\n"),
        ("markdown", "```text\nnor this\n```\n<!-- nor a comment -->\ntwelve {term}`KV cache`\n"))
    stats = citations.chapter_stats(_write(tmp_path, "chapters/01_one.ipynb", chapter), tmp_path)
    # The pool (2) + One..seven (7) + eight nine (2) + ten eleven (2) + twelve KV cache (3)
    assert stats.words == 16


def test_a_misnamed_aside_and_an_unclosed_fence_fail_the_check(tmp_path, wheels):
    page = ":::{dropdown} In vLLM 0.32\nx\n:::\n\n:::{dropdown} In vLLM 0.33.0\nnever closed\n"
    misnamed, unclosed = problems_in(tmp_path, wheels, "book/a.md", page)
    assert misnamed == ("book/a.md:1: the aside 'In vLLM 0.32' is titled neither 'In vLLM 0.33.0' "
                        "nor 'In SGLang 0.5.23'")
    assert unclosed == ("book/a.md:5: the {dropdown} In vLLM 0.33.0 never closes: it runs to the end "
                        "of the page")


def test_an_aside_with_three_colons_closes_at_its_inner_notes_fence(tmp_path):
    # markdown-it's rule: the first line of three or more colons closes a three-colon fence.
    text = f":::{{dropdown}} {ASIDE}\n:::{{note}}\ninside\n:::\nafter the note\n:::\n"
    found = myst.blocks(text)
    assert [(b.kind, b.line, b.closed) for b in found] == [("aside", 1, True), ("directive", 2, False)]
    assert myst.kind_at(found, text.index("after the note")) == "main"
    assert citations.aside_problems(citations.Text("a.md", text)) == [
        "a.md:2: the {note} never closes: it runs to the end of the {dropdown} opened on line 1"]
    four = text.replace(f":::{{dropdown}}", f"::::{{dropdown}}").rstrip(":\n") + "\n::::\n"
    found = myst.blocks(four)
    assert [(b.kind, b.name) for b in found] == [("aside", "dropdown"), ("directive", "note")]
    assert myst.kind_at(found, four.index("after the note")) == "aside"


def _over_budget_chapter(words: int, main_citations: int) -> str:
    prose = " ".join(["word"] * words)
    cites = " ".join(f"[`touch`]({VL}#L20)" for _ in range(main_citations))
    return notebook(("markdown", f"# A chapter\n\n{prose}\n\n{cites}\n"),
                    ("markdown", f":::{{dropdown}} {ASIDE}\n" + " ".join(["aside"] * 5000)
                     + f" [`touch`]({VL}#L20)\n:::\n"))


def test_the_budget_fails_a_chapter_over_either_limit(tmp_path):
    _write(tmp_path, "chapters/01_ok.ipynb", _over_budget_chapter(3496, 2))  # + "A chapter" + 2 citations
    _write(tmp_path, "chapters/02_long.ipynb", _over_budget_chapter(3500, 0))
    _write(tmp_path, "chapters/03_cited.ipynb", _over_budget_chapter(10, 3))
    stats = citations.chapters(tmp_path)
    assert [(s.name, s.words, len(s.citations["main"]), len(s.citations["aside"])) for s in stats] == [
        ("01_ok", 3500, 2, 1), ("02_long", 3502, 0, 1), ("03_cited", 15, 3, 1)]
    assert citations.budget_problems(stats) == [
        "chapters/02_long.ipynb: 3,502 words of main text (at most 3,500)",
        "chapters/03_cited.ipynb: 3 citations in the main text (at most 2; the rest go into asides):",
        "    chapters/03_cited.ipynb, cell 0, line 5: touch",
        "    chapters/03_cited.ipynb, cell 0, line 5: touch",
        "    chapters/03_cited.ipynb, cell 0, line 5: touch"]


def test_report_prints_the_table_and_budget_fails_without_any_wheel(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(citations, "find_wheel", lambda release=None: pytest.fail("no wheel is needed"))
    _write(tmp_path, "chapters/01_ok.ipynb", _over_budget_chapter(100, 1))
    assert citations.main(["--report", "--root", str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split() == ["chapter", "words", "main", "asides", "answers", "code", "as", "spans"]
    assert table[2].split() == ["01_ok", "103", "1", "1", "0", "0", "0"]
    _write(tmp_path, "chapters/02_long.ipynb", _over_budget_chapter(4000, 0))
    assert citations.main(["--budget", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "chapters/02_long.ipynb: 4,002 words of main text (at most 3,500)" in out
    assert "citations: budget: 1 over in 1 of 2 chapters" in out and "02_long" in out.splitlines()[-1]


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

@pytest.fixture
def offline(monkeypatch):
    """No network: a wheel that is not cached cannot be downloaded."""
    monkeypatch.setattr(citations, "download_wheel", lambda directory, release=citations.VLLM: None)


def test_main_checks_with_the_cached_wheels(tmp_path, wheel_path, sglang_wheel_path, monkeypatch, capsys, offline):
    monkeypatch.setenv("PAGEDKV_CACHE", str(wheel_path.parent))
    (tmp_path / "README.md").write_text(f"(`free_blocks`, `v1/core/block_pool.py:4`) and [`alloc`]({SG}#L4)\n")
    assert citations.main(["--check", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 vLLM citations, 1 checked against 1 files of the vLLM 0.33.0 wheel" in out
    assert "1 SGLang citations, 1 checked against 1 files of the SGLang 0.5.23 wheel" in out
    assert "1 links" in out and "0 problems" in out


def test_without_wheels_or_network_the_check_is_skipped(tmp_path, monkeypatch, capsys, offline):
    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path))
    monkeypatch.delenv("CI", raising=False)
    assert citations.main(["--check", "--root", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "citations: skipped: no vLLM 0.33.0 wheel in" in err and "no SGLang 0.5.23 wheel in" in err


def test_without_one_wheel_the_other_releases_citations_are_checked(tmp_path, wheel_path, monkeypatch, capsys,
                                                                   offline):
    monkeypatch.setenv("PAGEDKV_CACHE", str(wheel_path.parent))  # the vLLM wheel only
    monkeypatch.delenv("CI", raising=False)
    (tmp_path / "README.md").write_text(f"(`allocate`, `v1/core/block_pool.py:4`) and [`alloc`]({SG}#L4)\n")
    assert citations.main(["--check", "--root", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "README.md:1: `allocate` not in line 4" in captured.out
    assert "1 SGLang citations not checked (no SGLang 0.5.23 wheel in" in captured.out
    assert "skipped part: no SGLang 0.5.23 wheel" in captured.err


def test_under_ci_a_missing_wheel_fails(tmp_path, wheel_path, monkeypatch, capsys, offline):
    monkeypatch.setenv("PAGEDKV_CACHE", str(wheel_path.parent))  # the SGLang wheel is missing
    monkeypatch.setenv("CI", "true")
    assert citations.main(["--check", "--root", str(tmp_path)]) == 1
    assert "FAILED: no SGLang 0.5.23 wheel in" in capsys.readouterr().err


def test_each_wheel_is_downloaded_by_pip_for_one_named_platform(tmp_path, monkeypatch):
    commands = []

    def pip(cmd):
        commands.append(cmd)
        dest = Path(cmd[cmd.index("--dest") + 1])
        package, version = cmd[-1].split("==")
        (dest / f"{package}-{version}-x.whl").write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(citations.subprocess, "run", pip)
    got = citations.download_wheel(tmp_path, citations.SGLANG)
    assert got == tmp_path / "sglang-0.5.23-x.whl" and got.exists()
    assert commands[0][-1] == "sglang==0.5.23" and "--no-deps" in commands[0]
    assert "manylinux_2_34_x86_64" in commands[0] and "cp311" in commands[0]
    assert citations.download_wheel(tmp_path, citations.VLLM).name == "vllm-0.33.0-x.whl"

