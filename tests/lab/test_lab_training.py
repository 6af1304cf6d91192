"""A DeepCEEStrategy training run across 3 emulated devices, one torchrun node each (root).

python -m pytest tests/lab -m lab -q
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from lightning_deepcee.lab.network import LabNetwork
from lightning_deepcee.lab.runner import RunConfig, run_command
from lightning_deepcee.lab.state import StateStore, leftovers
from lightning_deepcee.lab.topology import load_topology

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]


def test_deepcee_trains_over_the_lab(lab_store: StateStore, tmp_path: Path) -> None:
    topology = load_topology(ROOT / "configs" / "lab" / "cee3_small.yaml")
    run_dir = tmp_path / "run"
    command = (
        "python", "examples/train_gpt.py", "fit",
        "--config", "configs/lab/tiny_gpt.yaml",
        "--trainer.num_nodes=3", "--trainer.devices=1",
        f"--trainer.default_root_dir={run_dir}",
        f"--trainer.logger.init_args.save_dir={run_dir}",
    )  # fmt: skip
    config = RunConfig(command=command, out_dir=tmp_path / "logs", cwd=str(ROOT), timeout_s=110)
    net = LabNetwork(topology, store=lab_store)
    with net:
        result = run_command(net, config)
    logs = {d.name: Path(d.log_path).read_text() for d in result.devices}
    assert result.returncode == 0, "\n".join(f"== {k}\n{v[-3000:]}" for k, v in logs.items())
    # Lightning's progress bar shows the loss: "train_loss_step=" (tqdm) or "train_loss_...:"
    # (rich, which Lightning prefers when it is installed).
    assert re.search(r"train_loss_\w+[=:]", logs["cloud0"]), logs["cloud0"][-3000:]
    assert "`Trainer.fit` stopped: `max_steps=6` reached" in logs["cloud0"]
    metrics = next(run_dir.rglob("metrics.csv"))
    losses = [
        float(r["train_loss_step"])
        for r in csv.DictReader(metrics.open())
        if r.get("train_loss_step")
    ]
    assert len(losses) == 6 and all(0 < x < 10 for x in losses)
    assert leftovers(net.record) == [] if net.record else False
