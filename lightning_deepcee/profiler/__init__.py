"""Profiler: what the cluster can do, and which devices belong together.

The pure core lives here: profile data types (:mod:`.device`, :mod:`.cluster`, :mod:`.cache`,
gathered in :mod:`.data`), the schema loader every YAML file of the project goes through
(:mod:`.schema`) and two-level device grouping (:mod:`.grouping`). None imports torch or
lightning, so planning from a saved or hand-written profile works anywhere. Measurement, which
needs torch, lives in the runtime.
"""

from __future__ import annotations

from lightning_deepcee.profiler.data import (
    ClusterProfile,
    DeviceProfile,
    ProfileCacheWarning,
    capability_score,
    fingerprint,
    fingerprint_cluster,
    load_cached_profile,
)
from lightning_deepcee.profiler.grouping import (
    LINKAGE_METHODS,
    DeviceGroups,
    GroupingConfig,
    group_by_compute,
    group_by_network,
    group_devices,
    group_devices_from_arrays,
    network_distances,
)

__all__ = [
    "LINKAGE_METHODS",
    "ClusterProfile",
    "DeviceGroups",
    "DeviceProfile",
    "GroupingConfig",
    "ProfileCacheWarning",
    "capability_score",
    "fingerprint",
    "fingerprint_cluster",
    "group_by_compute",
    "group_by_network",
    "group_devices",
    "group_devices_from_arrays",
    "load_cached_profile",
    "network_distances",
]
