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

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_deepcee.planner import balanced_partition
from lightning_deepcee.runtime import (
    P2PTransport,
    PipelineExecutor,
    Router,
    StageLayout,
    all_reduce_,
    build_stage,
    split_batch,
    split_sizes,
)
from lightning_deepcee.schedule import generate, lower

pytestmark = pytest.mark.gpu

sys.path.insert(0, os.path.dirname(__file__))


def _device(rank: int, mixed: bool) -> torch.device:
    """NCCL: GPU ``rank``. Mixed: even ranks on GPU 0, odd ranks on the CPU."""
    if not mixed:
        return torch.device("cuda", rank)
    return torch.device("cuda", 0) if rank % 2 == 0 else torch.device("cpu")


def _worker(
    rank: int, world: int, init: str, out: str, mixed: bool, layouts: list[StageLayout]
) -> None:
    from test_executor import _data, _Net

    device = _device(rank, mixed)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "gloo" if mixed else "nccl"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    net = _Net().to(device)
    spec = net.spec()
    stage_index = next(s for s, lay in enumerate(layouts) if rank in lay.ranks)
    ranges = balanced_partition([1.0] * len(spec.blocks), len(layouts))
    stage = build_stage(net, spec, ranges, stage_index)
    m = 4
    placement = {s: s for s in range(len(layouts))}
    ex = PipelineExecutor(
        stage=stage,
        actions=lower(generate("zb-h1", len(layouts), m), placement)[stage_index],
        transport=P2PTransport(device),
        router=Router(layouts, stage_index, rank),
        loss_fn=spec.loss_fn,
        input_fn=spec.input_fn,
        rank=rank,
    )
    batch = tuple(t.to(device) for t in _data())
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
    from test_executor import assert_grads_match_reference

    world = 2
    init = f"file://{tmp_path / 'store'}"
    layouts = [StageLayout((r,), (1.0,)) for r in range(world)]
    mp.spawn(_worker, args=(world, init, str(tmp_path), False, layouts), nprocs=world)
    assert_grads_match_reference(tmp_path, world, rtol=1e-4, atol=1e-5)


def test_gloo_mixed_gpu_cpu_executor_matches_reference(tmp_path: Path) -> None:
    assert torch.cuda.is_available(), "the gpu marker needs a CUDA device"
    from test_executor import assert_grads_match_reference

    # Ranks 0 and 2 on the GPU, 1 and 3 on the CPU: stage 0 is shared by a GPU and a CPU
    # (unequal row shares, gradients summed over gloo), stage 1 is a CPU (rank 3), stage 2 a
    # GPU (rank 2): transfers GPU/CPU -> CPU -> GPU and back.
    layouts = [StageLayout((0, 1), (0.6, 0.4)), StageLayout((3,), (1.0,)),
               StageLayout((2,), (1.0,))]  # fmt: skip
    init = f"file://{tmp_path / 'store'}"
    mp.spawn(_worker, args=(4, init, str(tmp_path), True, layouts), nprocs=4)
    assert_grads_match_reference(tmp_path, len(layouts), rtol=1e-4, atol=1e-5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch_nodes(world: int, configs: list[dict[str, Any]], out: Path) -> str:
    """One torchrun per rank (``--nnodes=world``), as the lab launches devices; rank 0's log."""
    out.mkdir(parents=True, exist_ok=True)
    cfg_file = out / "configs.json"
    cfg_file.write_text(json.dumps(configs))
    port = _free_port()
    worker = Path(__file__).with_name("_fit_worker.py")

    def launch(node: int) -> subprocess.Popen[str]:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={world}",
            f"--node_rank={node}", "--nproc_per_node=1", "--master_addr=127.0.0.1",
            f"--master_port={port}", str(worker), str(out), str(cfg_file),
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1")
        return subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )

    procs = [launch(r) for r in range(world)]
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    for r, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"node {r}:\n{text[-6000:]}"
    return outputs[0]


def test_lightning_on_gpus_matches_single_process(tmp_path: Path) -> None:
    assert torch.cuda.is_available(), "the gpu marker needs a CUDA device"
    from test_lightning_equivalence import _assert_equal, _merged, _reference

    tol: dict[str, float] = dict(rtol=1e-4, atol=1e-5)
    # One GPU, NCCL (Lightning's default backend for CUDA): a one-stage pipeline that
    # accumulates 3 micro-batches, then DeepCEEStrategy() profiling and planning on the GPU.
    single: list[dict[str, Any]] = [
        {"name": "one", "schedule": "1f1b", "num_microbatches": 3, "steps": 4,
         "accelerators": ["gpu"]},
        {"name": "one-auto", "steps": 3, "accelerators": ["gpu"]},
    ]  # fmt: skip
    _launch_nodes(1, single, tmp_path)
    _assert_equal(_merged(tmp_path / "one", 1), _reference(4), **tol)
    _assert_equal(_merged(tmp_path / "one-auto", 1), _reference(3), **tol)
    # GPU, CPU, GPU over gloo: the cloud-GPU / end-device-CPU cluster.
    mixed = ["gpu", "cpu", "gpu"]
    configs: list[dict[str, Any]] = [
        {"name": "zb", "schedule": "zb-h1", "num_microbatches": 3, "steps": 4,
         "accelerators": mixed, "backend": "gloo"},
        {"name": "auto", "steps": 3, "accelerators": mixed, "backend": "gloo",
         "verbose": True},
    ]  # fmt: skip
    log = _launch_nodes(3, configs, tmp_path)
    _assert_equal(_merged(tmp_path / "zb", 3), _reference(4), **tol)
    _assert_equal(_merged(tmp_path / "auto", 3), _reference(3), **tol)
    print(log[-5000:])  # the profile table and the plan of the mixed cluster (pytest -s)
