"""What the running plan expects of its links: the pairs it uses and the figures to judge them by.

Pure (stdlib plus the pure core). The Lightning Callback builds its
:class:`~lightning_deepcee.adapter.LinkMonitor` from these at the start of training and after
every change of layout:

- :func:`plan_pairs`: the directed pairs that carry the plan's pipeline transfers (every rank of
  a stage with every rank of the next, both ways);
- :func:`link_expectations`: per pair the profile's bandwidth, and the pairs that cross between
  two network groups gathered into one :class:`~lightning_deepcee.adapter.SharedLink`, as the
  cost model shares the wide-area link between the groups (``planner/evaluator.py``): the groups
  are the cost model's own (``ProfileArrays.network_group``) and the link's capacity is its
  ``group_capacity`` (the median pair measured between the two groups) when several of the
  plan's pairs cross it together, else the one pair's bandwidth, which is what the cost model
  charges a lone message.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

from lightning_deepcee.adapter.monitor import Link, SharedLink
from lightning_deepcee.planner.plan import Plan
from lightning_deepcee.planner.profile_arrays import ProfileArrays
from lightning_deepcee.profiler.data import ClusterProfile

__all__ = ["link_expectations", "plan_pairs"]


def plan_pairs(plan: Plan) -> list[Link]:
    """The directed pairs of ``plan``'s pipeline transfers, sorted: every rank of stage ``s``
    with every rank of stage ``s + 1``, both ways (activations forward, gradients back)."""
    pairs: set[Link] = set()
    for sender, receiver in itertools.pairwise(plan.stages):
        for a, b in itertools.product(sender.ranks, receiver.ranks):
            pairs.update({(a, b), (b, a)})
    return sorted(pairs)


def link_expectations(
    profile: ClusterProfile | None, pairs: Iterable[Link]
) -> tuple[dict[Link, float | None], list[SharedLink]]:
    """The figures a monitor judges ``pairs`` by: ``(per pair, shared links)``.

    Without a profile every pair is its own link with no figure (calibrated only). With one,
    pairs inside a network group keep the profile's bandwidth; pairs from group ``a`` to group
    ``b != a`` form one shared link ``net{a}->net{b}`` that lists *every* pair between the two
    groups, so a re-plan that rescales it rescales the whole wide-area link and cannot route
    around the drop over another pair of the same link.
    """
    pairs = sorted(set(pairs))
    if profile is None:
        return dict.fromkeys(pairs), []
    arrays = ProfileArrays(profile)
    group = [int(g) for g in arrays.network_group]
    bandwidth = profile.bandwidth_bytes_per_s
    expected: dict[Link, float | None] = {}
    crossing: dict[tuple[int, int], list[Link]] = {}
    for src, dst in pairs:
        a, b = group[src], group[dst]
        if a == b:
            expected[(src, dst)] = _finite(bandwidth[src][dst])
        else:
            crossing.setdefault((a, b), []).append((src, dst))
    shared = []
    for (a, b), used in sorted(crossing.items()):
        every = [
            (s, d)
            for s in range(profile.num_devices)
            for d in range(profile.num_devices)
            if group[s] == a and group[d] == b and math.isfinite(bandwidth[s][d])
        ]
        capacity = (
            float(arrays.group_capacity[a][b])
            if len(used) > 1
            else bandwidth[used[0][0]][used[0][1]]
        )
        shared.append(
            SharedLink(
                name=f"net{a}->net{b}",
                pairs=tuple(sorted(set(every) | set(used))),
                capacity=_finite(capacity),
            )
        )
    return expected, shared


def _finite(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) and value > 0 else None
