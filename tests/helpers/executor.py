"""The bare executor (no Lightning): one rank's executor, the test network, its data and its
gradient check."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lightning_deepcee.runtime import (
    P2PTransport,
    PipelineExecutor,
    PipelineSpec,
    Router,
    StageLayout,
    build_stage,
)
from lightning_deepcee.schedule import generate, lower, validate


class ExecutorNet(nn.Module):
    """Six blocks (five linear layers and a head), seeded: every process builds the same one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            [nn.Linear(6, 16)] + [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)]
        )
        self.head = nn.Linear(16, 3)

    def spec(self) -> PipelineSpec:
        return PipelineSpec(
            blocks=[*self.layers, self.head],
            loss_fn=lambda out, b: nn.functional.cross_entropy(out, b[1]),
        )


def executor_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(11, 6, generator=g), torch.randint(0, 3, (11,), generator=g)


def executor_reference() -> dict[str, torch.Tensor]:
    """The gradients of one single-process step on ``executor_data()``."""
    net = ExecutorNet()
    x, y = executor_data()
    nn.functional.cross_entropy(net.head(_body(net, x)), y).backward()
    return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def _body(net: ExecutorNet, x: torch.Tensor) -> torch.Tensor:
    for layer in net.layers:
        x = layer(x)
    return x


def merged_grads(directory: Path, world: int) -> dict[str, torch.Tensor]:
    """The gradients the ranks saved (``grads{stage}.pt``), merged by parameter name."""
    merged: dict[str, torch.Tensor] = {}
    for r in range(world):
        merged.update(torch.load(directory / f"grads{r}.pt"))
    return merged


def assert_grads_match_reference(directory: Path, world: int, *, rtol: float, atol: float) -> None:
    """Merge the ranks' saved gradients and compare them with the single-process reference."""
    merged = merged_grads(directory, world)
    ref = executor_reference()
    assert merged.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(merged[name], ref[name], rtol=rtol, atol=atol)


def stage_executor(
    model: nn.Module,
    spec: PipelineSpec,
    ranges: list[tuple[int, int]],
    layouts: list[StageLayout],
    rank: int,
    schedule: str,
    microbatches: int,
    *,
    device: torch.device | None = None,
    prefetch: bool = False,
    measure_saved: bool = False,
    compression: str = "off",
) -> PipelineExecutor:
    """The executor of ``rank``'s stage: ``ranges`` cut ``model`` into one stage per layout
    (stage ``s`` on the devices of ``layouts[s]``), every stage runs ``schedule`` with
    ``microbatches`` micro-batches (checked), tensors travel from and to ``device`` (the CPU),
    compressed by ``compression`` on every hop."""
    stage_index = next(s for s, lay in enumerate(layouts) if rank in lay.ranks)
    near = layouts[max(stage_index - 1, 0) : stage_index + 2]
    peers = {} if compression == "off" else {r: compression for lay in near for r in lay.ranks}
    placement = {s: s for s in range(len(layouts))}
    lowered = lower(generate(schedule, len(layouts), microbatches), placement)
    validate(lowered, placement, microbatches)
    stage = build_stage(model, spec, ranges, stage_index)
    return PipelineExecutor(
        stage=stage,
        actions=lowered[stage_index],
        transport=P2PTransport(device or torch.device("cpu"), prefetch=prefetch, compression=peers),
        router=Router(layouts, stage_index, rank),
        loss_fn=spec.loss_fn,
        input_fn=spec.input_fn,
        rank=rank,
        measure_saved=measure_saved,
    )
