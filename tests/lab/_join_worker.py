"""Worker of the join lab test (``test_lab_join.py``), under torchrun's agent; alone to join.

A tiny GPT (5 blocks) under ``DeepCEEStrategy()`` with ``ElasticCheckpoint`` every 3 steps and
``fit(ckpt_path="last")``. The search is stood in for by one stage per device (even block
ranges), so a device that leaves or joins changes the partition and a returning device holds a
stage. With ``--slow-device D --slow-step S``, device ``D`` announces ``in_step`` and sleeps
inside step ``S`` (the test kills it there). After the loss, until a device has joined, every
step takes three seconds more (time for the returning device to start on a loaded machine).
Rank 0 appends ``{"step", "loss", "world", "t"}`` to ``losses.jsonl`` after every step (``t``
on the lab's clock) and writes the consolidated parameters to ``final.pt`` at the end. Without
torchrun (one process) it is the reference.

    python tests/lab/_join_worker.py OUT [--slow-device D --slow-step S]
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

import lightning_deepcee.runtime.spread_search as spread_search
from lightning_deepcee import DeepCEEStrategy, ElasticCheckpoint, consolidate_checkpoint
from lightning_deepcee.demo import GPT, ShakespeareDataModule
from lightning_deepcee.planner import make_plan

STEPS = 40
BLOCKS = 5  # embedding, 3 layers, head


def _clock() -> float:
    return time.monotonic() - float(os.environ.get("DEEPCEE_LAB_T0", "0"))


def _one_stage_per_device(profile: Any, *, global_batch_size: int, **_: Any) -> Any:
    n = profile.num_devices
    edges = [round(i * BLOCKS / n) for i in range(n + 1)]
    return make_plan(
        profile,
        [[r] for r in range(n)],
        [(edges[i], edges[i + 1]) for i in range(n)],
        schedule="1f1b",
        num_microbatches=4,
        global_batch_size=global_batch_size,
    )


class _Recorder(Callback):
    def __init__(self, out: Path, slow_device: str | None, slow_step: int | None) -> None:
        self.out, self.slow_device, self.slow_step = out, slow_device, slow_step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        me, step = os.environ.get("DEEPCEE_DEVICE"), trainer.global_step
        first = not (self.out / "in_step").exists()
        if first and me == self.slow_device and step == self.slow_step:
            (self.out / "in_step").write_text(f"{_clock()}\n")
            time.sleep(60)  # killed in here
        strategy: Any = trainer.strategy
        waiting = strategy.recovery.recoveries and not strategy.admission.admissions
        if waiting and step < STEPS - 2:
            time.sleep(3.0)  # the survivors wait for the returning device

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        if trainer.is_global_zero:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            row = dict(step=trainer.global_step, loss=float(loss), world=trainer.world_size,
                       t=round(_clock(), 3))  # fmt: skip
            with (self.out / "losses.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--slow-device")
    parser.add_argument("--slow-step", type=int)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    spread_search.plan_search = _one_stage_per_device  # type: ignore[assignment]
    pl.seed_everything(0)
    model = GPT(vocab_size=96, block_size=32, n_layer=3, n_head=2, n_embd=32, learning_rate=3e-3)
    data = ShakespeareDataModule(block_size=32, batch_size=16, max_chars=2300)  # 4 steps/epoch
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=DeepCEEStrategy(plan_trial=1, timeout_s=20.0, profile_budget_s=60.0),
        max_steps=STEPS,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ElasticCheckpoint(dirpath=str(args.out / "ckpt"), every_n_train_steps=3),
            _Recorder(args.out, args.slow_device, args.slow_step),
        ],
        default_root_dir=str(args.out),
    )
    trainer.fit(model, datamodule=data, ckpt_path="last")
    trainer.save_checkpoint(args.out / "final.ckpt")
    if trainer.is_global_zero:
        torch.save(consolidate_checkpoint(args.out / "final.ckpt"), args.out / "final.pt")


if __name__ == "__main__":
    main()
