"""Whether a plan can replace the running layout, and the running layout as a plan.

The checks behind ``DeepCEEStrategy.check_plan`` and ``current_plan`` (what the adapter calls
before a re-plan): functions of explicit inputs, local and deterministic, so every rank raises
alike before any collective.
"""

from __future__ import annotations

import dataclasses

from lightning_deepcee.planner import Plan
from lightning_deepcee.profiler import ClusterProfile
from lightning_deepcee.runtime.measure import model_fingerprint
from lightning_deepcee.strategy.stage_part import PipelineStagePart

__all__ = ["check_replacement", "require_single_replica", "running_plan"]


def require_single_replica(what: str, num_replicas: int) -> None:
    """Raise unless the run has one pipeline replica (several read different data shards)."""
    if num_replicas != 1:
        raise ValueError(
            f"DeepCEEStrategy.{what}: this run has {num_replicas} data-parallel pipeline "
            "replicas (manual num_stages/placement), each reading its own shard of the data, "
            "and the sampler cannot change mid-epoch; a plan feeds every rank the whole batch "
            "and splits rows inside a stage. Start from a plan (DeepCEEStrategy() or "
            "plan='plan.json') or a manual layout with one replica to re-plan during training."
        )


def running_plan(
    part: PipelineStagePart, *, num_replicas: int, last_step_samples: int, global_batch_size: int
) -> Plan:
    """The built layout as a plan: a planned run's plan, or a manual layout's with the
    micro-batch count in force, sized to the last step's batch."""
    require_single_replica("current_plan", num_replicas)
    if part.plan is None:
        raise RuntimeError("DeepCEEStrategy.current_plan runs on a set-up strategy.")
    if part.plan.notes != "manual layout":
        return part.plan
    batch = max(last_step_samples, global_batch_size, part.num_microbatches)
    return dataclasses.replace(
        part.plan, num_microbatches=part.num_microbatches, global_batch_size=batch
    )


def check_replacement(
    plan: Plan,
    part: PipelineStagePart,
    *,
    set_up: bool,
    world_size: int,
    num_replicas: int,
    cluster_profile: ClusterProfile | None,
) -> None:
    """Raise unless ``plan`` can replace the layout ``part`` built: the checks of a saved plan
    at setup (``Plan.check_matches``), a set-up strategy (``set_up`` and a built stage), one
    pipeline replica now and in ``plan``."""
    if not isinstance(plan, Plan):
        raise TypeError(
            f"DeepCEEStrategy.apply_plan expects a lightning_deepcee.Plan, got "
            f"{type(plan).__name__} (Plan.from_dict / Plan.from_json build one)."
        )
    if part.spec is None or part.stage is None or not set_up:
        raise RuntimeError(
            "DeepCEEStrategy.apply_plan runs on a set-up strategy, between training steps "
            "(from a callback's on_train_batch_end or on_train_start)."
        )
    require_single_replica("apply_plan", num_replicas)
    cluster = cluster_profile.cluster_fingerprint if cluster_profile else None
    try:
        plan.check_matches(
            len(part.spec.blocks), world_size, model_fingerprint(list(part.spec.blocks)), cluster
        )
        if plan.num_replicas != 1:
            raise ValueError("it has several data-parallel replicas")
    except ValueError as exc:
        raise ValueError(
            f"DeepCEEStrategy.apply_plan: the new plan cannot replace the running layout. {exc}"
        ) from None
