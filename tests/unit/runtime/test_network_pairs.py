"""Which pairs across network groups the network measurement measures, and which borrow."""

from __future__ import annotations

import itertools
import math

import pytest

from lightning_deepcee.runtime.measure import round_robin_rounds
from lightning_deepcee.runtime.measure.network import (
    NetworkMeasurement,
    _agree,
    _rates,
    check_pairs,
    kept_agrees,
    representative_pairs,
)

MB = 1e6


def _probe(group_of: dict[int, int], speed: dict[tuple[int, int], float]) -> list[list[float]]:
    """Probe matrix: ``speed[(g, h)]`` bytes/s from a device of group g to one of group h."""
    n = len(group_of)
    return [[speed[(group_of[i], group_of[j])] for j in range(n)] for i in range(n)]


def _across(group_of: dict[int, int]) -> list[tuple[int, int]]:
    rounds = round_robin_rounds(len(group_of))
    return [p for pairs in rounds for p in pairs if group_of[p[0]] != group_of[p[1]]]


def test_each_pair_of_groups_measures_per_link_pairs_and_the_rest_borrow_alike() -> None:
    # cee8-like: 3 cloud (group 0), 3 edge (1), 2 end (2); asymmetric uplinks.
    group_of = {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1, 6: 2, 7: 2}
    speed = {(g, h): (100 if g == h else 10 + 3 * g + h) * MB for g in range(3) for h in range(3)}
    across = _across(group_of)
    assert len(across) == 9 + 6 + 6
    assert len(across) - len(representative_pairs(across, group_of, _probe(group_of, speed))) == 3
    stand_ins = representative_pairs(across, group_of, _probe(group_of, speed), per_link=2)
    measured = [p for p in across if p not in stand_ins]
    assert len(measured) == 2 * 3  # two per pair of groups
    for (low, high), alike in stand_ins.items():
        assert len(alike) == 2  # both representatives of the pair of groups match
        for a, b in alike:
            assert (min(a, b), max(a, b)) in measured
            # Oriented alike: the stand-in's first rank is in low's group, its second in high's.
            assert (group_of[a], group_of[b]) == (group_of[low], group_of[high])


def test_a_device_behind_its_own_slow_link_is_measured_itself() -> None:
    group_of = {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1}
    probe = [
        [100 * MB if group_of[i] == group_of[j] else 10 * MB for j in range(6)] for i in range(6)
    ]
    for j in range(6):  # device 5 reaches the other group at a tenth of the others' speed
        if group_of[j] == 0:
            probe[5][j] = probe[j][5] = 1 * MB
    across = _across(group_of)
    stand_ins = representative_pairs(across, group_of, probe)
    # Pair (0, 5) comes first: device 5's other pairs borrow its figures, and only they.
    assert stand_ins and all((5 in p) == (5 in q) for p, alike in stand_ins.items() for q in alike)
    assert len(stand_ins) == len(across) - 2


def test_no_stand_in_within_the_budget_of_two_pairs_per_link() -> None:
    for sizes in ((1, 1), (2, 1), (1, 2, 1)):
        group_of = dict(enumerate(g for g, size in enumerate(sizes) for _ in range(size)))
        speed = {k: 5 * MB for k in itertools.product(range(len(sizes)), repeat=2)}
        probe = _probe(group_of, speed)
        assert representative_pairs(_across(group_of), group_of, probe, per_link=2) == {}


def test_kept_links_are_checked_on_one_pair_between_every_two_network_groups() -> None:
    # Three groups: ranks 0-1 and 2-3 on fast LANs, rank 4 alone; slow links between them.
    inf, lan, wan, far = math.inf, 1e9, 1e6, 1e5
    bandwidth = [
        [inf, lan, wan, wan, far],
        [lan, inf, wan, wan, far],
        [wan, wan, inf, lan, far],
        [wan, wan, lan, inf, far],
        [far, far, far, far, inf],
    ]
    kept = NetworkMeasurement(
        latency_s=((0.0,) * 5,) * 5,
        bandwidth_bytes_per_s=tuple(tuple(row) for row in bandwidth),
        num_rounds=3,
        elapsed_s=1.0,
    )
    pairs = check_pairs(kept)
    assert pairs == [(0, 2), (0, 4), (2, 4)]
    assert kept_agrees(kept, bandwidth, pairs)
    now = [row[:] for row in bandwidth]
    now[1][0] = lan / 100  # inside a group: not checked
    now[2][0] = wan * 1.4  # within 1.5x
    assert kept_agrees(kept, now, pairs)
    now[4][2] = far / 2  # the far link lost half, one way
    assert not kept_agrees(kept, now, pairs)
    assert kept_agrees(kept, now, pairs, tolerance=2.5)


def test_a_pair_stops_repeating_once_its_two_fastest_readings_agree() -> None:
    small = 1024
    # 2 MB in 0.2 s over a 1 ms small round trip: about 10 MB/s; then 5% slower, then 30% slower.
    near = [(2_000_000, 0.201), (2_000_000, 0.2115)]
    assert _agree(near, 0.001, small)
    assert not _agree(near[:1], 0.001, small)  # one reading confirms nothing
    assert not _agree([(2_000_000, 0.201), (2_000_000, 0.261)], 0.001, small)


def test_a_short_message_that_may_have_ridden_a_burst_does_not_count() -> None:
    small = 1024
    # A 100 kB message served in 10 ms by a shaper's burst (10 MB/s), then 2 MB at 1 MB/s in 2 s.
    rates = _rates([(100_000, 0.011), (2_000_000, 2.001)], 0.001, small)
    assert rates == [pytest.approx((2_000_000 - small) / 2.0)]
    # With no message long enough, every reading counts (a fast LAN link).
    assert len(_rates([(100_000, 0.011), (200_000, 0.021)], 0.001, small)) == 2


def test_a_probe_that_rode_a_burst_one_way_still_borrows() -> None:
    group_of = {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1}
    probe = [
        [100 * MB if group_of[i] == group_of[j] else 10 * MB for j in range(6)] for i in range(6)
    ]
    across = _across(group_of)
    first = across[0]
    assert len(representative_pairs(across, group_of, probe)) == len(across) - 1
    for low, high in across[1:]:  # a burst one way: eight times the link's rate
        probe[high][low] = 80 * MB
    assert probe[first[1]][first[0]] == 10 * MB
    assert len(representative_pairs(across, group_of, probe)) == len(across) - 1
    for low, high in across[1:]:  # slower both ways than the first pair: one more measured
        probe[low][high] = probe[high][low] = 2 * MB
    stand_ins = representative_pairs(across, group_of, probe)
    assert len(stand_ins) == len(across) - 2
    assert all(first not in alike for alike in stand_ins.values())
