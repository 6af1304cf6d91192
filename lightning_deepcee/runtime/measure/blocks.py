"""Block timings: forward, ``B`` and ``W`` seconds of each block, and what they cost per call.

:func:`measure_blocks` times each block split exactly like the executor splits it
(``stage_backward_input`` / ``stage_backward_weight``) and whole (one backward call, as a
``BW`` action runs it), then corrects the fastest figures into a
training step's: the per-call cost a smaller micro-batch cannot shrink, the sustained speed under
a CPU quota, an optimizer step's rate, and the median over rounds. Blocks may pass block values
(a tensor, or tuples/lists/dicts of them: ``runtime/values.py``) from one to the next. It also
measures each block's memory per sample: output, saved for backward, transient (``saved.py``).

Runtime layer: torch, never lightning.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_deepcee.runtime.cpu_quota import read_cpu_quota
from lightning_deepcee.runtime.measure.alike import (
    alike_classes,
    first_of_classes,
    pool_alike,
    share_alike,
    timed_blocks,
)
from lightning_deepcee.runtime.measure.passes import (
    LossFn,
    RestoredState,
    block_fastest,
    block_inputs,
    parameter_bytes,
    slice_rows,
    sync_device,
    time_pass,
)
from lightning_deepcee.runtime.measure.saved import block_memory_bytes
from lightning_deepcee.runtime.values import (
    flatten_value,
    slice_value,
    tensor_leaves,
    value_bytes,
    value_rows,
)

__all__ = ["BlockTimings", "fit_passes", "measure_blocks"]

_SMALL_PASS_SHARE = 0.5
"""A pass at a quarter of the micro-batch costs about half a full pass (per-call costs do not
shrink with the rows): what :func:`fit_passes` charges for the second size's passes."""

_MERGED_PASS_SHARE = 0.9
"""A pass with each block's backward in one call (no separate ``B``) costs a little less than a
split pass: what :func:`fit_passes` charges for each of them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockTimings:
    """What :func:`measure_blocks` measured; lists are per block, in block order."""

    forward_s: tuple[float, ...]
    """Seconds of each block's forward (the last block's includes ``loss_fn``)."""
    backward_input_s: tuple[float, ...]
    """Seconds of each block's input gradient (``B``); 0 when its input needs none."""
    backward_weight_s: tuple[float, ...]
    """Seconds of each block's weight gradient (``W``); the whole backward when ``B`` is 0."""
    activation_bytes: tuple[int, ...]
    """Bytes of each block's output per sample (all its tensors, rounded up): what it sends on."""
    parameter_bytes: tuple[int, ...]
    """Bytes of each block's parameters."""
    microbatch_size: int
    """Samples in the measured micro-batch (the rows of ``sample_input``'s tensors)."""
    fixed_s: tuple[float, ...] = ()
    """Per block, the part of its F+B+W seconds that does not shrink with the micro-batch: the
    intercept of the line through the totals at ``microbatch_size`` and at a quarter of it (two
    samples at least), shared out by each block's time at the small size. Empty when the
    micro-batch is too small for a second size."""
    backward_s: tuple[float, ...] = ()
    """Seconds of each block's whole backward in one call (input and weight gradients in one
    pass over its graph, as a ``BW`` action and a first stage run it): its ``B + W`` times the
    device's ratio of one call to two (:func:`_merged_ratio`), at most 1. Empty when not
    measured."""
    optimizer_s_per_byte: float = 0.0
    """Seconds per parameter byte of a reference optimizer step (``torch.optim.Adam``, the
    default ``foreach`` path) on this device, timed on clones of the largest block's parameters
    and scaled by ``sustained_factor``; 0 when no block has parameters. The planner charges a
    stage's devices this rate times the stage's parameter bytes (Adam reads and writes about
    four tensors per parameter: a memory-bound step, linear in the bytes)."""
    sustained_factor: float = 1.0
    """Sustained over burst: the timed calls of back-to-back passes over all blocks (not the
    pass's own bookkeeping, which a training step does not run) divided by the sum of the
    per-block burst times (at least 1). Above 1 when the device cannot keep its burst
    speed, e.g. a CPU quota (cgroup ``cpu.max``) that throttles after a few milliseconds of work.
    Every ``*_s`` figure above is already multiplied by it."""

    saved_bytes: tuple[int, ...] = ()
    """Bytes per sample that autograd keeps for each block's backward from its forward (the
    input when saved, intermediates; parameters and buffers not counted): held per micro-batch
    in flight. See :func:`~lightning_deepcee.runtime.measure.saved.block_memory_bytes`."""
    transient_bytes: tuple[int, ...] = ()
    """Bytes per sample each block needs beyond ``saved_bytes`` at the peak of its forward and
    backward (intermediates, the output and the gradients, weight gradients not counted)."""

    @property
    def num_blocks(self) -> int:
        """Number of blocks measured."""
        return len(self.forward_s)


def measure_blocks(
    blocks: Sequence[nn.Module],
    sample_input: Any,
    *,
    loss_fn: LossFn | None = None,
    sample_batch: Any = None,
    repeats: int = 5,
    warmup: int = 2,
    sustain_s: float = 0.5,
    rounds: int = 1,
    budget_s: float | None = None,
) -> BlockTimings:
    """Time forward, ``B`` and ``W`` of each block on one micro-batch, on its tensors' device.

    Block ``i`` is called on the output of block ``i-1`` (block 0 on ``sample_input``): a block
    value, i.e. a tensor or a nested tuple/list/dict of tensors whose dimension 0 is the
    micro-batch's rows (``None``, numbers and strings allowed as constants). Each block runs
    ``warmup`` untimed then ``repeats`` timed iterations, each a pass over all blocks in a
    pipeline stage's order (every F, then every B last block first, then every W; see
    :func:`time_pass`); the fastest is kept (the burst speed, see below). Backward starts
    from a random gradient for every output tensor that requires one, except for the last block
    when ``loss_fn`` is given: then its forward includes ``loss_fn(output, sample_batch)`` and
    its backward starts from that loss, as in the last pipeline stage.

    A block whose input needs no gradient has ``B = 0`` and ``W`` = its whole backward. That is
    always block 0 (the data, token ids or features, never needs a gradient; the executor runs
    the first stage's backward whole) and any block fed no floating-point tensor. ``B`` is the
    gradient of every floating-point input tensor (a bool mask passed along needs none).

    Blocks that do the same work (:func:`~lightning_deepcee.runtime.measure.alike.alike_classes`:
    same modules, parameter shapes and value shapes; three at least, not block 0, not the last
    block with the loss) get their class's median F, B and W (a transformer's layers); only
    three of a class are timed (first, middle, last), so a deep stack costs about as much to
    measure as a shallow one.

    Two more figures make the times predict a training step rather than a micro-benchmark:

    - **Fixed cost.** With two or more samples, every block is timed again on a quarter of the
      micro-batch (rows sliced from every block's input and from every tensor of ``sample_batch``
      with the same leading size). The line through the two *totals* over all blocks gives the
      per-call cost a smaller micro-batch cannot shrink, shared out as ``fixed_s`` in proportion
      to each block's time at the small size (one fit over the sum: per-block lines through two
      noisy points often cross zero, and then small micro-batches look free). Two samples at
      least, for BatchNorm's sake; micro-batches of one or two samples get no ``fixed_s``. The
      two sizes also bound each other (:func:`_clamp_stalls`): an affine cost at ``size`` rows
      is at most ``size / small`` times its cost at ``small`` rows, so a call that a CPU quota
      stalled in every repeat is recognised and cut back.
    - **Merged backward.** As many passes again run each block's backward in one call: what a
      ``BW`` action of 1F1B or GPipe, and a first stage's backward, cost. One pass over a block's
      graph is cheaper than ``B`` then ``W``, which walk it twice (about 15% on a CPU), and the
      planner would otherwise overcharge those schedules. ``backward_s`` is each block's
      ``B + W`` times the median ratio over blocks (:func:`_merged_ratio`).
    - **Sustained speed.** The fastest calls miss throttling that only bites after a while (a
      cgroup CPU quota allows a burst, then stalls the process until the next period). Full
      passes over all blocks run back to back for ``sustain_s`` seconds (two at least); if their
      timed calls take longer than the burst times add up to, every figure is scaled up by that
      factor
      (``sustained_factor``): the fastest calls give each block's share, the sustained passes
      the device's speed. ``sustain_s=0`` skips this. (Charging only the sustained *work* and
      running each action at burst speed predicts steps far shorter than they run: a device
      under its quota on average still stalls whenever a burst of actions spends the period's
      budget, and those stalls sit on the pipeline's critical path.)

    **Memory.** Besides the bytes of each block's output (``activation_bytes``, what a stage
    sends on), one untimed forward and backward per kind of block (alike blocks save the same
    tensors) measures what it keeps for backward (``saved_bytes``) and its transient peak beyond
    that (``transient_bytes``), per sample
    (:func:`~lightning_deepcee.runtime.measure.saved.block_memory_bytes`), once for all rounds.

    **Rounds.** With ``rounds > 1`` all of the above runs that many times in a row and every
    figure is the median over the rounds, entry by entry. One round's sustained factor is how
    much of its CPU quota a device got over a few seconds, which varies from one round to the
    next; the search would then favour whichever plan a low reading makes look fast.

    **Budget.** With ``budget_s``, one untimed pass first measures how long a pass takes, and
    :func:`fit_passes` cuts ``rounds``, then ``repeats`` and ``warmup`` (never below one round of
    one repeat) so that the whole measurement, the blocks' inputs and memory included, takes
    about ``budget_s``: a device at a tenth of a core would otherwise spend minutes here while
    every other device waits for it.

    Side-effect free: parameters are not updated, each parameter's ``.grad`` is restored (to
    ``None`` if it was unset), buffers (BatchNorm statistics) are restored and the global RNG
    state (dropout) is forked. Modules stay in their current train/eval mode.
    """
    blocks = list(blocks)
    _check_measure_arguments(blocks, sample_input, loss_fn, sample_batch, repeats, warmup)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds: expected a positive integer, got {rounds!r}")
    if budget_s is not None and not (
        isinstance(budget_s, (int, float)) and budget_s > 0 and math.isfinite(budget_s)
    ):
        raise ValueError(f"budget_s: expected None or positive finite seconds, got {budget_s!r}")
    began = time.perf_counter()
    device = tensor_leaves(sample_input)[0].device
    size = value_rows(sample_input, "sample_input")
    rng_devices = [device.index or 0] if device.type == "cuda" else []
    with RestoredState(blocks), torch.random.fork_rng(devices=rng_devices):
        inputs = block_inputs(blocks, sample_input)
        classes = alike_classes(blocks, inputs, last_has_loss=loss_fn is not None)
        memory = _memory(blocks, inputs, classes, loss_fn, sample_batch, size)
        jitter = _quota_period_s(device)
        round_ = _Round(blocks, inputs, classes, loss_fn, sample_batch, jitter)
        if budget_s is not None:
            start = time.perf_counter()
            time_pass(blocks, inputs, loss_fn, sample_batch, only=round_.timed)  # the probe pass
            pass_s = time.perf_counter() - start
            rounds, repeats, warmup = fit_passes(
                budget_s - (time.perf_counter() - began),
                pass_s,
                rounds,
                repeats,
                warmup,
                sustain_s=sustain_s,
                sleep_s=jitter / 2,
            )
        measured = [round_.measure(repeats, warmup, sustain_s, memory) for _ in range(rounds)]
    return _median_timings(measured)


def fit_passes(
    budget_s: float,
    pass_s: float,
    rounds: int,
    repeats: int,
    warmup: int,
    *,
    sustain_s: float = 0.0,
    sleep_s: float = 0.0,
) -> tuple[int, int, int]:
    """``(rounds, repeats, warmup)`` for :func:`measure_blocks` that fit ``budget_s`` seconds when
    one pass over the timed blocks takes ``pass_s``; at most the given figures, at least one round
    of one timed repeat and no warmup (the probe pass warmed up). A single repeat keeps a block's
    share of the pass less steady, and the sustained passes still give the device's speed: on
    a device at a tenth of a core the second repeat alone costs seconds of every set-up.

    A round costs ``(warmup + repeats) * 1.5 + 0.9 * repeats`` passes (the timed passes at both
    sizes, the merged-backward passes), each after a sleep of ``sleep_s`` on average (the random
    start under a CPU quota), then the sustained passes: ``sustain_s`` of them, two at least.
    ``budget_s`` is what is left after the parts measured once (the blocks' inputs, their memory
    and the probe pass). Rounds go first: their median steadies the sustained speed, which
    matters less than each block's fastest time.
    """
    sustained = max(2.0, sustain_s / max(pass_s, 1e-9)) if sustain_s > 0 else 0.0

    def cost(num_rounds: int, num_repeats: int, num_warmup: int) -> float:
        timed = (num_warmup + num_repeats) * (1 + _SMALL_PASS_SHARE)
        timed += _MERGED_PASS_SHARE * num_repeats
        sleeps = (num_warmup + num_repeats) * 2 + num_repeats
        return num_rounds * ((timed + sustained) * pass_s + sleeps * sleep_s)

    for num_rounds in range(rounds, 0, -1):
        if cost(num_rounds, repeats, warmup) <= budget_s:
            return num_rounds, repeats, warmup
    fit = [r for r in range(1, repeats + 1) if cost(1, r, 0) <= budget_s]
    num_repeats = max(fit, default=1)
    fit = [w for w in range(warmup + 1) if cost(1, num_repeats, w) <= budget_s]
    return 1, num_repeats, max(fit, default=0)


def _median_timings(rounds: Sequence[BlockTimings]) -> BlockTimings:
    """Every figure of ``rounds`` (one or more measurements of the same blocks) at its median."""
    if len(rounds) == 1:
        return rounds[0]

    def per_block(name: str) -> tuple[float, ...]:
        columns = zip(*(getattr(r, name) for r in rounds), strict=True)
        return tuple(statistics.median(column) for column in columns)

    forward, backward_input, backward_weight = (
        per_block("forward_s"),
        per_block("backward_input_s"),
        per_block("backward_weight_s"),
    )
    # Each round's fixed part is at most its own F+B+W, but medians taken entry by entry need
    # not keep that: F, B and W may each come from a different round, so that their sum falls
    # under the median fixed part. Capped at the median total, as one round caps it at its own.
    totals = [sum(parts) for parts in zip(forward, backward_input, backward_weight, strict=True)]
    # fixed_s is empty when the micro-batch was too small for a second size: strict=False.
    fixed = tuple(min(f, t) for f, t in zip(per_block("fixed_s"), totals, strict=False))
    # Likewise the merged backward is capped at the median B + W.
    splits = [b + w for b, w in zip(backward_input, backward_weight, strict=True)]
    merged = tuple(min(m, t) for m, t in zip(per_block("backward_s"), splits, strict=False))
    return dataclasses.replace(
        rounds[0],
        forward_s=forward,
        backward_input_s=backward_input,
        backward_weight_s=backward_weight,
        fixed_s=fixed,
        backward_s=merged,
        optimizer_s_per_byte=statistics.median(r.optimizer_s_per_byte for r in rounds),
        sustained_factor=statistics.median(r.sustained_factor for r in rounds),
    )


class _Round:
    """One round of :func:`measure_blocks` over prepared blocks (arguments already checked):
    ``inputs`` from :func:`block_inputs`, ``classes`` from :func:`alike_classes`, ``jitter`` the
    quota period (:func:`_quota_period_s`); it times the :func:`timed_blocks` of the classes.
    The caller restores the model's state and forks the RNG."""

    def __init__(
        self,
        blocks: list[nn.Module],
        inputs: list[Any],
        classes: list[int | None],
        loss_fn: LossFn | None,
        sample_batch: Any,
        jitter: float,
    ) -> None:
        self.blocks, self.inputs, self.classes = blocks, inputs, classes
        self.timed = timed_blocks(classes)
        self.size = value_rows(inputs[0], "sample_input")
        self.loss_fn, self.sample_batch, self.jitter = loss_fn, sample_batch, jitter

    def _fastest(
        self, values: list[Any], batch: Any, count: int, warm: int, *, merged: bool = False
    ) -> list[tuple[float, float, float]]:
        return block_fastest(
            self.blocks,
            values,
            self.loss_fn,
            batch,
            count,
            warm,
            self.jitter,
            merged=merged,
            only=self.timed,
        )

    def measure(
        self,
        repeats: int,
        warmup: int,
        sustain_s: float,
        memory: tuple[tuple[int, ...], tuple[int, ...]],
    ) -> BlockTimings:
        """The round's timings; ``memory``: the saved and transient bytes (measured once)."""
        blocks, inputs, classes, timed = self.blocks, self.inputs, self.classes, self.timed
        loss_fn, sample_batch, size = self.loss_fn, self.sample_batch, self.size
        split = self._fastest(inputs, sample_batch, repeats, warmup)
        fastest = pool_alike(split, classes, timed)
        small = max(2, size // 4)
        small_fastest = None
        if small < size:
            small_batch = slice_rows(sample_batch, size, small)
            # The blocks' inputs only: the last output is not an input, and may hold a scalar.
            small_inputs = [slice_value(value, 0, small) for value in inputs[:-1]]
            try:
                small_fastest = pool_alike(
                    self._fastest(small_inputs, small_batch, repeats, warmup), classes, timed
                )
            except (RuntimeError, ValueError) as exc:  # a model that only takes its batch size
                warnings.warn(
                    f"measure_blocks: the blocks failed on a {small}-sample slice of the "
                    f"micro-batch ({exc}); fixed per-call costs are not measured (taken as 0)",
                    stacklevel=3,
                )
        # Each timed block's own reading (not its class's median): more readings to take the
        # median of; untimed blocks have no B and are passed over.
        ratio = _merged_ratio(self._fastest(inputs, sample_batch, repeats, 0, merged=True), split)
        fixed = []
        if small_fastest is not None:
            fastest, small_fastest = _clamp_stalls(fastest, small_fastest, size / small)
            fixed = _fixed_costs(_totals(fastest), _totals(small_fastest), size, small)
        factor = 1.0
        burst = sum(total for i, total in enumerate(_totals(fastest)) if i in timed)
        if sustain_s > 0 and burst > 0:
            passes, sustained, start = 0, 0.0, time.perf_counter()
            while passes < 2 or time.perf_counter() - start < sustain_s:
                timings = time_pass(blocks, inputs, loss_fn, sample_batch, only=timed)
                sustained += sum(_totals(timings))
                passes += 1
            factor = max(1.0, sustained / passes / burst)
        activation = [math.ceil(value_bytes(output) / size) for output in inputs[1:]]
        optimizer = _optimizer_s_per_byte(blocks, repeats, warmup)
        return BlockTimings(
            forward_s=tuple(f * factor for f, _, _ in fastest),
            backward_input_s=tuple(b * factor for _, b, _ in fastest),
            backward_weight_s=tuple(w * factor for _, _, w in fastest),
            activation_bytes=tuple(activation),
            parameter_bytes=tuple(parameter_bytes(block) for block in blocks),
            saved_bytes=memory[0],
            transient_bytes=memory[1],
            microbatch_size=size,
            fixed_s=tuple(value * factor for value in fixed),
            backward_s=tuple((b + w) * ratio * factor for _, b, w in fastest),
            optimizer_s_per_byte=optimizer * factor,
            sustained_factor=factor,
        )


def _quota_period_s(device: torch.device) -> float:
    """The CFS period of this process's CPU quota when the blocks run on the CPU, else 0: how
    much :func:`block_fastest` shifts each pass's start."""
    if device.type != "cpu":
        return 0.0
    quota = read_cpu_quota()
    return 0.0 if quota is None else quota.period_s


def _memory(
    blocks: list[nn.Module],
    inputs: list[Any],
    classes: list[int | None],
    loss_fn: LossFn | None,
    sample_batch: Any,
    size: int,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """:func:`block_memory_bytes` of one block per class of like blocks (alike blocks save the
    same tensors: the same modules on the same shapes), the others given their class's figures;
    or nothing (with a warning) for blocks it cannot follow."""
    measured = first_of_classes(classes)
    try:
        saved, transient = block_memory_bytes(
            blocks, inputs, loss_fn, sample_batch, size, only=measured
        )
    except (RuntimeError, TypeError, NotImplementedError) as exc:  # e.g. a compiled block
        warnings.warn(
            f"measure_blocks: the blocks' saved and transient bytes could not be measured "
            f"({type(exc).__name__}: {exc}); the planner takes each block's output bytes as what "
            "it keeps for backward, which undercounts activation memory",
            stacklevel=3,
        )
        return (), ()
    return share_alike(saved, classes), share_alike(transient, classes)


def _optimizer_s_per_byte(blocks: Sequence[nn.Module], repeats: int, warmup: int) -> float:
    """Fastest seconds per parameter byte of an Adam step over the largest block's parameters.

    The step runs on detached clones with small random gradients (the model is not touched;
    the caller forks the RNG), once to create Adam's state, ``warmup`` more times untimed, then
    ``repeats`` timed; only one block is cloned so that memory stays bounded on a large model.
    Not zero gradients: Adam's moments then stay zero and its step runs far slower than on a
    training step's gradients.
    """
    largest = max(blocks, key=parameter_bytes)
    num_bytes = parameter_bytes(largest)
    if num_bytes == 0:
        return 0.0
    clones = [p.detach().clone().requires_grad_(True) for p in largest.parameters()]
    for clone in clones:
        clone.grad = torch.randn_like(clone).mul_(1e-3)
    optimizer = torch.optim.Adam(clones, lr=1e-3)
    for _ in range(1 + warmup):
        optimizer.step()
    fastest = math.inf
    for _ in range(repeats):
        sync_device(clones[0].device)
        start = time.perf_counter()
        optimizer.step()
        sync_device(clones[0].device)
        fastest = min(fastest, time.perf_counter() - start)
    return fastest / num_bytes


def _merged_ratio(
    merged: Sequence[tuple[float, float, float]], split: Sequence[tuple[float, float, float]]
) -> float:
    """One backward call over ``B`` then ``W``: the median over the blocks that have a ``B`` of
    each block's ratio, at most 1 (1 when none has one). Under a CPU quota a block's fastest
    reading may still be a stalled one; the median over blocks passes those over."""
    pairs = zip(merged, split, strict=True)
    ratios = [min(1.0, bw / (b + w)) for (_, _, bw), (_, b, w) in pairs if b > 0]
    return statistics.median(ratios) if ratios else 1.0


def _clamp_stalls(
    big: Sequence[tuple[float, float, float]],
    small: Sequence[tuple[float, float, float]],
    ratio: float,
) -> tuple[list[tuple[float, float, float]], list[tuple[float, float, float]]]:
    """Bound each (block, F/B/W) time at the big size by ``ratio`` x its time at the small size.

    A cost that is affine in the rows with a non-negative intercept never takes more than
    ``ratio = size / small`` times its small-batch time, and fewer rows never take longer. A
    fastest time above that bound is a quota stall that hit the call in every repeat. Such an
    outlier also inflates the burst sum that ``sustained_factor`` divides by, so every *other*
    block of the device would come out too fast, and plans with stages on that device would run
    slower than predicted.
    """
    clamped = [
        (min(bf, ratio * sf), min(bb, ratio * sb), min(bw, ratio * sw))
        for (bf, bb, bw), (sf, sb, sw) in zip(big, small, strict=True)
    ]
    small_clamped = [
        (min(sf, bf), min(sb, bb), min(sw, bw))
        for (bf, bb, bw), (sf, sb, sw) in zip(clamped, small, strict=True)
    ]
    return clamped, small_clamped


def _totals(times: Sequence[tuple[float, float, float]]) -> list[float]:
    return [sum(fbw) for fbw in times]


def _fixed_costs(big: Sequence[float], small: Sequence[float], size: int, rows: int) -> list[float]:
    """Each block's per-call cost from its F+B+W at ``size`` and at ``rows`` samples.

    The intercept of the line through the two *sums* over all blocks (one fit: per-block lines
    through two noisy points often cross zero) is shared out in proportion to each block's time at
    ``rows`` samples, and capped at the block's own time.
    """
    big_sum, small_sum = sum(big), sum(small)
    slope = max(0.0, (big_sum - small_sum) / (size - rows))
    intercept = min(big_sum, max(0.0, big_sum - slope * size))
    if small_sum <= 0:
        return [0.0] * len(big)
    return [min(b, intercept * s / small_sum) for b, s in zip(big, small, strict=True)]


def _check_measure_arguments(
    blocks: list[nn.Module],
    sample_input: object,
    loss_fn: LossFn | None,
    sample_batch: Any,
    repeats: int,
    warmup: int,
) -> None:
    if not blocks:
        raise ValueError("blocks: expected at least one nn.Module, got 0")
    for index, block in enumerate(blocks):
        if not isinstance(block, nn.Module):
            raise ValueError(f"blocks[{index}]: expected an nn.Module, got {type(block).__name__}")
    tensors, _ = flatten_value(sample_input, "sample_input")  # TypeError for a foreign leaf
    if not tensors or any(t.dim() == 0 for t in tensors):
        shapes = [tuple(t.shape) for t in tensors] or type(sample_input).__name__
        raise ValueError(
            "sample_input: expected a tensor (or a tuple/list/dict of tensors) with a leading "
            f"batch dimension, got {shapes}"
        )
    if value_rows(sample_input, "sample_input") == 0:
        raise ValueError("sample_input: expected a micro-batch of at least 1 sample, got 0")
    if loss_fn is not None and sample_batch is None:
        raise ValueError("sample_batch: required with loss_fn (the loss reads targets from it)")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: expected a positive integer, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup: expected a non-negative integer, got {warmup!r}")
