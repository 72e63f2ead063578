"""Benchmark scripts: ``python -m pagedkv.bench <name> [...]``.

Speed is measured here, never in tests. Each benchmark reports ratios taken in
one run (ours against a baseline on the same data), because absolute times on
shared machines drift between runs while ratios mostly do not.
"""
