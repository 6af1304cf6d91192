"""The main job's path: LightningCLI + YAML + Lightning's own launcher (devices=2, popen)."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_deepcee.cli import main as deepcee_main
from lightning_deepcee.demo import GPT
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.multiprocess


def test_lightning_cli_yaml_run_and_consolidate(tmp_path: Path) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(
        f"""
trainer:
  accelerator: cpu
  devices: 2
  max_steps: 6
  log_every_n_steps: 2
  limit_val_batches: 2
  val_check_interval: 3
  default_root_dir: {tmp_path}
  strategy:
    class_path: lightning_deepcee.DeepCEEStrategy
    init_args: {{schedule: 1f1b, num_microbatches: 3, partition: [2, 2]}}
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {{save_dir: {tmp_path}, name: log}}
  callbacks:
    - class_path: lightning_deepcee.PipelineThroughputMonitor
      init_args: {{window_size: 3}}
model: {{n_layer: 2, n_embd: 32, n_head: 2, block_size: 16}}
data: {{block_size: 16, batch_size: 6, max_chars: 20000}}
"""
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "fit", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = proc.stdout + proc.stderr
    assert "DeepCEEStrategy: 2 stages x 1 replica(s), schedule 1f1b, 3 micro-batches" in out
    # The console: Lightning's model summary counts the whole model (not rank 0's stage), and
    # the strategy's own logs raise no sync_dist advice.
    whole = sum(p.numel() for p in GPT(n_layer=2, n_embd=32, n_head=2, block_size=16).parameters())
    # Lightning's plain summary ("32.1 K    Total params") or, with rich installed, its rich one
    # ("Total params: 32.1 K").
    total = re.search(r"^\s*([\d.]+ ?[KM]?)\s+Total params", out, re.MULTILINE) or re.search(
        r"^Total params: ([\d.]+ ?[KM]?)", out, re.MULTILINE
    )
    assert total is not None, out[-3000:]
    assert total.group(1).replace(" ", "") == _human(whole), (total.group(1), whole)
    assert "sync_dist=True" not in out
    rows = list(csv.DictReader((tmp_path / "log" / "version_0" / "metrics.csv").open()))
    losses = [float(r["train_loss_step"]) for r in rows if r.get("train_loss_step")]
    assert len(losses) >= 3 and all(v == v for v in losses)
    rates = [float(r["deepcee/samples_per_s"]) for r in rows if r.get("deepcee/samples_per_s")]
    assert rates and all(r > 0 for r in rates)
    assert any(r.get("deepcee/stage1_transfer_s") for r in rows)
    cpu = [float(r["deepcee/stage0_cpu_s"]) for r in rows if r.get("deepcee/stage0_cpu_s")]
    assert cpu and all(c > 0 for c in cpu)
    # One device per stage here: nothing to sum, and the column is there.
    sync = [float(r["deepcee/stage0_grad_sync_s"]) for r in rows if r.get("deepcee/stage0_cpu_s")]
    assert sync and all(s == 0 for s in sync)
    assert any(r.get("val_loss") for r in rows)
    # The demo's torchmetrics token accuracy (PipelineSpec.metrics_fn) reaches the logger.
    accuracies = [float(r["train_acc_step"]) for r in rows if r.get("train_acc_step")]
    assert accuracies and all(0 <= a <= 1 for a in accuracies)
    assert any(r.get("val_acc") for r in rows)

    ckpts = list((tmp_path / "log" / "version_0" / "checkpoints").glob("*.ckpt"))
    assert len(ckpts) == 1 and (ckpts[0] / "stage_001.pt").is_file()
    target = tmp_path / "plain.pt"
    assert deepcee_main(["consolidate", str(ckpts[0]), str(target)]) == 0
    model = GPT(n_layer=2, n_embd=32, n_head=2, block_size=16)
    model.load_state_dict(torch.load(target), strict=True)


def test_consolidate_cli_reports_bad_path(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert deepcee_main(["consolidate", str(tmp_path / "missing"), str(tmp_path / "x.pt")]) == 2
    assert "meta.pt" in capsys.readouterr().err


def _human(count: int) -> str:
    """Lightning's summary format for a parameter count (``27.9 K``, without the space)."""
    from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

    return get_human_readable_count(count).replace(" ", "")
