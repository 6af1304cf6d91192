"""A returning device joins the running job at a step boundary, without a restart.

:class:`Admission` is the part of ``DeepCEEStrategy`` that keeps the job's doorway open and
admits a device that comes back (``runtime/admission.py``: the note beside the checkpoints and
the keys in the store).

The job: rank 0 opens the doorway at the first step of every group (training starts, a lost
device's survivors or an admission re-formed it), and looks for a knock at each training
step; a knock raises the step's signal (:meth:`Admission.signal`), which the step's sum of
losses carries to every rank. At the next
step boundary (:meth:`Admission.at_step_start`) every rank saves a checkpoint of the state
there, rank 0 answers the device with it, and the ranks form a new process group with the
device (its rank is the next one), waiting up to ``JOIN_WAIT_S`` for it. Then every member takes
the profile of the new group (the device's row and links as this job's set-up measured them:
only a device the set-up profiled can come back), plans on it, builds the plan and loads that
checkpoint onto it; the step then runs on the new group. A device that does not arrive in time
is left out: the ranks form their group again and go on from the same checkpoint.

The device (started with ``DEEPCEE_JOIN=1``, the same script and ``ckpt_path="last"``, as a
world of one): it sets up alone, knocks at the end of set-up (:meth:`Admission.at_setup`),
resumes from the checkpoint of the answer (:meth:`Admission.checkpoint_path` replaces its
``ckpt_path``), and at its first step boundary joins the new group and does what the others do.

The checkpoint is saved when the next step has begun, so its loop state is set back to the end
of the previous step (:meth:`Admission.at_save`): the device's loop resumes at the step where
the others are, without running a validation again.
"""

from __future__ import annotations

import dataclasses
import gc
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_deepcee._compat import default_store, set_default_timeout
from lightning_deepcee.profiler import ClusterProfile
from lightning_deepcee.runtime.admission import (
    Answer,
    Doorway,
    JoinError,
    base_store,
    form_group,
    knock,
    wants_to_join,
)
from lightning_deepcee.runtime.measure.cluster import device_identity
from lightning_deepcee.strategy.checkpointer import checkpoint_dir
from lightning_deepcee.strategy.layout_build import build_layout
from lightning_deepcee.strategy.recovery import (
    InProcessRecovery,
    RecoveryHost,
    adopt_group,
    load_onto_layout,
    plan_on_profile,
)
from lightning_deepcee.strategy.reporting import print_everywhere
from lightning_deepcee.strategy.setup_profile import device_cache_dir

__all__ = ["JOIN_WAIT_S", "Admission", "AdmissionHost", "end_of_last_step"]

JOIN_WAIT_S = 120.0
"""How long the job waits for an answered device to arrive, and a device for its answer."""
_PROGRESS = "epoch_loop.batch_progress"


class AdmissionHost(RecoveryHost, Protocol):
    """What admission uses of the strategy: recovery's needs, its recovery and its trial."""

    recovery: InProcessRecovery

    @property
    def trial_running(self) -> bool: ...


class _Clock:
    """Seconds per phase since ``began``."""

    def __init__(self) -> None:
        self.began = self._last = time.time()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.time()
        self.laps[name] = round(now - self._last, 3)
        self._last = now


class Admission:
    """This rank's side of the doorway (see the module docstring)."""

    def __init__(self) -> None:
        self.doorway = Doorway()
        self.joining = wants_to_join()
        """This process was started to join a running job and has not joined yet."""
        self.admissions = 0
        """Devices admitted by this process's job (or 1 on a device that joined)."""
        self.last: dict[str, Any] | None = None
        """The last admission: the device, the new world, seconds in all and per phase."""
        self._answer: Answer | None = None
        self._store: Any = None
        self._known: ClusterProfile | None = None
        self._known_hosts: list[str] = []
        self._knock: dict[str, Any] | None = None
        self._saving = False
        self._opened: list[str] | None = None
        """The members whose doorway is open (rank 0 publishes it)."""

    # ------------------------------------------------------------------------------ set-up
    def at_setup(self, host: AdmissionHost, trainer: pl.Trainer) -> None:
        """End of set-up. The job keeps the profile set-up measured (a returning device gets
        its rows back); a joining device knocks and waits for the answer."""
        if not self.joining:
            profile = host.cluster_profile
            if profile is not None and profile.num_devices == len(host.failures.hosts):
                self._known, self._known_hosts = profile, list(host.failures.hosts)
            return
        directory = checkpoint_dir(trainer)
        if directory is None:  # ckpt_path is known only once Lightning restores (_join checks)
            raise JoinError(
                "a joining device resumes from the job's checkpoints: give it the job's "
                "checkpoint callback (ElasticCheckpoint, the same dirpath) and ckpt_path='last'"
            )
        if host.world_size != 1:
            raise JoinError(f"a joining device starts alone (world size 1, not {host.world_size})")
        name = device_identity()
        print_everywhere(f"DeepCEE: {name} asks to join the job in {directory}")
        self._store, self._answer = knock(directory, name, wait_s=JOIN_WAIT_S)

    def checkpoint_path(self, path: Path) -> Path:
        """The checkpoint to resume from: the answer's on a joining device, else ``path``."""
        return Path(self._answer.checkpoint) if self.joining and self._answer else path

    def _open(self, host: AdmissionHost, trainer: pl.Trainer) -> None:
        """Open the doorway of the current group (rank 0, when the job can take a device in
        its processes: the same conditions as recovering from a lost one)."""
        directory, store = checkpoint_dir(trainer), default_store()
        self._opened = list(host.failures.hosts)
        if host.global_rank != 0 or not host.recovery.enabled or self._known is None:
            return
        if directory is not None and store is not None:
            self.doorway.publish(directory, store, self._opened)

    # ------------------------------------------------------------------------------- steps
    def signal(self, host: AdmissionHost) -> float:
        """1.0 on rank 0 when a device waits at the doorway (one store check a step), else 0.0;
        a device the job cannot take back is refused at once."""
        if host.global_rank != 0 or self.joining or host.trial_running:
            return 0.0
        found = self.doorway.knocked()
        if found is None:
            return 0.0
        name = str(found.get("host"))
        why = None
        if name not in self._known_hosts:
            why = "it was not profiled at this job's set-up (restart the job to add a device)"
        elif name in host.failures.hosts:
            why = "a device of that name is training in the job"
        if why is not None:
            self.doorway.answer(found, {"refused": why})
            return 0.0
        self._knock = found
        return 1.0

    def at_step_start(self, host: AdmissionHost, trainer: pl.Trainer, signal: float) -> None:
        """At each training step's start: a joining device joins; the job admits the device
        whose knock the last step's ``signal`` (summed over the ranks) announced, or opens the
        doorway of a group that has none yet (training starts, or a lost device's survivors
        re-formed it)."""
        if self.joining:
            self._join(host, trainer)
        elif signal > 0:
            self._admit(host, trainer)
        elif host.failures.hosts != self._opened:
            self._open(host, trainer)

    def at_save(self, checkpoint: dict[str, Any]) -> None:
        """An admission's checkpoint resumes at the end of the last step
        (:func:`end_of_last_step`); any other save is left as it is."""
        if self._saving:
            end_of_last_step(checkpoint)

    # ---------------------------------------------------------------------------- the job
    def _admit(self, host: AdmissionHost, trainer: pl.Trainer) -> None:
        clock = _Clock()
        directory = checkpoint_dir(trainer)
        assert directory is not None  # the doorway opens only with one
        step, rank, world = trainer.global_step, host.global_rank, host.world_size
        path = directory / f"join-step={step}"
        self._saving = True
        try:
            trainer.save_checkpoint(path)
        finally:
            self._saving = False
        host.checkpointer.wait()
        if rank == 0:  # the previous admission's checkpoint is older than the others now
            for older in directory.glob("join-step=*"):
                if older != path:
                    shutil.rmtree(older, ignore_errors=True)
        clock.lap("checkpoint")
        shared = [self._knock, self.doorway.group_prefix()]
        dist.broadcast_object_list(shared, src=0)
        found, prefix = shared
        assert isinstance(found, dict) and isinstance(prefix, str)
        if rank == 0:
            answer = Answer(str(path), prefix, world, world + 1, step)
            self.doorway.answer(found, vars(answer))
        store, backend = base_store(default_store()), dist.get_backend()
        _leave(host)
        hosts = [*host.failures.hosts, str(found["host"])]
        try:
            form_group(store, prefix, rank, world + 1, backend=backend, timeout=_WAIT)
        except Exception as exc:  # the device did not come: the job goes on without it
            print_everywhere(
                f"[rank {rank}] DeepCEE: {hosts[-1]} did not join within {JOIN_WAIT_S:.0f} s "
                f"({type(exc).__name__}); training on without it"
            )
            hosts = hosts[:-1]
            form_group(store, f"{prefix}/without", rank, world, backend=backend, timeout=_WAIT)
        clock.lap("waited")
        self._settle(host, trainer, rank, hosts, path, clock)

    # ------------------------------------------------------------------------- the device
    def _join(self, host: AdmissionHost, trainer: pl.Trainer) -> None:
        answer = self._answer
        assert answer is not None
        if trainer.global_step != answer.step:
            raise JoinError(
                f"this device resumed at step {trainer.global_step}, the job is at step "
                f"{answer.step}: start it with ckpt_path='last'"
            )
        clock = _Clock()
        backend = dist.get_backend()
        _leave(host)
        form_group(
            self._store,
            answer.prefix,
            answer.rank,
            answer.world_size,
            backend=backend,
            timeout=_WAIT,
        )
        self.joining = False
        clock.lap("waited")
        self._settle(host, trainer, answer.rank, [], Path(answer.checkpoint), clock)

    # ------------------------------------------------------------------------------- both
    def _settle(
        self,
        host: AdmissionHost,
        trainer: pl.Trainer,
        rank: int,
        hosts: list[str],
        path: Path,
        clock: _Clock,
    ) -> None:
        """Every member of the group just formed: its devices and profile (rank 0's), the
        plan, the layout, the checkpoint."""
        set_default_timeout(timedelta(seconds=host.recovery.timeout_s))  # formed: run as before
        assert host.plan is not None
        # Rank 0's: the members, their profile, and what the plan search reads (every rank must
        # search alike; a joined device's own set-up knew neither the job's batch nor its cache).
        shared: list[Any] = [hosts, self._profile_of(hosts) if rank == 0 else None]
        shared += [device_cache_dir(host.profile_settings.device_cache)]
        shared += [host.plan.global_batch_size]
        dist.broadcast_object_list(shared, src=0)
        hosts, profile, device_cache, global_batch_size = shared
        joined = len(hosts) > host.world_size  # else the device did not come
        adopt_group(host, rank, hosts, profile)
        settings = dataclasses.replace(host.profile_settings, device_cache=device_cache)
        host.profile_settings = settings
        plan = plan_on_profile(host, global_batch_size)
        clock.lap("plan")
        host.stage_part.restore_blocks()
        build_layout(host, plan, trainer)
        load_onto_layout(host, path)
        clock.lap("load")
        host.recovery.start(host, trainer, len(hosts))  # its kept steps begin here
        self._open(host, trainer)
        seconds = round(time.time() - clock.began, 3)
        laps = ", ".join(f"{k} {v:.1f} s" for k, v in clock.laps.items())
        if not joined:
            rank_zero_info(f"DeepCEE: no device joined; paused {seconds:.1f} s ({laps})")
            return
        self.admissions += 1
        self.last = {"device": hosts[-1], "world": len(hosts), "seconds": seconds, **clock.laps}
        rank_zero_info(
            f"DeepCEE: {len(hosts)} devices ({', '.join(hosts)}) from step {trainer.global_step},"
            f" after a pause of {seconds:.1f} s ({laps})"
        )
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({"deepcee/join_pause_s": seconds}, step=trainer.global_step)

    def _profile_of(self, hosts: list[str]) -> ClusterProfile | None:
        """Rank 0: the profile set-up measured, for ``hosts`` in their order."""
        if self._known is None:
            return None
        return self._known.subset([self._known_hosts.index(h) for h in hosts])


_WAIT = timedelta(seconds=JOIN_WAIT_S)


def end_of_last_step(checkpoint: dict[str, Any]) -> None:
    """Set a checkpoint saved at a step's start (its batch ready, not started) back to the end
    of the last step: Lightning then resumes at this step, without a validation."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get(_PROGRESS)
    if progress is not None:
        for part in ("total", "current"):
            progress[part]["ready"] = progress[part]["started"]


def _leave(host: AdmissionHost) -> None:
    """Destroy the process group (nothing of the layout may hold it any more)."""
    host.stage_part.release_groups()
    host.step_log.release_group()
    dist.destroy_process_group()
    gc.collect()
