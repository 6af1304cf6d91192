"""Lowering: map stages to ranks and insert the point-to-point transfers.

Given compute actions per stage and a ``stage -> rank`` map, :func:`lower` produces the per-rank
action lists the executor runs. A receive is placed immediately before the compute action that
needs it and a send immediately after the action that produced the tensor; sends are asynchronous
in the runtime, receives block, so the order of compute actions alone decides whether the schedule
can deadlock (which :func:`~lightning_deepcee.schedule.validate.validate` checks).
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning_deepcee.schedule.actions import Action, ActionKind
from lightning_deepcee.schedule.generators import StageSchedule

__all__ = ["RankSchedule", "lower"]

RankSchedule = dict[int, list[Action]]
"""Lowered actions per rank, in execution order."""


def lower(schedule: StageSchedule, stage_to_rank: Mapping[int, int]) -> RankSchedule:
    """Insert SEND/RECV actions for the given stage placement and merge stages per rank.

    Transfers between two stages on the same rank are not inserted (the runtime hands the tensor
    over locally). Stages placed on one rank are interleaved in the order given by ``schedule``
    (stage by stage); a multi-stage-per-rank placement should come with a schedule that already
    orders such ranks, which none of the built-in generators need.
    """
    num_stages = len(schedule)
    if sorted(schedule) != list(range(num_stages)):
        raise ValueError(f"Stages must be 0..{num_stages - 1}, got {sorted(schedule)}")
    missing = [s for s in range(num_stages) if s not in stage_to_rank]
    if missing:
        raise ValueError(f"stage_to_rank has no rank for stages {missing}")
    last = num_stages - 1
    out: RankSchedule = {r: [] for r in sorted(set(stage_to_rank[s] for s in range(num_stages)))}

    def remote(a: int, b: int) -> bool:
        return stage_to_rank[a] != stage_to_rank[b]

    for stage in range(num_stages):
        acts = out[stage_to_rank[stage]]
        for action in schedule[stage]:
            s, kind, mb = action.stage, action.kind, action.microbatch
            if kind == ActionKind.F and s > 0 and remote(s, s - 1):
                acts.append(Action(s, ActionKind.RECV_F, mb))
            if kind in (ActionKind.B, ActionKind.BW) and s < last and remote(s, s + 1):
                acts.append(Action(s, ActionKind.RECV_B, mb))
            acts.append(action)
            if kind == ActionKind.F and s < last and remote(s, s + 1):
                acts.append(Action(s, ActionKind.SEND_F, mb))
            if kind in (ActionKind.B, ActionKind.BW) and s > 0 and remote(s, s - 1):
                acts.append(Action(s, ActionKind.SEND_B, mb))
    return out
