"""StepTotals over gloo: ranks that post before their work and ranks that post after it get the
same sums, and pipeline messages on the default group pass while a sum is pending."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_deepcee.runtime.step_totals import StepTotals

pytestmark = pytest.mark.multiprocess

WORLD = 3
STEPS = 3


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    figures = StepTotals()
    last = rank == WORLD - 1
    sums: list[list[float]] = []
    waited: list[float] = []
    for step in range(STEPS):
        # Rank 0 counts tokens, the last rank holds the loss and the metric; rank 1 holds none.
        tokens = 10.0 * (step + 1) if rank == 0 else 0.0
        loss = torch.tensor(0.5 + step) if last else None
        metrics = {"acc": 0.25 * step} if last else {}
        early = figures.names is not None and not last
        signal = 1.0 if rank == 0 and step == 1 else 0.0  # rank 0 raises a hand on step 1
        cpu = torch.device("cpu")
        pending = figures.post(None, tokens, {}, cpu, signal) if early else None
        # The step's work: a chain 0 -> 1 -> 2 on the default group, the last rank slowed, so
        # an early rank's sum is pending while the messages pass.
        message = torch.zeros(4)
        if rank > 0:
            dist.recv(message, src=rank - 1)
        if rank < WORLD - 1:
            dist.send(message + rank + 1, dst=rank + 1)
        if last:
            time.sleep(0.2)
            assert message.tolist() == [3.0] * 4  # 0 + 1 + 2 along the chain
        if pending is None:
            figures.agree_names(metrics)
            pending = figures.post(loss, tokens, metrics, cpu, signal)
        began = time.perf_counter()
        sums.append(pending().tolist())
        waited.append(time.perf_counter() - began)
    Path(out, f"rank{rank}.json").write_text(
        json.dumps({"names": figures.names, "sums": sums, "waited": waited})
    )
    dist.destroy_process_group()


def test_early_and_late_posts_sum_alike(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'store'}"
    mp.start_processes(_worker, args=(init, str(tmp_path)), nprocs=WORLD, start_method="spawn")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    expected = [
        [0.5 + step, 10.0 * (step + 1), 0.25 * step, 1.0 if step == 1 else 0.0]
        for step in range(STEPS)
    ]
    for rank, got in enumerate(results):
        assert got["names"] == ["acc"], rank
        for step, (sums, want) in enumerate(zip(got["sums"], expected, strict=True)):
            assert sums == pytest.approx(want), (rank, step)
    # From the second step rank 0 posts before its work: its wait covers the last rank's delay.
    assert min(results[0]["waited"][1:]) > 0.1


def test_post_needs_the_names_first() -> None:
    with pytest.raises(RuntimeError, match="agreed on the metric names"):
        StepTotals().post(None, 0.0, {}, torch.device("cpu"))
