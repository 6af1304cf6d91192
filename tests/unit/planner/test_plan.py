"""Unit tests of Plan and StagePlan: validation, JSON round trip, table, fit checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lightning_deepcee.planner.plan import Plan, StagePlan


def _plan(**overrides: Any) -> Plan:
    fields: dict[str, Any] = {
        "stages": (
            StagePlan(block_range=(0, 3), ranks=(0, 1), batch_shares=(0.75, 0.25)),
            StagePlan(block_range=(3, 8), ranks=(2,), batch_shares=(1.0,)),
        ),
        "schedule": "zb-h1",
        "num_microbatches": 4,
        "global_batch_size": 32,
        "predicted_step_time_s": 1.25,
        "predicted_bubble_ratio": 0.2,
        "predicted_peak_memory_bytes": {0: 100, 1: 90, 2: 300},
        "model_fingerprint": "m" * 16,
        "cluster_fingerprint": "c" * 16,
        "notes": "hand-made",
    }
    fields.update(overrides)
    return Plan(**fields)


def test_json_round_trip(tmp_path: Path) -> None:
    plan = _plan()
    path = tmp_path / "plan.json"
    plan.to_json(path)
    again = Plan.from_json(path)
    assert again == plan
    assert again.predicted_peak_memory_bytes == {0: 100, 1: 90, 2: 300}
    assert json.loads(path.read_text())["stages"][0]["ranks"] == [0, 1]
    assert Plan.from_dict(plan.to_dict()) == plan


def test_views() -> None:
    plan = _plan()
    assert plan.num_stages == 2
    assert plan.num_blocks == 8
    assert plan.ranks == (0, 1, 2)
    assert plan.microbatch_size == 8
    assert plan.stage_of(2) == 1
    with pytest.raises(ValueError, match="expected one of the plan's ranks"):
        plan.stage_of(7)


def test_format_table_lists_every_stage() -> None:
    table = _plan().format_table()
    assert "zb-h1" in table and "1250.00 ms" in table
    assert "0-2" in table and "3-7" in table
    assert "0.750,0.250" in table
    assert "hand-made" in table


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {
                "stages": (
                    StagePlan(block_range=(0, 3), ranks=(0,), batch_shares=(1.0,)),
                    StagePlan(block_range=(4, 8), ranks=(1,), batch_shares=(1.0,)),
                )
            },
            "expected to start at block 3",
        ),
        (
            {"stages": (StagePlan(block_range=(1, 3), ranks=(0,), batch_shares=(1.0,)),)},
            "expected to start at block 0",
        ),
        (
            {
                "stages": (
                    StagePlan(block_range=(0, 3), ranks=(0, 1), batch_shares=(0.5, 0.5)),
                    StagePlan(block_range=(3, 8), ranks=(1,), batch_shares=(1.0,)),
                )
            },
            "rank 1 is already in stage 0",
        ),
        ({"schedule": "zb-v"}, "schedule: expected one of"),
        ({"num_microbatches": 0}, "num_microbatches: expected a positive integer"),
        ({"global_batch_size": 2}, "cannot fill 4 micro-batches"),
        ({"predicted_step_time_s": float("nan")}, "predicted_step_time_s"),
        ({"predicted_peak_memory_bytes": {9: 1}}, r"predicted_peak_memory_bytes\[9\]"),
        ({"stages": ()}, "stages: expected a non-empty list"),
        ({"schedule": "compact"}, "a 'compact' plan needs one action string per stage"),
        ({"stage_actions": ("0F0", "1F0")}, "only a 'compact' plan lists its actions"),
        ({"schedule": "compact", "stage_actions": ("0F0 0B0 0W0",)}, "one action string per"),
        (
            {"schedule": "compact", "stage_actions": ("0F0 0X0", "1F0")},
            r"stage_actions\[0\]: Cannot parse action",
        ),
        (
            {"schedule": "compact", "stage_actions": ("0F0 1B0", "1F0")},
            r"stage_actions\[0\]: expected compute actions .* of stage 0",
        ),
        (  # micro-batches 1..3 never run: not a schedule of 4 micro-batches
            {"schedule": "compact", "stage_actions": ("0F0 0B0 0W0", "1F0 1B0 1W0")},
            "stage_actions: not a valid schedule",
        ),
    ],
)
def test_plan_validation(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _plan(**overrides)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"block_range": (3, 3), "ranks": (0,), "batch_shares": (1.0,)}, "0 <= start < end"),
        ({"block_range": (0, 3), "ranks": (0, 0), "batch_shares": (0.5, 0.5)}, "distinct"),
        ({"block_range": (0, 3), "ranks": (0, 1), "batch_shares": (0.5,)}, "expected 2 entries"),
        ({"block_range": (0, 3), "ranks": (0, 1), "batch_shares": (0.5, 0.6)}, "summing to 1"),
        ({"block_range": (0, 3), "ranks": (0, 1), "batch_shares": (1.0, 0.0)}, "positive"),
        ({"block_range": (0, 3), "ranks": (), "batch_shares": ()}, "non-empty"),
    ],
)
def test_stage_validation(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StagePlan(**fields)


def test_from_dict_rejects_unknown_and_missing_fields() -> None:
    data = _plan().to_dict()
    with pytest.raises(ValueError, match="unknown field of Plan"):
        Plan.from_dict({**data, "extra": 1})
    del data["schedule"]
    with pytest.raises(ValueError, match="missing required field of Plan"):
        Plan.from_dict(data)
    bad = _plan().to_dict()
    bad["stages"][1]["batch_shares"] = [0.5]
    with pytest.raises(ValueError, match=r"stages\[1\]"):
        Plan.from_dict(bad)


def test_check_matches() -> None:
    plan = _plan()
    plan.check_matches(8, 3, "m" * 16, "c" * 16)
    plan.check_matches(8, 3)
    with pytest.raises(ValueError, match="covers 8 blocks but the model has 9"):
        plan.check_matches(9, 3)
    with pytest.raises(ValueError, match="the world has 4 ranks"):
        plan.check_matches(8, 4)
    with pytest.raises(ValueError, match="model structure changed"):
        plan.check_matches(8, 3, model_fingerprint="other")
    with pytest.raises(ValueError, match="hosts or ranks changed"):
        plan.check_matches(8, 3, cluster_fingerprint="other")


def _compact_actions(m: int) -> tuple[str, ...]:
    """A valid two-stage schedule that is none of the generated kinds (W deferred to the end)."""
    first = [f"0F{i}" for i in range(m)] + [f"0B{i}" for i in range(m)]
    last = [a for i in range(m) for a in (f"1F{i}", f"1B{i}")]
    return (
        " ".join(first + [f"0W{i}" for i in range(m)]),
        " ".join(last + [f"1W{i}" for i in range(m)]),
    )


def test_compact_plan_carries_its_actions(tmp_path: Path) -> None:
    from lightning_deepcee.schedule import format_actions, generate

    plan = _plan(schedule="compact", stage_actions=_compact_actions(4))
    path = tmp_path / "compact.json"
    plan.to_json(path)
    assert Plan.from_json(path) == plan
    own = plan.stage_schedule()
    assert tuple(format_actions(own[s]) for s in range(2)) == _compact_actions(4)
    # Another micro-batch count (the adapter re-splitting): ZB-H1, not the fitted actions.
    assert plan.stage_schedule(3) == generate("zb-h1", 2, 3)
    assert _plan().stage_schedule() == generate("zb-h1", 2, 4)
    assert "stage_actions" not in _plan().to_dict()
