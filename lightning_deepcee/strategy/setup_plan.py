"""The planning step of ``DeepCEEStrategy`` set-up: the layout the first build runs.

A function of explicit inputs that returns the plan (and, for a searched plan, the search's
other best plans, which the plan trial times): a saved plan checked against the model and the
cluster, the search's plan on the profile, or the manual layout's arguments as a plan.

With a device cache (``DeepCEEStrategy(device_cache=...)``), rank 0 keeps the plan that set-up
trained (after the trial), keyed by the whole profile and the search's settings: a later set-up
on the same profile (block timings kept, link figures kept after their check) takes it without
a search or a trial, and says so.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_deepcee.planner import CostModelConfig, Plan
from lightning_deepcee.planner.record import format_device_sets, write_setup_record
from lightning_deepcee.planner.search import DeviceSetScore
from lightning_deepcee.profiler import ClusterProfile
from lightning_deepcee.runtime.manual_layout import ManualLayout, manual_plan
from lightning_deepcee.runtime.measure import model_fingerprint
from lightning_deepcee.runtime.measure.kept import format_age, kept_age_s, read_kept, write_kept
from lightning_deepcee.runtime.spread_search import spread_plan_search
from lightning_deepcee.strategy.setup_profile import device_cache_dir

__all__ = ["PlanChoice", "initial_plan", "keep_plan", "save_setup_record"]

KEPT_PLAN_FORMAT = 1
"""Goes up when what decides a plan changes beyond the profile and the settings in the key (the
search, the cost model), so that a kept plan from before is searched again."""


@dataclass(frozen=True)
class PlanChoice:
    """What the planning step decided."""

    plan: Plan
    alternatives: list[Plan] | None = None
    """Rank 0's other best plans when the plan was searched (the plan trial times them)."""
    device_sets: dict[tuple[int, ...], DeviceSetScore] = field(default_factory=dict)
    """Rank 0's scored device sets when the plan was searched (why these devices)."""
    kept: bool = False
    """Whether the plan was kept from an earlier set-up on the same profile (no search, no
    trial)."""
    kept_file: Path | None = None
    """Where rank 0 keeps the plan that trains, for the next set-up on this profile."""


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
    device_cache: str | None = None,
) -> PlanChoice:
    """The layout set-up builds and, when it was searched (``plan_arg == "auto"``), rank 0's
    alternatives and scored device sets. ``plan_arg``: ``None`` for the manual
    layout, ``"auto"`` to search on ``cluster_profile`` (all ranks: the search is spread over
    them), else a saved plan's path. Prints the plan unless it is the manual layout's.
    ``running``: the layout that trained, which validate/test after fit keep (re-planned or
    not); ``None`` while fitting. ``compression``: the methods the search may choose per hop.
    ``device_cache``: the strategy's setting; a plan kept there for this profile and these
    settings is taken as it is (rank 0 reads it, every rank gets it)."""
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
    kept_file: Path | None = None
    if plan_arg != "auto":
        plan = Plan.from_json(str(plan_arg))
        plan.check_matches(len(blocks), world_size, fingerprint, cluster)
    else:
        if cluster_profile is None:
            raise ValueError(
                "DeepCEEStrategy plans automatically while fitting; for validate/test "
                "pass plan='plan.json' or a manual layout."
            )
        settings = [len(blocks), global_batch_size, device_gain, list(compression)]
        kept_file = _kept_file(device_cache_dir(device_cache), cluster_profile, settings)
        kept = _load_kept(kept_file)
        if kept is not None and _fits(kept[0], cluster_profile):
            rank_zero_info(
                f"DeepCEE: plan kept from an earlier set-up on this profile ({format_age(kept[1])} "
                "old): no search, no trial\n" + kept[0].format_table()
            )
            return PlanChoice(kept[0], kept=True, kept_file=kept_file)
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
    return PlanChoice(plan, alternatives, device_sets, kept_file=kept_file)


def keep_plan(choice: PlanChoice, plan: Plan | None, writer: bool) -> None:
    """On rank 0 (``writer``), keep ``plan`` (the one that trains, after the trial) where
    ``choice`` says, for the next set-up on the same profile; nothing for a kept plan."""
    if writer and not choice.kept and plan is not None:
        write_kept(choice.kept_file, plan.to_dict())  # if refused: the next set-up searches


def _kept_file(
    directory: str | None, profile: ClusterProfile, settings: list[object]
) -> Path | None:
    """Where rank 0 keeps the plan for ``profile`` and the search's settings: all of the
    profile but the devices' free memory, which moves from one start to the next (a kept plan
    must still fit it, :func:`_fits`)."""
    if directory is None:
        return None
    data = profile.to_dict()
    for device in data["devices"]:
        device.pop("memory_bytes")
    key = json.dumps([data, settings, KEPT_PLAN_FORMAT], sort_keys=True)
    return Path(directory) / f"plan-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _fits(plan: Plan, profile: ClusterProfile) -> bool:
    """Whether ``plan``'s predicted peak memory fits every device's free memory now."""
    free = {device.rank: device.memory_bytes for device in profile.devices}
    return all(peak <= free[rank] for rank, peak in plan.predicted_peak_memory_bytes.items())


def _load_kept(path: Path | None) -> tuple[Plan, float] | None:
    """The kept plan and its age in seconds (rank 0 reads, every rank gets it), or None."""
    if path is None:  # the same on every rank: the same setting
        return None
    found: list[tuple[dict[str, Any], float] | None] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        fields, age = read_kept(path), kept_age_s(path)
        found[0] = None if fields is None else (fields, age or 0.0)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(found, src=0)
    if found[0] is None:
        return None
    fields, age = found[0]
    try:
        return Plan.from_dict(fields), age
    except (ValueError, KeyError, TypeError):
        return None  # from another version: search again


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
