"""Liveness: tell which device was lost when a step fails.

A failed transfer or collective says little about *who* is gone: gloo reports "connection closed
by peer" for the dead device and equally for a healthy device that has just exited because of
its own error, and a timeout names nobody. So every rank runs a :class:`Heartbeat`, a daemon
thread that increments a counter of its own in the rendezvous store (the ``TCPStore`` every
``torch.distributed`` job already has) every ``interval_s``. When a step fails,
:func:`find_lost_ranks` marks this rank as exiting, reads every counter twice, ``wait_s`` apart,
and names the ranks whose counter stood still and that did not mark themselves: those stopped
without a word. Healthy ranks that exit because of the failure mark themselves first, so they are
never blamed. If the store itself is unreachable, the process that hosts it (rank 0's launcher) is
the one lost.

Keys carry the worker group's token (:func:`agree_group_token`), so a restart under torchrun's
agent (which may keep the store) never reads the counters of the attempt before.

Runtime layer: torch.distributed, never lightning.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from lightning_deepcee._compat import default_store
from lightning_deepcee.runtime.background import start_thread
from lightning_deepcee.runtime.transport import PeerLostError

__all__ = [
    "DeviceLostError",
    "Heartbeat",
    "RankFailedError",
    "agree_group_token",
    "default_store",
    "explain_failure",
    "failed_ranks",
    "failure_message",
    "find_lost_ranks",
    "is_communication_failure",
    "key_prefix",
    "lost_message",
    "report_failure",
    "wait_for_ranks",
]


class DeviceLostError(RuntimeError):
    """A device (or its link) was lost during a step; ``lost_ranks`` names it when known."""

    def __init__(self, message: str, lost_ranks: Sequence[int] | None) -> None:
        super().__init__(message)
        self.lost_ranks = None if lost_ranks is None else tuple(lost_ranks)


_GROUP = {"token": ""}
"""The worker group's token (:func:`agree_group_token`): it names every key of this module."""


def agree_group_token() -> str:
    """Give every rank of this worker group the same fresh key prefix (collective, once per job
    start, before any :class:`Heartbeat`).

    An elastic restart may keep the rendezvous store of the attempt before, so its keys must
    differ; and ``TORCHELASTIC_RESTART_COUNT`` cannot tell attempts apart, since every node's
    agent counts its own restarts (a node that joins later starts at 0). Rank 0 draws a token
    and broadcasts it.
    """
    token = [uuid.uuid4().hex[:12] if dist.get_rank() == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(token, src=0)
    _GROUP["token"] = str(token[0])
    return _GROUP["token"]


def _prefix() -> str:
    return (
        f"deepcee/liveness/{_GROUP['token'] or os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    )


def key_prefix() -> str:
    """The prefix of this worker group's keys in the store (for other modules' keys)."""
    return _prefix()


class Heartbeat:
    """A daemon thread that increments ``<prefix>/beat/<rank>`` in ``store`` every ``interval_s``.

    Errors (a store that went away) stop the thread quietly: the failure shows in the step, and
    :func:`find_lost_ranks` reports it there.
    """

    def __init__(self, store: Any, rank: int, *, interval_s: float = 1.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s: expected a positive number of seconds, got {interval_s}")
        self.store, self.rank, self.interval_s = store, rank, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        """Beat once now (so every live rank has a key), then every ``interval_s`` in a thread."""
        self.store.add(f"{_prefix()}/beat/{self.rank}", 1)
        self._thread = start_thread(
            self._run, name=f"deepcee-heartbeat-{self.rank}", stop=self._stop.set
        )
        return self

    def _run(self) -> None:
        key = f"{_prefix()}/beat/{self.rank}"
        while not self._stop.wait(self.interval_s):
            try:
                self.store.add(key, 1)
            except Exception:  # the store is gone: the step will fail and say so
                return

    def stop(self) -> None:
        """Stop beating (idempotent); waits at most one interval for the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 1.0)
            self._thread = None


def _beats(store: Any, world_size: int) -> list[int]:
    # add(key, 0) reads a counter without a wait, and creates it (at 0) if a rank never beat.
    return [int(store.add(f"{_prefix()}/beat/{r}", 0)) for r in range(world_size)]


def find_lost_ranks(store: Any, rank: int, world_size: int, *, wait_s: float) -> list[int] | None:
    """Ranks whose heartbeat stopped without an exit mark; None when the store is unreachable.

    Marks ``rank`` as exiting first. Blocks for ``wait_s`` (give it at least two heartbeat
    intervals, so every live rank beats at least once in between).
    """
    try:
        store.set(f"{_prefix()}/exit/{rank}", "1")
        before = _beats(store, world_size)
        time.sleep(wait_s)
        after = _beats(store, world_size)
        exited = [store.check([f"{_prefix()}/exit/{r}"]) for r in range(world_size)]
    except Exception:
        return None
    return [r for r in range(world_size) if r != rank and after[r] == before[r] and not exited[r]]


class RankFailedError(RuntimeError):
    """Another rank failed with its own error (a model bug, a bad batch) and this rank stopped
    because of it; ``failed`` maps each such rank to its error's type and message."""

    def __init__(self, message: str, failed: dict[int, str]) -> None:
        super().__init__(message)
        self.failed = dict(failed)


def report_failure(store: Any, rank: int, error: BaseException) -> None:
    """Post this rank's own error (type and message) and mark it as exiting, so the ranks its
    exit breaks report that error instead of a lost device. Best effort: a store that went
    away changes nothing."""
    text = f"{type(error).__name__}: {error}"
    try:
        store.set(f"{_prefix()}/error/{rank}", text[:4000])
        store.set(f"{_prefix()}/exit/{rank}", "1")
    except Exception:
        return


def failed_ranks(store: Any, world_size: int) -> dict[int, str]:
    """The errors ranks posted with :func:`report_failure` (none when the store is gone)."""
    failed: dict[int, str] = {}
    try:
        for r in range(world_size):
            key = f"{_prefix()}/error/{r}"
            if store.check([key]):
                failed[r] = store.get(key).decode(errors="replace")
    except Exception:
        return failed
    return failed


def failure_message(
    failed: dict[int, str], *, describe: Callable[[int], str], cause: BaseException
) -> str:
    """The error text on the ranks that stopped because another rank failed."""
    parts = "; ".join(f"{describe(r)} failed with {text}" for r, text in sorted(failed.items()))
    return (
        f"{parts}. This rank stopped because of it (its step then failed with "
        f"{type(cause).__name__}: {cause})"
    )


def lost_message(
    lost: Sequence[int] | None,
    *,
    describe: Callable[[int], str],
    cause: BaseException,
    wait_s: float,
) -> str:
    """The error text: who was lost (``describe(rank)`` gives "rank 2 (stage 1, host edge0)")."""
    if lost is None:
        who = (
            "the rendezvous store is unreachable, so the device that hosts it is lost: "
            f"{describe(0)} (or its launcher)"
        )
    elif lost:
        who = "lost " + ", ".join(describe(r) for r in lost) + ": its heartbeat stopped"
    else:
        who = (
            f"no device's heartbeat stopped within {wait_s:.1f} s: a link is down or a peer is "
            "too slow for the timeout"
        )
    return f"{who}. The step failed with {type(cause).__name__}: {cause}"


def wait_for_ranks(
    store: Any,
    rank: int,
    world_size: int,
    name: str,
    *,
    stale_s: float = 15.0,
    limit_s: float = 1800.0,
    poll_s: float = 0.2,
    on_arrival: Callable[[int, float], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> None:
    """Count ``rank`` in at ``name`` and block until all ``world_size`` ranks are in.

    For a wait whose length nobody knows in advance (a slow device timing its blocks): a
    collective would fail after the process group's timeout, however alive the device it waits
    for. Here a rank still working is waited for as long as its :class:`Heartbeat` advances; one
    whose heartbeat stands still for ``stale_s`` raises :class:`DeviceLostError` naming it. A rank
    that runs no heartbeat (its counter stays 0) is waited for up to ``limit_s``. Every rank must
    call this with the same ``name``, once. ``on_arrival(rank, seconds)``, when given, is told
    of each rank as this one sees it arrive (about once a second; the last ones at the end),
    with the seconds since this rank arrived: progress for a console. ``stop()`` returning
    True gives up (``RuntimeError``): the group waited in no longer exists.
    """
    key = f"{_prefix()}/arrive/{name}"
    store.set(f"{key}/{rank}", "1")
    store.add(key, 1)
    start = last_check = time.monotonic()
    beats = _beats(store, world_size)
    moved = [start] * world_size
    told: set[int] = set()

    def tell(arrived: list[int]) -> None:
        for r in arrived:
            if on_arrival is not None and r not in told:
                told.add(r)
                on_arrival(r, time.monotonic() - start)

    while int(store.add(key, 0)) < world_size:
        time.sleep(poll_s)
        if stop is not None and stop():
            raise RuntimeError(f"waiting at {name!r}: given up (the group was re-formed)")
        now = time.monotonic()
        if now - last_check < 1.0:
            continue
        last_check = now
        latest = _beats(store, world_size)
        moved = [now if b != a else t for a, b, t in zip(beats, latest, moved, strict=True)]
        beats = latest
        waiting = [r for r in range(world_size) if not store.check([f"{key}/{r}"])]
        tell([r for r in range(world_size) if r not in waiting])
        lost = [r for r in waiting if beats[r] > 0 and now - moved[r] > stale_s]
        if lost or now - start > limit_s:
            raise DeviceLostError(
                f"waiting at {name!r} for rank(s) {waiting}: "
                + (
                    f"the heartbeat of {lost} stood still for {stale_s:.0f} s"
                    if lost
                    else f"still not there after {limit_s:.0f} s"
                ),
                lost or None,
            )
    tell(list(range(world_size)))


def is_communication_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a failed transfer or collective, not a model bug."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (PeerLostError, dist.DistError)):
            return True
        text = str(current).lower()
        if any(word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout")):
            return True
        current = current.__cause__ or current.__context__
    return False


def explain_failure(
    cause: Exception,
    *,
    store: Any | None,
    rank: int,
    world_size: int,
    describe: Callable[[int], str],
    wait_s: float,
) -> RuntimeError:
    """The error a rank raises when its transfer or collective failed: another rank's posted
    error (:class:`RankFailedError`) or else the lost device from the heartbeats
    (:class:`DeviceLostError`). Blocks ``wait_s`` to read the heartbeats; ``store`` None (no
    heartbeats) names nobody."""
    lost: list[int] | None = []
    if store is not None:
        lost = find_lost_ranks(store, rank, world_size, wait_s=wait_s)
        failed = failed_ranks(store, world_size)
        failed.pop(rank, None)
        if failed:
            text = failure_message(failed, describe=describe, cause=cause)
            return RankFailedError(f"DeepCEEStrategy: {text}", failed)
    message = "DeepCEEStrategy: " + lost_message(
        lost, describe=describe, cause=cause, wait_s=wait_s
    )
    return DeviceLostError(message, lost if lost is not None else [0])
