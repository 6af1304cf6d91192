"""This rank's part of the running plan: the built stage, its executors and its process groups.

:class:`PipelineStagePart` is the part of ``DeepCEEStrategy`` that holds what one rank runs of a
:class:`~lightning_deepcee.planner.Plan`: the model's pipeline spec and tied parameters
(:meth:`~PipelineStagePart.adopt`), the split stage, the stage and tie process groups and the
executors (:meth:`~PipelineStagePart.build`, the one path used by setup, re-plan, resume and the
plan trial), the training state moved between layouts (:meth:`~PipelineStagePart.relayout`), and
the one step function of training, evaluation, prediction and the plan trial
(:meth:`~PipelineStagePart.run`). What Lightning owns (the optimizers, the precision plugin,
moving the module to the device) stays with the strategy, which passes it in.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_deepcee.planner import Plan
from lightning_deepcee.profiler import ClusterProfile
from lightning_deepcee.runtime import (
    PipelineExecutor,
    PipelineSpec,
    Stage,
    batch_size_of,
    build_stage,
    get_pipeline_spec,
    split_batch,
    split_sizes,
)
from lightning_deepcee.runtime.batch_statistics import batch_dependent_modules
from lightning_deepcee.runtime.checkpoint import repartition, shard_part
from lightning_deepcee.runtime.executors import Executors, build_executors
from lightning_deepcee.runtime.grad_buckets import BucketedGradSync, bucket_bytes_for
from lightning_deepcee.runtime.layout_text import describe
from lightning_deepcee.runtime.relayout import Route, move_shards, routes
from lightning_deepcee.runtime.stage import TiedParameter, tied_parameters
from lightning_deepcee.runtime.stage_groups import make_stage_groups
from lightning_deepcee.runtime.ties import (
    TieGroup,
    broadcast_initial_weights,
    canonical_names,
    make_tie_groups,
    owned_state_dict,
    sync_copies,
    tied_names_to_fill,
)
from lightning_deepcee.runtime.transport import TransferRecord, all_reduce_
from lightning_deepcee.runtime.values import cat_values
from lightning_deepcee.strategy.placement import Placement

__all__ = ["STEP_KINDS", "PipelineStagePart"]

STEP_KINDS = ("train", "eval", "predict")
"""What :meth:`PipelineStagePart.run` runs: a training step (also the plan trial's), an
evaluation step, a prediction step."""
ShardSource = Callable[[], dict[str, Any]]
"""Gives this stage's part of the training state (a checkpoint shard) when called."""


class PipelineStagePart:
    """What this rank runs of the running plan (see the module docstring)."""

    def __init__(self, *, num_microbatches: int, receive_ahead: bool) -> None:
        self.num_microbatches = num_microbatches
        """Micro-batches per step now: the plan's, until the adapter re-splits."""
        self.receive_ahead = receive_ahead
        """Post every receive of a step when it starts (``DeepCEEStrategy(receive_ahead=...)``)."""
        self.plan: Plan | None = None
        """The built layout (every layout is a Plan; a manual one has no predictions)."""
        self.spec: PipelineSpec | None = None
        """The whole model's pipeline (``configure_pipeline``), set by :meth:`adopt`."""
        self.stage: Stage | None = None
        """This rank's blocks of the built plan."""
        self.ranges: list[tuple[int, int]] = []
        """Block range of every stage of the built plan."""
        self.ties: list[tuple[TiedParameter, torch.nn.Parameter]] = []
        """Parameters several blocks use, with the parameter object (found on the unsplit
        module)."""
        self._module: torch.nn.Module | None = None
        self._block_names: list[str] = []
        """Qualified name of every block in the unsplit module, so a rebuild can put back the
        blocks that ``build_stage`` replaced by ``nn.Identity``."""
        self._split_module: torch.nn.Module | None = None
        """The module whose blocks ``build_stage`` split (a second setup of it restores them)."""
        self._stage_group: Any = None
        self._tie_groups: list[TieGroup] = []
        """This rank's tied parameters that span stages, with the group of their holders."""
        self._grad_buckets: BucketedGradSync | None = None
        """The stage copies' gradient sum, bucketed and started during the last backward."""
        self._synced_buffers: list[torch.Tensor] = []
        """Running statistics of this stage's BatchNorm modules, kept equal across its devices."""
        self._executors: Executors | None = None
        self._rank = 0
        self._device = torch.device("cpu")
        self._forward_context: Callable[[], AbstractContextManager[Any]] | None = None

    # ------------------------------------------------------------------------------ build
    def adopt(self, module: torch.nn.Module) -> None:
        """Take ``module``'s pipeline spec, block names and tied parameters (setup). A second
        setup of the module already split (validate/test after fit) puts its blocks back and
        keeps the spec of the whole model."""
        self._module = module
        if self._split_module is module and self.spec is not None:
            self.restore_blocks()
            return
        self.spec = get_pipeline_spec(module)
        qualified = {id(m): name for name, m in module.named_modules()}
        self._block_names = [qualified[id(block)] for block in self.spec.blocks]
        self.ties = [
            (tie, module.get_parameter(tie.names[0]))
            for tie in tied_parameters(module, self.spec.blocks)
        ]

    @property
    def where(self) -> Placement:
        """Where this rank sits in the built plan."""
        assert self.plan is not None
        return Placement.of_plan(self.plan, self._rank)

    def build(
        self,
        plan: Plan,
        *,
        rank: int,
        device: torch.device,
        place: Callable[[], None],
        fresh: bool,
        forward_context: Callable[[], AbstractContextManager[Any]],
        profile: ClusterProfile | None = None,
    ) -> None:
        """Build (or rebuild) this rank's part of ``plan`` on the adopted module. Collective.

        Re-creates the stage and tie process groups, splits the module for the plan's ranges,
        moves the blocks this rank does not run off the accelerator, calls ``place`` (the
        strategy puts the module on its device under its precision), gives the devices sharing
        a stage or a tied parameter the same initial weights when ``fresh`` (no state is loaded
        after), and lowers, validates and wraps the schedule in executors. The stage copies'
        gradient sum is bucketed for the links of ``profile`` (when measured) between them
        (:mod:`~lightning_deepcee.runtime.grad_buckets`).
        """
        module, spec = self._module, self.spec
        assert module is not None and spec is not None
        self.plan, self._rank, self._device = plan, rank, device
        self._forward_context = forward_context
        self.num_microbatches = plan.num_microbatches
        self.ranges = [st.block_range for st in plan.stages]
        where = self.where
        placement = [list(ranks) for ranks in where.stages]
        old_groups = [self._stage_group, *(t.group for t in self._tie_groups)]
        self._stage_group = make_stage_groups(placement, where.stage_index)
        self._tie_groups = make_tie_groups(self.ties, self.ranges, placement, where.stage_index)
        for old in old_groups:
            if old is not None:
                # Every rank has passed the collective new_group calls: nothing is in flight.
                dist.destroy_process_group(old)
        self.stage = build_stage(module, spec, self.ranges, where.stage_index)
        self._split_module = module
        start, end = self.stage.block_range
        self._synced_buffers = [
            buffer
            for found in batch_dependent_modules(spec.blocks)
            if start <= found.block_index < end
            for buffer in found.module.buffers(recurse=False)
        ]
        self._park_other_blocks()
        place()
        if fresh and not where.idle:
            broadcast_initial_weights(
                self.stage.blocks, placement[where.stage_index], self._stage_group, self._tie_groups
            )
        self._grad_buckets = None
        if self._stage_group is not None:
            tied = {id(t.parameter) for t in self._tie_groups}
            untied = [p for p in self.stage.parameters() if id(p) not in tied]
            bucket_bytes = bucket_bytes_for(profile, placement[where.stage_index])
            self._grad_buckets = BucketedGradSync(
                untied, self._stage_group, bucket_bytes=bucket_bytes
            )
        self._build_executors()

    def norm_shares(self) -> tuple[float, dict[int, float]]:
        """The share of this stage's gradient norm each device counts (every device of a stage
        holds the same all-reduced gradient: the global-norm clip counts each stage once), and
        the share of each tied parameter's (by ``id``)."""
        where = self.where
        devices = 1 if where.idle else len(where.stages[where.stage_index])
        return 1.0 / devices, {id(t.parameter): 1.0 / len(t.ranks) for t in self._tie_groups}

    def _build_executors(self) -> None:
        assert self.stage is not None and self.spec is not None and self.plan is not None
        if self.where.idle:
            self._executors = None
            return
        self._executors = build_executors(
            self.plan,
            num_microbatches=self.num_microbatches,
            stage=self.stage,
            spec=self.spec,
            rank=self._rank,
            device=self._device,
            receive_ahead=self.receive_ahead,
        )

    def set_num_microbatches(self, num_microbatches: int) -> None:
        """Use ``num_microbatches`` from the next step on (all ranks together)."""
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        if num_microbatches != self.num_microbatches:
            self.num_microbatches = num_microbatches
            self._build_executors()

    def release_groups(self) -> None:
        """Drop every reference to this layout's process groups and executors (a lost device:
        the groups are destroyed next, and a group's sockets close only once nothing holds
        it); :meth:`build` makes new ones."""
        self._executors, self._grad_buckets = None, None
        self._stage_group, self._tie_groups = None, []

    def restore_blocks(self) -> None:
        """Put every original block back into the module (undo ``build_stage``)."""
        module, spec = self._module, self.spec
        assert module is not None and spec is not None
        for name, block in zip(self._block_names, spec.blocks, strict=True):
            parent_name, _, attr = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, attr, block)

    @contextmanager
    def whole_model(self) -> Iterator[None]:
        """Every block back in the module for the duration, then this rank's split again (for
        views of the whole model, such as Lightning's model summary; no collectives)."""
        module, spec = self._module, self.spec
        if module is None or spec is None or self.stage is None:
            yield
            return
        self.restore_blocks()
        try:
            yield
        finally:
            build_stage(module, spec, self.ranges, self.where.stage_index)

    def _park_other_blocks(self) -> None:
        """Blocks this rank no longer runs keep their objects (a later re-plan puts them back
        and overwrites their weights) but free the accelerator: host memory, no gradients."""
        assert self.spec is not None and self.stage is not None
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
            if self._device.type != "cpu" and not shared:
                block.to("cpu")

    # --------------------------------------------------------------------- training state
    def relayout(
        self, source: Plan, shard_of: ShardSource, plan: Plan, world_size: int
    ) -> tuple[list[dict[str, Any]], float]:
        """Move the training state from ``source`` towards ``plan``. Collective.

        The ranks first agree on ``plan`` (a digest of it, gathered: unequal plans raise on
        every rank, before anything moves); then each rank of ``plan`` receives, point to
        point, the shards of the ``source`` stages that held its new blocks (the first device
        of each such stage sends ``shard_of()``), and the blocks ``build_stage`` replaced are
        put back. Returns the received shards in stage order and the bytes sent by all ranks;
        :meth:`build` with the shards follows.
        """
        digest = hashlib.sha256(json.dumps(plan.to_dict(), sort_keys=True).encode()).hexdigest()
        gathered: list[Any] = [None] * world_size
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
            tied_blocks=[tie.blocks for tie, _ in self.ties],
        )
        sends = any(m.src == self._rank for m in moves)
        shard = shard_of() if sends else None
        received, sent = move_shards(moves, self._rank, shard, self._device, select=self._part_of)
        figures = torch.tensor([float(sent)], dtype=torch.float64, device=self._device)
        all_reduce_(figures)
        self.restore_blocks()
        return [received[stage] for stage in sorted(received)], figures.item()

    def _part_of(self, shard: dict[str, Any], move: Route) -> dict[str, Any]:
        """What ``move``'s receiver needs of ``shard``: the entries of its new blocks, of the
        tied parameters they use, and of anything outside every block."""
        start, end = move.blocks
        mine = tuple(f"{name}." for name in self._block_names[start:end])
        every = tuple(f"{name}." for name in self._block_names)
        tied = {n for tie, _ in self.ties if any(start <= b < end for b in tie.blocks)
                for n in tie.names}  # fmt: skip

        def keep(name: str) -> bool:
            return name.startswith(mine) or name in tied or not name.startswith(every)

        return shard_part(shard, keep)

    def repartitioned(
        self, shards: list[dict[str, Any]], optimizers: Sequence[torch.optim.Optimizer]
    ) -> dict[str, Any]:
        """This rank's training state rebuilt from every stage's shard (re-plan and resume)."""
        assert self._module is not None
        fresh = [opt.state_dict() for opt in optimizers]
        return repartition(
            shards,
            list(self._module.state_dict().keys()),
            list(zip(fresh, self.optimizer_param_names(optimizers), strict=True)),
            tied=[tie.names for tie, _ in self.ties],
        )

    def optimizer_param_names(self, optimizers: Sequence[torch.optim.Optimizer]) -> list[list[str]]:
        """Global names of each optimizer's parameters in optimizer order (for re-partitioning)."""
        assert self._module is not None
        canonical = canonical_names([tie for tie, _ in self.ties])
        names = {id(p): canonical.get(n, n) for n, p in self._module.named_parameters()}
        return [[names[id(p)] for g in opt.param_groups for p in g["params"]] for opt in optimizers]

    def owned_state_dict(self, state_dict: dict[str, Any], stage_index: int) -> dict[str, Any]:
        """``state_dict`` without tied parameters another stage saves (kept once)."""
        return owned_state_dict(state_dict, [tie for tie, _ in self.ties], self.ranges, stage_index)

    def tied_names_to_fill(self, stage_index: int) -> dict[int, list[str]]:
        """Tied parameters this stage loads from the stage that saved them (checkpoint load):
        ``{owner stage: [local names]}``."""
        assert self._module is not None
        return tied_names_to_fill(
            list(self._module.state_dict()), [tie for tie, _ in self.ties], self.ranges, stage_index
        )

    # ----------------------------------------------------------------------------- a step
    def executor(self, kind: str) -> PipelineExecutor | None:
        """The executor of ``kind`` (one of :data:`STEP_KINDS`); ``None`` on an idle rank."""
        if self._executors is None:
            return None
        return {
            "train": self._executors.train,
            "eval": self._executors.evaluation,
            "predict": self._executors.prediction,
        }[kind]

    def run(self, kind: str, batch: Any) -> torch.Tensor | None:
        """This rank's part of one pipeline step on ``batch``: the one step function of
        training (``"train"``, also the plan trial's), evaluation (``"eval"``) and prediction
        (``"predict"``, whose outputs stay in the executor's ``last_outputs``).

        The batch is split into the running number of micro-batches and the lowered schedule
        runs under the precision plugin's forward context. Each rank weights its rows by rows /
        (samples of the step over all replicas), so the sums of the loss and of the stage
        gradients are whole-step means; prediction weights by this replica's batch. Returns this
        rank's share of the loss, ``None`` on a rank the plan leaves idle (no executor).
        """
        executor = self.executor(kind)
        if executor is None:
            return None
        assert self._forward_context is not None
        total = batch_size_of(batch)
        micro = split_batch(batch, split_sizes(total, self.num_microbatches))
        weight = total if kind == "predict" else total * self.where.num_replicas
        arm = self._grad_buckets.arm if kind == "train" and self._grad_buckets else None
        return executor.run(
            micro, weight, forward_context=self._forward_context, before_last_backward=arm
        )

    def sync_copies(self) -> float:
        """After a training step's schedule: sum the gradients of this stage's copies (devices
        sharing the stage) and of tied parameters across stages, and keep batch statistics
        equal; returns the seconds it took (0 when no copy lives elsewhere)."""
        if self._stage_group is None and not self._tie_groups:
            return 0.0
        assert self.stage is not None
        began = time.perf_counter()
        where = self.where
        sync_copies(
            self.stage.parameters(),
            self._stage_group,
            self._tie_groups,
            self._synced_buffers,
            where.stages[where.stage_index][0],
            self._grad_buckets,
        )
        return time.perf_counter() - began

    def set_aside_gradients(self) -> list[torch.Tensor | None]:
        """The stage's gradients (with ``accumulate_grad_batches`` > 1, the earlier batches'
        sum), cleared so that a step's schedule leaves this batch's alone."""
        assert self.stage is not None
        params = self.stage.parameters()
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        return held

    def swap_gradients(self, held: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """This step's gradients, with ``held`` (:meth:`set_aside_gradients`) put back."""
        assert self.stage is not None
        params = self.stage.parameters()
        step = [p.grad for p in params]
        for p, g in zip(params, held, strict=True):
            p.grad = g
        return step

    def add_gradients(self, step: list[torch.Tensor | None], accumulate: int) -> None:
        """Add a step's gradients, divided by ``accumulate`` (Lightning divides the loss by
        ``accumulate_grad_batches``), to what the stage's parameters hold."""
        assert self.stage is not None
        for p, g in zip(self.stage.parameters(), step, strict=True):
            if g is not None:
                g = g if accumulate == 1 else g / accumulate
                p.grad = g if p.grad is None else p.grad + g

    @property
    def transfer_records(self) -> list[TransferRecord]:
        """This rank's transfers of the last training step (peer, bytes, seconds, direction)."""
        executor = self.executor("train")
        return [] if executor is None else list(executor.transport.records)

    def gathered_output(self, world_size: int) -> Any:
        """The last stage's output (a block value) of the last prediction step, for this
        replica's whole batch, on every rank. Collective."""
        assert self.plan is not None
        executor = self.executor("predict")  # an idle rank has nothing to add
        mine = [] if executor is None else executor.last_outputs
        plan, replica = self.plan, self.where.replica_index
        parts: list[Any] = [None] * world_size
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
        return apply_to_collection(whole, torch.Tensor, lambda t: t.to(self._device))

    def describe(self) -> str:
        """The partition and schedule, as printed at setup."""
        assert self.spec is not None and self.plan is not None
        return describe(self.plan, self.spec, self.num_microbatches)
