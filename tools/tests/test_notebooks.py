"""The notebook tools: normalisation keeps outputs stable, the toc audit catches a missing notebook."""

import pytest

nbformat = pytest.importorskip("nbformat")  # the notebook tools need Jupyter's file format

from tools import notebooks as _notebooks


def _nb_with_widget_output():
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("view")
    cell.outputs = [nbformat.v4.new_output("display_data", data={
        "text/plain": "VBox(children=...)",
        "text/html": "<svg>static</svg>",
        _notebooks.WIDGET_VIEW: {"model_id": "3f2a", "version_major": 2, "version_minor": 0},
    })]
    cell.metadata["execution"] = {"iopub.execute_input": "2026-01-01T00:00:00"}
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), cell]
    nb.metadata["widgets"] = {"state": {}}
    return nb


def test_normalise_drops_live_widget_parts_and_timings_and_numbers_cells():
    nb = _nb_with_widget_output()
    _notebooks.normalise(nb)
    data = nb.cells[1].outputs[0]["data"]
    assert _notebooks.WIDGET_VIEW not in data and data["text/html"] == "<svg>static</svg>"
    assert "execution" not in nb.cells[1].metadata and "widgets" not in nb.metadata
    assert [c["id"] for c in nb.cells] == ["c000", "c001"]
    nbformat.validate(nb)


def test_check_toc_reports_a_notebook_missing_from_the_toc(tmp_path, monkeypatch, capsys):
    (tmp_path / "_toc.yml").write_text("root: book/intro\nchapters:\n  - file: chapters/01_a\n")
    for d in _notebooks.NOTEBOOK_DIRS:
        (tmp_path / d).mkdir()
    nbformat.write(nbformat.v4.new_notebook(), tmp_path / "chapters" / "01_a.ipynb")
    monkeypatch.chdir(tmp_path)
    assert _notebooks.check_toc() == 0
    nbformat.write(nbformat.v4.new_notebook(), tmp_path / "exercises" / "01_a.ipynb")
    assert _notebooks.check_toc() == 1
    assert "exercises/01_a.ipynb" in capsys.readouterr().err


def test_run_plain_compares_printed_text(tmp_path, capsys):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(6 * 7)")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="42\n")]
    nb.cells = [cell]
    path = tmp_path / "ok.ipynb"
    nbformat.write(nb, path)
    assert _notebooks.run_plain([str(path)]) == 0
    cell.outputs[0]["text"] = "41\n"
    nbformat.write(nb, path)
    assert _notebooks.run_plain([str(path)]) == 1
    assert "printed text differs" in capsys.readouterr().out


def test_check_site_refuses_a_page_with_a_cdn_script(tmp_path, monkeypatch):
    (tmp_path / "_toc.yml").write_text("root: x\n")
    site = tmp_path / "_build" / "html"
    site.mkdir(parents=True)
    (site / "a.html").write_text("<script src='_static/local.js'></script><script>inline()</script>")
    monkeypatch.chdir(tmp_path)
    assert _notebooks.check_site() == 0
    (site / "b.html").write_text('<script async src="https://cdn.example/mathjax.js"></script>')
    assert _notebooks.check_site() == 1


def test_tracebacks_lose_machine_paths_but_keep_the_library_file():
    line = "File \x1b[0;32m/srv/build/checkout/lib/pagedkv/budget.py:251\x1b[0m, in check"
    assert _notebooks.scrub_paths(line) == "File \x1b[0;32mpagedkv/budget.py:251\x1b[0m, in check"
    site = "File /opt/venv/lib/python3.11/site-packages/torch/nn/x.py:3"
    assert "/opt/" not in _notebooks.scrub_paths(site) and "torch/nn/x.py" in _notebooks.scrub_paths(site)
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("1/0")
    cell.outputs = [nbformat.v4.new_output("error", ename="E", evalue="v", traceback=[line])]
    nb.cells = [cell]
    _notebooks.normalise(nb)
    assert not _notebooks.MACHINE_PATH.search(str(nb))


def test_check_toc_refuses_a_notebook_that_names_a_machine_path(tmp_path, monkeypatch, capsys):
    (tmp_path / "_toc.yml").write_text("root: x\nchapters:\n  - file: chapters/01_a\n")
    for d in _notebooks.NOTEBOOK_DIRS:
        (tmp_path / d).mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("see /home/alice/notes.txt")]
    nbformat.write(nb, tmp_path / "chapters" / "01_a.ipynb")
    monkeypatch.chdir(tmp_path)
    assert _notebooks.check_toc() == 1
    assert "/home/alice" in capsys.readouterr().err


def test_run_plain_skips_only_live_views_that_need_jupyter(tmp_path):
    nb = nbformat.v4.new_notebook()
    live = nbformat.v4.new_code_cell("raise ImportError(\"No module named 'ipywidgets'\")")
    live.metadata["tags"] = ["nbval-ignore-output"]
    nb.cells = [live, nbformat.v4.new_code_cell("print('after')")]
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="after\n")]
    path = tmp_path / "live.ipynb"
    nbformat.write(nb, path)
    assert _notebooks.run_plain([str(path)]) == 0
    live.metadata["tags"] = []  # the same failure in an ordinary cell is a failure
    nbformat.write(nb, path)
    assert _notebooks.run_plain([str(path)]) == 1


def test_run_plain_skips_a_comparison_whose_reference_package_is_missing(tmp_path, capsys):
    # A bare GPU machine has no transformers; the cell that compares with it is skipped, said so.
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("raise ImportError(\"No module named 'transformers'\")")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="identical tokens: True\n")]
    nb.cells = [cell]
    path = tmp_path / "ref.ipynb"
    nbformat.write(nb, path)
    assert _notebooks.run_plain([str(path)]) == 0
    assert "lacks" in capsys.readouterr().out
    cell.source = "raise ImportError(\"No module named 'pagedkv_missing'\")"  # anything else still fails
    nbformat.write(nb, path)
    assert _notebooks.run_plain([str(path)]) == 1


def test_normalise_merges_stream_chunks_so_reruns_do_not_diff():
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print('a'); print('b')")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="a\n"),
                    nbformat.v4.new_output("stream", name="stdout", text="b\n"),
                    nbformat.v4.new_output("stream", name="stderr", text="warn\n"),
                    nbformat.v4.new_output("stream", name="stdout", text="c\n")]
    nb.cells = [cell]
    _notebooks.normalise(nb)
    assert [(o["name"], o["text"]) for o in nb.cells[0].outputs] == [
        ("stdout", "a\nb\n"), ("stderr", "warn\n"), ("stdout", "c\n")]


def test_check_site_refuses_a_script_constant_declared_twice(tmp_path, monkeypatch):
    # The theme's thebe block, emitted twice, threw "Identifier 'THEBE_JS_URL' has already been declared".
    (tmp_path / "_toc.yml").write_text("root: x\n")
    site = tmp_path / "_build" / "html"
    site.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    (site / "a.html").write_text("<script>var x = 1;</script><script>var x = 1;</script>")
    assert _notebooks.check_site() == 0  # a repeated var is legal JavaScript
    (site / "b.html").write_text('<script>const U = "u"</script><p></p><script>const U = "u"</script>')
    assert _notebooks.check_site() == 1


def test_run_plain_skips_cells_whose_guard_is_false(tmp_path, capsys):
    # Chapter 8 on a machine without the real model: HAVE_MODEL is False and its
    # cells print nothing of the committed text, which is not a difference.
    nb = nbformat.v4.new_notebook()
    guard = nbformat.v4.new_code_cell("HAVE_MODEL = False")
    cell = nbformat.v4.new_code_cell("if HAVE_MODEL:\n    print('Paris')")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="Paris\n")]
    nb.cells = [guard, cell]
    path = tmp_path / "model.ipynb"
    nbformat.write(nb, path)
    assert _notebooks.run_plain([str(path)]) == 0
    assert "cell 1: HAVE_MODEL is false here" in capsys.readouterr().out
    guard.source = "HAVE_MODEL = True"  # with the model the cell runs and is compared
    cell.source = "if HAVE_MODEL:\n    print('Lyon')"
    nbformat.write(nb, path)
    assert _notebooks.run_plain([str(path)]) == 1
    assert "printed text differs" in capsys.readouterr().out


def test_run_cell_registers_its_source_for_inspect(tmp_path):
    # What compiled @triton.jit needs: the function's source, found through linecache.
    import inspect

    ns: dict = {}
    _notebooks.run_cell("def f(x):\n    return x + 1", ns, "<nb.ipynb cell 7>")
    assert inspect.getsource(ns["f"]) == "def f(x):\n    return x + 1\n"
