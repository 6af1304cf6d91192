"""Where one rank sits in the running layout: a frozen record of plan + rank.

:class:`Placement` answers, for one global rank, which stage it runs (or that it is idle),
which pipeline replica it belongs to, and whether it writes its stage's checkpoint shard. The
strategy derives it from its plan (or, before set-up makes one, from the manual layout's
arguments) and reads everything about "where am I" from it.
"""

from __future__ import annotations

import dataclasses

from lightning_deepcee.planner import Plan
from lightning_deepcee.runtime.manual_layout import ManualLayout
from lightning_deepcee.runtime.stage import IDLE

__all__ = ["Placement"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """One rank's place in a layout (see the module docstring)."""

    stages: tuple[tuple[int, ...], ...]
    """Global ranks of each stage: one per replica, or a plan's devices of the stage."""
    num_replicas: int
    """Data-parallel pipeline replicas, each reading its own shard of the data (a plan has one:
    devices sharing a stage split every micro-batch by rows instead)."""
    rank: int
    """The global rank this record describes."""
    idle: bool
    """Whether the layout leaves the rank idle (no stage, no compute)."""

    @classmethod
    def of_plan(cls, plan: Plan, rank: int) -> Placement:
        return cls(
            stages=tuple(tuple(stage.ranks) for stage in plan.stages),
            num_replicas=plan.num_replicas,
            rank=rank,
            idle=rank in plan.idle_ranks,
        )

    @classmethod
    def of_manual(cls, manual: ManualLayout, world_size: int, rank: int) -> Placement:
        """The manual layout's arguments, before set-up turns them into a plan."""
        return cls(
            stages=tuple(tuple(ranks) for ranks in manual.placement_for(world_size)),
            num_replicas=world_size // manual.stages(world_size),
            rank=rank,
            idle=False,
        )

    @classmethod
    def of_running(
        cls, plan: Plan | None, manual: ManualLayout, world_size: int, rank: int
    ) -> Placement:
        """In ``plan`` once set-up has made one, else in the manual layout's arguments."""
        if plan is not None:
            return cls.of_plan(plan, rank)
        return cls.of_manual(manual, world_size, rank)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stage_index(self) -> int:
        """The rank's stage; ``IDLE`` (-1) when the layout leaves it idle."""
        return self._where()[0]

    @property
    def replica_index(self) -> int:
        return self._where()[1]

    @property
    def writes_shard(self) -> bool:
        """The first device of each stage holds what a checkpoint shard of the stage saves."""
        return not self.idle and self.stages[self.stage_index][0] == self.rank

    def _where(self) -> tuple[int, int]:
        if self.idle:
            return IDLE, 0
        for stage, ranks in enumerate(self.stages):
            if self.rank in ranks:
                replica = ranks.index(self.rank) if self.num_replicas > 1 else 0
                return stage, replica
        placement = [list(ranks) for ranks in self.stages]
        raise ValueError(f"Rank {self.rank} is in no stage of placement {placement}.")
