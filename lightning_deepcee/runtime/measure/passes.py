"""One timed pass over all blocks in a pipeline stage's order, and what it needs.

:func:`time_pass` times every block's forward, input gradient (``B``) and weight gradient
(``W``) as a stage runs them; :func:`block_fastest` keeps each figure's fastest over repeated
passes. The helpers build the blocks' inputs and leave the model as it was found.

What flows between blocks is a *block value* (``runtime/values.py``): one tensor, or a nested
tuple/list/dict of tensors with the micro-batch's rows as dimension 0 (constants allowed).

Runtime layer: torch, never lightning.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn

from lightning_deepcee._compat import stage_backward_input, stage_backward_weight, tree_map
from lightning_deepcee.runtime.values import flatten_value, tensor_leaves, value_rows

__all__ = ["LossFn"]

LossFn = Callable[[Any, Any], torch.Tensor]
"""What ``loss_fn`` is called as: ``loss_fn(last_block_output, sample_batch) -> loss``."""


def block_fastest(
    blocks: Sequence[nn.Module],
    inputs: Sequence[Any],
    loss_fn: LossFn | None,
    sample_batch: Any,
    repeats: int,
    warmup: int,
    jitter_s: float = 0.0,
    *,
    merged: bool = False,
    only: Collection[int] | None = None,
) -> list[tuple[float, float, float]]:
    """Fastest (F, B, W) seconds of each block on its input in ``inputs`` (over ``repeats``);
    with ``merged``, (F, 0, whole backward), and with ``only``, zeros for the blocks not in it,
    as :func:`time_pass` gives them.

    The fastest call is the one that ran unthrottled: a CPU quota stalls whichever calls run
    after the period's budget is spent, and a median of a few consecutive calls lands on either.
    The repeats run as passes over all blocks (not five calls of one block, then the next):
    consecutive calls of one block fall into the same throttled stretch, which can give some
    blocks their burst time and others a throttled one and skew the partition. Sustained speed
    is measured separately (``sustained_factor``). Each pass runs in a stage's order
    (:func:`time_pass`).

    ``jitter_s``: each pass first sleeps a random time up to this long. Passes of equal work run
    back to back keep their phase against a CPU quota's period, so the quota stalls the same
    calls in every pass and their fastest is a stalled one; a random start, up to one period,
    moves the stalls from pass to pass.
    """
    times: list[list[tuple[float, float, float]]] = [[] for _ in blocks]
    phases = random.Random()
    for repeat in range(warmup + repeats):
        if jitter_s > 0:
            time.sleep(phases.uniform(0.0, jitter_s))
        timings = time_pass(blocks, inputs, loss_fn, sample_batch, merged=merged, only=only)
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


def block_inputs(blocks: Sequence[nn.Module], sample_input: Any) -> list[Any]:
    """Inputs of every block, then the last output: ``len(blocks) + 1`` detached block values.

    Raises ``TypeError`` for an output holding something other than tensors and constants, and
    ``ValueError`` for one without a tensor, or (between blocks) whose tensors' rows disagree.
    """
    values = [_detached(sample_input, "sample_input")]
    last = len(blocks) - 1
    with torch.no_grad():
        for index, block in enumerate(blocks):
            what = f"the output of blocks[{index}] ({type(block).__name__})"
            output = _detached(block(values[-1]), what)
            if index != last:  # travels to the next block: split by rows in a pipeline
                value_rows(output, what)
            elif not tensor_leaves(output):
                raise ValueError(f"{what} holds no tensor; a block value needs at least one.")
            values.append(output)
    return values


def _detached(value: Any, what: str) -> Any:
    """``value`` with every tensor leaf detached; ``what`` names it in a ``TypeError``."""
    tensors, structure = flatten_value(value, what)
    return structure.rebuild([t.detach() for t in tensors])


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_pass(
    blocks: Sequence[nn.Module],
    inputs: Sequence[Any],
    loss_fn: LossFn | None,
    sample_batch: Any,
    *,
    merged: bool = False,
    only: Collection[int] | None = None,
) -> list[tuple[float, float, float]]:
    """F of every block, then B of every block (last first), then W: seconds of each.

    The order a pipeline stage runs them in: a block's B and W find its activations and
    intermediate gradients after other work has passed through the caches, not right after its
    F. Timing each block's F, B and W back to back measures them hot, and training then costs
    more than profiled (``docs/profiler.md``). The pass holds one micro-batch's activations of
    every block at once, as a device training the whole model would.

    Every floating-point tensor of a block's input needs a gradient, except block 0's (data).
    A block whose input has none has ``B = 0``; its ``W`` is its whole backward, run in the W
    phase, as the executor runs a first stage. Backward starts from a random gradient for every
    output tensor that requires one (the last block's loss, when ``loss_fn`` is given, from 1).

    ``merged``: no B phase; the W phase runs each block's whole backward in one call, as a
    ``BW`` action (1F1B, GPipe) and a first stage run it (``B`` is then 0). One pass over the
    graph costs less than B then W, which walk it twice.

    ``only``: the indices of the blocks to run (default all); the others are not run and get
    zeros (each block runs on its own input from ``inputs``, so any subset can be timed).
    """
    device = tensor_leaves(inputs[0])[0].device
    last = len(blocks) - 1
    state: list[tuple[Any, ...]] = []
    forward = []
    for index, block in enumerate(blocks):
        if only is not None and index not in only:
            forward.append(0.0)
            state.append(([], [], None, [], False))
            continue
        leaves, structure = flatten_value(inputs[index], f"the input of blocks[{index}]")
        xs = [t.detach().requires_grad_(index > 0 and t.is_floating_point()) for t in leaves]
        x = structure.rebuild(xs)
        sync_device(device)
        start = time.perf_counter()
        output = block(x)
        loss = None if loss_fn is None or index != last else loss_fn(output, sample_batch)
        sync_device(device)
        forward.append(time.perf_counter() - start)
        if loss is None:
            roots = [t for t in tensor_leaves(output) if t.requires_grad]
            grads: list[torch.Tensor] | None = [torch.randn_like(root) for root in roots]
        else:  # a loss starts from 1
            roots, grads = ([loss] if loss.requires_grad else []), None
        needs_grad = [leaf for leaf in xs if leaf.requires_grad]
        params = [p for p in block.parameters() if p.requires_grad]
        # Whether to differentiate at all is read now: B detaches the roots in place.
        state.append((needs_grad, roots, grads, params, bool(roots)))
    backward = [0.0] * len(blocks)
    groups: list[Any] = [None] * len(blocks)
    for index in reversed(range(len(blocks))):
        needs_grad, roots, grads, params, differentiable = state[index]
        if merged or not differentiable or not needs_grad:
            continue
        start = time.perf_counter()
        _, groups[index] = stage_backward_input(roots, grads, needs_grad, iter(params))
        sync_device(device)
        backward[index] = time.perf_counter() - start
    weight = [0.0] * len(blocks)
    for index in reversed(range(len(blocks))):
        needs_grad, roots, grads, params, differentiable = state[index]
        if not differentiable:
            continue
        start = time.perf_counter()
        if needs_grad and not merged:
            stage_backward_weight(iter(params), groups[index])
        else:
            torch.autograd.backward(roots, grads)
        sync_device(device)
        weight[index] = time.perf_counter() - start
    return list(zip(forward, backward, weight, strict=True))
