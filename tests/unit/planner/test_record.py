"""The set-up record: plan, profile, timeline and why, saved where a user finds them."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_deepcee.planner import Plan, plan_search, record
from lightning_deepcee.planner.search import DeviceSetScore
from lightning_deepcee.profiler import ClusterProfile
from tests.helpers.paths import EXAMPLE_PROFILE


def test_the_record_holds_the_plan_the_profile_a_timeline_and_every_scored_set(
    tmp_path: Path,
) -> None:
    profile = ClusterProfile.from_yaml(EXAMPLE_PROFILE)
    sets: dict[tuple[int, ...], DeviceSetScore] = {}
    plan = plan_search(
        profile, num_blocks=profile.num_blocks, global_batch_size=32, device_sets=sets
    )
    # Every set scored, the chosen one among them with the plan's own prediction.
    assert tuple(range(profile.num_devices)) in sets and len(sets) > 2
    chosen = sets[tuple(sorted(plan.ranks))]
    assert chosen.full and chosen.step_time_s == plan.predicted_step_time_s
    assert min(s.step_time_s for s in sets.values() if s.full) == plan.predicted_step_time_s

    written = record.write_setup_record(tmp_path / "record", plan, profile, sets)
    names = sorted(p.name for p in written)
    assert names == ["plan.json", "profile.json", "timeline.png", "why.txt"]
    assert Plan.from_json(tmp_path / "record" / "plan.json") == plan
    assert ClusterProfile.from_json(tmp_path / "record" / "profile.json") == profile
    assert (tmp_path / "record" / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    why = (tmp_path / "record" / "why.txt").read_text()
    assert plan.format_table() in why
    chosen_lines = [line for line in why.splitlines() if line.endswith("<- chosen")]
    assert len(chosen_lines) == 1
    for r in plan.ranks:  # the chosen set names its devices by host
        assert profile.devices[r].host in chosen_lines[0]
    assert len([line for line in why.splitlines() if " ms  " in line]) == len(sets)


def test_a_timeline_that_cannot_be_drawn_is_explained_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    profile = ClusterProfile.from_yaml(EXAMPLE_PROFILE)
    plan = plan_search(profile, num_blocks=profile.num_blocks, global_batch_size=32)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no display")

    monkeypatch.setattr(record, "plan_timeline", broken)
    written = record.write_setup_record(tmp_path, plan, profile)
    assert sorted(p.name for p in written) == ["plan.json", "profile.json", "why.txt"]
    assert "timeline.png not drawn: RuntimeError: no display" in (tmp_path / "why.txt").read_text()
