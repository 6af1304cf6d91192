"""Copies that must stay equal: tied parameters across stages, and a shared stage's devices.

A parameter used by blocks on two stages (GPT-2's embedding and output head) has a copy on every
device of both stages. Each copy's gradient covers only the uses on its stage, so the copies'
gradients are summed over all of those devices (:func:`make_tie_groups`, then
:func:`~lightning_deepcee.runtime.stage_groups.sum_gradients` on the tie's group instead of the
stage's): every copy then holds the gradient one device would compute, and identical optimizers
keep the copies identical. Checkpoints keep a tied parameter once, on the first stage that uses
it (the *owner*); the others fill it back in at load (:func:`tied_names_to_fill`).

Devices that share a stage (or hold a tied copy) must start from the same weights: without a
common seed they would not, so setup broadcasts them (:func:`broadcast_initial_weights`), as
DDP does at construction.

torch and torch.distributed; no Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_deepcee.runtime.grad_buckets import BucketedGradSync
from lightning_deepcee.runtime.stage import TiedParameter
from lightning_deepcee.runtime.stage_groups import (
    broadcast_buffers,
    sum_gradients,
    unbound_gloo_default_group,
)
from lightning_deepcee.runtime.transport import wire_device

__all__ = [
    "TieGroup",
    "broadcast_",
    "broadcast_initial_weights",
    "canonical_names",
    "make_tie_groups",
    "owned_state_dict",
    "sync_copies",
    "tied_names_to_fill",
]


@dataclass(frozen=True)
class TieGroup:
    """A tied parameter held on this rank and the devices of every stage that holds a copy."""

    tie: TiedParameter
    parameter: nn.Parameter
    ranks: tuple[int, ...]
    group: Any


def make_tie_groups(
    ties: Sequence[tuple[TiedParameter, nn.Parameter]],
    ranges: Sequence[tuple[int, int]],
    placement: Sequence[Sequence[int]],
    stage_index: int,
) -> list[TieGroup]:
    """Create a process group for every tie that spans stages (collective: every rank, same
    order); return this rank's. A tie inside one stage needs none (one copy per device)."""
    mine = []
    with unbound_gloo_default_group():
        for tie, parameter in ties:
            stages = tie.stages(ranges)
            if len(stages) < 2:
                continue
            ranks = tuple(sorted(r for s in stages for r in placement[s]))
            group = dist.new_group(list(ranks))
            if stage_index in stages:
                mine.append(TieGroup(tie, parameter, ranks, group))
    return mine


def broadcast_(tensor: torch.Tensor, src: int, group: Any) -> None:
    """Broadcast ``tensor`` in place from global rank ``src`` over ``group`` (host-staged on
    gloo for CUDA tensors, as :func:`~lightning_deepcee.runtime.transport.all_reduce_`)."""
    wire = wire_device(tensor.device, group)
    if wire == tensor.device:
        dist.broadcast(tensor, src=src, group=group)
        return
    staged = tensor.detach().to(wire)
    dist.broadcast(staged, src=src, group=group)
    with torch.no_grad():
        tensor.copy_(staged)


def broadcast_initial_weights(
    blocks: Sequence[nn.Module],
    stage_ranks: Sequence[int],
    stage_group: Any,
    tie_groups: Sequence[TieGroup],
) -> None:
    """Give every device of this stage its first device's parameters and buffers, then every
    tied copy the lowest holder's value (collective over the stage's and ties' groups)."""
    with torch.no_grad():
        if stage_group is not None:
            seen: set[int] = set()
            for block in blocks:
                for tensor in [*block.parameters(), *block.buffers()]:
                    if id(tensor) not in seen:
                        seen.add(id(tensor))
                        broadcast_(tensor.data, stage_ranks[0], stage_group)
        for tied in tie_groups:
            broadcast_(tied.parameter.data, tied.ranks[0], tied.group)


def sync_copies(
    params: Sequence[nn.Parameter],
    stage_group: Any,
    tie_groups: Sequence[TieGroup],
    buffers: Sequence[torch.Tensor],
    first_device: int,
    buckets: BucketedGradSync | None = None,
) -> None:
    """After a step's backward: sum the stage's gradients over its devices (``buckets``, when
    given, holds those of its untied parameters, some already under way), and each tied
    parameter's over every holder of the tie instead; give the stage's devices the first
    device's running statistics (``buffers``). Collective over those groups."""
    tied = {id(t.parameter) for t in tie_groups}
    if stage_group is not None:
        if buckets is not None:
            buckets.finish()
        else:
            sum_gradients([p for p in params if id(p) not in tied], stage_group)
        broadcast_buffers(buffers, first_device, stage_group)
    for tie in tie_groups:
        if tie.parameter.requires_grad:
            sum_gradients([tie.parameter], tie.group)


def canonical_names(ties: Sequence[TiedParameter]) -> dict[str, str]:
    """Every name of a tied parameter mapped to its canonical (first) name."""
    return {name: tie.names[0] for tie in ties for name in tie.names}


def owned_state_dict(
    state_dict: Mapping[str, Any],
    ties: Sequence[TiedParameter],
    ranges: Sequence[tuple[int, int]],
    stage_index: int,
) -> dict[str, Any]:
    """``state_dict`` without the tied parameters another stage owns (saved once, there)."""
    dropped = {
        name
        for tie in ties
        if (stages := tie.stages(ranges)) and stages[0] != stage_index
        for name in tie.names
    }
    return {k: v for k, v in state_dict.items() if k not in dropped}


def tied_names_to_fill(
    local_keys: Sequence[str],
    ties: Sequence[TiedParameter],
    ranges: Sequence[tuple[int, int]],
    stage_index: int,
) -> dict[int, list[str]]:
    """The owner stage of each tied parameter this stage holds but does not save, with the
    names it has here: ``{owner stage: [local names]}``."""
    keys = set(local_keys)
    fill: dict[int, list[str]] = {}
    for tie in ties:
        stages = tie.stages(ranges)
        if stage_index in stages and stages[0] != stage_index:
            fill.setdefault(stages[0], []).extend(n for n in tie.names if n in keys)
    return fill
