"""Blocks that do the same work: one figure for all of them.

A transformer is a stack of identical layers; timed one by one on a throttled device, a few of
them read several times slower than the rest (a quota stall that hit the call in every repeat),
and the planner then avoids the stage that holds them. Blocks that run the same modules (types,
settings) with the same parameters' shapes on the same shapes of input do the same work, so
each of their F, B and W times is taken as the median over the class. Only three of a class
are timed (:func:`timed_blocks`): the others would cost measurement time and add nothing.

Runtime layer: torch, never lightning.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Hashable, Sequence
from typing import Any

from torch import nn

from lightning_deepcee.runtime.values import flatten_value

__all__ = ["alike_classes", "first_of_classes", "pool_alike", "share_alike", "timed_blocks"]

_MIN_CLASS = 3
"""Blocks a class needs before its median replaces their own figures (two readings have no
median that outvotes a stalled one)."""


_SETTING_TYPES = (bool, int, float, str, type(None))


def _settings(module: nn.Module) -> tuple[tuple[str, Any], ...]:
    """A module's plain public attributes (``self.causal = True``, ``self.window = 64``): the
    settings ``extra_repr`` does not show for a user's module. One that differs from block to
    block (a layer index) keeps the blocks apart: timed each on its own, as without pooling."""
    return tuple(
        sorted(
            (name, value)
            for name, value in vars(module).items()
            if not name.startswith("_") and isinstance(value, _SETTING_TYPES)
        )
    )


def _signature(block: nn.Module, value: Any, output: Any) -> Hashable:
    """What determines a block's work: its modules (types and settings), its parameters' and
    buffers' shapes, and the shapes and dtypes of its input and output tensors."""
    modules = tuple((type(m).__qualname__, m.extra_repr(), _settings(m)) for m in block.modules())
    params = tuple(
        (name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in block.named_parameters()
    )
    buffers = tuple((name, tuple(b.shape), b.dtype) for name, b in block.named_buffers())
    shapes = tuple(
        tuple((tuple(t.shape), t.dtype) for t in flatten_value(v, "a block value")[0])
        for v in (value, output)
    )
    return (modules, params, buffers, shapes)


def alike_classes(
    blocks: Sequence[nn.Module], inputs: Sequence[Any], *, last_has_loss: bool
) -> list[int | None]:
    """For each block, the index of its class of like blocks, or ``None`` when it stands alone.

    ``inputs`` are the blocks' inputs then the last output (``block_inputs``). Block 0 never
    pools (its input needs no gradient, so its backward is timed whole), nor does the last
    block when its forward includes the loss; a class needs at least three blocks.
    """
    keys: list[Hashable | None] = []
    for index, block in enumerate(blocks):
        last = index == len(blocks) - 1
        if index == 0 or (last and last_has_loss):
            keys.append(None)
        else:
            keys.append(_signature(block, inputs[index], inputs[index + 1]))
    counts: dict[Hashable, int] = {}
    for key in keys:
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    numbers: dict[Hashable, int] = {}
    classes: list[int | None] = []
    for key in keys:
        if key is None or counts[key] < _MIN_CLASS:
            classes.append(None)
        else:
            classes.append(numbers.setdefault(key, len(numbers)))
    return classes


def _members(classes: Sequence[int | None]) -> dict[int, list[int]]:
    members: dict[int, list[int]] = {}
    for index, number in enumerate(classes):
        if number is not None:
            members.setdefault(number, []).append(index)
    return members


def timed_blocks(classes: Sequence[int | None]) -> frozenset[int]:
    """The blocks to time: every block outside a class, and :data:`_MIN_CLASS` of each class
    (its first, last and evenly spaced ones between: the median of three outvotes one stalled
    reading, and a class does the same work wherever it sits)."""
    chosen = {index for index, number in enumerate(classes) if number is None}
    for indices in _members(classes).values():
        last = len(indices) - 1
        k = _MIN_CLASS - 1
        chosen.update(indices[round(i * last / k)] for i in range(_MIN_CLASS))
    return frozenset(chosen)


def first_of_classes(classes: Sequence[int | None]) -> frozenset[int]:
    """Every block outside a class, and the first of each class: one of each kind of work."""
    chosen = {index for index, number in enumerate(classes) if number is None}
    chosen.update(indices[0] for indices in _members(classes).values())
    return frozenset(chosen)


def share_alike(values: Sequence[int], classes: Sequence[int | None]) -> tuple[int, ...]:
    """``values`` with each class's blocks at its first member's value (what
    :func:`first_of_classes` measured); blocks outside a class keep theirs."""
    shared = list(values)
    for indices in _members(classes).values():
        for i in indices:
            shared[i] = values[indices[0]]
    return tuple(shared)


def pool_alike(
    times: Sequence[tuple[float, float, float]],
    classes: Sequence[int | None],
    timed: Collection[int] | None = None,
) -> list[tuple[float, float, float]]:
    """``times`` (F, B, W per block) with each class's blocks at the median of its ``timed``
    members (default all), F, B and W each on its own; blocks outside a class keep theirs."""
    pooled = list(times)
    for indices in _members(classes).values():
        readings = [i for i in indices if timed is None or i in timed]
        median = tuple(statistics.median(times[i][k] for i in readings) for k in range(3))
        for i in indices:
            pooled[i] = (median[0], median[1], median[2])
    return pooled
