"""The receiving side's wait for a CPU (``runtime/stalls.py``): the run delays of the calling
thread and of gloo's I/O threads, read from ``schedstat`` files (a stand-in task directory here,
the process's own at the end)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_deepcee.runtime.stalls import StallClock, StallReading, stalled


def _thread(task_dir: Path, tid: int, name: str, run_delay_ns: int) -> Path:
    folder = task_dir / str(tid)
    folder.mkdir(exist_ok=True)
    (folder / "comm").write_text(name + "\n")
    (folder / "schedstat").write_text(f"1000 {run_delay_ns} 7\n")
    return folder


def test_the_wait_is_the_own_threads_plus_the_longest_io_threads() -> None:
    before = StallReading(1.0, {10: 2.0, 11: 5.0})
    after = StallReading(1.25, {10: 2.5, 11: 5.125, 12: 9.0})  # 12 started since: not counted
    assert stalled(before, after) == pytest.approx(0.25 + 0.5)
    assert stalled(after, after) == 0.0
    assert stalled(StallReading(), StallReading()) == 0.0


def test_the_clock_reads_the_io_threads_it_found_and_forgets_those_that_ended(
    tmp_path: Path,
) -> None:
    loop = _thread(tmp_path, 101, "gloo_tcp_loop", 2_000_000_000)
    _thread(tmp_path, 102, "python", 9_000_000_000)  # not an I/O thread
    own = tmp_path / "own"
    own.write_text("5 500000000 1\n")
    clock = StallClock(str(tmp_path))
    assert clock.read(str(own)) == StallReading(0.5, {})  # none found before a refresh
    clock.refresh()
    first = clock.read(str(own))
    assert first == StallReading(0.5, {101: 2.0})
    (loop / "schedstat").write_text("1000 2080000000 9\n")  # the open file is read afresh
    own.write_text("5 510000000 1\n")
    assert stalled(first, clock.read(str(own))) == pytest.approx(0.01 + 0.08)
    for name in ("comm", "schedstat"):
        (loop / name).unlink()
    loop.rmdir()
    clock.refresh()
    assert clock.read(str(own)).io == {}
    clock.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="schedstat is Linux's")
def test_the_calling_threads_run_delay_is_read_from_the_kernel() -> None:
    def kernel_s() -> float:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9

    clock = StallClock()
    clock.refresh()
    low = kernel_s()
    reading = clock.read()
    assert low <= reading.own <= kernel_s()  # the second field, in seconds, of this thread
    clock.close()
