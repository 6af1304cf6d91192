"""Profile data types: what the profiler measured about each device and each link.

The plain, typed, serialisable records that flow from measurement to planning, gathered in one
import (each lives in its own module):

- :class:`DeviceProfile` (:mod:`.device`): one device's memory, per-block compute times and a
  capability score (:func:`capability_score`, DeepCEE's ``pc = sum_i w_i/t_i``).
- :class:`ClusterProfile` (:mod:`.cluster`): all devices plus the latency and bandwidth of every
  ordered device pair, with YAML/JSON round trips checked by :mod:`.schema`.
- :func:`fingerprint`, :func:`fingerprint_cluster`, :func:`load_cached_profile` (:mod:`.cache`):
  reuse a saved profile only when it was measured for this model and device set.

Pure: numpy, pyyaml, omegaconf and the standard library (no torch, no lightning). Errors read
``<key>: expected <what>, got <value>``, e.g.
``devices[2].memory_bytes: expected a non-negative integer, got -5``.
"""

from __future__ import annotations

from lightning_deepcee.profiler.cache import (
    ProfileCacheWarning,
    fingerprint,
    fingerprint_cluster,
    load_cached_profile,
)
from lightning_deepcee.profiler.cluster import ClusterProfile
from lightning_deepcee.profiler.device import DeviceProfile, capability_score

__all__ = [
    "ClusterProfile",
    "DeviceProfile",
    "ProfileCacheWarning",
    "capability_score",
    "fingerprint",
    "fingerprint_cluster",
    "load_cached_profile",
]
