"""Two-level device grouping: regions joined by fast links, then similar-speed devices inside.

This module owns DeepCEE's hierarchical clustering of devices (pure numpy/scipy):

1. **Network groups** (first level). Devices joined by fast links form a group; by default each
   group becomes one pipeline stage, so only activations cross the slow wide-area links.
2. **Compute groups** (second level). Inside each network group, devices of similar speed
   (capability within a factor) form a sub-group for asymmetric data parallelism.

How the first level measures "fast" (the why is in ``docs/profiler.md``):

- Each pair uses ``min(bw[i][j], bw[j][i])``: an asymmetric link counts by its slow direction,
  because a pipeline sends activations one way and gradients the other.
- Distances are log-ratios, so a 20% measurement error moves a distance by ~0.2 whatever the
  absolute speed. The distance of a link is how many times slower it is than the best link either
  endpoint has: ``d(i, j) = log(max(best_i, best_j) / bw_ij)`` with ``best_i`` the fastest link
  of device ``i``. Using each device's own best link (not the cluster-wide fastest) keeps a region
  with a slower LAN (WiFi at the end devices, 1 Gbit/s at the edge, 10 Gbit/s in the cloud)
  together.
- scipy ``linkage`` + ``fcluster(criterion="distance")`` cut at ``log(bandwidth_ratio_threshold)``.

The second level uses ``|log c_i - log c_j|`` cut at ``log(compute_ratio_threshold)``.

Output is deterministic: ranks sorted inside each group, groups sorted by their smallest rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.spatial.distance import pdist, squareform

from lightning_deepcee.profiler.data import ClusterProfile

__all__ = [
    "LINKAGE_METHODS",
    "DeviceGroups",
    "GroupingConfig",
    "group_by_compute",
    "group_by_network",
    "group_devices",
    "group_devices_from_arrays",
    "network_distances",
]

# Methods that work on an arbitrary dissimilarity matrix; centroid/median/ward assume Euclidean
# observations, which log-ratio distances are not.
LINKAGE_METHODS = ("average", "complete", "single", "weighted")

Groups = tuple[tuple[int, ...], ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupingConfig:
    """Thresholds of the two-level grouping. The defaults suit LAN vs WAN links with +-30% noise.

    See ``docs/profiler.md`` for a sensitivity study of ``bandwidth_ratio_threshold``.
    """

    bandwidth_ratio_threshold: float = 4.0
    """Two devices share a network group when their link is at most this many times slower than
    the best link either of them has (averaged over the groups by ``linkage``). 1 Gbit/s LAN vs
    <= 200 Mbit/s WAN is a factor >= 5; +-20% noise within a LAN is a factor <= 1.5. Raise it to
    merge more, lower it to split more."""
    compute_ratio_threshold: float = 1.5
    """Devices of one network group share a compute group when their capabilities differ by at
    most this factor (averaged over the groups by ``linkage``)."""
    linkage: str = "average"
    """scipy hierarchical-clustering method: one of ``LINKAGE_METHODS``. ``average`` is robust to
    a single noisy link; ``single`` chains groups through one fast link; ``complete`` splits on
    one slow link."""

    def __post_init__(self) -> None:
        for name in ("bandwidth_ratio_threshold", "compute_ratio_threshold"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 1.0
            ):
                raise ValueError(
                    f"{name}: expected a finite ratio > 1 (1 would merge only identical values), "
                    f"got {value!r}"
                )
            object.__setattr__(self, name, float(value))
        if self.linkage not in LINKAGE_METHODS:
            raise ValueError(
                f"linkage: expected one of {', '.join(LINKAGE_METHODS)}, got {self.linkage!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the settings."""
        return {
            "bandwidth_ratio_threshold": self.bandwidth_ratio_threshold,
            "compute_ratio_threshold": self.compute_ratio_threshold,
            "linkage": self.linkage,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GroupingConfig:
        """Inverse of :meth:`to_dict`; missing keys take their defaults, unknown keys are errors."""
        unknown = sorted(
            set(data) - {"bandwidth_ratio_threshold", "compute_ratio_threshold", "linkage"}
        )
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown field of GroupingConfig")
        return cls(**data)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceGroups:
    """The result of grouping: network groups, and the compute groups inside each of them."""

    network_groups: tuple[tuple[int, ...], ...]
    """First level: the ranks of each network group (devices joined by fast links)."""
    compute_groups: tuple[tuple[tuple[int, ...], ...], ...]
    """Second level: ``compute_groups[k]`` partitions ``network_groups[k]`` by device speed."""

    def __post_init__(self) -> None:
        network = _groups("network_groups", self.network_groups)
        seen: set[int] = set()
        for k, group in enumerate(network):
            repeated = seen.intersection(group)
            if repeated:
                raise ValueError(
                    f"network_groups[{k}]: expected each rank in one group only, got rank "
                    f"{min(repeated)} again"
                )
            seen.update(group)
        raw_compute = self.compute_groups
        if isinstance(raw_compute, (str, bytes)) or not isinstance(raw_compute, Sequence):
            raise ValueError(
                f"compute_groups: expected a list per network group, got {raw_compute!r}"
            )
        if len(raw_compute) != len(network):
            raise ValueError(
                f"compute_groups: expected {len(network)} entries (one per network group), "
                f"got {len(raw_compute)}"
            )
        compute = []
        for k, (members, subgroups) in enumerate(zip(network, raw_compute, strict=True)):
            parts = _groups(f"compute_groups[{k}]", subgroups)
            flat = sorted(rank for part in parts for rank in part)
            if flat != sorted(members):
                raise ValueError(
                    f"compute_groups[{k}]: expected a partition of network_groups[{k}] = "
                    f"{list(members)}, got {[list(p) for p in parts]}"
                )
            compute.append(parts)
        object.__setattr__(self, "network_groups", network)
        object.__setattr__(self, "compute_groups", tuple(compute))

    @property
    def num_network_groups(self) -> int:
        """Number of first-level groups."""
        return len(self.network_groups)

    @property
    def num_devices(self) -> int:
        """Number of ranks over all groups."""
        return sum(len(group) for group in self.network_groups)

    def network_group_of(self, rank: int) -> int:
        """Index of the network group holding ``rank``."""
        for index, group in enumerate(self.network_groups):
            if rank in group:
                return index
        raise ValueError(f"rank: expected one of the grouped ranks, got {rank!r}")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict with lists."""
        return {
            "network_groups": [list(group) for group in self.network_groups],
            "compute_groups": [[list(part) for part in parts] for parts in self.compute_groups],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceGroups:
        """Inverse of :meth:`to_dict`; unknown or missing fields are errors."""
        expected = {"network_groups", "compute_groups"}
        if not isinstance(data, Mapping):
            raise ValueError(f"DeviceGroups: expected a mapping, got {data!r}")
        for key in data:
            if key not in expected:
                raise ValueError(
                    f"{key}: unknown field of DeviceGroups (expected only: "
                    "network_groups, compute_groups)"
                )
        for key in sorted(expected):
            if key not in data:
                raise ValueError(f"{key}: missing required field of DeviceGroups")
        return cls(network_groups=data["network_groups"], compute_groups=data["compute_groups"])

    def format_table(self, profile: ClusterProfile | None = None) -> str:
        """One row per rank: its network group, compute group and (given a profile) the device."""
        header = ["network_group", "compute_group", "rank"]
        if profile is not None:
            header += ["host", "kind", "capability"]
        rows = [header]
        for k, parts in enumerate(self.compute_groups):
            for c, part in enumerate(parts):
                for rank in part:
                    row = [str(k), str(c), str(rank)]
                    if profile is not None and rank < profile.num_devices:
                        device = profile.devices[rank]
                        row += [device.host, device.kind, f"{device.capability:.4g}"]
                    rows.append(row)
        widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(header))]
        lines = [
            "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows
        ]
        lines.insert(1, "  ".join("-" * width for width in widths))
        return "\n".join(lines)


def _groups(name: str, value: object) -> Groups:
    """Validate a list of non-empty rank lists and sort nothing (order is the caller's)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"{name}: expected a non-empty list of rank lists, got {value!r}")
    result = []
    for index, group in enumerate(value):
        if isinstance(group, (str, bytes)) or not isinstance(group, Sequence) or not group:
            raise ValueError(f"{name}[{index}]: expected a non-empty list of ranks, got {group!r}")
        for rank in group:
            if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 0:
                raise ValueError(
                    f"{name}[{index}]: expected non-negative integer ranks, got {rank!r}"
                )
        if len(set(group)) != len(group):
            raise ValueError(f"{name}[{index}]: expected distinct ranks, got {list(group)!r}")
        result.append(tuple(int(rank) for rank in group))
    return tuple(result)


# --------------------------------------------------------------------------------------------
# Clustering
# --------------------------------------------------------------------------------------------


def _bandwidth_array(bandwidth_bytes_per_s: npt.ArrayLike) -> npt.NDArray[np.float64]:
    array = np.asarray(bandwidth_bytes_per_s, dtype=np.float64)
    if array.ndim != 2 or array.shape[0] != array.shape[1] or array.shape[0] == 0:
        raise ValueError(
            f"bandwidth_bytes_per_s: expected a non-empty square N x N matrix, got shape "
            f"{array.shape}"
        )
    off_diagonal = ~np.eye(array.shape[0], dtype=bool)
    bad = off_diagonal & ~(array > 0)  # catches NaN too
    if bad.any():
        i, j = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(
            f"bandwidth_bytes_per_s[{i}][{j}]: expected a positive bandwidth in bytes/s between "
            f"distinct devices, got {array[i, j]!r}"
        )
    return array


def network_distances(bandwidth_bytes_per_s: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """The first-level dissimilarity: ``d[i, j] = log(max(best_i, best_j) / min(bw_ij, bw_ji))``.

    ``best_i`` is device ``i``'s fastest (symmetrised) link. ``d = 0`` means the link is as good as
    anything its endpoints have; ``d = log(10)`` means ten times slower. Infinite bandwidth (same
    host) counts as the fastest finite link, so co-located processes do not make their LAN look
    slow. The diagonal is 0.
    """
    array = _bandwidth_array(bandwidth_bytes_per_s)
    size = array.shape[0]
    if size == 1:
        return np.zeros((1, 1))
    symmetric = np.minimum(array, array.T)
    off_diagonal = ~np.eye(size, dtype=bool)
    finite = symmetric[off_diagonal & np.isfinite(symmetric)]
    cap = float(finite.max()) if finite.size else 1.0
    with np.errstate(divide="ignore"):  # the diagonal (and a dead link) has 0 bytes/s: -inf
        log_bw = np.log(np.where(np.isinf(symmetric), cap, symmetric))
    np.fill_diagonal(log_bw, -np.inf)
    best = log_bw.max(axis=1)
    distance = np.maximum(best[:, None], best[None, :]) - log_bw
    np.fill_diagonal(distance, 0.0)
    return np.maximum(distance, 0.0)


def _cut(condensed: npt.NDArray[np.float64], ratio: float, method: str) -> npt.NDArray[np.int32]:
    """Flat cluster labels from a condensed distance vector, cut at ``log(ratio)``.

    Every method in :data:`LINKAGE_METHODS` merges at heights between the smallest and the
    largest pairwise distance, so when all distances lie below the cut (one cluster) or above
    it (singletons) the answer is known without building the tree.
    """
    cut = math.log(ratio)
    size = round((1 + math.sqrt(1 + 8 * condensed.size)) / 2)
    margin = 1e-9 * max(abs(cut), 1e-12)  # rounding in the tree's averaged heights
    if condensed.size and float(condensed.max()) < cut - margin:
        return np.ones(size, dtype=np.int32)
    if condensed.size and float(condensed.min()) > cut + margin:
        return np.arange(1, size + 1, dtype=np.int32)
    tree = linkage(condensed, method=method)
    return np.asarray(fcluster(tree, t=cut, criterion="distance"), dtype=np.int32)


def _canonical(labels: Sequence[int], members: Sequence[int]) -> Groups:
    by_label: dict[int, list[int]] = {}
    for label, rank in zip(labels, members, strict=True):
        by_label.setdefault(int(label), []).append(int(rank))
    return tuple(sorted((tuple(sorted(group)) for group in by_label.values()), key=min))


def group_by_network(
    bandwidth_bytes_per_s: npt.ArrayLike, config: GroupingConfig | None = None
) -> Groups:
    """First level: ranks grouped by fast links, from an N x N bandwidth matrix (bytes/s).

    ``bandwidth_bytes_per_s[i][j]`` is the throughput from rank ``i`` to rank ``j``; the diagonal
    is ignored. See :func:`network_distances` for the distance.
    """
    config = config or GroupingConfig()
    distance = network_distances(bandwidth_bytes_per_s)
    size = distance.shape[0]
    if size == 1:
        return ((0,),)
    condensed = squareform(distance, checks=False)
    labels = _cut(condensed, config.bandwidth_ratio_threshold, config.linkage)
    return _canonical(labels.tolist(), range(size))


def group_by_compute(
    capabilities: npt.ArrayLike,
    members: Sequence[int] | None = None,
    config: GroupingConfig | None = None,
) -> Groups:
    """Second level: ``members`` (default: all ranks) grouped by similar capability.

    ``capabilities`` is indexed by rank (higher is faster); only ``members`` are grouped.
    """
    config = config or GroupingConfig()
    values = np.asarray(capabilities, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"capabilities: expected a non-empty 1-D array, got shape {values.shape}")
    ranks = list(range(values.size)) if members is None else [int(rank) for rank in members]
    if not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"members: expected a non-empty list of distinct ranks, got {ranks!r}")
    for rank in ranks:
        if not 0 <= rank < values.size:
            raise ValueError(f"members: expected ranks in 0..{values.size - 1}, got {rank}")
        if not (math.isfinite(values[rank]) and values[rank] > 0):
            raise ValueError(
                f"capabilities[{rank}]: expected a positive finite score, got {values[rank]!r}"
            )
    if len(ranks) == 1:
        return ((ranks[0],),)
    log_capability = np.log(values[ranks]).reshape(-1, 1)
    labels = _cut(pdist(log_capability), config.compute_ratio_threshold, config.linkage)
    return _canonical(labels.tolist(), ranks)


def group_devices_from_arrays(
    bandwidth_bytes_per_s: npt.ArrayLike,
    capabilities: npt.ArrayLike,
    config: GroupingConfig | None = None,
) -> DeviceGroups:
    """Both levels from plain arrays: an N x N bandwidth matrix and N capability scores."""
    config = config or GroupingConfig()
    values = np.asarray(capabilities, dtype=np.float64)
    size = np.asarray(bandwidth_bytes_per_s).shape[0] if np.ndim(bandwidth_bytes_per_s) else 0
    if values.shape != (size,):
        raise ValueError(
            f"capabilities: expected {size} scores (one per row of the bandwidth matrix), got "
            f"shape {values.shape}"
        )
    network = group_by_network(bandwidth_bytes_per_s, config)
    compute = tuple(group_by_compute(values, group, config) for group in network)
    return DeviceGroups(network_groups=network, compute_groups=compute)


def group_devices(profile: ClusterProfile, config: GroupingConfig | None = None) -> DeviceGroups:
    """Both levels for a measured or hand-written :class:`ClusterProfile`."""
    return group_devices_from_arrays(
        profile.bandwidth_matrix(), profile.capability_vector(), config
    )
