"""CheckpointWriter: background saves that commit only when every rank wrote; newest_checkpoint.

Two writer objects share one in-memory store and stand for two ranks (threads, no processes):
what matters here is the order of the files on disk, not the transport.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_deepcee.runtime.checkpoint import META_FILE, newest_checkpoint, partial_dir
from lightning_deepcee.runtime.checkpoint_writer import CheckpointWriter, snapshot


def _pair(asynchronous: bool = True) -> tuple[CheckpointWriter, CheckpointWriter]:
    store = dist.HashStore()
    return (
        CheckpointWriter(0, 2, store, asynchronous=asynchronous, name="w"),
        CheckpointWriter(1, 2, store, asynchronous=asynchronous, name="w"),
    )


def _writer(name: str, gate: threading.Event | None = None, fail: bool = False):  # type: ignore[no-untyped-def]
    def write(directory: Path) -> None:
        if gate is not None:
            assert gate.wait(10)
        if fail:
            raise OSError("disk full")
        directory.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(name)

    return write


def test_save_returns_at_once_and_commits_when_every_rank_wrote(tmp_path: Path) -> None:
    zero, one = _pair()
    target = tmp_path / "step=3.ckpt"
    gate = threading.Event()
    began = time.monotonic()
    record = zero.save(target, _writer(META_FILE))
    one.save(target, _writer("stage_001.pt", gate))
    assert time.monotonic() - began < 5 and record.blocking_s < 5
    time.sleep(0.5)
    assert not target.exists(), "committed before rank 1 wrote its part"
    gate.set()
    assert zero.wait() and one.wait()
    assert sorted(p.name for p in target.iterdir()) == [META_FILE, "stage_001.pt"]
    assert not partial_dir(target).exists()
    assert record.total_s is not None and record.total_s >= 0.5


def test_a_failed_part_never_replaces_the_previous_checkpoint(tmp_path: Path) -> None:
    zero, one = _pair()
    target = tmp_path / "last.ckpt"
    target.mkdir()
    (target / META_FILE).write_text("previous")
    zero.save(target, _writer(META_FILE))
    one.save(target, _writer("stage_001.pt", fail=True))
    with pytest.raises(RuntimeError, match="disk full"):
        one.wait()
    with pytest.raises(RuntimeError, match="rank 1 could not write"):
        zero.wait()
    assert (target / META_FILE).read_text() == "previous"
    # The next save cleans the leftovers and commits.
    zero.save(target, _writer(META_FILE))
    one.save(target, _writer("stage_001.pt"))
    assert zero.wait() and one.wait()
    assert (target / META_FILE).read_text() == META_FILE


def test_removal_waits_for_the_save_in_flight(tmp_path: Path) -> None:
    zero, one = _pair()
    old = tmp_path / "step=3.ckpt"
    old.mkdir()
    gate = threading.Event()
    zero.save(tmp_path / "step=6.ckpt", _writer(META_FILE))
    one.save(tmp_path / "step=6.ckpt", _writer("stage_001.pt", gate))
    zero.after_commit(lambda: old.rmdir())
    time.sleep(0.3)
    assert old.exists(), "removed before the newer checkpoint was complete"
    gate.set()
    zero.wait()
    one.wait()
    assert not old.exists() and (tmp_path / "step=6.ckpt").is_dir()
    # Nothing in flight: a removal runs at once.
    again = tmp_path / "x"
    again.mkdir()
    zero.after_commit(lambda: again.rmdir())
    assert not again.exists()


def test_blocking_writer_waits_for_its_commit(tmp_path: Path) -> None:
    (alone,) = [CheckpointWriter(0, 1, None, asynchronous=False)]
    target = tmp_path / "a.ckpt"
    alone.save(target, _writer(META_FILE))
    assert (target / META_FILE).is_file() and not alone.in_flight


def test_snapshot_is_independent_of_training() -> None:
    weight = torch.ones(3)
    state = {"state_dict": {"w": weight}, "optimizer_states": [{"state": {0: (weight, 1)}}]}
    frozen = snapshot(state)
    weight.add_(1)
    assert torch.equal(frozen["state_dict"]["w"], torch.ones(3))
    assert torch.equal(frozen["optimizer_states"][0]["state"][0][0], torch.ones(3))
    assert frozen["optimizer_states"][0]["state"][0][1] == 1


def _complete(path: Path, mtime: float) -> None:
    path.mkdir()
    (path / META_FILE).write_text("m")
    os.utime(path / META_FILE, (mtime, mtime))


def test_newest_checkpoint_counts_complete_saves_only(tmp_path: Path) -> None:
    assert newest_checkpoint(tmp_path / "missing") is None
    assert newest_checkpoint(tmp_path) is None
    _complete(tmp_path / "step=3.ckpt", 1000)
    _complete(tmp_path / "step=6.ckpt", 2000)
    partial_dir(tmp_path / "step=9.ckpt").mkdir()  # a save in progress
    (partial_dir(tmp_path / "step=9.ckpt") / META_FILE).write_text("m")
    (tmp_path / "step=12.ckpt").mkdir()  # no meta: not complete
    assert newest_checkpoint(tmp_path) == tmp_path / "step=6.ckpt"
    # A crash between the two renames of a swap: the previous state stands for its name.
    _complete(tmp_path / ".last.ckpt.old", 3000)
    assert newest_checkpoint(tmp_path) == tmp_path / "last.ckpt"
