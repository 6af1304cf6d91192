"""The plan trial of ``DeepCEEStrategy`` set-up: the clock picks among plans the model cannot rank.

The searched plan and its rivals, predicted within 10% of it (inside the cost model's error):
the search's best plans of another structure (another device set, stage count, schedule or
micro-batch count; ``plan_search(alternatives=...)``) and the near layouts (block boundaries
moved; :func:`~lightning_deepcee.planner.rivals.choose_rivals`), each run a few
whole pipeline steps on the first training batch, forward and backward, no optimizer step; the
fastest by the clock is built for training. A rival is built from the copies of the blocks each
rank already holds (``build_for_timing``): no state crosses the links, since a step's time
depends on the layout and the shapes, not on the weights' values. The first device of each of
the searched plan's stages keeps its part of the training state meanwhile, and the plan that
trains receives it from there (``relayout_from``, the re-plan path): exact, so the weights
training starts from are the ones the searched plan would have started from.

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
from lightning_deepcee.planner import Plan
from lightning_deepcee.planner.rivals import RIVAL_WITHIN, choose_rivals, pick_timed
from lightning_deepcee.profiler import ClusterProfile
from lightning_deepcee.runtime import PipelineSpec, Stage
from lightning_deepcee.runtime.layout import batch_dependent_modules, layout_line
from lightning_deepcee.runtime.transport import all_reduce_

__all__ = ["TRIAL_STEPS", "TrialStrategy", "trial_plans"]

ShardSource = Callable[[], dict[str, Any]]
"""Gives this stage's part of the training state (a checkpoint shard) when called."""

TRIAL_STEPS = 3
"""Timed steps per candidate, after one untimed step (its first transfers set up connections
and allocate buffers)."""


class TrialStrategy(Protocol):
    """What the plan trial uses of the strategy (``DeepCEEStrategy`` provides it): the running
    plan and what the search found, the one step function, and the re-layout calls."""

    plan: Plan | None
    spec: PipelineSpec | None
    stage: Stage | None
    cluster_profile: ClusterProfile | None
    plan_alternatives: list[Plan]
    device_gain: float

    @property
    def is_global_zero(self) -> bool: ...

    @property
    def writes_shard(self) -> bool: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def world_size(self) -> int: ...

    @property
    def lightning_module(self) -> pl.LightningModule | None: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def batch_to_device(self, batch: Any, device: torch.device | None = ...) -> Any: ...

    def live_shard(self) -> dict[str, Any]: ...

    def run_schedule(self, kind: str, batch: Any) -> torch.Tensor | None: ...

    def sync_copies(self) -> float: ...

    def build_for_timing(self, plan: Plan, trainer: pl.Trainer) -> None: ...

    def relayout_from(
        self, source: Plan, shard_of: ShardSource, plan: Plan, trainer: pl.Trainer, why: str
    ) -> None: ...


def trial_plans(strategy: TrialStrategy, trainer: pl.Trainer, count: int) -> Plan:
    """Time the running (searched) plan and up to ``count - 1`` rivals; build the fastest and
    return it. Collective: every rank calls it right after the searched plan is built."""
    plan = strategy.plan
    assert plan is not None and strategy.spec is not None
    if count < 2 or strategy.cluster_profile is None:
        return plan
    found: list[dict[str, Any]] = []
    if strategy.is_global_zero:
        rivals = choose_rivals(
            strategy.cluster_profile, plan, strategy.plan_alternatives, count - 1
        )
        found = [rival.to_dict() for rival in rivals]
    rivals = [Plan.from_dict(d) for d in strategy.broadcast(found)]
    if not rivals:
        rank_zero_info(
            f"DeepCEE: plan trial: no other layout is predicted within {RIVAL_WITHIN:.0%} of "
            "the searched plan; it runs untimed"
        )
        return plan
    stateful = batch_dependent_modules(strategy.spec.blocks)
    if stateful:
        first = stateful[0]
        rank_zero_info(
            f"DeepCEE: plan trial skipped: {first.kind} in block {first.block_index} keeps "
            "running statistics that a trial step would change; the searched plan runs"
        )
        return plan
    rng = _rng_state()
    # The training state of the searched layout, kept while rivals run on copies of the blocks.
    saved = strategy.live_shard() if strategy.writes_shard else None
    try:
        batch = strategy.batch_to_device(next(iter(fit_dataloader(trainer))))
        candidates = [plan, *rivals]
        timed: list[float] = []
        for index, candidate in enumerate(candidates):
            if index:
                strategy.build_for_timing(candidate, trainer)
            step_s = _time_steps(strategy, batch)
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
            strategy.relayout_from(plan, _saved(saved), candidates[best], trainer, why)
    finally:
        _set_rng_state(rng)
        for p in strategy.lightning_module.parameters() if strategy.lightning_module else ():
            p.grad = None
    rank_zero_info(_report(candidates, timed, best))
    return candidates[best]


def _saved(shard: dict[str, Any] | None) -> Callable[[], dict[str, Any]]:
    def get() -> dict[str, Any]:
        assert shard is not None, "only a stage's first device sends its shard"
        return shard

    return get


def _time_steps(strategy: TrialStrategy, batch: Any) -> float | None:
    """Median seconds of a whole pipeline step after one untimed step, the mean over ranks
    (each step ends in an all-reduce, so they differ little; every rank gets the same figure);
    ``None`` when a step changed a buffer of this stage (the buffers are put back)."""
    assert strategy.stage is not None
    buffers = list(dict.fromkeys(b for block in strategy.stage.blocks for b in block.buffers()))
    kept = [b.detach().clone() for b in buffers]
    seconds = []
    for _ in range(1 + TRIAL_STEPS):
        began = time.perf_counter()
        _step(strategy, batch)
        seconds.append(time.perf_counter() - began)
    changed = any(not torch.equal(b, k) for b, k in zip(buffers, kept, strict=True))
    for b, k in zip(buffers, kept, strict=True):
        b.data.copy_(k)
    figures = torch.tensor(
        [statistics.median(seconds[1:]), float(changed)],
        dtype=torch.float64,
        device=strategy.root_device,
    )
    all_reduce_(figures)
    return None if figures[1].item() else float(figures[0].item()) / strategy.world_size


def _step(strategy: TrialStrategy, batch: Any) -> None:
    """One training step's pipeline work (forward, backward, copies' gradient sync and the
    step's closing all-reduce) without the optimizer; gradients dropped."""
    assert strategy.stage is not None
    params = strategy.stage.parameters()
    strategy.run_schedule("train", batch)
    strategy.sync_copies()
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


def _report(candidates: list[Plan], timed: list[float], best: int) -> str:
    lines = [
        f"DeepCEE: plan trial, {TRIAL_STEPS} timed steps each (forward and backward, no "
        f"optimizer step; median, mean over ranks):"
    ]
    for index, (plan, seconds) in enumerate(zip(candidates, timed, strict=False)):
        name = "searched" if index == 0 else f"rival {index}"
        mark = "  <- trains" if index == best else ""
        measured = "stopped" if seconds == float("inf") else f"{seconds * 1e3:.1f} ms"
        lines.append(
            f"  {name:>8}: {measured}, predicted {plan.predicted_step_time_s * 1e3:.1f} ms: "
            f"{layout_line(plan, plan.num_microbatches)}{mark}"
        )
    return "\n".join(lines)
