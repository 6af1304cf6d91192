"""The executor alone (no Lightning): gradients of one step equal a single-process reference."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_deepcee.planner import balanced_partition
from lightning_deepcee.planner.compression import METHODS
from lightning_deepcee.runtime import StageLayout, split_batch, split_sizes
from lightning_deepcee.schedule import SCHEDULE_KINDS
from tests.helpers.executor import (
    ExecutorNet,
    assert_grads_match_reference,
    executor_data,
    executor_reference,
    merged_grads,
    stage_executor,
)

pytestmark = pytest.mark.multiprocess


def _worker(
    rank: int,
    world: int,
    kind: str,
    m: int,
    init: str,
    out: str,
    layouts: list[StageLayout],
    prefetch: bool = False,
    compression: str = "off",
) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    net = ExecutorNet()
    spec = net.spec()
    ranges = balanced_partition([1.0] * len(spec.blocks), len(layouts))
    ex = stage_executor(
        net, spec, ranges, layouts, rank, kind, m, prefetch=prefetch, compression=compression
    )
    stage, stage_index = ex.stage, ex.stage.stage_index
    transport = ex.transport
    ex.run(split_batch(executor_data(), split_sizes(11, m)), 11)
    # Every receive is timed twice: blocked and on the wire (a single step has no payload
    # slots yet, so every payload's wire time is measured, receive-ahead or not).
    for record in transport.records:
        if record.direction == "recv":
            assert record.wire_s is not None and record.wire_s >= 0, record
            assert record.seconds >= 0, record
        else:
            assert record.wire_s is None, record
    # CPU per action kind: every stage ran F, the step's CPU covers its actions' CPU, and an
    # action's CPU never exceeds its wall time (the main thread cannot run longer than that).
    stats = ex.last_stats
    assert stats is not None and stats.cpu_s_by_kind["F"] > 0
    assert stats.cpu_s >= sum(stats.cpu_s_by_kind.values()) - 1e-3
    for kind, cpu in stats.cpu_s_by_kind.items():
        assert cpu <= stats.seconds_by_kind[kind] + 1e-3, (kind, cpu)
    # Devices sharing a stage sum their gradients (what the strategy's stage group does).
    # new_group is collective: every rank creates every group, in the same order.
    group = [dist.new_group(list(lay.ranks)) for lay in layouts][stage_index]
    for p in stage.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
    grads = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    if layouts[stage_index].ranks[0] == rank:
        torch.save(grads, os.path.join(out, f"grads{stage_index}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
def test_executor_gradients_match_reference(tmp_path: Path, world: int, kind: str) -> None:
    m = 4  # 11 samples in 4 micro-batches: sizes 3, 3, 3, 2 (uneven)
    init = f"file://{tmp_path / 'store'}"
    layouts = [StageLayout((r,), (1.0,)) for r in range(world)]
    mp.spawn(_worker, args=(world, kind, m, init, str(tmp_path), layouts), nprocs=world, join=True)
    assert_grads_match_reference(tmp_path, world, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("kind", "prefetch"), [("1f1b", False), ("zb-h1", True)])
def test_asymmetric_data_parallel_stages_match_reference(
    tmp_path: Path, kind: str, prefetch: bool
) -> None:
    """Stages shared by devices with unequal row shares (some micro-batches leave a device with
    no rows) still give the single-process gradient, with receives posted ahead or not."""
    layouts = [
        StageLayout((0, 1), (0.7, 0.3)),
        StageLayout((2,), (1.0,)),
        StageLayout((3, 4), (0.2, 0.8)),
    ]
    world, m = 5, 4  # micro-batches of 3, 3, 3, 2 rows: 0.2 * 2 rounds to 0 rows on rank 3
    init = f"file://{tmp_path / 'store'}"
    args = (world, kind, m, init, str(tmp_path), layouts, prefetch)
    mp.spawn(_worker, args=args, nprocs=world, join=True)
    assert_grads_match_reference(tmp_path, len(layouts), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("method", "kind"), [("bf16", "1f1b"), ("tah8", "zb-h1"), ("tah4", "1f1b")]
)
def test_compressed_hops_give_the_reference_gradient_within_the_method_error(
    tmp_path: Path, method: str, kind: str
) -> None:
    """Three stages (one shared by two devices), every hop compressed: each parameter's gradient
    is the single-process one to within the method's typical round-trip error per compressed
    message on its path (two hops, forward and back), with a factor 2 for the network's own
    amplification; and not exact, so the hops did compress."""
    layouts = [
        StageLayout((0,), (1.0,)),
        StageLayout((1, 2), (0.5, 0.5)),
        StageLayout((3,), (1.0,)),
    ]
    init = f"file://{tmp_path / 'store'}"
    args = (4, kind, 4, init, str(tmp_path), layouts, True, method)
    mp.spawn(_worker, args=args, nprocs=4, join=True)
    got, ref = merged_grads(tmp_path, len(layouts)), executor_reference()
    assert got.keys() == ref.keys()
    bound = 2 * 4 * METHODS[method].typical_error
    errors = {n: float((got[n] - ref[n]).norm() / ref[n].norm()) for n in ref}
    assert max(errors.values()) <= bound, (errors, bound)
    assert max(errors.values()) > 0, "no hop was compressed"
