"""The checkpoint half of DeepCEEStrategy: sharded saves off the loop, exact resume, restarts.

:class:`ElasticStrategy` saves the sharded checkpoints of the running layout through a
:class:`~lightning_deepcee.runtime.checkpoint_writer.CheckpointWriter` (a snapshot now, the
files and the commit in the background), loads them onto whatever layout this run has
(re-partitioning when the devices or the plan changed), and makes a restart exact and visible:

- the train loader is wrapped in a :class:`~lightning_deepcee.runtime.loaders.TrainLoader`, so a
  checkpoint taken mid-epoch resumes with the batch after the last one trained (Lightning alone
  restarts the epoch's data), and a rank the plan leaves idle reads no batches;
- a failed fit writes ``deepcee_failure.json`` beside the checkpoints (when, at which step,
  which devices were lost), and the run that resumes says which devices left or joined, the
  old and the new plan, the steps to redo, and the time from the failure to its first step.

:class:`~lightning_deepcee.strategy.deepcee.DeepCEEStrategy` adds setup and the steps.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_deepcee._compat import PATH, default_store, set_default_timeout
from lightning_deepcee.runtime.checkpoint import load_meta, load_sharded, save_sharded
from lightning_deepcee.runtime.checkpoint_writer import CheckpointWriter, snapshot
from lightning_deepcee.runtime.liveness import DeviceLostError, agree_group_token
from lightning_deepcee.runtime.loaders import StepLoader, TrainLoader
from lightning_deepcee.runtime.measure import device_identity
from lightning_deepcee.runtime.ties import tied_names_to_fill
from lightning_deepcee.strategy.layout import PipelineLayoutStrategy

__all__ = ["FAILURE_FILE", "ElasticStrategy"]

FAILURE_FILE = "deepcee_failure.json"
"""Written beside the checkpoints when a fit fails; read by the run that resumes."""
START_TIMEOUT_S = 600.0
"""How long forming the process group waits for the last device to arrive. A device at a few
percent of a core takes a minute or more to import torch and Lightning and build its model before
it joins; the strategy's ``timeout_s`` (how soon a dead device stops the others) starts after."""
WRITER_GRACE_S = 60.0
"""After a failure, how long a rank waits for the checkpoint save in flight to commit."""
_SHARD_KEYS = ("state_dict", "optimizer_states", "lr_schedulers", "optimizer_param_names")


class ElasticStrategy(PipelineLayoutStrategy):
    """Sharded checkpoints and restarts (see the module docstring); attributes set by
    :class:`~lightning_deepcee.strategy.deepcee.DeepCEEStrategy`."""

    async_checkpoint: bool
    device_cache: str | None
    _hosts: list[str]
    _writer: CheckpointWriter | None = None
    _resumed: dict[str, Any] | None = None
    """What the resume found (failure record, steps to redo), for the first step's report."""
    _step_began: float = 0.0

    @override
    def setup_distributed(self) -> None:
        """Form the process group with ``START_TIMEOUT_S`` for the devices to arrive, then run it
        with the strategy's own timeout (``timeout_s``)."""
        running = self._timeout
        start = timedelta(seconds=START_TIMEOUT_S)
        self._timeout = start if running is None else max(running, start)
        try:
            super().setup_distributed()
        finally:
            self._timeout = running
        if running is not None and dist.is_initialized():
            set_default_timeout(running)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.world_size > 1:
            agree_group_token()  # before any heartbeat: the keys of this start of the job
        self._check_same_checkpoint()

    def _check_same_checkpoint(self) -> None:
        """Every rank must resume from the same checkpoint (each resolves ``ckpt_path`` alone,
        before there is a process group): a directory that is not shared by every device gives
        each its own "last" checkpoint, or none."""
        module = self.lightning_module
        if module is None or module._trainer is None or self.world_size < 2:
            return
        path = module.trainer.ckpt_path
        mine = (device_identity(), None if path is None else str(path))
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        if len({p for _, p in gathered}) > 1:
            per_rank = ", ".join(f"rank {r} ({h}): {p}" for r, (h, p) in enumerate(gathered))
            raise RuntimeError(
                f"DeepCEEStrategy: the ranks would resume from different checkpoints ({per_rank})."
                " Checkpoints must be in a directory every device shares (e.g. NFS), and every"
                " rank must be given the same ckpt_path."
            )

    def device_cache_dir(self) -> str | None:
        """Where this device keeps its block timings (``DeepCEEStrategy(device_cache=...)``)."""
        if self.device_cache != "auto":
            return self.device_cache
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
        if not run_id or run_id == "none" or restarts < 1:  # no restart can reuse it
            return None
        return str(Path(tempfile.gettempdir()) / f"deepcee-devices-{run_id}")

    # ------------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    def checkpoint_writer(self) -> CheckpointWriter:
        """This rank's writer (created at the first save)."""
        if self._writer is None:
            self._writer = CheckpointWriter(
                self.global_rank,
                self.world_size,
                default_store() if self.world_size > 1 else None,
                asynchronous=self.async_checkpoint,
            )
        return self._writer

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("DeepCEEStrategy.save_checkpoint does not take storage_options.")
        began = time.perf_counter()
        layout = self._layout()
        checkpoint["optimizer_param_names"] = self._optimizer_param_names()
        write_shard, write_meta = self.writes_shard, self.is_global_zero
        keys = [k for k in checkpoint if write_meta or (write_shard and k in _SHARD_KEYS)]
        frozen = snapshot({k: checkpoint[k] for k in keys})  # training goes on meanwhile
        stage_index = self.stage_index

        def write(directory: Path) -> None:
            save_sharded(
                frozen,
                directory,
                stage_index=stage_index,
                write_shard=write_shard,
                write_meta=write_meta,
                layout=layout,
            )

        writer = self.checkpoint_writer()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        in_fit = (
            trainer is not None
            and trainer.state.fn == TrainerFn.FITTING
            and trainer.state.status == TrainerStatus.RUNNING
        )
        writer.save(Path(filepath), write)
        if not in_fit:  # a save the caller may read at once (e.g. after fit) is complete first
            writer.wait()
        elif trainer is not None and self.is_global_zero:
            blocked = time.perf_counter() - began  # snapshot + the previous save's tail
            for logger in trainer.loggers:
                logger.log_metrics(
                    {"deepcee/checkpoint_blocking_s": blocked}, step=trainer.global_step
                )

    def _layout(self) -> dict[str, Any]:
        """The running layout as ``meta.pt`` records it (re-partitioning and restart reports)."""
        return {
            "num_stages": self.num_stages,
            "ranges": self.ranges,
            "schedule": self.schedule_kind,
            "num_microbatches": self.num_microbatches,
            "tied": [list(tie.names) for tie, _ in self._ties],
            "placement": self.placement,
            "devices": list(self._hosts),
        }

    @override
    def load_checkpoint(self, checkpoint_path: PATH, weights_only: bool | None = None) -> dict:
        module = self.lightning_module
        assert module is not None
        if self.is_idle:  # holds nothing: the meta part only, and Lightning's empty entries
            checkpoint = load_meta(Path(checkpoint_path))
            checkpoint.update(
                state_dict={}, optimizer_states=[{} for _ in self.optimizers], lr_schedulers=[]
            )
        else:
            checkpoint = load_sharded(
                Path(checkpoint_path),
                stage_index=self.stage_index,
                expected_ranges=self.ranges,
                fill_tied=tied_names_to_fill(
                    list(module.state_dict()),
                    [tie for tie, _ in self._ties],
                    self.ranges,
                    self.stage_index,
                ),
            )
        shards = checkpoint.pop("deepcee_shards", None)
        if shards is not None:
            # The cluster or plan changed: rebuild this rank's part from every saved stage.
            checkpoint.update(self._repartitioned(shards))
            rank_zero_info(
                f"DeepCEE: re-partitioned checkpoint {checkpoint_path} from blocks "
                f"{checkpoint['deepcee']['ranges']} onto {self.ranges}."
            )
        checkpoint.pop("optimizer_param_names", None)
        self._report_resume(Path(checkpoint_path), checkpoint)
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: PATH) -> None:
        # Only once the save in flight has committed: one complete checkpoint stays on disk.
        if self.is_global_zero:
            self.checkpoint_writer().after_commit(
                lambda: shutil.rmtree(filepath, ignore_errors=True)
            )

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Train and evaluation loaders stand in for batches on idle ranks, and the train loader
        resumes mid-epoch (:mod:`lightning_deepcee.runtime.loaders`). A loader with a ``state_dict``
        of its own, and the predict loaders (the module's ``predict_step`` sees the batch on every
        rank), are read as they are."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        stateful = callable(getattr(dataloader, "state_dict", None))
        if trainer is None or trainer.predicting or stateful:
            return dataloader
        if not trainer.training:
            return StepLoader(dataloader, lambda: self.is_idle)

        def trained() -> int:
            current = trainer.fit_loop.epoch_loop.batch_progress.current
            done = int(current.processed)  # type: ignore[attr-defined]  # a _ProcessedTracker
            return done if done < trainer.num_training_batches else 0

        def epoch() -> int:
            progress: Any = trainer.fit_loop.epoch_progress.current  # a _ProcessedTracker
            return int(progress.processed)

        return TrainLoader(dataloader, lambda: self.is_idle, epoch=epoch, trained=trained)

    @override
    def on_train_end(self) -> None:
        if self._writer is not None:
            self._writer.wait()  # the last save is complete when fit returns
        super().on_train_end()

    # --------------------------------------------------------------------------- restarts
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
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
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and self.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(
                    {
                        "deepcee/failure_to_step_s": since,
                        "deepcee/steps_redone": float(resumed["steps_redone"]),
                    },
                    step=trainer.global_step,
                )

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Leave a failure record beside the checkpoints for the run that resumes, and let the
        save in flight finish (bounded) unless a device was lost (it cannot finish then)."""
        super().on_exception(exception)
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        directory = _checkpoint_dir(trainer)
        lost_error = _device_lost(exception)
        if trainer is not None and directory is not None and trainer.state.fn == TrainerFn.FITTING:
            lost = lost_error.lost_ranks if lost_error is not None else None
            hosts = self._hosts
            record = {
                "detected": time.time(),
                "step_began": self._step_began or time.time(),
                "step": trainer.global_step,
                "reported_by": hosts[self.global_rank] if hosts else str(self.global_rank),
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

    def _report_resume(self, path: Path, checkpoint: dict[str, Any]) -> None:
        """Say what changed since ``checkpoint`` was written (rank 0); keep the failure for the
        first step's report."""
        saved = checkpoint.get("deepcee", {})
        before, now = list(saved.get("devices", [])), list(self._hosts)
        step = int(checkpoint.get("global_step", 0))
        if not self.is_global_zero:  # rank 0 reports (and files the record away)
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
        lines.append(f"  new plan: {_layout_line(self._layout())}")
        rank_zero_info("\n".join(lines))


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


def _chain(exception: BaseException | None) -> Any:
    while exception is not None:
        yield exception
        exception = exception.__cause__ or exception.__context__


def _checkpoint_dir(trainer: pl.Trainer | None) -> Path | None:
    callback = trainer.checkpoint_callback if trainer is not None else None
    dirpath = getattr(callback, "dirpath", None)
    return Path(dirpath) if dirpath else None


def _read_failure(directory: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((directory / FAILURE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "step" in record else None
