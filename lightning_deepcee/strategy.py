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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
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
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.types import STEP_OUTPUT
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning_deepcee._compat import (
    _PATH,
    _flatten_dense_tensors,
    _unflatten_dense_tensors,
    default_process_group,
    fit_dataloader,
    optimizers_to_device,
)
from lightning_deepcee.checkpoint import (
    commit_partial,
    load_sharded,
    partial_dir,
    repartition,
    save_sharded,
)
from lightning_deepcee.planner import (
    Plan,
    StagePlan,
    balanced_partition,
    check_partition,
    partition_from_sizes,
    plan_search,
)
from lightning_deepcee.precision import wrap_precision
from lightning_deepcee.profiler import ClusterProfile, DeviceGroups, group_devices
from lightning_deepcee.runtime import (
    P2PTransport,
    PipelineExecutor,
    PipelineSpec,
    Stage,
    batch_size_of,
    build_stage,
    get_pipeline_spec,
    split_batch,
    split_sizes,
)
from lightning_deepcee.runtime.executor import StepStats
from lightning_deepcee.runtime.liveness import (
    DeviceLostError,
    Heartbeat,
    default_store,
    find_lost_ranks,
    lost_message,
)
from lightning_deepcee.runtime.measure import model_fingerprint, profile_cluster, profile_or_load
from lightning_deepcee.runtime.routing import Router, StageLayout
from lightning_deepcee.runtime.transport import PeerLostError, TransferRecord, all_reduce_
from lightning_deepcee.schedule import SCHEDULE_KINDS, generate, lower, render, validate
from lightning_deepcee.schedule.generators import StageSchedule, forward_only

__all__ = ["DeepCEEStrategy"]

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
"""Seconds between a rank's liveness beats in the rendezvous store."""
LIVENESS_WAIT_S = 3.0
"""After a failed step, how long a rank watches the heartbeats to name the lost device."""


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
        schedule = schedule or "1f1b"
        num_microbatches = num_microbatches or 4
        if schedule not in SCHEDULE_KINDS:
            raise ValueError(
                f"DeepCEEStrategy(schedule={schedule!r}) is unknown; choose one of "
                f"{', '.join(SCHEDULE_KINDS)}."
            )
        if num_microbatches < 1:
            raise ValueError(f"DeepCEEStrategy(num_microbatches={num_microbatches}) must be >= 1.")
        if num_stages is not None and num_stages < 1:
            raise ValueError(f"DeepCEEStrategy(num_stages={num_stages}) must be >= 1.")
        if timeout_s <= 0:
            raise ValueError(f"DeepCEEStrategy(timeout_s={timeout_s}) must be > 0.")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout_s),
        )
        self._partition_arg = _normalise_partition(partition)
        self.schedule_kind = schedule
        self.num_microbatches = num_microbatches
        self._placement_arg = _normalise_placement(placement)
        if self._placement_arg is not None:
            if num_stages is not None and num_stages != len(self._placement_arg):
                raise ValueError(
                    f"DeepCEEStrategy(num_stages={num_stages}) disagrees with placement, which "
                    f"has {len(self._placement_arg)} stages."
                )
            num_stages = len(self._placement_arg)
        self._num_stages_arg = num_stages
        if profile_budget_s <= 0:
            raise ValueError(f"DeepCEEStrategy(profile_budget_s={profile_budget_s}) must be > 0.")
        if isinstance(profile_rounds, bool) or not isinstance(profile_rounds, int):
            raise ValueError(
                f"DeepCEEStrategy(profile_rounds={profile_rounds!r}) must be a positive integer."
            )
        if profile_rounds < 1:
            raise ValueError(f"DeepCEEStrategy(profile_rounds={profile_rounds}) must be >= 1.")
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
        self._stage_group: Any = None
        self.plan: Plan | None = None
        self._pending_grads: list[torch.Tensor | None] | None = None
        self._global_batch_size = 0
        self.last_step_stats: StepStats | None = None
        self.last_step_samples = 0
        self.last_step_tokens: int | None = None
        self._heartbeat: Heartbeat | None = None
        self._hosts: list[str] = []
        self._block_names: list[str] = []
        """Qualified name of every block in the unsplit module, so a re-plan can put back the
        blocks that ``build_stage`` replaced by ``nn.Identity``."""

    # ----------------------------------------------------------------------------- layout
    @property
    def num_stages(self) -> int:
        """Pipeline depth (stages per replica)."""
        if self.plan is not None:
            return len(self.plan.stages)
        return self._num_stages_arg or self.world_size

    @property
    def num_replicas(self) -> int:
        """Data-parallel pipeline replicas, each reading its own shard of the data.

        A plan has one: devices sharing a stage split every micro-batch by rows instead.
        """
        return 1 if self.plan is not None else self.world_size // self.num_stages

    @property
    def placement(self) -> list[list[int]]:
        """Global ranks of each stage (one per replica, or a plan's devices of the stage)."""
        if self.plan is not None:
            return [list(st.ranks) for st in self.plan.stages]
        if self._placement_arg is not None:
            return [list(r) for r in self._placement_arg]
        s, d = self.num_stages, self.num_replicas
        return [[r * s + stage for r in range(d)] for stage in range(s)]

    def _where(self) -> tuple[int, int]:
        for stage, ranks in enumerate(self.placement):
            if self.global_rank in ranks:
                return stage, ranks.index(self.global_rank)
        raise ValueError(f"Rank {self.global_rank} is in no stage of placement {self.placement}.")

    @property
    def stage_index(self) -> int:
        return self._where()[0]

    @property
    def replica_index(self) -> int:
        return 0 if self.plan is not None else self._where()[1]

    def _layouts(self) -> list[StageLayout]:
        """The pipeline this rank belongs to: per stage, its devices and their row shares."""
        if self.plan is not None:
            return [StageLayout(st.ranks, st.batch_shares) for st in self.plan.stages]
        d = self.replica_index
        return [StageLayout((ranks[d],), (1.0,)) for ranks in self.placement]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Shard by pipeline replica only: every stage of one pipeline sees the same batch.
        return {"num_replicas": self.num_replicas, "rank": self.replica_index}

    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_plugin = (
            None if precision_plugin is None else wrap_precision(precision_plugin)
        )

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

    def _check_layout(self) -> None:
        if self.plan is not None:
            return  # Plan.check_matches has validated it
        if self.world_size % self.num_stages:
            raise ValueError(
                f"DeepCEEStrategy(num_stages={self.num_stages}) must divide the number of "
                f"processes ({self.world_size})."
            )
        flat = sorted(r for ranks in self.placement for r in ranks)
        if (
            flat != list(range(self.world_size))
            or len({len(ranks) for ranks in self.placement}) != 1
        ):
            raise ValueError(
                f"DeepCEEStrategy(placement={self.placement}) must list every rank 0.."
                f"{self.world_size - 1} exactly once, with as many ranks in every stage."
            )

    def _make_stage_groups(self) -> None:
        # Every rank creates every stage group, in the same order (new_group is collective).
        self._stage_group = None
        with _unbound_gloo_default_group():
            for s, ranks in enumerate(self.placement):
                group = dist.new_group(ranks) if len(ranks) > 1 else None
                if s == self.stage_index:
                    self._stage_group = group

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        self.spec = get_pipeline_spec(module)
        num_blocks = len(self.spec.blocks)
        if self.profile and trainer.state.fn == TrainerFn.FITTING:
            # Blocks are timed where they will run (the batch is already on root_device);
            # model_to_device below would move them there anyway.
            self.model_to_device()
            self._profile_cluster(trainer)
        if self.plan_arg is not None:
            self.plan = self._load_or_search_plan(num_blocks)
        self._check_layout()
        if self.num_stages > num_blocks:
            raise ValueError(
                f"DeepCEEStrategy: {self.num_stages} pipeline stages but "
                f"{type(module).__name__}.configure_pipeline() returns only {num_blocks} blocks. "
                f"Use at most {num_blocks} stages (num_stages or fewer devices), or split the "
                "model into more blocks."
            )
        self.ranges = self._resolve_partition(num_blocks)
        self._make_stage_groups()
        qualified = {id(m): name for name, m in module.named_modules()}
        self._block_names = [qualified[id(block)] for block in self.spec.blocks]
        self.stage = build_stage(module, self.spec, self.ranges, self.stage_index)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        # Every device of a stage holds the same (all-reduced) gradient: the global-norm clip
        # counts each stage once.
        self.precision_plugin.norm_share = 1.0 / len(  # type: ignore[attr-defined]
            self.placement[self.stage_index]
        )
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)
        self._build_executors()
        if self.verbose:
            rank_zero_info(self.describe())

    def _profile_cluster(self, trainer: pl.Trainer) -> None:
        """Measure devices and links on the first training micro-batch (all ranks)."""
        assert self.spec is not None
        loader = fit_dataloader(trainer)
        batch = next(iter(loader))
        batch = self.batch_to_device(batch)
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
        if self.profile_cache is not None:
            profile = profile_or_load(self.profile_cache, blocks, sample, **options)
        else:
            profile = profile_cluster(blocks, sample, **options)
        seconds = time.perf_counter() - began
        self.cluster_profile = profile
        self.device_groups = group_devices(profile)
        rank_zero_info(format_cluster(profile, self.device_groups))
        rank_zero_info(f"DeepCEE: profiled {profile.num_devices} devices in {seconds:.1f} s")
        metrics = {f"deepcee/capability_rank{d.rank}": d.capability for d in profile.devices}
        metrics["deepcee/profile_s"] = seconds
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=0)

    def _load_or_search_plan(self, num_blocks: int) -> Plan:
        """A saved plan checked against this run, or the search's plan (rank 0, broadcast)."""
        assert self.spec is not None
        fingerprint = model_fingerprint(list(self.spec.blocks))
        if self.plan_arg != "auto":
            plan = Plan.from_json(str(self.plan_arg))
            cluster = self.cluster_profile.cluster_fingerprint if self.cluster_profile else None
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
        self.schedule_kind = plan.schedule
        self.num_microbatches = plan.num_microbatches
        self._partition_arg = [(st.block_range[0], st.block_range[1]) for st in plan.stages]
        rank_zero_info("DeepCEE plan:\n" + plan.format_table())
        return plan

    def _resolve_partition(self, num_blocks: int) -> list[tuple[int, int]]:
        if self._partition_arg is None:
            assert self.spec is not None
            weights = [sum(p.numel() for p in b.parameters()) + 1 for b in self.spec.blocks]
            return balanced_partition(weights, self.num_stages)
        ranges = self._partition_arg
        if len(ranges) != self.num_stages:
            raise ValueError(
                f"DeepCEEStrategy(partition=...) has {len(ranges)} stages but the pipeline has "
                f"{self.num_stages} (num_stages or number of processes)."
            )
        check_partition(ranges, num_blocks)
        return list(ranges)

    def _build_executors(self) -> None:
        assert self.stage is not None and self.spec is not None
        # The schedule is per stage; devices sharing a stage run the same list, and the router
        # expands each transfer into the row pieces exchanged with the neighbouring devices.
        placement = {s: s for s in range(self.num_stages)}
        common: dict[str, Any] = dict(
            stage=self.stage,
            transport=P2PTransport(self.root_device, prefetch=self.receive_ahead),
            router=Router(self._layouts(), self.stage_index, self.global_rank),
            loss_fn=self.spec.loss_fn,
            input_fn=self.spec.input_fn,
            rank=self.global_rank,
        )
        m = self.num_microbatches
        train = lower(self._stage_schedule(m), placement)
        validate(train, placement, m)
        evaluation = lower(forward_only(self.num_stages, m), placement)
        validate(evaluation, placement, m, require_backward=False)
        self._train_schedule = train
        self._executor = PipelineExecutor(actions=train[self.stage_index], **common)
        self._eval_executor = PipelineExecutor(actions=evaluation[self.stage_index], **common)

    def _stage_schedule(self, m: int) -> StageSchedule:
        """Compute actions per stage for ``m`` micro-batches.

        A plan's own schedule (a ``"compact"`` plan carries its fitted actions, valid for the
        plan's micro-batch count; ZB-H1 for any other), else the named generator.
        """
        if self.plan is not None and self.schedule_kind == self.plan.schedule:
            return self.plan.stage_schedule(m)
        return generate(self.schedule_kind, self.num_stages, m)

    def set_num_microbatches(self, num_microbatches: int) -> None:
        """Use ``num_microbatches`` from the next step on (all ranks must call it together).

        Any split gives the same gradient (rows are weighted by their share of the step), so the
        adapter may change it between any two steps without a restart.
        """
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        if num_microbatches != self.num_microbatches:
            self.num_microbatches = num_microbatches
            self._build_executors()

    # ------------------------------------------------------------------------ re-planning
    def current_plan(self) -> Plan:
        """The running layout as a :class:`Plan` (what a re-plan is compared with).

        A plan run returns its plan. A manual layout with one pipeline replica becomes a plan of
        one device per stage, its schedule and the micro-batch count in force, sized to the last
        step's batch, with no predictions; a manual layout with several replicas has no plan
        form (its replicas read different data) and raises ``ValueError``.
        """
        if self.plan is not None:
            return self.plan
        self._check_single_replica("current_plan")
        assert self.spec is not None
        stages = tuple(
            StagePlan(block_range=r, ranks=tuple(ranks), batch_shares=(1.0,))
            for r, ranks in zip(self.ranges, self.placement, strict=True)
        )
        batch = max(self.last_step_samples, self._global_batch_size, self.num_microbatches)
        return Plan(
            stages=stages,
            schedule=self.schedule_kind,
            num_microbatches=self.num_microbatches,
            global_batch_size=batch,
            predicted_step_time_s=0.0,
            predicted_bubble_ratio=0.0,
            predicted_peak_memory_bytes={},
            model_fingerprint=model_fingerprint(list(self.spec.blocks)),
            cluster_fingerprint=(
                self.cluster_profile.cluster_fingerprint if self.cluster_profile else ""
            ),
            notes="manual layout",
        )

    def _check_single_replica(self, what: str) -> None:
        if self.num_replicas != 1:
            raise ValueError(
                f"DeepCEEStrategy.{what}: this run has {self.num_replicas} data-parallel pipeline "
                "replicas (manual num_stages/placement), each reading its own shard of the data, "
                "and the sampler cannot change mid-epoch; a plan feeds every rank the whole batch "
                "and splits rows inside a stage. Start from a plan (DeepCEEStrategy() or "
                "plan='plan.json') or a manual layout with one replica to re-plan during training."
            )

    def check_plan(self, plan: Plan) -> None:
        """Raise unless ``plan`` can replace the running layout (the checks of :meth:`apply_plan`).

        The same checks as a saved plan at setup (``Plan.check_matches``: every block, every rank
        of the world once, the model's fingerprint and, when profiled, the cluster's), plus: the
        strategy is set up, and the run has one pipeline replica. Local and deterministic: every
        rank raises alike, before any collective.
        """
        if not isinstance(plan, Plan):
            raise TypeError(
                f"DeepCEEStrategy.apply_plan expects a lightning_deepcee.Plan, got "
                f"{type(plan).__name__} (Plan.from_dict / Plan.from_json build one)."
            )
        if self.spec is None or self.stage is None or self.lightning_module is None:
            raise RuntimeError(
                "DeepCEEStrategy.apply_plan runs on a set-up strategy, between training steps "
                "(from a callback's on_train_batch_end or on_train_start)."
            )
        self._check_single_replica("apply_plan")
        cluster = self.cluster_profile.cluster_fingerprint if self.cluster_profile else None
        try:
            plan.check_matches(
                len(self.spec.blocks),
                self.world_size,
                model_fingerprint(list(self.spec.blocks)),
                cluster,
            )
        except ValueError as exc:
            raise ValueError(
                f"DeepCEEStrategy.apply_plan: the new plan cannot replace the running layout. {exc}"
            ) from None

    def apply_plan(self, plan: Plan, trainer: pl.Trainer) -> None:
        """Switch to ``plan`` between two steps: move blocks, with their optimizer state, live.

        Every rank calls it together, at a step boundary (a callback's ``on_train_batch_end``,
        after the optimizer and LR-scheduler step of that batch, or ``on_train_start``). What it
        does:

        1. :meth:`check_plan` (local, so a bad plan raises on every rank before anything moves);
        2. the first device of every stage copies its stage's part of the training state to host
           memory: weights, optimizer state, LR-scheduler state and the global name of each
           optimizer parameter, exactly a checkpoint shard; ``all_gather_object`` gives every
           rank every shard (the ranks must pass equal plans, or all raise here);
        3. the blocks ``build_stage`` replaced by ``nn.Identity`` are put back, the module is
           split again for the new ranges, the stage process groups are re-created (the old one
           destroyed), blocks this rank no longer runs go back to host memory;
        4. ``configure_optimizers`` runs again through Lightning, so the optimizers and
           schedulers cover this rank's new parameters; ``strategy.optimizers`` (hence
           ``_lightning_optimizers``, which the automatic-optimization loop reads at every step)
           and ``lr_scheduler_configs`` are the new objects from the next step on;
        5. this rank's part is rebuilt from the shards with the checkpoint code
           (:func:`~lightning_deepcee.checkpoint.repartition`) and loaded: weights, optimizer
           state (by parameter name, so Adam moments follow their block), scheduler state;
        6. the executors are rebuilt for the plan's stages, shares, schedule and micro-batches.

        Gradients stay exact: nothing changes inside a step, the moved state is bit-for-bit the
        state the old owner would have used, and the next step computes the same whole-batch
        gradient under any layout. Rank 0 logs the old and new layout.

        Cost: the whole training state (weights plus optimizer state, 3x the weights with Adam)
        passes through every rank once, pickled on the host: ``world_size`` times that many bytes
        in all, held at once in each rank's host memory. That is seconds for the models this
        strategy targets (up to some hundred MB of state on a LAN, longer over a WAN), and a
        re-plan is rare (the adapter asks at most once per ``replan_after`` steps per link).
        Sending only the blocks that change owner, point to point, would move less; it is not
        done here. The gather blocks every rank, so it must finish within ``timeout_s``.
        """
        self.check_plan(plan)
        module, spec = self.lightning_module, self.spec
        assert module is not None and spec is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        began = time.perf_counter()
        before = self._layout_line()
        shard = self._live_shard() if self._where()[1] == 0 else None
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (plan.to_dict(), self.stage_index, shard))
        differing = [r for r, part in enumerate(gathered) if part[0] != gathered[0][0]]
        if differing:
            raise ValueError(
                f"DeepCEEStrategy.apply_plan: ranks {differing} passed another plan than rank 0; "
                "every rank must pass the same plan (broadcast it from rank 0). Nothing changed."
            )
        shards: list[dict[str, Any]] = [{} for _ in range(self.num_stages)]
        for _, stage_index, part in gathered:
            if part is not None:
                shards[stage_index] = part
        num_bytes = sum(_tensor_bytes(s) for s in shards)

        self._restore_blocks()
        self.plan = plan
        self.schedule_kind = plan.schedule
        self.num_microbatches = plan.num_microbatches
        self._partition_arg = [(st.block_range[0], st.block_range[1]) for st in plan.stages]
        self.ranges = self._resolve_partition(len(spec.blocks))
        old_group = self._stage_group
        self._make_stage_groups()
        if old_group is not None:
            # Every rank is past the gather, so no collective of the old group is in flight.
            dist.destroy_process_group(old_group)
        self.stage = build_stage(module, spec, self.ranges, self.stage_index)
        self._park_other_blocks()
        assert self.model is not None
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.precision_plugin.norm_share = 1.0 / len(  # type: ignore[attr-defined]
            self.placement[self.stage_index]
        )
        fresh = [opt.state_dict() for opt in self.optimizers]
        local = repartition(
            shards,
            list(module.state_dict().keys()),
            list(zip(fresh, self._optimizer_param_names(), strict=True)),
        )
        module.load_state_dict(local["state_dict"], strict=True)
        for optimizer, state in zip(self.optimizers, local["optimizer_states"], strict=True):
            optimizer.load_state_dict(state)
        if fitting:
            schedulers = self.lr_scheduler_configs
            for config, state in zip(schedulers, local["lr_schedulers"], strict=True):
                config.scheduler.load_state_dict(state)
            optimizers_to_device(self.optimizers, self.root_device)
        self._pending_grads = None
        self._build_executors()
        rank_zero_info(
            f"DeepCEE: re-planned at step {trainer.global_step}, moved the training state "
            f"({num_bytes / 1e6:.2f} MB, gathered on every rank) in "
            f"{time.perf_counter() - began:.2f} s:\n  before: {before}\n  after:  "
            f"{self._layout_line()}"
        )
        if self.verbose:
            rank_zero_info(self.describe())

    def _layout_line(self) -> str:
        """``[0, 3) on 0 | [3, 6) on 1,2 (0.50,0.50); 1f1b, 2 micro-batches`` for the logs."""
        shares = [st.batch_shares for st in self.plan.stages] if self.plan is not None else None
        parts = []
        for s, ((a, b), ranks) in enumerate(zip(self.ranges, self.placement, strict=True)):
            part = f"[{a}, {b}) on {','.join(str(r) for r in ranks)}"
            if shares is not None and len(ranks) > 1:
                part += " (" + ",".join(f"{x:.2f}" for x in shares[s]) + ")"
            parts.append(part)
        return " | ".join(parts) + f"; {self.schedule_kind}, {self.num_microbatches} micro-batches"

    def _live_shard(self) -> dict[str, Any]:
        """This stage's training state on the host, in the checkpoint's shard format."""
        module = self.lightning_module
        assert module is not None
        shard = {
            "state_dict": module.state_dict(),
            "optimizer_states": [self.optimizer_state(opt) for opt in self.optimizers],
            "lr_schedulers": [c.scheduler.state_dict() for c in self.lr_scheduler_configs],
            "optimizer_param_names": self._optimizer_param_names(),
        }
        # Pickling a CUDA tensor would unpickle it on the receiver's GPU of the same index.
        return apply_to_collection(shard, torch.Tensor, lambda t: t.detach().cpu())

    def _restore_blocks(self) -> None:
        """Put every original block back into the module (undo ``build_stage``)."""
        module, spec = self.lightning_module, self.spec
        assert module is not None and spec is not None
        for name, block in zip(self._block_names, spec.blocks, strict=True):
            parent_name, _, attr = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, attr, block)

    def _park_other_blocks(self) -> None:
        """Blocks this rank no longer runs keep their objects (a later re-plan puts them back
        and overwrites their weights) but free the accelerator: host memory, no gradients."""
        assert self.spec is not None
        start, end = self.ranges[self.stage_index]
        for index, block in enumerate(self.spec.blocks):
            if start <= index < end:
                continue
            for p in block.parameters():
                p.grad = None
            if self.root_device.type != "cpu":
                block.to("cpu")

    @property
    def transfer_records(self) -> list[TransferRecord]:
        """This rank's transfers of the last training step (peer, bytes, seconds, direction)."""
        return [] if self._executor is None else list(self._executor.transport.records)

    def describe(self) -> str:
        """The partition and schedule, as printed at setup."""
        assert self.spec is not None
        lines = [
            f"DeepCEEStrategy: {self.num_stages} stages x {self.num_replicas} replica(s), "
            f"schedule {self.schedule_kind}, {self.num_microbatches} micro-batches",
            "  stage | blocks      | ranks        | parameters",
        ]
        for s, (a, b) in enumerate(self.ranges):
            n = sum(p.numel() for blk in list(self.spec.blocks)[a:b] for p in blk.parameters())
            ranks = ",".join(str(r) for r in self.placement[s])
            lines.append(f"  {s:>5} | [{a:>3}, {b:>3}) | {ranks:<12} | {n:,}")
        placement = {s: s for s in range(self.num_stages)}
        stage_sched = self._stage_schedule(self.num_microbatches)
        lines.append("  schedule (stage | actions):")
        grid = render(lower(stage_sched, placement), compute_only=True)
        lines.extend("    " + line for line in grid.splitlines())
        return "\n".join(lines)

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
                _sum_gradients(params, self._stage_group)
                synced = time.perf_counter() - synced
        except RuntimeError as exc:
            if not _is_communication_failure(exc):
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
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
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
            write_shard=self._where()[1] == 0,
            write_meta=self.is_global_zero,
            layout=layout,
        )
        # Swap the finished save in only once every rank has written its part.
        self.barrier("DeepCEEStrategy.save_checkpoint:written")
        if self.is_global_zero:
            commit_partial(target)
        self.barrier("DeepCEEStrategy.save_checkpoint")

    def _optimizer_param_names(self) -> list[list[str]]:
        """Global names of each optimizer's parameters in optimizer order (for re-partitioning)."""
        module = self.lightning_module
        assert module is not None
        names = {id(p): n for n, p in module.named_parameters()}
        return [
            [names[id(p)] for g in opt.param_groups for p in g["params"]] for opt in self.optimizers
        ]

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict:
        checkpoint = load_sharded(
            Path(checkpoint_path), stage_index=self.stage_index, expected_ranges=self.ranges
        )
        shards = checkpoint.pop("deepcee_shards", None)
        if shards is not None:
            # The cluster or plan changed: rebuild this rank's part from every saved stage.
            module = self.lightning_module
            assert module is not None
            fresh = [opt.state_dict() for opt in self.optimizers]
            local = repartition(
                shards,
                list(module.state_dict().keys()),
                list(zip(fresh, self._optimizer_param_names(), strict=True)),
            )
            checkpoint.update(local)
            rank_zero_info(
                f"DeepCEE: re-partitioned checkpoint {checkpoint_path} from blocks "
                f"{checkpoint['deepcee']['ranges']} onto {self.ranges}."
            )
        checkpoint.pop("optimizer_param_names", None)
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="DeepCEE pipeline strategy", override=True
        )


def _normalise_partition(
    partition: Sequence[int] | Sequence[Sequence[int]] | None,
) -> list[tuple[int, int]] | None:
    if partition is None:
        return None
    items = list(partition)
    if not items:
        raise ValueError("DeepCEEStrategy(partition=[]) needs at least one stage.")
    if all(isinstance(x, int) for x in items):
        sizes = [int(x) for x in items if isinstance(x, int)]
        if any(n < 1 for n in sizes):
            raise ValueError(f"DeepCEEStrategy(partition={sizes}): stage sizes must be >= 1.")
        return partition_from_sizes(sizes)
    ranges = []
    for x in items:
        pair = list(x) if isinstance(x, Sequence) else [x]
        if len(pair) != 2:
            raise ValueError(
                f"DeepCEEStrategy(partition=...): expected stage sizes like [3, 2, 3] or block "
                f"ranges like [[0, 3], [3, 5]], got {partition}."
            )
        ranges.append((_as_int(pair[0]), _as_int(pair[1])))
    return ranges


def _as_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"DeepCEEStrategy: {value!r} in partition/placement is not an integer.")
    return value


def _normalise_placement(placement: Sequence[Sequence[int]] | None) -> list[tuple[int, ...]] | None:
    if placement is None:
        return None
    out = [tuple(_as_int(r) for r in ranks) for ranks in placement]
    if not out or any(not ranks for ranks in out):
        raise ValueError(f"DeepCEEStrategy(placement={placement}) needs ranks for every stage.")
    return out


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


def _is_communication_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a failed transfer or collective, not a model bug."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (PeerLostError, dist.DistError)):
            return True
        text = str(current).lower()
        if any(word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout")):
            return True
        current = current.__cause__ or current.__context__
    return False


def _print_everywhere(message: str) -> None:
    """Print on every rank (a lost-device error is news on each of them), to stderr."""
    print(message, file=sys.stderr, flush=True)


@contextmanager
def _unbound_gloo_default_group() -> Iterator[None]:
    """Create gloo subgroups as if the default group were bound to no device.

    Lightning binds the default group to the rank's GPU (``device_id``) whatever the backend, and
    torch's ``new_group`` then splits subgroups from it; a rank outside a new group calls
    ``perform_nocolor_split``, which gloo does not have (``AttributeError`` on a GPU rank of a
    mixed GPU/CPU cluster whose plan shares a stage between other ranks; seen with torch 2.11,
    the same code in 2.13). Gloo creates subgroups without splitting, so the binding is lifted
    while they are made. NCCL keeps its split.
    """
    default = default_process_group()
    bound = default.bound_device_id
    if bound is None or dist.get_backend(default) != "gloo":
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


def _tensor_bytes(obj: Any) -> int:
    """Bytes of all tensors in a nested collection (for the re-plan log line)."""
    total = 0

    def count(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    apply_to_collection(obj, torch.Tensor, count)
    return total


def _sum_gradients(params: Sequence[torch.nn.Parameter], group: Any) -> None:
    """Sum the stage's gradients over the devices sharing it: one flat all-reduce per dtype.

    A device that held no rows this step has no gradients; it contributes zeros, so every
    device of the group calls the same collectives.
    """
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for group_params in by_dtype.values():
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group_params]
        flat = _flatten_dense_tensors(grads)
        all_reduce_(flat, group=group)
        for p, g in zip(group_params, _unflatten_dense_tensors(flat, grads), strict=True):
            p.grad = g
