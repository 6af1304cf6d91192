"""benchmarks/profile_spread.py: every run's plan re-predicted under every run's profile."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lightning_deepcee.planner.search import plan_search
from lightning_deepcee.profiler.data import ClusterProfile
from tests.helpers.benchmarks import load_benchmark


def _slower(profile: ClusterProfile, rank: int, factor: float) -> ClusterProfile:
    devices = list(profile.devices)
    d = devices[rank]
    devices[rank] = dataclasses.replace(
        d,
        forward_s=tuple(t * factor for t in d.forward_s),
        backward_input_s=tuple(t * factor for t in d.backward_input_s),
        backward_weight_s=tuple(t * factor for t in d.backward_weight_s),
    )
    return dataclasses.replace(profile, devices=tuple(devices))


def test_every_plan_is_predicted_under_every_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spread = load_benchmark("profile_spread")
    fast = load_benchmark("plan_scaling").synthetic_cluster(
        regions=2, sites=1, devices=2, num_blocks=6, seed=1
    )
    slow = _slower(fast, rank=3, factor=3.0)  # a re-measurement that found rank 3 slower
    runs = []
    for profile, measured_s in ((fast, 0.5), (slow, 0.8)):
        # Plans on every device: a plan that left the slow rank idle would predict the same
        # under both profiles, and this checks how plans move between profiles.
        plan = plan_search(
            profile, num_blocks=6, global_batch_size=16, seed=0, choose_devices=False
        )
        runs.append(
            {
                "profile": profile.to_dict(),
                "plan": plan.to_dict(),
                "step_times_s": [9.0, measured_s, measured_s],  # the first is outside the window
                "window_steps": 2,
            }
        )
    results = tmp_path / "bench.json"
    results.write_text(json.dumps({"systems": {"deepcee": {"runs": runs}, "ddp": {"runs": [{}]}}}))

    loaded = spread.load_runs(results)
    assert [run.label for run in loaded] == ["deepcee 0", "deepcee 1"]
    assert [run.measured_s for run in loaded] == [0.5, 0.8]
    table = spread.cross_predictions(loaded)
    # Under its own profile each plan predicts what its run recorded.
    for i, run in enumerate(loaded):
        assert table[i][i] == pytest.approx(run.plan.predicted_step_time_s, rel=1e-9)
    # The plan chosen on the fast profile is no faster under the slow one, whose rank 3 is
    # slower; the slow profile's own plan is no slower under the fast profile.
    assert table[0][1] >= table[0][0]
    assert table[1][0] <= table[1][1]

    out = tmp_path / "spread.md"
    assert spread.main([str(results), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# Every plan under every profile")
    assert f"python benchmarks/profile_spread.py {results} --out {out}" in text
    own, others = table[0][0], table[0][1]
    row = next(line for line in text.splitlines() if line.startswith("| deepcee 0 |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[2:5] == ["500", f"{own * 1e3:.0f}", f"{own / 0.5 - 1:+.0%}"]
    assert cells[5:7] == [f"{others * 1e3:.0f}", f"{others / 0.5 - 1:+.0%}"]
    assert cells[7:] == [f"{others / own - 1:.0%}", "1 of 2"]
    assert next(line for line in text.splitlines() if line.startswith("| deepcee 1 |")).endswith(
        "| 2 of 2 |"
    )  # the slow profile's plan runs faster under the fast profile
    assert "Own profile the most optimistic for its plan: 1 of 2 runs" in text
    assert capsys.readouterr().err == ""  # nothing re-predicted differently from the record


def test_a_file_with_one_planned_run_is_reported_and_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spread = load_benchmark("profile_spread")
    results = tmp_path / "one.json"
    results.write_text(json.dumps({"systems": {"ddp": {"runs": [{"step_times_s": [1.0]}]}}}))
    assert spread.main([str(results)]) == 0
    assert "fewer than two planned runs" in capsys.readouterr().err
