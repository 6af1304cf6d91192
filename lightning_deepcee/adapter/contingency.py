"""Plans searched ahead: for each wide-area link the running plan uses, the plan for that link
at a tenth, ready before the link falls.

Pure (stdlib plus the pure core), tested in one process. A re-plan search takes seconds of CPU,
and the device that runs it while training goes on (an idle one, paced under its CPU quota) may
need half a minute; a link that falls to a tenth costs several times the step meanwhile. So the
searcher spends its spare time before any change: :func:`contingency_profiles` lists, for every
pair of network groups the running plan's transfers cross, the profile with every pair between
the two groups at ``factor`` of its figure, both ways (a congested or re-shaped WAN path slows
both directions); the search process plans each. When the monitor proposes a re-plan,
:func:`choose_contingency` predicts those plans on the profile as the links behave now and takes
the fastest if it beats the running plan by the margin: the move needs no search, and the clock
still confirms it (``adapter/guard.py``). A change that none of them answers (a link at a third,
a link the plan does not use) goes to the search as before.

Each is searched in the running plan's neighbourhood (:func:`neighbourhood_search`): on the
devices it trains on (dropping any of them is in reach, idle ones are not), over the two
generated schedule kinds and its own, at half, the same and twice its micro-batch count. That
is about a third of a full search's CPU, which decides whether the plans are ready when the
change comes on a searcher at a few percent of a core.

:func:`device_contingency_profiles` does the same for the devices that train: each at
``COMPUTE_FACTOR`` times its block times (another tenant taking two thirds of it), so that a
device that slows down (``adapter/compute.py``) finds its plan ready too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from lightning_deepcee.adapter.links import plan_pairs
from lightning_deepcee.adapter.replan import ReplanChoice, placement_key
from lightning_deepcee.planner.cost_model import predict_plan
from lightning_deepcee.planner.plan import Plan
from lightning_deepcee.planner.prediction import CostModelConfig
from lightning_deepcee.planner.profile_arrays import ProfileArrays
from lightning_deepcee.planner.search import DEVICE_GAIN, plan_search
from lightning_deepcee.planner.subsets import lift, restrict
from lightning_deepcee.profiler.data import ClusterProfile

__all__ = [
    "COMPUTE_FACTOR",
    "CONTINGENCY_FACTOR",
    "choose_contingency",
    "contingency_profiles",
    "device_contingency_profiles",
    "neighbourhood_search",
]

CONTINGENCY_FACTOR = 0.1
"""The bandwidth, as a fraction of its figure, each contingency plans a wide-area link at."""
COMPUTE_FACTOR = 3.0
"""How many times as long each device contingency has a training device compute."""


def contingency_profiles(
    profile: ClusterProfile, plan: Plan, factor: float = CONTINGENCY_FACTOR
) -> list[tuple[str, ClusterProfile]]:
    """``(name, profile)`` for every pair of network groups ``plan``'s transfers cross: every
    pair of devices between the two groups at ``factor`` of ``profile``'s figure, both ways.
    Named ``net{a}<->net{b}`` (the cost model's groups, ``ProfileArrays.network_group``)."""
    if not 0 < factor < 1:
        raise ValueError(f"contingency_profiles: factor must be in (0, 1), got {factor!r}")
    group = [int(g) for g in ProfileArrays(profile).network_group]
    crossed = sorted(
        {tuple(sorted((group[s], group[d]))) for s, d in plan_pairs(plan) if group[s] != group[d]}
    )
    scenarios = []
    for a, b in crossed:
        matrix = [list(row) for row in profile.bandwidth_bytes_per_s]
        for src, row in enumerate(matrix):
            for dst in range(len(row)):
                if {group[src], group[dst]} == {a, b}:
                    row[dst] *= factor
        scaled = dataclasses.replace(
            profile, bandwidth_bytes_per_s=tuple(tuple(row) for row in matrix)
        )
        scenarios.append((f"net{a}<->net{b}", scaled))
    return scenarios


def device_contingency_profiles(
    profile: ClusterProfile, plan: Plan, factor: float = COMPUTE_FACTOR
) -> list[tuple[str, ClusterProfile]]:
    """``(name, profile)`` for every device ``plan`` trains on: that device computing
    ``factor`` times as long (:func:`~lightning_deepcee.adapter.compute.observed_compute`).
    Named ``device {rank}``."""
    from lightning_deepcee.adapter.compute import observed_compute

    if not factor > 1:
        raise ValueError(f"device_contingency_profiles: factor must be above 1, got {factor!r}")
    ranks = sorted({r for stage in plan.stages for r in stage.ranks})
    return [(f"device {r}", observed_compute(profile, {r: factor})[0]) for r in ranks]


def neighbourhood_search(
    scenario: ClusterProfile,
    plan: Plan,
    *,
    device_gain: float = DEVICE_GAIN,
    config: CostModelConfig | None = None,
) -> Plan:
    """The plan for ``scenario`` near the running ``plan``: searched on ``plan``'s training
    devices only (subsets of them included), over 1F1B, ZB-H1 and ``plan``'s own schedule
    kind, at half, the same and twice its micro-batch count; returned on the whole cluster
    (the other ranks idle). Raises ``ValueError`` when nothing fits."""
    from lightning_deepcee.schedule import COST_AWARE_SCHEDULE_KINDS

    ranks = sorted({r for stage in plan.stages for r in stage.ranks})
    m = plan.num_microbatches
    own = [plan.schedule] if plan.schedule in COST_AWARE_SCHEDULE_KINDS else []
    found = plan_search(
        restrict(scenario, ranks),
        num_blocks=plan.num_blocks,
        global_batch_size=plan.global_batch_size,
        schedules=tuple(dict.fromkeys(("1f1b", "zb-h1", *own))),
        microbatch_candidates=tuple(sorted({max(1, m // 2), m, 2 * m})),
        device_gain=device_gain,
        config=config,
    )
    return lift(found, ranks, scenario.num_devices)


def choose_contingency(
    observed: ClusterProfile,
    current: Plan,
    current_s: float,
    plans: Sequence[tuple[str, Plan]],
    *,
    gain: float,
) -> ReplanChoice | None:
    """The fastest of ``plans`` (``(name, plan)`` searched ahead) on ``observed`` against the
    running plan's ``current_s`` (its step on the model's scale): applied if it is faster by
    ``gain``; ``None`` when no plan differs from the running layout."""
    if not 0 <= gain < 1:
        raise ValueError(f"choose_contingency: gain must be in [0, 1), got {gain!r}")
    others = [(n, p) for n, p in plans if placement_key(p) != placement_key(current)]
    if not others:
        return None
    timed = [(predict_plan(observed, p).step_time_s, n, p) for n, p in others]
    new_s, name, plan = min(timed, key=lambda t: t[0])
    apply = new_s < current_s * (1 - gain)
    reason = (
        f"the plan searched ahead for {name} "
        f"{'at a third of its speed' if name.startswith('device') else 'at a tenth'} is predicted "
        f"{1 - new_s / current_s:.0%} faster on the links as measured (needs {gain:.0%})"
    )
    return ReplanChoice(
        apply=apply,
        current_step_time_s=current_s,
        new_step_time_s=new_s,
        plan=plan,
        reason=reason,
    )
