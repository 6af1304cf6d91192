"""Worker of the lost-device lab test (``test_lab_elastic.py``): a tiny GPT under DeepCEEStrategy().

One epoch is 3 optimizer steps (48 Shakespeare windows, global batch 16); a sharded checkpoint is
written after every epoch. Rank 0 appends ``{"step", "loss"}`` to ``losses.jsonl`` after every
step. With ``--die-rank R --die-step S`` the process of rank ``R`` kills itself with SIGKILL after
step ``S`` (a device that dies without a word). With ``--resume`` training starts from the newest
complete checkpoint, on however many devices this run has: the strategy profiles and plans again
and re-partitions the checkpoint onto the new plan.

    python tests/lab/_elastic_worker.py OUT [--die-rank R --die-step S] [--resume]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_deepcee import DeepCEEStrategy
from lightning_deepcee.demo import GPT, ShakespeareDataModule

EPOCHS = 4
TIMEOUT_S = 20.0
"""The strategy's failure bound (``DeepCEEStrategy(timeout_s=...)``) in this test."""


class _Recorder(Callback):
    def __init__(self, out: Path, die_rank: int | None, die_step: int | None) -> None:
        self.out, self.die_rank, self.die_step = out, die_rank, die_step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        step = trainer.global_step
        if trainer.is_global_zero:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            with (self.out / "losses.jsonl").open("a") as f:
                f.write(json.dumps({"step": step, "loss": float(loss)}) + "\n")
        if trainer.global_rank == self.die_rank and step == self.die_step:
            (self.out / "killed_at.txt").write_text(f"{time.time()}\n")
            os.kill(os.getpid(), signal.SIGKILL)


def newest_checkpoint(directory: Path) -> Path:
    """The checkpoint of the latest epoch that was completely written."""
    done = [d for d in directory.glob("epoch=*.ckpt") if (d / "meta.pt").is_file()]
    if not done:
        raise FileNotFoundError(f"no complete checkpoint in {directory}")
    return max(done, key=lambda d: int(d.name.split("=")[1].split(".")[0]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--die-rank", type=int)
    parser.add_argument("--die-step", type=int)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0)
    model = GPT(vocab_size=96, block_size=32, n_layer=3, n_head=2, n_embd=32, learning_rate=3e-3)
    data = ShakespeareDataModule(block_size=32, batch_size=16, max_chars=1710)
    ckpt_dir = args.out / "ckpt"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")),
        # The restart path: the survivors stop, naming the lost device, and a new run resumes
        # (recovery in the survivors' processes: tests/multiprocess/test_recover_in_process.py).
        strategy=DeepCEEStrategy(timeout_s=TIMEOUT_S, recover_in_process=False),
        max_epochs=EPOCHS,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1),
            _Recorder(args.out, args.die_rank, args.die_step),
        ],
        default_root_dir=str(args.out),
    )
    ckpt_path = newest_checkpoint(ckpt_dir) if args.resume else None
    if ckpt_path is not None and trainer.is_global_zero:
        print(f"[elastic] resuming from {ckpt_path}", flush=True)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)


if __name__ == "__main__":
    main()
