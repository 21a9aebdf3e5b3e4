"""Modules of the repository's tests/ that benchmarks reuse (fixtures, helpers, local services), loaded
from their files: tests/ is no package, and an installed package named `tests` shadows the folder."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_test_module(relpath: str):
    """The module at `relpath` under the repository, registered under its dotted path once, so that a
    test module another imports by that name (`tests.ops.conftest`) is found when loaded first."""
    name = relpath.removesuffix(".py").replace("/", ".")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / relpath)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
