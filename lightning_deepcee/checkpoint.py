"""Sharded pipeline checkpoints: one file per stage plus ``meta.pt``, and consolidation.

A checkpoint is a directory::

    epoch=0-step=10.ckpt/
        meta.pt        everything Lightning saves except model and optimizer state (rank 0),
                       plus the pipeline layout under "deepcee"
        stage_000.pt   {"state_dict", "optimizer_states", "lr_schedulers"} of stage 0
        stage_001.pt   ...

Stage ``state_dict`` keys are the global parameter names of the unsplit module (other stages'
blocks are ``nn.Identity`` on each rank), so :func:`consolidate_checkpoint` is a plain union that
loads into the unsplit module. Every file is written to a temporary name and renamed into place,
so a crash mid-save never leaves a half-written file under the final name.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["META_FILE", "consolidate_checkpoint", "load_sharded", "save_sharded", "shard_file"]

META_FILE = "meta.pt"
_SHARD_KEYS = ("state_dict", "optimizer_states", "lr_schedulers")


def shard_file(stage_index: int) -> str:
    """File name of one stage's shard."""
    return f"stage_{stage_index:03d}.pt"


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_sharded(
    checkpoint: dict[str, Any],
    directory: Path,
    *,
    stage_index: int,
    write_shard: bool,
    write_meta: bool,
    layout: dict[str, Any],
) -> None:
    """Write this rank's part of ``checkpoint`` (Lightning's dict) under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    shard = {k: checkpoint[k] for k in _SHARD_KEYS if k in checkpoint}
    if write_shard:
        _atomic_save(shard, directory / shard_file(stage_index))
    if write_meta:
        meta = {k: v for k, v in checkpoint.items() if k not in _SHARD_KEYS}
        meta["deepcee"] = dict(layout)
        _atomic_save(meta, directory / META_FILE)


def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(
            f"Pipeline checkpoint file {path} is missing; a DeepCEE checkpoint is a directory "
            f"with {META_FILE} and one stage_NNN.pt per stage."
        )
    return torch.load(path, map_location="cpu", weights_only=False)


def load_sharded(
    directory: Path, *, stage_index: int, expected_ranges: Sequence[tuple[int, int]]
) -> dict[str, Any]:
    """Read ``meta.pt`` and this stage's shard back into one Lightning checkpoint dict."""
    if not directory.is_dir():
        raise ValueError(
            f"{directory} is not a DeepCEE pipeline checkpoint directory (it should contain "
            f"{META_FILE} and stage_NNN.pt files)."
        )
    checkpoint = _load(directory / META_FILE)
    saved = [tuple(r) for r in checkpoint.get("deepcee", {}).get("ranges", [])]
    if saved != [tuple(r) for r in expected_ranges]:
        raise ValueError(
            f"Checkpoint {directory} was saved with the block partition {saved}, but this run "
            f"uses {list(expected_ranges)}. Resume with DeepCEEStrategy(partition={saved}) (and "
            "as many stages), or consolidate it with `deepcee consolidate` and start from the "
            "plain weights."
        )
    checkpoint.update(_load(directory / shard_file(stage_index)))
    return checkpoint


def consolidate_checkpoint(directory: str | Path) -> dict[str, torch.Tensor]:
    """Merge every stage's weights into one ``state_dict`` for the unsplit module."""
    directory = Path(directory)
    meta = _load(directory / META_FILE)
    num_stages = int(meta["deepcee"]["num_stages"])
    merged: dict[str, torch.Tensor] = {}
    for s in range(num_stages):
        state = _load(directory / shard_file(s))["state_dict"]
        overlap = merged.keys() & state.keys()
        if overlap:
            raise ValueError(f"Stages overlap in {sorted(overlap)[:5]}: not a DeepCEE checkpoint.")
        merged.update(state)
    return merged
