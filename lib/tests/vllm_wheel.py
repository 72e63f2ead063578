"""The release wheels for the differential tests that execute vLLM's or SGLang's own code from them.

Not a test module: the differential tests import ``vllm_wheel()`` or
``sglang_wheel()``, and the ones that build a package of stubbed modules use
``stub_modules`` and ``exec_from_wheel``. A wheel comes from
``tools.citations``' cache (downloaded once); without it a test skips, except
under ``CI=true``, where a skip would let the differential pass unseen.
"""

import os
import sys
import types
import zipfile

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _release_wheel(which: str, label: str):
    """The path of the wheel ``tools.citations`` knows as ``which``, or a skip (a failure under CI)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from tools import citations

    path = citations.find_wheel(getattr(citations, which))
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the {label} wheel could not be fetched; the differential test would pass unseen")
        pytest.skip(f"the {label} wheel is not cached and cannot be downloaded")
    return path


def vllm_wheel():
    """The path of the vLLM 0.33.0 wheel, or a skip (a failure under CI)."""
    return _release_wheel("VLLM", "vLLM 0.33.0")


def sglang_wheel():
    """The path of the SGLang 0.5.23 wheel, or a skip (a failure under CI)."""
    return _release_wheel("SGLANG", "SGLang 0.5.23")


def stub_modules(monkeypatch, package: str):
    """Take every ``package`` module out of ``sys.modules`` (``monkeypatch`` puts them back when the
    test ends) and return ``stub(name, **attrs)``, which files an empty module, a package, under
    ``name`` holding ``attrs``."""
    for k in [k for k in sys.modules if k == package or k.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, k)

    def stub(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        m.__path__ = []
        monkeypatch.setitem(sys.modules, name, m)

    return stub


def exec_from_wheel(monkeypatch, wheel: zipfile.ZipFile, member: str, name: str, release: str):
    """Execute ``member`` of the open ``wheel`` as module ``name``, filed in ``sys.modules`` first
    (so its own imports of ``name`` find it); ``release`` labels its file (``"vllm-0.33.0"``)."""
    m = types.ModuleType(name)
    m.__file__ = f"{release}/{member}"
    monkeypatch.setitem(sys.modules, name, m)
    exec(compile(wheel.read(member), m.__file__, "exec"), m.__dict__)
    return m
