"""The layout half of DeepCEEStrategy: one Plan, built and rebuilt on this rank.

:class:`PipelineLayoutStrategy` holds the running :class:`~lightning_deepcee.planner.Plan`
(every layout is one: planned, saved or manual), answers where this rank sits in it (stage,
replica, placement), builds this rank's part with :meth:`~PipelineLayoutStrategy._build` (the
one path used by setup, re-plan and resume) and switches plans between two steps
(:meth:`~PipelineLayoutStrategy.apply_plan`).
:class:`~lightning_deepcee.strategy.elastic.ElasticStrategy` adds the sharded checkpoints and
the restarts, :class:`~lightning_deepcee.strategy.deepcee.DeepCEEStrategy` setup and the steps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning_deepcee._compat import mock_optimizer, optimizers_to_device
from lightning_deepcee.planner import Plan
from lightning_deepcee.profiler import ClusterProfile
from lightning_deepcee.runtime import (
    PipelineExecutor,
    PipelineSpec,
    Stage,
    batch_size_of,
    build_stage,
    split_batch,
    split_sizes,
)
from lightning_deepcee.runtime.checkpoint import repartition
from lightning_deepcee.runtime.layout import (
    ManualLayout,
    batch_dependent_modules,
    build_executors,
    describe,
    layout_line,
    make_stage_groups,
)
from lightning_deepcee.runtime.measure import model_fingerprint
from lightning_deepcee.runtime.relayout import move_shards, routes
from lightning_deepcee.runtime.stage import TiedParameter
from lightning_deepcee.runtime.ties import (
    TieGroup,
    broadcast_initial_weights,
    canonical_names,
    make_tie_groups,
    owned_state_dict,
    sync_copies,
)
from lightning_deepcee.runtime.transport import TransferRecord, all_reduce_
from lightning_deepcee.runtime.values import cat_values
from lightning_deepcee.strategy.placement import Placement
from lightning_deepcee.strategy.precision import wrap_precision

__all__ = ["PipelineLayoutStrategy"]


class PipelineLayoutStrategy(DDPStrategy):
    """A DDP-launched strategy whose ranks run the stages of one :class:`Plan`.

    Not used on its own: :class:`~lightning_deepcee.strategy.deepcee.DeepCEEStrategy` sets the
    attributes declared here in its ``__init__``.
    """

    _manual: ManualLayout
    plan: Plan | None
    num_microbatches: int
    spec: PipelineSpec | None
    stage: Stage | None
    ranges: list[tuple[int, int]]
    cluster_profile: ClusterProfile | None
    receive_ahead: bool
    verbose: bool
    last_step_samples: int
    _global_batch_size: int
    _executor: PipelineExecutor | None
    _eval_executor: PipelineExecutor | None
    _predict_executor: PipelineExecutor | None
    _stage_group: Any
    _pending_grads: list[torch.Tensor | None] | None
    _block_names: list[str]
    _split_module: Any
    _synced_buffers: list[torch.Tensor]
    """Running statistics of this stage's BatchNorm modules, kept equal across its devices."""
    _ties: list[tuple[TiedParameter, torch.nn.Parameter]]
    """Parameters several blocks use, with the parameter object (found on the unsplit module)."""
    _tie_groups: list[TieGroup]
    """This rank's tied parameters that span stages, with the group of their holders."""

    # ----------------------------------------------------------------------------- layout
    @property
    def schedule_kind(self) -> str:
        """The running schedule kind (the plan's, or the manual ``schedule``)."""
        return self.plan.schedule if self.plan is not None else self._manual.schedule

    @property
    def where(self) -> Placement:
        """Where this rank sits in the running plan (before set-up makes one: in the manual
        layout's arguments)."""
        if self.plan is not None:
            return Placement.of_plan(self.plan, self.global_rank)
        return Placement.of_manual(self._manual, self.world_size, self.global_rank)

    @property
    def num_stages(self) -> int:
        """Pipeline depth (stages per replica)."""
        return self.where.num_stages

    @property
    def num_replicas(self) -> int:
        """Data-parallel pipeline replicas, each reading its own shard of the data."""
        return self.where.num_replicas

    @property
    def placement(self) -> list[list[int]]:
        """Global ranks of each stage (one per replica, or a plan's devices of the stage)."""
        return [list(ranks) for ranks in self.where.stages]

    @property
    def is_idle(self) -> bool:
        """Whether the running plan leaves this rank idle (no stage, no compute)."""
        return self.plan is not None and self.global_rank in self.plan.idle_ranks

    @property
    def stage_index(self) -> int:
        """This rank's stage; ``IDLE`` (-1) when the plan leaves it idle."""
        return self.where.stage_index

    @property
    def replica_index(self) -> int:
        return self.where.replica_index

    @property
    def writes_shard(self) -> bool:
        """The first device of each stage holds what a checkpoint shard of the stage saves."""
        return self.where.writes_shard

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

    def _build(
        self, plan: Plan, trainer: pl.Trainer, shards: list[dict[str, Any]] | None = None
    ) -> None:
        """Build (or rebuild) this rank's part of ``plan``: the one path for every layout.

        Used by setup, re-plan (:meth:`apply_plan`, with the gathered ``shards`` of the training
        state) and hence resume, whose checkpoint is re-partitioned onto what this builds. It
        splits the module for the plan's ranges, re-creates the stage process groups, moves
        blocks this rank does not run off the accelerator, (re)creates the optimizers through
        Lightning while fitting, loads the re-partitioned state when ``shards`` are given, and
        lowers, validates and wraps the schedule in executors.
        """
        module, spec = self.lightning_module, self.spec
        assert module is not None and spec is not None and self.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.plan = plan
        self.num_microbatches = plan.num_microbatches
        self.ranges = [st.block_range for st in plan.stages]
        old_groups = [self._stage_group, *(t.group for t in self._tie_groups)]
        self._stage_group = make_stage_groups(self.placement, self.stage_index)
        self._tie_groups = make_tie_groups(
            self._ties, self.ranges, self.placement, self.stage_index
        )
        for old in old_groups:
            if old is not None:
                # Every rank has passed the collective new_group calls: nothing is in flight.
                dist.destroy_process_group(old)
        self.stage = build_stage(module, spec, self.ranges, self.stage_index)
        self._split_module = module
        start, end = self.stage.block_range
        self._synced_buffers = [
            buffer
            for found in batch_dependent_modules(spec.blocks)
            if start <= found.block_index < end
            for buffer in found.module.buffers(recurse=False)
        ]
        self._park_other_blocks()
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if shards is None and not self.is_idle:
            broadcast_initial_weights(
                self.stage.blocks,
                self.placement[self.stage_index],
                self._stage_group,
                self._tie_groups,
            )
        if fitting and self.is_idle:
            # Nothing to optimise: Lightning's own stand-in for "no optimizer" keeps the loop
            # (and its collectives, such as gradient clipping's norm) in step with the others.
            self.optimizers, self.lr_scheduler_configs = [mock_optimizer()], []
        elif fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        # Every device of a stage holds the same (all-reduced) gradient: the global-norm clip
        # counts each stage once.
        devices = 1 if self.is_idle else len(self.placement[self.stage_index])
        self.precision_plugin.norm_share = 1.0 / devices  # type: ignore[attr-defined]
        self.precision_plugin.norm_shares = {  # type: ignore[attr-defined]
            id(t.parameter): 1.0 / len(t.ranks) for t in self._tie_groups
        }
        if shards is not None and not self.is_idle:
            local = self._repartitioned(shards)
            module.load_state_dict(local["state_dict"], strict=True)
            for optimizer, state in zip(self.optimizers, local["optimizer_states"], strict=True):
                optimizer.load_state_dict(state)
            if fitting:
                schedulers = self.lr_scheduler_configs
                for config, state in zip(schedulers, local["lr_schedulers"], strict=True):
                    config.scheduler.load_state_dict(state)
        if fitting:
            optimizers_to_device(self.optimizers, self.root_device)
        self._pending_grads = None
        self._build_executors()
        if self.verbose:
            rank_zero_info(self.describe())

    def _repartitioned(self, shards: list[dict[str, Any]]) -> dict[str, Any]:
        """This rank's training state rebuilt from every stage's shard (re-plan and resume)."""
        module = self.lightning_module
        assert module is not None
        fresh = [opt.state_dict() for opt in self.optimizers]
        return repartition(
            shards,
            list(module.state_dict().keys()),
            list(zip(fresh, self._optimizer_param_names(), strict=True)),
            tied=[tie.names for tie, _ in self._ties],
        )

    def _build_executors(self) -> None:
        assert self.stage is not None and self.spec is not None and self.plan is not None
        if self.is_idle:
            self._executor = self._eval_executor = self._predict_executor = None
            return
        built = build_executors(
            self.plan,
            num_microbatches=self.num_microbatches,
            stage=self.stage,
            spec=self.spec,
            rank=self.global_rank,
            device=self.root_device,
            receive_ahead=self.receive_ahead,
        )
        self._executor, self._eval_executor = built.train, built.evaluation
        self._predict_executor = built.prediction

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

        A planned run returns its plan. A manual layout with one pipeline replica returns its
        plan with the micro-batch count in force, sized to the last step's batch, with no
        predictions; a manual layout with several replicas cannot be re-planned (its replicas
        read different data) and raises ``ValueError``.
        """
        self._check_single_replica("current_plan")
        if self.plan is None:
            raise RuntimeError("DeepCEEStrategy.current_plan runs on a set-up strategy.")
        if self.plan.notes != "manual layout":
            return self.plan
        batch = max(self.last_step_samples, self._global_batch_size, self.num_microbatches)
        return dataclasses.replace(
            self.plan, num_microbatches=self.num_microbatches, global_batch_size=batch
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
            if plan.num_replicas != 1:
                raise ValueError("it has several data-parallel replicas")
        except ValueError as exc:
            raise ValueError(
                f"DeepCEEStrategy.apply_plan: the new plan cannot replace the running layout. {exc}"
            ) from None

    def apply_plan(self, plan: Plan, trainer: pl.Trainer, why: str = "re-planned") -> None:
        """Switch to ``plan`` between two steps: move blocks, with their optimizer state, live.

        Every rank calls it together, at a step boundary (a callback's ``on_train_batch_end``,
        after the optimizer and LR-scheduler step of that batch, or ``on_train_start``). What it
        does:

        1. :meth:`check_plan` (local, so a bad plan raises on every rank before anything moves);
        2. the first device of every stage copies its stage's part of the training state to host
           memory: weights, optimizer state, LR-scheduler state and the global name of each
           optimizer parameter, exactly a checkpoint shard; each rank of the new layout receives,
           point to point, the shards of the old stages that held its new blocks
           (:mod:`~lightning_deepcee.runtime.relayout`: a rank that keeps its blocks receives
           nothing over the network, an idle rank nothing at all). The ranks first agree on the
           plan (a digest of it, gathered): unequal plans raise on every rank;
        3. the blocks ``build_stage`` replaced by ``nn.Identity`` are put back and :meth:`_build`
           builds the new layout, as setup does, loading this rank's part rebuilt from the
           shards with the checkpoint code
           (:func:`~lightning_deepcee.runtime.checkpoint.repartition`):
           weights, optimizer state (by parameter name, so Adam moments follow their block) and
           scheduler state. ``configure_optimizers`` runs again through Lightning, so the
           optimizers and schedulers cover this rank's new parameters from the next step on.

        Gradients stay exact: nothing changes inside a step, the moved state is bit-for-bit the
        state the old owner would have used, and the next step computes the same whole-batch
        gradient under any layout. Rank 0 logs the old and new layout and the bytes moved.

        Cost: the state of the blocks that change owner crosses the links from their old to their
        new owners, pickled on the host; every rank waits until the move is done, so it must
        finish within ``timeout_s``. ``why`` opens the log line.
        """
        assert self.plan is not None
        self.relayout_from(self.plan, self.live_shard, plan, trainer, why)

    def relayout_from(
        self,
        source: Plan,
        shard_of: Callable[[], dict[str, Any]],
        plan: Plan,
        trainer: pl.Trainer,
        why: str,
    ) -> None:
        """:meth:`apply_plan` from ``source``, whose first device of each stage holds its part of
        the training state in ``shard_of()``: the running layout, or one the plan trial saved
        before building layouts whose weights are not the training state."""
        self.check_plan(plan)
        began = time.perf_counter()
        before = layout_line(source, source.num_microbatches)
        digest = hashlib.sha256(json.dumps(plan.to_dict(), sort_keys=True).encode()).hexdigest()
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, digest)
        differing = [r for r, part in enumerate(gathered) if part != gathered[0]]
        if differing:
            raise ValueError(
                f"DeepCEEStrategy.apply_plan: ranks {differing} passed another plan than rank 0; "
                "every rank must pass the same plan (broadcast it from rank 0). Nothing changed."
            )
        moves = routes(
            [st.block_range for st in source.stages],
            [list(st.ranks) for st in source.stages],
            [st.block_range for st in plan.stages],
            [list(st.ranks) for st in plan.stages],
            tied_blocks=[tie.blocks for tie, _ in self._ties],
        )
        sends = any(m.src == self.global_rank for m in moves)
        shard = shard_of() if sends else None
        received, sent = move_shards(moves, self.global_rank, shard, self.root_device)
        figures = torch.tensor([float(sent)], dtype=torch.float64, device=self.root_device)
        all_reduce_(figures)
        self._restore_blocks()
        self._build(plan, trainer, [received[stage] for stage in sorted(received)])
        rank_zero_info(
            f"DeepCEE: {why} at step {trainer.global_step}, moved the training state "
            f"({figures.item() / 1e6:.2f} MB sent point to point) in "
            f"{time.perf_counter() - began:.2f} s:\n  before: {before}\n  after:  "
            f"{layout_line(plan, self.num_microbatches)}"
        )

    def live_shard(self) -> dict[str, Any]:
        """This stage's training state on the host, in the checkpoint's shard format."""
        module = self.lightning_module
        assert module is not None
        shard = {
            "state_dict": self.lightning_module_state_dict(),
            "optimizer_states": [self.optimizer_state(opt) for opt in self.optimizers],
            "lr_schedulers": [c.scheduler.state_dict() for c in self.lr_scheduler_configs],
            "optimizer_param_names": self._optimizer_param_names(),
        }
        # Pickling a CUDA tensor would unpickle it on the receiver's GPU of the same index.
        return apply_to_collection(shard, torch.Tensor, lambda t: t.detach().cpu())

    def build_for_timing(self, plan: Plan, trainer: pl.Trainer) -> None:
        """Build ``plan`` from the copies of the blocks this rank holds, moving no state (each
        stage's replicas take its first device's copy): the weights are not the training state,
        the shapes and the work are. The plan trial times layouts so, and then
        :meth:`relayout_from` the layout whose state it saved. Collective."""
        self.check_plan(plan)
        self._restore_blocks()
        self._build(plan, trainer)

    def _restore_blocks(self) -> None:
        """Put every original block back into the module (undo ``build_stage``)."""
        module, spec = self.lightning_module, self.spec
        assert module is not None and spec is not None
        for name, block in zip(self._block_names, spec.blocks, strict=True):
            parent_name, _, attr = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, attr, block)

    @contextmanager
    def whole_model(self) -> Iterator[None]:
        """Every block back in the module for the duration, then this rank's split again (for
        views of the whole model, such as Lightning's model summary; no collectives)."""
        module, spec = self.lightning_module, self.spec
        if module is None or spec is None or self.stage is None:
            yield
            return
        self._restore_blocks()
        try:
            yield
        finally:
            build_stage(module, spec, self.ranges, self.stage_index)

    def _park_other_blocks(self) -> None:
        """Blocks this rank no longer runs keep their objects (a later re-plan puts them back
        and overwrites their weights) but free the accelerator: host memory, no gradients."""
        assert self.spec is not None
        assert self.stage is not None
        start, end = self.stage.block_range
        local = {id(p) for p in self.stage.parameters()}
        for index, block in enumerate(self.spec.blocks):
            if start <= index < end:
                continue
            shared = False
            for p in block.parameters():
                if id(p) in local:
                    shared = True  # a tied parameter this stage runs: it stays
                else:
                    p.grad = None
            if self.root_device.type != "cpu" and not shared:
                block.to("cpu")

    # ----------------------------------------------------------------------------- a step
    def run_schedule(self, kind: str, batch: Any) -> torch.Tensor | None:
        """This rank's part of one pipeline step on ``batch``: the one step function of
        training (``"train"``, also the plan trial's), evaluation (``"eval"``) and prediction
        (``"predict"``, whose outputs stay in the executor's ``last_outputs``).

        The batch is split into the running number of micro-batches and the lowered schedule
        runs under the precision plugin's forward context. Each rank weights its rows by rows /
        (samples of the step over all replicas), so the sums of the loss and of the stage
        gradients are whole-step means; prediction weights by this replica's batch. Returns this
        rank's share of the loss, ``None`` on a rank the plan leaves idle (no executor).
        """
        executor = {
            "train": self._executor,
            "eval": self._eval_executor,
            "predict": self._predict_executor,
        }[kind]
        if executor is None:
            return None
        total = batch_size_of(batch)
        micro = split_batch(batch, split_sizes(total, self.num_microbatches))
        weight = total if kind == "predict" else total * self.num_replicas
        return executor.run(micro, weight, forward_context=self.precision_plugin.forward_context)

    def sync_copies(self) -> float:
        """After a training step's schedule: sum the gradients of this stage's copies (devices
        sharing the stage) and of tied parameters across stages, and keep batch statistics
        equal; returns the seconds it took (0 when no copy lives elsewhere)."""
        if self._stage_group is None and not self._tie_groups:
            return 0.0
        assert self.stage is not None
        began = time.perf_counter()
        first = self.placement[self.stage_index][0]
        sync_copies(
            self.stage.parameters(),
            self._stage_group,
            self._tie_groups,
            self._synced_buffers,
            first,
        )
        return time.perf_counter() - began

    @property
    def transfer_records(self) -> list[TransferRecord]:
        """This rank's transfers of the last training step (peer, bytes, seconds, direction)."""
        return [] if self._executor is None else list(self._executor.transport.records)

    def _gathered_output(self, mine: list[tuple[int, int, Any]]) -> Any:
        """The last stage's output (a block value) for this replica's whole batch, on every
        rank."""
        assert self.plan is not None
        plan, replica = self.plan, self.replica_index
        parts: list[Any] = [None] * self.world_size
        on_host = apply_to_collection(mine, torch.Tensor, lambda t: t.cpu())
        dist.all_gather_object(parts, on_host)
        pieces = [
            piece
            for rank, part in enumerate(parts)
            if plan.num_replicas == 1 or plan.replica_of(rank) == replica
            for piece in part or []
        ]
        pieces.sort(key=lambda piece: (piece[0], piece[1]))
        whole = cat_values([value for _, _, value in pieces])
        return apply_to_collection(whole, torch.Tensor, lambda t: t.to(self.root_device))

    def describe(self) -> str:
        """The partition and schedule, as printed at setup."""
        assert self.spec is not None and self.plan is not None
        return describe(self.plan, self.spec, self.num_microbatches)

    def _optimizer_param_names(self) -> list[list[str]]:
        """Global names of each optimizer's parameters in optimizer order (for re-partitioning)."""
        module = self.lightning_module
        assert module is not None
        canonical = canonical_names([tie for tie, _ in self._ties])
        names = {id(p): canonical.get(n, n) for n, p in module.named_parameters()}
        return [
            [names[id(p)] for g in opt.param_groups for p in g["params"]] for opt in self.optimizers
        ]

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This stage's weights, without tied parameters another stage saves (kept once)."""
        module = self.lightning_module
        assert module is not None
        return owned_state_dict(
            module.state_dict(), [tie for tie, _ in self._ties], self.ranges, self.stage_index
        )
