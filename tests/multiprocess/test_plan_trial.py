"""The plan trial on the first training steps: the clock chooses among near plans, and every
trial step trains, exactly.

One torchrun job (4 processes) trains ``TinyNet`` with ``DeepCEEStrategy()`` (profile, plan,
trial; the search's plan is a fixed 4-stage layout, as the tiny model alone would be planned on
one device): once as it runs, once with a second added to the searched plan's steps so that a
rival wins and the state moves back to it after the race, once with the search's alternative on
three ranks as the only rival (the fourth goes idle, then active again), once where the searched
plan's only device becomes a replica of the rival's stage, once under
``accumulate_grad_batches=2`` (moves only between optimizer steps), and once with the trial off.
Parameters must equal one process on the whole batch for the same number of steps: the trial's
steps are training steps, moved between layouts with their optimizer state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_deepcee.planner import Plan
from tests.helpers.equivalence import assert_same_params, fit_reference, merged_ranks
from tests.helpers.launch import launch_fit

pytestmark = pytest.mark.multiprocess

WORLD = 4
LAYOUT = [[[0], [0, 2]], [[1], [2, 3]], [[2], [3, 5]], [[3], [5, 6]]]


def _records(directory: Path) -> list[dict]:
    return [json.loads((directory / f"rank{r}_trial.json").read_text()) for r in range(WORLD)]


def test_the_trial_trains_near_plans_in_turn_and_training_stays_exact(tmp_path: Path) -> None:
    configs = [
        {"name": "trial", "steps": 24, "searched_layout": LAYOUT},
        {"name": "rival", "steps": 24, "searched_layout": LAYOUT, "trial_slow_searched": True},
        # One rival: the search's alternative on ranks 0-2, rank 3 idle (its blocks move off).
        {
            "name": "fewer",
            "steps": 12,
            "searched_layout": LAYOUT,
            "alternative_layout": [[[0], [0, 2]], [[1], [2, 4]], [[2], [4, 6]]],
            "plan_trial": 2,
        },
        # The searched plan's only device becomes a replica of the rival's stage.
        {
            "name": "replica",
            "steps": 12,
            "searched_layout": [[[1], [0, 6]]],
            "alternative_layout": [[[0, 1], [0, 6]]],
            "plan_trial": 2,
        },
        {
            "name": "accumulate",
            "steps": 12,
            "accumulate": 2,
            "num_samples": 40,  # 4 batches an epoch: 2 optimizer steps
            "searched_layout": LAYOUT,
            "alternative_layout": [[[0], [0, 2]], [[1], [2, 4]], [[2], [4, 6]]],
            "trial_slow_searched": True,
            "plan_trial": 2,
        },
        {"name": "off", "steps": 6, "plan_trial": 1, "record_trial": True},
        # Fewer steps than twice the trial's: it is skipped, the searched plan trains.
        {"name": "short", "steps": 6, "searched_layout": LAYOUT, "record_trial": True},
    ]
    launch_fit(WORLD, configs, tmp_path)
    for name, steps in (("trial", 24), ("rival", 24), ("fewer", 12), ("replica", 12)):
        assert_same_params(merged_ranks(tmp_path / name, WORLD), fit_reference(steps))
    assert_same_params(
        merged_ranks(tmp_path / "accumulate", WORLD),
        fit_reference(12, accumulate=2, num_samples=40),
    )
    assert_same_params(merged_ranks(tmp_path / "off", WORLD), fit_reference(6))
    for name in ("trial", "rival", "fewer", "replica", "accumulate"):
        records = _records(tmp_path / name)
        calls = records[0]["calls"]
        # Every rank timed the same steps with the same figures (one all-reduce each).
        assert all(record["calls"] == calls for record in records), records
        ran = [index for index, _ in calls]
        assert ran == sorted(ran) and ran[0] == 0 and len(set(ran)) >= 2, calls
        assert all(seconds > 0 for _, seconds in calls), calls
        trained = Plan.from_dict(records[0]["trained"])
        layouts = records[0]["layouts"]
        # Each candidate trained its steps; after the race the winner trains on.
        assert len(set(layouts)) >= 2, layouts
        assert layouts[-1] == str(trained.layout_key), (layouts[-1], trained.layout_key)
    rival = _records(tmp_path / "rival")[0]
    trained, searched = Plan.from_dict(rival["trained"]), Plan.from_dict(rival["searched"])
    assert trained.layout_key != searched.layout_key, rival
    assert "rival" in rival["trained"]["notes"], rival["trained"]["notes"]
    fewer = _records(tmp_path / "fewer")
    assert [index for index, _ in fewer[0]["calls"]] == [0, 0, 0, 1, 1, 1], fewer[0]["calls"]
    accumulate = _records(tmp_path / "accumulate")[0]
    # Two batches per optimizer step: six timed steps, the layout the same within each pair.
    assert len(accumulate["calls"]) == 6, accumulate["calls"]
    pairs = accumulate["layouts"]
    assert all(pairs[i] == pairs[i + 1] for i in range(0, len(pairs), 2)), pairs
    assert "alternative" in accumulate["trained"]["notes"], accumulate["trained"]["notes"]
    for name in ("off", "short"):
        for record in _records(tmp_path / name):
            assert record["calls"] == [], record
            assert len(set(record["layouts"])) == 1, record["layouts"]
