"""The CUDA/NCCL path: the executor's gradients on GPUs equal the single-process reference.

Marked ``gpu``; CI machines have no GPU and deselect it (``-m "not gpu"``). NCCL needs one GPU
per rank, so the test asks for as many devices as stages.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_deepcee.planner import balanced_partition
from lightning_deepcee.runtime import (
    P2PTransport,
    PipelineExecutor,
    build_stage,
    split_batch,
    split_sizes,
)
from lightning_deepcee.schedule import generate, lower

pytestmark = pytest.mark.gpu


def _worker(rank: int, world: int, init: str, out: str) -> None:
    from test_executor import _data, _Net

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    net = _Net().to(device)
    spec = net.spec()
    ranges = balanced_partition([1.0] * len(spec.blocks), world)
    stage = build_stage(net, spec, ranges, rank)
    lowered = lower(generate("zb-h1", world, 4), {s: s for s in range(world)})
    ex = PipelineExecutor(
        stage=stage,
        actions=lowered[rank],
        transport=P2PTransport(device),
        prev_rank=rank - 1 if rank > 0 else None,
        next_rank=rank + 1 if rank < world - 1 else None,
        loss_fn=spec.loss_fn,
        input_fn=spec.input_fn,
        rank=rank,
    )
    batch = tuple(t.to(device) for t in _data())
    sizes = split_sizes(11, 4)
    ex.run(split_batch(batch, sizes), [n / 11 for n in sizes])
    torch.cuda.synchronize()
    grads = {n: p.grad.cpu() for n, p in net.named_parameters() if p.grad is not None}
    torch.save(grads, os.path.join(out, f"grads{rank}.pt"))
    dist.destroy_process_group()


def test_nccl_executor_matches_reference(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
    from test_executor import assert_grads_match_reference

    world = 2
    mp.spawn(_worker, args=(world, f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=world)
    assert_grads_match_reference(tmp_path, world, rtol=1e-4, atol=1e-5)
