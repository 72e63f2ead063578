"""The glossary check on a tiny book: each rule of tools/terms.py, failing when it should."""

import json

import pytest

from tools import terms

GLOSSARY = """# Glossary

```{glossary}
KV cache
  The keys and values of every token seen.

Block
  A fixed number of token positions.

Block table
Block tables
  The list of a request's blocks.

Copy-on-write
  A private copy before a write.

`max_model_len`
  The longest request.
```
"""
TOC = """format: jb-book
root: book/intro
parts:
  - caption: Chapters
    chapters:
      - file: chapters/01_one
      - file: chapters/02_two
  - caption: Reference
    chapters:
      - file: book/glossary
"""


def notebook(*cells):
    nb = {"cells": [{"cell_type": kind, "id": f"c{i}", "metadata": {"tags": list(tags)},
                     "source": src.splitlines(keepends=True),
                     **({"execution_count": None, "outputs": []} if kind == "code" else {})}
                    for i, (kind, src, *tags) in enumerate(cells)],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    return json.dumps(nb, indent=1, sort_keys=True) + "\n"


def book(tmp_path, intro, one, two=notebook(("markdown", "Nothing.\n"))):
    for name, content in (("_toc.yml", TOC), ("book/glossary.md", GLOSSARY), ("book/intro.md", intro),
                          ("chapters/01_one.ipynb", one), ("chapters/02_two.ipynb", two)):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)
    return tmp_path


def check(root):
    return terms.violations(terms.first_appearances(root))


DEFINED = ("The **KV cache** holds keys and values; a *block* is 16 of its positions and a\n"
           "{term}`block table <Block tables>` lists them. {term}`Copy-on-write` copies;\n"
           "**`max_model_len`** bounds a request.\n")


def test_the_glossary_and_the_reading_order():
    entries, _ = terms.glossary(terms.ROOT)
    assert entries[0].terms == ["KV cache"]
    order = [p.relative_to(terms.ROOT).as_posix() for p in terms.reading_order(terms.ROOT)]
    assert order[:4] == ["book/intro.md", "book/setup.md", "chapters/00_one_engine_step.ipynb",
                         "chapters/01_memory_budget.ipynb"]
    assert order.index("chapters/08_serving_engine.ipynb") < order.index("book/glossary.md")


def test_synonyms_are_one_entry(tmp_path):
    entries, _ = terms.glossary(book(tmp_path, "x", notebook()))
    assert [e.terms for e in entries] == [["KV cache"], ["Block"], ["Block table", "Block tables"],
                                          ["Copy-on-write"], ["`max_model_len`"]]


def test_definitions_and_links_pass(tmp_path):
    root = book(tmp_path, DEFINED, notebook(("markdown", "The KV cache, blocks, block tables again.\n")))
    assert check(root) == []


def test_a_first_use_without_definition_or_link_fails_where_it_stands(tmp_path):
    intro = DEFINED.replace("**KV cache**", "KV cache").replace("*block*", "block")
    root = book(tmp_path, "A heading-free start.\n\n" + intro, notebook())
    assert check(root) == [
        "book/intro.md:3: 'KV cache' first appears as 'KV cache', neither {term}`KV cache` nor its **definition**",
        "book/intro.md:3: 'Block' first appears as 'block', neither {term}`Block` nor its **definition**"]


def test_matching_ignores_case_and_hyphens_and_takes_plurals(tmp_path):
    one = notebook(("markdown", "Two KV-caches and COPY ON WRITE.\n"))
    root = book(tmp_path, "Nothing yet.\n", one)
    assert [line.split(": ", 1)[1] for line in check(root)] == [
        "'KV cache' first appears as 'KV-caches', neither {term}`KV cache` nor its **definition**",
        "'Copy-on-write' first appears as 'COPY ON WRITE', neither {term}`Copy-on-write` nor its **definition**"]


def test_the_longer_match_is_the_appearance(tmp_path):
    # "block table" is Block table's appearance (linked), not Block's; "blocks" later is Block's.
    one = notebook(("markdown", "A {term}`block table` here; a **block table** there. Then blocks.\n"))
    root = book(tmp_path, "Nothing yet.\n", one)
    assert check(root) == ["chapters/01_one.ipynb, cell 0, line 1: 'Block' first appears as 'blocks', "
                           "neither {term}`Block` nor its **definition**"]


def test_whole_words_only_and_code_terms_match_identifiers(tmp_path):
    intro = ("Blockwise, per-block and unblocked are not the term; `BlockPool` is code.\n"
             "`max_model_len=4096` uses the term undefined; max_model_lens is another word.\n")
    root = book(tmp_path, intro, notebook())
    assert check(root) == ["book/intro.md:2: '`max_model_len`' first appears as 'max_model_len', "
                           "neither {term}`max_model_len` nor its **definition**"]


def test_code_headings_math_comments_and_link_targets_are_not_read(tmp_path):
    intro = ("# The KV cache and {term}`Block`\n\n```python\nblock = 1\n```\n\n$$\n\\text{block}\n$$\n"
             "<!-- a block -->\n[see](https://example.com/block-table) ![a block](b.png)\n")
    one = notebook(("code", "# a block table\nkv_cache = 1\n"),
                   ("markdown", "Hidden block.\n", "remove-cell"),
                   ("markdown", DEFINED))
    assert check(book(tmp_path, intro, one)) == []
    found = terms.first_appearances(tmp_path)
    assert found[1].first.where == "chapters/01_one.ipynb, cell 2, line 1"  # not the heading's link


def test_a_reader_who_skips_asides_needs_the_definition_in_the_main_text(tmp_path):
    one = notebook(("markdown", ":::{dropdown} In vLLM 0.33.0\nvLLM's **KV cache** is defined here.\n:::\n"),
                   ("markdown", "The main text then says KV cache.\n"),
                   ("markdown", ":::{dropdown} Answer\nA block table.\n:::\n\nBlock tables, undefined.\n"))
    found = check(book(tmp_path, "Nothing yet.\n", one))
    assert found == [
        "chapters/01_one.ipynb, cell 1, line 1: 'KV cache' first appears in the main text as 'KV cache', "
        "neither {term}`KV cache` nor its **definition**",
        "chapters/01_one.ipynb, cell 2, line 2: 'Block table' first appears as 'block table', "
        "neither {term}`Block table` nor its **definition**",
        "chapters/01_one.ipynb, cell 2, line 5: 'Block table' first appears in the main text as 'Block tables', "
        "neither {term}`Block table` nor its **definition**"]


def test_terms_used_only_in_the_glossary_are_defined_there(tmp_path):
    findings = terms.first_appearances(book(tmp_path, "Nothing.\n", notebook()))
    assert all(f.first.defined and f.first.where.startswith("book/glossary.md") for f in findings)


def test_main_reports_the_violations_and_fails(tmp_path, capsys):
    root = book(tmp_path, "The KV cache.\n", notebook())
    assert terms.main(["--check", "--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert "book/intro.md:1: 'KV cache' first appears" in out
    assert "terms: 5 glossary entries; 1 first appear neither defined nor linked (1 places)" in out
    assert terms.main(["--list", "--root", str(root)]) == 0
    assert terms.main(["--check", "--root", str(book(tmp_path, DEFINED, notebook()))]) == 0


@pytest.mark.parametrize("role", ["{term}`kv  CACHE`", "{term}`the cache <KV cache>`"])
def test_a_term_link_matches_its_target_whatever_the_case(tmp_path, role):
    assert not any("'KV cache'" in v for v in check(book(tmp_path, f"See {role}, the KV cache.\n", notebook())))
