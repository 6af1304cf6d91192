"""Unit tests for two-level device grouping on synthetic bandwidth matrices and capabilities."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_deepcee.profiler import (
    ClusterProfile,
    DeviceGroups,
    GroupingConfig,
    group_by_compute,
    group_by_network,
    group_devices,
    group_devices_from_arrays,
    network_distances,
)
from tests.helpers.paths import EXAMPLE_PROFILE as EXAMPLE

GBIT = 1e9 / 8  # bytes/s
MBIT = 1e6 / 8


def _regions(
    sizes: list[int],
    *,
    lan: float | list[float] = GBIT,
    wan: float | None = None,
    rng: np.random.Generator | None = None,
    noise: float = 0.0,
) -> tuple[npt.NDArray[np.float64], tuple[tuple[int, ...], ...]]:
    """Bandwidth matrix for regions of ``sizes`` devices (ranks numbered region by region).

    WAN links between two regions get ``wan`` or, if None, a per-pair value in 20-200 Mbit/s.
    Every ordered entry is multiplied by a factor in [1 - noise, 1 + noise].
    """
    rng = rng or np.random.default_rng(0)
    region_of = np.repeat(np.arange(len(sizes)), sizes)
    lans = np.broadcast_to(np.asarray(lan, dtype=float), (len(sizes),))
    pair_wan = np.exp(rng.uniform(np.log(20 * MBIT), np.log(200 * MBIT), (len(sizes),) * 2))
    pair_wan = np.triu(pair_wan, 1) + np.triu(pair_wan, 1).T
    if wan is not None:
        pair_wan[:] = wan
    same = region_of[:, None] == region_of[None, :]
    bandwidth = np.where(
        same, lans[region_of][:, None], pair_wan[region_of[:, None], region_of[None, :]]
    )
    bandwidth = bandwidth * rng.uniform(1 - noise, 1 + noise, bandwidth.shape)
    np.fill_diagonal(bandwidth, np.inf)
    truth = tuple(tuple(int(r) for r in np.flatnonzero(region_of == k)) for k in range(len(sizes)))
    return bandwidth, truth


# ------------------------------------------------------------------------------------------
# First level: network groups
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sizes",
    [[2, 2], [3, 1], [1, 4], [2, 2, 2], [4, 3, 2], [2, 2, 2, 2], [3, 1, 2, 4], [5, 5, 5, 5]],
)
def test_clean_regions_are_recovered(sizes: list[int]) -> None:
    bandwidth, truth = _regions(sizes)
    assert group_by_network(bandwidth) == truth


@pytest.mark.parametrize("sizes", [[2, 2], [2, 3, 2], [2, 2, 3, 2]])
@pytest.mark.parametrize("noise", [0.1, 0.2])
def test_noisy_regions_are_recovered_for_many_seeds(sizes: list[int], noise: float) -> None:
    failures = []
    for seed in range(100):
        bandwidth, truth = _regions(sizes, rng=np.random.default_rng(seed), noise=noise)
        if group_by_network(bandwidth) != truth:
            failures.append(seed)
    assert failures == []


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(2, 4), min_size=2, max_size=4),
    seed=st.integers(0, 2**32 - 1),
    noise=st.floats(0.0, 0.2),
)
def test_noisy_regions_property(sizes: list[int], seed: int, noise: float) -> None:
    bandwidth, truth = _regions(sizes, rng=np.random.default_rng(seed), noise=noise)
    assert group_by_network(bandwidth) == truth


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), data=st.data())
def test_groups_follow_a_relabelling_of_ranks(seed: int, data: st.DataObject) -> None:
    bandwidth, truth = _regions([2, 3, 2], rng=np.random.default_rng(seed), noise=0.2)
    permutation = np.array(data.draw(st.permutations(range(7))))
    # new rank r is old rank permutation[r]
    shuffled = bandwidth[np.ix_(permutation, permutation)]
    new_rank = {int(old): new for new, old in enumerate(permutation)}
    expected = tuple(
        sorted((tuple(sorted(new_rank[r] for r in group)) for group in truth), key=min)
    )
    assert group_by_network(shuffled) == expected


@pytest.mark.parametrize("noise", [0.0, 0.2])
@pytest.mark.parametrize("size", [2, 3, 6])
def test_all_equal_links_form_one_group(size: int, noise: float) -> None:
    bandwidth, _ = _regions([size], rng=np.random.default_rng(size), noise=noise)
    assert group_by_network(bandwidth) == (tuple(range(size)),)


def test_one_device_is_one_group() -> None:
    assert group_by_network([[np.inf]]) == ((0,),)
    groups = group_devices_from_arrays([[0.0]], [3.0])
    assert groups == DeviceGroups(network_groups=((0,),), compute_groups=(((0,),),))


@pytest.mark.parametrize("bandwidth", [20 * MBIT, GBIT, 100 * GBIT])
def test_two_devices_form_one_group_whatever_their_link(bandwidth: float) -> None:
    # With a single link there is nothing to call it slow against.
    assert group_by_network([[np.inf, bandwidth], [bandwidth, np.inf]]) == ((0, 1),)


def test_asymmetric_link_counts_by_its_slow_direction() -> None:
    bandwidth, truth = _regions([2, 2], wan=GBIT)
    bandwidth[0:2, 2:4] = 20 * MBIT  # fast 1 -> 0 direction stays at LAN speed
    assert group_by_network(bandwidth) == truth
    assert group_by_network(bandwidth.T) == truth


def test_regions_with_different_lan_speeds_stay_together() -> None:
    # Cloud 10 Gbit/s, edge 1 Gbit/s, end WiFi 100 Mbit/s; WAN 100/50/20 Mbit/s. A single
    # cluster-wide reference would split the end devices from each other.
    bandwidth, truth = _regions([2, 3, 3], lan=[10 * GBIT, GBIT, 100 * MBIT], wan=20 * MBIT)
    bandwidth[0:2, 2:5] = bandwidth[2:5, 0:2] = 100 * MBIT
    bandwidth[2:5, 5:8] = bandwidth[5:8, 2:5] = 50 * MBIT
    assert group_by_network(bandwidth) == truth


def test_co_located_processes_with_infinite_bandwidth_do_not_split_their_lan() -> None:
    bandwidth, _ = _regions([3, 2])
    bandwidth[0, 1] = bandwidth[1, 0] = np.inf  # ranks 0 and 1 share a host
    assert group_by_network(bandwidth) == ((0, 1, 2), (3, 4))


def test_threshold_decides_whether_a_mid_speed_link_merges() -> None:
    bandwidth, _ = _regions([2, 2], wan=GBIT / 5)
    assert group_by_network(bandwidth, GroupingConfig(bandwidth_ratio_threshold=4)) == (
        (0, 1),
        (2, 3),
    )
    assert group_by_network(bandwidth, GroupingConfig(bandwidth_ratio_threshold=6)) == (
        (0, 1, 2, 3),
    )


def test_network_distances_are_log_ratios_to_the_best_link() -> None:
    bandwidth, _ = _regions([2, 2], wan=GBIT / 10)
    distance = network_distances(bandwidth)
    assert distance.shape == (4, 4)
    np.testing.assert_allclose(np.diag(distance), 0.0)
    np.testing.assert_allclose(distance, distance.T)
    assert distance[0, 1] == pytest.approx(0.0)
    assert distance[0, 2] == pytest.approx(np.log(10))


@pytest.mark.parametrize(
    ("matrix", "message"),
    [
        ([[1.0, 2.0]], "expected a non-empty square"),
        ([], "expected a non-empty square"),
        ([[np.inf, -1.0], [1.0, np.inf]], r"bandwidth_bytes_per_s\[0\]\[1\]: expected a positive"),
        (
            [[np.inf, 1.0], [np.nan, np.inf]],
            r"bandwidth_bytes_per_s\[1\]\[0\]: expected a positive",
        ),
        ([[np.inf, 1.0], [0.0, np.inf]], r"bandwidth_bytes_per_s\[1\]\[0\]: expected a positive"),
    ],
)
def test_bad_bandwidth_matrix_is_rejected(matrix: list[list[float]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        group_by_network(matrix)


# ------------------------------------------------------------------------------------------
# Second level: compute groups
# ------------------------------------------------------------------------------------------


def test_all_different_capabilities_give_one_group_each() -> None:
    assert group_by_compute([1.0, 2.0, 4.0, 8.0]) == ((0,), (1,), (2,), (3,))
    assert group_by_compute([8.0, 1.0, 4.0, 2.0]) == ((0,), (1,), (2,), (3,))


@pytest.mark.parametrize(
    ("capabilities", "expected"),
    [
        ([5.0, 5.0, 5.0], ((0, 1, 2),)),
        ([1.0, 1.3, 1.1], ((0, 1, 2),)),
        ([1.0, 3.3, 1.1, 3.0], ((0, 2), (1, 3))),
        ([100.0, 1.0, 99.0, 1.2, 10.0], ((0, 2), (1, 3), (4,))),
    ],
)
def test_similar_capabilities_share_a_group(
    capabilities: list[float], expected: tuple[tuple[int, ...], ...]
) -> None:
    assert group_by_compute(capabilities) == expected


def test_compute_groups_only_cover_the_given_members() -> None:
    capabilities = [1.0, 4.0, 1.1, 4.2, 1.05]
    assert group_by_compute(capabilities, members=[4, 1, 0]) == ((0, 4), (1,))
    assert group_by_compute(capabilities, members=[3]) == ((3,),)


def test_compute_threshold_is_respected() -> None:
    assert group_by_compute([1.0, 1.4]) == ((0, 1),)
    assert group_by_compute([1.0, 1.6]) == ((0,), (1,))
    loose = GroupingConfig(compute_ratio_threshold=2.0)
    assert group_by_compute([1.0, 1.6], config=loose) == ((0, 1),)


@pytest.mark.parametrize(
    ("capabilities", "members", "message"),
    [
        ([1.0, 0.0], None, r"capabilities\[1\]: expected a positive"),
        ([1.0, -2.0], [0, 1], r"capabilities\[1\]: expected a positive"),
        ([1.0, np.nan], None, r"capabilities\[1\]"),
        ([1.0, 2.0], [0, 2], r"members: expected ranks in 0\.\.1, got 2"),
        ([1.0, 2.0], [0, 0], "members: expected a non-empty list of distinct ranks"),
        ([], None, "capabilities: expected a non-empty 1-D array"),
    ],
)
def test_bad_capabilities_are_rejected(
    capabilities: list[float], members: list[int] | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        group_by_compute(capabilities, members)


# ------------------------------------------------------------------------------------------
# Both levels, the result type and the config
# ------------------------------------------------------------------------------------------


def test_two_levels_from_arrays() -> None:
    bandwidth, _ = _regions([3, 3], rng=np.random.default_rng(1), noise=0.1)
    capabilities = [4.0, 1.0, 4.2, 2.0, 2.1, 2.05]
    groups = group_devices_from_arrays(bandwidth, capabilities)
    assert groups.network_groups == ((0, 1, 2), (3, 4, 5))
    assert groups.compute_groups == (((0, 2), (1,)), ((3, 4, 5),))
    assert groups.num_network_groups == 2 and groups.num_devices == 6
    assert groups.network_group_of(4) == 1
    with pytest.raises(ValueError, match="capabilities: expected 6 scores"):
        group_devices_from_arrays(bandwidth, capabilities[:5])


def test_example_profile_groups_into_its_three_regions() -> None:
    profile = ClusterProfile.from_yaml(EXAMPLE)
    groups = group_devices(profile)
    assert groups.network_groups == ((0, 1), (2, 3), (4, 5))
    assert [{profile.devices[r].kind for r in group} for group in groups.network_groups] == [
        {"cloud"},
        {"edge"},
        {"end"},
    ]
    assert groups.compute_groups == (((0, 1),), ((2, 3),), ((4, 5),))
    table = groups.format_table(profile)
    assert table.splitlines()[0].split() == [
        "network_group",
        "compute_group",
        "rank",
        "host",
        "kind",
        "capability",
    ]
    assert len(table.splitlines()) == 2 + 6
    assert "end-1" in table.splitlines()[-1]


def test_device_groups_round_trip_and_validation() -> None:
    groups = DeviceGroups(network_groups=((0, 2), (1,)), compute_groups=(((0,), (2,)), ((1,),)))
    assert DeviceGroups.from_dict(groups.to_dict()) == groups
    assert groups.to_dict() == {
        "network_groups": [[0, 2], [1]],
        "compute_groups": [[[0], [2]], [[1]]],
    }
    with pytest.raises(ValueError, match=r"network_groups\[1\]: expected each rank in one group"):
        DeviceGroups(network_groups=((0, 1), (1,)), compute_groups=(((0, 1),), ((1,),)))
    with pytest.raises(ValueError, match=r"compute_groups\[0\]: expected a partition"):
        DeviceGroups(network_groups=((0, 1),), compute_groups=(((0,),),))
    with pytest.raises(ValueError, match="compute_groups: expected 1 entries"):
        DeviceGroups(network_groups=((0, 1),), compute_groups=())
    with pytest.raises(ValueError, match="extra: unknown field of DeviceGroups"):
        DeviceGroups.from_dict({**groups.to_dict(), "extra": 1})
    with pytest.raises(ValueError, match="compute_groups: missing required field"):
        DeviceGroups.from_dict({"network_groups": [[0]]})
    assert "0              1              2" in groups.format_table()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"bandwidth_ratio_threshold": 1.0},
            "bandwidth_ratio_threshold: expected a finite ratio > 1",
        ),
        ({"bandwidth_ratio_threshold": float("inf")}, "bandwidth_ratio_threshold"),
        ({"compute_ratio_threshold": 0.5}, "compute_ratio_threshold: expected a finite ratio > 1"),
        ({"compute_ratio_threshold": "2"}, "compute_ratio_threshold"),
        ({"linkage": "ward"}, "linkage: expected one of average, complete, single, weighted"),
    ],
)
def test_bad_config_is_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GroupingConfig(**kwargs)  # type: ignore[arg-type]


def test_config_round_trip() -> None:
    config = GroupingConfig(bandwidth_ratio_threshold=3, linkage="complete")
    assert config.bandwidth_ratio_threshold == 3.0
    assert GroupingConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="colour: unknown field"):
        GroupingConfig.from_dict({"colour": 1})


@pytest.mark.parametrize("method", ["average", "complete", "single", "weighted"])
def test_every_linkage_recovers_clean_regions(method: str) -> None:
    bandwidth, truth = _regions([2, 3, 2], rng=np.random.default_rng(3), noise=0.1)
    assert group_by_network(bandwidth, GroupingConfig(linkage=method)) == truth
