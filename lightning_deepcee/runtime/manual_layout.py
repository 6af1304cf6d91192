"""Manual layouts as Plans: the ``partition``, ``schedule``, ``num_microbatches``, ``num_stages``
and ``placement`` arguments of ``DeepCEEStrategy``, checked and turned into a
:class:`~lightning_deepcee.planner.Plan` by :func:`manual_plan` (every layout the strategy runs is
a Plan: the planner's, a saved one, or this).

No torch: plain checks and the planner's partition helpers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_deepcee.planner.partition import (
    balanced_partition,
    check_partition,
    partition_from_sizes,
)
from lightning_deepcee.planner.plan import Plan, StagePlan
from lightning_deepcee.schedule import SCHEDULE_KINDS

__all__ = ["ManualLayout", "manual_plan"]

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
