"""The plan trial at setup: the clock chooses among near plans, and training stays exact.

One torchrun job (4 processes) trains ``TinyNet`` with ``DeepCEEStrategy()`` (profile, plan,
trial; the search's plan is a fixed 4-stage layout, as the tiny model alone would be planned on
one device): once as it runs, once with the searched plan's timing made a second slower so that a
rival is chosen and the blocks move to it before the first step, once so with the search's
alternative on three ranks as the only rival (the fourth goes idle), and once with BatchNorm (the
trial must not run: a step would change the running statistics). Parameters must equal one
process on the whole batch; the trial must leave the random generators and gradients as it
found them. Each rank's copies of the blocks it does not train are spoilt before the trial (the
rivals run on them), so training matches only if the state comes from the searched plan's owners.
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


def _records(directory: Path) -> list[dict]:
    return [json.loads((directory / f"rank{r}_trial.json").read_text()) for r in range(WORLD)]


def test_the_trial_times_near_plans_and_training_stays_exact(tmp_path: Path) -> None:
    layout = [[[0], [0, 2]], [[1], [2, 3]], [[2], [3, 5]], [[3], [5, 6]]]
    configs = [
        {"name": "trial", "steps": 3, "searched_layout": layout},
        {"name": "rival", "steps": 3, "searched_layout": layout, "trial_slow_searched": True},
        # One rival: the search's alternative on ranks 0-2, rank 3 idle (its blocks move off).
        {
            "name": "fewer",
            "steps": 3,
            "searched_layout": layout,
            "trial_slow_searched": True,
            "alternative_layout": [[[0], [0, 2]], [[1], [2, 4]], [[2], [4, 6]]],
            "plan_trial": 2,
        },
        # The searched plan's only device is a replica of the rival's stage, whose first device
        # holds spoilt copies: the rival's build overwrites its blocks, and the state saved
        # before it must be a copy, not the live tensors.
        {
            "name": "replica",
            "steps": 3,
            "searched_layout": [[[1], [0, 6]]],
            "alternative_layout": [[[0, 1], [0, 6]]],
            "plan_trial": 2,
        },
        {"name": "off", "steps": 3, "plan_trial": 1, "record_trial": True},
        {
            "name": "bn",
            "steps": 2,
            "batch_norm": True,
            "record_trial": True,
            "searched_layout": layout,
        },
    ]
    launch_fit(WORLD, configs, tmp_path)
    for name in ("trial", "rival", "off", "fewer", "replica"):
        assert_same_params(merged_ranks(tmp_path / name, WORLD), fit_reference(3))
    for name in ("trial", "rival", "fewer", "replica"):
        records = _records(tmp_path / name)
        for record in records:
            # The searched plan and at least one rival were timed on every rank, the same count.
            assert len(record["calls"]) >= 2, record
            assert len(record["calls"]) == len(records[0]["calls"])
            assert all(isinstance(s, float) and s > 0 for s in record["calls"]), record
            assert record["rng_restored"] and record["grads_dropped"], record
            Plan.from_dict(record["trained"])
    rival = _records(tmp_path / "rival")[0]
    # A second added to the searched plan's timing: a rival trains, on other block ranges or
    # under another schedule or micro-batch count (rival_runs), whichever the clock found fastest.
    trained, searched = Plan.from_dict(rival["trained"]), Plan.from_dict(rival["searched"])
    assert trained.layout_key != searched.layout_key, rival
    assert "rival" in rival["trained"]["notes"], rival["trained"]["notes"]
    fewer = _records(tmp_path / "fewer")
    assert all(len(record["calls"]) == 2 for record in fewer), fewer
    assert fewer[0]["trained"]["idle_ranks"] == [3], fewer[0]["trained"]
    assert "alternative" in fewer[0]["trained"]["notes"], fewer[0]["trained"]["notes"]
    # plan_trial=1 and a BatchNorm model: no candidate is timed.
    for name in ("off", "bn"):
        for record in _records(tmp_path / name):
            assert record["calls"] == [], record
