"""The plan trial of ``DeepCEEStrategy`` set-up: the clock picks among plans the model cannot rank.

The searched plan and its rivals, predicted within 10% of it (inside the cost model's error):
the search's best plans of another structure (another device set, stage count, schedule or
micro-batch count; ``plan_search(alternatives=...)``) and the near layouts (block boundaries
moved, another schedule or micro-batch count on the same devices;
:func:`~lightning_deepcee.planner.rivals.choose_rivals`), each run a few
whole pipeline steps on the first training batch, forward and backward, no optimizer step; the
fastest by the clock is built for training. A rival is built from the copies of the blocks each
rank already holds (``layout_build.build_for_timing``): no state crosses the links, since a
step's time depends on the layout and the shapes, not on the weights' values. The first device
of each of the searched plan's stages keeps its part of the training state meanwhile, and the
plan that trains receives it from there (``layout_build.relayout_from``, the re-plan path):
exact, so the weights training starts from are the ones the searched plan would have started
from. Each timed step is the stage part's one step function
(:meth:`~lightning_deepcee.strategy.stage_part.PipelineStagePart.run`).

Nothing of a trial step stays: gradients are dropped, the random number generators are put back
(dropout draws and the data loader's shuffle are as without a trial), and a model whose buffers
a step changes (running statistics) stops the trial at its first step, with its buffers put
back, and trains on the searched plan.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_deepcee._compat import fit_dataloader
from lightning_deepcee.planner import CostModelConfig, Plan
from lightning_deepcee.planner.rivals import (
    RACE_MARGIN,
    RIVAL_WITHIN,
    choose_rivals,
    out_of_race,
    pick_timed,
)
from lightning_deepcee.profiler import ClusterProfile
from lightning_deepcee.runtime.batch_statistics import batch_dependent_modules
from lightning_deepcee.runtime.layout_text import layout_line
from lightning_deepcee.runtime.transport import all_reduce_
from lightning_deepcee.strategy.layout_build import (
    BuildHost,
    build_for_timing,
    live_shard,
    relayout_from,
)

__all__ = ["TRIAL_STEPS", "TrialStrategy", "trial_plans"]

TRIAL_STEPS = 3
"""Timed steps per candidate. The first also allocates the layout's buffers and reads slower;
the median of three sets it aside without a step that is thrown away."""


class TrialStrategy(BuildHost, Protocol):
    """What the plan trial uses of the strategy (``DeepCEEStrategy`` provides it): the running
    plan and what the search found, and what building a layout uses (its stage part, whose one
    step function the trial times, and Lightning's own API)."""

    cluster_profile: ClusterProfile | None
    plan_alternatives: list[Plan]
    device_gain: float
    compression: tuple[str, ...]

    @property
    def plan(self) -> Plan | None: ...

    @property
    def is_global_zero(self) -> bool: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def batch_to_device(self, batch: Any, device: torch.device | None = ...) -> Any: ...


def trial_plans(strategy: TrialStrategy, trainer: pl.Trainer, count: int) -> Plan:
    """Time the running (searched) plan and up to ``count - 1`` rivals; build the fastest and
    return it. Collective: every rank calls it right after the searched plan is built."""
    plan, part = strategy.plan, strategy.stage_part
    assert plan is not None and part.spec is not None
    if count < 2 or strategy.cluster_profile is None:
        return plan
    found: list[dict[str, Any]] = []
    if strategy.is_global_zero:
        rivals = choose_rivals(
            strategy.cluster_profile,
            plan,
            strategy.plan_alternatives,
            count - 1,
            config=CostModelConfig(compression=strategy.compression),
        )
        found = [rival.to_dict() for rival in rivals]
    rivals = [Plan.from_dict(d) for d in strategy.broadcast(found)]
    if not rivals:
        rank_zero_info(
            f"DeepCEE: plan trial: no other layout is predicted within {RIVAL_WITHIN:.0%} of "
            "the searched plan; it runs untimed"
        )
        return plan
    stateful = batch_dependent_modules(part.spec.blocks)
    if stateful:
        first = stateful[0]
        rank_zero_info(
            f"DeepCEE: plan trial skipped: {first.kind} in block {first.block_index} keeps "
            "running statistics that a trial step would change; the searched plan runs"
        )
        return plan
    rng = _rng_state()
    # The training state of the searched layout, kept while rivals run on copies of the blocks.
    saved = live_shard(strategy) if part.where.writes_shard else None
    try:
        batch = strategy.batch_to_device(next(iter(fit_dataloader(trainer))))
        candidates = [plan, *rivals]
        timed: list[float] = []
        counts: list[int] = []
        for index, candidate in enumerate(candidates):
            if index:
                build_for_timing(strategy, candidate, trainer)
            step_s, count = _time_steps(strategy, batch, min(timed, default=None))
            counts.append(count)
            if step_s is None:
                rank_zero_info(
                    "DeepCEE: plan trial stopped: a training step changes the model's buffers; "
                    "the searched plan runs"
                )
                candidates, timed = candidates[: index + 1], [*timed, float("inf")]
                break
            timed.append(step_s)
        stopped = timed[-1] == float("inf")
        best = 0 if stopped else pick_timed(candidates, timed, strategy.device_gain)
        if len(timed) > 1:  # a rival was built: the training state goes where it trains
            why = "plan trial: the fastest" if best else "plan trial: the searched plan"
            relayout_from(strategy, plan, _saved(saved), candidates[best], trainer, why)
    finally:
        _set_rng_state(rng)
        for p in strategy.lightning_module.parameters() if strategy.lightning_module else ():
            p.grad = None
    rank_zero_info(_report(candidates, timed, counts, best))
    return candidates[best]


def _saved(shard: dict[str, Any] | None) -> Callable[[], dict[str, Any]]:
    def get() -> dict[str, Any]:
        assert shard is not None, "only a stage's first device sends its shard"
        return shard

    return get


def _time_steps(
    strategy: TrialStrategy, batch: Any, fastest_s: float | None
) -> tuple[float | None, int]:
    """Median seconds of a whole pipeline step (each step's seconds the mean over ranks, so
    every rank gets the same figures), and how many steps were timed: up to ``TRIAL_STEPS``,
    fewer once the plan is out of the race against ``fastest_s`` (the fastest median timed
    before; :func:`~lightning_deepcee.planner.rivals.out_of_race`, judged on the steps after the
    first, which allocates). ``None`` when a step changed a buffer of this stage (the buffers
    are put back)."""
    stage = strategy.stage_part.stage
    assert stage is not None
    buffers = list(dict.fromkeys(b for block in stage.blocks for b in block.buffers()))
    kept = [b.detach().clone() for b in buffers]
    seconds: list[float] = []
    while len(seconds) < TRIAL_STEPS:
        began = time.perf_counter()
        _step(strategy, batch)
        took = torch.tensor(
            [time.perf_counter() - began], dtype=torch.float64, device=strategy.root_device
        )
        all_reduce_(took)
        seconds.append(float(took.item()) / strategy.world_size)
        if fastest_s is not None and out_of_race(seconds[1:], fastest_s, strategy.device_gain):
            break
    changed = torch.tensor(
        [float(any(not torch.equal(b, k) for b, k in zip(buffers, kept, strict=True)))],
        dtype=torch.float64,
        device=strategy.root_device,
    )
    for b, k in zip(buffers, kept, strict=True):
        b.data.copy_(k)
    all_reduce_(changed)
    return (None if changed.item() else statistics.median(seconds)), len(seconds)


def _step(strategy: TrialStrategy, batch: Any) -> None:
    """One training step's pipeline work (forward, backward, copies' gradient sync and the
    step's closing all-reduce) without the optimizer; gradients dropped."""
    part = strategy.stage_part
    assert part.stage is not None
    params = part.stage.parameters()
    part.run("train", batch)
    part.sync_copies()
    all_reduce_(torch.zeros(1, dtype=torch.float64, device=strategy.root_device))
    for p in params:
        p.grad = None


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _report(candidates: list[Plan], timed: list[float], counts: list[int], best: int) -> str:
    lines = [
        f"DeepCEE: plan trial, up to {TRIAL_STEPS} timed steps each (forward and backward, no "
        f"optimizer step; median of each step's mean over ranks; a rival whose fastest step is "
        f"{RACE_MARGIN:.0%} beyond device_gain slower than the fastest plan stops early):"
    ]
    for index, (plan, seconds) in enumerate(zip(candidates, timed, strict=False)):
        name = "searched" if index == 0 else f"rival {index}"
        mark = "  <- trains" if index == best else ""
        measured = "stopped" if seconds == float("inf") else f"{seconds * 1e3:.1f} ms"
        if seconds != float("inf") and counts[index] < TRIAL_STEPS:
            measured += f" (out of the race after {counts[index]} step(s))"
        lines.append(
            f"  {name:>8}: {measured}, predicted {plan.predicted_step_time_s * 1e3:.1f} ms: "
            f"{layout_line(plan, plan.num_microbatches)}{mark}"
        )
    return "\n".join(lines)
