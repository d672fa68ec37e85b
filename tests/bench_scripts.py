"""Load a ``benchmarks/`` script as a module, for the tests of its pure parts."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def bench_module(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (not through sys.path, where benchmarks/kernels.py would
    stand in for a package); registered as ``<name>_benchmark``, as its dataclasses need."""
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
