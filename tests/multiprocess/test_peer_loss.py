"""A device that dies mid-step: its neighbour stops within the bound, naming the lost rank."""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_deepcee.planner import balanced_partition
from lightning_deepcee.runtime import PipelineExecutionError, StageLayout, split_batch, split_sizes
from tests.helpers.executor import ExecutorNet, executor_data, stage_executor

pytestmark = pytest.mark.multiprocess
TIMEOUT_S = 20.0


def _worker(rank: int, init: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip
    net = ExecutorNet()
    spec = net.spec()
    ranges = balanced_partition([1.0] * len(spec.blocks), 2)
    layouts = [StageLayout((0,), (1.0,)), StageLayout((1,), (1.0,))]
    ex = stage_executor(net, spec, ranges, layouts, rank, "1f1b", 2)
    micro = split_batch(executor_data(), split_sizes(11, 2))
    ex.run(micro, 11)  # one healthy step: connections are up
    dist.barrier()
    if rank == 1:
        os._exit(0)  # the device dies without a word
    start = time.perf_counter()
    try:
        ex.run(micro, 11)
        message = "no error"
    except PipelineExecutionError as exc:
        message = str(exc)
    Path(out, "result.txt").write_text(f"{time.perf_counter() - start:.2f}\n{message}")
    os._exit(0)


def test_lost_device_is_named_within_the_timeout(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    init = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=_worker, args=(r, init, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=TIMEOUT_S + 60)
        if p.is_alive():
            p.kill()
            pytest.fail("a rank hung past the timeout")
    elapsed, message = (tmp_path / "result.txt").read_text().split("\n", 1)
    assert "lost rank 1 (stage 1)" in message, message
    assert float(elapsed) <= TIMEOUT_S + 5
