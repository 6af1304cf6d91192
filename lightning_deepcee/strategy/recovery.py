"""Recovery in the same processes: after a lost device the survivors keep training, no restart.

:class:`InProcessRecovery` is the part of ``DeepCEEStrategy`` that turns a step failed by a lost
device into a short pause instead of a job restart (which pays for a new Python and torch on
every device, a new rendezvous and a new set-up). When a training step raises
:class:`~lightning_deepcee.runtime.liveness.DeviceLostError` naming the lost ranks, every
survivor, still inside that step:

1. leaves the old process group (a survivor blocked on it fails at once), agrees on the
   members with the others and forms a new process group of them over the rendezvous store
   (:mod:`~lightning_deepcee.runtime.regroup`); Lightning's ranks, the heartbeat and the
   checkpoint writer move to it;
2. plans for the survivors on the profile it has (the lost devices' rows dropped, nothing
   measured again, no plan trial) and builds that plan;
3. loads the newest complete checkpoint onto it (re-partitioned: the lost stage's state exists
   only there), and
4. replays the steps trained since that checkpoint, from the batches it kept (the real batch,
   or, on a rank that stood in for it, the indices to read it), then trains the failed step.

Lightning's loop goes on with that step's optimizer step, a no-op by then (every gradient is
``None``); the step count, the data order and the logs go on as if nothing had happened. Each
replayed step is the step Lightning ran: the pipeline's forward and backward, Lightning's
``configure_gradient_clipping``, the optimizer step and the step-interval schedulers; so the
parameters equal an uninterrupted run. Settings the replay cannot repeat exactly (gradient
accumulation, a module's own ``optimizer_step``, plateau schedulers, ...) make the strategy
restart the job instead, and set-up says so (:meth:`InProcessRecovery.why_not`).
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_deepcee._compat import tree_flatten
from lightning_deepcee.planner import Plan
from lightning_deepcee.profiler import ClusterProfile
from lightning_deepcee.runtime import PipelineSpec
from lightning_deepcee.runtime.checkpoint import load_meta, newest_checkpoint
from lightning_deepcee.runtime.liveness import DeviceLostError
from lightning_deepcee.runtime.manual_layout import ManualLayout
from lightning_deepcee.runtime.regroup import (
    RegroupError,
    agree_survivors,
    leave_group,
    reform_group,
)
from lightning_deepcee.strategy.checkpointer import ShardedCheckpointer, checkpoint_dir
from lightning_deepcee.strategy.failure_naming import FailureNaming
from lightning_deepcee.strategy.layout_build import BuildHost, build_layout
from lightning_deepcee.strategy.reporting import print_everywhere
from lightning_deepcee.strategy.setup_plan import initial_plan
from lightning_deepcee.strategy.setup_profile import ProfileSettings
from lightning_deepcee.strategy.step_log import StepLog

__all__ = [
    "KEEP_LIMIT_BYTES",
    "InProcessRecovery",
    "RecoveryHost",
    "adopt_group",
    "load_onto_layout",
    "plan_on_profile",
]

KEEP_LIMIT_BYTES = 2 * 2**30
"""At most this many bytes of batches are kept for a replay (on the host, per rank)."""
_MODULE_HOOKS = ("optimizer_step", "optimizer_zero_grad", "lr_scheduler_step")
"""Module hooks a replayed step would not call: a module that overrides one restarts instead."""


@dataclasses.dataclass
class _Step:
    """One training step's data, kept until a newer checkpoint makes it unnecessary."""

    step: int
    """``trainer.global_step`` when the step began."""
    began: float
    """``time.time()`` when the step began."""
    batch: Any
    reread: Callable[[], Any] | None
    """Reads the real batch when ``batch`` is an idle rank's stand-in."""
    size: int = 0
    """Bytes of the batch's tensors."""


class _Clock:
    """Seconds per phase of a recovery, from the failed step's start (wall clock)."""

    def __init__(self, began: float) -> None:
        self.began = self._last = began
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.time()
        self.laps[name] = round(now - self._last, 3)
        self._last = now

    def total(self) -> float:
        return round(self._last - self.began, 3)


class RecoveryHost(BuildHost, Protocol):
    """What recovery uses of the strategy: building layouts, its checkpoints, its step."""

    checkpointer: ShardedCheckpointer
    step_log: StepLog
    failures: FailureNaming
    plan_arg: str | None
    device_gain: float
    compression: tuple[str, ...]
    profile_settings: ProfileSettings

    @property
    def spec(self) -> PipelineSpec | None: ...

    @property
    def plan(self) -> Plan | None: ...

    @property
    def cluster_environment(self) -> Any: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def num_nodes(self) -> int: ...

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None: ...

    def set_world_ranks(self) -> None: ...

    def pipeline_step(self, batch: Any, *, log: bool = True) -> torch.Tensor: ...

    def backward(self, closure_loss: torch.Tensor, optimizer: Any) -> torch.Tensor: ...


class InProcessRecovery:
    """This rank's in-process recovery: the steps kept for a replay, and the recovery itself
    (see the module docstring)."""

    def __init__(self, wanted: bool, *, timeout_s: float) -> None:
        self.wanted = wanted
        """The strategy's ``recover_in_process``."""
        self.enabled = wanted
        """Whether this fit recovers in process (``wanted``, and :meth:`why_not` found nothing)."""
        self._steps: list[_Step] = []
        self._kept_bytes = 0
        self._overflowed = False
        self._saved_before = -1
        """The step of the save before the newest: a replay may start there (the newest save
        may not have committed when the device is lost)."""
        self._saved = -1
        self.timeout_s = timeout_s
        """The strategy's ``timeout_s``: the re-formed group's."""
        self.recoveries = 0
        """In-process recoveries of this run."""
        self.last: dict[str, Any] | None = None
        """The last recovery: lost devices, steps redone, seconds in all and per phase."""

    # ------------------------------------------------------------------------------ set-up
    def why_not(self, host: RecoveryHost, trainer: pl.Trainer) -> str | None:
        """Why this run would restart rather than recover in its processes (``None``: it can).
        The same answer on every rank: it reads only settings every rank shares."""
        module = host.lightning_module
        environment = host.cluster_environment
        if host.plan_arg != "auto":
            return "the layout is manual or a saved plan, made for this number of devices"
        if dist.is_initialized() and dist.get_backend() != "gloo":
            return f"the {dist.get_backend()} backend (recovery in process runs on gloo)"
        if host.num_processes != 1:
            return "several processes per node (a lost node takes all of them)"
        if not isinstance(environment, (TorchElasticEnvironment, LightningEnvironment)):
            return f"ranks come from {type(environment).__name__}, which cannot renumber them"
        if checkpoint_dir(trainer) is None:
            return "no checkpoint callback (the lost stage's state comes from a checkpoint)"
        if trainer.accumulate_grad_batches != 1:
            return "accumulate_grad_batches > 1"
        overridden = [h for h in _MODULE_HOOKS if module is not None and is_overridden(h, module)]
        if overridden:
            return f"the module overrides {', '.join(overridden)}"
        for config in host.lr_scheduler_configs:
            if config.reduce_on_plateau or (config.interval == "step" and config.frequency != 1):
                return "a plateau scheduler, or a step scheduler with frequency > 1"
        return None

    def start(self, host: RecoveryHost, trainer: pl.Trainer, world_size: int) -> None:
        """At the start of fitting: keep steps for a replay, or say why a loss will restart."""
        self._steps, self._kept_bytes, self._overflowed = [], 0, False
        self._saved = self._saved_before = trainer.global_step  # a resume starts at a save
        self.enabled = self.wanted and world_size > 1  # one process has nothing to lose
        if not self.enabled:
            return
        why = self.why_not(host, trainer)
        self.enabled = why is None
        if why is not None:
            rank_zero_info(
                f"DeepCEE: a lost device will restart the job, not recover in its processes: {why}."
            )

    # ------------------------------------------------------------------------------- steps
    def note_step(self, step: int, batch: Any, reread: Callable[[], Any] | None) -> None:
        """Keep this step's batch for a replay (only while recovery is on). Past
        ``KEEP_LIMIT_BYTES`` of batches since the last save, nothing more is kept until the next
        save, and a loss until then restarts the job. Every rank counts the same bytes (a
        stand-in has the real batch's shapes), so every rank decides alike."""
        if not self.enabled or self._overflowed:
            return
        size = _tensor_bytes(batch)
        if self._kept_bytes + size > KEEP_LIMIT_BYTES:
            rank_zero_info(
                f"DeepCEE: the batches since the last checkpoint exceed "
                f"{KEEP_LIMIT_BYTES / 2**30:.0f} GiB: until the next one, a lost device restarts "
                "the job (checkpoint more often to recover in process)."
            )
            self._steps, self._kept_bytes, self._overflowed = [], 0, True
            return
        self._kept_bytes += size
        self._steps.append(_Step(step, time.time(), batch, reread, size))

    def note_save(self, step: int) -> None:
        """A checkpoint of ``step`` began: the steps before the save before it are not needed."""
        if step == self._saved:
            return
        self._saved_before, self._saved = self._saved, step
        if self._overflowed:  # keep again from this save on
            self._saved_before, self._overflowed = step, False
        self._steps = [s for s in self._steps if s.step >= self._saved_before]
        self._kept_bytes = sum(s.size for s in self._steps)

    # ---------------------------------------------------------------------------- recovery
    def recover(
        self, host: RecoveryHost, trainer: pl.Trainer, error: DeviceLostError
    ) -> torch.Tensor:
        """Recover from ``error`` inside the failed training step and return its loss; raise
        ``error`` (the job restarts) when this run cannot (see the module docstring)."""
        rank, world_size = host.global_rank, host.world_size
        directory = checkpoint_dir(trainer)
        path = newest_checkpoint(directory) if directory is not None else None
        why = self._why_not_now(error, path)
        if why is not None:
            print_everywhere(f"[rank {rank}] DeepCEE: restarting the job, not recovering: {why}")
            raise error
        assert path is not None and error.lost_ranks is not None
        current = self._steps[-1]
        clock = _Clock(current.began)
        # Nothing may hold the old groups once they are destroyed: their sockets close then,
        # and a survivor blocked on this rank fails at once (not after the timeout).
        host.stage_part.release_groups()
        host.step_log.release_group()
        _clear_frames(error)
        store, backend = leave_group()
        try:
            members = agree_survivors(store, rank, world_size, error.lost_ranks)
        except RegroupError as exc:
            print_everywhere(f"[rank {rank}] DeepCEE: restarting the job, not recovering: {exc}")
            raise error from exc
        clock.lap("named")
        lost = [host.failures.hosts[r] for r in range(world_size) if r not in members]
        _regroup(host, store, members, backend, timedelta(seconds=self.timeout_s))
        clock.lap("regroup")
        plan = plan_on_profile(host)
        clock.lap("plan")
        host.stage_part.restore_blocks()
        build_layout(host, plan, trainer)
        saved_step = load_onto_layout(host, path)
        clock.lap("load")
        redo = [s for s in self._steps[:-1] if s.step >= saved_step]
        for kept in redo:
            self._train(host, trainer, kept, schedulers=True)
        clock.lap("redo")
        loss = self._train(host, trainer, current, schedulers=False)
        clock.lap("step")
        self.recoveries += 1
        self.last = {
            "lost": lost,
            "steps_redone": len(redo),
            "seconds": clock.total(),
            **clock.laps,
        }
        rank_zero_info(
            f"DeepCEE: lost {', '.join(lost)}; training again on {len(members)} devices in this "
            f"process, {clock.total():.1f} s after the failed step began (loss named and agreed "
            f"{clock.laps['named']:.1f} s, group re-formed {clock.laps['regroup']:.1f} s, planned "
            f"{clock.laps['plan']:.1f} s, {path.name} loaded {clock.laps['load']:.1f} s, "
            f"{len(redo)} step(s) redone {clock.laps['redo']:.1f} s, the failed step "
            f"{clock.laps['step']:.1f} s)"
        )
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(
                    {"deepcee/failure_to_step_s": clock.total(), "deepcee/steps_redone": len(redo)},
                    step=trainer.global_step,
                )
        return loss

    def _why_not_now(self, error: DeviceLostError, path: Path | None) -> str | None:
        if not self.enabled:
            return "in-process recovery is off for this run (set-up said why)"
        if error.lost_ranks is None:
            return "the lost device is not known"
        if path is None:
            return "no complete checkpoint yet"
        if self._overflowed or not self._steps:
            return "the batches since the last checkpoint were not kept (over the limit)"
        saved = int(load_meta(path).get("global_step", 0))
        if saved < self._steps[0].step:
            return f"the newest complete checkpoint (step {saved}) is older than the steps kept"
        return None

    def _train(
        self, host: RecoveryHost, trainer: pl.Trainer, kept: _Step, *, schedulers: bool
    ) -> torch.Tensor:
        """One step as Lightning runs it: zero the gradients, forward and backward, clip,
        optimizer step, then (``schedulers``) the step-interval schedulers. The gradients are
        ``None`` afterwards, so Lightning's own optimizer step of the failed step is a no-op."""
        module = host.lightning_module
        assert module is not None
        batch = kept.batch
        if kept.reread is not None and not host.is_idle:
            batch = kept.reread()  # a stand-in where this rank now needs the real batch
        for optimizer in host.optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss = host.pipeline_step(batch, log=not schedulers)
        host.backward(loss, host.optimizers[0])  # automatic optimization: one optimizer
        for optimizer in host.optimizers:
            module.configure_gradient_clipping(
                optimizer,
                gradient_clip_val=trainer.gradient_clip_val,
                gradient_clip_algorithm=trainer.gradient_clip_algorithm,
            )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if schedulers:
            for config in host.lr_scheduler_configs:
                if config.interval == "step":
                    config.scheduler.step()  # type: ignore[call-arg]  # no plateau (why_not)
        return loss


def _regroup(
    host: RecoveryHost, store: Any, members: list[int], backend: str, timeout: timedelta
) -> None:
    """Re-form the process group of ``members`` (old ranks) and make Lightning, the profile,
    the checkpoint writer and the strategy's own records use the new ranks."""
    rank = reform_group(store, members, host.global_rank, backend=backend, timeout=timeout)
    profile = None if host.cluster_profile is None else host.cluster_profile.subset(members)
    adopt_group(host, rank, [host.failures.hosts[m] for m in members], profile)


def adopt_group(
    host: RecoveryHost, rank: int, hosts: list[str], profile: ClusterProfile | None
) -> None:
    """Make Lightning, the checkpoint writer and the strategy's records use the default process
    group just formed (this rank is ``rank`` of ``len(hosts)``, whose devices are ``hosts``)
    and the cluster ``profile`` of its members. Collective (a new group token)."""
    # Lightning's ranks: torchelastic's and Lightning's environments read them from here.
    ranks = {"RANK": rank, "WORLD_SIZE": len(hosts), "GROUP_RANK": rank, "NODE_RANK": rank}
    os.environ.update({k: str(v) for k, v in ranks.items()})
    host.num_nodes = len(hosts)  # one process per node (why_not)
    host.set_world_ranks()
    if (host.global_rank, host.world_size) != (rank, len(hosts)):
        raise RuntimeError(
            f"DeepCEE: rank {rank} of {len(hosts)} in the new group, but Lightning's environment "
            f"says {host.global_rank} of {host.world_size}"
        )
    host.cluster_profile = profile
    host.checkpointer.regrouped()
    host.failures.regrouped(hosts, rank)


def plan_on_profile(host: RecoveryHost, global_batch_size: int | None = None) -> Plan:
    """The plan for the group's devices, searched on the profile the run has (no measurement,
    no trial) for ``global_batch_size`` samples a step (default: the running plan's).
    Collective (the search is spread over the ranks: they must agree on the arguments)."""
    assert host.spec is not None and host.plan is not None
    return initial_plan(
        "auto",
        manual=ManualLayout.from_arguments(None, None, None, None, None),
        blocks=host.spec.blocks,
        world_size=host.world_size,
        cluster_profile=host.cluster_profile,
        global_batch_size=global_batch_size or host.plan.global_batch_size,
        device_gain=host.device_gain,
        compression=host.compression,
        device_cache=host.profile_settings.device_cache,
    ).plan


def load_onto_layout(host: RecoveryHost, path: Path) -> int:
    """Load the checkpoint at ``path`` onto the layout just built (re-partitioned): weights,
    optimizer and scheduler states; its global step."""
    checkpoint = host.checkpointer.load(
        path, host.stage_part, host.optimizers, hosts=host.failures.hosts
    )
    if not host.is_idle:
        module = host.lightning_module
        assert module is not None
        module.load_state_dict(checkpoint["state_dict"], strict=True)
        for optimizer, state in zip(host.optimizers, checkpoint["optimizer_states"], strict=True):
            optimizer.load_state_dict(state)
        for config, state in zip(
            host.lr_scheduler_configs, checkpoint["lr_schedulers"], strict=True
        ):
            config.scheduler.load_state_dict(state)
    return int(checkpoint.get("global_step", 0))


def _clear_frames(error: BaseException) -> None:
    """Drop the local variables of the frames the failure unwound (they hold the executors,
    hence the process groups); frames still running are left as they are."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        traceback.clear_frames(cause.__traceback__)
        cause = cause.__cause__ or cause.__context__


def _tensor_bytes(batch: Any) -> int:
    """Bytes of the tensors in ``batch`` (any nesting torch's pytree knows)."""
    leaves = tree_flatten(batch)[0]
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
