"""Measurement: time the model's blocks on this device and every link between devices.

This module owns the benchmarks behind a :class:`~lightning_deepcee.profiler.ClusterProfile`
(the pure data types live in ``profiler/data.py``; this is the torch side):

- :func:`measure_blocks`: forward, input-gradient (``B``) and weight-gradient (``W``) seconds of
  each block, split exactly like the executor splits them (``stage_backward_input`` /
  ``stage_backward_weight``), plus activation and parameter bytes.
- :func:`available_memory_bytes`: memory this process may still use on a device.
- :func:`measure_network`: latency and bandwidth of every ordered pair of ranks.
- :func:`profile_cluster` / :func:`profile_or_load`: all of the above on every rank, gathered into
  one ``ClusterProfile`` that every rank holds (and cached on disk by rank 0).

Why rounds of disjoint pairs: measuring one pair at a time needs ``N(N-1)/2`` sequential steps;
measuring all pairs at once makes every rank's NIC carry ``N-1`` streams, so each link looks
``N-1`` times slower than it is. A round-robin tournament (the circle method) splits the pairs
into ``N-1`` rounds (``N`` for odd ``N``, one rank idle per round) in which every rank talks to
at most one peer, so each measurement sees an otherwise quiet link and the whole matrix costs
about ``N`` pair measurements of wall time.

Each direction of a pair is measured on its own, so asymmetric links (a slow uplink) show: the
initiator sends a ``small_bytes`` ping and gets a ``small_bytes`` pong (latency = round trip / 2),
then sends a large ping and gets a ``small_bytes`` pong (the large size is chosen per link by a
warm-up round: about 0.2 s of transfer, at most ``large_bytes``). The two round trips differ only
by the extra bytes going one way, so ``bandwidth = (large - small) / (rtt_large - rtt_small)``;
echoing the large message back would average both directions. Noise only ever adds time (a
process throttled by its CPU quota, a round trip that waited for a scheduler slot, another pair's
traffic on the shared cores), so each round trip keeps its *minimum* over ``repeats``: the
fastest repeat is the one that saw the link alone, as in ping's and BBR's min-RTT filters. A
median keeps a stalled small round trip as often as a stalled large one, and a stall on the small
one makes the difference, and so the bandwidth, too high (29 Mbit/s read on a 20 Mbit/s link of
the lab).

Time limits (a slow or dead device must never hang setup silently):

- ``budget_s`` bounds the whole network measurement. The initiator of each pair checks it before
  every ping and tells its peer in the ping itself; at the end of each round all ranks exchange
  which pair (if any) ran out, so *every* rank raises :class:`ProfilingTimeoutError` naming that
  pair, instead of some ranks waiting forever for a peer that gave up.
- A device that never answers is bounded by ``op_timeout_s`` if given, else by the process
  group's timeout (``init_process_group(timeout=...)``, 30 min by default for gloo). The error
  from ``torch.distributed`` is re-raised as ``ProfilingTimeoutError`` naming the silent peer's
  rank and host. The other ranks then fail in the next collective, also within the timeout.

Runtime layer: torch and torch.distributed, never lightning.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import socket
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_deepcee._compat import stage_backward_input, stage_backward_weight, tree_map
from lightning_deepcee.profiler.data import (
    ClusterProfile,
    DeviceProfile,
    capability_score,
    fingerprint,
    fingerprint_cluster,
    load_cached_profile,
)
from lightning_deepcee.profiler.grouping import group_by_network
from lightning_deepcee.runtime.cpu_quota import read_cpu_quota
from lightning_deepcee.runtime.liveness import DeviceLostError, default_store, wait_for_ranks
from lightning_deepcee.runtime.transport import wire_device

__all__ = [
    "DEVICE_KIND_ENV",
    "BlockTimings",
    "NetworkMeasurement",
    "ProfilingTimeoutError",
    "available_memory_bytes",
    "measure_blocks",
    "measure_network",
    "model_fingerprint",
    "profile_cluster",
    "profile_or_load",
    "round_robin_rounds",
]

DEVICE_KIND_ENV = "DEEPCEE_DEVICE_KIND"
"""Environment variable naming this device's class (``cloud``, ``edge``, ``end``, ...); when
unset the kind is the torch device type (``cpu``, ``cuda``)."""

LossFn = Callable[[torch.Tensor, Any], torch.Tensor]

# Ping header: byte 0 of every small ping says whether the initiator goes on; bytes 1-8 carry
# the size of the large message that follows (int64), which the initiator adapts to the link.
_CONTINUE = 1
_STOP = 2
_HEADER_BYTES = 9
_PROBE_BYTES = 256 * 2**10
"""The warm-up round sends at most this much; its time sizes the measured messages."""
_TARGET_S = 0.2
"""Measured large messages are sized to take about this long on the link (between the probe
size and ``large_bytes``): a fixed 4 MiB message would take 1.7 s on a 20 Mbit/s WAN link, and
the measurement sends ``2 * repeats`` of them per pair. Shorter is faster but reads high: on
the lab, 0.1 s messages let the shaper's burst through (24-28 Mbit/s read on 20 Mbit/s links,
13 of 168 pairs off by more than 20%; 0 of 56 at 0.2 s)."""


class ProfilingTimeoutError(RuntimeError):
    """Profiling ran past its time budget, or a peer did not answer within the timeout."""


# --------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------


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
    """Bytes of each block's output per sample (rounded up)."""
    parameter_bytes: tuple[int, ...]
    """Bytes of each block's parameters."""
    microbatch_size: int
    """Samples in the measured micro-batch (``sample_input.shape[0]``)."""
    fixed_s: tuple[float, ...] = ()
    """Per block, the part of its F+B+W seconds that does not shrink with the micro-batch: the
    intercept of the line through the totals at ``microbatch_size`` and at a quarter of it (two
    samples at least), shared out by each block's time at the small size. Empty when the
    micro-batch is too small for a second size."""
    optimizer_s_per_byte: float = 0.0
    """Seconds per parameter byte of a reference optimizer step (``torch.optim.Adam``, the
    default ``foreach`` path) on this device, timed on clones of the largest block's parameters
    and scaled by ``sustained_factor``; 0 when no block has parameters. The planner charges a
    stage's devices this rate times the stage's parameter bytes (Adam reads and writes about
    four tensors per parameter: a memory-bound step, linear in the bytes)."""
    sustained_factor: float = 1.0
    """Sustained over burst: wall time of back-to-back passes over all blocks divided by the sum
    of the per-block burst times (at least 1). Above 1 when the device cannot keep its burst
    speed, e.g. a CPU quota (cgroup ``cpu.max``) that throttles after a few milliseconds of work.
    Every ``*_s`` figure above is already multiplied by it."""

    @property
    def num_blocks(self) -> int:
        """Number of blocks measured."""
        return len(self.forward_s)


def measure_blocks(
    blocks: Sequence[nn.Module],
    sample_input: torch.Tensor,
    *,
    loss_fn: LossFn | None = None,
    sample_batch: Any = None,
    repeats: int = 5,
    warmup: int = 2,
    sustain_s: float = 0.5,
    rounds: int = 1,
) -> BlockTimings:
    """Time forward, ``B`` and ``W`` of each block on one micro-batch, on ``sample_input.device``.

    Block ``i`` gets the output of block ``i-1`` (block 0 gets ``sample_input``). Each block runs
    ``warmup`` untimed then ``repeats`` timed iterations, each a pass over all blocks in a
    pipeline stage's order (every F, then every B last block first, then every W; see
    :func:`_time_pass`); the fastest is kept (the burst speed, see below). Backward starts
    from a random gradient of the block output's shape, except for the last block when
    ``loss_fn`` is given: then its forward includes
    ``loss_fn(output, sample_batch)`` and its backward starts from that loss, as in the last
    pipeline stage.

    A block whose input needs no gradient has ``B = 0`` and ``W`` = its whole backward. That is
    always block 0 (the data, token ids or features, never needs a gradient; the executor runs
    the first stage's backward whole) and any block fed a non-floating-point tensor.

    Two more figures make the times predict a training step rather than a micro-benchmark:

    - **Fixed cost.** With two or more samples, every block is timed again on a quarter of the
      micro-batch (rows sliced from ``sample_input`` and from every tensor of ``sample_batch``
      with the same leading size). The line through the two *totals* over all blocks gives the
      per-call cost a smaller micro-batch cannot shrink, shared out as ``fixed_s`` in proportion
      to each block's time at the small size (one fit over the sum: per-block lines through two
      noisy points often cross zero, and then small micro-batches look free). Two samples at
      least, for BatchNorm's sake; micro-batches of one or two samples get no ``fixed_s``. The
      two sizes also bound each other (:func:`_clamp_stalls`): an affine cost at ``size`` rows
      is at most ``size / small`` times its cost at ``small`` rows, so a call that a CPU quota
      stalled in every repeat is recognised and cut back.
    - **Sustained speed.** The fastest calls miss throttling that only bites after a while (a
      cgroup CPU quota allows a burst, then stalls the process until the next period). Full
      passes over all blocks run back to back for ``sustain_s`` seconds (two at least); if they
      take longer than the burst times add up to, every figure is scaled up by that factor
      (``sustained_factor``): the fastest calls give each block's share, the sustained passes
      the device's speed. ``sustain_s=0`` skips this. (Charging only the sustained *work* and
      running each action at burst speed was tried on the lab and predicted steps half as long
      as measured: a device under its quota on average still stalls whenever a burst of
      actions spends the period's budget, and those stalls sit on the pipeline's critical path.)

    **Rounds.** With ``rounds > 1`` all of the above runs that many times in a row and every
    figure is the median over the rounds, entry by entry. One round's sustained factor is how
    much of its CPU quota a device got over a few seconds: on the lab the same device measured
    3-20% apart in rounds 20 s apart, and the search then favours whichever plan a low reading
    makes look fast (``benchmarks/results/experiments/profile_repeat/``).

    Side-effect free: parameters are not updated, each parameter's ``.grad`` is restored (to
    ``None`` if it was unset), buffers (BatchNorm statistics) are restored and the global RNG
    state (dropout) is forked. Modules stay in their current train/eval mode.
    """
    blocks = list(blocks)
    _check_measure_arguments(blocks, sample_input, loss_fn, sample_batch, repeats, warmup)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds: expected a positive integer, got {rounds!r}")
    return _median_timings(
        [
            _measure_round(blocks, sample_input, loss_fn, sample_batch, repeats, warmup, sustain_s)
            for _ in range(rounds)
        ]
    )


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
    # under the median fixed part (CI saw 0.1274 ms fixed against a 0.1235 ms block). Capped at
    # the median total, as one round caps it at its own.
    totals = [sum(parts) for parts in zip(forward, backward_input, backward_weight, strict=True)]
    # fixed_s is empty when the micro-batch was too small for a second size: strict=False.
    fixed = tuple(min(f, t) for f, t in zip(per_block("fixed_s"), totals, strict=False))
    return dataclasses.replace(
        rounds[0],
        forward_s=forward,
        backward_input_s=backward_input,
        backward_weight_s=backward_weight,
        fixed_s=fixed,
        optimizer_s_per_byte=statistics.median(r.optimizer_s_per_byte for r in rounds),
        sustained_factor=statistics.median(r.sustained_factor for r in rounds),
    )


def _measure_round(
    blocks: list[nn.Module],
    sample_input: torch.Tensor,
    loss_fn: LossFn | None,
    sample_batch: Any,
    repeats: int,
    warmup: int,
    sustain_s: float,
) -> BlockTimings:
    """One round of :func:`measure_blocks` (arguments already checked)."""
    device = sample_input.device
    rng_devices = [device.index or 0] if device.type == "cuda" else []
    size = len(sample_input)
    with _RestoredState(blocks), torch.random.fork_rng(devices=rng_devices):
        inputs = _block_inputs(blocks, sample_input)
        fastest = _block_fastest(blocks, inputs, loss_fn, sample_batch, repeats, warmup)
        small = max(2, size // 4)
        small_fastest = None
        if small < size:
            small_batch = _slice_rows(sample_batch, size, small)
            small_inputs = [value[:small] for value in inputs]
            try:
                small_fastest = _block_fastest(
                    blocks, small_inputs, loss_fn, small_batch, repeats, warmup
                )
            except (RuntimeError, ValueError) as exc:  # a model that only takes its batch size
                warnings.warn(
                    f"measure_blocks: the blocks failed on a {small}-sample slice of the "
                    f"micro-batch ({exc}); fixed per-call costs are not measured (taken as 0)",
                    stacklevel=2,
                )
        fixed = []
        if small_fastest is not None:
            fastest, small_fastest = _clamp_stalls(fastest, small_fastest, size / small)
            fixed = _fixed_costs(_totals(fastest), _totals(small_fastest), size, small)
        factor = 1.0
        burst = sum(_totals(fastest))
        if sustain_s > 0 and burst > 0:
            passes, start = 0, time.perf_counter()
            while passes < 2 or time.perf_counter() - start < sustain_s:
                _time_pass(blocks, inputs, loss_fn, sample_batch)
                passes += 1
            factor = max(1.0, (time.perf_counter() - start) / passes / burst)
        activation = [
            math.ceil(output.numel() * output.element_size() / size) for output in inputs[1:]
        ]
        optimizer = _optimizer_s_per_byte(blocks, repeats, warmup)
    return BlockTimings(
        forward_s=tuple(f * factor for f, _, _ in fastest),
        backward_input_s=tuple(b * factor for _, b, _ in fastest),
        backward_weight_s=tuple(w * factor for _, _, w in fastest),
        activation_bytes=tuple(activation),
        parameter_bytes=tuple(_parameter_bytes(block) for block in blocks),
        microbatch_size=size,
        fixed_s=tuple(value * factor for value in fixed),
        optimizer_s_per_byte=optimizer * factor,
        sustained_factor=factor,
    )


def _optimizer_s_per_byte(blocks: Sequence[nn.Module], repeats: int, warmup: int) -> float:
    """Fastest seconds per parameter byte of an Adam step over the largest block's parameters.

    The step runs on detached clones with small random gradients (the model is not touched;
    the caller forks the RNG), once to create Adam's state, ``warmup`` more times untimed, then
    ``repeats`` timed; only one block is cloned so that memory stays bounded on a large model.
    Not zero gradients: Adam's moments then stay zero and its step took 2.4 times as long as on
    a training step's gradients (1.98 against 0.83 ms for one GPT block on this machine).
    """
    largest = max(blocks, key=_parameter_bytes)
    num_bytes = _parameter_bytes(largest)
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
        _sync(clones[0].device)
        start = time.perf_counter()
        optimizer.step()
        _sync(clones[0].device)
        fastest = min(fastest, time.perf_counter() - start)
    return fastest / num_bytes


def _clamp_stalls(
    big: Sequence[tuple[float, float, float]],
    small: Sequence[tuple[float, float, float]],
    ratio: float,
) -> tuple[list[tuple[float, float, float]], list[tuple[float, float, float]]]:
    """Bound each (block, F/B/W) time at the big size by ``ratio`` x its time at the small size.

    A cost that is affine in the rows with a non-negative intercept never takes more than
    ``ratio = size / small`` times its small-batch time, and fewer rows never take longer. A
    fastest time above that bound is a quota stall that hit the call in every repeat: on the
    lab's end devices one block's B measured 624 ms against 40-50 ms for its neighbours. Such an
    outlier also inflates the burst sum that ``sustained_factor`` divides by, so every *other*
    block of the device came out 31% too fast, and plans with stages on those devices ran 20-50%
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


def _block_fastest(
    blocks: Sequence[nn.Module],
    inputs: Sequence[torch.Tensor],
    loss_fn: LossFn | None,
    sample_batch: Any,
    repeats: int,
    warmup: int,
) -> list[tuple[float, float, float]]:
    """Fastest (F, B, W) seconds of each block on its input in ``inputs`` (over ``repeats``).

    The fastest call is the one that ran unthrottled: a CPU quota stalls whichever calls run
    after the period's budget is spent (5 ms or 90 ms for the same block on the lab's end
    devices), and a median of five consecutive calls lands on either. The repeats run as passes
    over all blocks (not five calls of one block, then the next): consecutive calls of one block
    fall into the same throttled stretch, and once gave some blocks of an end device their burst
    time and others ten times more, so the planner put three transformer layers there. Sustained
    speed is measured separately (``sustained_factor``). Each pass runs in a stage's order
    (:func:`_time_pass`).
    """
    times: list[list[tuple[float, float, float]]] = [[] for _ in blocks]
    for repeat in range(warmup + repeats):
        timings = _time_pass(blocks, inputs, loss_fn, sample_batch)
        if repeat >= warmup:
            for index, timing in enumerate(timings):
                times[index].append(timing)
    fastest = [
        (min(t[0] for t in ts), min(t[1] for t in ts), min(t[2] for t in ts)) for ts in times
    ]
    return fastest


def _slice_rows(batch: Any, size: int, rows: int) -> Any:
    """``batch`` with every tensor whose leading dimension is ``size`` cut to its first ``rows``."""

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and len(value) == size:
            return value[:rows]
        return value

    return tree_map(cut, batch)


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
    if not isinstance(sample_input, torch.Tensor) or sample_input.dim() == 0:
        raise ValueError(
            "sample_input: expected a tensor with a leading batch dimension, got "
            f"{getattr(sample_input, 'shape', type(sample_input).__name__)}"
        )
    if len(sample_input) == 0:
        raise ValueError("sample_input: expected a micro-batch of at least 1 sample, got 0")
    if loss_fn is not None and sample_batch is None:
        raise ValueError("sample_batch: required with loss_fn (the loss reads targets from it)")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: expected a positive integer, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup: expected a non-negative integer, got {warmup!r}")


class _RestoredState:
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


def _parameter_bytes(block: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in block.parameters())


def _block_inputs(blocks: Sequence[nn.Module], sample_input: torch.Tensor) -> list[torch.Tensor]:
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_pass(
    blocks: Sequence[nn.Module],
    inputs: Sequence[torch.Tensor],
    loss_fn: LossFn | None,
    sample_batch: Any,
) -> list[tuple[float, float, float]]:
    """F of every block, then B of every block (last first), then W: seconds of each.

    The order a pipeline stage runs them in: a block's B and W find its activations and
    intermediate gradients after other work has passed through the caches, not right after its
    F. Timing each block's F, B and W back to back measured them hot; on the lab's CPU-quota
    devices training then cost 10-20% more per pass than profiled and the cost model
    under-predicted cee6 steps by up to 19% (docs/profiler.md). The pass holds one micro-batch's
    activations of every block at once, as a device training the whole model would.

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
        _sync(device)
        start = time.perf_counter()
        output = block(x)
        root = output if loss_fn is None or index != last else loss_fn(output, sample_batch)
        _sync(device)
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
        _sync(device)
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
        _sync(device)
        weight[index] = time.perf_counter() - start
    return list(zip(forward, backward, weight, strict=True))


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------


def available_memory_bytes(device: torch.device | str) -> int:
    """Bytes this process may still allocate on ``device``.

    - CUDA: free memory from ``torch.cuda.mem_get_info`` (other processes' use is subtracted).
    - Anything else (host memory): ``MemAvailable`` from ``/proc/meminfo`` (Linux: free plus
      reclaimable page cache), capped by the cgroup v2 limit minus usage when this process runs
      in a memory-limited container (``/sys/fs/cgroup/memory.max``), since an edge device's
      container limit, not the host's RAM, is what the job may use. Without ``/proc/meminfo``
      (macOS, Windows) falls back to ``os.sysconf`` available pages, then total pages; psutil is
      not required. Raises ``RuntimeError`` if none of these exist.
    """
    device = torch.device(device)
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return int(free_bytes)
    available = _meminfo_available_bytes()
    if available is None:
        available = _sysconf_bytes()
    if available is None:
        raise RuntimeError(
            f"available_memory_bytes({device}): cannot read host memory (no /proc/meminfo, no "
            "os.sysconf page counts); declare memory_bytes in a hand-written ClusterProfile"
        )
    limit = _cgroup_free_bytes()
    return available if limit is None else min(available, limit)


def _meminfo_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel writes "kB" for KiB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _sysconf_bytes() -> int | None:
    for pages in ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES"):
        try:
            return int(os.sysconf(pages)) * int(os.sysconf("SC_PAGE_SIZE"))
        except (AttributeError, ValueError, OSError):
            continue
    return None


def _cgroup_free_bytes() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
        return max(int(limit) - int(used), 0)
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------------------------
# Network
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class NetworkMeasurement:
    """Link matrices indexed ``[src_rank][dst_rank]`` (ranks of the measured group)."""

    latency_s: tuple[tuple[float, ...], ...]
    """One-way latency of a ``small_bytes`` message, seconds; 0 on the diagonal."""
    bandwidth_bytes_per_s: tuple[tuple[float, ...], ...]
    """Bytes per second from ``src`` to ``dst``; ``inf`` on the diagonal."""
    num_rounds: int
    """Rounds of pairs used: the probe rounds (``N - 1`` for even ``N``, ``N`` for odd ``N``),
    then the measured rounds: those rounds' pairs inside network groups, and one round per pair
    across groups."""
    elapsed_s: float
    """Wall seconds this rank spent in :func:`measure_network`."""


def round_robin_rounds(num_ranks: int) -> list[list[tuple[int, int]]]:
    """Split all pairs of ``num_ranks`` ranks into rounds where each rank is in at most one pair.

    Circle method: rank 0 stays put, the others rotate one place per round. An odd count gets a
    phantom rank whose partner sits the round out, so there are ``N - 1`` rounds for even ``N``
    and ``N`` for odd ``N`` (none for a single rank). Pairs are ``(low, high)``, sorted.
    """
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks: expected a positive integer, got {num_ranks!r}")
    if num_ranks == 1:
        return []
    slots = num_ranks + num_ranks % 2
    circle = list(range(slots))
    rounds = []
    for _ in range(slots - 1):
        pairs = [
            (min(circle[i], circle[-1 - i]), max(circle[i], circle[-1 - i]))
            for i in range(slots // 2)
        ]
        rounds.append(sorted(pair for pair in pairs if pair[1] < num_ranks))
        circle = [circle[0], circle[-1], *circle[1:-1]]
    return rounds


def measure_network(
    *,
    group: dist.ProcessGroup | None = None,
    small_bytes: int = 1024,
    large_bytes: int = 4 * 2**20,
    repeats: int = 3,
    budget_s: float = 60.0,
    op_timeout_s: float | None = None,
    device: torch.device | str = "cpu",
    hosts: Sequence[str] | None = None,
) -> NetworkMeasurement:
    """Latency and bandwidth of every ordered pair of ranks in ``group``; collective.

    Every rank of ``group`` must call it with the same arguments; every rank returns the same
    full matrices. ``device`` holds the message buffers (``cuda`` for NCCL). ``hosts`` (one per
    rank) only improves error messages. Raises :class:`ProfilingTimeoutError` on every rank when
    ``budget_s`` runs out, naming the pair being measured; see the module docstring for the
    per-operation timeout (``op_timeout_s``, default: the process group's timeout).
    """
    for name, value, minimum in (
        ("small_bytes", small_bytes, _HEADER_BYTES),
        ("large_bytes", large_bytes, 1),
        ("repeats", repeats, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    if large_bytes <= small_bytes:
        raise ValueError(
            f"large_bytes: expected more than small_bytes ({small_bytes}) so that the difference "
            f"measures bandwidth, got {large_bytes}"
        )
    if not (isinstance(budget_s, (int, float)) and budget_s > 0 and math.isfinite(budget_s)):
        raise ValueError(
            f"budget_s: expected a positive finite number of seconds, got {budget_s!r}"
        )
    if op_timeout_s is not None and not op_timeout_s > 0:
        raise ValueError(f"op_timeout_s: expected None or positive seconds, got {op_timeout_s!r}")
    return _measure_network(
        group=group,
        small_bytes=small_bytes,
        large_bytes=large_bytes,
        repeats=repeats,
        budget_s=float(budget_s),
        op_timeout_s=op_timeout_s,
        device=torch.device(device),
        hosts=hosts,
    )


@dataclass(kw_only=True, slots=True)
class _PairContext:
    """What one rank needs to run its pair of the current round."""

    rank: int
    peer: int
    peer_global: int
    group: dist.ProcessGroup | None
    device: torch.device
    op_timeout: timedelta | None
    hosts: Sequence[str] | None
    deadline: float

    def name(self, rank: int) -> str:
        return f"rank {rank}" + (f" ({self.hosts[rank]})" if self.hosts else "")

    def send(self, tensor: torch.Tensor) -> None:
        self._wait(dist.isend(tensor, self.peer_global, group=self.group), "send to")

    def recv(self, tensor: torch.Tensor) -> None:
        self._wait(dist.irecv(tensor, self.peer_global, group=self.group), "receive from")

    def _wait(self, work: Any, what: str) -> None:
        try:
            if self.op_timeout is None:
                work.wait()
            else:
                work.wait(self.op_timeout)
            _sync(self.device)
        except RuntimeError as exc:
            raise ProfilingTimeoutError(
                f"{self.name(self.rank)}: could not {what} {self.name(self.peer)} while measuring "
                f"their link ({exc}). The peer is unreachable or stopped answering; the limit is "
                "op_timeout_s, else the process group timeout (init_process_group(timeout=...))."
            ) from exc


def _measure_network(
    *,
    group: dist.ProcessGroup | None,
    small_bytes: int,
    large_bytes: int,
    repeats: int,
    budget_s: float,
    op_timeout_s: float | None,
    device: torch.device,
    hosts: Sequence[str] | None,
) -> NetworkMeasurement:
    start = time.perf_counter()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if hosts is not None and len(hosts) != world:
        raise ValueError(f"hosts: expected {world} names (one per rank), got {len(hosts)}")
    rounds = round_robin_rounds(world)
    # Phase 1: one sizing probe each way for every pair, in rounds of disjoint pairs.
    _, probe_bandwidth = _run_rounds(
        [(pairs, "probe") for pairs in rounds],
        rank=rank, group=group, device=device, op_timeout_s=op_timeout_s, hosts=hosts,
        small_bytes=small_bytes, large_bytes=large_bytes, repeats=0, sizes=None,
        budget_s=budget_s, start=start, first_round=0, total_rounds=None,
    )  # fmt: skip
    # Phase 2: the measured figures. Pairs inside a network group run concurrently (a switch
    # carries disjoint pairs at full rate); pairs across groups run one at a time, because they
    # may share one WAN link (two cloud devices talking to two edge devices at once each see
    # half of it: 34.7 Mbit/s was read on a 100 Mbit/s link that three pairs crossed together).
    members = group_by_network(probe_bandwidth.cpu().numpy())
    group_of = {r: g for g, ranks in enumerate(members) for r in ranks}
    inside = [[p for p in pairs if group_of[p[0]] == group_of[p[1]]] for pairs in rounds]
    across = [[p] for pairs in rounds for p in pairs if group_of[p[0]] != group_of[p[1]]]
    schedule = [(pairs, "inside groups") for pairs in inside if pairs]
    schedule += [(pairs, "across groups") for pairs in across]
    sizes = (probe_bandwidth * _TARGET_S).clamp(min=small_bytes + 1, max=large_bytes)
    latency, bandwidth = _run_rounds(
        schedule,
        rank=rank, group=group, device=device, op_timeout_s=op_timeout_s, hosts=hosts,
        small_bytes=small_bytes, large_bytes=large_bytes, repeats=repeats,
        sizes=sizes.cpu().long().tolist(), budget_s=budget_s, start=start,
        first_round=len(rounds), total_rounds=len(rounds) + len(schedule),
    )  # fmt: skip
    bandwidth.fill_diagonal_(math.inf)
    return NetworkMeasurement(
        latency_s=tuple(tuple(row) for row in latency.cpu().tolist()),
        bandwidth_bytes_per_s=tuple(tuple(row) for row in bandwidth.cpu().tolist()),
        num_rounds=len(rounds) + len(schedule),
        elapsed_s=time.perf_counter() - start,
    )


def _run_rounds(
    schedule: Sequence[tuple[Sequence[tuple[int, int]], str]],
    *,
    rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    op_timeout_s: float | None,
    hosts: Sequence[str] | None,
    small_bytes: int,
    large_bytes: int,
    repeats: int,
    sizes: Sequence[Sequence[int]] | None,
    budget_s: float,
    start: float,
    first_round: int,
    total_rounds: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Measure each round's disjoint pairs concurrently; every rank returns the full matrices.

    ``sizes[i][j]`` is the large message from ``i`` to ``j``; ``None`` sizes it with a probe
    (and with ``repeats=0`` the probe is the measurement: the phase-1 figures).
    """
    world = dist.get_world_size(group)
    latency = torch.zeros(world, world, dtype=torch.float64, device=device)
    bandwidth = torch.zeros(world, world, dtype=torch.float64, device=device)
    total = total_rounds if total_rounds is not None else first_round + len(schedule)
    for index, (pairs, phase) in enumerate(schedule):
        stopped: tuple[int, int] | None = None
        for low, high in pairs:
            if rank not in (low, high):
                continue
            peer = high if rank == low else low
            context = _PairContext(
                rank=rank,
                peer=peer,
                peer_global=peer if group is None else dist.get_global_rank(group, peer),
                group=group,
                device=device,
                op_timeout=None if op_timeout_s is None else timedelta(seconds=op_timeout_s),
                hosts=hosts,
                deadline=start + budget_s,
            )
            size = None if sizes is None else (sizes[low][high], sizes[high][low])
            result = _measure_pair(context, low, high, small_bytes, large_bytes, repeats, size)
            if result is None:
                stopped = (low, high)
            else:
                latency[rank, peer], bandwidth[rank, peer] = result
        where = f"round {first_round + index + 1} of {total} ({phase})"
        _raise_if_any_stopped(stopped, group, device, hosts, budget_s, start, where)
    dist.all_reduce(latency, group=group)
    dist.all_reduce(bandwidth, group=group)
    return latency, bandwidth


def _measure_pair(
    context: _PairContext,
    low: int,
    high: int,
    small_bytes: int,
    large_bytes: int,
    repeats: int,
    sizes: tuple[int, int] | None,
) -> tuple[float, float] | None:
    """Measure ``low -> high`` then ``high -> low``; return this rank's outgoing direction.

    Returns ``(latency_s, bandwidth_bytes_per_s)`` from this rank to its peer, or ``None`` when
    the budget ran out (both ranks of the pair agree, because the initiator says so in its ping).
    ``sizes`` are the large messages ``low -> high`` and ``high -> low`` (``None``: probe first).
    """
    small = torch.zeros(small_bytes, dtype=torch.uint8, device=context.device)
    large = torch.zeros(large_bytes, dtype=torch.uint8, device=context.device)
    iterations = repeats if sizes is not None else repeats + 1
    mine: tuple[float, float] | None = None
    for initiator, size in zip((low, high), sizes or (None, None), strict=True):
        if context.rank == initiator:
            mine = _initiate(context, small, large, iterations, size)
            if mine is None:
                return None
        elif not _respond(context, small, large, iterations):
            return None
    return mine


def _initiate(
    context: _PairContext,
    small: torch.Tensor,
    large: torch.Tensor,
    iterations: int,
    size: int | None,
) -> tuple[float, float] | None:
    """``iterations`` ping-pairs; without ``size`` the first is a probe that sizes the rest.

    With a single probe iteration the probe's own figures are returned (phase 1).
    """
    small_rtt: list[float] = []
    large_rtt: list[float] = []
    probe = size is None
    if size is None:
        size = max(len(small) + 1, min(len(large), _PROBE_BYTES))
    for iteration in range(iterations):
        go = time.perf_counter() < context.deadline
        small[0] = _CONTINUE if go else _STOP
        small[1:_HEADER_BYTES] = torch.tensor([size], dtype=torch.int64).view(torch.uint8)
        begin = time.perf_counter()
        context.send(small)
        if not go:
            return None
        context.recv(small)
        middle = time.perf_counter()
        context.send(large[:size])
        context.recv(small)
        end = time.perf_counter()
        small_rtt.append(middle - begin)
        large_rtt.append(end - middle)
        if probe and iteration == 0:
            if iterations == 1:
                break  # the probe is the measurement
            small_rtt.clear()
            large_rtt.clear()
            # Size the measured messages to take about _TARGET_S on this link.
            rough = size / max(end - middle - (middle - begin), 1e-6)
            size = int(min(len(large), max(size, rough * _TARGET_S)))
    small_s, large_s = min(small_rtt), min(large_rtt)  # noise only adds time: see the docstring
    extra_bytes = size - len(small)
    # The extra bytes took (large_s - small_s); noise on a very fast link can make that <= 0, so
    # fall back to the lower bound "the whole large message fit in its round trip".
    extra_s = large_s - small_s
    bandwidth = extra_bytes / extra_s if extra_s > 0 else size / max(large_s, 1e-9)
    return small_s / 2, bandwidth


def _respond(
    context: _PairContext, small: torch.Tensor, large: torch.Tensor, iterations: int
) -> bool:
    for _ in range(iterations):
        context.recv(small)
        if int(small[0]) == _STOP:
            return False
        size = int(small[1:_HEADER_BYTES].clone().view(torch.int64)[0])
        context.send(small)
        context.recv(large[:size])
        context.send(small)
    return True


def _raise_if_any_stopped(
    stopped: tuple[int, int] | None,
    group: dist.ProcessGroup | None,
    device: torch.device,
    hosts: Sequence[str] | None,
    budget_s: float,
    start: float,
    where: str,
) -> None:
    """End of a round: every rank learns which pairs ran out of budget and raises alike."""
    world = dist.get_world_size(group)
    status = torch.full((2,), -1, dtype=torch.int64, device=device)
    if stopped is not None:
        status[0], status[1] = stopped
    gathered = [torch.empty_like(status) for _ in range(world)]
    dist.all_gather(gathered, status, group=group)
    pairs = sorted({(int(t[0]), int(t[1])) for t in gathered if int(t[0]) >= 0})
    if not pairs:
        return

    def name(rank: int) -> str:
        return f"rank {rank}" + (f" ({hosts[rank]})" if hosts else "")

    described = ", ".join(f"{name(a)} <-> {name(b)}" for a, b in pairs)
    raise ProfilingTimeoutError(
        f"network profiling ran past budget_s={budget_s:g} s after "
        f"{time.perf_counter() - start:.3f} s, in {where} while measuring {described}. A link "
        "this slow may be the problem; otherwise raise budget_s or lower large_bytes / repeats."
    )


# --------------------------------------------------------------------------------------------
# Whole cluster
# --------------------------------------------------------------------------------------------


def model_fingerprint(blocks: Sequence[nn.Module]) -> str:
    """Fingerprint of the model structure: each block's class and parameter names/shapes/dtypes."""
    return fingerprint(
        [
            {
                "class": f"{type(block).__module__}.{type(block).__qualname__}",
                "parameters": [
                    [name, list(p.shape), str(p.dtype)] for name, p in block.named_parameters()
                ],
            }
            for block in blocks
        ]
    )


def _device_of(blocks: Sequence[nn.Module], device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    for block in blocks:
        for p in block.parameters():
            return p.device
    return torch.device("cpu")


def _identities(
    blocks: Sequence[nn.Module], group: dist.ProcessGroup | None
) -> tuple[list[str], str]:
    """Gather every rank's host; check that every rank holds the same model."""
    identity = (socket.gethostname(), model_fingerprint(blocks))
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, identity, group=group)
    fingerprints = {fp for _, fp in gathered}
    if len(fingerprints) != 1:
        per_rank = ", ".join(f"rank {r}: {fp}" for r, (_, fp) in enumerate(gathered))
        raise ValueError(
            f"profile_cluster: ranks hold different models (model fingerprints {per_rank}); "
            "every rank must build the same full model before partitioning"
        )
    return [host for host, _ in gathered], identity[1]


def profile_cluster(
    blocks: Sequence[nn.Module],
    sample_input: torch.Tensor,
    *,
    loss_fn: LossFn | None = None,
    sample_batch: Any = None,
    device: torch.device | str | None = None,
    group: dist.ProcessGroup | None = None,
    repeats: int = 5,
    warmup: int = 2,
    small_bytes: int = 1024,
    large_bytes: int = 4 * 2**20,
    network_repeats: int = 3,
    budget_s: float = 60.0,
    op_timeout_s: float | None = None,
    rounds: int = 3,
) -> ClusterProfile:
    """Measure every rank's blocks and every link; every rank returns the same profile.

    Collective over ``group``. ``blocks`` is the full model (every rank holds all of it before
    partitioning), already on ``device`` (default: the device of the first parameter).
    ``sample_input`` is one reference micro-batch (moved to
    ``device``; ``sample_batch``, read only by ``loss_fn``, is not moved). ``budget_s`` bounds the
    network measurement (:func:`measure_network`); ``rounds`` is :func:`measure_blocks`' (the
    median of that many measurements); the device kind comes from ``$DEEPCEE_DEVICE_KIND``
    (default: the torch device type).
    """
    device = _device_of(blocks, device)
    hosts, model_fp = _identities(blocks, group)
    timings = measure_blocks(
        blocks,
        sample_input.to(device),
        loss_fn=loss_fn,
        sample_batch=sample_batch,
        repeats=repeats,
        warmup=warmup,
        rounds=rounds,
    )
    _wait_for_slowest_rank(group, "blocks")
    local = {
        "kind": os.environ.get(DEVICE_KIND_ENV, "").strip() or device.type,
        "memory_bytes": available_memory_bytes(device),
        "timings": timings,
        "cpu_quota": _cpu_quota(device),
    }
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    network = measure_network(
        group=group,
        small_bytes=small_bytes,
        large_bytes=large_bytes,
        repeats=network_repeats,
        budget_s=budget_s,
        op_timeout_s=op_timeout_s,
        device=wire_device(device, group),
        hosts=hosts,
    )
    devices = [_device_profile(rank, hosts[rank], record) for rank, record in enumerate(gathered)]
    return ClusterProfile(
        devices=tuple(devices),
        latency_s=network.latency_s,
        bandwidth_bytes_per_s=network.bandwidth_bytes_per_s,
        num_blocks=len(blocks),
        model_fingerprint=model_fp,
        cluster_fingerprint=fingerprint_cluster(hosts),
    )


_WAITS = itertools.count()
"""Numbers the waits of this process; every rank makes the same ones, so they agree."""


def _wait_for_slowest_rank(group: dist.ProcessGroup | None, phase: str) -> None:
    """Wait, without the process group's timeout, until every rank has finished ``phase``.

    The block timings take as long as the slowest device needs: on the lab with a 10 ms CPU
    period the end devices' three rounds took over a minute, and the other ranks, waiting in the
    gather that follows, hit the 60 s timeout ``DeepCEEStrategy`` gives its process group (two
    of three runs failed so). So the ranks meet in the store
    first (:func:`~lightning_deepcee.runtime.liveness.wait_for_ranks`: as long as the slow rank's
    heartbeat advances). A sub-group, or a run without a store, keeps the gather's timeout.
    """
    store = default_store()
    world = dist.get_world_size()
    if store is None or world == 1 or dist.get_world_size(group) != world:
        return
    try:
        wait_for_ranks(store, dist.get_rank(), world, f"profile/{phase}/{next(_WAITS)}")
    except DeviceLostError as exc:
        raise ProfilingTimeoutError(f"profile_cluster: {exc}") from exc


def _cpu_quota(device: torch.device) -> tuple[float, float]:
    """``(cpu_share, cpu_period_s)`` of a CPU device under a CFS quota; ``(1.0, 0.0)`` if none.

    The share is of the speed the compute threads reach unthrottled: ``quota cores / threads``
    (a device computing on 2 threads under a 1-core quota sustains half its burst speed). A
    GPU's compute does not run on the quota's CPU time, so no quota is recorded for it.
    """
    if device.type != "cpu":
        return 1.0, 0.0
    quota = read_cpu_quota()
    if quota is None:
        return 1.0, 0.0
    share = quota.cores / max(1, torch.get_num_threads())
    if share >= 1.0:
        return 1.0, 0.0
    return share, quota.period_s


def _device_profile(rank: int, host: str, record: dict[str, Any]) -> DeviceProfile:
    timings: BlockTimings = record["timings"]
    cpu_share, cpu_period_s = record.get("cpu_quota", (1.0, 0.0))
    return DeviceProfile(
        rank=rank,
        host=host,
        kind=record["kind"],
        memory_bytes=record["memory_bytes"],
        forward_s=timings.forward_s,
        backward_input_s=timings.backward_input_s,
        backward_weight_s=timings.backward_weight_s,
        activation_bytes=timings.activation_bytes,
        parameter_bytes=timings.parameter_bytes,
        reference_microbatch_size=timings.microbatch_size,
        fixed_s=timings.fixed_s,
        optimizer_s_per_byte=timings.optimizer_s_per_byte,
        cpu_share=cpu_share,
        cpu_period_s=cpu_period_s,
        capability=capability_score(
            timings.forward_s, timings.backward_input_s, timings.backward_weight_s
        ),
    )


def profile_or_load(
    path: str | os.PathLike[str],
    blocks: Sequence[nn.Module],
    sample_input: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    **options: Any,
) -> ClusterProfile:
    """Reuse the profile cached at ``path`` when it matches this model and device set; else measure.

    Collective. Only rank 0 reads and writes the file (it may exist on rank 0's host only) and
    broadcasts what it read, so all ranks agree on whether to re-measure. A stale or unreadable
    cache gives :class:`~lightning_deepcee.profiler.ProfileCacheWarning` (on rank 0) and is
    replaced; the new file is written atomically (temporary file + rename), as JSON for a
    ``.json`` path and YAML otherwise. ``options`` are passed to :func:`profile_cluster`.
    """
    hosts, model_fp = _identities(blocks, group)
    message: list[Any] = [None]
    is_writer = dist.get_rank(group) == 0
    if is_writer:
        cached = load_cached_profile(
            path, model_fingerprint=model_fp, cluster_fingerprint=fingerprint_cluster(hosts)
        )
        message[0] = None if cached is None else cached.to_dict()
    source = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(message, src=source, group=group)
    if message[0] is not None:
        return ClusterProfile.from_dict(message[0])
    profile = profile_cluster(blocks, sample_input, group=group, **options)
    if is_writer:
        _write_atomically(profile, Path(path))
    return profile


def _write_atomically(profile: ClusterProfile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        if path.suffix.lower() == ".json":
            profile.to_json(temporary)
        else:
            profile.to_yaml(temporary)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
