"""What the strategy tells people: the cluster table, and warnings printed once per job.

Lightning layer: the warnings go through Lightning's rank-zero helpers.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from lightning_deepcee.planner import Plan
from lightning_deepcee.profiler import ClusterProfile, DeviceGroups
from lightning_deepcee.runtime.batch_statistics import (
    batch_dependent_modules,
    batch_statistics_warning,
)
from lightning_deepcee.runtime.loaders import stand_in_warning
from lightning_deepcee.runtime.measure import device_identity
from lightning_deepcee.runtime.stage import PipelineSpec

__all__ = [
    "SetupTimer",
    "check_versions",
    "format_cluster",
    "print_everywhere",
    "summarise_whole_model",
    "warn_at_setup",
    "warn_once_per_job",
    "warn_unrun_steps",
]


def check_versions(world_size: int) -> list[str]:
    """Every rank must run the same versions: a mismatch fails early, naming the ranks.
    Returns every rank's host name (the same exchange), for errors that name a lost device.
    Collective."""
    import lightning
    import torch

    from lightning_deepcee._version import VERSION as __version__

    mine = {"lightning_deepcee": __version__, "torch": torch.__version__}
    mine["lightning"] = lightning.__version__
    gathered_all: list[tuple[dict[str, str], str] | None] = [None] * world_size
    dist.all_gather_object(gathered_all, (mine, device_identity()))
    gathered = [entry[0] for entry in gathered_all if entry is not None]
    differing = {r: v for r, v in enumerate(gathered) if v != gathered[0]}
    if differing:
        raise RuntimeError(
            f"DeepCEEStrategy: package versions differ across ranks: rank 0 has "
            f"{gathered[0]}, but {differing}. Install the same versions everywhere."
        )
    return [entry[1] for entry in gathered_all if entry is not None]


def warn_once_per_job(messages: list[str], world_size: int) -> None:
    """Warn on rank 0 once per distinct message, naming the ranks that raised it (every rank
    profiling the same cache would otherwise print the same warning). Collective."""
    gathered: list[list[str] | None] = [None] * world_size
    dist.all_gather_object(gathered, messages)
    ranks_of: dict[str, list[int]] = {}
    for rank, part in enumerate(gathered):
        for message in dict.fromkeys(part or []):
            ranks_of.setdefault(message, []).append(rank)
    for message, ranks in ranks_of.items():
        where = "every rank" if len(ranks) == world_size else f"ranks {ranks}"
        rank_zero_warn(f"{message} ({where})", category=UserWarning)


def warn_unrun_steps(module: pl.LightningModule, spec: PipelineSpec) -> None:
    """Say that the module's own steps do not run (what they log would be silently lost)."""
    if spec.metrics_fn is not None:
        return
    steps = ("training_step", "validation_step", "test_step")
    name = type(module).__name__
    own = [f"{name}.{step}" for step in steps if is_overridden(step, module)]
    if own:
        rank_zero_warn(
            f"DeepCEEStrategy runs {name}'s blocks as a pipeline and does not call "
            f"{', '.join(own)}: what they self.log is not logged. The strategy logs "
            "train_loss, val_loss and test_loss; return the module's other metrics as "
            "means over the micro-batch from PipelineSpec(metrics_fn=...) "
            "(docs/model_contract.md).",
            category=UserWarning,
        )


def summarise_whole_model(
    trainer: pl.Trainer, whole_model: Callable[[], AbstractContextManager[None]]
) -> None:
    """Make Lightning's model summary count the whole model, not this rank's stage: its
    ``on_fit_start`` runs inside ``whole_model()`` (every block put back)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if not isinstance(callback, ModelSummary) or getattr(callback, "_deepcee", False):
            continue
        original = callback.on_fit_start

        def on_fit_start(
            trainer: pl.Trainer, pl_module: pl.LightningModule, _original: Any = original
        ) -> None:
            with whole_model():
                _original(trainer, pl_module)

        setattr(callback, "on_fit_start", on_fit_start)  # noqa: B010
        setattr(callback, "_deepcee", True)  # noqa: B010


def format_cluster(profile: ClusterProfile, groups: DeviceGroups) -> str:
    """The profiling table printed at setup: devices, groups, memory and the bandwidth matrix."""
    lines = ["DeepCEE cluster profile:", groups.format_table(profile)]
    lines.append("  rank | memory GiB | F+B+W ms, all blocks, one micro-batch (fixed part)")
    for d in profile.devices:
        total, fixed = sum(d.block_seconds) * 1e3, sum(d.fixed_s) * 1e3
        lines.append(
            f"  {d.rank:>4} | {d.memory_bytes / 2**30:>10.1f} | {total:.1f} at "
            f"{d.reference_microbatch_size} samples ({fixed:.1f} fixed)"
        )
    lines.append("  bandwidth Mbit/s (row sends to column), latency ms:")
    n = profile.num_devices
    lines.append("        " + "".join(f"{j:>10}" for j in range(n)))
    for i in range(n):
        cells = []
        for j in range(n):
            bw = profile.bandwidth_bytes_per_s[i][j]
            lat = profile.latency_s[i][j]
            cells.append("         -" if i == j else f"{bw * 8 / 1e6:>6.0f}/{lat * 1e3:<3.1f}")
        lines.append(f"  {i:>4}  " + "".join(f"{c:>10}" for c in cells))
    return "\n".join(lines)


def print_everywhere(message: str) -> None:
    """Print on every rank (a lost-device error is news on each of them), to stderr."""
    print(message, file=sys.stderr, flush=True)


class SetupTimer:
    """Times the parts of set-up (``with timer("plan"): ...``) and reports them once; a part may
    name its own parts (``timer.detail["profile"] = {"blocks": 12.0, "network": 5.1}``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.detail: dict[str, dict[str, float]] = {}

    @contextmanager
    def __call__(self, part: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] = time.perf_counter() - began

    def flat(self) -> dict[str, float]:
        """Every part and sub-part in seconds: ``{"profile": ..., "profile_blocks": ...}``."""
        flat: dict[str, float] = {}
        for name, seconds in self.seconds.items():
            flat[name] = seconds
            flat.update({f"{name}_{sub}": s for sub, s in self.detail.get(name, {}).items()})
        return flat

    def report(self, trainer: pl.Trainer) -> None:
        """Print the parts (rank 0) and log them as ``deepcee/setup_<part>_s`` (and
        ``deepcee/setup_<part>_<subpart>_s``) to every logger."""
        texts = []
        for name, seconds in self.seconds.items():
            inner = self.detail.get(name, {})
            within = ", ".join(f"{sub} {s:.1f} s" for sub, s in inner.items())
            texts.append(f"{name} {seconds:.1f} s" + (f" ({within})" if within else ""))
        rank_zero_info(f"DeepCEE: set-up {sum(self.seconds.values()):.1f} s ({'; '.join(texts)})")
        metrics = {f"deepcee/setup_{key}_s": s for key, s in self.flat().items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=0)


def warn_at_setup(
    trainer: pl.Trainer, module: pl.LightningModule, spec: PipelineSpec, plan: Plan
) -> None:
    """What set-up warns about the built ``plan`` (rank 0): batch statistics that the layout
    cannot keep exact, hooks an idle rank's stand-in batches reach, steps the pipeline never
    runs; and silence Lightning's advice to sync the losses, which are all-reduced already."""
    batch_warning = batch_statistics_warning(
        batch_dependent_modules(spec.blocks), plan, plan.num_microbatches, type(module).__name__
    )
    if batch_warning is not None:
        rank_zero_warn(batch_warning, category=UserWarning)
    callbacks = getattr(trainer, "callbacks", [])  # set by its connector, not declared
    hooks_warning = stand_in_warning(plan.idle_ranks, module, callbacks)
    if hooks_warning is not None:
        rank_zero_warn(hooks_warning, category=UserWarning)
    warn_unrun_steps(module, spec)
    # train/val/test_loss are all-reduced before they are logged (every rank holds the same
    # value), so Lightning's advice to sync them on epoch level does not apply.
    warnings.filterwarnings(
        "ignore",
        message=r"It is recommended to use `self\.log\('(train|val|test)_",
        category=PossibleUserWarning,
    )
