"""Schedule IR (pure core): actions, generators, lowering, validation, simulation and rendering.

Nothing here imports torch.distributed or Lightning.
"""

from lightning_deepcee.schedule.actions import (
    Action,
    ActionKind,
    format_actions,
    parse_action,
    parse_actions,
)
from lightning_deepcee.schedule.compact import (
    COST_AWARE_SCHEDULE_KINDS,
    compact_zero_bubble,
    generate_for_costs,
)
from lightning_deepcee.schedule.generators import (
    SCHEDULE_KINDS,
    StageSchedule,
    generate,
    gpipe,
    one_f_one_b,
    zb_h1,
)
from lightning_deepcee.schedule.lowering import RankSchedule, lower
from lightning_deepcee.schedule.render import render
from lightning_deepcee.schedule.simulate import SimEvent, SimulationResult, StageCosts, simulate
from lightning_deepcee.schedule.timeline import plot_timeline
from lightning_deepcee.schedule.validate import ScheduleError, validate

__all__ = [
    "COST_AWARE_SCHEDULE_KINDS",
    "SCHEDULE_KINDS",
    "Action",
    "ActionKind",
    "RankSchedule",
    "ScheduleError",
    "SimEvent",
    "SimulationResult",
    "StageCosts",
    "StageSchedule",
    "compact_zero_bubble",
    "format_actions",
    "generate",
    "generate_for_costs",
    "gpipe",
    "lower",
    "one_f_one_b",
    "parse_action",
    "parse_actions",
    "plot_timeline",
    "render",
    "simulate",
    "validate",
    "zb_h1",
]
