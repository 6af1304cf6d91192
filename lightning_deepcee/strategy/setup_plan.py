"""The planning step of ``DeepCEEStrategy`` set-up: the layout the first build runs.

A function of explicit inputs that returns the plan (and, for a searched plan, the search's
other best plans, which the plan trial times): a saved plan checked against the model and the
cluster, the search's plan on the profile, or the manual layout's arguments as a plan.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_deepcee.planner import Plan
from lightning_deepcee.profiler import ClusterProfile
from lightning_deepcee.runtime.manual_layout import ManualLayout, manual_plan
from lightning_deepcee.runtime.measure import model_fingerprint
from lightning_deepcee.runtime.spread_search import spread_plan_search

__all__ = ["initial_plan"]


def initial_plan(
    plan_arg: str | None,
    *,
    manual: ManualLayout,
    blocks: Sequence[torch.nn.Module],
    world_size: int,
    cluster_profile: ClusterProfile | None,
    global_batch_size: int,
    device_gain: float,
    running: Plan | None = None,
) -> tuple[Plan, list[Plan] | None]:
    """The layout set-up builds and, when it was searched (``plan_arg == "auto"``), rank 0's
    alternatives for the plan trial (``None`` otherwise). ``plan_arg``: ``None`` for the manual
    layout, ``"auto"`` to search on ``cluster_profile`` (all ranks: the search is spread over
    them), else a saved plan's path. Prints the plan unless it is the manual layout's.
    ``running``: the layout that trained, which validate/test after fit keep (re-planned or
    not); ``None`` while fitting."""
    if running is not None:
        return running, None
    fingerprint = model_fingerprint(list(blocks))
    cluster = cluster_profile.cluster_fingerprint if cluster_profile else None
    if plan_arg is None:
        plan = manual_plan(
            manual,
            world_size=world_size,
            block_weights=[
                sum(p.numel() for p in b.parameters() if p.requires_grad) for b in blocks
            ],
            model_fingerprint=fingerprint,
            cluster_fingerprint=cluster or "",
            global_batch_size=global_batch_size,
        )
        return plan, None
    alternatives: list[Plan] | None = None
    if plan_arg != "auto":
        plan = Plan.from_json(str(plan_arg))
        plan.check_matches(len(blocks), world_size, fingerprint, cluster)
    else:
        if cluster_profile is None:
            raise ValueError(
                "DeepCEEStrategy plans automatically while fitting; for validate/test "
                "pass plan='plan.json' or a manual layout."
            )
        alternatives = []  # rank 0's, for the plan trial
        plan = spread_plan_search(
            cluster_profile,
            num_blocks=len(blocks),
            global_batch_size=global_batch_size,
            device_gain=device_gain,
            alternatives=alternatives,
        )
    rank_zero_info("DeepCEE plan:\n" + plan.format_table())
    return plan, alternatives
