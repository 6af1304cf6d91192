"""Blocks that do the same work share one figure: classes and pooling (``measure/alike.py``)."""

from __future__ import annotations

import time

import torch
from torch import nn

from lightning_deepcee.runtime.measure import measure_blocks
from lightning_deepcee.runtime.measure.alike import (
    alike_classes,
    first_of_classes,
    pool_alike,
    share_alike,
    timed_blocks,
)
from lightning_deepcee.runtime.measure.passes import block_inputs
from lightning_deepcee.runtime.measure.saved import block_memory_bytes


class _Layer(nn.Module):
    """A residual MLP layer with a setting ``extra_repr`` does not show."""

    def __init__(self, width: int = 16, causal: bool = True) -> None:
        super().__init__()
        self.causal = causal
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def _stack(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(8, 16), *(_Layer() for _ in range(n)), nn.Linear(16, 3)]


def test_like_layers_form_one_class_and_the_ends_stand_alone() -> None:
    blocks = _stack(4)
    inputs = block_inputs(blocks, torch.randn(6, 8))
    assert alike_classes(blocks, inputs, last_has_loss=True) == [None, 0, 0, 0, 0, None]
    # A layer with another setting, width or activation is not like the others.
    other: list[nn.Module] = [_Layer(causal=False), _Layer(width=16)]
    other[1].fc = nn.Linear(16, 16, bias=False)
    mixed = [nn.Linear(8, 16), _Layer(), other[0], _Layer(), other[1], _Layer()]
    inputs = block_inputs(mixed, torch.randn(6, 8))
    assert alike_classes(mixed, inputs, last_has_loss=False) == [None, 0, None, 0, None, 0]
    # Two alike blocks are not a class: their two readings have no outvoting median.
    assert alike_classes(
        _stack(2), block_inputs(_stack(2), torch.randn(6, 8)), last_has_loss=False
    )[1:3] == [None, None]


def test_pool_takes_each_figure_at_its_class_median() -> None:
    times = [(1.0, 0.0, 1.0), (2.0, 3.0, 4.0), (2.2, 3.1, 40.0), (20.0, 2.9, 4.2), (9.0, 9.0, 9.0)]
    pooled = pool_alike(times, [None, 0, 0, 0, None])
    assert pooled[0] == times[0] and pooled[4] == times[4]
    assert pooled[1] == pooled[2] == pooled[3] == (2.2, 3.0, 4.2)


def test_a_stalled_layer_reads_like_its_class_in_measure_blocks() -> None:
    blocks = _stack(4)
    stalled = blocks[1]  # the class's first block: always timed
    assert isinstance(stalled, _Layer)
    # One layer stalls in every repeat, as a throttled call can: its class's median holds.
    original = stalled.forward

    def slow(x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return original(x)

    stalled.forward = slow  # type: ignore[method-assign]
    t = measure_blocks(blocks, torch.randn(16, 8), repeats=3, warmup=1, sustain_s=0.0)
    layer_forward = t.forward_s[1:5]
    assert max(layer_forward) == min(layer_forward) < 0.01


def test_three_of_a_class_are_timed_and_give_the_figures_of_all() -> None:
    assert timed_blocks([None, 0, 0, 0, 0, 0, 0, None]) == {0, 1, 3, 6, 7}
    assert timed_blocks([None, 0, 1, 0, 1, 0, 1]) == {0, 1, 2, 3, 4, 5, 6}
    assert timed_blocks([None, 0, 0, 0, None, None]) == {0, 1, 2, 3, 4, 5}
    times = [(1.0, 0.0, 1.0), (2.0, 3.0, 4.0), (0.0, 0.0, 0.0), (2.2, 3.1, 40.0), (20.0, 2.9, 4.2)]
    pooled = pool_alike(times, [None, 0, 0, 0, 0], timed={0, 1, 3, 4})
    assert pooled[1:] == [(2.2, 3.0, 4.2)] * 4  # the untimed block's zeros are not read
    assert first_of_classes([None, 0, 1, 0, 1, None]) == {0, 1, 2, 5}
    assert share_alike([5, 7, 9, 0, 0, 3], [None, 0, 1, 0, 1, None]) == (5, 7, 9, 7, 9, 3)

    calls = [0] * 8
    blocks = _stack(6)
    for index, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda *_, i=index: calls.__setitem__(i, calls[i] + 1))
    t = measure_blocks(blocks, torch.randn(16, 8), repeats=3, warmup=1, sustain_s=0.0)
    # Layers 1-6 form a class: 1, 3 and 6 run in every pass; 2, 4 and 5 only make the next
    # block's input; the memory pass runs block 0, the class's first (1) and block 7.
    assert calls[2] == calls[4] == calls[5] == 1 < 5 < calls[3] == calls[6]
    assert calls[0] == calls[1] == calls[7] == calls[3] + 1
    assert len(set(t.forward_s[1:7])) == 1 and len(set(t.backward_s[1:7])) == 1
    # Alike blocks keep the same tensors: one measured gives the class's memory, as each would.
    with torch.no_grad():
        inputs = block_inputs(blocks, torch.randn(16, 8))
    each = block_memory_bytes(blocks, inputs, None, None, 16)
    assert (t.saved_bytes, t.transient_bytes) == each
    assert len(set(each[0][1:7])) == 1 and each[0][1] > 0
