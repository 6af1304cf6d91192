"""The plan trial: the clock picks among plans the cost model cannot rank, on steps that train.

At set-up rank 0 chooses the searched plan's rivals, predicted within 10% of it (inside the
cost model's error): the search's best plans of another structure (another device set, stage
count, schedule or micro-batch count; ``plan_search(alternatives=...)``) and the near layouts
(block boundaries moved, another schedule or micro-batch count on the same devices;
:func:`~lightning_deepcee.planner.rivals.choose_rivals`); every rank receives them. The trial
then runs on the fit's first optimizer steps: the searched plan trains
:data:`~lightning_deepcee.planner.rivals.TRIAL_STEPS` steps, then each rival in turn
(``DeepCEEStrategy.apply_plan`` moves the training state to it), and the fastest by the clock
trains on (:class:`~lightning_deepcee.planner.rivals.TrialRace`). Every trial step is a step of
the fit, with its optimizer step: any layout computes the whole batch's gradient and a move
carries the state bit for bit, so training is exactly what the winner alone would have done.
What the trial costs is the moves and what its slower candidates took beyond the winner's pace
(:attr:`PlanTrial.cost_s`).

A step's time is the time between two step boundaries on each rank (the strategy's
``on_train_batch_start`` where ``global_step`` moved on: one optimizer step, whatever
``accumulate_grad_batches``), averaged over the ranks by one all-reduce, so every rank takes
the same moves at the same boundary. The trial ends early, leaving the layout as it is, when
something else changes the layout (a re-plan restored on resume, a recovery after a lost
device, a callback's ``apply_plan``), and it is skipped when the fit has fewer than twice its
steps left. ``DynamicEnvironmentAdapter`` waits while it runs (``DeepCEEStrategy.trial_running``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_deepcee.planner import CostModelConfig, Plan
from lightning_deepcee.planner.rivals import (
    RACE_MARGIN,
    RIVAL_WITHIN,
    TRIAL_STEPS,
    TrialRace,
    choose_rivals,
)
from lightning_deepcee.profiler import ClusterProfile
from lightning_deepcee.runtime.layout_text import layout_line
from lightning_deepcee.runtime.transport import all_reduce_

__all__ = ["PlanTrial", "TrialStrategy"]


class TrialStrategy(Protocol):
    """What the plan trial uses of the strategy (``DeepCEEStrategy`` provides it)."""

    cluster_profile: ClusterProfile | None
    device_gain: float
    compression: tuple[str, ...]

    @property
    def plan(self) -> Plan | None: ...

    @property
    def is_global_zero(self) -> bool: ...

    @property
    def world_size(self) -> int: ...

    @property
    def root_device(self) -> torch.device: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def apply_plan(self, plan: Plan, trainer: pl.Trainer, why: str = ...) -> None: ...


class PlanTrial:
    """The plan trial of one fit: chosen at set-up (:meth:`prepare`), run at the step
    boundaries (:meth:`at_step_start`); ``on_chosen`` receives the plan that trains once the
    clock has picked it (set-up keeps it for the next start on the same profile)."""

    def __init__(self, count: int) -> None:
        self.count = count
        """The searched plan and up to ``count - 1`` rivals run; 1: no trial."""
        self.race: TrialRace | None = None
        """The race under way (``None`` before, after, or without one)."""
        self.cost_s = 0.0
        """What the last trial cost: its moves, and its steps' time beyond the winner's pace."""
        self._on_chosen: Callable[[Plan], None] = lambda plan: None
        self._built: Plan | None = None  # the layout the trial runs now
        self._step: int | None = None  # global_step at the last boundary
        self._clock: float | None = None  # when the running step began
        self._moves_s = 0.0

    def running(self, plan: Plan | None) -> bool:
        """Whether the trial runs on the layout ``plan`` (the running one)."""
        return self.race is not None and plan is not None and plan is self._built

    def prepare(
        self, strategy: TrialStrategy, alternatives: list[Plan], on_chosen: Callable[[Plan], None]
    ) -> None:
        """Choose the rivals of the running (searched) plan on rank 0 and share them; a trial
        starts with the fit's first step when there are any, else ``on_chosen`` gets the plan
        now. Collective: every rank calls it right after the searched plan is built."""
        plan = strategy.plan
        assert plan is not None
        self.race, self.cost_s, self._on_chosen = None, 0.0, on_chosen
        if self.count < 2 or strategy.cluster_profile is None:
            on_chosen(plan)
            return
        found: list[dict[str, Any]] = []
        if strategy.is_global_zero:
            config = CostModelConfig(compression=strategy.compression)
            rivals = choose_rivals(
                strategy.cluster_profile, plan, alternatives, self.count - 1, config=config
            )
            found = [rival.to_dict() for rival in rivals]
        rivals = [Plan.from_dict(d) for d in strategy.broadcast(found)]
        if not rivals:
            rank_zero_info(
                f"DeepCEE: plan trial: no other layout is predicted within {RIVAL_WITHIN:.0%} "
                "of the searched plan; it trains untimed"
            )
            on_chosen(plan)
            return
        self.race = TrialRace([plan, *rivals], strategy.device_gain)
        self._built, self._step, self._clock, self._moves_s = plan, None, None, 0.0
        rank_zero_info(
            f"DeepCEE: plan trial on the first training steps: the searched plan and "
            f"{len(rivals)} rival(s), up to {TRIAL_STEPS} steps each"
        )

    def at_step_start(self, strategy: TrialStrategy, trainer: pl.Trainer) -> None:
        """At a step boundary (every rank, ``on_train_batch_start``): time the step that ended
        and move to the next candidate, or to the winner, when the race says so."""
        race = self.race
        if race is None:
            return
        if strategy.plan is not self._built:
            self._end(f"the layout changed at step {trainer.global_step}; that layout trains")
            return
        step = trainer.global_step
        if step == self._step:
            return  # within an accumulation of batches: not an optimizer step's boundary
        self._step = step
        if self._clock is None:
            left = trainer.estimated_stepping_batches - step
            if left < 2 * TRIAL_STEPS * len(race.plans):
                self._end(f"the fit has {left} steps left; the searched plan trains")
            else:
                self._clock = time.perf_counter()
            return
        took = torch.tensor(
            [time.perf_counter() - self._clock], dtype=torch.float64, device=strategy.root_device
        )
        all_reduce_(took)
        move = race.record(float(took.item()) / strategy.world_size)
        if move is not None:
            self._move(strategy, trainer, race, move)
        self._clock = time.perf_counter()

    def at_fit_end(self) -> None:
        """At the strategy's teardown: a race the fit left unfinished ends, the layout in use
        stays, nothing is kept."""
        if self.race is not None:
            self._end("the fit ended first; the layout in use stays")

    def _move(
        self, strategy: TrialStrategy, trainer: pl.Trainer, race: TrialRace, move: int
    ) -> None:
        """Build candidate ``move`` (unless it runs already); at the race's end, report it."""
        began = time.perf_counter()
        if race.plans[move] is not self._built:
            why = f"plan trial: rival {move}" if race.winner is None else "plan trial: the fastest"
            strategy.apply_plan(race.plans[move], trainer, why)
            self._built = strategy.plan
        self._moves_s += time.perf_counter() - began
        if race.winner is None:
            return
        pace = race.medians[race.winner]
        self.cost_s = self._moves_s + sum(s - pace for steps in race.steps for s in steps)
        rank_zero_info(_report(race, self.cost_s))
        self.race = None
        self._on_chosen(race.plans[race.winner])

    def _end(self, why: str) -> None:
        rank_zero_info(f"DeepCEE: plan trial stopped: {why}")
        self.race = None


def _report(race: TrialRace, cost_s: float) -> str:
    lines = [
        f"DeepCEE: plan trial, up to {TRIAL_STEPS} training steps each (median of each step's "
        f"mean over ranks; a rival whose fastest step is {RACE_MARGIN:.0%} beyond device_gain "
        f"slower than the fastest plan stops early); it cost {cost_s:.1f} s over the winner's "
        "pace (moves included):"
    ]
    for index, (plan, steps) in enumerate(zip(race.plans, race.steps, strict=True)):
        name = "searched" if index == 0 else f"rival {index}"
        mark = "  <- trains" if index == race.winner else ""
        measured = f"{race.medians[index] * 1e3:.1f} ms"
        if len(steps) < TRIAL_STEPS:
            measured += f" (out of the race after {len(steps)} step(s))"
        lines.append(
            f"  {name:>8}: {measured}, predicted {plan.predicted_step_time_s * 1e3:.1f} ms: "
            f"{layout_line(plan, plan.num_microbatches)}{mark}"
        )
    return "\n".join(lines)
