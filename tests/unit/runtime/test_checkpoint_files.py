"""Checkpoint files: an interrupted save never replaces or corrupts the previous checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_deepcee.runtime.checkpoint import (
    commit_partial,
    consolidate_checkpoint,
    load_sharded,
    partial_dir,
    repartition,
    save_sharded,
)

RANGES = [(0, 1), (1, 2)]


def _save(directory: Path, value: float, stages: tuple[int, ...] = (0, 1)) -> None:
    for s in stages:
        checkpoint = {
            "state_dict": {f"b{s}.w": torch.full((2,), value)},
            "optimizer_states": [],
            "global_step": int(value),
        }
        save_sharded(
            checkpoint, partial_dir(directory), stage_index=s, write_shard=True,
            write_meta=s == 0, layout={"num_stages": 2, "ranges": RANGES},
        )  # fmt: skip


def test_interrupted_save_keeps_previous(tmp_path: Path) -> None:
    ckpt = tmp_path / "last.ckpt"
    _save(ckpt, 1.0)
    commit_partial(ckpt)
    _save(ckpt, 2.0, stages=(0,))  # the save of step 2 dies before stage 1 wrote, no commit
    loaded = load_sharded(ckpt, stage_index=1, expected_ranges=RANGES)
    assert loaded["global_step"] == 1
    torch.testing.assert_close(loaded["state_dict"]["b1.w"], torch.full((2,), 1.0))
    # The next complete save replaces the stale partial directory and the old checkpoint.
    _save(ckpt, 3.0)
    commit_partial(ckpt)
    assert consolidate_checkpoint(ckpt)["b0.w"].tolist() == [3.0, 3.0]
    assert not partial_dir(ckpt).exists()


def test_crash_between_the_swap_renames_is_recovered(tmp_path: Path) -> None:
    ckpt = tmp_path / "last.ckpt"
    _save(ckpt, 1.0)
    commit_partial(ckpt)
    ckpt.rename(tmp_path / ".last.ckpt.old")  # the first rename of the next swap happened
    loaded = load_sharded(ckpt, stage_index=0, expected_ranges=RANGES)
    assert loaded["global_step"] == 1


def test_other_partition_returns_all_shards_and_repartitions(tmp_path: Path) -> None:
    ckpt = tmp_path / "c.ckpt"
    _save(ckpt, 1.0)
    commit_partial(ckpt)
    loaded = load_sharded(ckpt, stage_index=0, expected_ranges=[(0, 2)])
    shards = loaded["deepcee_shards"]
    assert len(shards) == 2
    with pytest.raises(ValueError, match="optimizer_param_names"):
        repartition(shards, ["b0.w", "b1.w"], [])
    for s in shards:
        s["optimizer_param_names"] = []
    local = repartition(shards, ["b0.w", "b1.w"], [])
    assert set(local["state_dict"]) == {"b0.w", "b1.w"}
