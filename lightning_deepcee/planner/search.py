"""Plan search: pick the stages, block split, micro-batch count and schedule of a cluster.

This module owns the planner's entry points:

- :func:`plan_search`: DeepCEE's parallel strategy planner, the plan with the lowest predicted
  step time;
- :func:`make_plan`: a fully specified candidate (stage devices + block ranges + schedule +
  number of micro-batches) turned into a :class:`~lightning_deepcee.planner.plan.Plan` with
  speed-proportional, memory-bounded batch shares and the cost model's prediction;
- :func:`baseline_plans`: the best pure data-parallel plan and the best plain pipeline (one
  stage per device, rank order); :func:`plan_search` is never predicted worse than either
  (by more than ``device_gain``, when it keeps fewer devices).

The candidate space of :func:`plan_search` (see ``docs/planner.md``):

1. pure data parallelism: one stage holding every device;
2. a plain pipeline: one stage per device in rank order (when there are enough blocks);
3. DeepCEE's structure: one stage per first-level network group, in an order found by beam
   search, each optionally split into its second-level compute groups
   (:mod:`lightning_deepcee.planner.units`);

each with the compute-balanced block partition (refined by moving boundaries,
:mod:`lightning_deepcee.planner.candidates`), every micro-batch count of
``microbatch_candidates`` that divides the global batch and every generated schedule of
``schedules``. When ``schedules`` holds ``"compact"`` (the default), the best layouts are then
given the compact zero-bubble schedule fitted to their own costs
(:mod:`lightning_deepcee.planner.compact_fit`), which replaces the generated schedule only where
it is predicted faster.

Before all that, the search chooses its devices: it runs on every device subset that
:func:`~lightning_deepcee.planner.subsets.candidate_subsets` proposes (whole network groups or
the slowest compute groups left out) and keeps the fastest prediction; the ranks a plan leaves
out are its ``idle_ranks``, and its notes give the prediction with every device.

Pure: numpy, scipy and the standard library (no torch, no lightning).
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable, Sequence

from lightning_deepcee.planner.candidates import (
    Candidate,
    MapFn,
    SearchContext,
    Structure,
    serial_map,
)
from lightning_deepcee.planner.compact_fit import fit_compact_pool
from lightning_deepcee.planner.evaluator import Evaluator
from lightning_deepcee.planner.infeasible import infeasible
from lightning_deepcee.planner.plan import Plan, compact_ranks
from lightning_deepcee.planner.prediction import CostModelConfig
from lightning_deepcee.planner.set_scores import quick_step_time, score_sets
from lightning_deepcee.planner.subsets import (
    SubsetProfiles,
    candidate_subsets,
    compute_bound_s,
    lift,
    sample_rates,
)
from lightning_deepcee.planner.units import network_units, search_units
from lightning_deepcee.profiler.data import ClusterProfile
from lightning_deepcee.profiler.grouping import GroupingConfig, group_devices
from lightning_deepcee.schedule.actions import format_actions
from lightning_deepcee.schedule.compact import COST_AWARE_SCHEDULE_KINDS
from lightning_deepcee.schedule.generators import SCHEDULE_KINDS

__all__ = [
    "DEFAULT_MAX_STAGES",
    "DEVICE_GAIN",
    "DeviceSetScore",
    "baseline_plans",
    "make_plan",
    "plan_search",
]

DEFAULT_MAX_STAGES = 16
"""Network groups beyond this many (or beyond the number of blocks) are merged by bandwidth."""


MAX_SUBSET_SEARCHES = 12
"""Device subsets :func:`plan_search` scores besides every device (the most promising)."""
FULL_SEARCHES = 2
"""Device sets (the best scored) that get the full search."""
DEVICE_GAIN = 0.05
"""Default ``device_gain`` of :func:`plan_search`: the predicted gain a larger device set must
bring over a smaller one to be chosen."""
LARGE_CLUSTER = 64
"""Beyond this many devices, a quarter as many device sets are scored (half as many zones) and
only the best gets the full search: the quick search of a large set costs about a second, and
sets that differ by a few of a thousand devices score within a few percent of each other,
inside ``device_gain``."""


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
    choose_devices: bool = True,
    device_gain: float = DEVICE_GAIN,
    alternatives: list[Plan] | None = None,
    map_fn: MapFn = serial_map,
    device_sets: dict[tuple[int, ...], DeviceSetScore] | None = None,
    map_width: int = 1,
) -> Plan:
    """Search for the plan with the lowest predicted step time, on the best set of devices.

    Args:
        profile: the measured (or declared) cluster.
        num_blocks: the model's number of blocks; must equal ``profile.num_blocks``.
        global_batch_size: samples per optimizer step.
        schedules: schedule kinds to consider; ``"compact"`` is fitted to the best layouts
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
        choose_devices: also search device subsets and leave the others idle when that is
            predicted faster; ``False`` plans on every device.
        device_gain: a device set is chosen over one with fewer devices only when predicted
            at least this fraction faster (0.05: 5%). A smaller gain is inside the cost model's
            error, and every extra device adds links whose bandwidth can fall and a device that
            can fail; 0 takes the fastest prediction whatever its size.
        alternatives: when given, filled with the best plans of the other candidates the search
            scored in full (the other fully searched device set, the other candidate kinds and
            the next best layouts on each, each at its fastest schedule and micro-batch count),
            each once, fastest prediction first; the plan trial times those the cost model
            cannot rank against the result.
        map_fn: runs the full searches' independent calls (refining each of the best orders,
            fitting the compact schedule to each layout at each micro-batch count); one that
            spreads them over other processes (``DeepCEEStrategy`` at set-up) returns the same
            plan sooner.
        device_sets: when given, filled with every device set the search scored (its ranks,
            whole-cluster numbering) and its prediction: why the chosen devices won.
        map_width: how many calls ``map_fn`` runs at once; the device sets' quick searches go
            to it in waves of this many (:func:`~.set_scores.score_sets`: the same scores
            whatever the width).

    Returns:
        The best plan; its ``notes`` name the candidate kind and the baselines' predictions,
        and, when it leaves devices idle, the prediction with every device.

    Raises:
        ValueError: bad arguments; a global batch smaller than every micro-batch count; no
            candidate fits in memory (the message says whether even one block, or the whole
            model spread over ``num_blocks`` stages, is too large).
    """
    _check_request(profile, num_blocks, schedules)
    if isinstance(device_gain, bool) or not 0 <= device_gain < 1:
        raise ValueError(f"device_gain: expected a fraction in [0, 1), got {device_gain!r}")
    search = functools.partial(
        _search_devices,
        num_blocks=num_blocks,
        global_batch_size=global_batch_size,
        schedules=schedules,
        microbatch_candidates=microbatch_candidates,
        beam_width=beam_width,
        max_iter=max_iter,
        memory_check=memory_check,
        seed=seed,
        grouping=grouping,
        config=config,
        max_stages=max_stages,
        map_fn=map_fn,
    )
    found: list[Plan] = [] if alternatives is None else alternatives
    with_bounds = functools.partial(_with_bounds, profile=profile, config=config)
    sets: dict[tuple[int, ...], DeviceSetScore] = {} if device_sets is None else device_sets
    if not choose_devices or profile.num_devices == 1:
        best = search(profile, others=found)
        _keep_others(found, best)
        sets[tuple(range(profile.num_devices))] = DeviceSetScore(best.predicted_step_time_s, True)
        return with_bounds(best, global_batch_size)
    # Every candidate device set gets a quick search (one generated schedule, a beam of one, one
    # refinement round), most promising first and only while its compute bound can still beat
    # the best quick plan; the best sets then get the full search.
    generated = tuple(k for k in schedules if k != "compact")
    large = profile.num_devices > LARGE_CLUSTER
    quick = functools.partial(
        search,
        schedules=generated[:1],
        beam_width=1,
        max_iter=min(max_iter, 1),
        map_fn=serial_map,  # its calls take milliseconds: map_fn gets whole quick searches
    )
    full_searches = 1 if large else FULL_SEARCHES
    everyone = tuple(range(profile.num_devices))
    groups = group_devices(profile, grouping)
    subsets = candidate_subsets(profile, groups)
    rates = sample_rates(profile)
    bound = {ranks: compute_bound_s(rates, ranks, global_batch_size) for ranks in subsets}
    most = MAX_SUBSET_SEARCHES // 4 if large else MAX_SUBSET_SEARCHES
    order = [everyone, *sorted(subsets[1:], key=bound.__getitem__)[:most]]
    most = MAX_SUBSET_SEARCHES // 2 if large else MAX_SUBSET_SEARCHES  # zones: small, quick
    subset_profile = SubsetProfiles(profile)
    # Each zone (network group) alone is scored too, most promising first while its bound can
    # beat the best zone: the compute bound ignores the links, so sets across a slow WAN rank
    # above a zone they cannot beat, and the cap above may leave every zone out.
    for group in groups.network_groups:
        zone = tuple(sorted(group))
        bound.setdefault(zone, compute_bound_s(rates, zone, global_batch_size))
    zones = sorted((tuple(sorted(g)) for g in groups.network_groups), key=bound.__getitem__)[:most]
    scored = score_sets(
        order,
        zones,
        bound,
        score=functools.partial(quick_step_time, quick),
        profiles=subset_profile,
        map_fn=map_fn,
        width=map_width,
    )
    if not scored:
        return search(profile)  # raises the whole cluster's reason
    finalists = sorted(scored, key=scored.__getitem__)[:full_searches]
    best_zone = min((z for z in zones if z in scored), key=scored.__getitem__, default=None)
    if best_zone is not None and best_zone not in finalists:
        finalists.append(best_zone)  # the answer is never slower than the best zone alone
    if not large and everyone not in finalists:
        # The quick search (one schedule, a beam of one) can rank every device below a subset
        # that a full search over every device, baselines included, beats.
        finalists.append(everyone)
    full: dict[tuple[int, ...], Plan] = {}
    others: dict[tuple[int, ...], list[Plan]] = {}
    searched = _search_each(search, [subset_profile(r) for r in finalists], map_fn, map_width)
    for ranks, (plan, rest) in zip(finalists, searched, strict=True):
        full[ranks], others[ranks] = plan, rest
    faster = min(full, key=lambda ranks: full[ranks].predicted_step_time_s)
    within = full[faster].predicted_step_time_s * (1 + device_gain)
    if best_zone is not None:  # fewer devices, but never slower than the best zone alone
        within = min(within, full[best_zone].predicted_step_time_s)
    best_ranks = min(
        (ranks for ranks in full if full[ranks].predicted_step_time_s <= within),
        key=lambda ranks: (len(ranks), full[ranks].predicted_step_time_s),
    )
    best = full[best_ranks]
    sets.update((ranks, DeviceSetScore(seconds, False)) for ranks, seconds in scored.items())
    sets.update(
        (ranks, DeviceSetScore(plan.predicted_step_time_s, True)) for ranks, plan in full.items()
    )
    for ranks in full:
        mine = [*([] if ranks == best_ranks else [full[ranks]]), *others[ranks]]
        found += [lift(p, ranks, profile.num_devices) for p in mine]
    _keep_others(found, lift(best, best_ranks, profile.num_devices))
    if best_ranks == everyone:
        return with_bounds(best, global_batch_size)
    if everyone in full:
        with_every = f"{full[everyone].predicted_step_time_s * 1e3:.2f} ms"
    else:
        with_every = f"{scored[everyone] * 1e3:.2f} ms (quick search)"
    idle = [r for r in everyone if r not in best_ranks]
    more = ""
    if faster != best_ranks:  # a larger set is predicted faster, by less than device_gain
        if faster != everyone:
            more = f", with devices {compact_ranks(faster)} "
            more += f"{full[faster].predicted_step_time_s * 1e3:.2f} ms"
        more += f" (fewer devices within the {device_gain:.0%} device_gain)"
    notes = (
        f"devices {compact_ranks(best_ranks)} ({len(idle)} idle: {compact_ranks(idle)}): predicted "
        f"{best.predicted_step_time_s * 1e3:.2f} ms, with every device {with_every}{more}; "
        f"{best.notes}"
    )
    return with_bounds(lift(best, best_ranks, profile.num_devices, notes), global_batch_size)


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceSetScore:
    """What the search predicted for one device set."""

    step_time_s: float
    """Predicted step time of the set's best plan."""
    full: bool
    """Whether the set got the full search (else the quick one: one generated schedule, a beam
    of one, one refinement round; an upper bound on what a full search would find)."""


def _with_bounds(
    plan: Plan, global_batch_size: int, *, profile: ClusterProfile, config: CostModelConfig | None
) -> Plan:
    """``plan`` with its compute bounds and where its predicted step goes."""
    rates = sample_rates(profile)
    bound = compute_bound_s(rates, plan.ranks, global_batch_size)
    evaluator = Evaluator(profile, config)
    p = evaluator.predict_plan(plan)
    pipeline = p.pipeline_s + p.allreduce_s + p.optimizer_s
    parts = {
        "bound": bound,
        "imbalance": p.compute_s - bound,
        "stalls": p.pipeline_s - p.compute_s - p.transfer_s,
        "transfers": p.transfer_s,
        "allreduce": p.allreduce_s,
        "optimizer": p.optimizer_s,
        "cpu_quota": max(0.0, p.step_time_s - pipeline),
    }
    why = evaluator.hops.explain(plan.stages, plan.microbatch_size, plan.hop_compression)
    return dataclasses.replace(
        plan,
        notes=f"{plan.notes}; {why}" if why else plan.notes,
        compute_bound_s=bound,
        cluster_bound_s=compute_bound_s(rates, range(profile.num_devices), global_batch_size),
        step_parts_s=parts,
    )


def _search_each(
    search: Callable[..., Plan],
    profiles: Sequence[ClusterProfile],
    map_fn: MapFn,
    width: int,
) -> list[tuple[Plan, list[Plan]]]:
    """The full search of each finalist device set and its other best plans. When ``map_fn``
    runs calls side by side, one call per set, each search serial inside (one wide map instead
    of a dozen narrow ones, each a wait for its slowest call); else one set after another, each
    spreading its own calls."""
    if width > 1 and len(profiles) > 1:
        serial = functools.partial(search, map_fn=serial_map)
        costs = [float(p.num_devices**2) for p in profiles]  # larger sets have more to search
        found: list[tuple[Plan, list[Plan]]] = map_fn(
            functools.partial(_full_search, serial), list(profiles), costs
        )
        return found
    return [_full_search(search, profile) for profile in profiles]


def _full_search(search: Callable[..., Plan], profile: ClusterProfile) -> tuple[Plan, list[Plan]]:
    """``search(profile)`` and the other best plans it scored."""
    others: list[Plan] = []
    return search(profile, others=others), others


def _keep_others(found: list[Plan], best: Plan) -> None:
    """Sort ``found`` by prediction, each layout once (its fastest), without ``best``'s."""
    seen = {best.layout_key}
    kept = []
    for plan in sorted(found, key=lambda p: p.predicted_step_time_s):
        key = plan.layout_key
        if key not in seen:
            seen.add(key)
            kept.append(plan)
    found[:] = kept


def _search_devices(
    profile: ClusterProfile,
    *,
    num_blocks: int,
    global_batch_size: int,
    schedules: Sequence[str],
    microbatch_candidates: Sequence[int],
    beam_width: int,
    max_iter: int,
    memory_check: bool,
    seed: int,
    grouping: GroupingConfig | None,
    config: CostModelConfig | None,
    max_stages: int | None,
    map_fn: MapFn,
    others: list[Plan] | None = None,
) -> Plan:
    """:func:`plan_search` on every device of ``profile``; ``others`` (when given) gets the
    best plan of every other finalist and of the next best layouts."""
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
    baselines = _baselines(context, max_iter, map_fn)
    finalists = dict(baselines)
    units, note = network_units(context, grouping, limit)
    layouts = search_units(
        context, units, grouping, beam_width, max_iter, random.Random(seed), map_fn
    )
    if layouts:
        finalists["deepcee"] = layouts[0]
    if not finalists:
        raise infeasible(context)
    name, best = min(finalists.items(), key=lambda item: item[1].step_time_s)
    fitted_note = ""
    if "compact" in schedules:
        # The winner under the generated schedules need not win once each layout is fitted.
        pool = sorted(
            [*finalists.items(), *(("deepcee", scored) for scored in layouts[1:])],
            key=lambda item: item[1].step_time_s,
        )
        name, best, fitted_note = fit_compact_pool(context, pool, name, best, map_fn)
    listed = ", ".join(
        f"{other}={scored.step_time_s * 1e3:.2f} ms"
        for other, scored in sorted(finalists.items())
        if other != name
    )
    notes = f"{note}chosen: {name}; other candidates: {listed or 'none fit'}{fitted_note}"
    if others is not None:
        for kind, scored in [*finalists.items(), *(("deepcee", s) for s in layouts[1:8])]:
            if scored is not best:
                others.append(plan_from_candidate(profile, scored, global_batch_size, kind))
    return plan_from_candidate(profile, best, global_batch_size, notes)


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
    context = SearchContext(
        Evaluator(profile, config),
        global_batch_size=global_batch_size,
        schedules=(schedule,),
        microbatch_counts=(num_microbatches,),
        memory_check=memory_check,
    )
    structure = tuple(tuple(int(r) for r in ranks) for ranks in stage_ranks)
    ranges = tuple((int(a), int(b)) for a, b in block_ranges)
    scored = context.evaluate(structure, ranges, schedule, num_microbatches)
    return (
        None if scored is None else plan_from_candidate(profile, scored, global_batch_size, notes)
    )


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
        name: plan_from_candidate(profile, scored, global_batch_size, name)
        for name, scored in _baselines(context, max_iter).items()
    }


def plan_from_candidate(
    profile: ClusterProfile, scored: Candidate, global_batch_size: int, notes: str
) -> Plan:
    """The :class:`Plan` of a scored candidate (with a compact schedule's fitted actions)."""
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
        hop_compression=p.hop_compression,
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
) -> SearchContext:
    """The evaluation context shared by the baselines and the full search."""
    counts = _microbatch_counts(microbatch_candidates, global_batch_size)
    return SearchContext(
        Evaluator(profile, config),
        global_batch_size=global_batch_size,
        schedules=tuple(k for k in schedules if k in SCHEDULE_KINDS),  # compact: fitted after
        microbatch_counts=counts,
        memory_check=memory_check,
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


def _baselines(
    context: SearchContext, max_iter: int, map_fn: MapFn = serial_map
) -> dict[str, Candidate]:
    """The best data-parallel and plain-pipeline candidates, each found by its own call of
    ``map_fn`` (absent when it does not fit)."""
    n = context.profile.num_devices
    structures: dict[str, Structure] = {"data_parallel": (tuple(range(n)),)}
    if n <= context.profile.num_blocks and n > 1:
        structures["pipeline"] = tuple((r,) for r in range(n))
    found = map_fn(functools.partial(_baseline, context, max_iter), list(structures.values()))
    return {name: c for name, c in zip(structures, found, strict=True) if c is not None}


def _baseline(context: SearchContext, max_iter: int, structure: Structure) -> Candidate | None:
    ranges = context.partition(structure)
    scored = None if ranges is None else context.best_over_pairs(structure, ranges)
    return None if scored is None else context.refine(scored, max_iter)
