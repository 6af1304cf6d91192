"""Checkpoint saves off the training loop: snapshot now, write and commit in a background thread.

A save copies this rank's part of the checkpoint (every tensor cloned, so training may update the
parameters and optimizer state at once) and hands it to one writer thread per rank. The threads
meet in the rendezvous store, not in a collective of the process group (which the training loop
uses at the same time): all ranks arrive before anyone writes (rank 0 has removed a crashed
save's leftovers by then), every rank writes its files into the hidden ``.NAME.partial``
directory, and when all have written, rank 0 swaps it in place of ``NAME``
(:func:`~lightning_deepcee.runtime.checkpoint.commit_partial`); every rank's save ends with that
commit, so no rank resumes before it. A save interrupted by a lost device never commits, so the
previous checkpoint stays the newest complete one. Removals of older checkpoints wait for the save
in flight to commit, so there is always one complete checkpoint on disk.

One save is in flight at a time: the next save, and the end of training, wait for it. With
``asynchronous=False`` every save waits for its own commit (the classic blocking save).

Runtime layer: torch and torch.distributed's store, never lightning.
"""

from __future__ import annotations

import itertools
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_deepcee.runtime.background import start_thread
from lightning_deepcee.runtime.checkpoint import commit_partial, partial_dir
from lightning_deepcee.runtime.liveness import key_prefix, wait_for_ranks

__all__ = ["CheckpointWriter", "SaveRecord", "snapshot"]

_WRITERS = itertools.count()
"""Numbers the writers of this process; every rank creates the same ones, so the names agree."""


def snapshot(obj: Any) -> Any:
    """``obj`` with every tensor cloned to the CPU (containers copied, other leaves shared)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(snapshot(v) for v in obj)
    return obj


class SaveRecord:
    """What one save cost: ``blocking_s`` on the training loop, ``total_s`` until committed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.began = time.monotonic()
        self.blocking_s = 0.0
        self.total_s: float | None = None


class CheckpointWriter:
    """One rank's checkpoint writer (see the module docstring).

    Args:
        rank: this rank; rank 0 cleans, commits and removes.
        world_size: ranks that take part in every save.
        store: the rendezvous store (``None`` for one process, where no meeting is needed).
        asynchronous: write in the background (``True``) or wait for every commit.
        name: the writer's name in the store, the same on every rank (default: the number of
            writers this process created before, which every rank agrees on).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: Any,
        *,
        asynchronous: bool,
        name: str | None = None,
    ) -> None:
        self.rank, self.world_size, self.store = rank, world_size, store
        self.asynchronous = asynchronous
        self.name = name if name is not None else f"writer{next(_WRITERS)}"
        self._saves = itertools.count()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._after_commit: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._abandoned = threading.Event()
        self.records: list[SaveRecord] = []

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(self, target: Path, write: Callable[[Path], None]) -> SaveRecord:
        """Start saving ``target``: ``write(partial_dir)`` writes this rank's files there.

        ``write`` runs in the writer thread and must only touch the snapshot it closes over.
        Waits for the previous save first (its error, if any, is raised here).
        """
        self.wait()
        record = SaveRecord(target)
        name = f"ckpt/{self.name}/{next(self._saves)}"
        self._thread = start_thread(
            self._run,
            target,
            write,
            name,
            record,
            name=f"deepcee-checkpoint-{self.rank}",
            stop=self._abandoned.set,
        )
        if not self.asynchronous:
            self.wait()
        record.blocking_s = time.monotonic() - record.began
        self.records.append(record)
        return record

    def after_commit(self, action: Callable[[], None]) -> None:
        """Run ``action`` (rank 0: remove an older checkpoint) once the save in flight commits."""
        with self._lock:
            if self.in_flight:
                self._after_commit.append(action)
                return
        action()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the save in flight has finished; raise what went wrong in it.

        With ``timeout_s``, give up after that long and return ``False`` (still in flight).
        """
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return False
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"DeepCEE: a checkpoint save failed: {error}") from error
        return True

    def abandon(self) -> None:
        """Give up the save in flight: its group lost a rank (the previous checkpoint stays
        the newest complete one); the writer thread ends at its next wait."""
        self._abandoned.set()

    def _meet(self, name: str) -> None:
        if self.store is not None and self.world_size > 1:
            stop = self._abandoned.is_set
            wait_for_ranks(self.store, self.rank, self.world_size, name, stop=stop)

    def _run(
        self, target: Path, write: Callable[[Path], None], name: str, record: SaveRecord
    ) -> None:
        partial = partial_dir(target)
        failed = f"{key_prefix()}/{name}/failed"
        try:
            if self.rank == 0 and partial.exists():
                shutil.rmtree(partial)  # a save that crashed earlier
            self._meet(f"{name}/clean")
            try:
                write(partial)
            except BaseException:
                if self.store is not None:
                    self.store.set(failed, str(self.rank))  # nobody commits this save
                raise
            finally:
                self._meet(f"{name}/written")  # arrive even after a failure: nobody hangs
            if self.rank == 0:
                if self.store is not None and self.store.check([failed]):
                    rank = self.store.get(failed).decode()
                    raise RuntimeError(f"rank {rank} could not write its part of {target}")
                commit_partial(target)
            self._meet(f"{name}/committed")  # no rank moves on before the save is complete
            record.total_s = time.monotonic() - record.began
        except BaseException as exc:  # surfaced by wait(); the previous checkpoint stays
            self._error = exc
            with self._lock:
                self._after_commit.clear()
            return
        with self._lock:
            actions, self._after_commit = self._after_commit, []
        for action in actions:
            try:
                action()
            except OSError as exc:  # a removal that failed leaves an extra checkpoint, no harm
                print(f"DeepCEE: could not remove an old checkpoint: {exc}", flush=True)
