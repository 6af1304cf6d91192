"""The profiling step of ``DeepCEEStrategy`` set-up: measure every device and link once.

A function of explicit inputs that returns what it found (:class:`SetupProfile`); the strategy
keeps it. It runs once, before the plan exists, on the first training micro-batch.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_deepcee._compat import fit_dataloader
from lightning_deepcee.profiler import ClusterProfile, DeviceGroups, group_devices
from lightning_deepcee.runtime import PipelineSpec, batch_size_of, split_batch, split_sizes
from lightning_deepcee.runtime.measure import profile_cluster, profile_or_load
from lightning_deepcee.strategy.reporting import format_cluster, warn_once_per_job

__all__ = [
    "ProfileHost", "ProfileSettings", "SetupProfile", "device_cache_dir", "profile_at_setup",
    "profile_strategy",
]  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProfileSettings:
    """How to profile (``DeepCEEStrategy``'s ``profile_*`` and ``device_cache`` arguments)."""

    cache: str | None
    """A profile file reused while the model and the cluster are unchanged."""
    budget_s: float
    """The network measurement's time limit."""
    rounds: int
    """Rounds of block timings, each figure taken at its median."""
    block_budget_s: float | None
    """About how long each device may spend timing its blocks."""
    device_cache: str | None
    """Where this device keeps its block timings (:func:`device_cache_dir` of the setting)."""


def device_cache_dir(setting: str | None) -> str | None:
    """Where this device keeps its block timings (``DeepCEEStrategy(device_cache=...)``):
    ``"auto"`` is one directory per torchrun elastic job that can restart, else none."""
    if setting != "auto":
        return setting
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if not run_id or run_id == "none" or restarts < 1:  # no restart can reuse it
        return None
    return str(Path(tempfile.gettempdir()) / f"deepcee-devices-{run_id}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SetupProfile:
    """What profiling found: the cluster, its device groups, the batch it was measured on."""

    profile: ClusterProfile
    groups: DeviceGroups
    global_batch_size: int
    """Samples in the first training batch (the plan is made for it)."""
    parts: dict[str, float]
    """Seconds of the parts (the slowest device's block timings, the network)."""


class ProfileHost(Protocol):
    """What profiling at set-up uses of the strategy (``DeepCEEStrategy`` provides it)."""

    profile_settings: ProfileSettings

    @property
    def num_microbatches(self) -> int: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def world_size(self) -> int: ...

    def model_to_device(self) -> None: ...

    def batch_to_device(self, batch: Any, device: torch.device | None = ...) -> Any: ...


def profile_strategy(host: ProfileHost, trainer: pl.Trainer, spec: PipelineSpec) -> SetupProfile:
    """:func:`profile_at_setup` for ``host``'s devices on the first training batch; the blocks
    are timed where they will run, on ``root_device``."""
    host.model_to_device()
    return profile_at_setup(
        trainer,
        host.batch_to_device(next(iter(fit_dataloader(trainer)))),
        spec=spec,
        num_microbatches=host.num_microbatches,
        device=host.root_device,
        world_size=host.world_size,
        settings=host.profile_settings,
    )


def profile_at_setup(
    trainer: pl.Trainer,
    batch: Any,
    *,
    spec: PipelineSpec,
    num_microbatches: int,
    device: torch.device,
    world_size: int,
    settings: ProfileSettings,
) -> SetupProfile:
    """Measure devices and links on the first micro-batch of ``batch`` (the first training
    batch, on ``device``; all ranks), print the table and log the capabilities."""
    global_batch_size = batch_size_of(batch)
    micro = split_batch(batch, split_sizes(global_batch_size, num_microbatches))[0]
    parts: dict[str, float] = {}
    options: dict[str, Any] = dict(
        loss_fn=spec.loss_fn,
        sample_batch=micro,
        device=device,
        budget_s=settings.budget_s,
        rounds=settings.rounds,
        device_cache=device_cache_dir(settings.device_cache),
        block_budget_s=settings.block_budget_s,
        parts=parts,
        progress=rank_zero_info,
    )
    blocks, sample = list(spec.blocks), spec.input_fn(micro)
    budget = settings.block_budget_s
    rank_zero_info(
        f"DeepCEE: profiling {world_size} devices: block timings"
        + (f" (about {budget:g} s per device)" if budget is not None else "")
        + ", then every link"
    )
    began = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if settings.cache is not None:
            profile = profile_or_load(settings.cache, blocks, sample, **options)
        else:
            profile = profile_cluster(blocks, sample, **options)
    seconds = time.perf_counter() - began
    warn_once_per_job([str(w.message) for w in caught], world_size)
    groups = group_devices(profile)
    rank_zero_info(format_cluster(profile, groups))
    rank_zero_info(f"DeepCEE: profiled {profile.num_devices} devices in {seconds:.1f} s")
    metrics = {f"deepcee/capability_rank{d.rank}": d.capability for d in profile.devices}
    metrics["deepcee/profile_s"] = seconds
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=0)
    return SetupProfile(
        profile=profile, groups=groups, global_batch_size=global_batch_size, parts=parts
    )
