"""The planner chooses its devices: subsets, idle ranks, and an exhaustive check.

``plan_search`` searches the device subsets of ``candidate_subsets`` and leaves out the devices
whose every use is predicted slower. Checked here: a slow WAN keeps the fast zone alone, a fast
WAN uses both zones, and on small random clusters the search is within 5% of an exhaustive
search over every subset and layout under the same cost model.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator

import numpy as np
import pytest

from lightning_deepcee.planner import Plan
from lightning_deepcee.planner.search import make_plan, plan_search
from lightning_deepcee.planner.subsets import SubsetProfiles, candidate_subsets, lift, restrict
from lightning_deepcee.profiler.data import ClusterProfile
from lightning_deepcee.profiler.grouping import group_devices
from tests.helpers.clusters import make_profile, random_profile, two_zones


def test_a_slow_wan_keeps_the_fast_zone_alone() -> None:
    plan = plan_search(two_zones(1e6), num_blocks=8, global_batch_size=32)
    assert set(plan.ranks) <= {0, 1}, plan.format_table()
    assert plan.idle_ranks == (2, 3, 4, 5)
    everyone = plan_search(two_zones(1e6), num_blocks=8, global_batch_size=32, choose_devices=False)
    assert plan.predicted_step_time_s < everyone.predicted_step_time_s
    assert "idle" in plan.notes and "with every device" in plan.notes
    plan.check_matches(8, 6, "model", "cluster")  # names all six ranks
    assert Plan.from_dict(plan.to_dict()) == plan


def test_a_fast_wan_uses_both_zones() -> None:
    plan = plan_search(two_zones(1e10), num_blocks=8, global_batch_size=32)
    assert set(plan.ranks) & {0, 1} and set(plan.ranks) & {2, 3, 4, 5}, plan.format_table()


@pytest.mark.parametrize("wan", [1e6, 1e7, 3e7, 1e10])
@pytest.mark.parametrize("gain", [0.05, 0.2])
def test_device_gain_prefers_fewer_devices_within_the_gain(wan: float, gain: float) -> None:
    fastest = plan_search(two_zones(wan), num_blocks=8, global_batch_size=32, device_gain=0.0)
    plan = plan_search(two_zones(wan), num_blocks=8, global_batch_size=32, device_gain=gain)
    assert plan.predicted_step_time_s <= (1 + gain) * fastest.predicted_step_time_s
    assert len(plan.ranks) <= len(fastest.ranks)
    if len(plan.ranks) < len(fastest.ranks):
        assert "device_gain" in plan.notes, plan.notes


def test_a_large_device_gain_keeps_the_fast_zone() -> None:
    # At 10 MB/s both zones are fastest, by less than 20%: a gain of 0.2 keeps zone A alone.
    fastest = plan_search(two_zones(1e7), num_blocks=8, global_batch_size=32, device_gain=0.0)
    plan = plan_search(two_zones(1e7), num_blocks=8, global_batch_size=32, device_gain=0.2)
    assert set(fastest.ranks) & {2, 3, 4, 5}
    assert plan.ranks == (0, 1), plan.format_table()
    assert fastest.predicted_step_time_s < plan.predicted_step_time_s
    assert "device_gain" in plan.notes, plan.notes
    with pytest.raises(ValueError, match="device_gain"):
        plan_search(two_zones(1e10), num_blocks=8, global_batch_size=32, device_gain=1.0)


def test_candidate_subsets_drop_groups_and_slow_devices() -> None:
    profile = two_zones(1e6)
    subsets = candidate_subsets(profile, group_devices(profile))
    assert subsets[0] == (0, 1, 2, 3, 4, 5)
    assert (0, 1) in subsets and (2, 3, 4, 5) in subsets
    assert len(subsets) == len(set(subsets))


def test_restrict_and_lift_round_trip() -> None:
    profile = two_zones(1e6)
    sub = restrict(profile, (4, 1))
    assert sub.num_devices == 2 and sub.devices[0].forward_s == profile.devices[4].forward_s
    assert sub.bandwidth_bytes_per_s[0][1] == profile.bandwidth_bytes_per_s[4][1]
    plan = plan_search(sub, num_blocks=8, global_batch_size=8, choose_devices=False)
    lifted = lift(plan, (4, 1), 6)
    assert set(lifted.ranks) <= {1, 4} and set(lifted.idle_ranks) == {0, 2, 3, 5} - set()
    assert set(lifted.ranks) | set(lifted.idle_ranks) == set(range(6))


def _ordered_partitions(items: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], ...]]:
    """Every way to split ``items`` into ordered, non-empty stages."""
    if not items:
        yield ()
        return
    first, rest = items[0], items[1:]
    for smaller in _ordered_partitions(rest):
        for i in range(len(smaller)):  # join an existing stage
            yield (*smaller[:i], tuple(sorted((first, *smaller[i]))), *smaller[i + 1 :])
        for i in range(len(smaller) + 1):  # or start a new stage anywhere
            yield (*smaller[:i], (first,), *smaller[i:])


def _exhaustive(profile: ClusterProfile, batch: int) -> float:
    best = math.inf
    n, blocks = profile.num_devices, profile.num_blocks
    for size in range(1, n + 1):
        for subset in itertools.combinations(range(n), size):
            for stages in set(_ordered_partitions(subset)):
                for cuts in itertools.combinations(range(1, blocks), len(stages) - 1):
                    bounds = (0, *cuts, blocks)
                    ranges = list(itertools.pairwise(bounds))
                    for schedule, m in itertools.product(("1f1b", "zb-h1"), (1, 2, 4)):
                        plan = make_plan(
                            profile, stages, ranges, schedule=schedule, num_microbatches=m,
                            global_batch_size=batch,
                        )  # fmt: skip
                        if plan is not None:
                            best = min(best, plan.predicted_step_time_s)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_within_five_percent_of_exhaustive_search(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 4
    zone = rng.integers(0, 2, n)
    bandwidth = np.where(
        zone[:, None] == zone[None, :], 10 ** rng.uniform(8, 10), 10 ** rng.uniform(5, 8)
    )
    profile = make_profile(
        speeds=list(rng.uniform(0.5, 4.0, n)),
        num_blocks=4,
        bandwidth=bandwidth,
        latency=float(rng.uniform(0, 0.01)),
        block_s=0.01,
        activation_bytes=int(rng.integers(10_000, 1_000_000)),
        parameter_bytes=int(rng.integers(100_000, 50_000_000)),
    )
    found = plan_search(
        profile, num_blocks=4, global_batch_size=8, schedules=("1f1b", "zb-h1"),
        microbatch_candidates=(1, 2, 4),
    )  # fmt: skip
    best = _exhaustive(profile, 8)
    assert found.predicted_step_time_s <= 1.05 * best, (found.format_table(), best)


def test_a_device_measured_as_all_fixed_cost_still_plans() -> None:
    # A tiny model can measure fixed_s equal to a block's whole time: no per-sample compute,
    # a bound of 0, and still a plan.
    profile = make_profile(speeds=[2.0, 1.0], num_blocks=4, fixed_fraction=1.0)
    plan = plan_search(profile, num_blocks=4, global_batch_size=8)
    assert plan.compute_bound_s is not None and plan.cluster_bound_s is not None
    assert 0 == plan.cluster_bound_s <= plan.compute_bound_s <= plan.predicted_step_time_s
    assert Plan.from_dict(plan.to_dict()) == plan


def test_a_subset_profile_equals_the_checked_profile_of_its_devices() -> None:
    profile = random_profile(3, 7, 4)
    ranks = [5, 0, 3]
    checked = dataclasses.replace(
        profile,
        devices=tuple(dataclasses.replace(profile.devices[r], rank=i) for i, r in enumerate(ranks)),
        latency_s=tuple(tuple(profile.latency_s[a][b] for b in ranks) for a in ranks),
        bandwidth_bytes_per_s=tuple(
            tuple(profile.bandwidth_bytes_per_s[a][b] for b in ranks) for a in ranks
        ),
    )
    assert restrict(profile, ranks) == checked
    assert SubsetProfiles(profile)(ranks) == checked
    for bad in ([], [0, 0], [7], [-1]):
        with pytest.raises(ValueError, match="ranks"):
            profile.subset(bad)
