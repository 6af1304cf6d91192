"""DeepCEEStrategy: trains a LightningModule as a pipeline over several processes.

Layout: ``world_size = num_stages * num_replicas``. By default global rank ``r`` runs stage
``r % num_stages`` of pipeline replica ``r // num_stages``; ``placement`` puts stages on any
ranks (e.g. to follow the network: one stage per region). Each replica sees its own share of
the data (the sampler shards by replica, never by stage) and the gradients of one stage are
averaged over its replicas in a per-stage process group.

One training step runs the whole lowered schedule inside Lightning's ``training_step``; the
gradients it leaves are moved aside and put back in :meth:`DeepCEEStrategy.backward`, because
Lightning's automatic optimization zeroes gradients between ``training_step`` and ``backward``
(its closure runs ``training_step``, ``zero_grad``, ``backward``, then the optimizer step). The
optimizer then steps once per batch, after every W of the step: exact synchronous semantics, the
same update a single device computes on the whole batch.

The class holds Lightning's hooks only and delegates to parts that own their state (this
module's imports from ``strategy/``): the stage part, the checkpointer, the step log, the failure
naming, the recovery, the admission; set-up's steps (profile, plan, build, trial) are functions.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from lightning_deepcee._compat import PATH, set_default_timeout
from lightning_deepcee.planner import DEVICE_GAIN, Plan
from lightning_deepcee.planner.compression import allowed_methods
from lightning_deepcee.profiler import ClusterProfile, DeviceGroups
from lightning_deepcee.runtime import PipelineSpec, Stage
from lightning_deepcee.runtime.executor import StepStats
from lightning_deepcee.runtime.liveness import DeviceLostError, agree_group_token
from lightning_deepcee.runtime.loaders import real_batch
from lightning_deepcee.runtime.manual_layout import ManualLayout
from lightning_deepcee.runtime.transport import TransferRecord
from lightning_deepcee.strategy.admission import Admission
from lightning_deepcee.strategy.checkpointer import (
    ShardedCheckpointer,
    check_same_checkpoint,
    resumable_loader,
)
from lightning_deepcee.strategy.failure_naming import FailureNaming
from lightning_deepcee.strategy.gc_freeze import GcFreeze
from lightning_deepcee.strategy.layout_build import build_layout, relayout_from
from lightning_deepcee.strategy.module_checks import (
    check_arguments,
    plan_argument,
    refuse_manual_optimization,
)
from lightning_deepcee.strategy.placement import Placement
from lightning_deepcee.strategy.plan_checks import check_replacement, running_plan
from lightning_deepcee.strategy.plan_trial import PlanTrial
from lightning_deepcee.strategy.precision import wrap_precision
from lightning_deepcee.strategy.recovery import InProcessRecovery
from lightning_deepcee.strategy.reporting import (
    SetupTimer,
    check_versions,
    summarise_whole_model,
    warn_at_setup,
)
from lightning_deepcee.strategy.setup_plan import initial_plan, keep_plan, save_setup_record
from lightning_deepcee.strategy.setup_profile import ProfileSettings, profile_strategy
from lightning_deepcee.strategy.stage_part import PipelineStagePart
from lightning_deepcee.strategy.step_log import StepLog

__all__ = ["START_TIMEOUT_S", "DeepCEEStrategy"]

START_TIMEOUT_S = 600.0
"""How long forming the process group waits for the last device (a device at a few percent of a
core takes a minute to import torch and build its model); ``timeout_s`` applies after."""


class DeepCEEStrategy(DDPStrategy):
    """Pipeline-parallel training across heterogeneous devices, exact synchronous gradients.

    Three ways to choose the layout:

    - ``DeepCEEStrategy()`` (no layout argument): profile the devices and links at setup, search
      a plan (stages per network group, compute-aware partition, micro-batch count, batch shares
      proportional to device speed) and run it.
    - ``plan="plan.json"``: run a saved plan (``deepcee plan`` or ``Plan.to_json``), no search.
    - any of ``partition``, ``schedule``, ``num_microbatches``, ``num_stages``, ``placement``:
      a manual layout (one device per stage per replica; unset values default to a balanced
      partition, ``1f1b`` and 4 micro-batches).

    Args:
        plan: ``"auto"`` (the default when no manual argument is given) or a saved plan's path.
        partition: blocks per stage, either stage sizes (``[3, 2, 3]``) or block ranges
            (``[[0, 3], [3, 5], [5, 8]]``). ``None`` balances parameter counts.
        schedule: one of ``gpipe``, ``1f1b``, ``zb-h1``.
        num_microbatches: micro-batches per step and replica; batches need at least as many
            samples. Uneven splits are fine.
        num_stages: pipeline depth; ``None`` uses one stage per process. Must divide the world
            size; the quotient is the number of data-parallel pipeline replicas.
        placement: the global ranks of each stage, one per replica, e.g. ``[[2], [0], [1]]`` runs
            stage 0 on rank 2. ``None`` places stage ``s`` of replica ``d`` on ``d * S + s``.
        profile: measure every device (per-block F/B/W times on the first training micro-batch,
            memory) and link (latency, bandwidth) at setup, group devices, print the table.
        profile_cache: a JSON/YAML file caching the profile, reused while the model and the
            cluster are unchanged (otherwise re-measured with a warning).
        profile_budget_s: the network measurement fails with an error naming the pair it was
            measuring when it takes longer than this.
        profile_rounds: block timings are measured this many times and each figure taken at
            its median (one reading under a CPU quota is noisy); 1 measures once.
        profile_block_budget_s: about how long each device may spend timing its blocks (a slow
            one takes fewer rounds and repeats, at least one); ``None``: ``profile_rounds`` rounds.
        device_cache: where each device keeps its block timings (same model, micro-batch, quota)
            and rank 0 the link figures (reused while a probe of each pair agrees) and the plan
            set-up chose on that profile; ``"auto"``: one per torchrun elastic job; ``None``: no.
        timeout_s: seconds a collective or transfer may block: a dead device stops every rank
            within about this long (plus 3 s) with a ``DeviceLostError`` (rank, stage, host) or
            a ``RankFailedError`` (the rank's own error); ``START_TIMEOUT_S`` to form the group.
        verbose: print the partition and schedule on rank 0 at setup.
        receive_ahead: on gloo, post every receive of a step when it starts (gloo moves a
            message only once it is posted), so senders never wait; identical results
            (docs/architecture.md). ``False`` posts each receive when the schedule reaches it.
        freeze_gc: when training starts, collect garbage once and ``gc.freeze()`` what survives:
            later collections (one rank's pause stalls every stage) skip the model and data.
        async_checkpoint: a save snapshots this rank's state and returns; the files are committed
            in the background (an interrupted save leaves the previous one); ``False`` blocks.
        device_gain: the automatic plan uses more devices than another only when predicted at
            least this fraction faster (``plan_search``); 0 takes the fastest prediction.
        plan_trial: the automatic plan and up to ``plan_trial - 1`` rivals predicted within 10%
            of it each train the fit's first steps in turn, 3 each, and the fastest by the clock
            trains on (``plan_trial.py``); 1 trains the searched plan untimed.
        compression: what the automatic plan may do to the float32 tensors crossing a pipeline
            hop in training: ``"off"`` (exact), ``"auto"`` (``bf16`` or ``tah8`` per hop where
            the link makes it pay) or method names, e.g. ``["tah8"]`` (docs/compression.md).
        recover_in_process: a lost device's survivors re-plan, load the newest checkpoint and
            redo the steps since in their processes (``recovery.py``), and a device started with
            ``DEEPCEE_JOIN=1`` joins at a step boundary (``admission.py``); ``False``: restart.
    """

    strategy_name = "deepcee"

    def __init__(
        self,
        plan: str | None = None,
        partition: Sequence[int] | Sequence[Sequence[int]] | None = None,
        schedule: str | None = None,
        num_microbatches: int | None = None,
        num_stages: int | None = None,
        placement: Sequence[Sequence[int]] | None = None,
        profile: bool = False,
        profile_cache: str | None = None,
        profile_budget_s: float = 60.0,
        profile_rounds: int = 3,
        profile_block_budget_s: float | None = 6.0,
        device_cache: str | None = "auto",
        timeout_s: float = 60.0,
        verbose: bool = True,
        receive_ahead: bool = True,
        freeze_gc: bool = True,
        async_checkpoint: bool = True,
        device_gain: float = DEVICE_GAIN,
        plan_trial: int = 4,
        compression: str | Sequence[str] = "off",
        recover_in_process: bool = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
    ) -> None:
        manual = (partition, schedule, num_microbatches, num_stages, placement)
        self.plan_arg = plan_argument(plan, manual=any(x is not None for x in manual))
        self._manual = ManualLayout.from_arguments(
            partition, schedule, num_microbatches, num_stages, placement
        )
        check_arguments(
            timeout_s=timeout_s,
            profile_budget_s=profile_budget_s,
            profile_block_budget_s=profile_block_budget_s,
            profile_rounds=profile_rounds,
            device_gain=device_gain,
            plan_trial=plan_trial,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout_s),
        )
        self.profile = profile or profile_cache is not None or self.plan_arg == "auto"
        self.profile_settings = ProfileSettings(
            cache=profile_cache,
            budget_s=profile_budget_s,
            rounds=profile_rounds,
            block_budget_s=profile_block_budget_s,
            device_cache=device_cache,
        )
        self.cluster_profile: ClusterProfile | None = None
        self.setup_seconds: dict[str, float] = {}
        """The last fit's set-up in seconds, part by part (``SetupTimer.flat``)."""
        self.device_groups: DeviceGroups | None = None
        self.verbose, self.freeze_gc = verbose, freeze_gc
        self.device_gain, self.plan_trial = device_gain, plan_trial
        self.compression = allowed_methods(compression)  # the methods a hop may use
        self.trial = PlanTrial(plan_trial)
        """The plan trial, run on the first training steps (``plan_trial.py``)."""
        self.last_step_stats: StepStats | None = None
        self.stage_part = PipelineStagePart(
            num_microbatches=self._manual.num_microbatches, receive_ahead=receive_ahead
        )
        """This rank's part of the running plan: stage, executors, process groups, the step."""
        self.checkpointer = ShardedCheckpointer(asynchronous=async_checkpoint)
        """Sharded checkpoint saves and loads, and the records that make restarts visible."""
        self.step_log = StepLog()
        """Runs and logs each step; keeps the last step's sample and token counts."""
        self.recovery = InProcessRecovery(recover_in_process, timeout_s=timeout_s)
        self.admission = Admission()
        """The doorway of the running job, and this device's way in when it joins one."""
        self.failures = FailureNaming()
        """This rank's heartbeat, the devices' names, and the naming of failed steps."""
        self._gc = GcFreeze()
        self._pending_grads: list[torch.Tensor | None] | None = None
        """The last training step's gradients, kept aside until :meth:`backward`."""
        self._global_batch_size = 0

    # ----------------------------------------------------------------- the running layout
    @property
    def plan(self) -> Plan | None:
        """The running layout (every layout is a Plan; a manual one has no predictions)."""
        return self.stage_part.plan

    @property
    def spec(self) -> PipelineSpec | None:
        """The whole model's pipeline (``configure_pipeline``), once set up."""
        return self.stage_part.spec

    @property
    def stage(self) -> Stage | None:
        """This rank's blocks of the running plan."""
        return self.stage_part.stage

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step now: the plan's, until :meth:`set_num_microbatches`."""
        return self.stage_part.num_microbatches

    @property
    def where(self) -> Placement:
        """Where this rank sits in the running plan (before set-up: in the manual layout's)."""
        return Placement.of_running(self.plan, self._manual, self.world_size, self.global_rank)

    @property
    def num_stages(self) -> int:
        """Pipeline depth (stages per replica)."""
        return self.where.num_stages

    @property
    def num_replicas(self) -> int:
        """Data-parallel pipeline replicas, each reading its own shard of the data."""
        return self.where.num_replicas

    @property
    def trial_running(self) -> bool:
        """Whether the plan trial runs: the layout changes at the coming step boundaries."""
        return self.trial.running(self.plan)

    @property
    def is_idle(self) -> bool:
        """Whether the running plan leaves this rank idle (no stage, no compute)."""
        return self.plan is not None and self.global_rank in self.plan.idle_ranks

    @property
    def transfer_records(self) -> list[TransferRecord]:
        """This rank's transfers of the last training step (peer, bytes, seconds, direction)."""
        return self.stage_part.transfer_records

    @property
    def last_step_samples(self) -> int:
        """Samples of the last step over all replicas."""
        return self.step_log.samples

    @property
    def last_step_tokens(self) -> int | None:
        """Tokens of the last step (``PipelineSpec.tokens_fn``), ``None`` without one."""
        return self.step_log.tokens

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Shard by pipeline replica only: every stage of one pipeline sees the same batch.
        return {"num_replicas": self.num_replicas, "rank": self.where.replica_index}

    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_plugin = precision_plugin and wrap_precision(precision_plugin)

    def _trainer(self) -> pl.Trainer | None:
        return self.lightning_module.trainer if self.lightning_module is not None else None

    # ------------------------------------------------------------------------------ setup
    @override
    def setup_distributed(self) -> None:
        """Form the process group with ``START_TIMEOUT_S`` for the devices to arrive, then run it
        with the strategy's own timeout (``timeout_s``)."""
        running, start = self._timeout, timedelta(seconds=START_TIMEOUT_S)
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
        self.failures.start(self.global_rank, self.world_size, check_versions(self.world_size))

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        refuse_manual_optimization(module)
        self.stage_part.adopt(module)
        spec = self.spec
        assert spec is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        timer = SetupTimer()
        joining = self.admission.joining and self.plan_arg == "auto"  # it takes the job's plan
        if self.profile and fitting and not joining:
            with timer("profile"):
                found = profile_strategy(self, trainer, spec)
                self.cluster_profile, self.device_groups = found.profile, found.groups
                self._global_batch_size = found.global_batch_size
                timer.detail["profile"] = found.parts
        with timer("plan"):
            choice = initial_plan(
                None if joining else self.plan_arg,  # a joining device: one stage until it joins
                manual=self._manual,
                blocks=spec.blocks,
                world_size=self.world_size,
                cluster_profile=self.cluster_profile,
                global_batch_size=self._global_batch_size,
                device_gain=self.device_gain,
                compression=self.compression,
                running=None if fitting else self.plan,
                device_cache=self.profile_settings.device_cache,
            )
        with timer("build"):
            build_layout(self, choice.plan, trainer)
        if fitting and self.plan_arg == "auto" and not (choice.kept or joining):
            with timer("trial"):  # rivals chosen here; they train in the first steps
                keep = functools.partial(keep_plan, choice, writer=self.is_global_zero)
                self.trial.prepare(self, choice.alternatives or [], keep)
        self._pending_grads = None
        if fitting:
            timer.report(trainer)
            self.setup_seconds = timer.flat()
            save_setup_record(trainer, self.plan, self.cluster_profile, choice.device_sets)
            self.admission.at_setup(self, trainer)
        summarise_whole_model(trainer, self.stage_part.whole_model)
        assert self.plan is not None
        warn_at_setup(trainer, module, spec, self.plan)

    # ------------------------------------------------------------------------ re-planning
    def set_num_microbatches(self, num_microbatches: int) -> None:
        """Use ``num_microbatches`` from the next step on (all ranks must call it together).
        Any split gives the same gradient (rows are weighted by their share of the step), so the
        adapter may change it between any two steps without a restart."""
        self.stage_part.set_num_microbatches(num_microbatches)

    def current_plan(self) -> Plan:
        """The running layout as a :class:`Plan`, what a re-plan is compared with
        (:func:`~lightning_deepcee.strategy.plan_checks.running_plan`)."""
        return running_plan(
            self.stage_part,
            num_replicas=self.num_replicas,
            last_step_samples=self.last_step_samples,
            global_batch_size=self._global_batch_size,
        )

    def check_plan(self, plan: Plan) -> None:
        """Raise unless ``plan`` can replace the running layout (the checks of :meth:`apply_plan`,
        :func:`~lightning_deepcee.strategy.plan_checks.check_replacement`); local, so every rank
        raises alike before any collective."""
        check_replacement(
            plan,
            self.stage_part,
            set_up=self.lightning_module is not None,
            world_size=self.world_size,
            num_replicas=self.num_replicas,
            cluster_profile=self.cluster_profile,
        )

    def apply_plan(self, plan: Plan, trainer: pl.Trainer, why: str = "re-planned") -> None:
        """Switch to ``plan`` between two steps: move blocks, with their optimizer state, live.

        Every rank calls it together, at a step boundary (``on_train_batch_end`` or
        ``on_train_start``), within ``timeout_s``. Exact: the next step computes the same
        whole-batch gradient under any layout (:func:`.layout_build.relayout_from`); ``why``
        opens rank 0's log line.
        """
        relayout_from(self, plan, trainer, why)

    # ------------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This stage's weights, without tied parameters another stage saves (kept once)."""
        module = self.lightning_module
        assert module is not None
        return self.stage_part.owned_state_dict(module.state_dict(), self.where.stage_index)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("DeepCEEStrategy.save_checkpoint does not take storage_options.")
        self.recovery.note_save(int(checkpoint.get("global_step", 0)))
        self.admission.at_save(checkpoint)
        self.checkpointer.save(
            checkpoint,
            Path(filepath),
            self.stage_part,
            self.optimizers,
            world_size=self.world_size,
            hosts=self.failures.hosts,
            trainer=self._trainer(),
        )

    @override
    def load_checkpoint(self, checkpoint_path: PATH, weights_only: bool | None = None) -> dict:
        path, hosts = self.admission.checkpoint_path(Path(checkpoint_path)), self.failures.hosts
        return self.checkpointer.load(path, self.stage_part, self.optimizers, hosts=hosts)

    @override
    def remove_checkpoint(self, filepath: PATH) -> None:
        self.checkpointer.remove(Path(filepath), rank=self.global_rank, world_size=self.world_size)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Loaders that resume mid-epoch and stand in on idle ranks (:func:`resumable_loader`)."""
        return resumable_loader(dataloader, self._trainer(), lambda: self.is_idle)

    # ----------------------------------------------------------------------------- steps
    def _run(self, kind: str, batch: Any, prefix: str) -> torch.Tensor:
        """One step of ``kind`` run and logged (:class:`StepLog`)."""
        module = self.lightning_module
        assert module is not None
        part, rank, device = self.stage_part, self.global_rank, self.root_device
        signal = self.admission.signal(self) if prefix == "train" else 0.0  # a device knocks
        return self.step_log.run(
            part, kind, batch, prefix, module=module, rank=rank, device=device, signal=signal
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        trainer = self._trainer()
        assert trainer is not None
        loaders, idle = trainer.train_dataloader, self.is_idle
        batch, reread = real_batch(
            loaders, args[0] if args else kwargs["batch"], idle, self.batch_to_device
        )
        self.recovery.note_step(trainer.global_step, batch, reread)
        try:
            return self.pipeline_step(batch)
        except DeviceLostError as error:  # the survivors go on in this process, or raise
            return self.recovery.recover(self, trainer, error)

    def pipeline_step(self, batch: Any, *, log: bool = True) -> torch.Tensor:
        """One training step's forward and backward on ``batch`` through the pipeline (logged
        unless ``log`` is False); the gradients wait aside for :meth:`backward`."""
        # With accumulate_grad_batches > 1 the parameters hold the earlier batches' sum: set it
        # aside so the schedule's gradients are this batch's alone, and put it back below.
        held = self.stage_part.set_aside_gradients()
        start = time.perf_counter()
        with self.failures.named(self.where.stages):
            loss = self._run("train", batch, "train" if log else "")
            synced = self.stage_part.sync_copies()  # 0 when no copy lives elsewhere
        # Lightning zeroes gradients between training_step and backward: keep them aside.
        self._pending_grads = self.stage_part.swap_gradients(held)
        executor = self.stage_part.executor("train")
        self.last_step_stats = executor.last_stats if executor else StepStats()
        self.last_step_stats.wall_s = time.perf_counter() - start
        self.last_step_stats.grad_sync_s = synced
        return loss

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        trainer = self._trainer()
        self.checkpointer.begin_step(trainer, self.is_global_zero)
        if trainer is not None:
            self.admission.at_step_start(self, trainer, self.step_log.signal)
            self.trial.at_step_start(self, trainer)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Leave a failure record beside the checkpoints for the run that resumes."""
        super().on_exception(exception)
        self.checkpointer.record_failure(
            exception, self._trainer(), rank=self.global_rank, hosts=self.failures.hosts
        )

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if (trainer := self._trainer()) is not None:
            check_same_checkpoint(trainer, self.world_size)  # each rank has restored (or not)
            self.recovery.start(self, trainer, self.world_size)
        if self.freeze_gc:
            self._gc.freeze(self.verbose)

    @override
    def on_train_end(self) -> None:
        self._gc.unfreeze()
        self.checkpointer.wait()  # the last save is complete when fit returns
        super().on_train_end()

    @override
    def teardown(self) -> None:
        self.trial.at_fit_end()
        self._gc.unfreeze()
        self.failures.stop()
        super().teardown()

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        module = self.lightning_module
        assert module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        # The loss is divided by accumulate_grad_batches: the gradients too, then summed.
        if self._pending_grads is not None:
            self.stage_part.add_gradients(
                self._pending_grads, module.trainer.accumulate_grad_batches
            )
            self._pending_grads = None
        return self.precision_plugin.post_backward(closure_loss, module)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with torch.no_grad(), self.failures.named(self.where.stages):
            return self._run("eval", args[0] if args else kwargs["batch"], "val")

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with torch.no_grad(), self.failures.named(self.where.stages):
            return self._run("eval", args[0] if args else kwargs["batch"], "test")

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own ``predict_step``, with the pipeline's output for the batch standing
        in for ``forward``; every rank returns it (``trainer.predict`` gives rank 0's)."""
        module = self.lightning_module
        assert module is not None
        with torch.no_grad(), self.failures.named(self.where.stages):
            output = self.step_log.predict(self.stage_part, args[0] if args else kwargs["batch"])
        return self.step_log.call_predict(self.stage_part, module, output, *args, **kwargs)

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        return False  # Lightning steps every k batches; training_step and backward keep the sum

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="DeepCEE pipeline strategy", override=True
        )
