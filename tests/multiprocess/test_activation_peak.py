"""A pipeline's measured activation memory stays within the cost model's figure (3 processes).

Three ranks run one training step of a small GPT, one stage each, with the executor metering
what autograd holds (``measure_saved=True``). The cost model predicts each rank's peak memory
from a profile measured on the same blocks at the same micro-batch size. Each rank's measured
peak of saved bytes must stay within the prediction's activation part (the peak minus the
parameter state), and be close to the held bytes the prediction is made of.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_deepcee.demo.gpt import GPT
from lightning_deepcee.planner.cost_model import (
    CostModelConfig,
    in_flight_microbatches,
    predict,
    stage_costs,
)
from lightning_deepcee.planner.plan import StagePlan
from lightning_deepcee.profiler.data import ClusterProfile
from lightning_deepcee.runtime import StageLayout, split_batch, split_sizes
from lightning_deepcee.runtime.measure import measure_blocks
from lightning_deepcee.runtime.measure.cluster import _device_profile
from tests.helpers.executor import stage_executor

pytestmark = pytest.mark.multiprocess

VOCAB, BLOCK, ROWS, MICROBATCHES = 40, 16, 4, 4
RANGES = [(0, 2), (2, 4), (4, 6)]
CLOSE = 0.05
"""Measured held bytes vs the cost model's: a stage's micro-batches are row slices of one batch
(a saved input holds the whole batch's storage) and a tensor two blocks save counts once."""


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=4, n_head=2, n_embd=32)


def _batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (rows, BLOCK + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _worker(rank: int, world: int, schedule: str, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    model = _model()
    spec = model.configure_pipeline()
    layouts = [StageLayout((r,), (1.0,)) for r in range(world)]
    executor = stage_executor(
        model, spec, RANGES, layouts, rank, schedule, MICROBATCHES, measure_saved=True
    )
    total = ROWS * MICROBATCHES
    executor.run(split_batch(_batch(total), split_sizes(total, MICROBATCHES)), total)
    assert executor.last_stats is not None
    Path(out, f"peak{rank}.json").write_text(json.dumps(executor.last_stats.peak_saved_bytes))
    dist.destroy_process_group()


def _profile(world: int) -> ClusterProfile:
    model = _model()
    spec = model.configure_pipeline()
    batch = _batch(ROWS)
    timings = measure_blocks(
        list(spec.blocks), batch[0], loss_fn=spec.loss_fn, sample_batch=batch, repeats=1,
        warmup=0, sustain_s=0,
    )  # fmt: skip
    record = {"kind": "cpu", "memory_bytes": 1 << 40, "timings": timings}
    return ClusterProfile(
        devices=tuple(_device_profile(r, f"h{r}", record) for r in range(world)),
        latency_s=tuple(tuple(0.0 if i == j else 1e-4 for j in range(world)) for i in range(world)),
        bandwidth_bytes_per_s=tuple(
            tuple(float("inf") if i == j else 1e9 for j in range(world)) for i in range(world)
        ),
        num_blocks=len(spec.blocks),
        model_fingerprint="gpt",
        cluster_fingerprint="three",
    )


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_measured_peak_stays_within_the_plans_figure(tmp_path: Path, schedule: str) -> None:
    world = len(RANGES)
    init = f"file://{tmp_path / 'store'}"
    mp.spawn(_worker, args=(world, schedule, init, str(tmp_path)), nprocs=world, join=True)
    profile = _profile(world)
    stages = [
        StagePlan(block_range=r, ranks=(s,), batch_shares=(1.0,)) for s, r in enumerate(RANGES)
    ]
    prediction = predict(profile, stages, schedule, MICROBATCHES, ROWS * MICROBATCHES)
    costs = stage_costs(profile, stages, microbatch_size=ROWS)
    in_flight = in_flight_microbatches(schedule, world, MICROBATCHES)
    copies = CostModelConfig().state_copies
    for rank, (start, end) in enumerate(RANGES):
        measured = json.loads((tmp_path / f"peak{rank}.json").read_text())
        params = sum(profile.devices[rank].parameter_bytes[start:end])
        activations = prediction.peak_memory_bytes[rank] - copies * params
        held = in_flight[rank] * costs.activation_bytes[rank]
        message = (
            f"{schedule} rank {rank}: measured peak of saved tensors {measured} B; plan's "
            f"activation memory {activations} B (held {held:.0f} B + transient)"
        )
        assert measured is not None and 0 < measured <= activations, message
        assert abs(measured - held) <= CLOSE * held, message
