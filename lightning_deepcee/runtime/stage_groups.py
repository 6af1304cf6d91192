"""The process groups of shared stages and the collectives run on them.

Devices sharing a stage (and, in :mod:`~lightning_deepcee.runtime.ties`, the holders of a tied
parameter) form a process group: :func:`make_stage_groups` creates them, :func:`sum_gradients`
sums their gradients after a step and :func:`broadcast_buffers` keeps their running statistics
equal.

torch and torch.distributed; no Lightning.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from lightning_deepcee._compat import (
    default_process_group,
    flatten_dense_tensors,
    unflatten_dense_tensors,
)
from lightning_deepcee.runtime.transport import all_reduce_

__all__ = ["broadcast_buffers", "make_stage_groups", "sum_gradients", "unbound_gloo_default_group"]


@contextmanager
def unbound_gloo_default_group() -> Iterator[None]:
    """Create gloo subgroups as if the default group were bound to no device.

    Lightning binds the default group to the rank's GPU (``device_id``) whatever the backend,
    and ``new_group`` then splits subgroups from it; a rank outside a new group calls
    ``perform_nocolor_split``, which gloo does not have (``AttributeError`` on a GPU rank of a
    mixed GPU/CPU cluster). Gloo creates subgroups without splitting, so the binding is lifted
    while they are made. NCCL keeps its split.
    """
    default = default_process_group()
    bound = default.bound_device_id
    if bound is None or dist.get_backend(default) != "gloo":
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


def make_stage_groups(placement: Sequence[Sequence[int]], stage_index: int) -> Any:
    """Create every shared stage's process group (collective: all ranks, same order); return
    this rank's (``None`` when its stage has one device)."""
    mine = None
    with unbound_gloo_default_group():
        for s, ranks in enumerate(placement):
            group = dist.new_group(list(ranks)) if len(ranks) > 1 else None
            if s == stage_index:
                mine = group
    return mine


def sum_gradients(params: Sequence[torch.nn.Parameter], group: Any) -> None:
    """Sum the stage's gradients over the devices sharing it: one flat all-reduce per dtype.

    A device that held no rows this step has no gradients; it contributes zeros, so every
    device of the group calls the same collectives.
    """
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for group_params in by_dtype.values():
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group_params]
        flat = flatten_dense_tensors(grads)
        all_reduce_(flat, group=group)
        for p, g in zip(group_params, unflatten_dense_tensors(flat, grads), strict=True):
            p.grad = g


def broadcast_buffers(buffers: Sequence[torch.Tensor], src: int, group: Any) -> None:
    """Give every device of a shared stage the ``src`` device's buffers (running statistics)."""
    for buffer in buffers:
        dist.broadcast(buffer, src=src, group=group)
