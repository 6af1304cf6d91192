"""The planning step of ``DeepCEEStrategy`` set-up: the layout the first build runs.

A function of explicit inputs that returns the plan (and, for a searched plan, the search's
other best plans, which the plan trial times): a saved plan checked against the model and the
cluster, the search's plan on the profile, or the manual layout's arguments as a plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_deepcee.planner import CostModelConfig, Plan
from lightning_deepcee.planner.record import format_device_sets, write_setup_record
from lightning_deepcee.planner.search import DeviceSetScore
from lightning_deepcee.profiler import ClusterProfile
from lightning_deepcee.runtime.manual_layout import ManualLayout, manual_plan
from lightning_deepcee.runtime.measure import model_fingerprint
from lightning_deepcee.runtime.spread_search import spread_plan_search

__all__ = ["PlanChoice", "initial_plan", "save_setup_record"]


@dataclass(frozen=True)
class PlanChoice:
    """What the planning step decided."""

    plan: Plan
    alternatives: list[Plan] | None = None
    """Rank 0's other best plans when the plan was searched (the plan trial times them)."""
    device_sets: dict[tuple[int, ...], DeviceSetScore] = field(default_factory=dict)
    """Rank 0's scored device sets when the plan was searched (why these devices)."""


def initial_plan(
    plan_arg: str | None,
    *,
    manual: ManualLayout,
    blocks: Sequence[torch.nn.Module],
    world_size: int,
    cluster_profile: ClusterProfile | None,
    global_batch_size: int,
    device_gain: float,
    compression: tuple[str, ...] = (),
    running: Plan | None = None,
) -> PlanChoice:
    """The layout set-up builds and, when it was searched (``plan_arg == "auto"``), rank 0's
    alternatives and scored device sets. ``plan_arg``: ``None`` for the manual
    layout, ``"auto"`` to search on ``cluster_profile`` (all ranks: the search is spread over
    them), else a saved plan's path. Prints the plan unless it is the manual layout's.
    ``running``: the layout that trained, which validate/test after fit keep (re-planned or
    not); ``None`` while fitting. ``compression``: the methods the search may choose per hop."""
    if running is not None:
        return PlanChoice(running)
    fingerprint = model_fingerprint(list(blocks))
    cluster = cluster_profile.cluster_fingerprint if cluster_profile else None
    if plan_arg is None:
        plan = manual_plan(
            manual,
            world_size=world_size,
            block_weights=[
                sum(p.numel() for p in b.parameters() if p.requires_grad) for b in blocks
            ],
            model_fingerprint=fingerprint,
            cluster_fingerprint=cluster or "",
            global_batch_size=global_batch_size,
        )
        return PlanChoice(plan)
    alternatives: list[Plan] | None = None
    device_sets: dict[tuple[int, ...], DeviceSetScore] = {}
    if plan_arg != "auto":
        plan = Plan.from_json(str(plan_arg))
        plan.check_matches(len(blocks), world_size, fingerprint, cluster)
    else:
        if cluster_profile is None:
            raise ValueError(
                "DeepCEEStrategy plans automatically while fitting; for validate/test "
                "pass plan='plan.json' or a manual layout."
            )
        alternatives = []  # rank 0's, for the plan trial
        plan = spread_plan_search(
            cluster_profile,
            num_blocks=len(blocks),
            global_batch_size=global_batch_size,
            device_gain=device_gain,
            config=CostModelConfig(compression=compression),
            alternatives=alternatives,
            device_sets=device_sets,
        )
    rank_zero_info("DeepCEE plan:\n" + plan.format_table())
    if device_sets and cluster_profile is not None:
        rank_zero_info(format_device_sets(cluster_profile, device_sets, plan))
    return PlanChoice(plan, alternatives, device_sets)


def save_setup_record(
    trainer: pl.Trainer,
    plan: Plan | None,
    profile: ClusterProfile | None,
    device_sets: dict[tuple[int, ...], DeviceSetScore],
) -> None:
    """On global rank 0, write what set-up decided into ``<default_root_dir>/deepcee/`` (the
    plan, the profile, a timeline and why; see :mod:`lightning_deepcee.planner.record`)."""
    if trainer.global_rank != 0 or plan is None or profile is None:
        return
    folder = Path(trainer.default_root_dir) / "deepcee"
    written = write_setup_record(folder, plan, profile, device_sets)
    names = ", ".join(path.name for path in written)
    rank_zero_info(f"DeepCEE: saved {names} in {folder}")
