"""What the worker scripts under tests/multiprocess/workers/ share: their command line, the
Trainer settings that keep a run quiet, and how a rank saves what the test compares."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_deepcee import consolidate_checkpoint

QUIET: dict[str, Any] = dict(
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
)
"""Trainer arguments: no logger, checkpoints, progress bar, summary or sanity validation."""


def run_configs(run: Callable[[dict[str, Any], Path], None]) -> None:
    """``worker.py OUT_DIR CONFIGS_JSON``: ``run(cfg, OUT_DIR)`` for each config in turn."""
    out = Path(sys.argv[1])
    for cfg in json.loads(Path(sys.argv[2]).read_text()):
        run(cfg, out)


def save_params(model: torch.nn.Module, path: Path) -> None:
    """The model's state dict, detached and on the CPU, at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, path)


def save_consolidated(trainer: pl.Trainer, target: Path) -> None:
    """A pipeline checkpoint at ``target/final.ckpt``; rank 0 consolidates it into
    ``target/consolidated.pt`` while the other ranks wait."""
    trainer.save_checkpoint(target / "final.ckpt")
    if int(os.environ["RANK"]) == 0:
        torch.save(consolidate_checkpoint(target / "final.ckpt"), target / "consolidated.pt")
    trainer.strategy.barrier()
