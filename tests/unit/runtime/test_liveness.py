"""Liveness: the heartbeats in a real TCPStore name a rank that stopped without a word."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_deepcee.runtime.liveness import Heartbeat, find_lost_ranks, lost_message
from tests.helpers.ports import free_port


def _store(port: int, master: bool) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", port, is_master=master, timeout=timedelta(seconds=2), wait_for_workers=False
    )


def test_the_silent_rank_is_named_and_exiting_ranks_are_not() -> None:
    port = free_port()
    server = _store(port, True)
    beats = [Heartbeat(_store(port, False), r, interval_s=0.1).start() for r in range(4)]
    beats[2].stop()  # rank 2 dies: its counter stops
    # Rank 3 failed too and exits on its own error: it marks itself, then stops beating.
    find_lost_ranks(_store(port, False), 3, 4, wait_s=0.0)  # marks rank 3 as exiting
    beats[3].stop()
    lost = find_lost_ranks(_store(port, False), 0, 4, wait_s=0.4)
    assert lost == [2]
    for beat in beats:
        beat.stop()
    del server


def test_unreachable_store_blames_its_host_and_messages_say_who() -> None:
    port = free_port()
    server = _store(port, True)
    client = _store(port, False)
    del server  # the process hosting the store is gone
    assert find_lost_ranks(client, 1, 3, wait_s=0.1) is None
    cause = RuntimeError("Connection closed by peer")
    text = lost_message([2], describe=lambda r: f"rank {r} (stage 1)", cause=cause, wait_s=3.0)
    assert text.startswith("lost rank 2 (stage 1): its heartbeat stopped")
    assert "RuntimeError: Connection closed by peer" in text
    text = lost_message(None, describe=lambda r: f"rank {r}", cause=cause, wait_s=3.0)
    assert "rendezvous store is unreachable" in text and "rank 0" in text
    assert "no device's heartbeat stopped" in lost_message(
        [], describe=str, cause=cause, wait_s=3.0
    )


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        Heartbeat(object(), 0, interval_s=0)
