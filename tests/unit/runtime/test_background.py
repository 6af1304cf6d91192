"""Background threads that call into torch are joined before the interpreter finalizes.

A daemon thread that returns from a store call while the interpreter finalizes aborts the
process ("terminate called without an active exception", exit -6) after its work is done. The
script below keeps such a thread busy in ``TCPStore.add`` while a slow object is torn down at
exit: started through ``start_thread`` it is stopped and joined by the exit hook, and the
process exits 0.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

from lightning_deepcee.runtime.background import join_background_threads, start_thread

SCRIPT = textwrap.dedent(
    """
    import datetime, threading, time
    import torch.distributed as dist
    from lightning_deepcee.runtime.background import start_thread

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5))
    stop = threading.Event()

    def beat():
        while not stop.is_set():
            store.add("beat", 1)

    start_thread(beat, name="beat", stop=stop.set)

    class SlowTeardown:
        def __del__(self):
            time.sleep(0.5)

    slow = SlowTeardown()
    time.sleep(0.2)
    print("done", flush=True)
    """
)


def test_a_thread_busy_in_the_store_at_exit_does_not_abort_the_process() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "done" in done.stdout
    assert "terminate called" not in done.stderr


def test_join_asks_each_thread_to_stop_and_names_those_that_outlast_the_wait() -> None:
    stop = threading.Event()
    stuck = threading.Event()
    start_thread(stop.wait, name="stops-when-asked", stop=stop.set)
    start_thread(stuck.wait, 30.0, name="never-asked")
    assert join_background_threads(timeout_s=0.3) == ["never-asked"]
    assert stop.is_set()
    stuck.set()  # the one still running stays registered, and is joined now
    assert join_background_threads(timeout_s=5.0) == []
