"""wait_for_ranks tells its caller of each rank as it arrives (profiling's progress lines)."""

from __future__ import annotations

import threading
import time

from torch.distributed import HashStore

from lightning_deepcee.runtime.liveness import wait_for_ranks


def test_each_rank_is_told_once_and_the_late_one_last() -> None:
    store = HashStore()
    told: list[tuple[int, float]] = []
    early = threading.Thread(target=wait_for_ranks, args=(store, 1, 3, "blocks"))
    late = threading.Timer(1.6, wait_for_ranks, args=(store, 2, 3, "blocks"))
    early.start()
    late.start()
    start = time.monotonic()
    wait_for_ranks(store, 0, 3, "blocks", on_arrival=lambda r, s: told.append((r, s)))
    early.join()
    late.join()
    assert sorted(r for r, _ in told) == [0, 1, 2]
    assert told[-1][0] == 2 and told[-1][1] >= 1.0  # seen when it came, after the others
    assert time.monotonic() - start >= 1.5
