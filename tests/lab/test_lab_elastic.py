"""A device dies mid-training over the lab; the run restarts on one device fewer (root).

The test of issue 7's "must show": three emulated devices train a tiny GPT with
``DeepCEEStrategy()`` (profile, plan, run), checkpointing every epoch (3 steps). After step 8,
device ``edge0`` (rank 2) kills its own process with SIGKILL. The two others must exit within
the strategy's failure bound with an error naming rank 2. Then the same command runs on the two
cloud devices only, resuming from the newest complete checkpoint (end of epoch 2, step 6, or
step 3 when the background save of step 6 had not committed at the kill): the strategy profiles
and plans again for two devices and re-partitions the sharded checkpoint. Its losses for the
steps after it must match an uninterrupted single-process run of the same training.

python -m pytest tests/lab/test_lab_elastic.py -m lab -q
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lightning_deepcee.lab.network import LabNetwork
from lightning_deepcee.lab.runner import RunConfig, run_command
from lightning_deepcee.lab.state import StateStore
from lightning_deepcee.lab.topology import load_topology
from tests.helpers.lab import read_rows

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "lab" / "_elastic_worker.py"
TIMEOUT_S = 20.0  # _elastic_worker.TIMEOUT_S: DeepCEEStrategy(timeout_s=...)
DIAGNOSIS_S = 3.0  # strategy.LIVENESS_WAIT_S: watching the heartbeats before the error
SLACK_S = 10.0  # process exit, Lightning teardown, torchrun agent shutdown


def _losses(path: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_rows(path)}


def _lab(topology_path: Path, store: StateStore, command: list[str], out: Path):  # type: ignore[no-untyped-def]
    config = RunConfig(
        command=tuple(command),
        out_dir=out,
        cwd=str(ROOT),
        timeout_s=300,
        fail_grace_s=TIMEOUT_S + DIAGNOSIS_S + 60,  # let the survivors fail on their own
        echo=False,
    )
    with LabNetwork(load_topology(topology_path), store=store) as net:
        return run_command(net, config)


def test_lost_device_then_restart_on_fewer_devices(lab_store: StateStore, tmp_path: Path) -> None:
    # The uninterrupted curve: one process, no lab (the strategy's plan is one stage).
    reference = tmp_path / "reference"
    subprocess.run(
        [sys.executable, str(WORKER), str(reference)], cwd=ROOT, check=True, timeout=600,
        capture_output=True,
    )  # fmt: skip
    expected = _losses(reference / "losses.jsonl")
    assert sorted(expected) == list(range(1, 13))

    # Three devices; rank 2 (edge0) dies after step 8.
    work = tmp_path / "elastic"
    three = ROOT / "configs" / "lab" / "cee3_small.yaml"
    command = ["python", str(WORKER), str(work), "--die-rank", "2", "--die-step", "8"]
    first = _lab(three, lab_store, command, tmp_path / "logs1")
    logs = {d.name: Path(d.log_path).read_text() for d in first.devices}
    dump = "\n".join(f"== {k}\n{v[-2500:]}" for k, v in logs.items())
    assert first.returncode != 0, dump
    assert (work / "killed_at.txt").is_file(), dump
    by_name = {d.name: d for d in first.devices}
    for name in ("cloud0", "cloud1"):
        # edge0 holds a stage, or the plan left it idle (the cloud pair alone is faster): either
        # way its loss is named.
        named = re.search(r"lost rank 2 \((stage \d+|idle), host edge0\)", logs[name])
        assert named, f"{name} did not name the lost device\n{dump}"
        assert "host edge0)" in logs[name], dump
        assert "its heartbeat stopped" in logs[name], dump
        assert by_name[name].returncode not in (0, None), dump
    # Every survivor exited within the bound after the dead device (durations share a start).
    for name in ("cloud0", "cloud1"):
        after_death = by_name[name].duration_s - by_name["edge0"].duration_s
        assert after_death <= TIMEOUT_S + DIAGNOSIS_S + SLACK_S, (name, after_death, dump)
    seen = _losses(work / "losses.jsonl")
    assert sorted(seen) == list(range(1, 9)), seen

    # Restart on the two cloud devices: new profile, new plan, re-partitioned checkpoint.
    topology = yaml.safe_load(three.read_text())
    topology["name"] = "cee2_small"
    topology["devices"] = [d for d in topology["devices"] if d["name"] != "edge0"]
    topology["regions"] = {"cloud": topology["regions"]["cloud"]}
    topology["wan"] = []
    two = tmp_path / "cee2_small.yaml"
    two.write_text(yaml.safe_dump(topology))
    (work / "losses.jsonl").rename(work / "losses_first.jsonl")
    began = time.time()
    second = _lab(
        two, lab_store, ["python", str(WORKER), str(work), "--resume"], tmp_path / "logs2"
    )
    logs = {d.name: Path(d.log_path).read_text() for d in second.devices}
    dump = "\n".join(f"== {k}\n{v[-2500:]}" for k, v in logs.items())
    assert second.returncode == 0, dump
    # The newest complete checkpoint: epoch 1's (step 6), or epoch 0's (step 3) when epoch 1's
    # save, written in the background, had not committed when edge0 was killed in step 8.
    resumed_from = re.search(r"resuming from \S*epoch=([01])\.ckpt \(step (\d+)\)", logs["cloud0"])
    assert resumed_from, dump
    assert int(resumed_from[2]) == 3 * (int(resumed_from[1]) + 1), dump
    assert "DeepCEE plan:" in logs["cloud0"], dump  # planned again for two devices
    resumed = _losses(work / "losses.jsonl")
    assert sorted(resumed) == list(range(int(resumed_from[2]) + 1, 13)), resumed
    # The loss continues the uninterrupted curve: same data order, exact gradients; only the
    # floating-point reduction order differs between one process and the new two-device plan.
    for step, loss in resumed.items():
        assert loss == pytest.approx(expected[step], abs=2e-3), (step, loss, expected[step])
    # And the first run matched it too before the device was lost.
    for step, loss in seen.items():
        assert loss == pytest.approx(expected[step], abs=2e-3), (step, loss, expected[step])
    assert time.time() - began < 300
