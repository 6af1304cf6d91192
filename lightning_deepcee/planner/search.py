"""Plan search: pick the stages, block split, micro-batch count and schedule of a cluster.

This module owns :func:`plan_search`, DeepCEE's parallel strategy planner, and its parts:

- :func:`heterogeneous_partition`: contiguous split of blocks over an ordered list of stages with
  *different* speeds, minimising the slowest stage (exact dynamic programme, ``O(p n^2)``).
- :func:`make_plan`: a fully specified candidate (stage devices + block ranges + schedule + number
  of micro-batches) turned into a :class:`~lightning_deepcee.planner.plan.Plan` with
  speed-proportional, memory-bounded batch shares and the cost model's prediction.
- :func:`baseline_plans`: the best pure data-parallel plan and the best plain pipeline (one stage
  per device, rank order); :func:`plan_search` is never predicted worse than either.

The candidate space of :func:`plan_search` (see ``docs/planner.md``):

1. pure data parallelism: one stage holding every device;
2. a plain pipeline: one stage per device in rank order (when there are enough blocks);
3. DeepCEE's structure: one stage per first-level network group (``group_devices``), in an order
   found by beam search, each optionally split into its second-level compute groups;

each with the block partition of :func:`heterogeneous_partition` (refined by moving boundaries),
every micro-batch count of ``microbatch_candidates`` that divides the global batch and every
generated schedule of ``schedules``. When ``schedules`` holds ``"compact"`` (the default), the
winning layout is then given the compact zero-bubble schedule fitted to its own stage and link
costs (:func:`~lightning_deepcee.schedule.compact_zero_bubble`), at each micro-batch count, under
the memory limits; it replaces the generated schedule only where it is predicted faster. It is
fitted once at the end rather than inside the search because fitting costs a few greedy
simulations per candidate, and it never predicts worse than ZB-H1 or 1F1B under the same caps.

Pure: numpy, scipy and the standard library (no torch, no lightning).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

import numpy as np
import numpy.typing as npt
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.spatial.distance import squareform

from lightning_deepcee.planner.cost_model import (
    CostModelConfig,
    Prediction,
    _Arrays,
    _arrays,
    _predict,
    _shares,
    _stage_costs,
    in_flight_microbatches,
)
from lightning_deepcee.planner.plan import Plan, StagePlan
from lightning_deepcee.profiler.data import ClusterProfile
from lightning_deepcee.profiler.grouping import (
    GroupingConfig,
    group_by_compute,
    group_by_network,
    group_devices,
    network_distances,
)
from lightning_deepcee.schedule.actions import format_actions
from lightning_deepcee.schedule.compact import (
    COST_AWARE_SCHEDULE_KINDS,
    compact_zero_bubble,
    default_max_in_flight,
)
from lightning_deepcee.schedule.generators import SCHEDULE_KINDS, StageSchedule

__all__ = [
    "DEFAULT_MAX_STAGES",
    "baseline_plans",
    "heterogeneous_partition",
    "make_plan",
    "plan_search",
]

DEFAULT_MAX_STAGES = 16
"""Network groups beyond this many (or beyond the number of blocks) are merged by bandwidth."""

_EXACT_PARTITIONS = 64
"""Structures with at most this many block partitions have all of them tried."""
_REFINED_ORDERS = 2
"""How many of the beam's final orders at least get boundary refinement and second-level
splitting."""
_REFINE_WINDOW = 1.25
"""Further final orders predicted within this factor of the best (before refinement) are refined
too: an order that loses unrefined by a few percent can win once its cuts move or a group is
split (a 4-device instance missed the exhaustive optimum by 8.6% refining only two)."""
_REFINE_ALL_UNITS = 4
"""With at most this many network units every final order is refined (at most ``4! = 24``
orders, ``beam_width`` finalists): cheap, and an order can rank third unrefined and win once
one of its groups is split."""
_REFINE_EVERY_SPLIT = 8
"""Up to this many stages every trial split is refined before it is compared; beyond, trial
splits are compared on the balanced partition and only the final structure is refined."""
_JOINT_SPLIT_GROUPS = 3
"""With at most this many splittable stages, every combination of their second-level splits
(unsplit, fastest part first, slowest first: ``3**k``) is tried, not only the greedy path: on a
4-device cluster of two pairs the best plan split both pairs, the slower device first in one,
while splitting either pair alone lost to not splitting, so the greedy search stopped 8% short."""
_COMPACT_GAIN = 0.02
"""The compact schedule replaces the generated one only when predicted this much faster (its
actions are fitted to measured costs; a marginal gain is within their noise)."""
_COMPACT_CANDIDATES = 3
"""The compact schedule is fitted to this many of the best distinct layouts (baselines and the
beam's refined orders), not only to the winner under generated schedules: on the lab's cee6
profiles the layout that won under ZB-H1 by 1% lost by 1% once both were fitted."""
_COMPACT_WINDOW = 1.5
"""Micro-batch counts whose best generated schedule is this much slower than the winner are not
fitted (the compact schedule gains at most the bubble)."""

Structure = tuple[tuple[int, ...], ...]
"""Devices of each stage, in pipeline order."""
Ranges = tuple[tuple[int, int], ...]
Array = npt.NDArray[np.float64]


# --------------------------------------------------------------------------------------------
# Heterogeneous partition
# --------------------------------------------------------------------------------------------


def _min_max_split(range_cost: Sequence[Array]) -> Ranges | None:
    """Contiguous split minimising ``max_s range_cost[s][start_s, end_s]``; None if all inf.

    ``range_cost[s]`` is an ``(n+1) x (n+1)`` matrix: the time stage ``s`` takes for blocks
    ``[i, j)`` (only ``i < j`` is read).
    """
    p = len(range_cost)
    n = range_cost[0].shape[0] - 1
    if p > n:
        return None
    upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    cuts = []
    for s in range(p):
        load = np.where(upper, np.maximum(best[:, None], range_cost[s]), np.inf)
        cut = np.argmin(load, axis=0)
        best = load[cut, np.arange(n + 1)]
        cuts.append(cut)
    if not math.isfinite(best[n]):
        return None
    ranges = []
    end = n
    for s in range(p - 1, -1, -1):
        start = int(cuts[s][end])
        ranges.append((start, end))
        end = start
    return tuple(ranges[::-1])


def heterogeneous_partition(
    block_costs: Sequence[float], stage_speeds: Sequence[float]
) -> list[tuple[int, int]]:
    """Split blocks over stages of different speeds so that the slowest stage is fastest.

    Stage ``s`` takes ``sum(block_costs[start:end]) / stage_speeds[s]`` for its half-open range;
    the order of the stages is fixed (it is the pipeline order). Exact, ``O(p n^2)``.
    """
    n, p = len(block_costs), len(stage_speeds)
    if p < 1 or p > n:
        raise ValueError(
            f"Cannot split {n} blocks into {p} stages: every stage needs at least one block "
            f"(use 1..{n} stages, or expose a finer list of blocks)"
        )
    if any(c < 0 or not math.isfinite(c) for c in block_costs):
        raise ValueError(f"block_costs: expected non-negative finite costs, got {block_costs!r}")
    if any(v <= 0 or not math.isfinite(v) for v in stage_speeds):
        raise ValueError(f"stage_speeds: expected positive finite speeds, got {stage_speeds!r}")
    prefix = np.concatenate([[0.0], np.cumsum(block_costs)])
    work = prefix[None, :] - prefix[:, None]
    ranges = _min_max_split([work / speed for speed in stage_speeds])
    assert ranges is not None  # every entry is finite when p <= n
    return list(ranges)


# --------------------------------------------------------------------------------------------
# Candidates
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Scored:
    step_time_s: float
    structure: Structure
    ranges: Ranges
    schedule: str
    num_microbatches: int
    stages: tuple[StagePlan, ...]
    prediction: Prediction
    stage_schedule: StageSchedule | None = None  # "compact" only: the fitted actions


def _improves(trial: _Scored | None, best: _Scored) -> TypeGuard[_Scored]:
    """Whether ``trial`` exists and is faster than ``best`` by more than rounding (1e-9 relative;
    ties keep the candidate found first, so the search is deterministic)."""
    return trial is not None and trial.step_time_s < best.step_time_s * (1 - 1e-9)


class _Context:
    """Everything one search evaluates candidates against, with memoisation."""

    def __init__(
        self,
        profile: ClusterProfile,
        *,
        global_batch_size: int,
        schedules: Sequence[str],
        microbatch_counts: Sequence[int],
        memory_check: bool,
        config: CostModelConfig,
    ) -> None:
        self.profile = profile
        self.arrays: _Arrays = _arrays(profile)
        self.global_batch_size = global_batch_size
        self.schedules = tuple(schedules)
        self.microbatch_counts = tuple(microbatch_counts)
        self.memory_check = memory_check
        self.config = config
        self._evaluated: dict[tuple[Structure, Ranges, str, int], _Scored | None] = {}
        self._range_cost: dict[tuple[int, ...], Array] = {}
        self._partition: dict[Structure, Ranges | None] = {}

    @property
    def pairs(self) -> list[tuple[str, int]]:
        return [(k, m) for m in self.microbatch_counts for k in self.schedules]

    def evaluate(
        self, structure: Structure, ranges: Ranges, schedule: str, m: int
    ) -> _Scored | None:
        key = (structure, ranges, schedule, m)
        if key not in self._evaluated:
            self._evaluated[key] = self._evaluate(structure, ranges, schedule, m)
        return self._evaluated[key]

    def _evaluate(
        self, structure: Structure, ranges: Ranges, schedule: str, m: int
    ) -> _Scored | None:
        b = self.global_batch_size / m
        in_flight = in_flight_microbatches(schedule, len(structure), m)
        stages = []
        for s, (ranks, block_range) in enumerate(zip(structure, ranges, strict=True)):
            shares = _shares(
                self.arrays, ranks, block_range, b, in_flight[s], self.config, self.memory_check
            )
            if shares is None:
                return None
            stages.append(StagePlan(block_range=block_range, ranks=ranks, batch_shares=shares))
        prediction = _predict(
            self.profile,
            stages,
            schedule,
            m,
            self.global_batch_size,
            self.config,
            breakdown=False,
        )
        if self.memory_check and not prediction.fits_memory:
            return None
        return _Scored(
            prediction.step_time_s, structure, ranges, schedule, m, tuple(stages), prediction
        )

    def best_over_pairs(self, structure: Structure, ranges: Ranges) -> _Scored | None:
        best: _Scored | None = None
        for schedule, m in self.pairs:
            scored = self.evaluate(structure, ranges, schedule, m)
            if scored is not None and (best is None or scored.step_time_s < best.step_time_s):
                best = scored
        return best

    def range_cost(self, ranks: tuple[int, ...]) -> Array:
        """Per-sample seconds of a stage on ``ranks`` for each block range ``[i, j)``.

        With speed-proportional shares the stage takes ``1 / sum_d (1 / T_d)`` per sample; a range
        whose parameter state does not fit every device is infinite.
        """
        if ranks not in self._range_cost:
            total = self.arrays.total[np.asarray(ranks)]
            with np.errstate(divide="ignore"):
                per_device = total[:, None, :] - total[:, :, None]
                speed = np.where(per_device > 0, 1.0 / per_device, np.inf).sum(axis=0)
                cost = np.where(speed > 0, 1.0 / speed, np.inf)
            if self.memory_check:
                params = self.arrays.parameter_prefix
                state = self.config.state_copies * (params[None, :] - params[:, None])
                cost = np.where(state > self.arrays.memory[list(ranks)].min(), np.inf, cost)
            self._range_cost[ranks] = cost
        return self._range_cost[ranks]

    def partition(self, structure: Structure) -> Ranges | None:
        if structure not in self._partition:
            if len(structure) > self.profile.num_blocks:
                self._partition[structure] = None
            else:
                costs = [self.range_cost(ranks) for ranks in structure]
                self._partition[structure] = _min_max_split(costs)
        return self._partition[structure]

    def refine(self, scored: _Scored, max_iter: int) -> _Scored:
        """Improve the block boundaries under the full cost model, then re-pick (schedule, m).

        The compute-balanced partition ignores transfers, which depend on where the cuts fall.
        When a structure has at most ``_EXACT_PARTITIONS`` partitions they are all tried, each
        with every (schedule, micro-batch count) pair (the best cuts depend on the pair: fewer,
        larger micro-batches favour other cuts than many small ones); otherwise up to
        ``max_iter`` rounds of hill climbing move one boundary, or two adjacent boundaries
        together (shifting a whole stage), by one block, keeping the best move.
        """
        current = scored
        p, n = len(current.ranges), self.profile.num_blocks
        if math.comb(n - 1, p - 1) <= _EXACT_PARTITIONS:
            for cuts in itertools.combinations(range(1, n), p - 1):
                bounds = (0, *cuts, n)
                ranges = tuple(itertools.pairwise(bounds))
                trial = self.best_over_pairs(current.structure, ranges)
                if _improves(trial, current):
                    current = trial
        else:
            for _ in range(max_iter):
                best = current
                for ranges in _neighbours(current.ranges):
                    trial = self.evaluate(
                        current.structure, ranges, current.schedule, current.num_microbatches
                    )
                    if _improves(trial, best):
                        best = trial
                if best is current:
                    break
                current = best
        again = self.best_over_pairs(current.structure, current.ranges)
        return again if again is not None and again.step_time_s < current.step_time_s else current


def _neighbours(ranges: Ranges) -> list[Ranges]:
    """Partitions one move away: one boundary, or two adjacent ones together, by +-1 block."""
    cuts = [start for start, _ in ranges[1:]]
    n = ranges[-1][1]
    out = []
    for first in range(len(cuts)):
        for last in range(first, min(first + 2, len(cuts))):
            for delta in (-1, 1):
                moved = list(cuts)
                for k in range(first, last + 1):
                    moved[k] += delta
                bounds = (0, *moved, n)
                if all(a < b for a, b in itertools.pairwise(bounds)):
                    out.append(tuple(itertools.pairwise(bounds)))
    return out


# --------------------------------------------------------------------------------------------
# Public helpers
# --------------------------------------------------------------------------------------------


def make_plan(
    profile: ClusterProfile,
    stage_ranks: Sequence[Sequence[int]],
    block_ranges: Sequence[tuple[int, int]],
    *,
    schedule: str,
    num_microbatches: int,
    global_batch_size: int,
    config: CostModelConfig | None = None,
    memory_check: bool = True,
    notes: str = "",
) -> Plan | None:
    """A :class:`Plan` for fixed stage devices and block ranges; ``None`` if it cannot fit memory.

    Batch shares are proportional to each device's speed on its stage's blocks, bounded by memory
    (:func:`~lightning_deepcee.planner.cost_model.speed_shares`).
    """
    context = _Context(
        profile,
        global_batch_size=global_batch_size,
        schedules=(schedule,),
        microbatch_counts=(num_microbatches,),
        memory_check=memory_check,
        config=config or CostModelConfig(),
    )
    structure = tuple(tuple(int(r) for r in ranks) for ranks in stage_ranks)
    ranges = tuple((int(a), int(b)) for a, b in block_ranges)
    scored = context.evaluate(structure, ranges, schedule, num_microbatches)
    return None if scored is None else _to_plan(profile, scored, global_batch_size, notes)


def _to_plan(profile: ClusterProfile, scored: _Scored, global_batch_size: int, notes: str) -> Plan:
    p = scored.prediction
    actions = None
    if scored.stage_schedule is not None:
        actions = tuple(format_actions(scored.stage_schedule[s]) for s in range(len(scored.stages)))
    return Plan(
        stage_actions=actions,
        stages=scored.stages,
        schedule=scored.schedule,
        num_microbatches=scored.num_microbatches,
        global_batch_size=global_batch_size,
        predicted_step_time_s=p.step_time_s,
        predicted_bubble_ratio=p.bubble_ratio,
        predicted_peak_memory_bytes=p.peak_memory_bytes,
        model_fingerprint=profile.model_fingerprint,
        cluster_fingerprint=profile.cluster_fingerprint,
        notes=notes,
    )


def _microbatch_counts(candidates: Sequence[int], global_batch_size: int) -> tuple[int, ...]:
    if (
        isinstance(global_batch_size, bool)
        or not isinstance(global_batch_size, int)
        or (global_batch_size < 1)
    ):
        raise ValueError(
            f"global_batch_size: expected a positive integer, got {global_batch_size!r}"
        )
    bad = [m for m in candidates if isinstance(m, bool) or not isinstance(m, int) or m < 1]
    if not candidates or bad:
        raise ValueError(
            f"microbatch_candidates: expected positive integers, got {list(candidates)!r}"
        )
    counts = tuple(sorted({m for m in candidates if m <= global_batch_size}))
    if not counts:
        raise ValueError(
            f"global_batch_size: {global_batch_size} samples is smaller than every micro-batch "
            f"count in microbatch_candidates={list(candidates)}; raise the global batch to at "
            f"least {min(candidates)} or add smaller counts"
        )
    divisors = tuple(m for m in counts if global_batch_size % m == 0)
    # Equal micro-batches when possible; otherwise the mean size is modelled (runtime pads).
    return divisors or counts


def _search_context(
    profile: ClusterProfile,
    global_batch_size: int,
    schedules: Sequence[str],
    microbatch_candidates: Sequence[int],
    memory_check: bool,
    config: CostModelConfig | None,
) -> _Context:
    """The evaluation context shared by the baselines and the full search."""
    return _Context(
        profile,
        global_batch_size=global_batch_size,
        schedules=tuple(k for k in schedules if k in SCHEDULE_KINDS),  # compact: fitted after
        microbatch_counts=_microbatch_counts(microbatch_candidates, global_batch_size),
        memory_check=memory_check,
        config=config or CostModelConfig(),
    )


def _check_request(profile: ClusterProfile, num_blocks: int, schedules: Sequence[str]) -> None:
    if num_blocks != profile.num_blocks:
        raise ValueError(
            f"num_blocks: the model has {num_blocks} blocks but the profile was measured on "
            f"{profile.num_blocks}; re-profile the cluster for this model"
        )
    unknown = [k for k in schedules if k not in COST_AWARE_SCHEDULE_KINDS]
    if not schedules or unknown or not any(k in SCHEDULE_KINDS for k in schedules):
        raise ValueError(
            f"schedules: expected a list of {', '.join(COST_AWARE_SCHEDULE_KINDS)} with at "
            f"least one generated kind ({', '.join(SCHEDULE_KINDS)}), got {list(schedules)!r}"
        )


def _baselines(context: _Context, max_iter: int) -> dict[str, _Scored]:
    n = context.profile.num_devices
    out: dict[str, _Scored] = {}
    structures: dict[str, Structure] = {"data_parallel": (tuple(range(n)),)}
    if n <= context.profile.num_blocks and n > 1:
        structures["pipeline"] = tuple((r,) for r in range(n))
    for name, structure in structures.items():
        ranges = context.partition(structure)
        if ranges is None:
            continue
        scored = context.best_over_pairs(structure, ranges)
        if scored is not None:
            out[name] = context.refine(scored, max_iter)
    return out


def baseline_plans(
    profile: ClusterProfile,
    *,
    global_batch_size: int,
    schedules: Sequence[str] = ("1f1b", "zb-h1"),
    microbatch_candidates: Sequence[int] = (1, 2, 4, 8, 16),
    max_iter: int = 20,
    memory_check: bool = True,
    config: CostModelConfig | None = None,
) -> dict[str, Plan]:
    """The best ``"data_parallel"`` and ``"pipeline"`` plans (absent when they do not fit)."""
    _check_request(profile, profile.num_blocks, schedules)
    context = _search_context(
        profile, global_batch_size, schedules, microbatch_candidates, memory_check, config
    )
    return {
        name: _to_plan(profile, scored, global_batch_size, name)
        for name, scored in _baselines(context, max_iter).items()
    }


# --------------------------------------------------------------------------------------------
# Network units: first-level groups, merged when there are more than stages allowed
# --------------------------------------------------------------------------------------------


def _group_bandwidth(bandwidth: Array, units: Sequence[tuple[int, ...]]) -> Array:
    """Slowest link between every two units (``inf`` on the diagonal)."""
    k = len(units)
    out = np.full((k, k), np.inf)
    for g in range(k):
        rows = bandwidth[np.asarray(units[g])]
        for h in range(k):
            if g != h:
                out[g, h] = rows[:, np.asarray(units[h])].min()
    return out


def _network_units(
    context: _Context, grouping: GroupingConfig, max_stages: int
) -> tuple[list[tuple[int, ...]], str]:
    groups = group_devices(context.profile, grouping)
    units = [tuple(g) for g in groups.network_groups]
    note = ""
    while len(units) > max_stages:
        merged = group_by_network(_group_bandwidth(context.arrays.bandwidth, units), grouping)
        if len(merged) == len(units):
            # No natural level left: cut the group tree at max_stages clusters.
            distance = network_distances(_group_bandwidth(context.arrays.bandwidth, units))
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
            f"{len(groups.network_groups)} network groups merged into {len(merged)} "
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
    context: _Context,
    units: Sequence[tuple[int, ...]],
    beam_width: int,
    score_pair: tuple[str, int],
    rng: random.Random,
) -> list[tuple[int, ...]]:
    """Beam search over partial orders, scored by their greedy completion; best orders first."""
    k = len(units)
    if k == 1:
        return [(0,)]
    unit_bandwidth = _group_bandwidth(context.arrays.bandwidth, units)
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
# The search
# --------------------------------------------------------------------------------------------


def plan_search(
    profile: ClusterProfile,
    *,
    num_blocks: int,
    global_batch_size: int,
    schedules: Sequence[str] = ("1f1b", "zb-h1", "compact"),
    microbatch_candidates: Sequence[int] = (1, 2, 4, 8, 16),
    beam_width: int = 8,
    max_iter: int = 20,
    memory_check: bool = True,
    seed: int = 0,
    grouping: GroupingConfig | None = None,
    config: CostModelConfig | None = None,
    max_stages: int | None = None,
) -> Plan:
    """Search for the plan with the lowest predicted step time.

    Args:
        profile: the measured (or declared) cluster.
        num_blocks: the model's number of blocks; must equal ``profile.num_blocks``.
        global_batch_size: samples per optimizer step.
        schedules: schedule kinds to consider; ``"compact"`` is fitted to the winning layout
            at the end (see the module docstring) and needs a generated kind beside it.
        microbatch_candidates: micro-batch counts to consider; those that divide
            ``global_batch_size`` are used (all that fit when none divides).
        beam_width: partial orders of the network groups kept at each level of the beam search
            (``l`` in DeepCEE). The search scores ``O(beam_width * k^2)`` complete orders for
            ``k`` network groups; with ``beam_width >= (k-1)!`` it is exhaustive.
        max_iter: rounds of boundary hill-climbing per finalist (each round moves one block
            boundary by one block, keeping the best improving move) and rounds of second-level
            splitting.
        memory_check: reject candidates whose predicted peak exceeds a device's memory, and bound
            batch shares by memory. ``False`` plans as if memory were unlimited.
        seed: seeds the random tie-breaking of the beam.
        grouping: thresholds of the two-level grouping.
        config: cost model constants.
        max_stages: most pipeline stages a DeepCEE candidate may have; more network groups are
            merged by bandwidth. Defaults to ``min(num_blocks, DEFAULT_MAX_STAGES)``.

    Returns:
        The best plan; its ``notes`` name the candidate kind and the baselines' predictions.

    Raises:
        ValueError: bad arguments; a global batch smaller than every micro-batch count; no
            candidate fits in memory (the message says whether even one block, or the whole
            model spread over ``num_blocks`` stages, is too large).
    """
    _check_request(profile, num_blocks, schedules)
    if isinstance(beam_width, bool) or not isinstance(beam_width, int) or beam_width < 1:
        raise ValueError(f"beam_width: expected a positive integer, got {beam_width!r}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 0:
        raise ValueError(f"max_iter: expected a non-negative integer, got {max_iter!r}")
    grouping = grouping or GroupingConfig()
    limit = min(num_blocks, max_stages or DEFAULT_MAX_STAGES)
    if limit < 1:
        raise ValueError(f"max_stages: expected a positive integer, got {max_stages!r}")
    context = _search_context(
        profile, global_batch_size, schedules, microbatch_candidates, memory_check, config
    )
    baselines = _baselines(context, max_iter)
    finalists = dict(baselines)
    units, note = _network_units(context, grouping, limit)
    layouts = _search_units(context, units, grouping, beam_width, max_iter, random.Random(seed))
    if layouts:
        finalists["deepcee"] = layouts[0]
    if not finalists:
        raise _infeasible(context)
    name, best = min(finalists.items(), key=lambda item: item[1].step_time_s)
    fitted_note = ""
    if "compact" in schedules:
        # Fit the compact schedule to the few best distinct layouts: the winner under the
        # generated schedules need not be the winner once each is fitted.
        pool = sorted(
            [*finalists.items(), *(("deepcee", scored) for scored in layouts[1:])],
            key=lambda item: item[1].step_time_s,
        )
        seen: set[tuple[Structure, Ranges]] = set()
        for kind, scored in pool:
            layout = (scored.structure, scored.ranges)
            if layout in seen:
                continue
            seen.add(layout)
            fitted = _fit_compact(context, scored)
            if (
                fitted is not None
                and fitted.step_time_s < scored.step_time_s * (1 - _COMPACT_GAIN)
                and fitted.step_time_s < best.step_time_s
            ):
                fitted_note = (
                    f"; compact schedule (m={fitted.num_microbatches}) "
                    f"{fitted.step_time_s * 1e3:.2f} ms vs {scored.schedule} "
                    f"(m={scored.num_microbatches}) {scored.step_time_s * 1e3:.2f} ms"
                )
                name, best = kind, fitted
            if len(seen) == _COMPACT_CANDIDATES:
                break
    others = ", ".join(
        f"{other}={scored.step_time_s * 1e3:.2f} ms"
        for other, scored in sorted(finalists.items())
        if other != name
    )
    notes = f"{note}chosen: {name}; other candidates: {others or 'none fit'}{fitted_note}"
    return _to_plan(profile, best, global_batch_size, notes)


def _fit_compact(context: _Context, scored: _Scored) -> _Scored | None:
    """The compact schedule fitted to ``scored``'s layout; the fastest over micro-batch counts.

    At each count the layout's batch shares come from the best generated schedule there. The
    compact schedule may hold every micro-batch in flight on every stage; when that does not fit
    a device's memory, as many as ZB-H1 (``min(p, m)``), else as 1F1B.
    """
    p = len(scored.structure)
    if p < 2:
        return None
    best: _Scored | None = None
    for m in context.microbatch_counts:
        structure, ranges = scored.structure, scored.ranges
        evaluated = (context.evaluate(structure, ranges, k, m) for k in context.schedules)
        fitting = [c for c in evaluated if c is not None]
        if not fitting:
            continue
        generated = min(fitting, key=lambda c: c.step_time_s)
        if generated.step_time_s > _COMPACT_WINDOW * scored.step_time_s:
            continue  # far behind at this count: fitting will not close the gap
        costs = _stage_costs(context.arrays, generated.stages, context.global_batch_size / m)
        # Most micro-batches in flight first (covers the slowest hops), then ZB-H1's, 1F1B's.
        for caps in ([m] * p, [min(p, m)] * p, default_max_in_flight(p, m)):
            schedule = compact_zero_bubble(costs, m, max_in_flight=caps)
            prediction = _predict(
                context.profile,
                generated.stages,
                "compact",
                m,
                context.global_batch_size,
                context.config,
                breakdown=False,
                stage_schedule=schedule,
            )
            if context.memory_check and not prediction.fits_memory:
                continue
            if best is None or prediction.step_time_s < best.step_time_s:
                best = _Scored(
                    prediction.step_time_s,
                    scored.structure,
                    scored.ranges,
                    "compact",
                    m,
                    generated.stages,
                    prediction,
                    schedule,
                )
            break  # the larger caps fit: the smaller ones cannot do better
    return best


def _search_units(
    context: _Context,
    units: Sequence[tuple[int, ...]],
    grouping: GroupingConfig,
    beam_width: int,
    max_iter: int,
    rng: random.Random,
) -> list[_Scored]:
    """Beam over unit orders, then refine, then try second-level splits; the refined layouts,
    best first (empty when none fits)."""
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
    finalists: list[_Scored] = []
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
    split = [
        _split_second_level(context, context.refine(scored, max_iter), grouping, max_iter)
        for scored in chosen
    ]
    return sorted(split, key=lambda scored: scored.step_time_s)


def _split_second_level(
    context: _Context, best: _Scored, grouping: GroupingConfig, max_iter: int
) -> _Scored:
    """Split stages into their compute groups while that helps: every combination when few
    stages can be split (``_JOINT_SPLIT_GROUPS``), else greedily, one stage at a time."""
    capability = context.profile.capability_vector()

    def compute_parts(ranks: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The stage's compute groups, fastest first; () when it does not split."""
        parts = group_by_compute(capability, ranks, grouping) if len(ranks) > 1 else ()
        if len(parts) < 2:
            return ()
        return tuple(sorted(parts, key=lambda p: -float(capability[list(p)].mean())))

    def score(structure: tuple[tuple[int, ...], ...]) -> _Scored | None:
        """The structure's best (schedule, m) on its partition, refined when it is short."""
        ranges = context.partition(structure)
        scored = None if ranges is None else context.best_over_pairs(structure, ranges)
        if scored is not None and len(structure) <= _REFINE_EVERY_SPLIT:
            scored = context.refine(scored, max_iter)
        return scored

    options: list[list[tuple[tuple[int, ...], ...]]] = []
    for ranks in best.structure:
        parts = compute_parts(ranks)
        options.append([(ranks,), parts, parts[::-1]] if parts else [(ranks,)])
    if sum(len(o) > 1 for o in options) <= _JOINT_SPLIT_GROUPS:
        for choice in itertools.product(*options):
            structure = tuple(unit for part in choice for unit in part)
            if structure == best.structure:
                continue
            scored = score(structure)
            if _improves(scored, best):
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
                    scored = score(structure)
                    if _improves(scored, candidate):
                        candidate = scored
                if candidate is not best:
                    best, improved = candidate, True
                    break
            if not improved:
                break
    if len(best.structure) > _REFINE_EVERY_SPLIT:
        best = context.refine(best, max_iter)
    return best


def _infeasible(context: _Context) -> ValueError:
    arrays = context.arrays
    copies = context.config.state_copies
    largest_memory = float(arrays.memory.max())
    per_block = np.diff(arrays.parameter_prefix) * copies
    total = float(arrays.parameter_prefix[-1]) * copies
    n = context.profile.num_blocks
    gib = 2.0**30
    if per_block.max() > largest_memory:
        block = int(per_block.argmax())
        return ValueError(
            f"No plan fits in memory: block {block} alone needs {per_block[block] / gib:.2f} GiB "
            f"of parameter state ({copies} copies of its parameters) but the largest device has "
            f"{largest_memory / gib:.2f} GiB. Split the model into smaller blocks or add memory."
        )
    needed = math.ceil(total / largest_memory)
    if needed > n:
        return ValueError(
            f"No plan fits in memory: the model's parameter state ({total / gib:.2f} GiB) needs at "
            f"least {needed} pipeline stages on the largest device ({largest_memory / gib:.2f} "
            f"GiB) but the model has only {n} blocks (fewer blocks than needed stages). Expose "
            "more, smaller blocks, or add devices with more memory."
        )
    return ValueError(
        f"No plan fits in memory: every candidate (pure data parallelism, a plain pipeline and "
        f"the network-group pipelines, with {list(context.microbatch_counts)} micro-batches) "
        f"exceeds some device's memory (smallest device: {float(arrays.memory.min()) / gib:.2f} "
        f"GiB; model parameter state: {total / gib:.2f} GiB). Use more micro-batches or a smaller "
        "global batch, or pass memory_check=False to plan anyway."
    )
