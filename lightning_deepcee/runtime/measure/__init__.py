"""Measurement: time the model's blocks on this device and every link between devices.

This package owns the benchmarks behind a :class:`~lightning_deepcee.profiler.ClusterProfile`
(the pure data types live in ``profiler/data.py``; this is the torch side):

- :func:`measure_blocks` (``blocks.py``, passes in ``passes.py``): forward, input-gradient
  (``B``) and weight-gradient (``W``) seconds of each block, split exactly like the executor
  splits them, plus output, saved-for-backward, transient and parameter bytes.
- :class:`SavedTensorsMeter` (``saved.py``): bytes held by the tensors autograd saves for
  backward, and their peak (what a stage keeps per micro-batch in flight).
- :func:`available_memory_bytes` (``memory.py``): memory this process may still use on a device.
- :func:`measure_network` (``network.py``): latency and bandwidth of every ordered pair of ranks.
- :func:`profile_cluster` (``cluster.py``) / :func:`profile_or_load` (``cache.py``): all of the
  above on every rank, gathered into one ``ClusterProfile`` that every rank holds (and cached on
  disk by rank 0).

Runtime layer: torch and torch.distributed, never lightning.
"""

from lightning_deepcee.runtime.measure.blocks import BlockTimings, measure_blocks
from lightning_deepcee.runtime.measure.cache import profile_or_load
from lightning_deepcee.runtime.measure.cluster import (
    DEVICE_KIND_ENV,
    device_identity,
    model_fingerprint,
    profile_cluster,
)
from lightning_deepcee.runtime.measure.memory import available_memory_bytes
from lightning_deepcee.runtime.measure.network import (
    NetworkMeasurement,
    ProfilingTimeoutError,
    measure_network,
    round_robin_rounds,
)
from lightning_deepcee.runtime.measure.saved import SavedTensorsMeter

__all__ = [
    "DEVICE_KIND_ENV",
    "BlockTimings",
    "NetworkMeasurement",
    "ProfilingTimeoutError",
    "SavedTensorsMeter",
    "available_memory_bytes",
    "device_identity",
    "measure_blocks",
    "measure_network",
    "model_fingerprint",
    "profile_cluster",
    "profile_or_load",
    "round_robin_rounds",
]
