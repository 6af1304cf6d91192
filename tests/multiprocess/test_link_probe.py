"""LinkProbe over gloo: the receiver gets samples of the message size with wire times, the
sender rests between rounds and sizes its next payload by ``resize``, a rank outside the pair
gets no probe, both ends stop cleanly at the same step, and training's own messages on the
default group pass meanwhile."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_deepcee.runtime.probe import LinkProbe, open_link_probe

pytestmark = pytest.mark.multiprocess

WORLD = 3
SIZE = 512 * 2**10
NEXT = 96 * 2**10


def _next_size(rate: float) -> int:
    """The probe's resize: the rate was positive, and the next payload is NEXT bytes."""
    assert rate > 0
    return NEXT


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    probe = open_link_probe((0, 2), rank, SIZE, resize=_next_size)
    samples = []
    chain = []
    for _ in range(10):  # "steps": a chain 0 -> 1 -> 2 on the default group
        message = torch.zeros(4)
        if rank > 0:
            dist.recv(message, src=rank - 1)
        if rank < WORLD - 1:
            dist.send(message + 1, dst=rank + 1)
        chain.append(float(message[0]))
        time.sleep(0.05)
        if probe is not None:
            samples += [[r.peer, r.num_bytes, r.wire_s, r.direction] for r in probe.take()]
    dist.barrier()
    stopped = True if probe is None else probe.close(timeout_s=30)
    if probe is not None:
        samples += [[r.peer, r.num_bytes, r.wire_s, r.direction] for r in probe.take()]
    error = None if probe is None or probe.error is None else str(probe.error)
    freed = probe is None or probe.group is None
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "probe": probe is not None,
                "samples": samples,
                "stopped": stopped,
                "freed": freed,
                "error": error,
                "chain": chain,
            }
        )
    )
    dist.barrier()  # nothing of the probe is left posted: the group tears down cleanly
    dist.destroy_process_group()


def test_a_probe_times_its_messages_and_stops_cleanly(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'store'}"
    mp.start_processes(_worker, args=(init, str(tmp_path)), nprocs=WORLD, start_method="spawn")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r["probe"] for r in results] == [True, False, True]
    assert all(r["stopped"] and r["error"] is None and r["freed"] for r in results)
    assert results[0]["samples"] == [] and results[1]["samples"] == []
    received = results[2]["samples"]
    assert len(received) >= 2
    assert all(peer == 0 and direction == "recv" for peer, _, _, direction in received)
    # the first payload is the size asked for, the next ones what resize said
    assert [size for _, size, _, _ in received] == [SIZE] + [NEXT] * (len(received) - 1)
    assert all(wire_s > 0 for _, _, wire_s, _ in received)
    assert results[2]["chain"] == [2.0] * 10 and results[1]["chain"] == [1.0] * 10


def test_a_probe_needs_to_be_an_end_of_its_pair() -> None:
    with pytest.raises(ValueError, match="not an end of the pair"):
        LinkProbe(0, 2, 1, SIZE, None)
    with pytest.raises(ValueError, match="num_bytes must be positive"):
        LinkProbe(0, 2, 0, 0, None)
