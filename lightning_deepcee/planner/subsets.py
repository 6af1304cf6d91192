"""Which devices to use: the device subsets the search considers, and plans on a subset.

A slow device, or a region behind a slow WAN link, can make every plan that uses it slower than
a plan that leaves it out: its stage, or the transfers to it, hold the pipeline back, or its
share of an all-reduce crosses the slow link. :func:`candidate_subsets` lists the subsets worth
a search, from the two-level grouping:

- every device;
- network groups dropped whole: every non-empty proper subset of the network groups when there
  are at most ``_ALL_COMBINATIONS`` of them, else each group alone and the fastest ``k`` groups;
- compute groups dropped: in each kept set, its slowest compute groups, one after another;
- the slowest devices of each kept set dropped, one after another (in steps for large sets);

each a candidate only if it holds at least ``min_devices`` devices. :func:`compute_bound_s`
bounds what a subset can reach, so the search skips subsets that cannot win. :func:`restrict`
gives the profile of a subset (ranks renumbered ``0..k-1``); :func:`lift` turns a plan made on
it back into a plan of the whole cluster whose other ranks are ``idle_ranks``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from lightning_deepcee.planner.plan import Plan, StagePlan
from lightning_deepcee.profiler.data import ClusterProfile
from lightning_deepcee.profiler.grouping import DeviceGroups

__all__ = [
    "SubsetProfiles",
    "candidate_subsets",
    "compute_bound_s",
    "lift",
    "restrict",
    "sample_rates",
]

_ALL_COMBINATIONS = 4
"""Up to this many network groups every combination of them is a candidate (at most 15)."""
_ALL_DROPS = 8
"""Up to this many devices in a kept set, every number of its slowest devices is dropped."""


def _speed(profile: ClusterProfile, rank: int) -> float:
    """Samples per second of one device on the whole model (F+B+W of every block)."""
    total = sum(profile.devices[rank].block_seconds)
    return 1.0 / total if total > 0 else float("inf")


def candidate_subsets(
    profile: ClusterProfile, groups: DeviceGroups, *, min_devices: int = 1
) -> list[tuple[int, ...]]:
    """Device subsets worth a search (sorted rank tuples, all devices first, no repeats)."""
    everyone = tuple(range(profile.num_devices))
    device_speed = [_speed(profile, r) for r in everyone]
    network = [tuple(sorted(g)) for g in groups.network_groups]
    speed = {k: sum(device_speed[r] for r in g) for k, g in enumerate(network)}
    if len(network) <= _ALL_COMBINATIONS:
        kept_sets = [
            combo
            for size in range(len(network), 0, -1)
            for combo in itertools.combinations(range(len(network)), size)
        ]
    else:
        by_speed = sorted(range(len(network)), key=lambda k: -speed[k])
        kept_sets = [tuple(range(len(network)))]
        kept_sets += [tuple(sorted(by_speed[:k])) for k in range(len(network) - 1, 0, -1)]
        kept_sets += [(k,) for k in range(len(network))]
    found: list[tuple[int, ...]] = [everyone]
    for kept in kept_sets:
        ranks = sorted(r for k in kept for r in network[k])
        found.append(tuple(ranks))
        # Then the slowest compute groups of the kept set, one after another.
        compute = sorted(
            (tuple(c) for k in kept for c in groups.compute_groups[k]),
            key=lambda c: sum(device_speed[r] for r in c) / len(c),
        )
        dropped: set[int] = set()
        for slowest in compute[:-1]:
            dropped.update(slowest)
            found.append(tuple(r for r in ranks if r not in dropped))
        # And its slowest devices, however they are grouped.
        by_speed = sorted(ranks, key=device_speed.__getitem__)
        for k in _drop_counts(len(ranks)):
            slow = set(by_speed[:k])
            found.append(tuple(r for r in ranks if r not in slow))
    seen: set[tuple[int, ...]] = set()
    unique: list[tuple[int, ...]] = []
    for subset in found:
        if len(subset) >= min_devices and subset not in seen:
            seen.add(subset)
            unique.append(subset)
    return unique


def sample_rates(profile: ClusterProfile) -> npt.NDArray[np.float64]:
    """Samples per second of each device on the whole model, fixed per-call costs left out
    (``inf`` for a device whose measured time is all fixed cost)."""
    rates = np.empty(profile.num_devices)
    for r, device in enumerate(profile.devices):
        variable = sum(device.block_seconds) - sum(device.fixed_s)
        rates[r] = device.reference_microbatch_size / variable if variable > 0 else np.inf
    return rates


def compute_bound_s(
    rates: npt.NDArray[np.float64], ranks: Sequence[int], global_batch_size: int
) -> float:
    """A lower bound on any plan's step on ``ranks``: the batch's per-sample compute spread over
    their summed speed (``rates`` from :func:`sample_rates`), with no fixed cost, bubble,
    transfer or optimizer step. A subset whose bound is above a plan already found cannot
    beat it. It is 0 when a device measured no per-sample compute (an infinite rate)."""
    return float(global_batch_size / rates[np.asarray(ranks)].sum())


def _drop_counts(n: int) -> list[int]:
    """How many of ``n`` devices to leave out, slowest first: each count up to 8 devices,
    then an eighth, a quarter, a half and three quarters."""
    if n <= _ALL_DROPS:
        return list(range(1, n))
    return sorted({max(1, n // 8), n // 4, n // 2, 3 * n // 4})


def restrict(profile: ClusterProfile, ranks: Sequence[int]) -> ClusterProfile:
    """The profile of ``ranks`` alone, renumbered ``0..len(ranks)-1`` in the given order.

    The fingerprints stay the whole cluster's: a plan made on the subset is lifted back onto it.
    """
    return profile.subset(ranks)


class SubsetProfiles:
    """:func:`restrict` for many subsets of one profile, each built once: the link matrices
    are converted to arrays once for all of them."""

    def __init__(self, profile: ClusterProfile) -> None:
        self.profile = profile
        self._matrices = (profile.latency_matrix(), profile.bandwidth_matrix())
        self._built: dict[tuple[int, ...], ClusterProfile] = {}

    def __call__(self, ranks: Sequence[int]) -> ClusterProfile:
        """The profile of ``ranks`` alone (see :func:`restrict`)."""
        key = tuple(ranks)
        if key not in self._built:
            self._built[key] = self.profile.subset(key, self._matrices)
        return self._built[key]


def lift(plan: Plan, ranks: Sequence[int], world_size: int, notes: str | None = None) -> Plan:
    """A plan made on ``restrict(profile, ranks)`` as a plan of the whole cluster: its ranks
    mapped back, every other rank idle."""
    ranks = list(ranks)
    stages = tuple(
        StagePlan(
            block_range=st.block_range,
            ranks=tuple(ranks[r] for r in st.ranks),
            batch_shares=st.batch_shares,
        )
        for st in plan.stages
    )
    used = {r for st in stages for r in st.ranks}
    return dataclasses.replace(
        plan,
        stages=stages,
        predicted_peak_memory_bytes={
            ranks[r]: v for r, v in plan.predicted_peak_memory_bytes.items()
        },
        idle_ranks=tuple(r for r in range(world_size) if r not in used),
        notes=plan.notes if notes is None else notes,
    )
