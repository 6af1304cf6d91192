"""lightning_deepcee: pipeline training across cloud, edge and end devices for PyTorch Lightning.

Importing the package registers ``strategy="deepcee"`` in Lightning's StrategyRegistry.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_deepcee.callbacks import DynamicEnvironmentAdapter, PipelineThroughputMonitor
from lightning_deepcee.checkpoint import consolidate_checkpoint
from lightning_deepcee.runtime.liveness import DeviceLostError
from lightning_deepcee.runtime.stage import PipelineSpec
from lightning_deepcee.strategy import DeepCEEStrategy

__all__ = [
    "DeepCEEStrategy",
    "DeviceLostError",
    "DynamicEnvironmentAdapter",
    "PipelineSpec",
    "PipelineThroughputMonitor",
    "consolidate_checkpoint",
]
__version__ = "0.1.0"

DeepCEEStrategy.register_strategies(StrategyRegistry)
