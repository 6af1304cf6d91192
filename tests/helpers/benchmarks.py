"""A script under benchmarks/ loaded as a module (benchmarks/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.helpers.paths import BENCHMARKS


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``name``, loaded once per process.

    benchmarks/ goes on ``sys.path`` (the benchmarks import each other), and the module is in
    ``sys.modules`` before it runs (its dataclasses look their module up while being defined)."""
    if name in sys.modules:
        return sys.modules[name]
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
