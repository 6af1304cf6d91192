"""A device joining a running job: the doorway the job keeps open, and the knock at it.

A running job keeps a note beside its checkpoints (:data:`JOIN_FILE`, written by rank 0 at
set-up and after every re-formed group): where its rendezvous store listens and the token of
its current group. A device that returns starts the same training script with
``DEEPCEE_JOIN=1``; it finds the note in the checkpoint directory every device shares, and
knocks (:func:`knock`): it posts its name under the token in the store, once
(``compare_set``: one device at a time), and waits for the answer. Rank 0 of the job looks for
a knock at every training step (:meth:`Doorway.knocked`, one ``check`` on the store); the job
answers at a step boundary (:meth:`Doorway.answer`) with the checkpoint it saved there, the new
group's key prefix and the device's rank. Both sides then form the new process group over the
same store (:func:`form_group`): the job's ranks keep theirs, the device takes the next.

The keys live in the store's root (not under the default group's prefix), so that a process
outside the group finds them with a plain client of the store.

Runtime layer: torch.distributed, never lightning.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = [
    "JOIN_ENV",
    "JOIN_FILE",
    "Answer",
    "Doorway",
    "JoinError",
    "base_store",
    "form_group",
    "knock",
    "wants_to_join",
]

JOIN_ENV = "DEEPCEE_JOIN"
"""Set to 1 on a device that joins a running job instead of starting one."""
JOIN_FILE = ".deepcee-join.json"
"""The job's note in its checkpoint directory: where to knock."""
_KEYS = "deepcee/join"


class JoinError(RuntimeError):
    """The device cannot join: no running job to join, refused, or no answer in time."""


def wants_to_join() -> bool:
    """Whether this process was started to join a running job (``DEEPCEE_JOIN=1``)."""
    return os.environ.get(JOIN_ENV, "").strip() not in ("", "0")


def base_store(store: Any) -> Any:
    """The TCP store under ``store``'s prefixes (the one a plain client reaches)."""
    while store is not None and not hasattr(store, "port"):
        store = getattr(store, "underlying_store", None)
    if store is None:
        raise JoinError("the process group's store is not a TCP store: nothing can join it")
    return store


@dataclass(frozen=True)
class Answer:
    """The job's answer to a knock."""

    checkpoint: str
    """The checkpoint the job saved for the device to resume from."""
    prefix: str
    """Key prefix of the new group's rendezvous in the store."""
    rank: int
    """The device's rank in the new group."""
    world_size: int
    step: int
    """The job's global step at the boundary where the device joins."""


class Doorway:
    """The job's side of the doorway: rank 0 publishes the note, looks for knocks, answers."""

    def __init__(self) -> None:
        self.token = ""
        self._store: Any = None

    def publish(self, directory: Path, store: Any, hosts: list[str]) -> None:
        """Open the doorway of the group just formed (rank 0): a new token, and the note in
        ``directory`` naming the store and the members."""
        self._store = base_store(store)
        self.token = uuid.uuid4().hex[:12]
        note = {
            "store": [self._store.host, self._store.port],
            "token": self.token,
            "hosts": hosts,
        }
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f"{JOIN_FILE}.partial"
        partial.write_text(json.dumps(note))
        os.replace(partial, directory / JOIN_FILE)

    def knocked(self) -> dict[str, Any] | None:
        """The pending knock (rank 0, once per step), or ``None``."""
        if self._store is None:
            return None
        key = f"{_KEYS}/{self.token}/request"
        if not self._store.check([key]):
            return None
        found = json.loads(self._store.get(key).decode())
        return found if isinstance(found, dict) else None

    def answer(self, knocked: dict[str, Any], reply: dict[str, Any]) -> None:
        """Answer the knock ``knocked`` (rank 0): an :class:`Answer`'s fields, or ``refused``
        with the reason; the doorway is free for the next knock."""
        key = f"{_KEYS}/{self.token}"
        self._store.set(f"{key}/answer/{knocked.get('nonce')}", json.dumps(reply))
        self._store.delete_key(f"{key}/request")

    def group_prefix(self) -> str:
        """Key prefix of the group that admits the pending knock."""
        return f"{_KEYS}/{self.token}/group"


def knock(directory: Path, host: str, *, wait_s: float, poll_s: float = 0.2) -> tuple[Any, Answer]:
    """Knock at the job whose note is in ``directory``; returns the job's store (a client) and
    its answer. Raises :class:`JoinError` when there is no note, the job refuses ``host``, or
    no answer comes within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            note = json.loads((directory / JOIN_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise JoinError(
                f"no running job to join in {directory} ({exc}): start the job first, or start "
                f"this device without {JOIN_ENV}"
            ) from exc
        host_addr, port = note["store"]
        try:
            store = dist.TCPStore(
                host_addr, int(port), is_master=False, timeout=timedelta(seconds=wait_s)
            )
        except (RuntimeError, OSError) as exc:  # DistStoreError / DistNetworkError
            raise JoinError(
                f"the job of {directory} does not answer at {host_addr}:{port} (it may have "
                f"ended): {exc}"
            ) from exc
        key = f"{_KEYS}/{note['token']}"
        nonce = uuid.uuid4().hex[:12]
        payload = json.dumps({"host": host, "nonce": nonce})
        posted = store.compare_set(f"{key}/request", "", payload).decode()
        if posted == payload:
            break
        if time.monotonic() > deadline:  # another device is being admitted
            raise JoinError(f"another device ({posted}) is joining; no turn within {wait_s} s")
        time.sleep(poll_s)  # wait for the next group's note
    answer = f"{key}/answer/{nonce}"
    while not store.check([answer]):
        if time.monotonic() > deadline:
            raise JoinError(f"the job did not answer within {wait_s} s")
        time.sleep(poll_s)
    reply = json.loads(store.get(answer).decode())
    if "refused" in reply:
        raise JoinError(f"the job refused {host}: {reply['refused']}")
    return store, Answer(**reply)


def form_group(
    store: Any, prefix: str, rank: int, world_size: int, *, backend: str, timeout: timedelta
) -> None:
    """Form the new default process group over ``store`` (the base store) under ``prefix``;
    collective over every member (it waits up to ``timeout`` for them)."""
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(prefix, store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
