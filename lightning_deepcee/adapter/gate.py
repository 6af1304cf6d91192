"""Decide with the model: what a change of micro-batch split is predicted to gain.

Pure (stdlib plus the pure core). Before the adapter changes the split it asks the cost model,
on the profile as the links behave now (:func:`~lightning_deepcee.adapter.observed_profile`),
what every split would cost: the running plan with ``num_microbatches * k`` micro-batches,
re-predicted with :func:`~lightning_deepcee.planner.predict_plan` for ``k = 1 .. max_split``
(``k = 1`` is the plan's own count, the one the planner chose). Roughly:

- a split ``k > 1`` is a deviation from the plan: it is the target only if it is predicted at
  least ``gain`` faster than the plan's own count; otherwise the target is the plan's count;
- a move to a target that splits more (or to another split) is made only if the target is
  predicted at least ``gain`` faster than the split in force;
- a move back to the plan's count is always made: the plan's choice needs no justification.

The re-plan has its gate in :func:`~lightning_deepcee.adapter.choose_replan`. Every action that
passes a gate is then confirmed by the clock (:mod:`lightning_deepcee.adapter.guard`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_deepcee.planner.cost_model import CostModelConfig, predict_plan
from lightning_deepcee.planner.plan import Plan
from lightning_deepcee.profiler.data import ClusterProfile

__all__ = ["SplitChoice", "choose_split", "with_microbatches"]


def with_microbatches(plan: Plan, num_microbatches: int) -> Plan:
    """``plan`` run with ``num_microbatches`` micro-batches, as the executor runs it.

    A ``compact`` plan's stored actions hold for its own count only; at any other count the
    strategy runs ZB-H1 (:meth:`Plan.stage_schedule`), so that is what is predicted.
    """
    if num_microbatches == plan.num_microbatches:
        return plan
    if plan.schedule == "compact":
        return dataclasses.replace(
            plan, num_microbatches=num_microbatches, schedule="zb-h1", stage_actions=None
        )
    return dataclasses.replace(plan, num_microbatches=num_microbatches)


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitChoice:
    """The outcome of :func:`choose_split`; plain data, broadcast from rank 0 as a dict."""

    apply: bool
    """Whether to change the split in force to ``split``."""
    current_split: int
    """The split in force when asked."""
    split: int
    """The split to run (``current_split`` when not applied)."""
    step_time_s: dict[int, float]
    """Predicted step time of every split considered, on the observed profile."""
    reason: str
    """One line saying why."""

    @property
    def gain(self) -> float:
        """Predicted relative gain of ``split`` over ``current_split`` (negative: slower)."""
        return 1 - self.step_time_s[self.split] / self.step_time_s[self.current_split]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe dict."""
        return {
            "apply": self.apply,
            "current_split": self.current_split,
            "split": self.split,
            "step_time_s": {str(k): v for k, v in sorted(self.step_time_s.items())},
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SplitChoice:
        """Inverse of :meth:`to_dict`."""
        return cls(
            apply=bool(data["apply"]),
            current_split=int(data["current_split"]),
            split=int(data["split"]),
            step_time_s={int(k): float(v) for k, v in data["step_time_s"].items()},
            reason=str(data["reason"]),
        )


def choose_split(
    profile: ClusterProfile,
    plan: Plan,
    *,
    current_split: int,
    max_split: int,
    gain: float,
    config: CostModelConfig | None = None,
) -> SplitChoice:
    """The split to run on ``profile`` (see the module docstring).

    ``plan`` is the running plan at its own micro-batch count (split 1); a split ``k`` runs
    ``plan.num_microbatches * k`` micro-batches, so only the ``k`` whose count fits the global
    batch are considered.
    """
    if not (isinstance(gain, int | float) and not isinstance(gain, bool) and 0 <= gain < 1):
        raise ValueError(f"choose_split: gain must be in [0, 1), got {gain!r}")
    if max_split < 1 or current_split < 1:
        raise ValueError(
            f"choose_split: expected max_split >= 1 and current_split >= 1, got {max_split} "
            f"and {current_split}"
        )
    base = plan.num_microbatches
    splits = {k for k in range(1, max_split + 1) if base * k <= plan.global_batch_size} | {
        current_split
    }
    times = {
        k: predict_plan(profile, with_microbatches(plan, base * k), config=config).step_time_s
        for k in sorted(splits)
    }
    best = min(sorted(times), key=lambda k: times[k])
    best_gain = 1 - times[best] / times[1]
    target = best if best != 1 and best_gain > gain else 1

    def choice(apply: bool, split: int, reason: str) -> SplitChoice:
        return SplitChoice(
            apply=apply, current_split=current_split, split=split, step_time_s=times, reason=reason
        )

    best_line = f"best x{best} predicted {best_gain:.0%} faster than the plan's count"
    if target == current_split:
        return choice(False, current_split, f"x{current_split} is the split to run ({best_line})")
    if target == 1:
        return choice(
            True,
            1,
            f"no split is predicted {gain:.0%} faster than the plan's count ({best_line}): "
            "back to the plan's count",
        )
    move_gain = 1 - times[target] / times[current_split]
    if move_gain > gain:
        return choice(
            True,
            target,
            f"x{target} predicted {move_gain:.0%} faster than x{current_split} (needs {gain:.0%})",
        )
    return choice(
        False,
        current_split,
        f"x{target} predicted only {move_gain:.0%} faster than x{current_split} (needs {gain:.0%})",
    )
