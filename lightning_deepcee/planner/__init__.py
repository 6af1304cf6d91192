"""Planner (pure core): partitions, cost model, evaluator, search and the Plan.

Every module here is pure: numpy and the standard library (no torch, no lightning); the layering
test (``tests/unit/test_layering.py``) keeps it so.
"""

from lightning_deepcee.planner.cost_model import (
    allreduce_time_s,
    in_flight_microbatches,
    predict,
    predict_plan,
    speed_shares,
    stage_costs,
    transfer_time_s,
)
from lightning_deepcee.planner.evaluator import Evaluator
from lightning_deepcee.planner.partition import (
    balanced_partition,
    check_partition,
    heterogeneous_partition,
    partition_from_sizes,
)
from lightning_deepcee.planner.plan import Plan, StagePlan
from lightning_deepcee.planner.prediction import CostModelConfig, Prediction
from lightning_deepcee.planner.search import DEVICE_GAIN, baseline_plans, make_plan, plan_search

__all__ = [
    "DEVICE_GAIN",
    "CostModelConfig",
    "Evaluator",
    "Plan",
    "Prediction",
    "StagePlan",
    "allreduce_time_s",
    "balanced_partition",
    "baseline_plans",
    "check_partition",
    "heterogeneous_partition",
    "in_flight_microbatches",
    "make_plan",
    "partition_from_sizes",
    "plan_search",
    "predict",
    "predict_plan",
    "speed_shares",
    "stage_costs",
    "transfer_time_s",
]
