"""Planner (pure core): partitions, cost model, search and the Plan."""

from lightning_deepcee.planner.partition import (
    balanced_partition,
    check_partition,
    partition_from_sizes,
)

__all__ = ["balanced_partition", "check_partition", "partition_from_sizes"]
