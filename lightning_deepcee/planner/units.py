"""DeepCEE's structured candidates: network units, their pipeline order, second-level splits.

This module owns the third kind of candidate of :func:`~lightning_deepcee.planner.plan_search`:

1. :func:`network_units`: the first-level network groups (``group_by_network``), merged by
   bandwidth while there are more of them than stages allowed;
2. :func:`search_units`: a beam search over the pipeline order of the units (each unit one
   stage), scored by the greedy completion of each partial order; then, on the best few orders,
   boundary refinement and second-level splitting (a stage split into its compute groups, in
   either order) while that helps.

Pure: numpy, scipy and the standard library (no torch, no lightning).
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.spatial.distance import squareform

from lightning_deepcee.planner.candidates import (
    Candidate,
    MapFn,
    SearchContext,
    Structure,
    improves,
    serial_map,
)
from lightning_deepcee.profiler.grouping import (
    GroupingConfig,
    group_by_compute,
    group_by_network,
    network_distances,
)

__all__ = ["network_units", "search_units"]

Array = npt.NDArray[np.float64]

_REFINED_ORDERS = 2
"""How many of the beam's final orders at least get boundary refinement and second-level
splitting."""
_REFINE_WINDOW = 1.25
"""Further final orders predicted within this factor of the best (before refinement) are refined
too: an order that loses unrefined by a few percent can win once its cuts move or a group is
split."""
_REFINE_ALL_UNITS = 4
"""With at most this many network units every final order is refined (at most ``4! = 24``
orders, ``beam_width`` finalists): cheap, and an order can rank third unrefined and win once
one of its groups is split."""
_REFINE_EVERY_SPLIT = 8
"""Up to this many stages every trial split is refined before it is compared; beyond, trial
splits are compared on the balanced partition and only the final structure is refined."""
_SPLIT_SCREEN = 1.05
"""A greedy trial split predicted more than this factor slower than the current best under the
best's own (schedule, micro-batch count) is not scored at the other pairs: a split rarely moves
the best pair (seven trials in eight keep it), and one that loses by 5% at the pair that suits
its neighbours does not win at another."""
_JOINT_SPLIT_GROUPS = 3
"""With at most this many splittable stages, every combination of their second-level splits
(unsplit, fastest part first, slowest first: ``3**k``) is tried, not only the greedy path:
splitting one stage can pay only once another is split too, which the greedy path (one stage at
a time, each split kept only if it helps alone) never tries."""


# --------------------------------------------------------------------------------------------
# Network units: first-level groups, merged when there are more than stages allowed
# --------------------------------------------------------------------------------------------


def _group_bandwidth(bandwidth: Array, units: Sequence[tuple[int, ...]]) -> Array:
    """Slowest link between every two units (``inf`` on the diagonal)."""
    order = np.asarray([r for unit in units for r in unit], dtype=np.intp)
    starts = np.cumsum([0, *(len(unit) for unit in units[:-1])])
    rows = np.minimum.reduceat(bandwidth[order][:, order], starts, axis=0)
    out = np.minimum.reduceat(rows, starts, axis=1)
    np.fill_diagonal(out, np.inf)
    return out


def network_units(
    context: SearchContext, grouping: GroupingConfig, max_stages: int
) -> tuple[list[tuple[int, ...]], str]:
    """The network groups as pipeline units, at most ``max_stages`` of them, and a note saying
    how many were merged (empty when none were)."""
    arrays = context.evaluator.arrays
    bandwidth = arrays.bandwidth
    default = GroupingConfig()
    if (grouping.bandwidth_ratio_threshold, grouping.linkage) == (
        default.bandwidth_ratio_threshold,
        default.linkage,
    ):
        network = arrays.network_groups  # the same cut, made once per profile
    else:
        network = group_by_network(bandwidth, grouping)
    units = [tuple(g) for g in network]
    note = ""
    while len(units) > max_stages:
        merged = group_by_network(_group_bandwidth(bandwidth, units), grouping)
        if len(merged) == len(units):
            # No natural level left: cut the group tree at max_stages clusters.
            distance = network_distances(_group_bandwidth(bandwidth, units))
            labels = fcluster(
                linkage(squareform(distance, checks=False), method=grouping.linkage),
                t=max_stages,
                criterion="maxclust",
            )
            by_label: dict[int, list[int]] = {}
            for label, unit in zip(labels, range(len(units)), strict=True):
                by_label.setdefault(int(label), []).append(unit)
            merged = tuple(tuple(v) for v in by_label.values())
        note = (
            f"{len(network)} network groups merged into {len(merged)} "
            f"(at most {max_stages} stages); "
        )
        units = [tuple(sorted(r for u in part for r in units[u])) for part in merged]
    return units, note


# --------------------------------------------------------------------------------------------
# Beam search over the order of the network units
# --------------------------------------------------------------------------------------------


def _complete(prefix: tuple[int, ...], k: int, unit_bandwidth: Array) -> tuple[int, ...]:
    """Append the unused units greedily: next is the best-connected to the current last."""
    order = list(prefix)
    left = [u for u in range(k) if u not in prefix]
    while left:
        last = order[-1]
        nxt = max(left, key=lambda u: (unit_bandwidth[last, u], -u))
        order.append(nxt)
        left.remove(nxt)
    return tuple(order)


def _beam_orders(
    context: SearchContext,
    units: Sequence[tuple[int, ...]],
    beam_width: int,
    score_pair: tuple[str, int],
    rng: random.Random,
) -> list[tuple[int, ...]]:
    """Beam search over partial orders, scored by their greedy completion; best orders first."""
    k = len(units)
    if k == 1:
        return [(0,)]
    unit_bandwidth = _group_bandwidth(context.evaluator.arrays.bandwidth, units)
    scores: dict[tuple[int, ...], float] = {}

    def score(order: tuple[int, ...]) -> float:
        if order not in scores:
            structure = tuple(units[u] for u in order)
            ranges = context.partition(structure)
            scored = None if ranges is None else context.evaluate(structure, ranges, *score_pair)
            scores[order] = math.inf if scored is None else scored.step_time_s
        return scores[order]

    beam: list[tuple[int, ...]] = [()]
    for _ in range(k):
        children = [(*prefix, u) for prefix in beam for u in range(k) if u not in prefix]
        rng.shuffle(children)  # ties are broken at random (seeded), as in DeepCEE
        ranked = sorted(children, key=lambda c: score(_complete(c, k, unit_bandwidth)))
        beam = ranked[:beam_width]
    return sorted(beam, key=score)


# --------------------------------------------------------------------------------------------
# Refinement and second-level splits of the best orders
# --------------------------------------------------------------------------------------------


def search_units(
    context: SearchContext,
    units: Sequence[tuple[int, ...]],
    grouping: GroupingConfig,
    beam_width: int,
    max_iter: int,
    rng: random.Random,
    map_fn: MapFn = serial_map,
) -> list[Candidate]:
    """Beam over unit orders, then refine, then try second-level splits; the refined layouts,
    best first (empty when none fits). Each chosen order is refined and split in one call of
    ``map_fn`` (the orders are independent)."""
    # Score the beam with the (schedule, m) that suits the capability-descending order best.
    capability = context.profile.capability_vector()
    default = tuple(sorted(units, key=lambda u: -float(capability[list(u)].sum())))
    default_ranges = context.partition(default)
    seed_scored = None
    if default_ranges is not None:
        seed_scored = context.best_over_pairs(default, default_ranges)
    pair = (
        (seed_scored.schedule, seed_scored.num_microbatches)
        if seed_scored is not None
        else context.pairs[-1]
    )
    orders = _beam_orders(context, units, beam_width, pair, rng)
    finalists: list[Candidate] = []
    for order in orders:
        structure = tuple(units[u] for u in order)
        ranges = context.partition(structure)
        scored = None if ranges is None else context.best_over_pairs(structure, ranges)
        if scored is not None:
            finalists.append(scored)
    if not finalists:
        return []
    # Boundary refinement and second-level splitting are the expensive part; they are spent on
    # the few best orders only. Each finalist is split before they are compared: an order that
    # loses unsplit can win once one of its groups is split (and its halves swapped).
    finalists.sort(key=lambda scored: scored.step_time_s)
    window = finalists[0].step_time_s * _REFINE_WINDOW
    chosen = [
        scored
        for index, scored in enumerate(finalists)
        if index < _REFINED_ORDERS
        or scored.step_time_s <= window
        or len(units) <= _REFINE_ALL_UNITS
    ]
    split = map_fn(functools.partial(_refine_and_split, context, grouping, max_iter), chosen)
    return sorted(split, key=lambda scored: scored.step_time_s)


def _refine_and_split(
    context: SearchContext, grouping: GroupingConfig, max_iter: int, scored: Candidate
) -> Candidate:
    """One order's boundary refinement, then its second-level splits."""
    return _split_second_level(context, context.refine(scored, max_iter), grouping, max_iter)


def _split_second_level(
    context: SearchContext, best: Candidate, grouping: GroupingConfig, max_iter: int
) -> Candidate:
    """Split stages into their compute groups while that helps: every combination when few
    stages can be split (``_JOINT_SPLIT_GROUPS``), else greedily, one stage at a time."""
    capability = context.profile.capability_vector()

    def compute_parts(ranks: tuple[int, ...]) -> Structure:
        """The stage's compute groups, fastest first; () when it does not split."""
        parts = group_by_compute(capability, ranks, grouping) if len(ranks) > 1 else ()
        if len(parts) < 2:
            return ()
        return tuple(sorted(parts, key=lambda p: -float(capability[list(p)].mean())))

    def score(structure: Structure, *, screen: bool = False) -> Candidate | None:
        """The structure's best (schedule, m) on its partition, refined when it is short;
        ``screen``: first under the best's own pair, and only there when far behind
        (``_SPLIT_SCREEN``)."""
        ranges = context.partition(structure)
        if ranges is None:
            return None
        if screen:
            at_pair = context.evaluate(structure, ranges, best.schedule, best.num_microbatches)
            if at_pair is not None and at_pair.step_time_s > best.step_time_s * _SPLIT_SCREEN:
                return at_pair
        scored = context.best_over_pairs(structure, ranges)
        if scored is not None and len(structure) <= _REFINE_EVERY_SPLIT:
            scored = context.refine(scored, max_iter)
        return scored

    options: list[list[Structure]] = []
    for ranks in best.structure:
        parts = compute_parts(ranks)
        options.append([(ranks,), parts, parts[::-1]] if parts else [(ranks,)])
    if sum(len(o) > 1 for o in options) <= _JOINT_SPLIT_GROUPS:
        for choice in itertools.product(*options):
            structure = tuple(unit for part in choice for unit in part)
            if structure == best.structure:
                continue
            scored = score(structure)
            if improves(scored, best):
                best = scored
    else:
        for _ in range(max(1, max_iter)):
            improved = False
            for index, ranks in enumerate(best.structure):
                parts = compute_parts(ranks)
                if not parts:
                    continue
                candidate = best
                for ordered in (parts, parts[::-1]):
                    structure = best.structure[:index] + ordered + best.structure[index + 1 :]
                    scored = score(structure, screen=True)
                    if improves(scored, candidate):
                        candidate = scored
                if candidate is not best:
                    best, improved = candidate, True
                    break
            if not improved:
                break
    if len(best.structure) > _REFINE_EVERY_SPLIT:
        best = context.refine(best, max_iter)
    return best
