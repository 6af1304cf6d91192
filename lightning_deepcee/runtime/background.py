"""Background threads that call into torch finish before the interpreter does.

A daemon thread that comes back from a pybind11 call (a store ``add``, a work ``wait``) after the
interpreter has begun to finalize is ended by CPython inside a C++ destructor, and the process
aborts with "terminate called without an active exception" after its work is done: a job that
trained correctly exits -6 and its launcher reports a failure. Every such thread of this package
starts through :func:`start_thread`, which registers it with a stop request; an ``atexit`` hook
(atexit runs before finalization) asks each thread still running to stop and joins it, within
``EXIT_JOIN_S`` in all.

Runtime layer: the standard library only.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable

__all__ = ["EXIT_JOIN_S", "join_background_threads", "start_thread"]

EXIT_JOIN_S = 5.0
"""At exit, how long in all to wait for background threads. They are idle by then on a normal
exit (fit waits for its last checkpoint save, a step joins its receive timers); after a failure
a thread may wait on a lost peer, and the exit should not wait long for it (a thread that
outlasts this is named on the console)."""

_RUNNING: list[tuple[threading.Thread, Callable[[], None] | None]] = []
_LOCK = threading.Lock()


def start_thread(
    target: Callable[..., object],
    *args: object,
    name: str,
    stop: Callable[[], None] | None = None,
) -> threading.Thread:
    """Start a daemon thread running ``target(*args)`` that the exit hook will join;
    ``stop`` (when given) asks it to finish early, and the hook calls it first."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    with _LOCK:
        _RUNNING[:] = [entry for entry in _RUNNING if entry[0].is_alive()]
        _RUNNING.append((thread, stop))
    thread.start()
    return thread


def join_background_threads(timeout_s: float = EXIT_JOIN_S) -> list[str]:
    """Ask every registered thread still running to stop, and join them within ``timeout_s``
    in all; returns the names of those still running (they stay registered; the exit hook
    prints them)."""
    with _LOCK:
        running = [entry for entry in _RUNNING if entry[0].is_alive()]
    for _, stop in running:
        if stop is not None:
            stop()
    deadline = time.monotonic() + timeout_s
    for thread, _ in running:
        thread.join(max(0.0, deadline - time.monotonic()))
    with _LOCK:
        _RUNNING[:] = [entry for entry in _RUNNING if entry[0].is_alive()]
    return [thread.name for thread, _ in running if thread.is_alive()]


def _at_exit() -> None:
    left = join_background_threads()
    if left:
        print(
            f"DeepCEE: background threads still running at exit after {EXIT_JOIN_S:.0f} s: "
            f"{', '.join(left)} (a blocked store or peer); the process may abort as it exits",
            flush=True,
        )


atexit.register(_at_exit)
