"""lightning_deepcee: pipeline training across cloud, edge and end devices for PyTorch Lightning.

Importing the package registers ``strategy="deepcee"`` in Lightning's StrategyRegistry (when
Lightning loads). The public names below are imported on first use, so that the pure core
(``lightning_deepcee.profiler``, ``.planner``, ``.schedule``, ``.adapter``) imports without
Lightning or torch.distributed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_deepcee._registry import register_when_lightning_loads
from lightning_deepcee._version import VERSION

if TYPE_CHECKING:
    from lightning_deepcee.callbacks.adapter import DynamicEnvironmentAdapter
    from lightning_deepcee.callbacks.elastic_checkpoint import ElasticCheckpoint
    from lightning_deepcee.callbacks.throughput import PipelineThroughputMonitor
    from lightning_deepcee.runtime.checkpoint import consolidate_checkpoint
    from lightning_deepcee.runtime.liveness import DeviceLostError, RankFailedError
    from lightning_deepcee.runtime.stage import PipelineSpec
    from lightning_deepcee.strategy.deepcee import DeepCEEStrategy

__all__ = [
    "DeepCEEStrategy",
    "DeviceLostError",
    "DynamicEnvironmentAdapter",
    "ElasticCheckpoint",
    "PipelineSpec",
    "PipelineThroughputMonitor",
    "RankFailedError",
    "consolidate_checkpoint",
]
__version__ = VERSION

_WHERE = {
    "DeepCEEStrategy": "lightning_deepcee.strategy",
    "DeviceLostError": "lightning_deepcee.runtime.liveness",
    "DynamicEnvironmentAdapter": "lightning_deepcee.callbacks",
    "ElasticCheckpoint": "lightning_deepcee.callbacks",
    "PipelineSpec": "lightning_deepcee.runtime.stage",
    "PipelineThroughputMonitor": "lightning_deepcee.callbacks",
    "RankFailedError": "lightning_deepcee.runtime.liveness",
    "consolidate_checkpoint": "lightning_deepcee.runtime.checkpoint",
}


def __getattr__(name: str) -> Any:
    """Import a public name on first use (PEP 562)."""
    if name not in _WHERE:
        raise AttributeError(f"module 'lightning_deepcee' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


register_when_lightning_loads()
