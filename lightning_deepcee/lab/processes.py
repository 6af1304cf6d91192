"""A lab device's processes, found through ``/proc`` and ended by id (never by name)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

__all__ = ["kill_process_tree"]


def kill_process_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and all its descendants, found through ``/proc`` (by pid, never by name).

    torchrun starts each worker in a new session, so the agent's process group is not enough.
    Every process found is stopped first, so none can fork a child the walk would miss.
    """
    found: list[int] = []
    while new := [p for p in _descendants(pid) if p not in found]:  # a stopped one cannot fork
        for p in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGSTOP)
        found += new
    for p in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    return found


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path("/proc", entry, "stat").read_text()
            except OSError:
                continue  # exited meanwhile
            ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces or ')'
            children.setdefault(ppid, []).append(int(entry))
    tree = [root]
    for pid in tree:  # the list grows while it is walked: breadth first
        tree += children.get(pid, [])
    return tree
