"""Worker of the elastic-restart lab test (``test_lab_elastic_restart.py``), under torchrun's agent.

A tiny GPT under ``DeepCEEStrategy`` with one stage per device (the layout follows the world
size, so a device that leaves or joins changes the partition), ``ElasticCheckpoint`` every 3
steps and ``fit(ckpt_path="last")``: a first start trains from scratch, every restart resumes
from the newest complete checkpoint. Rank 0 appends ``{"step", "loss", "world", "start",
"t"}`` to ``losses.jsonl`` after every step (``t`` on the lab's clock, ``$DEEPCEE_LAB_T0``).
With ``--slow-device D --slow-step S``, device ``D`` announces ``in_step`` and sleeps inside
step ``S`` of the first start, so the test can kill it mid-step; with ``--step-sleep T`` every
step after the first start waits ``T`` seconds (time for a returning device to join). ``start``
in a row counts the job's starts (0 the first; every restart of the worker group adds one). At
the end rank 0 writes the consolidated parameters to ``final.pt``. Without torchrun (one process)
it is the reference.

    python tests/lab/_elastic_restart_worker.py OUT [--slow-device D --slow-step S] [--step-sleep T]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_deepcee import DeepCEEStrategy, ElasticCheckpoint, consolidate_checkpoint
from lightning_deepcee.demo import GPT, ShakespeareDataModule

STEPS = 30
TIMEOUT_S = 20.0


def _clock() -> float:
    return time.monotonic() - float(os.environ.get("DEEPCEE_LAB_T0", "0"))


class _Recorder(Callback):
    def __init__(
        self, out: Path, slow_device: str | None, slow_step: int | None, step_sleep: float
    ) -> None:
        self.out, self.slow_device, self.slow_step = out, slow_device, slow_step
        self.step_sleep, self.start = step_sleep, 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        starts = self.out / "starts.txt"  # rank 0 of each start counts it; all ranks read it
        if trainer.is_global_zero:
            with starts.open("a") as f:
                f.write(f"{trainer.world_size}\n")
        trainer.strategy.barrier("starts")
        self.start = len(starts.read_text().split()) - 1

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        me = os.environ.get("DEEPCEE_DEVICE")
        first = self.start == 0 and not (self.out / "in_step").exists()
        if first and me == self.slow_device and trainer.global_step == self.slow_step:
            (self.out / "in_step").write_text(f"{_clock()}\n")
            time.sleep(30)  # killed in here

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        if trainer.is_global_zero:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            row = dict(step=trainer.global_step, loss=float(loss), world=trainer.world_size,
                       start=self.start, t=round(_clock(), 3))  # fmt: skip
            with (self.out / "losses.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            if self.start > 0:
                time.sleep(self.step_sleep)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--slow-device")
    parser.add_argument("--slow-step", type=int)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0)
    model = GPT(vocab_size=96, block_size=32, n_layer=3, n_head=2, n_embd=32, learning_rate=3e-3)
    data = ShakespeareDataModule(block_size=32, batch_size=16, max_chars=2300)  # 4 steps/epoch
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=DeepCEEStrategy(num_microbatches=4, timeout_s=TIMEOUT_S),
        max_steps=STEPS,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ElasticCheckpoint(dirpath=str(args.out / "ckpt"), every_n_train_steps=3),
            _Recorder(args.out, args.slow_device, args.slow_step, args.step_sleep),
        ],
        default_root_dir=str(args.out),
    )
    trainer.fit(model, datamodule=data, ckpt_path="last")
    trainer.save_checkpoint(args.out / "final.ckpt")
    if trainer.is_global_zero:
        torch.save(consolidate_checkpoint(args.out / "final.ckpt"), args.out / "final.pt")


if __name__ == "__main__":
    main()
