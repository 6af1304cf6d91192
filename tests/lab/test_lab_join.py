"""A lost device comes back by joining the running job, over the lab (root).

One lab run of ``_join_worker.py`` on ``configs/lab/cee4_elastic.yaml`` under torchrun's elastic
agent (``--nnodes 3:4``): device ``edge1`` is killed with SIGKILL inside step 8; the three
survivors recover in their processes and train on three stages. Once they do, the lab's
``join`` starts edge1 again alone, outside torchrun, with ``DEEPCEE_JOIN=1``: the job admits it
at a step boundary and trains on four stages again, edge1 holding one, without a restart. Every
step's loss, and the parameters after the last step, must equal one uninterrupted process.

python -m pytest tests/lab/test_lab_join.py -m lab -q
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_deepcee.lab.network import LabNetwork
from lightning_deepcee.lab.runner import LabControl, LabResult, RunConfig, run_command
from lightning_deepcee.lab.state import StateStore
from lightning_deepcee.lab.topology import load_topology
from tests.helpers.lab import device_logs, read_rows, require_lab

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "lab" / "_join_worker.py"
TOPOLOGY = ROOT / "configs" / "lab" / "cee4_elastic.yaml"
SLOW_STEP = 7  # edge1 is killed inside the step after step 7; checkpoints every 3 steps
STEPS = 40  # _join_worker.STEPS
LINGER_S = 15.0  # after the last step, torchrun's agents wait at exit for the lost one's


class _Script:
    """Kill edge1 inside its step; once the survivors train, start it to join; end the rest."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.killed_at: float | None = None
        self.joined_at: float | None = None

    def __call__(self, ctl: LabControl) -> None:
        rows = read_rows(self.work / "losses.jsonl")
        if self.killed_at is None:
            if (self.work / "in_step").is_file():
                ctl.kill("edge1")
                self.killed_at = ctl.elapsed_s
        elif self.joined_at is None:
            if any(r["world"] == 3 for r in rows):
                ctl.join("edge1")
                self.joined_at = ctl.elapsed_s
        elif rows and rows[-1]["step"] >= STEPS and ctl.elapsed_s - rows[-1]["t"] > LINGER_S:
            for name in ("cloud0", "cloud1", "edge0"):
                if ctl.running(name):
                    ctl.kill(name)


@pytest.fixture(scope="module")
def join_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, LabResult, _Script]:
    require_lab()
    tmp = tmp_path_factory.mktemp("join")
    reference = tmp / "reference"
    subprocess.run(
        [sys.executable, str(WORKER), str(reference)], cwd=ROOT, check=True, timeout=600,
        capture_output=True,
    )  # fmt: skip
    work = tmp / "join"
    script = _Script(work)
    config = RunConfig(
        command=("python", str(WORKER), str(work), "--slow-device", "edge1",
                 "--slow-step", str(SLOW_STEP)),
        out_dir=tmp / "logs",
        cwd=str(ROOT),
        timeout_s=600,
        echo=False,
        elastic="3:4",
        max_restarts=0,  # a restart would be a failure here: everything happens in process
    )  # fmt: skip
    with LabNetwork(load_topology(TOPOLOGY), store=StateStore(tmp / "lab-state")) as net:
        result = run_command(net, config, control=script)
    return reference, work, result, script


def test_the_lost_device_joins_the_running_job_and_stays_exact(join_run: Any) -> None:
    reference, work, result, script = join_run
    assert script.killed_at is not None and script.joined_at is not None, device_logs(result)
    assert result.returncode == 0, device_logs(result)
    edge1 = next(d for d in result.devices if d.name == "edge1")
    assert edge1.launches == 2 and edge1.returncode == 0 and not edge1.killed, device_logs(result)
    rows = read_rows(work / "losses.jsonl")
    worlds = [r["world"] for r in rows]
    # Four, then three after the loss, then four again to the last step: one fit, no restart.
    assert worlds[0] == 4 and 3 in worlds and worlds[-1] == 4, worlds
    back = worlds.index(4, worlds.index(3))
    assert set(worlds[back:]) == {4} and rows[-1]["step"] == STEPS, rows
    logs = {d.name: Path(d.log_path).read_text() for d in result.devices}
    assert "training again on 3 devices in this process" in logs["cloud0"], device_logs(result)
    assert "4 devices (cloud0, cloud1, edge0, edge1) from step" in logs["cloud0"], device_logs(
        result
    )
    assert "edge1 asks to join the job" in logs["edge1"], device_logs(result)
    new_plan = logs["cloud0"].split("joined: edge1")[-1].split("\n")[2]  # old plan, new plan
    assert new_plan.startswith("  new plan: ") and "on edge1" in new_plan, device_logs(result)
    # Every step and the parameters after the last one: the uninterrupted run's.
    expected = {r["step"]: r["loss"] for r in read_rows(reference / "losses.jsonl")}
    for row in rows:
        assert row["loss"] == pytest.approx(expected[row["step"]], abs=2e-3), row
    got, want = torch.load(work / "final.pt"), torch.load(reference / "final.pt")
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-3, atol=1e-4, msg=key)
    used = rows[back]["t"] - script.joined_at
    print(f"edge1 started to join -> first step on 4 devices: {used:.1f} s")
