"""Rehearse a bare GPU machine on a full one: the modules named in GPU_CHECK_HIDE
fail to import, as if not installed (.ci/gpu-check.sh puts this folder on
PYTHONPATH when the variable is set).

``import NAME`` raises ``No module named 'NAME'``; ``importlib.util.find_spec``
finds a plain module with no files, so code that only locates a package (the
SmolLM2 model file) finds nothing either.
"""

import importlib.abc
import importlib.machinery
import os
import sys

HIDDEN = set(os.environ.get("GPU_CHECK_HIDE", "").split())


class _Missing(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r}", name=spec.name)

    def exec_module(self, module):  # never reached
        raise ModuleNotFoundError(f"No module named {module.__name__!r}")


if HIDDEN:
    sys.meta_path.insert(0, _Missing())
