"""The version matrix check on fake wheels (offline), then against the real ones when they are cached.

The last tests read vLLM 0.33.0's own sources from its wheel: every flag
``EngineArgs.to_cli`` emits is one ``engine/arg_utils.py`` registers, and
every metric ``pagedkv.engine.metrics`` exposes is registered under that name
and type in ``v1/metrics/loggers.py``. Without a cached wheel they are
skipped, except under ``CI=true`` (where the wheel is downloaded or the test
fails), like the citation check.
"""

import ast
import copy
import json
import os
import re
import zipfile

import pytest

from tools import citations, versions, wheel_members

OLD = "\n".join([
    "def free_blocks(self, blocks):",               # 1
    "    for b in blocks:",                         # 2
    "        b.ref_cnt -= 1",                       # 3
    "    self.queue.append_n(blocks)",              # 4
    "gpu_memory_utilization: float = 0.9",          # 5
])
NEW = "\n".join([
    "def free_blocks(self, blocks):",               # 1
    "    self.queue.prepend_n(blocks_without_hash)", # 2
    "    self.queue.append_n(blocks_with_hash)",    # 3
    "gpu_memory_utilization: float = 0.92",         # 4
])


def fake_wheel(path, version, source):
    name = path / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(name, "w") as z:
        z.writestr("vllm/v1/core/block_pool.py", source)
    return name


def matrix(**change):
    m = {"platforms": {"0.1.0": "p", "0.2.0": "p", "0.3.0": "p"},
         "pypi_order": ["0.1.0", "0.2.0", "0.2.1", "0.3.0"],
         "rows": [{"claim": "unhashed blocks to the head", "cells": [
             {"release": "0.1.0", "value": "no", "path": "v1/core/block_pool.py", "first": 1, "last": 4,
              "name": "free_blocks", "evidence": "self.queue.append_n(blocks)", "absent": "prepend_n"},
             {"release": "0.2.0", "value": "yes", "path": "v1/core/block_pool.py", "first": 1, "last": 3,
              "name": "free_blocks", "evidence": "self.queue.prepend_n(blocks_without_hash)"}]},
             {"claim": "utilization", "cells": [
                 {"release": "0.1.0", "value": "0.9", "path": "v1/core/block_pool.py", "first": 5, "last": 5,
                  "name": "gpu_memory_utilization", "evidence": "float = 0.9"},
                 {"release": "0.3.0", "value": "0.92", "path": "v1/core/block_pool.py", "first": 4, "last": 4,
                  "name": "gpu_memory_utilization", "evidence": "float = 0.92"}]}]}
    m.update(change)
    return m


@pytest.fixture
def wheels(tmp_path):
    return {"0.1.0": citations.Wheel(fake_wheel(tmp_path, "0.1.0", OLD)),
            "0.2.0": citations.Wheel(fake_wheel(tmp_path, "0.2.0", NEW)),
            "0.3.0": citations.Wheel(fake_wheel(tmp_path, "0.3.0", NEW))}


def test_a_matrix_that_holds_has_no_problems(wheels):
    assert versions.check_matrix(matrix(), wheels) == []


@pytest.mark.parametrize("edit,words", [
    (lambda m: m["rows"][0]["cells"][0].update(first=9, last=9), "has 5 lines"),
    (lambda m: m["rows"][0]["cells"][1].update(name="touch"), "`touch` not in lines 1-3"),
    (lambda m: m["rows"][1]["cells"][0].update(evidence="float = 0.95"), "`float = 0.95` is not in lines 5-5"),
    # "0.9" must not match "0.92": the evidence is whole code.
    (lambda m: m["rows"][1]["cells"][1].update(evidence="float = 0.9"), "`float = 0.9` is not in lines 4-4"),
    (lambda m: m["rows"][0]["cells"][1].update(absent="append_n"), "'append_n' is in"),
    (lambda m: m["rows"][0]["cells"][1].update(path="v1/core/kv_cache_utils.py"), "is not a file"),
    (lambda m: m["rows"][0]["cells"].reverse(), "not oldest first"),
    (lambda m: m["rows"][0]["cells"][1].update(release="0.9.0"), "not in pypi_order"),
    (lambda m: m["platforms"].pop("0.2.0"), "no platform tag"),
])
def test_each_wrong_cell_is_named(wheels, edit, words):
    m = copy.deepcopy(matrix())
    edit(m)
    problems = versions.check_matrix(m, wheels)
    assert any(words in p for p in problems), problems


def test_changed_in_names_the_release_or_the_two_around_it():
    from pagedkv.views.operator import changed_in, version_table

    m = matrix()
    assert changed_in(m["rows"][0], m["pypi_order"]) == "0.2.0"  # consecutive releases
    assert changed_in(m["rows"][1], m["pypi_order"]) == "between 0.1.0 and 0.3.0"  # 0.2.x not read
    same = {"cells": [dict(m["rows"][0]["cells"][1], release="0.2.0"), dict(m["rows"][0]["cells"][1], release="0.3.0")]}
    assert changed_in(same, m["pypi_order"]) == "-"
    html = version_table(m)
    assert "https://github.com/vllm-project/vllm/blob/v0.1.0/vllm/v1/core/block_pool.py#L1-L4" in html
    assert "https://github.com/vllm-project/vllm/blob/v0.3.0/vllm/v1/core/block_pool.py#L4'" in html


def test_main_skips_offline_and_fails_under_ci(tmp_path, monkeypatch, capsys):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(matrix()))
    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path / "empty"))
    monkeypatch.delenv("CI", raising=False)
    assert versions.run_check(tmp_path, path, download=False) == 0
    assert "skipped" in capsys.readouterr().err
    monkeypatch.setenv("CI", "true")
    assert versions.run_check(tmp_path, path, download=False) == 1
    assert "may not be skipped" in capsys.readouterr().err


def test_main_checks_cached_wheels(tmp_path, wheels, monkeypatch, capsys):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(matrix()))
    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path))
    monkeypatch.delenv("CI", raising=False)
    assert versions.run_check(tmp_path, path, download=False) == 0
    assert "2 claims, 4 cells, 4 checked against 3 wheels" in capsys.readouterr().out
    bad = matrix()
    bad["rows"][0]["cells"][0]["absent"] = "append_n"
    path.write_text(json.dumps(bad))
    assert versions.run_check(tmp_path, path, download=False) == 1


# ------------------------------------------------- the real wheels

def _real(version: str):
    """A release's wheel: cached, else the members read fetched (a few MB); offline it
    is skipped, except under CI=true, where the test fails."""
    platform = versions.load_matrix()["platforms"].get(version)
    ci = os.environ.get("CI", "").lower() in ("true", "1")
    found = versions.open_wheel(version, platform)
    if isinstance(found, str):
        if ci:
            pytest.fail(found)
        pytest.skip(found)
    return found


def test_the_books_matrix_holds_against_every_release_it_reads():
    m = versions.load_matrix()
    wheels = {v: _real(v) for v in versions.releases_of(m)}
    assert versions.check_matrix(m, wheels) == []
    assert len(wheels) >= 4  # at least three releases before 0.33.0
    for row in m["rows"]:
        assert len(row["cells"]) >= 2 and row["cells"][-1]["release"] == citations.VLLM.version


def _registered_flags(source: str) -> tuple[set[str], set[str]]:
    """Every "--flag" given to add_argument in arg_utils.py, and the EngineArgs fields typed bool."""
    tree = ast.parse(source)
    flags = {a.value for node in ast.walk(tree) if isinstance(node, ast.Call)
             and getattr(node.func, "attr", None) == "add_argument"
             for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    booleans = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "EngineArgs":
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and re.search(r"\bbool\b", ast.unparse(item.annotation)):
                    booleans.add(item.target.id)
    return flags, booleans


def test_every_flag_to_cli_emits_exists_in_vllm_0_33_0():
    from pagedkv.engine import EngineArgs

    source = "\n".join(_real(citations.VLLM.version).lines("engine/arg_utils.py"))
    flags, booleans = _registered_flags(source)
    assert "--tensor-parallel-size" in flags and "--kv-cache-dtype" in flags and "enable_prefix_caching" in booleans
    commands = [
        EngineArgs(tensor_parallel_size=4, kv_cache_dtype="fp8", gpu_memory_utilization=0.9,
                   max_model_len=32_768).to_cli("m", only_changed=True, gpu_class="H100/H200"),
        EngineArgs(num_gpu_blocks_override=2048, max_model_len=32_768, enable_prefix_caching=False,
                   enable_chunked_prefill=False, max_num_batched_tokens=32_768, scheduler_reserve_full_isl=False,
                   watermark=0.01, kv_cache_memory_bytes=2**30, seed=3, tensor_parallel_size=2,
                   kv_cache_dtype="fp8_e5m2").to_cli("m"),
    ]
    for command in commands:
        for flag in re.findall(r"(--[a-z0-9-]+)", command):
            if flag.startswith("--no-"):
                positive = "--" + flag[5:]
                assert positive in flags and flag[5:].replace("-", "_") in booleans, flag
            else:
                assert flag in flags, flag
    # Every kv_cache_dtype we accept is one of vLLM's CacheDType values.
    from pagedkv.engine.args import KV_CACHE_DTYPES

    cache = "\n".join(_real(citations.VLLM.version).lines("config/cache.py"))
    literal = re.search(r"CacheDType = Literal\[(.*?)\]", cache, re.S).group(1)
    assert set(KV_CACHE_DTYPES) <= set(re.findall(r'"([^"]+)"', literal))


def test_every_metric_is_registered_under_its_name_and_type_in_vllm_0_33_0():
    from pagedkv.engine.metrics import KV_CACHE_RESIDENCY_BUCKETS, VLLM_METRICS

    source = "\n".join(_real(citations.VLLM.version).lines("v1/metrics/loggers.py"))
    kinds = {m.group(2): m.group(1) for m in re.finditer(
        r"self\._(gauge|counter|histogram)_cls\(\s*name=\"(vllm:[a-z_]+)\"", source)}
    for name, kind in VLLM_METRICS:
        assert kinds.get(name) == kind, name
    assert re.search(r'labelnames = \["model_name", "engine"\]', source)
    buckets = "\n".join(_real(citations.VLLM.version).lines("v1/metrics/buckets.py"))
    body = re.search(r"KV_CACHE_RESIDENCY_BUCKETS: tuple\[float, \.\.\.\] = \((.*?)\)", buckets, re.S).group(1)
    assert tuple(float(x) for x in re.findall(r"[\d.]+", body)) == tuple(map(float, KV_CACHE_RESIDENCY_BUCKETS))


def test_the_startup_log_lines_read_are_vllms_words():
    from pagedkv import budget, server_log

    w = _real(citations.VLLM.version)
    runner = "\n".join(w.lines("v1/worker/gpu_model_runner.py"))
    assert "Model loading took %s GiB memory and %.6f seconds" in runner
    worker = "\n".join(w.lines("v1/worker/gpu_worker.py"))
    assert "Available KV cache memory: %s GiB" in worker and "logger.debug(profile_result)" in worker
    assert "Actual usage is {format_gib(self.total_consumed)} " in worker
    assert "GiB for consumed memory (weights + non-torch), " in worker
    mem = "\n".join(w.lines("utils/mem_utils.py"))
    assert 'f"Total non KV cache memory: "' in mem
    utils = "\n".join(w.lines("v1/core/kv_cache_utils.py"))
    assert '"%s KV cache size: %s tokens, "' in utils
    assert '"Maximum concurrency for %s tokens per request: %.2fx"' in utils
    # And the reader parses the lines our arithmetic prints in those words.
    p = budget.plan(model="Llama-3.1-70B", tensor_parallel_size=4, gpu_memory_utilization=0.9, request_len=2_500)
    log = server_log.read_startup_log("\n".join(server_log.server_log_lines(p)))
    assert log.available_kv_gib == round(p.pool_bytes / budget.GiB, 2) and log.kv_cache_tokens == p.token_slots


def test_the_book_notebooks_citations_hold_against_0_33_0():
    # tools.citations reads book/*.md; the notebooks in book/ are checked here.
    pages = sorted(versions.ROOT.glob(versions.PAGE_GLOB))
    assert pages, "no notebook in book/"
    problems, counts = citations.check(pages, versions.ROOT, {citations.VLLM.key: _real(citations.VLLM.version),
                                                              citations.SGLANG.key: None})
    assert problems == [] and counts["checked"][citations.VLLM.key] >= 10


def _free_rule(source: str) -> str:
    """Which rule a release's ``BlockPool.free_blocks`` ships, read from its code:
    "tail" (every freed block appended), "tail when caching is off" (unhashed
    blocks prepended, but only with caching on) or "head" (unhashed blocks, and
    every block with caching off, prepended)."""
    start = source.index("    def free_blocks(")
    end = source.find("\n    def ", start + 1)
    body = source[start:end if end > 0 else None]
    if "blocks_without_hash" not in body and "blocks_to_evict_first" not in body:
        return "tail"
    if "block.block_hash is None and self.enable_caching" in body:
        return "tail when caching is off"
    assert ("block.block_hash is None or not self.enable_caching" in body
            or "if block.block_hash is None:" in body), body
    return "head"


FREE_RULE_VALUES = {  # what each rule makes of the matrix's two free-queue claims
    "tail": ("no: all to the tail", "no: all to the tail"),
    "tail when caching is off": ("yes", "no: all to the tail"),
    "head": ("yes", "yes"),
}


def test_the_free_queue_history_is_read_release_by_release():
    # Issue 42: the head rule held with caching on from 0.24.0, but 0.27.x (vLLM
    # PR #48017, undone by #51482 in 0.28.0) sent every freed block to the tail
    # with caching off. The matrix's cells must name each change exactly, with
    # no "between", and they must agree with the rule each cell's release ships.
    from pagedkv.views.operator import changed_in

    m = versions.load_matrix()
    rows = [r for r in m["rows"] if "free queue's head" in r["claim"]]
    assert [r["claim"].startswith("with prefix caching off") for r in rows] == [False, True]
    assert changed_in(rows[0], m["pypi_order"]) == "0.24.0"
    assert changed_in(rows[1], m["pypi_order"]) == "0.24.0; 0.27.0; 0.28.0"
    for column, row in enumerate(rows):
        for cell in row["cells"]:
            source = "\n".join(_real(cell["release"]).lines("v1/core/block_pool.py"))
            value = FREE_RULE_VALUES[_free_rule(source)][column]
            assert cell["value"].split(":")[0] == value.split(":")[0], cell


def test_releases_between_the_free_queue_cells_agree_with_them_when_cached():
    # The releases the matrix does not list between two cells of equal value
    # (0.25.x; 0.30.0 to 0.32.0) were read too: each must ship the rule of the
    # cells around it. Only block_pool.py is fetched (tools.wheel_members), so
    # CI reads them all; elsewhere a release that cannot be read is skipped.
    m = versions.load_matrix()
    order = m["pypi_order"]
    off = next(r for r in m["rows"] if r["claim"].startswith("with prefix caching off"))
    cells = {c["release"]: c["value"] for c in off["cells"]}
    first, last = order.index(off["cells"][0]["release"]), order.index(off["cells"][-1]["release"])
    read = 0
    for i in range(first, last + 1):
        v = order[i]
        if v in cells:
            continue
        before = max((c for c in cells if order.index(c) < i), key=order.index)
        after = min((c for c in cells if order.index(c) > i), key=order.index)
        assert cells[before] == cells[after], f"{v} sits between cells that differ"
        found = versions.open_wheel(v, "manylinux_2_28_x86_64")
        try:
            if isinstance(found, str):
                raise wheel_members.MemberFetchError(found)
            source = "\n".join(found.lines("v1/core/block_pool.py"))
        except wheel_members.MemberFetchError:
            if os.environ.get("CI", "").lower() in ("true", "1"):
                raise
            continue
        rule = _free_rule(source)
        assert FREE_RULE_VALUES[rule][1].split(":")[0] == cells[before].split(":")[0], v
        read += 1
    if read == 0:
        pytest.skip("no wheel between the free-queue cells is cached")


def test_model_runner_v2_became_everyones_default_in_0_29_0():
    # Issue 43: chapters 4 and 5 teach Model Runner V2 and say since when it is
    # the default. Before 0.29.0 it was the default only for a list of
    # architectures (from 0.22.0) and then for dense models (from 0.25.0); the
    # matrix must name each change, and 0.29.0 as the first "yes".
    from pagedkv.views.operator import changed_in

    m = versions.load_matrix()
    (row,) = [r for r in m["rows"] if r["claim"].startswith("Model Runner V2 runs by default")]
    assert changed_in(row, m["pypi_order"]).split("; ")[-2:] == ["0.29.0", "0.32.0"]
    first_yes = next(c["release"] for c in row["cells"] if c["value"].startswith("yes"))
    assert first_yes == "0.29.0"
    assert row["cells"][0]["value"].startswith("no")


# ------------------------------------------- upgrades from 0.10.x: log lines and metric names

_TEMPLATE = re.compile(r'(?:logger\.\w+\(|msg = \()\s*((?:f?"(?:[^"\\]|\\.)*"\s*)+)')


def _rendered_lines(lines: list[str], first: int, last: int, around: int = 15) -> list[str]:
    """The log lines a release's source prints near ``first``-``last``: each
    ``logger.x(`` call's (or ``msg = (``'s) adjacent string literals joined, as
    Python joins them, with every %-field and f-string field given a number."""
    text = "\n".join(lines[max(0, first - 1 - around):last + around])
    out = []
    for run in _TEMPLATE.finditer(text):
        line = "".join(re.findall(r'f?"((?:[^"\\]|\\.)*)"', run.group(1)))
        line = re.sub(r"%[-0-9.]*[sd]", "1,024", line)
        line = re.sub(r"%[-0-9.]*f", "2.50", line)
        out.append(re.sub(r"\{[^{}]*\}", "2.5", line))
    return out


def _row(m: dict, start: str) -> dict:
    (row,) = [r for r in m["rows"] if r["claim"].startswith(start)]
    return row


POOL_LINE = "Available KV cache memory: 1.00 GiB"  # read_startup_log needs the pool's line


def test_each_releases_startup_lines_are_read_as_the_matrix_says():
    # Issue 46 (upgrades from 0.10.x): the page's reader (pagedkv.server_log)
    # must find the sizing figures in every release's wording, and where it
    # cannot the matrix must say so ("not read by the page"). Each cell's
    # lines are rendered from that release's own source.
    from pagedkv.server_log import read_startup_log

    m = versions.load_matrix()

    def rendered(cell):
        return _rendered_lines(_real(cell["release"]).lines(cell["path"]), cell["first"], cell["last"])

    kv = _row(m, "'KV cache size: N tokens'")
    assert [c["release"] for c in kv["cells"]][:1] == ["0.10.0"]
    for cell in kv["cells"]:
        printed = [line for line in rendered(cell) if "KV cache size:" in line or "Maximum concurrency" in line]
        one_line = any("KV cache size:" in line and "Maximum concurrency" in line for line in printed)
        assert one_line == cell["value"].startswith("one line"), (cell["release"], printed)
        log = read_startup_log("\n".join(printed + [POOL_LINE]))
        assert log.kv_cache_tokens == 1024 and log.max_concurrency == 2.5, (cell["release"], printed)
    for cell in _row(m, "'Available KV cache memory")["cells"]:
        (line,) = [x for x in rendered(cell) if "Available KV cache memory" in x]
        assert read_startup_log(line).available_kv_gib is not None, line
    for cell in _row(m, "'Model loading took")["cells"]:
        (line,) = [x for x in rendered(cell) if "Model loading took" in x]
        assert ("GiB memory and" in line) == ("GiB memory and" in cell["value"]), line
        assert read_startup_log("\n".join([line, POOL_LINE])).model_loading_gib is not None, line
    usage = _row(m, "the 'Actual usage is ...'")
    assert [c["release"] for c in usage["cells"]][:2] == ["0.10.1.1", "0.10.2"]
    for cell in usage["cells"]:
        printed = [x for x in rendered(cell) if "Actual usage is" in x]
        if cell["value"] == "absent":
            assert printed == [] and "Actual usage is" not in "\n".join(_real(cell["release"]).lines(cell["path"]))
            continue
        (line,) = printed
        log = read_startup_log("\n".join([line, POOL_LINE]))
        assert (log.consumed_gib is None) == ("not read by the page" in cell["value"]), (cell["release"], line)
        assert log.free_gib is not None and log.gpu_memory_utilization == 2.5, line
        # Every figure is rendered 2.5: four of them add weights and non-torch into consumed.
        four = cell["value"].endswith("four figures")
        assert (log.weights_gib, log.non_torch_gib) == ((2.5, 2.5) if four else (None, None)), cell["release"]
        assert log.consumed_gib == (5.0 if four else 2.5) and log.activation_gib == log.cudagraph_gib == 2.5
    for cell in _row(m, "'CUDA graph pool memory")["cells"]:
        printed = [x for x in rendered(cell) if "CUDA graph pool memory" in x]
        assert bool(printed) == (cell["value"] == "present"), cell["release"]
        if printed:
            assert read_startup_log("\n".join(printed + [POOL_LINE])).cudagraph_estimate_gib is not None


def test_every_release_from_0_10_2_prints_a_usage_sentence_the_reader_reads_when_cached():
    # The matrix reads a few releases; pagedkv.server_log.USAGE_WORDINGS claims
    # a range each. Every release of pypi_order from 0.10.2 on whose
    # gpu_worker.py can be read must render a usage sentence that the wording
    # covering that release reads (CI reads them all; elsewhere a release that
    # cannot be read is skipped).
    from pagedkv.server_log import USAGE_WORDINGS, read_startup_log

    m = versions.load_matrix()
    order = m["pypi_order"]

    def covers(span, v):
        lo, hi = span.split("-")
        return order.index(lo) <= order.index(v) <= order.index(hi)

    read = []
    for v in order[order.index("0.10.2"):]:
        found = versions.open_wheel(v, m["platforms"][v])
        try:
            if isinstance(found, str):
                raise wheel_members.MemberFetchError(found)
            lines = found.lines("v1/worker/gpu_worker.py")
        except wheel_members.MemberFetchError:
            if os.environ.get("CI", "").lower() in ("true", "1"):
                raise
            continue
        at = next(i + 1 for i, line in enumerate(lines) if "Actual usage is" in line)
        (sentence,) = [x for x in _rendered_lines(lines, at, at) if "Actual usage is" in x]
        log = read_startup_log("\n".join([sentence, POOL_LINE]))
        assert covers(log.usage_releases, v), (v, log.usage_releases)
        assert [covers(w[0], v) for w in USAGE_WORDINGS].count(True) == 1, v
        read.append(v)
    if not read:
        pytest.skip("no release's gpu_worker.py from 0.10.2 on is cached")
    assert "0.33.0" in read


def _registered_metrics(wheel) -> set[str]:
    source = "\n".join(wheel.lines("v1/metrics/loggers.py"))
    return set(re.findall(r'name="(vllm:[a-z_]+)"', source))


def _book_metric_names() -> set[str]:
    """Every vllm:name the book's pages, chapters and library name (Prometheus'
    _total/_bucket/_sum/_count suffixes taken off; a name ending in "_" is a prefix)."""
    files = [*versions.ROOT.glob("book/*.ipynb"), *versions.ROOT.glob("book/*.md"),
             *versions.ROOT.glob("chapters/*.ipynb"),
             *(p for p in (versions.ROOT / "lib" / "pagedkv").rglob("*.py"))]
    names = set()
    for path in files:
        for name in re.findall(r"vllm:[a-z_]+", path.read_text(encoding="utf-8", errors="replace")):
            names.add(re.sub(r"_(total|bucket|sum|count)$", "", name))
    return names - {"vllm:"}


def test_every_metric_the_book_names_is_in_0_33_0_or_its_history_and_is_in_0_10_0_or_the_matrix():
    # A panel written from the book queries 0.33.0's names. An operator still on
    # 0.10.x (or upgrading from it) must find each name either in 0.10.0 too,
    # or in a row of the matrix that says when it came (or was renamed).
    m = versions.load_matrix()
    now = _registered_metrics(_real(citations.VLLM.version))
    then = _registered_metrics(_real("0.10.0"))
    said = "\n".join(json.dumps(row) for row in m["rows"])
    names = _book_metric_names()
    assert {"vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits", "vllm:num_preemptions"} <= names
    for name in sorted(names):
        if name.endswith("_"):  # a family, e.g. vllm:gpu_prefix_cache_*
            assert name in said, f"{name}* is named in the book but in no row of the matrix"
        elif name not in now:
            assert name in said, f"{name} is not registered in 0.33.0, and no row of the matrix says when it went"
        elif name not in then:
            assert name in said, f"{name} is not registered in 0.10.0, and no row of the matrix says when it came"
    # The renames of issue 46: both old names are in 0.10.0 beside the new ones, and gone in 0.33.0.
    for old, new in [("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
                     ("vllm:gpu_prefix_cache_queries", "vllm:prefix_cache_queries"),
                     ("vllm:gpu_prefix_cache_hits", "vllm:prefix_cache_hits")]:
        assert {old, new} <= then and old not in now and new in now, old


def _hidden_metrics(source_lines: list[str]) -> set[str]:
    """The metric names a release registers only under ``if self.show_hidden_metrics:``."""
    names = set()
    for i, line in enumerate(source_lines):
        if line.strip() == "if self.show_hidden_metrics:":
            indent = len(line) - len(line.lstrip())
            for body in source_lines[i + 1:]:
                if body.strip() and len(body) - len(body.lstrip()) <= indent:
                    break
                names.update(re.findall(r'name="(vllm:[a-z_]+)"', body))
    return names


def test_show_hidden_metrics_brings_back_what_the_matrix_says():
    # The flag's row lists, per release, the metrics registered only when it is
    # given; each cell is compared with the names under the flag's `if` blocks.
    m = versions.load_matrix()
    (row,) = [r for r in m["rows"] if "--show-hidden-metrics-for-version" in r["claim"]]
    assert row["cells"][0]["release"] == "0.10.0"
    for cell in row["cells"]:
        hidden = _hidden_metrics(_real(cell["release"]).lines("v1/metrics/loggers.py"))
        listed = cell["value"].split(":", 1)[1]
        said = set()
        for name in re.findall(r"vllm:[a-z_]+\*?", listed):
            said |= {h for h in hidden if h.startswith(name[:-1])} if name.endswith("*") else {name}
        assert said == hidden, (cell["release"], said, hidden)
        assert ("none" in listed) == (not hidden), cell["release"]


RENAMES_END = "0.15.0"  # the releases between cells are read up to here (after it, only the cells)
RENAMES = {  # the matrix's rename rows: the claim's start -> (old name, new name)
    "the KV usage gauge's name": ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
    "the prefix-cache counters' names": ("vllm:gpu_prefix_cache_queries", "vllm:prefix_cache_queries"),
    "the inter-token latency histogram's name": ("vllm:time_per_output_token_seconds",
                                                 "vllm:inter_token_latency_seconds"),
}


def _rename_state(wheel, old: str, new: str) -> str:
    """What a release's loggers.py does with a renamed metric: "old only", "both",
    "hidden" (the old name only under --show-hidden-metrics-for-version) or "new only"."""
    registered = _registered_metrics(wheel)
    if new not in registered:
        return "old only"
    if old not in registered:
        return "new only"
    return "hidden" if old in _hidden_metrics(wheel.lines("v1/metrics/loggers.py")) else "both"


def _says(value: str, old: str) -> str:
    """The state a cell's words name (see ``_rename_state``)."""
    if "only with --show-hidden-metrics-for-version" in value:
        return "hidden"
    if value.startswith("both"):
        return "both"
    return "old only" if value.startswith(old.removeprefix("vllm:")) else "new only"


def test_each_rename_cell_is_what_its_release_registers_and_so_are_the_releases_between():
    # Upgrades from 0.10.x: for the usage gauge, the prefix-cache counters and
    # the inter-token histogram, each cell's words (both names; the old one
    # hidden behind the flag, for the previous minor version only; the new one
    # only) are read from that release's registrations; and every release the
    # matrix does not list between two cells of one value (0.10.1,
    # 0.13.0, 0.14.0; not the long runs after 0.15.0, to keep the download
    # small) registers the same, when it can be read.
    m = versions.load_matrix()
    order, read = m["pypi_order"], 0
    for start, (old, new) in RENAMES.items():
        (row,) = [r for r in m["rows"] if r["claim"].startswith(start)]
        cells = {c["release"]: c for c in row["cells"]}
        for v, cell in cells.items():
            state = _rename_state(_real(v), old, new)
            assert _says(cell["value"], old) == state, (start, v, cell["value"], state)
            if state == "hidden":
                major, minor = v.split(".")[:2]
                assert f"--show-hidden-metrics-for-version={major}.{int(minor) - 1}" in cell["value"], (start, v)
        listed = sorted(cells, key=order.index)
        for before, after in zip(listed, listed[1:]):
            if (_says(cells[before]["value"], old) != _says(cells[after]["value"], old)
                    or order.index(after) > order.index(RENAMES_END)):
                continue
            for v in order[order.index(before) + 1:order.index(after)]:
                found = versions.open_wheel(v, m["platforms"][before])
                try:
                    if isinstance(found, str):
                        raise wheel_members.MemberFetchError(found)
                    state = _rename_state(found, old, new)
                except wheel_members.MemberFetchError:
                    if os.environ.get("CI", "").lower() in ("true", "1"):
                        raise
                    continue
                assert state == _says(cells[before]["value"], old), (start, v, state)
                read += 1
    assert read or not os.environ.get("CI"), "no release between the rename cells was read"
