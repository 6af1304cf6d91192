"""Sharded checkpoints of the running layout: saves off the loop, exact resume, visible restarts.

:class:`ShardedCheckpointer` is the part of ``DeepCEEStrategy`` that saves the sharded
checkpoints of the running layout through a
:class:`~lightning_deepcee.runtime.checkpoint_writer.CheckpointWriter` (a snapshot now, the files
and the commit in the background), loads them onto whatever layout this run has (re-partitioning
when the devices or the plan changed), and makes a restart visible: a failed fit writes
``deepcee_failure.json`` beside the checkpoints (when, at which step, which devices were lost),
and the run that resumes says which devices left or joined, the old and the new plan, the steps
to redo, and the time from the failure to its first step.

:func:`resumable_loader` wraps the train loader so that a checkpoint taken mid-epoch resumes
with the batch after the last one trained, and :func:`check_same_checkpoint` makes every rank
resume from the same checkpoint.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_deepcee._compat import default_store
from lightning_deepcee.runtime.checkpoint import load_meta, load_sharded, save_sharded
from lightning_deepcee.runtime.checkpoint_writer import CheckpointWriter, snapshot
from lightning_deepcee.runtime.liveness import DeviceLostError
from lightning_deepcee.runtime.loaders import StepLoader, TrainLoader
from lightning_deepcee.runtime.measure import device_identity
from lightning_deepcee.strategy.stage_part import PipelineStagePart

__all__ = [
    "FAILURE_FILE",
    "ShardedCheckpointer",
    "check_same_checkpoint",
    "checkpoint_dir",
    "layout_record",
    "resumable_loader",
]

FAILURE_FILE = "deepcee_failure.json"
"""Written beside the checkpoints when a fit fails; read by the run that resumes."""
WRITER_GRACE_S = 60.0
"""After a failure, how long a rank waits for the checkpoint save in flight to commit."""
_SHARD_KEYS = ("state_dict", "optimizer_states", "lr_schedulers", "optimizer_param_names")


class ShardedCheckpointer:
    """This rank's checkpoint saves, loads and restart records (see the module docstring)."""

    def __init__(self, *, asynchronous: bool) -> None:
        self.asynchronous = asynchronous
        """Saves return after the snapshot; the files are written in the background."""
        self._writer: CheckpointWriter | None = None
        self._resumed: dict[str, Any] | None = None
        """What the resume found (failure record, steps to redo), for the first step's report."""
        self._step_began = 0.0

    def writer(self, rank: int, world_size: int) -> CheckpointWriter:
        """This rank's writer (created at the first save)."""
        if self._writer is None:
            # One writer per group: the group's token in its keys tells them apart, so every
            # rank names it alike, a device that joined as well (it made no writer before).
            self._writer = CheckpointWriter(
                rank,
                world_size,
                default_store() if world_size > 1 else None,
                asynchronous=self.asynchronous,
                name="writer",
            )
        return self._writer

    def save(
        self,
        checkpoint: dict[str, Any],
        directory: Path,
        part: PipelineStagePart,
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        world_size: int,
        hosts: list[str],
        trainer: pl.Trainer | None,
    ) -> None:
        """Snapshot this rank's part of ``checkpoint`` (its stage's shard on the stage's first
        device, the rest on rank 0) and write it under ``directory``, in the background while
        fitting. The shard records each optimizer parameter's global name (re-partitioning)."""
        began = time.perf_counter()
        where = part.where
        layout = layout_record(part, hosts)
        checkpoint["optimizer_param_names"] = part.optimizer_param_names(optimizers)
        rank, stage_index, write_shard = where.rank, where.stage_index, where.writes_shard
        began = time.perf_counter()
        write_meta = rank == 0
        keys = [k for k in checkpoint if write_meta or (write_shard and k in _SHARD_KEYS)]
        frozen = snapshot({k: checkpoint[k] for k in keys})  # training goes on meanwhile

        def write(target: Path) -> None:
            save_sharded(
                frozen,
                target,
                stage_index=stage_index,
                write_shard=write_shard,
                write_meta=write_meta,
                layout=layout,
            )

        writer = self.writer(rank, world_size)
        in_fit = (
            trainer is not None
            and trainer.state.fn == TrainerFn.FITTING
            and trainer.state.status == TrainerStatus.RUNNING
        )
        writer.save(directory, write)
        if not in_fit:  # a save the caller may read at once (e.g. after fit) is complete first
            writer.wait()
        elif trainer is not None and write_meta:
            blocked = time.perf_counter() - began  # snapshot + the previous save's tail
            for logger in trainer.loggers:
                logger.log_metrics(
                    {"deepcee/checkpoint_blocking_s": blocked}, step=trainer.global_step
                )

    def load(
        self,
        directory: Path,
        part: PipelineStagePart,
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        hosts: list[str],
    ) -> dict[str, Any]:
        """This rank's part of the checkpoint in ``directory``, as Lightning restores it: the
        meta part only on an idle rank; else this stage's shard, or, when the checkpoint was
        saved under another partition, this rank's part rebuilt from every saved stage's shard.
        Rank 0 says what changed since the checkpoint was written."""
        where = part.where
        if where.idle:  # holds nothing: the meta part only, and Lightning's empty entries
            checkpoint = load_meta(directory)
            checkpoint.update(
                state_dict={}, optimizer_states=[{} for _ in optimizers], lr_schedulers=[]
            )
        else:
            checkpoint = load_sharded(
                directory,
                stage_index=where.stage_index,
                expected_ranges=part.ranges,
                fill_tied=part.tied_names_to_fill(where.stage_index),
            )
        shards = checkpoint.pop("deepcee_shards", None)
        if shards is not None:
            # The cluster or plan changed: rebuild this rank's part from every saved stage.
            checkpoint.update(part.repartitioned(shards, optimizers))
            rank_zero_info(
                f"DeepCEE: re-partitioned checkpoint {directory} from blocks "
                f"{checkpoint['deepcee']['ranges']} onto {part.ranges}."
            )
        checkpoint.pop("optimizer_param_names", None)
        self._report_resume(directory, checkpoint, layout_record(part, hosts), where.rank == 0)
        return checkpoint

    def remove(self, directory: Path, *, rank: int, world_size: int) -> None:
        """Delete ``directory`` (rank 0) once the save in flight has committed: one complete
        checkpoint stays on disk."""
        if rank == 0:
            self.writer(rank, world_size).after_commit(
                lambda: shutil.rmtree(directory, ignore_errors=True)
            )

    def regrouped(self) -> None:
        """The process group was re-formed without a lost rank: a save in flight cannot commit
        (the previous checkpoint stays the newest complete one); later saves use a new writer."""
        if self._writer is not None:
            self._writer.abandon()
        self._writer = None

    def wait(self, timeout_s: float | None = None) -> None:
        """Until the save in flight (if any) has committed."""
        if self._writer is not None:
            self._writer.wait(timeout_s=timeout_s)

    # --------------------------------------------------------------------------- restarts
    def begin_step(self, trainer: pl.Trainer | None, is_global_zero: bool) -> None:
        """Note when a training step begins; the first one after a failed run says how long
        the restart took and how many steps it redoes."""
        self._step_began = time.time()
        resumed, self._resumed = self._resumed, None
        if resumed is None or resumed.get("failure") is None:
            return
        failure = resumed["failure"]
        began = float(failure.get("step_began", failure["detected"]))
        since, detected = self._step_began - began, float(failure["detected"]) - began
        rank_zero_info(
            f"DeepCEE: training again {since:.1f} s after the step that failed began (the loss "
            f"was detected after {detected:.1f} s); {resumed['steps_redone']} step(s) to redo."
        )
        if trainer is not None and is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(
                    {
                        "deepcee/failure_to_step_s": since,
                        "deepcee/steps_redone": float(resumed["steps_redone"]),
                    },
                    step=trainer.global_step,
                )

    def record_failure(
        self, exception: BaseException, trainer: pl.Trainer | None, *, rank: int, hosts: list[str]
    ) -> None:
        """Leave a failure record beside the checkpoints for the run that resumes, and let the
        save in flight finish (bounded) unless a device was lost (it cannot finish then)."""
        directory = checkpoint_dir(trainer)
        lost_error = _device_lost(exception)
        if trainer is not None and directory is not None and trainer.state.fn == TrainerFn.FITTING:
            lost = lost_error.lost_ranks if lost_error is not None else None
            record = {
                "detected": time.time(),
                "step_began": self._step_began or time.time(),
                "step": trainer.global_step,
                "reported_by": hosts[rank] if hosts else str(rank),
                "lost": [hosts[r] if r < len(hosts) else str(r) for r in lost or ()],
                "error": f"{type(exception).__name__}: {exception}"[:2000],
            }
            with contextlib.suppress(OSError):  # a record is a courtesy; the failure propagates
                directory.mkdir(parents=True, exist_ok=True)
                temporary = directory / f".{FAILURE_FILE}.{os.getpid()}"
                temporary.write_text(json.dumps(record, indent=1))
                # The first rank to fail knows best (later ones may blame the store's host, gone
                # because it failed first): link, never replace, while the record is unreported.
                try:
                    os.link(temporary, directory / FAILURE_FILE)
                finally:
                    temporary.unlink()
        if self._writer is not None and lost_error is None:
            # Every rank is alive and fails the same way: each completes its part.
            with contextlib.suppress(Exception):
                self._writer.wait(timeout_s=WRITER_GRACE_S)

    def _report_resume(
        self, path: Path, checkpoint: dict[str, Any], layout: dict[str, Any], is_global_zero: bool
    ) -> None:
        """Say what changed since ``checkpoint`` was written, now running ``layout`` (rank 0);
        keep the failure for the first step's report."""
        saved = checkpoint.get("deepcee", {})
        before, now = list(saved.get("devices", [])), list(layout.get("devices", []))
        step = int(checkpoint.get("global_step", 0))
        if not is_global_zero:  # rank 0 reports (and files the record away)
            return
        failure = _read_failure(path.parent)
        if failure is not None:  # read: keep it as history, so the next failure is recorded
            with contextlib.suppress(OSError):
                history = path.parent / f"deepcee_failure.{int(failure['detected'])}.json"
                os.replace(path.parent / FAILURE_FILE, history)
            if int(failure.get("step", -1)) < step:
                failure = None  # a record older than this checkpoint
        redone = int(failure["step"]) - step if failure is not None else 0
        self._resumed = {"failure": failure, "steps_redone": redone}
        left = [d for d in before if d not in now]
        joined = [d for d in now if d not in before] if before else []
        lines = [f"DeepCEE: resuming from {path} (step {step})"]
        if failure is not None:
            lost = ", ".join(failure.get("lost") or []) or "unknown"
            lines.append(f"  failed at step {failure['step']}: lost {lost}; {redone} to redo")
        if before:
            left_s, joined_s = ", ".join(left) or "none", ", ".join(joined) or "none"
            lines.append(f"  devices left: {left_s}; joined: {joined_s}")
        lines.append(f"  old plan: {_layout_line(saved)}")
        lines.append(f"  new plan: {_layout_line(layout)}")
        rank_zero_info("\n".join(lines))


def layout_record(part: PipelineStagePart, hosts: list[str]) -> dict[str, Any]:
    """The built layout as ``meta.pt`` records it (re-partitioning and restart reports)."""
    assert part.plan is not None
    return {
        "num_stages": part.plan.num_stages,
        "ranges": part.ranges,
        "schedule": part.plan.schedule,
        "num_microbatches": part.num_microbatches,
        "tied": [list(tie.names) for tie, _ in part.ties],
        "placement": [list(ranks) for ranks in part.where.stages],
        "devices": list(hosts),
    }


def check_same_checkpoint(trainer: pl.Trainer | None, world_size: int) -> None:
    """Every rank must have resumed from the same checkpoint (each resolves ``ckpt_path``
    alone): a directory that is not shared by every device gives each its own "last"
    checkpoint, or none. Called when training starts, after Lightning's restore (which sets
    ``trainer.ckpt_path``), before the first step. Collective when ``world_size > 1``."""
    if trainer is None or world_size < 2:
        return
    path = trainer.ckpt_path
    mine = (device_identity(), None if path is None else str(path))
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    if len({p for _, p in gathered}) > 1:
        per_rank = ", ".join(f"rank {r} ({h}): {p}" for r, (h, p) in enumerate(gathered))
        raise RuntimeError(
            f"DeepCEEStrategy: the ranks would resume from different checkpoints ({per_rank})."
            " Checkpoints must be in a directory every device shares (e.g. NFS), and every"
            " rank must be given the same ckpt_path."
        )


def resumable_loader(
    dataloader: object, trainer: pl.Trainer | None, is_idle: Callable[[], bool]
) -> object:
    """Train and evaluation loaders stand in for batches on idle ranks, and the train loader
    resumes mid-epoch (:mod:`lightning_deepcee.runtime.loaders`). A loader with a ``state_dict``
    of its own, and the predict loaders (the module's ``predict_step`` sees the batch on every
    rank), are read as they are."""
    stateful = callable(getattr(dataloader, "state_dict", None))
    if trainer is None or trainer.predicting or stateful:
        return dataloader
    if not trainer.training:
        return StepLoader(dataloader, is_idle)

    def trained() -> int:
        current = trainer.fit_loop.epoch_loop.batch_progress.current
        done = int(current.processed)  # type: ignore[attr-defined]  # a _ProcessedTracker
        return done if done < trainer.num_training_batches else 0

    def epoch() -> int:
        progress: Any = trainer.fit_loop.epoch_progress.current  # a _ProcessedTracker
        return int(progress.processed)

    return TrainLoader(dataloader, is_idle, epoch=epoch, trained=trained)


def _layout_line(layout: dict[str, Any]) -> str:
    """``[0, 3) on cloud0 | [3, 6) on cloud1,edge0; 1f1b, 8 micro-batches`` (device names where
    the checkpoint recorded them, else ranks)."""
    devices = layout.get("devices") or []
    placement = layout.get("placement") or [[] for _ in layout.get("ranges", [])]
    parts = []
    for (a, b), ranks in zip(layout.get("ranges", []), placement, strict=False):
        names = [devices[r] if r < len(devices) else str(r) for r in ranks]
        parts.append(f"[{a}, {b}) on {','.join(names) or '?'}")
    return (
        " | ".join(parts)
        + f"; {layout.get('schedule')}, {layout.get('num_microbatches')} micro-batches"
    )


def _device_lost(exception: BaseException) -> DeviceLostError | None:
    for cause in itertools.islice(_chain(exception), 16):
        if isinstance(cause, DeviceLostError):
            return cause
    return None


def _chain(exception: BaseException | None) -> Iterator[BaseException]:
    while exception is not None:
        yield exception
        exception = exception.__cause__ or exception.__context__


def checkpoint_dir(trainer: pl.Trainer | None) -> Path | None:
    """The checkpoint callback's directory, ``None`` without one."""
    callback = trainer.checkpoint_callback if trainer is not None else None
    dirpath = getattr(callback, "dirpath", None)
    return Path(dirpath) if dirpath else None


def _read_failure(directory: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((directory / FAILURE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "step" in record else None
