"""Manual layouts become Plans (runtime.manual_layout.manual_plan): one shape for every layout."""

from __future__ import annotations

import pytest

from lightning_deepcee.planner import Plan
from lightning_deepcee.runtime.executors import stage_layouts
from lightning_deepcee.runtime.manual_layout import ManualLayout, manual_plan


def _plan(layout: ManualLayout, world_size: int, blocks: int = 6) -> Plan:
    return manual_plan(
        layout, world_size=world_size, block_weights=[10] * blocks, model_fingerprint="m"
    )


def test_defaults_make_one_balanced_stage_per_process() -> None:
    plan = _plan(ManualLayout(), world_size=3)
    assert [st.block_range for st in plan.stages] == [(0, 2), (2, 4), (4, 6)]
    assert [st.ranks for st in plan.stages] == [(0,), (1,), (2,)]
    assert (plan.schedule, plan.num_microbatches, plan.num_replicas) == ("1f1b", 4, 1)
    assert plan.predicted_step_time_s == 0.0 and plan.notes == "manual layout"
    assert Plan.from_dict(plan.to_dict()) == plan


def test_replicas_and_placement_become_a_plan_with_one_rank_per_replica() -> None:
    layout = ManualLayout.from_arguments([2, 4], "zb-h1", 3, None, [[3, 1], [0, 2]])
    plan = _plan(layout, world_size=4)
    assert plan.num_replicas == 2 and plan.schedule == "zb-h1"
    assert [st.block_range for st in plan.stages] == [(0, 2), (2, 6)]
    assert [st.ranks for st in plan.stages] == [(3, 1), (0, 2)]
    assert plan.replica_of(1) == 1 and plan.replica_of(0) == 0 and plan.stage_of(3) == 0
    # Replica 1's pipeline: rank 1 then rank 2, each alone in its stage.
    assert [(lay.ranks, lay.shares) for lay in stage_layouts(plan, 2)] == [
        ((1,), (1.0,)),
        ((2,), (1.0,)),
    ]
    assert Plan.from_dict(plan.to_dict()) == plan
    assert "num_replicas" not in _plan(ManualLayout(), world_size=2).to_dict()


@pytest.mark.parametrize(
    ("arguments", "world_size", "message"),
    [
        (dict(num_stages=4), 6, r"num_stages=4\) must divide the number of processes \(6\)"),
        (dict(num_stages=8), 8, "8 pipeline stages but configure_pipeline"),
        (dict(partition=[3, 3]), 3, r"has 2 stages but the pipeline has 3"),
        (dict(placement=[[0], [0]]), 2, "must list every rank 0..1 exactly once"),
        (
            dict(partition=[[0, 2], [3, 6]]),
            2,
            r"partition=\.\.\.\): Stage 1 covers blocks \[3, 6\)",
        ),
    ],
)
def test_layouts_that_do_not_fit_name_the_argument(
    arguments: dict, world_size: int, message: str
) -> None:
    layout = ManualLayout.from_arguments(
        arguments.get("partition"),
        None,
        None,
        arguments.get("num_stages"),
        arguments.get("placement"),
    )
    with pytest.raises(ValueError, match=message):
        _plan(layout, world_size)


def test_bad_arguments_fail_before_any_process_exists() -> None:
    with pytest.raises(ValueError, match="schedule='zb-h9'"):
        ManualLayout.from_arguments(None, "zb-h9", None, None, None)
    with pytest.raises(ValueError, match="num_microbatches=0"):
        ManualLayout.from_arguments(None, None, 0, None, None)
    with pytest.raises(ValueError, match="disagrees with placement"):
        ManualLayout.from_arguments(None, None, None, 3, [[0], [1]])
    with pytest.raises(ValueError, match="not an integer"):
        ManualLayout.from_arguments([[0, "a"]], None, None, None, None)  # type: ignore[list-item]


def test_a_plan_with_replicas_needs_one_rank_per_replica_in_every_stage() -> None:
    plan = _plan(ManualLayout(num_stages=2), world_size=4)
    data = plan.to_dict()
    data["stages"][1]["ranks"] = [1]
    data["stages"][1]["batch_shares"] = [1.0]
    data["stages"][0]["ranks"] = [0, 2, 3]
    data["stages"][0]["batch_shares"] = [1 / 3] * 3
    with pytest.raises(ValueError, match="one rank per replica in every stage"):
        Plan.from_dict(data)


def test_stages_without_trainable_parameters_are_refused_or_avoided() -> None:
    # Linear, ReLU, Linear on 3 processes: balancing alone would give the ReLU a stage.
    weights = [20, 0, 20]
    with pytest.raises(ValueError, match=r"stage 1 \(blocks 1\.\.1\) has no trainable"):
        manual_plan(
            ManualLayout(partition=[(0, 1), (1, 2), (2, 3)]),
            world_size=3,
            block_weights=weights,
            model_fingerprint="m",
        )
    plan = manual_plan(ManualLayout(), world_size=2, block_weights=weights, model_fingerprint="m")
    assert [st.block_range for st in plan.stages] == [(0, 2), (2, 3)]
    # Leading parameter-free blocks ride with the first block that has parameters.
    plan = manual_plan(
        ManualLayout(), world_size=2, block_weights=[0, 5, 0, 5], model_fingerprint="m"
    )
    assert [st.block_range for st in plan.stages] == [(0, 3), (3, 4)]
    with pytest.raises(ValueError, match="no trainable parameters"):
        manual_plan(ManualLayout(), world_size=3, block_weights=weights, model_fingerprint="m")
