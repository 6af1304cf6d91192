"""Register ``strategy="deepcee"`` with Lightning without importing Lightning.

``import lightning_deepcee`` must register the strategy name, yet ``import
lightning_deepcee.planner`` (which runs the package ``__init__`` too) must not load Lightning or
torch.distributed. So the registration waits for Lightning: if ``lightning.pytorch.strategies``
is already imported it registers now; otherwise a meta-path finder registers right after that
module has run (before any ``Trainer`` can look the name up). The registry entry is a factory
that imports the strategy on first use.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

__all__ = ["STRATEGIES_MODULE", "register_when_lightning_loads"]

STRATEGIES_MODULE = "lightning.pytorch.strategies"
NAME = "deepcee"


def _make_strategy(**kwargs: Any) -> Any:
    """What ``StrategyRegistry.get("deepcee")`` calls: the strategy, imported on first use."""
    from lightning_deepcee.strategy.deepcee import DeepCEEStrategy

    return DeepCEEStrategy(**kwargs)


def _register(strategies: ModuleType) -> None:
    registry = strategies.StrategyRegistry
    if NAME not in registry:
        registry.register(NAME, _make_strategy, description="DeepCEE pipeline strategy")


class _RegisterAfterExec(importlib.abc.Loader):
    """Wraps Lightning's loader of the strategies module: run it, then register."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _register(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``lightning.pytorch.strategies`` with the other finders and wraps its loader."""

    def find_spec(
        self, fullname: str, path: Any, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != STRATEGIES_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _RegisterAfterExec(spec.loader)
                return spec
        return None


def register_when_lightning_loads() -> None:
    """Register now if Lightning's strategies are loaded, else as soon as they load (once)."""
    loaded = sys.modules.get(STRATEGIES_MODULE)
    if loaded is not None and hasattr(loaded, "StrategyRegistry"):
        _register(loaded)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
