"""The adapter's slow response as plain logic: the profile as the links behave now, and whether a
new plan is worth moving blocks for.

Pure (stdlib plus the pure core: profiler data, planner), tested in one process. The Lightning
Callback (:class:`~lightning_deepcee.callbacks.adapter.DynamicEnvironmentAdapter`) reads its
monitor's link figures (every rank's monitor sees every rank's transfers), calls
:func:`observed_profile` and :func:`choose_replan` on rank 0, broadcasts the
:class:`ReplanChoice` and, when it says so, has the strategy move the blocks
(``DeepCEEStrategy.apply_plan``); the clock then confirms the move (``adapter/guard.py``).
:func:`observed_profile` is also what the split gate (``adapter/gate.py``) predicts on.

Roughly, on a ``replan`` decision:

1. every watched pair the monitor finds off its expectation (its link in state ``degraded`` or
   ``improved``; every pair of a shared link) scales the profile's bandwidth of that pair by
   ``measured / expected`` (:func:`observed_profile`);
2. the current plan is re-predicted on that profile, a new plan is searched on it
   (:func:`choose_replan`);
3. the new plan is applied only if its predicted step time beats the re-predicted current one
   by the margin ``gain``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_deepcee.adapter.monitor import Link, LinkState
from lightning_deepcee.planner.cost_model import predict_plan
from lightning_deepcee.planner.plan import Plan
from lightning_deepcee.planner.search import plan_search
from lightning_deepcee.profiler.data import ClusterProfile

__all__ = [
    "LinkFigure",
    "ReplanChoice",
    "choose_replan",
    "figure_from_decision",
    "figures_from_decision",
    "hopeless_search",
    "link_figures",
    "observed_profile",
    "placement_key",
    "profile_drift",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkFigure:
    """What the monitor knows of one directed link when a re-plan is considered."""

    link: Link
    """``(src, dst)`` ranks."""
    expected_bandwidth: float
    """What the monitor judges the link against, bytes/s (the plan's figure, or the calibrated
    one where that is lower)."""
    measured_bandwidth: float | None
    """The window median, bytes/s; ``None`` before the link's first sample."""
    state: LinkState
    """``normal``, ``degraded`` or ``improved``."""

    @property
    def ratio(self) -> float | None:
        """``measured / expected``, or ``None`` when there is no usable measurement."""
        measured, expected = self.measured_bandwidth, self.expected_bandwidth
        if measured is None or not (math.isfinite(measured) and measured > 0):
            return None
        if not (math.isfinite(expected) and expected > 0):
            return None
        return measured / expected


def link_figures(monitor_state: Mapping[str, Any]) -> list[LinkFigure]:
    """Every watched pair of a :meth:`LinkMonitor.state_dict` (the public, JSON-ready view).

    The pairs of a shared link all get the shared link's figures: a wide-area link that slowed
    down is slower for every pair that crosses it. A link still calibrating has no figure.

    The change is measured against the expectation, which may be calibrated below the plan's
    figure (a wire figure on another scale than the profiler's, or a link already slow when it
    was calibrated); the two readings differ, and each figure takes the one closer to no change:
    a degraded link against its expectation, an improved one against the larger of its
    expectation and the plan's figure. The planner then never sees a link faster, or slower,
    than both readings say.
    """
    figures = []
    for entry in monitor_state.get("links", []):
        expected = entry["expected"]
        if expected is None:
            continue
        state = entry["state"]
        if state == "improved" and entry.get("planned") is not None:
            expected = max(expected, entry["planned"])
        window = [float(v) for v in entry["apart" if state == "improved" else "together"]]
        for src, dst in entry["pairs"]:
            figures.append(
                LinkFigure(
                    link=(int(src), int(dst)),
                    expected_bandwidth=float(expected),
                    measured_bandwidth=statistics.median(window) if window else None,
                    state=state,
                )
            )
    return figures


def figure_from_decision(decision: Mapping[str, Any]) -> LinkFigure:
    """A ``replan`` decision's own figures (``Decision.to_dict()``) as a :class:`LinkFigure`
    of its first pair (:func:`figures_from_decision` gives every pair of a shared link)."""
    return figures_from_decision(decision)[0]


def figures_from_decision(decision: Mapping[str, Any]) -> list[LinkFigure]:
    """A decision's figures (``Decision.to_dict()``) for every pair it covers."""
    old, new = float(decision["old_bandwidth"]), float(decision["new_bandwidth"])
    pairs = decision.get("pairs") or [decision["link"]]
    return [
        LinkFigure(
            link=(int(src), int(dst)),
            expected_bandwidth=old,
            measured_bandwidth=new,
            state="degraded" if new < old else "improved",
        )
        for src, dst in pairs
    ]


def observed_profile(
    profile: ClusterProfile,
    figures: Iterable[LinkFigure],
    *,
    ceiling: ClusterProfile | None = None,
    changing_below: float = 0.0,
) -> tuple[ClusterProfile, dict[Link, tuple[float, float]]]:
    """``profile`` with the bandwidth of every link that is off its expectation rescaled.

    ``ceiling`` (the profile measured at setup): a link that got faster is raised at most to its
    figure there (never lowered by it). A rise is mostly a recovery, and the ratio of a link
    whose expectation was calibrated while it was slow reads high; a link faster than ever
    measured is for the profiler to confirm, not for an extrapolated ratio.

    A link in state ``degraded`` or ``improved`` gets ``profile bandwidth * measured / expected``.
    The ratio, not the measured figure itself, goes into the profile: the monitor's expectation
    may be calibrated on the running schedule's own transfers (wire time of its message sizes),
    which need not be on the scale of the profiler's large-message measurement, and a shared
    link's figure is a capacity, not a pair's; the ratio keeps the rescaled pair comparable with
    every other link of the matrix, which the planner weighs against it. When the expectation
    equals the profile's figure the two are the same.

    The reverse direction of a rescaled link gets the same ratio unless it has its own
    observation: a link watched in state ``normal`` keeps its figure, one off its expectation
    gets its own ratio. A pipeline link carries activations one way and gradients the other, so
    both directions are usually watched; when one is not (too few bytes, or no traffic in the
    current plan), assuming the same change both ways is the better guess for a WAN link (a
    congested or re-shaped path slows both directions) and the conservative one for the
    planner, which would otherwise route the gradients back over a link it believes unchanged.
    Later figures of one link override earlier ones (put decisions last).

    A link watched in state ``normal`` whose window reads under ``changing_below`` of its
    expectation (the monitor's ``1 / slow_threshold``) gets its own ratio too: it is changing
    and its state has not caught up. A cut into a receiver that waits for a CPU reads above the
    severe threshold for longer than the other direction (docs/adapter.md, Limits), and kept at
    its figure it would make a plan that sends over it look as fast as before the cut.

    Returns the new profile and, per rescaled link, ``(old, new)`` bandwidth in bytes/s.
    """
    normal: set[Link] = set()
    ratios: dict[Link, float] = {}
    for figure in figures:
        ratio = figure.ratio
        if ratio is None:
            continue
        if figure.state == "normal" and ratio >= changing_below:
            normal.add(figure.link)
            ratios.pop(figure.link, None)
        else:
            normal.discard(figure.link)
            ratios[figure.link] = ratio
    scaled = dict(ratios)
    for (src, dst), ratio in ratios.items():
        if (dst, src) not in ratios and (dst, src) not in normal:
            scaled[(dst, src)] = ratio
    n = profile.num_devices
    matrix = [list(row) for row in profile.bandwidth_bytes_per_s]
    changes: dict[Link, tuple[float, float]] = {}
    for (src, dst), ratio in sorted(scaled.items()):
        if not (0 <= src < n and 0 <= dst < n) or src == dst:
            raise ValueError(
                f"observed_profile: link {src}->{dst} is not a link of the profile's {n} devices"
            )
        old = matrix[src][dst]
        matrix[src][dst] = old * ratio
        if ratio > 1 and ceiling is not None:
            matrix[src][dst] = min(old * ratio, max(old, ceiling.bandwidth_bytes_per_s[src][dst]))
        changes[(src, dst)] = (old, matrix[src][dst])
    updated = dataclasses.replace(
        profile, bandwidth_bytes_per_s=tuple(tuple(row) for row in matrix)
    )
    return updated, changes


def profile_drift(before: ClusterProfile, after: ClusterProfile, tolerance: float) -> list[str]:
    """What changed by more than ``tolerance`` (a factor above one) either way between two
    observed profiles of one cluster: a link's bandwidth, a device's compute (its blocks'
    summed seconds). A search made on ``before`` is stale only for these; a monitor's state that
    changed without moving a figure (a link faster than its setup figure, where rises are
    capped) leaves the search's plan as good as it was."""
    if not tolerance > 1:
        raise ValueError(f"profile_drift: tolerance must be above 1, got {tolerance!r}")
    if before.num_devices != after.num_devices:
        raise ValueError("profile_drift: the profiles are of different clusters")

    def off(a: float, b: float) -> bool:
        return a > 0 and b > 0 and max(a / b, b / a) > tolerance

    out = [
        f"link {src}->{dst} {a / 1e6:.3g} -> {b / 1e6:.3g} MB/s"
        for src, (row_a, row_b) in enumerate(
            zip(before.bandwidth_bytes_per_s, after.bandwidth_bytes_per_s, strict=True)
        )
        for dst, (a, b) in enumerate(zip(row_a, row_b, strict=True))
        if src != dst and off(a, b)
    ]
    for old, new in zip(before.devices, after.devices, strict=True):
        a, b = sum(old.block_seconds), sum(new.block_seconds)
        if off(a, b):
            out.append(f"device {old.rank} computing x{b / a:.2f}")
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplanChoice:
    """The outcome of :func:`choose_replan`; plain data, broadcast from rank 0 as a dict."""

    apply: bool
    """Whether to move to ``plan``."""
    current_step_time_s: float
    """The running plan's step time predicted on the observed profile."""
    new_step_time_s: float | None
    """The searched plan's predicted step time (``None`` if the search failed)."""
    plan: Plan | None
    """The searched plan (``None`` if the search failed)."""
    reason: str
    """One line saying why."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe dict."""
        return {
            "apply": self.apply,
            "current_step_time_s": self.current_step_time_s,
            "new_step_time_s": self.new_step_time_s,
            "plan": None if self.plan is None else self.plan.to_dict(),
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplanChoice:
        """Inverse of :meth:`to_dict`."""
        plan, new_s = data.get("plan"), data["new_step_time_s"]
        return cls(
            apply=bool(data["apply"]),
            current_step_time_s=float(data["current_step_time_s"]),
            new_step_time_s=None if new_s is None else float(new_s),
            plan=None if plan is None else Plan.from_dict(plan),
            reason=str(data["reason"]),
        )


def placement_key(plan: Plan) -> list[Any]:
    """What a plan decides about placement (stages, devices, shares, schedule), JSON-ready;
    not its micro-batch count, which the fast response changes."""
    stages = [
        [list(st.block_range), list(st.ranks), [round(x, 6) for x in st.batch_shares]]
        for st in plan.stages
    ]
    return [stages, plan.schedule]


def _layout(plan: Plan) -> tuple[Any, ...]:
    stages = tuple(
        (s.block_range, s.ranks, tuple(round(x, 9) for x in s.batch_shares)) for s in plan.stages
    )
    return stages, plan.schedule, plan.num_microbatches, plan.stage_actions


def choose_replan(
    profile: ClusterProfile,
    current: Plan,
    *,
    gain: float,
    search: Callable[..., Plan] = plan_search,
    current_s: float | None = None,
) -> ReplanChoice:
    """Search a plan on ``profile`` and say whether it is worth moving to from ``current``.

    ``current`` (the running plan) is re-predicted on ``profile`` with the same cost model the
    search uses, so both figures are on one scale. The new plan is applied only if
    ``new < current * (1 - gain)``: a move sends the state of the blocks that change owner and
    re-calibrates the monitor, so a marginal predicted gain (within the cost model's error) is
    not worth it. ``search(profile, num_blocks=..., global_batch_size=...)`` defaults
    to :func:`~lightning_deepcee.planner.plan_search`; its ``ValueError`` (nothing fits) becomes
    a choice not to apply. ``current_s``: the running plan's step as the clock measured it, on
    the model's scale (``Replanner.clocked_step`` in ``callbacks/replanner.py``), in place of
    its prediction.
    """
    if not (isinstance(gain, int | float) and not isinstance(gain, bool) and 0 <= gain < 1):
        raise ValueError(f"choose_replan: gain must be in [0, 1), got {gain!r}")
    if current_s is None:
        current_s = predict_plan(profile, current).step_time_s
    try:
        new = search(
            profile, num_blocks=current.num_blocks, global_batch_size=current.global_batch_size
        )
    except ValueError as exc:
        return ReplanChoice(
            apply=False,
            current_step_time_s=current_s,
            new_step_time_s=None,
            plan=None,
            reason=f"the search found no plan ({exc})",
        )
    new_s = new.predicted_step_time_s
    if _layout(new) == _layout(current):
        apply, reason = False, "the search chose the running layout again"
    elif new_s < current_s * (1 - gain):
        apply = True
        reason = f"predicted {1 - new_s / current_s:.0%} faster (needs {gain:.0%})"
    else:
        apply = False
        reason = f"predicted gain {1 - new_s / current_s:.0%} is below the margin {gain:.0%}"
    return ReplanChoice(
        apply=apply, current_step_time_s=current_s, new_step_time_s=new_s, plan=new, reason=reason
    )


def hopeless_search(
    changes: dict[Any, tuple[float, float]],
    current_s: float,
    floor_s: float | None,
    gain: float,
    running: str,
) -> str | None:
    """Why no search can find a plan worth moving to, or None.

    The links as measured change no figure of the profile (a link that rose back to its setup
    figure, where rises are capped): the search would find the running plan again. Or the
    running plan's step ``current_s`` (described by ``running``) is within the margin of
    ``floor_s``, the step time of the plan the planner chose for the links as measured at
    setup: rises are capped at those figures, and a slower link never makes a plan faster, so
    no plan on the links as they are now can beat it.
    """
    if all(abs(new - old) <= 0.01 * old for old, new in changes.values()):
        return (
            "the links as measured change no figure of the profile (a rise is capped at the "
            "figure measured at setup), so a search would find the running plan again"
        )
    if floor_s is not None and floor_s >= current_s * (1 - gain):
        return (
            f"no plan can gain the margin {gain:.0%}: {running}, and no plan beats the "
            f"{floor_s * 1e3:.1f} ms of setup's plan on the links as measured at setup"
        )
    return None
