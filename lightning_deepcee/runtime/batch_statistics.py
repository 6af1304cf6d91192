"""Modules that normalise over the batch (BatchNorm): found in the blocks, and the setup warning
when a layout cannot match one device on the whole batch.

torch; no Lightning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_deepcee._compat import BatchNormBase
from lightning_deepcee.planner.plan import Plan

__all__ = ["BatchDependentModule", "batch_dependent_modules", "batch_statistics_warning"]


@dataclass(frozen=True)
class BatchDependentModule:
    """A module whose output depends on the other samples of its batch (BatchNorm)."""

    block_index: int
    name: str
    """Qualified name inside its block (``""``: the block itself)."""
    kind: str
    module: torch.nn.Module


def batch_dependent_modules(blocks: Sequence[torch.nn.Module]) -> list[BatchDependentModule]:
    """Every batch-statistics normalisation inside ``blocks`` (BatchNorm of any dimension)."""
    return [
        BatchDependentModule(index, name, type(module).__name__, module)
        for index, block in enumerate(blocks)
        for name, module in block.named_modules()
        if isinstance(module, BatchNormBase)
    ]


def batch_statistics_warning(
    found: Sequence[BatchDependentModule], plan: Plan, num_microbatches: int, model: str
) -> str | None:
    """The setup warning when BatchNorm cannot match one device on the whole batch, or None.

    It matches only when every batch reaches each such module whole: one micro-batch, and one
    device (one replica) per stage.
    """
    if not found or (num_microbatches == 1 and all(len(st.ranks) == 1 for st in plan.stages)):
        return None
    where = ", ".join(
        f"block {m.block_index} ({m.name + ', ' if m.name else ''}{m.kind})" for m in found[:4]
    )
    more = f" and {len(found) - 4} more" if len(found) > 4 else ""
    return (
        f"DeepCEEStrategy: {model} normalises over the batch in {where}{more}. Under this "
        f"layout ({num_microbatches} micro-batch(es); stages shared by "
        f"{max(len(st.ranks) for st in plan.stages)} device(s)) each micro-batch, or each "
        "device's rows of it, is normalised with its own statistics, so outputs and gradients "
        "differ from one device on the whole batch, and the running statistics are updated once "
        "per piece (num_batches_tracked counts pieces). Devices sharing a stage keep identical "
        "running statistics (the first device's are broadcast after each step, as DDP does). "
        "For exact results replace BatchNorm by GroupNorm or LayerNorm, or train with "
        "num_microbatches=1 and one device per stage."
    )
