"""One timed pass over all blocks in a pipeline stage's order, and what it needs.

:func:`time_pass` times every block's forward, input gradient (``B``) and weight gradient
(``W``) as a stage runs them; :func:`block_fastest` keeps each figure's fastest over repeated
passes. The helpers build the blocks' inputs and leave the model as it was found.

Runtime layer: torch, never lightning.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_deepcee._compat import stage_backward_input, stage_backward_weight, tree_map

__all__ = ["LossFn"]

LossFn = Callable[[torch.Tensor, Any], torch.Tensor]
"""What ``loss_fn`` is called as: ``loss_fn(last_block_output, sample_batch) -> loss``."""


def block_fastest(
    blocks: Sequence[nn.Module],
    inputs: Sequence[torch.Tensor],
    loss_fn: LossFn | None,
    sample_batch: Any,
    repeats: int,
    warmup: int,
) -> list[tuple[float, float, float]]:
    """Fastest (F, B, W) seconds of each block on its input in ``inputs`` (over ``repeats``).

    The fastest call is the one that ran unthrottled: a CPU quota stalls whichever calls run
    after the period's budget is spent, and a median of a few consecutive calls lands on either.
    The repeats run as passes over all blocks (not five calls of one block, then the next):
    consecutive calls of one block fall into the same throttled stretch, which can give some
    blocks their burst time and others a throttled one and skew the partition. Sustained speed
    is measured separately (``sustained_factor``). Each pass runs in a stage's order
    (:func:`time_pass`).
    """
    times: list[list[tuple[float, float, float]]] = [[] for _ in blocks]
    for repeat in range(warmup + repeats):
        timings = time_pass(blocks, inputs, loss_fn, sample_batch)
        if repeat >= warmup:
            for index, timing in enumerate(timings):
                times[index].append(timing)
    fastest = [
        (min(t[0] for t in ts), min(t[1] for t in ts), min(t[2] for t in ts)) for ts in times
    ]
    return fastest


def slice_rows(batch: Any, size: int, rows: int) -> Any:
    """``batch`` with every tensor whose leading dimension is ``size`` cut to its first ``rows``."""

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and len(value) == size:
            return value[:rows]
        return value

    return tree_map(cut, batch)


class RestoredState:
    """Context manager: put back every parameter's ``.grad`` and every buffer's value."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        self._params = _unique_parameters(blocks)
        self._grads: list[torch.Tensor | None] = []
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._blocks = blocks

    def __enter__(self) -> None:
        self._grads = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        seen: set[int] = set()
        for block in self._blocks:
            for buffer in block.buffers():
                if id(buffer) not in seen:
                    seen.add(id(buffer))
                    self._buffers.append((buffer, buffer.detach().clone()))

    def __exit__(self, *exc: object) -> None:
        for p, grad in zip(self._params, self._grads, strict=True):
            p.grad = grad
        with torch.no_grad():
            for buffer, saved in self._buffers:
                buffer.copy_(saved)


def _unique_parameters(blocks: Sequence[nn.Module]) -> list[nn.Parameter]:
    seen: set[int] = set()
    params = []
    for block in blocks:
        for p in block.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def parameter_bytes(block: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in block.parameters())


def block_inputs(blocks: Sequence[nn.Module], sample_input: torch.Tensor) -> list[torch.Tensor]:
    """Inputs of every block, then the last output: ``len(blocks) + 1`` detached tensors."""
    values = [sample_input.detach()]
    with torch.no_grad():
        for index, block in enumerate(blocks):
            output = block(values[-1])
            if not isinstance(output, torch.Tensor):
                raise ValueError(
                    f"blocks[{index}] ({type(block).__name__}): expected a tensor output (one "
                    f"tensor flows between pipeline stages), got {type(output).__name__}"
                )
            values.append(output.detach())
    return values


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_pass(
    blocks: Sequence[nn.Module],
    inputs: Sequence[torch.Tensor],
    loss_fn: LossFn | None,
    sample_batch: Any,
) -> list[tuple[float, float, float]]:
    """F of every block, then B of every block (last first), then W: seconds of each.

    The order a pipeline stage runs them in: a block's B and W find its activations and
    intermediate gradients after other work has passed through the caches, not right after its
    F. Timing each block's F, B and W back to back measures them hot, and training then costs
    more than profiled (``docs/profiler.md``). The pass holds one micro-batch's activations of
    every block at once, as a device training the whole model would.

    Block 0 (whose input is data) and any block fed a non-floating-point tensor have ``B = 0``;
    their ``W`` is their whole backward, run in the W phase, as the executor runs a first stage.
    """
    device = inputs[0].device
    last = len(blocks) - 1
    state = []
    forward = []
    for index, block in enumerate(blocks):
        value = inputs[index]
        needs_input_grad = index > 0 and value.is_floating_point()
        x = value.detach().requires_grad_(needs_input_grad)
        sync_device(device)
        start = time.perf_counter()
        output = block(x)
        root = output if loss_fn is None or index != last else loss_fn(output, sample_batch)
        sync_device(device)
        forward.append(time.perf_counter() - start)
        grad = torch.randn_like(root) if root is output else None  # a loss starts from 1
        params = [p for p in block.parameters() if p.requires_grad]
        # Whether to differentiate at all is read now: B detaches the root in place.
        state.append((x, root, grad, params, needs_input_grad, root.requires_grad))
    backward = [0.0] * len(blocks)
    groups: list[Any] = [None] * len(blocks)
    for index in reversed(range(len(blocks))):
        x, root, grad, params, needs_input_grad, differentiable = state[index]
        if not differentiable or not needs_input_grad:
            continue
        start = time.perf_counter()
        _, groups[index] = stage_backward_input(
            [root], None if grad is None else [grad], [x], iter(params)
        )
        sync_device(device)
        backward[index] = time.perf_counter() - start
    weight = [0.0] * len(blocks)
    for index in reversed(range(len(blocks))):
        _, root, grad, params, needs_input_grad, differentiable = state[index]
        if not differentiable:
            continue
        start = time.perf_counter()
        if needs_input_grad:
            stage_backward_weight(iter(params), groups[index])
        else:
            torch.autograd.backward(root, grad)
        sync_device(device)
        weight[index] = time.perf_counter() - start
    return list(zip(forward, backward, weight, strict=True))
