"""Rivals of a plan: the layouts the cost model cannot tell apart from it, for the clock to judge.

The cost model is right to about 10-15% on a measured profile, and a profile taken while every
device is busy reads each device a few percent off from one setup to the next. Layouts whose
predictions lie that close are a coin toss for the model, and a different one wins each time
the profile is taken. :func:`rival_plans` lists them, so that setup can time each for a few
steps (``lightning_deepcee.strategy.plan_trial``) and keep the fastest by the clock;
:func:`choose_rivals` adds the search's best plans of other structures
(``plan_search(alternatives=...)``).

A rival of :func:`rival_plans` keeps the plan's devices and stage order. It moves block
boundaries by at most two blocks in all (one boundary by one or two blocks, or two boundaries by
one each), or runs the plan's ranges or such near ones under another generated schedule or with
half or twice the micro-batches (:func:`rival_runs`): the model is least sure between schedules
and counts, whose fixed per-micro-batch costs and bubbles it predicts least well. Batch shares
are the cost model's for the new ranges, bounded by memory, so a rival fits wherever the plan
does.

Pure: the planner's own modules and the standard library.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Sequence

from lightning_deepcee.planner.candidates import Candidate, SearchContext
from lightning_deepcee.planner.evaluator import Evaluator
from lightning_deepcee.planner.partition import Ranges
from lightning_deepcee.planner.plan import Plan
from lightning_deepcee.planner.prediction import CostModelConfig
from lightning_deepcee.planner.search import plan_from_candidate
from lightning_deepcee.planner.subsets import lift, restrict
from lightning_deepcee.profiler.data import ClusterProfile

__all__ = [
    "RACE_MARGIN",
    "RIVAL_WITHIN",
    "TRIAL_STEPS",
    "TRIAL_WIN",
    "TrialRace",
    "choose_rivals",
    "out_of_race",
    "pick_timed",
    "rival_plans",
    "rival_runs",
]

RIVAL_WITHIN = 0.10
"""A rival is predicted at most this fraction slower than the plan: inside the cost model's
error on measured profiles (docs/benchmarks.md), so the model cannot rank the two."""

TRIAL_WIN = 0.02
"""A timed plan replaces the searched one (index 0 of :func:`pick_timed`) only when its step is
this fraction faster: timings of a few steps differ by a percent or two from run to run."""

RACE_MARGIN = 0.30
"""A rival stops being timed once its fastest step so far is this fraction (beyond
``device_gain``) slower than the fastest plan's median: one stalled step seldom costs that much,
and a plan that slow is never picked."""

TRIAL_STEPS = 3
"""Timed training steps per candidate. The first after a move also allocates the layout's
buffers and reads slower; the median of three sets it aside."""

RIVAL_SCHEDULES = ("1f1b", "zb-h1")
"""The generated schedules a rival may run (a compact plan's actions are fitted to its own
ranges, so its rivals run these too)."""


def rival_runs(plan: Plan) -> list[tuple[str, int]]:
    """The (schedule, micro-batch count) pairs a rival of ``plan`` may run: the plan's own
    first (a generated one in place of ``"compact"``), then :data:`RIVAL_SCHEDULES` with half,
    the same and twice its micro-batches, each count dividing the global batch."""
    m, batch = plan.num_microbatches, plan.global_batch_size
    counts = [c for c in (m, m // 2, 2 * m) if 1 <= c <= batch and batch % c == 0]
    own = [] if plan.schedule == "compact" else [(plan.schedule, m)]
    pairs = own + [(kind, c) for c in counts for kind in RIVAL_SCHEDULES]
    return list(dict.fromkeys(pairs))


def rival_plans(
    profile: ClusterProfile,
    plan: Plan,
    *,
    count: int,
    within: float = RIVAL_WITHIN,
    config: CostModelConfig | None = None,
    memory_check: bool = True,
    runs: Sequence[tuple[str, int]] | None = None,
) -> list[Plan]:
    """Up to ``count`` layouts near ``plan``, each predicted at most ``within`` slower: the
    fastest of each (schedule, micro-batch count) first, then the others, each part fastest
    prediction first (ties: the order the moves are listed in, so the result is deterministic).

    Args:
        profile: the profile ``plan`` was searched on (the whole cluster, idle ranks included).
        plan: a plan with one pipeline replica.
        count: most rivals returned; 0 returns none.
        within: the largest predicted slow-down of a rival, as a fraction of the plan's
            prediction on ``profile``.
        config: cost model constants (as the search used).
        memory_check: keep only layouts predicted to fit every device's memory.
        runs: the (schedule, micro-batch count) pairs a rival may run; default
            :func:`rival_runs`.

    Raises:
        ValueError: a negative ``count`` or ``within``, or a plan with several replicas.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count: expected a non-negative integer, got {count!r}")
    if isinstance(within, bool) or not within >= 0:
        raise ValueError(f"within: expected a non-negative fraction, got {within!r}")
    if plan.num_replicas != 1:
        raise ValueError("rival_plans: the plan has several data-parallel pipeline replicas")
    if count == 0 or plan.num_stages < 2:
        return []
    pairs = list(rival_runs(plan) if runs is None else runs)
    active = sorted({r for st in plan.stages for r in st.ranks})
    local = {rank: i for i, rank in enumerate(active)}
    sub = restrict(profile, active)
    context = SearchContext(
        Evaluator(sub, config),
        global_batch_size=plan.global_batch_size,
        schedules=sorted({kind for kind, _ in pairs}),
        microbatch_counts=sorted({m for _, m in pairs}),
        memory_check=memory_check,
    )
    structure = tuple(tuple(local[r] for r in st.ranks) for st in plan.stages)
    own: Ranges = tuple(st.block_range for st in plan.stages)
    itself = (own, plan.schedule, plan.num_microbatches)
    reference = Evaluator(profile, config).predict_plan(plan).step_time_s
    limit = reference * (1 + within)
    found: list[tuple[float, int, Candidate]] = []
    for index, (ranges, (kind, m)) in enumerate(itertools.product([own, *_near(own)], pairs)):
        if (ranges, kind, m) == itself:
            continue
        scored = context.evaluate(structure, ranges, kind, m)
        if scored is not None and scored.step_time_s <= limit:
            found.append((scored.step_time_s, index, scored))
    found.sort(key=lambda item: item[:2])
    firsts: dict[tuple[str, int], int] = {}
    for item in found:
        firsts.setdefault((item[2].schedule, item[2].num_microbatches), item[1])
    lead = set(firsts.values())
    ordered = sorted(found, key=lambda item: (item[1] not in lead, *item[:2]))
    rivals = []
    for _, _, scored in ordered[:count]:
        note = _rival_note(plan, reference, scored, moved=scored.ranges != own)
        made = plan_from_candidate(sub, scored, plan.global_batch_size, note)
        made = dataclasses.replace(
            made,
            model_fingerprint=plan.model_fingerprint,
            cluster_fingerprint=plan.cluster_fingerprint,
        )
        rivals.append(lift(made, active, profile.num_devices))
    return rivals


def _rival_note(plan: Plan, reference_s: float, scored: Candidate, *, moved: bool) -> str:
    """What a rival changes, and both predictions."""
    changes = ["block boundaries moved"] if moved else []
    if (scored.schedule, scored.num_microbatches) != (plan.schedule, plan.num_microbatches):
        changes.append(f"{scored.schedule} with {scored.num_microbatches} micro-batches")
    return (
        f"rival of the searched plan (predicted {reference_s * 1e3:.2f} ms): "
        f"{', '.join(changes)}, predicted {scored.step_time_s * 1e3:.2f} ms"
    )


def choose_rivals(
    profile: ClusterProfile,
    plan: Plan,
    alternatives: Sequence[Plan],
    count: int,
    *,
    config: CostModelConfig | None = None,
) -> list[Plan]:
    """Up to ``count`` plans to time against ``plan``, each predicted within ``RIVAL_WITHIN``
    of it, fastest prediction first: the search's best alternatives of another structure
    (device set, stages, schedule or micro-batch count; up to half the places, rounded up, the
    fastest), the near layouts of :func:`rival_plans` in the other places, any places left
    to the other alternatives. Each layout once, never ``plan``'s own. ``config``: as the
    search's."""
    reference = plan.predicted_step_time_s
    limit = reference * (1 + RIVAL_WITHIN)
    seen = {plan.layout_key}
    others = []
    for other in sorted(alternatives, key=lambda p: p.predicted_step_time_s):
        if other.predicted_step_time_s <= limit and other.layout_key not in seen:
            seen.add(other.layout_key)
            note = (
                f"alternative of the search, another structure: predicted "
                f"{other.predicted_step_time_s * 1e3:.2f} ms (the searched plan "
                f"{reference * 1e3:.2f} ms)"
            )
            others.append(dataclasses.replace(other, notes=note))
    first = others[: (count + 1) // 2]
    near = [
        p
        for p in rival_plans(profile, plan, count=count, config=config)
        if p.layout_key not in seen
    ]
    chosen = [*first, *near, *others[len(first) :]][:count]
    return sorted(chosen, key=lambda p: p.predicted_step_time_s)


def pick_timed(plans: Sequence[Plan], seconds: Sequence[float], device_gain: float) -> int:
    """Which of the timed ``plans`` trains (index 0: the searched plan): the search's rule on
    the clock's figures. Of the plans within ``device_gain`` of the fastest step, those with
    the fewest active devices (an extra device must pay for its links and its failures); of
    them the fastest, unless the searched plan is among them and within ``TRIAL_WIN``."""
    if not plans or len(plans) != len(seconds):
        raise ValueError(f"pick_timed: {len(plans)} plans and {len(seconds)} timings")
    fastest = min(seconds)
    eligible = [i for i, s in enumerate(seconds) if s <= fastest * (1 + device_gain)]
    fewest = min(len(plans[i].ranks) for i in eligible)
    pool = [i for i in eligible if len(plans[i].ranks) == fewest]
    best = min(pool, key=lambda i: seconds[i])
    if 0 in pool and seconds[best] > seconds[0] * (1 - TRIAL_WIN):
        return 0
    return best


def out_of_race(steps_s: Sequence[float], fastest_s: float, device_gain: float) -> bool:
    """Whether a rival timed ``steps_s`` so far can stop: its fastest step is slower than
    ``fastest_s`` (the fastest median timed before it) by more than ``device_gain`` (what
    :func:`pick_timed` still accepts) plus :data:`RACE_MARGIN`."""
    return bool(steps_s) and min(steps_s) > fastest_s * (1 + device_gain + RACE_MARGIN)


@dataclasses.dataclass(slots=True)
class TrialRace:
    """The plan trial's bookkeeping: the candidates (index 0 the searched plan) run one after
    the other, each for up to :data:`TRIAL_STEPS` timed steps (fewer once :func:`out_of_race`,
    judged on the steps after its first), then :func:`pick_timed` names the one that trains.
    Every rank holds one and feeds it the same figures, so all take the same moves."""

    plans: list[Plan]
    device_gain: float
    steps: list[list[float]] = dataclasses.field(default_factory=lambda: [[]])
    """Each candidate's timed steps in seconds, so far; the last list is the running one's."""
    winner: int | None = None
    """The index of the plan that trains, once every candidate ran."""

    @property
    def running(self) -> int:
        """The index of the candidate being timed (the winner once the race is over)."""
        return self.winner if self.winner is not None else len(self.steps) - 1

    @property
    def medians(self) -> list[float]:
        """Each finished candidate's median step (the running one's too, once it has steps)."""
        return [statistics.median(s) for s in self.steps if s]

    def record(self, seconds: float) -> int | None:
        """Add a timed step of the running candidate. Returns the index of the plan to run
        from the next step (the next candidate, or the winner when the race ends; it may be the
        running one), or ``None`` while the running candidate has steps to go."""
        if self.winner is not None:
            raise RuntimeError("TrialRace.record after the race ended")
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"TrialRace.record: a step of {seconds!r} s")
        steps = self.steps[-1]
        steps.append(seconds)
        done = self.medians[:-1]
        fastest = min(done, default=None)
        out = fastest is not None and out_of_race(steps[1:], fastest, self.device_gain)
        if len(steps) < TRIAL_STEPS and not out:
            return None
        if len(self.steps) < len(self.plans):
            self.steps.append([])
            return len(self.steps) - 1
        self.winner = pick_timed(self.plans, self.medians, self.device_gain)
        return self.winner


def _near(ranges: Ranges) -> list[Ranges]:
    """Every partition whose block boundaries lie at most two blocks away from those of
    ``ranges`` in all (one boundary by one or two, or two boundaries by one each), in a fixed
    order, without ``ranges`` itself."""
    cuts = [start for start, _ in ranges[1:]]
    n = ranges[-1][1]
    shifts: list[dict[int, int]] = []
    for i in range(len(cuts)):
        shifts += [{i: d} for d in (-2, -1, 1, 2)]
        for j in range(i + 1, len(cuts)):
            shifts += [{i: a, j: b} for a in (-1, 1) for b in (-1, 1)]
    out: list[Ranges] = []
    for shift in shifts:
        bounds = (0, *(c + shift.get(k, 0) for k, c in enumerate(cuts)), n)
        if all(a < b for a, b in itertools.pairwise(bounds)):
            out.append(tuple(itertools.pairwise(bounds)))
    return out
