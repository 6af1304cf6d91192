"""P2PTransport receives ahead on gloo: a sender's messages complete before the receiver asks.

Gloo moves a message only once its receive is posted; ``expect`` posts them from threads at the
start of the step, so the transfer overlaps the receiver's compute instead of waiting for it.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_deepcee.runtime import P2PTransport

pytestmark = pytest.mark.multiprocess

SHAPES = [(3, 4), (5,), (2, 2, 2)]


def _worker(rank: int, init: str, out: str, prefetch: bool) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    store = dist.distributed_c10d._get_default_store()
    transport = P2PTransport(torch.device("cpu"), prefetch=prefetch)
    if rank == 0:
        for i, shape in enumerate(SHAPES):
            transport.send(torch.full(shape, float(i)), 1)
        transport.wait_sends()  # done only once rank 1 has posted every receive
        store.set("sent", "1")
    else:
        transport.expect([0] * len(SHAPES))
        try:  # the sends finish while this rank has not called recv() yet?
            store.wait(["sent"], timedelta(seconds=20 if prefetch else 2))
            ahead = True
        except Exception:  # the store's timeout error type varies between torch versions
            ahead = False
        received = [transport.recv(0) for _ in SHAPES]
        transport.join()
        exact = all(
            r.shape == torch.Size(s) and bool((r == float(i)).all())
            for i, (r, s) in enumerate(zip(received, SHAPES, strict=True))
        )
        records = [r.direction for r in transport.records]
        Path(out, "result.json").write_text(
            json.dumps(dict(ahead=ahead, exact=exact, records=records))
        )
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("prefetch", [True, False])
def test_receives_run_ahead_of_the_schedule(tmp_path: Path, prefetch: bool) -> None:
    init = f"file://{tmp_path / 'store'}"
    mp.spawn(_worker, args=(init, str(tmp_path), prefetch), nprocs=2, join=True)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["exact"] and result["records"] == ["recv"] * len(SHAPES)
    # With receive-ahead the sender completes before recv() is called; without, it cannot.
    assert result["ahead"] is prefetch
