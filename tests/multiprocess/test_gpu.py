"""The CUDA paths: gradients and trained weights on GPUs equal the single-process reference.

Marked ``gpu``; CI machines have no GPU and deselect it (``-m "not gpu"``). Three paths:

- NCCL between GPUs (one GPU per rank, so it needs at least two GPUs);
- gloo between a mix of GPU and CPU-only ranks, the cloud-GPU / end-device-CPU case: gloo moves
  host memory only, so the transport and the all-reduces stage CUDA tensors through the host;
- the same mix under Lightning: each "node" (one torchrun per rank, as the lab launches them)
  builds its own Trainer with its own accelerator; ``DeepCEEStrategy()`` profiles the GPU and
  CPU devices, plans, and trains.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_deepcee.planner import balanced_partition
from lightning_deepcee.runtime import StageLayout, all_reduce_, split_batch, split_sizes
from tests.helpers.equivalence import assert_same_params, fit_reference, merged_ranks
from tests.helpers.executor import (
    ExecutorNet,
    assert_grads_match_reference,
    executor_data,
    stage_executor,
)
from tests.helpers.launch import torchrun, write_configs
from tests.helpers.paths import WORKERS

pytestmark = pytest.mark.gpu


def _device(rank: int, mixed: bool) -> torch.device:
    """NCCL: GPU ``rank``. Mixed: even ranks on GPU 0, odd ranks on the CPU."""
    if not mixed:
        return torch.device("cuda", rank)
    return torch.device("cuda", 0) if rank % 2 == 0 else torch.device("cpu")


def _worker(
    rank: int, world: int, init: str, out: str, mixed: bool, layouts: list[StageLayout]
) -> None:
    device = _device(rank, mixed)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "gloo" if mixed else "nccl"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    net = ExecutorNet().to(device)
    spec = net.spec()
    ranges = balanced_partition([1.0] * len(spec.blocks), len(layouts))
    m = 4
    ex = stage_executor(net, spec, ranges, layouts, rank, "zb-h1", m, device=device)
    stage, stage_index = ex.stage, ex.stage.stage_index
    batch = tuple(t.to(device) for t in executor_data())
    ex.run(split_batch(batch, split_sizes(11, m)), 11)
    # Devices sharing a stage sum their gradients, staged through the host on gloo.
    group = [dist.new_group(list(lay.ranks)) for lay in layouts][stage_index]
    for p in stage.parameters():
        if p.grad is not None:
            all_reduce_(p.grad, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert all(p.grad.device == device for p in stage.parameters() if p.grad is not None)
    if layouts[stage_index].ranks[0] == rank:
        grads = {n: p.grad.cpu() for n, p in net.named_parameters() if p.grad is not None}
        torch.save(grads, os.path.join(out, f"grads{stage_index}.pt"))
    dist.destroy_process_group()


def test_nccl_executor_matches_reference(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        found = torch.cuda.device_count()
        pytest.skip(f"NCCL needs one GPU per rank: 2 CUDA devices, found {found}")
    world = 2
    init = f"file://{tmp_path / 'store'}"
    layouts = [StageLayout((r,), (1.0,)) for r in range(world)]
    mp.spawn(_worker, args=(world, init, str(tmp_path), False, layouts), nprocs=world)
    assert_grads_match_reference(tmp_path, world, rtol=1e-4, atol=1e-5)


def test_gloo_mixed_gpu_cpu_executor_matches_reference(tmp_path: Path) -> None:
    assert torch.cuda.is_available(), "the gpu marker needs a CUDA device"
    # Ranks 0 and 2 on the GPU, 1 and 3 on the CPU: stage 0 is shared by a GPU and a CPU
    # (unequal row shares, gradients summed over gloo), stage 1 is a CPU (rank 3), stage 2 a
    # GPU (rank 2): transfers GPU/CPU -> CPU -> GPU and back.
    layouts = [StageLayout((0, 1), (0.6, 0.4)), StageLayout((3,), (1.0,)),
               StageLayout((2,), (1.0,))]  # fmt: skip
    init = f"file://{tmp_path / 'store'}"
    mp.spawn(_worker, args=(4, init, str(tmp_path), True, layouts), nprocs=4)
    assert_grads_match_reference(tmp_path, len(layouts), rtol=1e-4, atol=1e-5)


def _launch_nodes(world: int, configs: list[dict[str, Any]], out: Path) -> str:
    """One torchrun per rank (``--nnodes=world``), as the lab launches devices; rank 0's log."""
    out.mkdir(parents=True, exist_ok=True)
    cfg_file = write_configs(out, configs)
    worker = WORKERS / "fit_worker.py"
    return torchrun(worker, out, cfg_file, world=world, one_node_per_rank=True)[0]


def test_lightning_on_gpus_matches_single_process(tmp_path: Path) -> None:
    assert torch.cuda.is_available(), "the gpu marker needs a CUDA device"
    tol: dict[str, float] = dict(rtol=1e-4, atol=1e-5)
    # One GPU, NCCL (Lightning's default backend for CUDA): a one-stage pipeline that
    # accumulates 3 micro-batches, then DeepCEEStrategy() profiling and planning on the GPU.
    single: list[dict[str, Any]] = [
        {"name": "one", "schedule": "1f1b", "num_microbatches": 3, "steps": 4,
         "accelerators": ["gpu"]},
        {"name": "one-auto", "steps": 3, "accelerators": ["gpu"]},
    ]  # fmt: skip
    _launch_nodes(1, single, tmp_path)
    assert_same_params(merged_ranks(tmp_path / "one", 1), fit_reference(4), **tol)
    assert_same_params(merged_ranks(tmp_path / "one-auto", 1), fit_reference(3), **tol)
    # GPU, CPU, GPU over gloo: the cloud-GPU / end-device-CPU cluster.
    mixed = ["gpu", "cpu", "gpu"]
    configs: list[dict[str, Any]] = [
        {"name": "zb", "schedule": "zb-h1", "num_microbatches": 3, "steps": 4,
         "accelerators": mixed, "backend": "gloo"},
        {"name": "auto", "steps": 3, "accelerators": mixed, "backend": "gloo",
         "verbose": True},
    ]  # fmt: skip
    log = _launch_nodes(3, configs, tmp_path)
    assert_same_params(merged_ranks(tmp_path / "zb", 3), fit_reference(4), **tol)
    assert_same_params(merged_ranks(tmp_path / "auto", 3), fit_reference(3), **tol)
    print(log[-5000:])  # the profile table and the plan of the mixed cluster (pytest -s)
