"""One rank's part of a Plan: manual layouts as Plans, stage groups, executors, descriptions.

Every layout the strategy runs is a :class:`~lightning_deepcee.planner.Plan`: the planner's, a
saved one, or the manual arguments (``partition``, ``schedule``, ``num_microbatches``,
``num_stages``, ``placement``) turned into one by :func:`manual_plan`. The strategy builds (and
rebuilds, after a re-plan) what a rank runs from that Plan with the functions here: the stage
process groups (:func:`make_stage_groups`), the lowered and validated schedules and their
executors (:func:`build_executors`), and the text printed at setup (:func:`describe`).

torch and torch.distributed; no Lightning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_deepcee._compat import (
    BatchNormBase,
    default_process_group,
    flatten_dense_tensors,
    unflatten_dense_tensors,
)
from lightning_deepcee.planner.partition import (
    balanced_partition,
    check_partition,
    partition_from_sizes,
)
from lightning_deepcee.planner.plan import Plan, StagePlan
from lightning_deepcee.runtime.executor import PipelineExecutor
from lightning_deepcee.runtime.routing import Router, StageLayout
from lightning_deepcee.runtime.stage import PipelineSpec, Stage
from lightning_deepcee.runtime.transport import P2PTransport, all_reduce_
from lightning_deepcee.schedule import SCHEDULE_KINDS, lower, render, validate
from lightning_deepcee.schedule.generators import forward_only

__all__ = [
    "BatchDependentModule",
    "Executors",
    "ManualLayout",
    "batch_dependent_modules",
    "batch_statistics_warning",
    "broadcast_buffers",
    "build_executors",
    "call_with_output",
    "describe",
    "layout_line",
    "make_stage_groups",
    "manual_plan",
    "stage_layouts",
    "sum_gradients",
    "unbound_gloo_default_group",
]

Ranges = list[tuple[int, int]]


@dataclass(frozen=True)
class ManualLayout:
    """The manual layout arguments of ``DeepCEEStrategy``, checked and normalised.

    Unset values default at :func:`manual_plan` time: a partition balancing parameter counts,
    ``1f1b``, 4 micro-batches, one stage per process, stage ``s`` of replica ``d`` on rank
    ``d * S + s``.
    """

    partition: Ranges | None = None
    schedule: str = "1f1b"
    num_microbatches: int = 4
    num_stages: int | None = None
    placement: list[tuple[int, ...]] | None = None

    @classmethod
    def from_arguments(
        cls,
        partition: Sequence[int] | Sequence[Sequence[int]] | None,
        schedule: str | None,
        num_microbatches: int | None,
        num_stages: int | None,
        placement: Sequence[Sequence[int]] | None,
    ) -> ManualLayout:
        """Check the strategy's arguments (before any process exists) and normalise them."""
        schedule = schedule or "1f1b"
        num_microbatches = 4 if num_microbatches is None else num_microbatches
        if schedule not in SCHEDULE_KINDS:
            raise ValueError(
                f"DeepCEEStrategy(schedule={schedule!r}) is unknown; choose one of "
                f"{', '.join(SCHEDULE_KINDS)}."
            )
        if num_microbatches < 1:
            raise ValueError(f"DeepCEEStrategy(num_microbatches={num_microbatches}) must be >= 1.")
        if num_stages is not None and num_stages < 1:
            raise ValueError(f"DeepCEEStrategy(num_stages={num_stages}) must be >= 1.")
        places = _normalise_placement(placement)
        if places is not None:
            if num_stages is not None and num_stages != len(places):
                raise ValueError(
                    f"DeepCEEStrategy(num_stages={num_stages}) disagrees with placement, which "
                    f"has {len(places)} stages."
                )
            num_stages = len(places)
        return cls(_normalise_partition(partition), schedule, num_microbatches, num_stages, places)

    def stages(self, world_size: int) -> int:
        """Pipeline depth: ``num_stages``, else one stage per process."""
        return self.num_stages or world_size

    def placement_for(self, world_size: int) -> list[list[int]]:
        """Global ranks of each stage, one per replica."""
        if self.placement is not None:
            return [list(r) for r in self.placement]
        s = self.stages(world_size)
        d = world_size // s
        return [[r * s + stage for r in range(d)] for stage in range(s)]


def manual_plan(
    layout: ManualLayout,
    *,
    world_size: int,
    block_weights: Sequence[int],
    model_fingerprint: str,
    cluster_fingerprint: str = "",
    global_batch_size: int = 0,
) -> Plan:
    """The Plan of a manual layout (no predictions: ``predicted_step_time_s`` is 0).

    ``block_weights`` (trainable parameters per block) balance the stages when no partition is
    given; no stage may be without them (its optimizer would be empty).
    Raises ``ValueError`` naming the argument when the layout does not fit the world or model.
    """
    num_stages = layout.stages(world_size)
    num_blocks = len(block_weights)
    if world_size % num_stages:
        raise ValueError(
            f"DeepCEEStrategy(num_stages={num_stages}) must divide the number of "
            f"processes ({world_size})."
        )
    placement = layout.placement_for(world_size)
    flat = sorted(r for ranks in placement for r in ranks)
    if flat != list(range(world_size)) or len({len(ranks) for ranks in placement}) != 1:
        raise ValueError(
            f"DeepCEEStrategy(placement={placement}) must list every rank 0.."
            f"{world_size - 1} exactly once, with as many ranks in every stage."
        )
    if num_stages > num_blocks:
        raise ValueError(
            f"DeepCEEStrategy: {num_stages} pipeline stages but configure_pipeline() returns "
            f"only {num_blocks} blocks. Use at most {num_blocks} stages (num_stages or fewer "
            "devices), or split the model into more blocks."
        )
    if layout.partition is None:
        ranges = _balanced_with_parameters(block_weights, num_stages)
    else:
        ranges = list(layout.partition)
        if len(ranges) != num_stages:
            raise ValueError(
                f"DeepCEEStrategy(partition=...) has {len(ranges)} stages but the pipeline has "
                f"{num_stages} (num_stages or number of processes)."
            )
        try:
            check_partition(ranges, num_blocks)
        except ValueError as exc:
            raise ValueError(f"DeepCEEStrategy(partition=...): {exc}") from None
    empty = [s for s, (a, b) in enumerate(ranges) if sum(block_weights[a:b]) == 0]
    if empty:
        a, b = ranges[empty[0]]
        raise ValueError(
            f"DeepCEEStrategy: stage {empty[0]} (blocks {a}..{b - 1}) has no trainable "
            f"parameters, so its optimizer would be empty; partition={[list(r) for r in ranges]}. "
            "Give every stage a block with parameters (merge parameter-free blocks such as "
            "activations into a neighbouring stage), or use fewer stages."
        )
    replicas = len(placement[0])
    batch = max(global_batch_size, layout.num_microbatches * replicas)
    return Plan(
        stages=tuple(
            StagePlan(block_range=r, ranks=tuple(ranks), batch_shares=(1 / replicas,) * replicas)
            for r, ranks in zip(ranges, placement, strict=True)
        ),
        schedule=layout.schedule,
        num_microbatches=layout.num_microbatches,
        global_batch_size=batch,
        predicted_step_time_s=0.0,
        predicted_bubble_ratio=0.0,
        predicted_peak_memory_bytes={},
        model_fingerprint=model_fingerprint,
        cluster_fingerprint=cluster_fingerprint,
        notes="manual layout",
        num_replicas=replicas,
    )


def _balanced_with_parameters(block_weights: Sequence[int], num_stages: int) -> Ranges:
    """Balance parameter counts with every stage holding some: blocks without trainable
    parameters ride with the block before them (the first ones with the first that has some)."""
    units: list[list[int]] = []
    for index, weight in enumerate(block_weights):
        if units and (weight == 0 or sum(block_weights[i] for i in units[-1]) == 0):
            units[-1].append(index)
        else:
            units.append([index])
    if len(units) < num_stages:  # too few parameter-holding blocks: let the check below say so
        return balanced_partition([w + 1 for w in block_weights], num_stages)
    weights = [sum(block_weights[i] for i in unit) + 1 for unit in units]
    return [(units[a][0], units[b - 1][-1] + 1) for a, b in balanced_partition(weights, num_stages)]


def stage_layouts(plan: Plan, rank: int) -> list[StageLayout]:
    """The pipeline ``rank`` belongs to: per stage, its devices and their row shares."""
    if plan.num_replicas > 1:
        d = plan.replica_of(rank)
        return [StageLayout((st.ranks[d],), (1.0,)) for st in plan.stages]
    return [StageLayout(st.ranks, st.batch_shares) for st in plan.stages]


@contextmanager
def unbound_gloo_default_group() -> Iterator[None]:
    """Create gloo subgroups as if the default group were bound to no device.

    Lightning binds the default group to the rank's GPU (``device_id``) whatever the backend,
    and ``new_group`` then splits subgroups from it; a rank outside a new group calls
    ``perform_nocolor_split``, which gloo does not have (``AttributeError`` on a GPU rank of a
    mixed GPU/CPU cluster). Gloo creates subgroups without splitting, so the binding is lifted
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


def make_stage_groups(placement: Sequence[Sequence[int]], stage_index: int) -> Any:
    """Create every shared stage's process group (collective: all ranks, same order); return
    this rank's (``None`` when its stage has one device)."""
    mine = None
    with unbound_gloo_default_group():
        for s, ranks in enumerate(placement):
            group = dist.new_group(list(ranks)) if len(ranks) > 1 else None
            if s == stage_index:
                mine = group
    return mine


@dataclass(frozen=True)
class Executors:
    """A rank's executors for training, evaluation and prediction."""

    train: PipelineExecutor
    evaluation: PipelineExecutor
    prediction: PipelineExecutor


def build_executors(
    plan: Plan,
    *,
    num_microbatches: int,
    stage: Stage,
    spec: PipelineSpec,
    rank: int,
    device: torch.device,
    receive_ahead: bool,
    measure_saved: bool = False,
) -> Executors:
    """Lower and validate the plan's schedule for ``num_microbatches``, then build executors.

    The schedule is per stage; devices sharing a stage run the same list, and the router
    expands each transfer into the row pieces exchanged with the neighbouring devices.
    ``measure_saved``: the training executor reports ``StepStats.peak_saved_bytes``.
    """
    num_stages = plan.num_stages
    placement = {s: s for s in range(num_stages)}
    common: dict[str, Any] = dict(
        stage=stage,
        transport=P2PTransport(device, prefetch=receive_ahead),
        router=Router(stage_layouts(plan, rank), stage.stage_index, rank),
        loss_fn=spec.loss_fn,
        input_fn=spec.input_fn,
        metrics_fn=spec.metrics_fn,
        rank=rank,
    )
    m = num_microbatches
    train = lower(plan.stage_schedule(m), placement)
    validate(train, placement, m)
    evaluation = lower(forward_only(num_stages, m), placement)
    validate(evaluation, placement, m, require_backward=False)
    return Executors(
        train=PipelineExecutor(
            actions=train[stage.stage_index], measure_saved=measure_saved, **common
        ),
        evaluation=PipelineExecutor(actions=evaluation[stage.stage_index], **common),
        prediction=PipelineExecutor(
            actions=evaluation[stage.stage_index], keep_outputs=True, **common
        ),
    )


def call_with_output(
    module: torch.nn.Module,
    output: Any,
    batch: Any,
    input_fn: Callable[[Any], Any],
    step: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Call ``step`` (the module's own ``predict_step``) with ``output`` standing in for what
    ``module(...)`` returns on the batch: ``self(batch)`` or ``self(input_fn(batch))`` gives the
    pipeline's output; calling it on anything else raises, since only that ran."""
    expected = input_fn(batch)

    def forward(*f_args: Any, **f_kwargs: Any) -> Any:
        x = f_args[0] if f_args else next(iter(f_kwargs.values()), None)
        same = x is batch or x is expected
        if not same and isinstance(x, torch.Tensor) and isinstance(expected, torch.Tensor):
            same = x.shape == expected.shape and bool(torch.equal(x, expected))
        if not same:
            raise ValueError(
                f"DeepCEEStrategy.predict: {type(module).__name__}.predict_step called the model "
                "on something other than the batch's input; under the pipeline only the model "
                "on input_fn(batch) ran. Call self(batch) or self(input_fn(batch)) once, or "
                "predict with the consolidated plain module (deepcee consolidate)."
            )
        return output

    module.forward = forward
    try:
        return step(*args, **kwargs)
    finally:
        del module.forward


def layout_line(plan: Plan, num_microbatches: int) -> str:
    """``[0, 3) on 0 | [3, 6) on 1,2 (0.50,0.50); 1f1b, 2 micro-batches`` for the logs."""
    parts = []
    for st in plan.stages:
        a, b = st.block_range
        part = f"[{a}, {b}) on {','.join(str(r) for r in st.ranks)}"
        if len(st.ranks) > 1 and plan.num_replicas == 1:
            part += " (" + ",".join(f"{x:.2f}" for x in st.batch_shares) + ")"
        parts.append(part)
    return " | ".join(parts) + f"; {plan.schedule}, {num_microbatches} micro-batches"


def describe(plan: Plan, spec: PipelineSpec, num_microbatches: int) -> str:
    """The partition and schedule, as printed at setup."""
    blocks = list(spec.blocks)
    lines = [
        f"DeepCEEStrategy: {plan.num_stages} stages x {plan.num_replicas} replica(s), "
        f"schedule {plan.schedule}, {num_microbatches} micro-batches",
        "  stage | blocks      | ranks        | parameters",
    ]
    for s, st in enumerate(plan.stages):
        a, b = st.block_range
        n = sum(p.numel() for blk in blocks[a:b] for p in blk.parameters())
        ranks = ",".join(str(r) for r in st.ranks)
        lines.append(f"  {s:>5} | [{a:>3}, {b:>3}) | {ranks:<12} | {n:,}")
    placement = {s: s for s in range(plan.num_stages)}
    lines.append("  schedule (stage | actions):")
    grid = render(lower(plan.stage_schedule(num_microbatches), placement), compute_only=True)
    lines.extend("    " + line for line in grid.splitlines())
    return "\n".join(lines)


def sum_gradients(params: Sequence[torch.nn.Parameter], group: Any) -> None:
    """Sum the stage's gradients over the devices sharing it: one flat all-reduce per dtype.

    A device that held no rows this step has no gradients; it contributes zeros, so every
    device of the group calls the same collectives.
    """
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for group_params in by_dtype.values():
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group_params]
        flat = flatten_dense_tensors(grads)
        all_reduce_(flat, group=group)
        for p, g in zip(group_params, unflatten_dense_tensors(flat, grads), strict=True):
            p.grad = g


@dataclass(frozen=True)
class BatchDependentModule:
    """A module whose output depends on the other samples of its batch (BatchNorm)."""

    block_index: int
    name: str
    """Qualified name inside its block (``""``: the block itself)."""
    kind: str
    module: torch.nn.Module


def batch_dependent_modules(blocks: Sequence[torch.nn.Module]) -> list[BatchDependentModule]:
    """Every batch-statistics normalisation inside ``blocks`` (BatchNorm of any dimension)."""
    return [
        BatchDependentModule(index, name, type(module).__name__, module)
        for index, block in enumerate(blocks)
        for name, module in block.named_modules()
        if isinstance(module, BatchNormBase)
    ]


def batch_statistics_warning(
    found: Sequence[BatchDependentModule], plan: Plan, num_microbatches: int, model: str
) -> str | None:
    """The setup warning when BatchNorm cannot match one device on the whole batch, or None.

    It matches only when every batch reaches each such module whole: one micro-batch, and one
    device (one replica) per stage.
    """
    if not found or (num_microbatches == 1 and all(len(st.ranks) == 1 for st in plan.stages)):
        return None
    where = ", ".join(
        f"block {m.block_index} ({m.name + ', ' if m.name else ''}{m.kind})" for m in found[:4]
    )
    more = f" and {len(found) - 4} more" if len(found) > 4 else ""
    return (
        f"DeepCEEStrategy: {model} normalises over the batch in {where}{more}. Under this "
        f"layout ({num_microbatches} micro-batch(es); stages shared by "
        f"{max(len(st.ranks) for st in plan.stages)} device(s)) each micro-batch, or each "
        "device's rows of it, is normalised with its own statistics, so outputs and gradients "
        "differ from one device on the whole batch, and the running statistics are updated once "
        "per piece (num_batches_tracked counts pieces). Devices sharing a stage keep identical "
        "running statistics (the first device's are broadcast after each step, as DDP does). "
        "For exact results replace BatchNorm by GroupNorm or LayerNorm, or train with "
        "num_microbatches=1 and one device per stage."
    )


def broadcast_buffers(buffers: Sequence[torch.Tensor], src: int, group: Any) -> None:
    """Give every device of a shared stage the ``src`` device's buffers (running statistics)."""
    for buffer in buffers:
        dist.broadcast(buffer, src=src, group=group)


def _normalise_partition(
    partition: Sequence[int] | Sequence[Sequence[int]] | None,
) -> Ranges | None:
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
