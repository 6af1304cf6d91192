"""README's main job, shortened: the quick start profiles, plans, says why and saves it all.

``python examples/train_gpt.py fit --config configs/quickstart.yaml`` as README.md gives it, with
only the step count and the output folder changed: four local CPU processes under Lightning's
own launcher must print the cluster profile, the plan and the device sets it scored, and save
``plan.json``, ``profile.json``, ``timeline.png`` and ``why.txt`` in ``<root>/deepcee/``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_deepcee.planner import Plan
from lightning_deepcee.profiler import ClusterProfile
from tests.helpers.launch import worker_env
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.multiprocess


def test_the_quick_start_plans_and_saves_what_it_decided(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    assert "python examples/train_gpt.py fit --config configs/quickstart.yaml" in readme
    command = [
        sys.executable, "examples/train_gpt.py", "fit", "--config", "configs/quickstart.yaml",
        "--trainer.max_steps=4", f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
    ]  # fmt: skip
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=600, cwd=ROOT, env=worker_env()
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for line in ("DeepCEE cluster profile:", "DeepCEE plan:", "device sets scored", "<- chosen"):
        assert line in out, out[-6000:]
    record = tmp_path / "deepcee"
    assert f"saved plan.json, profile.json, timeline.png, why.txt in {record}" in out
    plan = Plan.from_json(record / "plan.json")
    assert list(plan.world_ranks) == [0, 1, 2, 3]
    assert ClusterProfile.from_json(record / "profile.json").num_devices == 4
    assert (record / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert plan.format_table() in (record / "why.txt").read_text()
