"""Survivors of a lost rank re-form the process group in the same processes and keep computing."""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_deepcee.runtime.liveness import agree_group_token
from lightning_deepcee.runtime.regroup import (
    RegroupError,
    agree_survivors,
    leave_group,
    reform_group,
)
from tests.helpers.ports import free_port

pytestmark = pytest.mark.multiprocess
TIMEOUT = datetime.timedelta(seconds=20)


def _worker(rank: int, init: str, out: str, lost: int, late: int) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4, timeout=TIMEOUT)
    agree_group_token()
    dist.barrier()
    if rank == lost:
        os._exit(0)  # gone without a word
    store, backend = leave_group()
    if rank == late:  # alive, but posts after the others have waited for it
        time.sleep(3.0)
    try:
        # Rank 0 believes rank `late` lost too; the others wait for it, up to 1 s.
        believed = [lost, late] if rank == 0 else [lost]
        members = agree_survivors(store, rank, 4, believed, wait_s=1.0)
    except RegroupError as exc:
        Path(out, f"rank{rank}.txt").write_text(f"left out: {exc}")
        os._exit(0)
    new_rank = reform_group(store, members, rank, backend=backend, timeout=TIMEOUT)
    agree_group_token()  # the new group's keys
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    Path(out, f"rank{rank}.txt").write_text(
        f"{members} {new_rank} {dist.get_world_size()} {total.item()}"
    )
    dist.destroy_process_group()
    if rank == 0:
        time.sleep(4.0)  # rank 0's process hosts the store: keep it for the late rank
    os._exit(0)


def test_survivors_agree_and_reform(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    init = f"tcp://127.0.0.1:{free_port()}"
    args = (init, str(tmp_path), 2, 3)
    procs = [ctx.Process(target=_worker, args=(r, *args)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
        if p.is_alive():
            p.kill()
            pytest.fail("a rank hung")
    # Ranks 0 and 1 formed a group of two (new ranks 0 and 1): 0 + 1 summed over it.
    assert (tmp_path / "rank0.txt").read_text() == "[0, 1] 0 2 1.0"
    assert (tmp_path / "rank1.txt").read_text() == "[0, 1] 1 2 1.0"
    # Rank 3 posted after the list was written: it is told it was left out.
    assert (tmp_path / "rank3.txt").read_text().startswith("left out: rank 3 posted after")
    assert not (tmp_path / "rank2.txt").exists()
