"""Who failed: this rank's heartbeat, and a failed step's error turned into one that names a rank.

:class:`FailureNaming` is the part of ``DeepCEEStrategy`` that beats in the rendezvous store while
the run lives, and wraps each step (:meth:`FailureNaming.named`): a rank's own error is posted in
the store before it propagates; a failed transfer or collective is explained by another rank's
posted error, or else by the heartbeats (a lost device, named with its stage and host).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from lightning_deepcee.runtime.liveness import (
    Heartbeat,
    agree_group_token,
    default_store,
    explain_failure,
    is_communication_failure,
    report_failure,
)
from lightning_deepcee.strategy.reporting import print_everywhere

__all__ = ["HEARTBEAT_S", "LIVENESS_WAIT_S", "FailureNaming"]

HEARTBEAT_S = 1.0
"""Seconds between a rank's liveness beats in the rendezvous store."""
LIVENESS_WAIT_S = 3.0
"""After a failed step, how long a rank watches the heartbeats to name the lost device."""


class FailureNaming:
    """This rank's heartbeat and the naming of failed steps (see the module docstring)."""

    def __init__(self) -> None:
        self._heartbeat: Heartbeat | None = None
        self._rank, self._world_size = 0, 1
        self._hosts: list[str] = []

    @property
    def hosts(self) -> list[str]:
        """Each rank's device name (host), in rank order."""
        return self._hosts

    def start(self, rank: int, world_size: int, hosts: list[str]) -> None:
        """Beat in the default store (several ranks only); ``hosts`` name each rank's device."""
        self._rank, self._world_size, self._hosts = rank, world_size, hosts
        self.stop()  # one heartbeat per rank, however often set-up runs
        store = default_store()
        if store is not None and world_size > 1:
            self._heartbeat = Heartbeat(store, rank, interval_s=HEARTBEAT_S).start()

    def regrouped(self, hosts: list[str], rank: int) -> None:
        """The process group was re-formed of the devices ``hosts`` (this rank is now ``rank``
        of ``len(hosts)``): keys of the new group, and a heartbeat under them. Collective."""
        agree_group_token()
        self.start(rank, len(hosts), hosts)

    def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None

    @contextmanager
    def named(self, stages: Sequence[Sequence[int]]) -> Iterator[None]:
        """Say who failed: a rank is named by its stage in ``stages`` (the ranks of each) and its
        host."""

        def describe(rank: int) -> str:
            found = [s for s, ranks in enumerate(stages) if rank in ranks]
            where = f"stage {found[0]}" if found else "idle"
            host = self._hosts[rank] if rank < len(self._hosts) else "?"
            return f"rank {rank} ({where}, host {host})"

        try:
            yield
        except Exception as exc:
            if is_communication_failure(exc):
                raise self._lost_device_error(exc, describe) from exc
            store = default_store()
            if self._heartbeat is not None and store is not None:
                report_failure(store, self._rank, exc)
            raise

    def _lost_device_error(self, cause: Exception, describe: Callable[[int], str]) -> RuntimeError:
        """Name the rank whose own error stopped the step or, failing that, the lost device from
        the heartbeats (blocks ``LIVENESS_WAIT_S``)."""
        store = default_store() if self._heartbeat is not None else None
        error = explain_failure(
            cause,
            store=store,
            rank=self._rank,
            world_size=self._world_size,
            describe=describe,
            wait_s=LIVENESS_WAIT_S,
        )
        print_everywhere(f"[rank {self._rank}] {error}")
        return error
