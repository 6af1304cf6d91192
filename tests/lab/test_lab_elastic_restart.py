"""Elastic without a person (root): lose a device mid-step, keep training; get it back, use it.

One lab run of ``_elastic_restart_worker.py`` on ``configs/lab/cee4_elastic.yaml`` under
torchrun's elastic agent (``--nnodes 3:4``, c10d rendezvous on cloud0): device ``edge1`` is
killed with SIGKILL (agent and worker) in the middle of step 8, and nobody runs a command. The
three survivors name the lost device, their agents re-rendezvous, and the job resumes from the
newest complete checkpoint on three devices (step 6's, or step 3's when the kill came before the
step-6 save had committed: a save cut short never counts). Once they train, ``edge1`` is started
again once they have committed a checkpoint of their own: it joins at the next rendezvous, the
job restarts on four devices and edge1 holds a stage again (the steps after the first start take
a second each, to leave it the time).
Every step's loss, and the parameters after the last step, must equal one uninterrupted process
(the resumed steps see the batches the data order gives them: the loader resumes mid-epoch).

python -m pytest tests/lab/test_lab_elastic_restart.py -m lab -q
"""

from __future__ import annotations

import re
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
WORKER = ROOT / "tests" / "lab" / "_elastic_restart_worker.py"
TOPOLOGY = ROOT / "configs" / "lab" / "cee4_elastic.yaml"
SLOW_STEP = 7  # edge1 is killed inside the step after step 7; checkpoints every 3 steps
STEPS = 30  # _elastic_restart_worker.STEPS


class _Script:
    """The test's hand on the lab: kill edge1 once it is inside the step, start it again later."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.killed_at: float | None = None
        self.started_at: float | None = None
        self.saved_on_four: set[str] | None = None

    def __call__(self, ctl: LabControl) -> None:
        if self.killed_at is None:
            if (self.work / "in_step").is_file():
                ctl.kill("edge1")
                self.killed_at = ctl.elapsed_s
        elif self.started_at is None:
            rows = read_rows(self.work / "losses.jsonl")
            if not any(r["start"] == 1 for r in rows):
                return
            # The survivors train again. Bring edge1 back once they have committed a checkpoint
            # of their own: the restart then resumes from three devices' state and edge1 joins
            # it (resuming from a checkpoint edge1 helped write would be no change of devices).
            committed = {p.name for p in (self.work / "ckpt").glob("step=*.ckpt")}
            if self.saved_on_four is None:
                self.saved_on_four = committed
            elif committed - self.saved_on_four:
                ctl.start("edge1")
                self.started_at = ctl.elapsed_s


@pytest.fixture(scope="module")
def elastic_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, LabResult, _Script]:
    require_lab()
    tmp = tmp_path_factory.mktemp("elastic_restart")
    reference = tmp / "reference"
    subprocess.run(
        [sys.executable, str(WORKER), str(reference)], cwd=ROOT, check=True, timeout=600,
        capture_output=True,
    )  # fmt: skip
    work = tmp / "elastic"
    script = _Script(work)
    config = RunConfig(
        command=("python", str(WORKER), str(work), "--slow-device", "edge1",
                 "--slow-step", str(SLOW_STEP), "--step-sleep", "1"),
        out_dir=tmp / "logs",
        cwd=str(ROOT),
        timeout_s=900,
        echo=False,
        elastic="3:4",
        max_restarts=4,
    )  # fmt: skip
    with LabNetwork(load_topology(TOPOLOGY), store=StateStore(tmp / "lab-state")) as net:
        result = run_command(net, config, control=script)
    return reference, work, result, script


def test_lost_device_training_goes_on_without_a_person(elastic_run: Any) -> None:
    reference, work, result, script = elastic_run
    logs = {d.name: Path(d.log_path).read_text() for d in result.devices}
    assert script.killed_at is not None, device_logs(result)
    assert result.returncode == 0, device_logs(result)
    rows = read_rows(work / "losses.jsonl")
    first = [r for r in rows if r["start"] == 0]
    assert [r["step"] for r in first] == list(range(1, SLOW_STEP + 1)), rows
    assert {r["world"] for r in first} == {4}
    on_three = [r for r in rows if r["start"] == 1]
    assert {r["world"] for r in on_three} == {3}, rows
    report = "\n".join(logs.values())
    # The report of the restart after the loss: the checkpoint, the failure, the steps to redo.
    resumed = re.search(
        rf"resuming from \S*step=(\d+)\.ckpt \(step \d+\)\n  failed at step {SLOW_STEP}: lost "
        r"edge1; (\d+) to redo",
        report,
    )
    assert resumed, device_logs(result)
    step = int(resumed[1])
    assert step in (3, 6) and int(resumed[2]) == SLOW_STEP - step, report
    assert on_three and on_three[0]["step"] == step + 1, rows  # the steps after it are redone
    survivors = ("cloud0", "cloud1", "edge0")
    assert any("host edge1)" in logs[n] and "lost rank" in logs[n] for n in survivors), device_logs(
        result
    )
    assert "devices left: edge1" in report, device_logs(result)
    # Every step, redone ones included, is the uninterrupted run's step.
    expected = {r["step"]: r["loss"] for r in read_rows(reference / "losses.jsonl")}
    for row in rows:
        assert row["loss"] == pytest.approx(expected[row["step"]], abs=2e-3), row
    seconds = on_three[0]["t"] - script.killed_at
    print(f"kill -> first step on 3 devices: {seconds:.1f} s")
    assert seconds < 180


def test_device_comes_back_and_is_used_again(elastic_run: Any) -> None:
    reference, work, result, script = elastic_run
    assert script.started_at is not None, device_logs(result)
    assert result.returncode == 0, device_logs(result)
    edge1 = next(d for d in result.devices if d.name == "edge1")
    assert edge1.launches == 2 and edge1.returncode == 0 and not edge1.killed, device_logs(result)
    rows = read_rows(work / "losses.jsonl")
    back = [r for r in rows if r["start"] >= 2]
    assert back and {r["world"] for r in back} == {4} and back[-1]["step"] == STEPS, rows
    report = "\n".join(Path(d.log_path).read_text() for d in result.devices)
    assert "joined: edge1" in report, device_logs(result)
    assert "new plan: " in report and "on edge1" in report.split("joined: edge1")[-1], device_logs(
        result
    )
    # The parameters after the last step: the uninterrupted run's.
    got, want = torch.load(work / "final.pt"), torch.load(reference / "final.pt")
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-3, atol=1e-4, msg=key)
