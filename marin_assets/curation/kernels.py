"""The compiled curation kernels, and which implementation ran.

Three C modules (``_langid``, ``_minhash``, ``_textstats``) are built on install where a C compiler
is found; they are optional ext-modules in pyproject.toml, so an install without a compiler still
works. Each has a numpy twin that defines its output, which the tests compare it against, so the
only difference is speed (2-5x). The fallback is not silent: the first time a process runs a numpy
twin for want of a kernel it logs one warning naming the missing kernels, and the `filtered/` stage
records ``kernel: compiled|numpy`` in its manifest's metrics. Metrics describe a build; they never
enter an identity or a data version (the content hash of the files), so both builds of a shard
have the same data version.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

COMPILED, NUMPY = "compiled", "numpy"
_log = logging.getLogger(__name__)


def _load(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError:  # not built: no C compiler at install
        return None


# name -> the built module, None where it was not built (tests set an entry to None for the numpy twin).
MODULES: dict[str, ModuleType | None] = {name: _load(name) for name in ("_langid", "_minhash", "_textstats")}
_warned = False


def kernel(name: str) -> ModuleType | None:
    """The compiled kernel ``name``, or None where it is not built and the caller runs its numpy
    twin; the first None of a process logs one warning."""
    module = MODULES[name]
    if module is None:
        _warn_once()
    return module


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        missing = ", ".join(f"{__package__}.{n}" for n, m in sorted(MODULES.items()) if m is None)
        _log.warning("compiled curation kernel(s) %s not built (no C compiler at install?): their numpy twins run "
                     "instead, with the same output, 2-5x slower. Install a C compiler and reinstall "
                     "(uv sync --reinstall-package marin-dagster) to build them.", missing)


def implementation() -> str:
    """``compiled`` where every curation kernel is built in this process, else ``numpy``."""
    return COMPILED if all(MODULES.values()) else NUMPY
