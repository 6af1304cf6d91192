"""DeepCEEStrategy: trains a LightningModule as a pipeline over several processes.

Layout: ``world_size = num_stages * num_replicas``. By default global rank ``r`` runs stage
``r % num_stages`` of pipeline replica ``r // num_stages``; ``placement`` puts stages on any
ranks (e.g. to follow the network: one stage per region). Each replica sees its own share of
the data (the sampler shards by replica, never by stage) and the gradients of one stage are
averaged over its replicas in a per-stage process group.

One training step runs the whole lowered schedule inside Lightning's ``training_step``; the
gradients it leaves are moved aside and put back in :meth:`DeepCEEStrategy.backward`, because
Lightning's automatic optimization zeroes gradients between ``training_step`` and ``backward``
(see LIGHTNING_NOTES.md). The optimizer then steps once per batch, after every W of the step:
exact synchronous semantics, the same update a single device computes on the whole batch.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import socket
import sys
import time
import warnings
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from typing_extensions import override

from lightning_deepcee._compat import (
    PATH,
    fit_dataloader,
)
from lightning_deepcee.checkpoint import (
    commit_partial,
    load_sharded,
    partial_dir,
    save_sharded,
)
from lightning_deepcee.console import format_cluster
from lightning_deepcee.layout_strategy import PipelineLayoutStrategy
from lightning_deepcee.planner import Plan, plan_search
from lightning_deepcee.profiler import ClusterProfile, DeviceGroups, group_devices
from lightning_deepcee.runtime import (
    PipelineExecutor,
    PipelineSpec,
    Stage,
    batch_size_of,
    get_pipeline_spec,
    split_batch,
    split_sizes,
)
from lightning_deepcee.runtime.executor import StepStats
from lightning_deepcee.runtime.layout import (
    ManualLayout,
    manual_plan,
    sum_gradients,
)
from lightning_deepcee.runtime.liveness import (
    DeviceLostError,
    Heartbeat,
    default_store,
    find_lost_ranks,
    is_communication_failure,
    lost_message,
)
from lightning_deepcee.runtime.measure import model_fingerprint, profile_cluster, profile_or_load
from lightning_deepcee.runtime.transport import all_reduce_

__all__ = ["DeepCEEStrategy"]

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
"""Seconds between a rank's liveness beats in the rendezvous store."""
LIVENESS_WAIT_S = 3.0
"""After a failed step, how long a rank watches the heartbeats to name the lost device."""


class DeepCEEStrategy(PipelineLayoutStrategy):
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
        profile: measure every device (per-block forward / input-gradient / weight-gradient
            times on the first training micro-batch, memory) and every link (latency and
            bandwidth, rounds of disjoint pairs) at setup, group devices, and print the table.
        profile_cache: a JSON/YAML file that caches the profile; reused only while the model
            and the cluster are unchanged (otherwise re-measured with a warning).
        profile_budget_s: the network measurement fails with an error naming the pair it was
            measuring when it takes longer than this.
        profile_rounds: the block timings are measured this many times in a row and every
            figure taken at its median (one reading under a CPU quota moved 3-20% between
            rounds on the lab); 1 measures once, for a quicker setup.
        timeout_s: seconds a collective or transfer may block before the process group fails;
            a dead device or link therefore stops every rank within about this long (plus a
            3 s look at the heartbeats), with a ``DeviceLostError`` naming the lost rank, its
            stage and host (Lightning's default timeout is 30 minutes).
        verbose: print the partition and schedule on rank 0 at setup.
        receive_ahead: on gloo, post every receive of a step when it starts, into payload
            slots sized by the last step, so senders never wait for the receiver to reach its
            receive (gloo moves a message only once it is posted). Results are identical
            either way; on the lab's cloud-edge-end cluster it raised throughput by about a
            quarter (docs/architecture.md). ``False`` posts each receive when the schedule
            reaches it. Payloads received ahead are still timed on the wire (the
            DynamicEnvironmentAdapter reads those times).
        freeze_gc: when training starts, run one full garbage collection and freeze what
            survives (``gc.freeze()``), so later collections skip the model, the data and
            the framework set up before training; unfrozen when training ends. A full
            collection of a trainer's objects took 0.4-0.7 s on the lab's cloud devices (at
            half a core), and in a pipeline one rank's pause stalls every stage. ``False``
            leaves the garbage collector alone.
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
        timeout_s: float = 60.0,
        verbose: bool = True,
        receive_ahead: bool = True,
        freeze_gc: bool = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
    ) -> None:
        manual = any(
            x is not None for x in (partition, schedule, num_microbatches, num_stages, placement)
        )
        if plan is not None and manual:
            raise ValueError(
                "DeepCEEStrategy(plan=...) decides partition, schedule, micro-batches and "
                "placement; pass either a plan or those arguments, not both."
            )
        self.plan_arg = plan if plan is not None else (None if manual else "auto")
        self._manual = ManualLayout.from_arguments(
            partition, schedule, num_microbatches, num_stages, placement
        )
        if timeout_s <= 0:
            raise ValueError(f"DeepCEEStrategy(timeout_s={timeout_s}) must be > 0.")
        if profile_budget_s <= 0:
            raise ValueError(f"DeepCEEStrategy(profile_budget_s={profile_budget_s}) must be > 0.")
        if isinstance(profile_rounds, bool) or not isinstance(profile_rounds, int):
            raise ValueError(
                f"DeepCEEStrategy(profile_rounds={profile_rounds!r}) must be a positive integer."
            )
        if profile_rounds < 1:
            raise ValueError(f"DeepCEEStrategy(profile_rounds={profile_rounds}) must be >= 1.")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout_s),
        )
        self.num_microbatches = self._manual.num_microbatches
        """Micro-batches per step now: the plan's, until the adapter re-splits."""
        self.profile = profile or profile_cache is not None or self.plan_arg == "auto"
        self.profile_cache = profile_cache
        self.profile_budget_s = profile_budget_s
        self.profile_rounds = profile_rounds
        self.cluster_profile: ClusterProfile | None = None
        self.device_groups: DeviceGroups | None = None
        self.verbose = verbose
        self.receive_ahead = receive_ahead
        self.freeze_gc = freeze_gc
        self._gc_frozen = False
        self.ranges: list[tuple[int, int]] = []
        self.spec: PipelineSpec | None = None
        self.stage: Stage | None = None
        self._executor: PipelineExecutor | None = None
        self._eval_executor: PipelineExecutor | None = None
        self._train_schedule: dict[int, list[Any]] = {}
        self._stage_group: Any = None
        self.plan: Plan | None = None
        """The running layout (every layout is a Plan; a manual one has no predictions)."""
        self._pending_grads: list[torch.Tensor | None] | None = None
        self._global_batch_size = 0
        self.last_step_stats: StepStats | None = None
        self.last_step_samples = 0
        self.last_step_tokens: int | None = None
        self._heartbeat: Heartbeat | None = None
        self._hosts: list[str] = []
        self._block_names: list[str] = []
        """Qualified name of every block in the unsplit module, so a rebuild can put back the
        blocks that ``build_stage`` replaced by ``nn.Identity``."""
        self._split_module: Any = None
        """The module whose blocks ``build_stage`` split (a second setup of it restores them)."""

    # ------------------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._check_versions()
        store = default_store()
        if store is not None and self.world_size > 1:
            self._heartbeat = Heartbeat(store, self.global_rank, interval_s=HEARTBEAT_S).start()

    def _check_versions(self) -> None:
        """Every rank must run the same versions: a mismatch fails early, naming the ranks.

        The same exchange collects every rank's host name, for errors that name a lost device.
        """
        import lightning

        from lightning_deepcee import __version__

        mine = {"lightning_deepcee": __version__, "torch": torch.__version__}
        mine["lightning"] = lightning.__version__
        gathered_all: list[tuple[dict[str, str], str] | None] = [None] * self.world_size
        host = os.environ.get("DEEPCEE_LAB_DEVICE") or socket.gethostname()  # lab: device name
        dist.all_gather_object(gathered_all, (mine, host))
        gathered = [entry[0] for entry in gathered_all if entry is not None]
        self._hosts = [entry[1] for entry in gathered_all if entry is not None]
        differing = {r: v for r, v in enumerate(gathered) if v != gathered[0]}
        if differing:
            raise RuntimeError(
                f"DeepCEEStrategy: package versions differ across ranks: rank 0 has "
                f"{gathered[0]}, but {differing}. Install the same versions everywhere."
            )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if self._split_module is module and self.spec is not None:
            # A second setup of the same module (validate/test after fit): its blocks are split
            # for the old layout; put them back and keep the spec of the whole model.
            self._restore_blocks()
        else:
            self.spec = get_pipeline_spec(module)
            qualified = {id(m): name for name, m in module.named_modules()}
            self._block_names = [qualified[id(block)] for block in self.spec.blocks]
        spec = self.spec
        assert spec is not None
        if self.profile and trainer.state.fn == TrainerFn.FITTING:
            # Blocks are timed where they will run (the batch is already on root_device).
            self.model_to_device()
            self._profile_cluster(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._build(self._initial_plan(len(spec.blocks), fitting), trainer)
        self._summarise_whole_model(trainer)
        # train/val/test_loss are all-reduced before they are logged (every rank holds the same
        # value), so Lightning's advice to sync them on epoch level does not apply.
        warnings.filterwarnings(
            "ignore",
            message=r"It is recommended to use `self\.log\('(train|val|test)_loss'",
            category=PossibleUserWarning,
        )

    def _summarise_whole_model(self, trainer: pl.Trainer) -> None:
        """Make Lightning's model summary count the whole model, not this rank's stage: its
        ``on_fit_start`` runs with every block put back (:meth:`whole_model`)."""
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if not isinstance(callback, ModelSummary) or getattr(callback, "_deepcee", False):
                continue
            original = callback.on_fit_start

            def on_fit_start(
                trainer: pl.Trainer, pl_module: pl.LightningModule, _original: Any = original
            ) -> None:
                with self.whole_model():
                    _original(trainer, pl_module)

            setattr(callback, "on_fit_start", on_fit_start)  # noqa: B010
            setattr(callback, "_deepcee", True)  # noqa: B010

    def _profile_cluster(self, trainer: pl.Trainer) -> None:
        """Measure devices and links on the first training micro-batch (all ranks)."""
        assert self.spec is not None
        batch = self.batch_to_device(next(iter(fit_dataloader(trainer))))
        self._global_batch_size = batch_size_of(batch)
        micro = split_batch(batch, split_sizes(batch_size_of(batch), self.num_microbatches))[0]
        options: dict[str, Any] = dict(
            loss_fn=self.spec.loss_fn,
            sample_batch=micro,
            device=self.root_device,
            budget_s=self.profile_budget_s,
            rounds=self.profile_rounds,
        )
        blocks, sample = list(self.spec.blocks), self.spec.input_fn(micro)
        began = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if self.profile_cache is not None:
                profile = profile_or_load(self.profile_cache, blocks, sample, **options)
            else:
                profile = profile_cluster(blocks, sample, **options)
        seconds = time.perf_counter() - began
        self._warn_once_per_job([str(w.message) for w in caught])
        self.cluster_profile = profile
        self.device_groups = group_devices(profile)
        rank_zero_info(format_cluster(profile, self.device_groups))
        rank_zero_info(f"DeepCEE: profiled {profile.num_devices} devices in {seconds:.1f} s")
        metrics = {f"deepcee/capability_rank{d.rank}": d.capability for d in profile.devices}
        metrics["deepcee/profile_s"] = seconds
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=0)

    def _warn_once_per_job(self, messages: list[str]) -> None:
        """Warn on rank 0 once per distinct message, naming the ranks that raised it (every rank
        profiling the same cache would otherwise print the same warning)."""
        gathered: list[list[str] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, messages)
        ranks_of: dict[str, list[int]] = {}
        for rank, part in enumerate(gathered):
            for message in dict.fromkeys(part or []):
                ranks_of.setdefault(message, []).append(rank)
        for message, ranks in ranks_of.items():
            where = "every rank" if len(ranks) == self.world_size else f"ranks {ranks}"
            rank_zero_warn(f"{message} ({where})", category=UserWarning)

    def _initial_plan(self, num_blocks: int, fitting: bool) -> Plan:
        """The layout setup builds: a saved plan, the search's plan, or the manual layout's.

        validate/test after fit keep the layout that trained (re-planned or not).
        """
        assert self.spec is not None
        if self.plan is not None and not fitting:
            return self.plan
        fingerprint = model_fingerprint(list(self.spec.blocks))
        cluster = self.cluster_profile.cluster_fingerprint if self.cluster_profile else None
        if self.plan_arg is None:
            return manual_plan(
                self._manual,
                world_size=self.world_size,
                block_weights=[sum(p.numel() for p in b.parameters()) for b in self.spec.blocks],
                model_fingerprint=fingerprint,
                cluster_fingerprint=cluster or "",
                global_batch_size=self._global_batch_size,
            )
        if self.plan_arg != "auto":
            plan = Plan.from_json(str(self.plan_arg))
            plan.check_matches(num_blocks, self.world_size, fingerprint, cluster)
        else:
            if self.cluster_profile is None:
                raise ValueError(
                    "DeepCEEStrategy plans automatically while fitting; for validate/test "
                    "pass plan='plan.json' or a manual layout."
                )
            found: dict[str, Any] = {}
            if self.is_global_zero:
                found = plan_search(
                    self.cluster_profile,
                    num_blocks=num_blocks,
                    global_batch_size=self._global_batch_size,
                ).to_dict()
            plan = Plan.from_dict(self.broadcast(found))
        rank_zero_info("DeepCEE plan:\n" + plan.format_table())
        return plan

    # ----------------------------------------------------------------------------- steps
    def _run(self, executor: PipelineExecutor, batch: Any) -> torch.Tensor:
        total = batch_size_of(batch)
        micro = split_batch(batch, split_sizes(total, self.num_microbatches))
        # Each rank weights its rows by rows / (samples of the step over all replicas), so the
        # sums below (loss, stage gradients) are the whole-step means.
        loss = executor.run(
            micro,
            total * self.num_replicas,
            forward_context=self.precision_plugin.forward_context,
        )
        value = torch.zeros((), dtype=torch.float32, device=self.root_device)
        if loss is not None:
            value = value + loss.detach().float()
        # Every rank returns the real loss: the last-stage devices each contribute their rows.
        all_reduce_(value)
        self.last_step_samples = total * self.num_replicas
        tokens_fn = self.spec.tokens_fn if self.spec is not None else None
        self.last_step_tokens = tokens_fn(batch) * self.num_replicas if tokens_fn else None
        return value

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        assert self._executor is not None and self.stage is not None
        module = self.lightning_module
        assert module is not None
        params = self.stage.parameters()
        for p in params:
            p.grad = None
        start = time.perf_counter()
        try:
            loss = self._run(self._executor, args[0] if args else kwargs["batch"])
            synced = 0.0
            if self._stage_group is not None:
                synced = time.perf_counter()
                sum_gradients(params, self._stage_group)
                synced = time.perf_counter() - synced
        except RuntimeError as exc:
            if not is_communication_failure(exc):
                raise
            raise self._lost_device_error(exc) from exc
        # Lightning zeroes gradients between training_step and backward: keep them aside.
        self._pending_grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        self.last_step_stats = self._executor.last_stats
        self.last_step_stats.wall_s = time.perf_counter() - start
        self.last_step_stats.grad_sync_s = synced
        module.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=True)
        return loss

    def _describe_rank(self, rank: int) -> str:
        stages = [s for s, ranks in enumerate(self.placement) if rank in ranks]
        where = f"stage {stages[0]}" if stages else "no stage"
        host = self._hosts[rank] if rank < len(self._hosts) else "?"
        return f"rank {rank} ({where}, host {host})"

    def _lost_device_error(self, cause: RuntimeError) -> DeviceLostError:
        """Name the lost device from the heartbeats (blocks ``LIVENESS_WAIT_S``) and say so."""
        store = default_store()
        if self._heartbeat is None or store is None:
            lost: list[int] | None = []
        else:
            lost = find_lost_ranks(store, self.global_rank, self.world_size, wait_s=LIVENESS_WAIT_S)
        message = "DeepCEEStrategy: " + lost_message(
            lost, describe=self._describe_rank, cause=cause, wait_s=LIVENESS_WAIT_S
        )
        _print_everywhere(f"[rank {self.global_rank}] {message}")
        return DeviceLostError(message, lost if lost is not None else [0])

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.freeze_gc and not self._gc_frozen:
            started = time.perf_counter()
            gc.collect()
            gc.freeze()
            self._gc_frozen = True
            if self.verbose:
                rank_zero_info(
                    f"DeepCEE: froze {gc.get_freeze_count():,} objects for the garbage collector "
                    f"({time.perf_counter() - started:.2f} s); later collections skip them"
                )

    @override
    def on_train_end(self) -> None:
        self._unfreeze_gc()
        super().on_train_end()

    def _unfreeze_gc(self) -> None:
        if self._gc_frozen:
            gc.unfreeze()
            self._gc_frozen = False

    @override
    def teardown(self) -> None:
        self._unfreeze_gc()
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        super().teardown()

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        module = self.lightning_module
        assert module is not None and self.stage is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        if self._pending_grads is not None:
            for p, g in zip(self.stage.parameters(), self._pending_grads, strict=True):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad + g
            self._pending_grads = None
        return self.precision_plugin.post_backward(closure_loss, module)

    def _eval_step(self, name: str, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        assert self._eval_executor is not None
        module = self.lightning_module
        assert module is not None
        with torch.no_grad():
            loss = self._run(self._eval_executor, args[0] if args else kwargs["batch"])
        module.log(name, loss, prog_bar=True, on_step=False, on_epoch=True)
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._eval_step("val_loss", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._eval_step("test_loss", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "DeepCEEStrategy does not run predict(); consolidate the checkpoint with "
            "`deepcee consolidate` and predict with the plain module."
        )

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        # Micro-batching inside the schedule replaces accumulate_grad_batches.
        return True

    # ------------------------------------------------------------------------ checkpoints
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
        layout = {
            "num_stages": self.num_stages,
            "ranges": self.ranges,
            "schedule": self.schedule_kind,
            "num_microbatches": self.num_microbatches,
        }
        target = Path(filepath)
        partial = partial_dir(target)
        if self.is_global_zero and partial.exists():
            shutil.rmtree(partial)  # a save that crashed earlier
        self.barrier("DeepCEEStrategy.save_checkpoint:clean")
        checkpoint["optimizer_param_names"] = self._optimizer_param_names()
        save_sharded(
            checkpoint,
            partial,
            stage_index=self.stage_index,
            write_shard=self._writes_shard,
            write_meta=self.is_global_zero,
            layout=layout,
        )
        # Swap the finished save in only once every rank has written its part.
        self.barrier("DeepCEEStrategy.save_checkpoint:written")
        if self.is_global_zero:
            commit_partial(target)
        self.barrier("DeepCEEStrategy.save_checkpoint")

    @override
    def load_checkpoint(self, checkpoint_path: PATH, weights_only: bool | None = None) -> dict:
        checkpoint = load_sharded(
            Path(checkpoint_path), stage_index=self.stage_index, expected_ranges=self.ranges
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
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: PATH) -> None:
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="DeepCEE pipeline strategy", override=True
        )


def _print_everywhere(message: str) -> None:
    """Print on every rank (a lost-device error is news on each of them), to stderr."""
    print(message, file=sys.stderr, flush=True)
