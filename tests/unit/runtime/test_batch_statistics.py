"""BatchNorm inside the blocks is found, and the setup warning says when it is not exact."""

from __future__ import annotations

import torch
from torch import nn

from lightning_deepcee.planner import Plan
from lightning_deepcee.runtime.batch_statistics import (
    batch_dependent_modules,
    batch_statistics_warning,
)
from lightning_deepcee.runtime.manual_layout import ManualLayout, manual_plan


def test_batch_norm_is_found_and_the_warning_says_what_to_do() -> None:
    def _plan(layout: ManualLayout, world_size: int, blocks: int) -> Plan:
        return manual_plan(
            layout, world_size=world_size, block_weights=[10] * blocks, model_fingerprint="m"
        )

    blocks = [nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), nn.ReLU()]
    found = batch_dependent_modules(blocks)
    assert [(m.block_index, m.name, m.kind) for m in found] == [(1, "1", "BatchNorm1d")]
    assert batch_dependent_modules([nn.LayerNorm(4), nn.GroupNorm(2, 4)]) == []
    one = _plan(ManualLayout(num_microbatches=1), world_size=3, blocks=3)
    assert batch_statistics_warning(found, one, 1, "Net") is None  # exact: whole batches
    text = batch_statistics_warning(found, one, 4, "Net")
    assert text is not None and "Net normalises over the batch in block 1 (1, BatchNorm1d)" in text
    assert "GroupNorm or LayerNorm" in text and "num_microbatches=1" in text
    shared = _plan(ManualLayout(num_stages=1, num_microbatches=1), world_size=2, blocks=3)
    assert batch_statistics_warning(found, shared, 1, "Net") is not None  # rows split by device
    assert isinstance(found[0].module, torch.nn.BatchNorm1d)
