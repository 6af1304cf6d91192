"""Lightning callbacks, thin shims over the strategy and the pure adapter core.

- :class:`PipelineThroughputMonitor` (:mod:`~lightning_deepcee.callbacks.throughput`): samples/s,
  tokens/s and per-stage times, counted once per pipeline replica;
- :class:`DynamicEnvironmentAdapter` (:mod:`~lightning_deepcee.callbacks.adapter`): watches the
  links during training and re-splits or re-plans (:mod:`~lightning_deepcee.callbacks.replanner`);
- :class:`ElasticCheckpoint` (:mod:`~lightning_deepcee.callbacks.elastic_checkpoint`): checkpoints
  that an elastic restart resumes from by itself.
"""

from lightning_deepcee.callbacks.adapter import DynamicEnvironmentAdapter
from lightning_deepcee.callbacks.elastic_checkpoint import ElasticCheckpoint
from lightning_deepcee.callbacks.throughput import PipelineThroughputMonitor

__all__ = ["DynamicEnvironmentAdapter", "ElasticCheckpoint", "PipelineThroughputMonitor"]
