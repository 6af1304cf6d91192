"""How long this process waited for a CPU: how late a receive's stamp can be on a starved device.

A payload received ahead is stamped by a timer thread that wakes once gloo's I/O thread
(``gloo_tcp_loop``) has read it. Where the process is short of CPU (its CFS quota spent for the
period, as under a container's CPU limit and on the lab's devices, or cores shared with busy
tenants) either thread can wait runnable before it runs: up to the throttled part of a period,
85 ms at 0.15 of a core in 100 ms periods. A LAN transfer of 1.4 ms then reads as tens of
milliseconds, a link at a tenth of its speed or less.

Linux counts each thread's time spent runnable but not running, time throttled by the quota
included: the second field of ``/proc/<pid>/task/<tid>/schedstat``, in nanoseconds.
:class:`StallClock` reads it for the calling thread and for the process's gloo I/O threads;
:func:`stalled` between two readings of one thread is how long the receiving side waited for a
CPU meanwhile (the calling thread's wait plus the longest I/O thread's). Part of that wait may
have passed while the payload was still on its way, so the interval less it is a lower bound of
the payload's time on the link. Where the files do not exist (not Linux) readings are empty and
nothing is stalled.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["IO_THREAD_NAMES", "StallClock", "StallReading", "process_clock", "stalled"]

IO_THREAD_NAMES = ("gloo_tcp_loop",)
"""Names (``comm``) of the threads that read payloads off the sockets."""


@dataclass(frozen=True, slots=True)
class StallReading:
    """Seconds spent runnable but not running so far: the calling thread's, and each I/O
    thread's by thread id."""

    own: float = 0.0
    io: Mapping[int, float] = field(default_factory=dict)


def _run_delay(raw: bytes) -> float:
    """The second field of a ``schedstat`` line, in seconds."""
    return int(raw.split()[1]) / 1e9


def stalled(before: StallReading, after: StallReading) -> float:
    """Seconds the receiving side waited for a CPU between two readings of one thread: the
    thread's own wait plus the longest wait of an I/O thread seen in both (at least 0)."""
    common = after.io.keys() & before.io.keys()
    io = max((after.io[t] - before.io[t] for t in common), default=0.0)
    return max(after.own - before.own, 0.0) + max(io, 0.0)


class StallClock:
    """Reads the run delays of the calling thread and of the process's I/O threads.

    The I/O threads' ``schedstat`` files stay open (a reading is one ``pread`` each);
    :meth:`refresh` finds threads started since (a new process group starts its own) and closes
    the files of threads that ended. Safe to read from several threads at once.
    """

    def __init__(
        self, task_dir: str = "/proc/self/task", names: Iterable[str] = IO_THREAD_NAMES
    ) -> None:
        self._task_dir = task_dir
        self._names = frozenset(names)
        self._io: dict[int, int] = {}  # thread id -> descriptor of its schedstat
        self._others: set[int] = set()  # threads seen that are not I/O threads
        self._lock = threading.Lock()
        self._own_path = "/proc/thread-self/schedstat" if task_dir == "/proc/self/task" else None

    def refresh(self) -> None:
        """Look for I/O threads among the threads started since the last call (a thread's name
        is read once); forget (and close) those that ended."""
        try:
            tids = [int(name) for name in os.listdir(self._task_dir) if name.isdigit()]
        except OSError:
            return
        with self._lock:
            found: dict[int, int] = {}
            self._others.intersection_update(tids)
            for tid in tids:
                if tid in self._io:
                    found[tid] = self._io.pop(tid)
                    continue
                if tid in self._others:
                    continue
                try:
                    with open(f"{self._task_dir}/{tid}/comm", "rb") as f:
                        name = f.read().strip().decode(errors="replace")
                    if name in self._names:
                        found[tid] = os.open(f"{self._task_dir}/{tid}/schedstat", os.O_RDONLY)
                    else:
                        self._others.add(tid)
                except OSError:
                    continue  # the thread ended meanwhile
            for fd in self._io.values():
                os.close(fd)
            self._io = found

    def read(self, own_path: str | None = None) -> StallReading:
        """The run delays now: the calling thread's (``own_path``: another file, for tests) and
        each I/O thread's."""
        path = own_path or self._own_path
        own = 0.0
        if path is not None:
            try:
                with open(path, "rb") as f:
                    own = _run_delay(f.read())
            except (OSError, ValueError, IndexError):
                own = 0.0
        io: dict[int, float] = {}
        with self._lock:
            for tid, fd in self._io.items():
                try:
                    io[tid] = _run_delay(os.pread(fd, 128, 0))
                except (OSError, ValueError, IndexError):
                    continue  # the thread ended: refresh() closes it
        return StallReading(own, io)

    def close(self) -> None:
        """Close the open files."""
        with self._lock:
            for fd in self._io.values():
                os.close(fd)
            self._io = {}


_PROCESS_CLOCK: StallClock | None = None


def process_clock() -> StallClock:
    """The process's clock (made at the first call): every transport of the process shares it."""
    global _PROCESS_CLOCK
    if _PROCESS_CLOCK is None:
        _PROCESS_CLOCK = StallClock()
    return _PROCESS_CLOCK
