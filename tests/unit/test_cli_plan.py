"""``deepcee plan``: offline planning from a hand-written profile writes a plan and pictures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_deepcee._version import VERSION
from lightning_deepcee.cli import DEVICE_GAIN_DEFAULT, main
from lightning_deepcee.planner import DEVICE_GAIN, Plan
from tests.helpers.paths import EXAMPLE_PROFILE as PROFILE


def test_plan_command_writes_plan_timeline_and_trace(tmp_path: Path) -> None:
    out, png, trace = tmp_path / "plan.json", tmp_path / "t.png", tmp_path / "t.json"
    argv = ["plan", "--profile", str(PROFILE), "--global-batch-size", "32", "--out", str(out)]
    assert main([*argv, "--timeline", str(png), "--trace", str(trace)]) == 0
    plan = Plan.from_json(out)
    # Every rank named once: in a stage or idle (the example's slow regions are left idle).
    assert list(plan.world_ranks) == list(range(6)) and plan.ranks
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads(trace.read_text())["traceEvents"]


def test_plan_command_reports_bad_profile(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("devices: []\n")
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(bad), "--global-batch-size", "8", "--out", str(out)]) == 2
    assert not out.exists()


def test_plan_command_device_gain(tmp_path: Path) -> None:
    argv = ["plan", "--profile", str(PROFILE), "--global-batch-size", "32"]
    plans = []
    for gain in ("0", "0.9"):
        out = tmp_path / f"plan{gain}.json"
        assert main([*argv, "--out", str(out), "--device-gain", gain]) == 0
        plans.append(Plan.from_json(out))
    fastest, fewest = plans
    assert len(fewest.ranks) <= len(fastest.ranks)
    assert fewest.predicted_step_time_s <= 1.9 * fastest.predicted_step_time_s
    assert main([*argv, "--out", str(tmp_path / "bad.json"), "--device-gain", "1.5"]) == 2


def test_plan_command_never_overwrites_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    out.write_text("keep me\n")
    argv = ["plan", "--profile", str(PROFILE), "--global-batch-size", "32", "--out", str(out)]
    assert main(argv) == 2
    assert out.read_text() == "keep me\n"
    assert "--force" in capsys.readouterr().err
    assert main([*argv, "--force"]) == 0
    assert Plan.from_json(out).ranks


def test_version_and_help_read_for_users(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"deepcee {VERSION}"
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = capsys.readouterr().out
    assert f"(default: {DEVICE_GAIN})" in help_text and "(default: plan.json)" in help_text
    assert DEVICE_GAIN_DEFAULT == DEVICE_GAIN


def test_profile_command_runs_the_script_set_up_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A stand-in script records the arguments it was started with.
    script = tmp_path / "train.py"
    seen = tmp_path / "argv.txt"
    script.write_text(f"import sys; open({str(seen)!r}, 'w').write(' '.join(sys.argv[1:]))\n")
    assert main(["profile", str(script), "--config", "c.yaml"]) == 0
    assert seen.read_text() == "fit --config c.yaml --trainer.max_steps=0"
    assert main(["profile", str(tmp_path / "missing.py")]) == 2
    assert "no such training script" in capsys.readouterr().err
