"""The fuzz harness itself (tools/fuzz/contract.py, targets.py, __main__.py): it catches what it must."""

from __future__ import annotations

import time

import pytest

from tools.fuzz import targets
from tools.fuzz.__main__ import summarize
from tools.fuzz.contract import Violation, attempt, no_exception, timed, wall_clock_alarm


def test_attempt_passes_results_and_named_errors():
    assert attempt(lambda: 7, "x") == 7

    def named():
        raise ValueError("model.gguf: bad")

    assert attempt(named, "model.gguf") is None


@pytest.mark.parametrize("error", [KeyError("k"), MemoryError(), RecursionError(), RuntimeError("alloc"),
                                   ValueError("no name here"), TypeError("nor here")])
def test_attempt_turns_every_other_outcome_into_a_violation(error):
    def fail():
        raise error

    with pytest.raises(Violation) as info:
        attempt(fail, "model.gguf")
    assert info.value.__cause__ is error


def test_no_exception_means_none():
    with pytest.raises(Violation, match="using it raised ZeroDivisionError"):
        with no_exception("using it"):
            1 / 0


def test_timed_measures_cpu_time_against_the_limit():
    def burn(data):
        start = time.process_time()
        while time.process_time() - start < 0.05:
            pass

    with pytest.raises(Violation, match="of CPU time"):
        timed(burn, b"", limit_s=0.01)
    assert timed(lambda data: None, b"", limit_s=0.01) < 0.01


def test_the_wall_clock_alarm_stops_a_hang():
    with pytest.raises(Violation, match="wall-clock"):
        with wall_clock_alarm(0.05):
            time.sleep(5)


def test_a_target_reports_what_escapes_the_library(monkeypatch):
    import pagedkv.model

    def broken(path):
        raise KeyError("general.alignment")

    monkeypatch.setattr(pagedkv.model, "read_gguf", broken)
    with pytest.raises(Violation, match="KeyError escaped"):
        targets.fuzz_gguf(b"GGUF")


def test_summary_lines_read_libfuzzer_output():
    log = ("#2048\tpulse  cov: 10 ft: 20 corp: 5/1Kb lim: 4 exec/s: 9 rss: 1Mb\n"
           "#4000\tDONE   cov: 12 ft: 25 corp: 6/2Kb lim: 4 exec/s: 9 rss: 1Mb\n"
           "stat::number_of_executed_units: 4000\n")
    ok, line = summarize("gguf", log, 0, 10.2)
    assert ok and line == "gguf: 4,000 executions in 10 s, coverage 12 edges, 25 features, corpus 6 inputs; no violation"
    ok, line = summarize("gguf", log + "Violation: KeyError escaped: 'x'\nTest unit written to ./crash-1\n", 1, 3)
    assert not ok and "VIOLATION after 4,000 executions (Violation: KeyError escaped: 'x'); input: ./crash-1" in line
    ok, line = summarize("gguf", "VIOLATION escaped KeyError at a.py:1: KeyError escaped\n" + log, 0, 10)
    assert not ok and "1 kinds of violation: escaped KeyError at a.py:1" in line
