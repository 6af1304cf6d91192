"""Re-form the process group among the ranks that survived a lost device, in the same processes.

After a step fails because a device is gone, every survivor first leaves the old group
(:func:`leave_group`): its sockets close, so a survivor still blocked on a transfer with it
fails at once instead of after the group's timeout, and recovers too. Then it calls
:func:`agree_survivors`: it posts itself in the rendezvous store, waits until every rank it does
not believe lost has posted (or ``wait_s`` has passed), and the first survivor to finish writes
the member list with one ``compare_set``; every survivor reads that list, so all of them agree
on it even when their views of who was lost differed. :func:`reform_group` then forms a new
default group of the members (new ranks in the order of their old ones) over the same store,
under a prefix of its own. The store must have survived: it lives with the launcher of the
store host, so a job that lost that host restarts instead (the caller's choice).

Keys live under the liveness prefix of the group's token (:func:`~.liveness.key_prefix`), which
the new group replaces with a fresh token, so each re-formed group has keys of its own.

Runtime layer: torch.distributed, never lightning.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import socket
import time
from collections.abc import Collection
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_deepcee._compat import default_store
from lightning_deepcee.runtime.liveness import key_prefix

__all__ = [
    "REGROUP_WAIT_S",
    "RegroupError",
    "agree_survivors",
    "leave_group",
    "reform_group",
    "shut_group_connections",
]

REGROUP_WAIT_S = 30.0
"""How long a survivor waits for the others it believes alive to post themselves."""


class RegroupError(RuntimeError):
    """This rank cannot join the re-formed group (the store is gone, or it was left out)."""


def agree_survivors(
    store: Any,
    rank: int,
    world_size: int,
    lost: Collection[int],
    *,
    wait_s: float = REGROUP_WAIT_S,
    poll_s: float = 0.05,
) -> list[int]:
    """The old ranks of the re-formed group, agreed by every survivor (see the module docstring).

    ``lost``: the ranks this rank believes gone (they are not waited for, but join the list if
    they post in time). Raises :class:`RegroupError` when the store is unreachable or the
    decided list leaves this rank out (it posted too late)."""
    key = f"{key_prefix()}/regroup"
    expected = [r for r in range(world_size) if r not in set(lost)]
    try:
        store.set(f"{key}/alive/{rank}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            posted = [r for r in range(world_size) if store.check([f"{key}/alive/{r}"])]
            decided = store.check([f"{key}/members"])
            if decided or set(expected) <= set(posted) or time.monotonic() >= deadline:
                break
            time.sleep(poll_s)
        stored = store.compare_set(f"{key}/members", "", json.dumps(posted))
    except RegroupError:
        raise
    except Exception as exc:  # the store went with the lost device
        raise RegroupError(f"the rendezvous store is unreachable ({exc})") from exc
    members = [int(r) for r in json.loads(stored)]
    if rank not in members:
        raise RegroupError(
            f"rank {rank} posted after the survivors {members} had formed their group"
        )
    return members


def leave_group() -> tuple[Any, str]:
    """Destroy every process group of this process; returns the default group's store and
    backend, for :func:`agree_survivors` and :func:`reform_group`.

    A peer blocked on this rank must fail now, as it would if this process had died: a gloo
    group closes its sockets only when nothing holds it any more (a collective still waiting
    in the group's worker thread does), and gloo waits cannot be interrupted. So the group's
    connections are shut down too (:func:`shut_group_connections`)."""
    store, backend = default_store(), dist.get_backend()
    dist.destroy_process_group()
    gc.collect()
    shut_group_connections(_store_port(store))
    return store, backend


def _store_port(store: Any) -> int | None:
    while store is not None and not hasattr(store, "port"):
        store = getattr(store, "underlying_store", None)
    return getattr(store, "port", None)


def shut_group_connections(store_port: int | None) -> int:
    """Shut down this process's TCP connections between two ephemeral ports (gloo's pairs: each
    side listens on a port the kernel chose), except the store's; returns how many. A logger's
    or a data service's connections go to a fixed server port and stay. Linux only (``/proc``);
    elsewhere nothing is shut and peers fail after the group's timeout."""
    low, high = _ephemeral_ports()
    inodes: dict[str, tuple[int, int]] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "01":  # ESTABLISHED
                continue
            ports = (int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16))
            if store_port not in ports and all(low <= p <= high for p in ports):
                inodes[f"socket:[{fields[9]}]"] = ports
    shut, descriptors = 0, []
    with contextlib.suppress(OSError):
        descriptors = os.listdir("/proc/self/fd")
    for fd in descriptors if inodes else []:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") in inodes:
                with socket.socket(fileno=os.dup(int(fd))) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
                shut += 1
    return shut


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def reform_group(
    store: Any, members: list[int], rank: int, *, backend: str, timeout: timedelta
) -> int:
    """Form a new default process group of ``members`` (old ranks, in the order of the new
    ranks) over ``store`` (the old group's, from :func:`leave_group`); returns this rank's new
    rank. Collective over the members."""
    new_rank = members.index(rank)
    prefix = f"{key_prefix()}/regroup/group"
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(prefix, store),
        rank=new_rank,
        world_size=len(members),
        timeout=timeout,
    )
    return new_rank
