"""Cost model: predicted step time, bubble ratio and memory of a plan on a measured cluster.

This module owns the arithmetic that turns a :class:`~lightning_deepcee.profiler.ClusterProfile`
and a list of :class:`~lightning_deepcee.planner.plan.StagePlan` into per-stage simulator costs
(:func:`stage_costs`) and a :class:`Prediction` (:func:`predict`). The model, stated once:

- **Compute is affine in the micro-batch size.** Device ``d`` spends, on block ``k``, a fixed
  ``fixed_s[d][k]`` per call (kernel launches, dispatch: what a small micro-batch cannot shrink)
  plus ``(block_s[d][k] - fixed_s[d][k]) / reference_microbatch_size`` per sample; the fixed part
  is split over F, B and W in proportion to their times. With ``fixed_s = 0`` (hand-written
  profiles) this is linear. The fixed part is what makes many tiny micro-batches slow: the planner
  sees it and picks fewer, larger ones (or no pipeline) where dispatch dominates.
- **Asymmetric data parallelism.** A stage shared by several devices takes, for each micro-batch,
  the maximum over its devices of ``fixed_d + share_d * microbatch_size * per_sample_s[d]``:
  devices run their rows in parallel and the stage is done when the slowest is. Shares
  proportional to speed (whole F+B+W time per sample at the measured size) make every device
  finish together (see :func:`speed_shares`). Rows are whole samples: the runtime rounds each
  micro-batch towards the shares of the whole step
  (:func:`~lightning_deepcee.planner.rows.split_step_rows`), so ``share_d * microbatch_size`` is
  each device's *mean* rows per micro-batch, exact over the step to within one row. A device
  whose mean is below one row holds a row in that fraction of the micro-batches and pays its
  fixed cost only then (``min(1, rows) * fixed_d``).
- **Runtime overhead.** Every executor action (a compute call, a send, a receive) costs the device
  one mean per-call fixed cost (its measured ``fixed_s`` over all blocks, per F, B or W call) on
  top of its compute: per micro-batch, F and B with their receive and send (none across the
  pipeline's ends) and W. Negligible on a fast device; on the lab's end devices (12% of a core) the
  executor's dispatch, the B/W split and the message handling took about 10 ms of burst CPU per
  micro-batch, 80 ms of wall time, which block compute alone does not show: plans with many
  micro-batch actions there ran 24-52% slower than predicted without this term; with it nine such
  runs re-predict within -15%..+4% (no fitted constant). The term is only as good as the measured
  ``fixed_s``, which a short CPU-quota period makes noisy. With ``fixed_s = 0`` (hand-written
  profiles) there is no overhead. A merged BW action is charged as B and W (one action more).
- **Activation transfers.** Between consecutive stages a micro-batch's boundary activation
  (``activation_bytes`` of the sending stage's last block, per sample, times the micro-batch size)
  moves once forward and its gradient once backward. Rows are laid out by shares on both sides, so
  sender ``i`` talks to receiver ``j`` only where their row intervals overlap; each such pair costs
  ``latency_ij + overlap_bytes / bandwidth_ij``. A device's messages are serialised (it sends or
  receives them one after another), and the hop takes the maximum over devices of that sum. With one
  device per stage this is exactly ``ClusterProfile.transfer_time_s``; with several it is
  conservative, since concurrent messages on distinct links are not overlapped. Messages between two
  *network groups* (:func:`~lightning_deepcee.profiler.group_by_network`) share the WAN link between
  them: their bytes together take at least ``bytes / capacity``, where the capacity is the median
  pair measured between the two groups (the profiler measures those pairs one at a time, so each is
  a reading of the whole WAN link; the fastest reading carries the shaper's burst: 3.2 MB/s on a 2.5
  MB/s link, and the lab's steps then took 25% longer per message than predicted). Two cloud devices
  sending halves of a micro-batch to two edge devices take as long as one device sending all of it.
- **Pipeline.** The schedule is generated, lowered with one simulated rank per stage, validated
  and simulated (:mod:`lightning_deepcee.schedule.simulate`); the simulator overlaps transfers
  with compute exactly as far as the schedule order allows.
- **CPU quotas.** A device whose profile records a quota (``cpu_share < 1`` with a
  ``cpu_period_s``: a container's CPU limit, which the profiler reads from the process's cgroup)
  is simulated as a token bucket: its measured times hold while it computes without pause, and
  what it leaves unused while it waits for a message lets its next actions run at full speed
  (see the simulator's docstring). A stage takes the quota of its slowest device. Without it,
  every wait is charged at the sustained speed and the lab's ZB-H1 plans with four micro-batches
  were predicted 16-20% slow.
- **Host CPU under a quota.** A quota-limited device also spends CPU outside its blocks: the
  Lightning loop, hooks and logging, and the handling of every byte it sends or receives
  (activations, their gradients, the stage's all-reduce). At its quota that CPU costs
  ``cpu / cpu_share`` of wall time, and the device cannot finish a step sooner than its compute
  (at sustained speed), its optimizer step and that host time together: the step is at least the
  slowest such device's sum (``Prediction.cpu_floor_s``). The host CPU is
  ``CostModelConfig.host_cpu_s_per_step + host_cpu_s_per_byte * bytes``, constants fitted to
  the lab's runs (18 ms and 0.7 ms per MB at full speed), not measured per device. Without it a
  6-stage plan with an end device (12% of a core) to itself was predicted 797 ms and ran 1000:
  that device spent 120 ms of CPU a step, 28 ms of it outside its blocks, and 120 ms at 12% of
  a core is the whole step. Devices without a quota are not charged (a host that is not held
  back does that work in its waits).
- **All-reduce.** After its last W, each stage's group all-reduces its gradients with a ring:
  ``2 (n-1)/n * parameter_bytes / min_bandwidth + 2 (n-1) * max_latency`` over the group's pairs.
  The slowest stage's all-reduce is added to the step.
- **Optimizer.** Each device's measured seconds per parameter byte of an Adam step
  (``DeviceProfile.optimizer_s_per_byte``; ``CostModelConfig.optimizer_s_per_byte`` where not
  measured) times its stage's parameter bytes; the slowest device's is added. Every device of
  a stage updates the whole stage. On the lab the constant 1e-10 s/B charged 1 ms where the
  cloud and edge devices took 5-10 ms.
- **Memory.** ``parameter_bytes * state_copies`` (weights, gradients, two Adam moments) plus the
  simulator's peak of in-flight activations, scaled by the device's share.

``step_time_s = simulated pipeline + slowest stage all-reduce + optimizer``, or the CPU floor
when that is longer. See
``docs/planner.md`` for the correspondence with DeepCEE's Eq. 1.

Pure: numpy and the standard library (no torch, no lightning).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_deepcee.planner.plan import Plan, StagePlan
from lightning_deepcee.profiler.data import ClusterProfile
from lightning_deepcee.profiler.grouping import group_by_network
from lightning_deepcee.schedule.actions import ActionKind
from lightning_deepcee.schedule.generators import SCHEDULE_KINDS, StageSchedule, generate
from lightning_deepcee.schedule.lowering import RankSchedule, lower
from lightning_deepcee.schedule.simulate import StageCosts, simulate
from lightning_deepcee.schedule.validate import validate

__all__ = [
    "CostModelConfig",
    "Prediction",
    "allreduce_time_s",
    "in_flight_microbatches",
    "predict",
    "predict_plan",
    "speed_shares",
    "stage_costs",
    "transfer_time_s",
]

Array = npt.NDArray[np.float64]


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModelConfig:
    """Constants of the cost model that the profile does not measure."""

    optimizer_s_per_byte: float = 1e-10
    """Optimizer seconds per byte of a stage's parameters on a device whose profile did not
    measure it (``DeviceProfile.optimizer_s_per_byte == 0``). Adam reads and writes about four
    tensors per parameter; 1e-10 s/B is ~40 GB/s of effective memory traffic."""
    state_copies: int = 4
    """Bytes held per parameter byte: the weights, their gradient and Adam's two moments."""
    host_cpu_s_per_step: float = 0.018
    """CPU seconds (at full speed) a device spends per step outside its blocks' compute and its
    optimizer: Lightning's loop, hooks and logging, the executor's bookkeeping. Only charged to
    devices under a CPU quota (see the module docstring's *Host CPU under a quota*); 18 ms is the
    fit over the lab's 15 planned runs of 2026-12-01 (residual 6 ms), not a per-device
    measurement."""
    host_cpu_s_per_byte: float = 0.7e-9
    """CPU seconds per byte a device sends or receives (activations, their gradients and the
    stage's gradient all-reduce), charged like ``host_cpu_s_per_step``; 0.7 ms per MB is the
    same fit (gloo over TCP)."""

    def __post_init__(self) -> None:
        for name in ("optimizer_s_per_byte", "host_cpu_s_per_step", "host_cpu_s_per_byte"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value >= 0)
            ):
                raise ValueError(f"{name}: expected a non-negative finite number, got {value!r}")
        if (
            isinstance(self.state_copies, bool)
            or not isinstance(self.state_copies, int)
            or (self.state_copies < 1)
        ):
            raise ValueError(
                f"state_copies: expected a positive integer (4 for Adam), got {self.state_copies!r}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    """What the cost model expects one optimizer step of a plan to cost."""

    step_time_s: float
    """``pipeline_s + allreduce_s + optimizer_s``, or ``cpu_floor_s`` when that is longer."""
    bubble_ratio: float
    """Idle share of stage-time in the simulated pipeline."""
    peak_memory_bytes: dict[int, int]
    """Peak bytes per rank: parameter state plus in-flight activations (scaled by share)."""
    pipeline_s: float
    """Simulated time of the forward/backward pipeline (compute and non-hidden transfers)."""
    compute_s: float
    """Compute seconds of the busiest stage (DeepCEE's ``B * t_c``)."""
    transfer_s: float
    """Activation/gradient transfer time the schedule fails to hide behind compute (``t_l``):
    the simulated pipeline minus the same pipeline with free transfers."""
    allreduce_s: float
    """Gradient all-reduce of the slowest stage group (DeepCEE's ``AL``)."""
    optimizer_s: float
    """Optimizer step of the largest stage."""
    over_memory_ranks: tuple[int, ...]
    """Ranks whose predicted peak exceeds their ``memory_bytes``; empty when the plan fits."""
    cpu_floor_s: float = 0.0
    """The longest step a CPU quota allows (module docstring, *Host CPU under a quota*): the
    slowest quota-limited device's compute, optimizer and host CPU at its quota; 0 without
    quotas. ``step_time_s`` is at least this."""

    @property
    def fits_memory(self) -> bool:
        """True when every rank's predicted peak fits its memory."""
        return not self.over_memory_ranks

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (rank keys as strings)."""
        return {
            "step_time_s": self.step_time_s,
            "bubble_ratio": self.bubble_ratio,
            "peak_memory_bytes": {str(r): v for r, v in sorted(self.peak_memory_bytes.items())},
            "pipeline_s": self.pipeline_s,
            "compute_s": self.compute_s,
            "transfer_s": self.transfer_s,
            "allreduce_s": self.allreduce_s,
            "optimizer_s": self.optimizer_s,
            "over_memory_ranks": list(self.over_memory_ranks),
            "cpu_floor_s": self.cpu_floor_s,
        }


# --------------------------------------------------------------------------------------------
# Cached array view of a profile (a 1024-device profile is a million-entry tuple of tuples)
# --------------------------------------------------------------------------------------------


class _Arrays:
    """Numpy views of one profile: matrices, per-sample prefix sums, per-block bytes."""

    def __init__(self, profile: ClusterProfile) -> None:
        self.profile = profile
        self.latency = profile.latency_matrix()
        self.bandwidth = profile.bandwidth_matrix()
        ref = np.array([d.reference_microbatch_size for d in profile.devices], dtype=np.float64)

        total = np.array([d.block_seconds for d in profile.devices], dtype=np.float64)
        fixed = np.array([d.fixed_s for d in profile.devices], dtype=np.float64)
        fixed_share = np.divide(fixed, total, out=np.zeros_like(total), where=total > 0)
        fixed_share = np.clip(fixed_share, 0.0, 1.0)

        def prefix(values: Array) -> Array:
            zero = np.zeros((len(ref), 1))
            return np.concatenate([zero, np.cumsum(values, axis=1)], axis=1)

        def split(name: str) -> tuple[Array, Array]:
            seconds = np.array([getattr(d, name) for d in profile.devices], dtype=np.float64)
            per_sample = seconds * (1.0 - fixed_share) / ref[:, None]
            return prefix(per_sample), prefix(seconds * fixed_share)

        self.forward, self.forward_fixed = split("forward_s")
        self.backward_input, self.backward_input_fixed = split("backward_input_s")
        self.backward_weight, self.backward_weight_fixed = split("backward_weight_s")
        num_calls = 3 * max(fixed.shape[1], 1)
        self.action_overhead = fixed.sum(axis=1) / num_calls
        """Seconds each executor action costs a device beyond its compute: the device's mean
        per-call fixed cost (its ``fixed_s`` over all blocks, per F, B or W call). See the module
        docstring's *Runtime overhead*."""
        self.total = prefix(total / ref[:, None])
        """Prefix sums of F+B+W per sample *at the reference size* (fixed part included): the
        speed that batch shares and the compute-balanced partition use. The affine split of one
        profile into slope and intercept is noisy (two short measurements); the whole time at the
        measured size is not."""
        act = np.array([d.activation_bytes for d in profile.devices], dtype=np.float64).max(axis=0)
        params = np.array([d.parameter_bytes for d in profile.devices], dtype=np.float64).max(0)
        self.activation = act
        self.activation_prefix = np.concatenate([[0.0], np.cumsum(act)])
        self.parameter_prefix = np.concatenate([[0.0], np.cumsum(params)])
        self.memory = np.array([d.memory_bytes for d in profile.devices], dtype=np.float64)
        self.optimizer_rate = np.array(
            [d.optimizer_s_per_byte for d in profile.devices], dtype=np.float64
        )
        """Measured optimizer seconds per parameter byte of each device; 0 = not measured."""
        self.cpu_share = np.array([d.cpu_share for d in profile.devices], dtype=np.float64)
        self.cpu_period = np.array([d.cpu_period_s for d in profile.devices], dtype=np.float64)
        self.has_quota = any(d.has_cpu_quota for d in profile.devices)
        """Whether any device runs under a CPU quota (the simulator then models it)."""
        self.group_links: dict[tuple[int, ...], tuple[float, float]] = {}
        """Slowest bandwidth and largest latency inside a group, by its ranks."""
        groups = group_by_network(self.bandwidth)
        self.network_group = np.zeros(len(ref), dtype=np.intp)
        """First-level network group of each rank (:func:`group_by_network`, default config)."""
        for index, members in enumerate(groups):
            self.network_group[list(members)] = index
        count = len(groups)
        self.group_capacity = np.full((count, count), np.inf)
        """Bytes/s that all traffic from group ``a`` to group ``b`` shares (``a != b``): the
        median pair between them, a reading of the WAN link every such pair crosses."""
        for a, b in itertools.permutations(range(count), 2):
            pairs = self.bandwidth[np.ix_(self.network_group == a, self.network_group == b)]
            pairs = pairs[np.isfinite(pairs)]
            if pairs.size:
                self.group_capacity[a, b] = float(np.median(pairs))

    def parameter_bytes(self, block_range: tuple[int, int]) -> float:
        return float(self.parameter_prefix[block_range[1]] - self.parameter_prefix[block_range[0]])

    def activation_bytes(self, block_range: tuple[int, int]) -> float:
        """Saved activations per sample of a stage: the outputs of all its blocks."""
        start, end = block_range
        return float(self.activation_prefix[end] - self.activation_prefix[start])


_CACHE: list[_Arrays] = []
_CACHE_SIZE = 4


def _arrays(profile: ClusterProfile) -> _Arrays:
    for entry in _CACHE:
        if entry.profile is profile:
            return entry
    entry = _Arrays(profile)
    _CACHE.insert(0, entry)
    del _CACHE[_CACHE_SIZE:]
    return entry


def _check_stages(profile: ClusterProfile, stages: Sequence[StagePlan]) -> None:
    if not stages:
        raise ValueError("stages: expected at least one StagePlan, got none")
    end = stages[-1].block_range[1]
    if end != profile.num_blocks:
        raise ValueError(
            f"stages: the last stage ends at block {end} but the profile has "
            f"{profile.num_blocks} blocks; the stages must cover every block"
        )
    num_devices = profile.num_devices
    for index, stage in enumerate(stages):
        if max(stage.ranks) >= num_devices:
            raise ValueError(
                f"stages[{index}].ranks: rank {max(stage.ranks)} is not in the profile's "
                f"{num_devices} devices (0..{num_devices - 1})"
            )


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


def _row_overlaps(
    left_shares: Sequence[float] | Array, right_shares: Sequence[float] | Array
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp], Array]:
    """``(i, j, fraction)`` arrays for each pair whose row intervals (laid out by shares) overlap.

    Both sides lay their rows out in order on ``[0, 1)``; every segment between two consecutive
    breakpoints of either side belongs to exactly one sender and one receiver.
    """
    left = np.cumsum(left_shares)
    right = np.cumsum(right_shares)
    left[-1] = right[-1] = 1.0
    points = np.unique(np.concatenate([[0.0], left, right]))
    fraction = np.diff(points)
    keep = fraction > 1e-12
    middle = (points[:-1] + points[1:])[keep] / 2
    i = np.minimum(np.searchsorted(left, middle, side="right"), len(left) - 1)
    j = np.minimum(np.searchsorted(right, middle, side="right"), len(right) - 1)
    return i, j, fraction[keep]


def transfer_time_s(
    profile: ClusterProfile, sender: StagePlan, receiver: StagePlan, num_bytes: float
) -> float:
    """Seconds to move ``num_bytes`` (one whole micro-batch's tensor) from one stage to another.

    Rows are split by shares on both sides; each overlapping (sender, receiver) pair costs
    ``latency + overlap_bytes / bandwidth`` on its directed link; a device's messages are
    serialised; the result is the maximum over devices of that sum (see the module docstring).
    """
    arrays = _arrays(profile)
    return _transfer(
        arrays, sender.ranks, sender.batch_shares, receiver.ranks, receiver.batch_shares, num_bytes
    )


def _transfer(
    arrays: _Arrays,
    ranks: Sequence[int],
    shares: Sequence[float] | Array,
    receiver_ranks: Sequence[int],
    receiver_shares: Sequence[float] | Array,
    num_bytes: float,
) -> float:
    i, j, fraction = _row_overlaps(shares, receiver_shares)
    src = np.asarray(ranks)[i]
    dst = np.asarray(receiver_ranks)[j]
    seconds = arrays.latency[src, dst] + fraction * num_bytes / arrays.bandwidth[src, dst]
    per_sender = np.bincount(i, weights=seconds, minlength=len(ranks))
    per_receiver = np.bincount(j, weights=seconds, minlength=len(receiver_ranks))
    slowest = float(max(per_sender.max(), per_receiver.max()))
    group_src, group_dst = arrays.network_group[src], arrays.network_group[dst]
    cross = group_src != group_dst
    if cross.sum() > 1:
        # Concurrent messages between the same two network groups share one WAN link.
        count = len(arrays.group_capacity)
        key = group_src[cross] * count + group_dst[cross]
        shared = np.bincount(key, weights=fraction[cross] * num_bytes, minlength=count * count)
        shared_s = shared / arrays.group_capacity.ravel()
        slowest = max(slowest, float(shared_s.max() + arrays.latency[src, dst][cross].max()))
    return slowest


def allreduce_time_s(profile: ClusterProfile, ranks: Sequence[int], num_bytes: float) -> float:
    """Ring all-reduce of ``num_bytes`` among ``ranks``; 0 for a single rank.

    ``2 (n-1)/n * num_bytes / min_bandwidth + 2 (n-1) * max_latency``, with the minimum
    bandwidth and maximum latency over every ordered pair of the group (the ring order is not
    known to the planner, so the slowest pair bounds every hop).
    """
    return _allreduce(_arrays(profile), ranks, num_bytes)


def _allreduce(arrays: _Arrays, ranks: Sequence[int], num_bytes: float) -> float:
    n = len(ranks)
    if n < 2:
        return 0.0
    key = tuple(ranks)
    if key not in arrays.group_links:
        index = np.asarray(ranks)
        off_diagonal = ~np.eye(n, dtype=bool)
        bandwidth = float(arrays.bandwidth[np.ix_(index, index)][off_diagonal].min())
        latency = float(arrays.latency[np.ix_(index, index)][off_diagonal].max())
        arrays.group_links[key] = (bandwidth, latency)
    bandwidth, latency = arrays.group_links[key]
    return 2.0 * (n - 1) / n * num_bytes / bandwidth + 2.0 * (n - 1) * latency


_IN_FLIGHT_CACHE: dict[tuple[str, int, int], tuple[int, ...]] = {}


def in_flight_microbatches(
    schedule: str, num_stages: int, num_microbatches: int
) -> tuple[int, ...]:
    """Peak number of micro-batches whose activations each stage holds (F until W or BW)."""
    key = (schedule, num_stages, num_microbatches)
    if key not in _IN_FLIGHT_CACHE:
        stage_schedule = generate(schedule, num_stages, num_microbatches)
        _IN_FLIGHT_CACHE[key] = tuple(_peak_held(stage_schedule, s) for s in range(num_stages))
    return _IN_FLIGHT_CACHE[key]


def _peak_held(stage_schedule: StageSchedule, stage: int) -> int:
    held = peak = 0
    for action in stage_schedule[stage]:
        if action.kind == ActionKind.F:
            held += 1
            peak = max(peak, held)
        elif action.kind in (ActionKind.W, ActionKind.BW):
            held -= 1
    return peak


def speed_shares(
    profile: ClusterProfile,
    ranks: Sequence[int],
    block_range: tuple[int, int],
    *,
    microbatch_size: float,
    in_flight: int,
    config: CostModelConfig | None = None,
    bounded_by_memory: bool = True,
) -> tuple[float, ...] | None:
    """Batch shares proportional to each device's speed on ``block_range``, bounded by memory.

    Device ``d``'s share is capped at what its memory holds after the stage's parameter state:
    ``(memory_bytes - state_copies * parameter_bytes) / (in_flight * microbatch_size *
    activation_bytes_per_sample)``; the rest of the batch is redistributed in proportion to the
    speed of the uncapped devices (water filling). ``None`` when the devices cannot hold the stage
    at all. ``bounded_by_memory=False`` gives the plain speed-proportional shares.
    """
    return _shares(
        _arrays(profile), ranks, block_range, microbatch_size, in_flight, config, bounded_by_memory
    )


def _shares(
    arrays: _Arrays,
    ranks: Sequence[int],
    block_range: tuple[int, int],
    microbatch_size: float,
    in_flight: int,
    config: CostModelConfig | None,
    bounded_by_memory: bool = True,
) -> tuple[float, ...] | None:
    config = config or CostModelConfig()
    start, end = block_range
    index = np.asarray(ranks)
    per_sample = arrays.total[index, end] - arrays.total[index, start]
    speed = 1.0 / np.maximum(per_sample, 1e-300)
    if not bounded_by_memory:
        return tuple(float(s) for s in speed / speed.sum())
    free = arrays.memory[index] - config.state_copies * arrays.parameter_bytes(block_range)
    if (free < 0).any():
        return None
    per_share = in_flight * microbatch_size * arrays.activation_bytes(block_range)
    caps = free / per_share if per_share > 0 else np.full(len(ranks), np.inf)
    shares = np.zeros(len(ranks))
    open_ = np.ones(len(ranks), dtype=bool)
    remaining = 1.0
    while open_.any():
        trial = remaining * speed * open_ / speed[open_].sum()
        over = open_ & (trial > caps)
        if not over.any():
            shares[open_] = trial[open_]
            remaining = 0.0
            break
        shares[over] = caps[over]
        remaining -= float(caps[over].sum())
        open_ &= ~over
        if remaining <= 0:
            break
    if remaining > 1e-9 or (shares <= 0).any():
        return None
    shares = shares / shares.sum()
    return tuple(float(s) for s in shares)


# --------------------------------------------------------------------------------------------
# Stage costs and prediction
# --------------------------------------------------------------------------------------------


def stage_costs(
    profile: ClusterProfile, stages: Sequence[StagePlan], *, microbatch_size: float
) -> StageCosts:
    """Simulator costs of one micro-batch of ``microbatch_size`` samples on each stage.

    ``activation_bytes`` is a whole micro-batch's saved activations on the stage (each device
    holds its share of it); ``static_memory_bytes`` is left unset (added per device by
    :func:`predict`).
    """
    _check_stages(profile, stages)
    return _stage_costs(_arrays(profile), stages, microbatch_size)


def _stage_costs(arrays: _Arrays, stages: Sequence[StagePlan], b: float) -> StageCosts:
    forward: list[float] = []
    backward_input: list[float] = []
    backward_weight: list[float] = []
    activation: list[float] = []
    share: list[float] = []
    period: list[float] = []
    last = len(stages) - 1
    for s, stage in enumerate(stages):
        index = np.asarray(stage.ranks)
        rows = np.asarray(stage.batch_shares) * b  # mean rows per micro-batch (split_step_rows)
        active = np.minimum(rows, 1.0)  # below one row: a row in that fraction of micro-batches
        start, end = stage.block_range
        # Executor actions per micro-batch: F with its receive and send, B with its receive and
        # send (none across the pipeline's ends), W.
        moves = int(s > 0) + int(s < last)
        overhead = arrays.action_overhead[index]
        stage_total = np.zeros(len(index))
        for out, slope, fixed, actions in (
            (forward, arrays.forward, arrays.forward_fixed, 1 + moves),
            (backward_input, arrays.backward_input, arrays.backward_input_fixed, 1 + moves),
            (backward_weight, arrays.backward_weight, arrays.backward_weight_fixed, 1),
        ):
            seconds = active * (fixed[index, end] - fixed[index, start] + actions * overhead)
            seconds = seconds + rows * (slope[index, end] - slope[index, start])
            out.append(float(seconds.max()))
            stage_total += seconds
        # The stage keeps the pace of its slowest device, so that device's quota applies.
        slowest = int(index[int(np.argmax(stage_total))])
        share.append(float(arrays.cpu_share[slowest]))
        period.append(float(arrays.cpu_period[slowest]))
        activation.append(arrays.activation_bytes(stage.block_range) * b)
    send_forward, send_backward = [], []
    for sender, receiver in itertools.pairwise(stages):
        num_bytes = float(arrays.activation[sender.block_range[1] - 1]) * b
        send_forward.append(
            _transfer(
                arrays,
                sender.ranks,
                sender.batch_shares,
                receiver.ranks,
                receiver.batch_shares,
                num_bytes,
            )
        )
        send_backward.append(
            _transfer(
                arrays,
                receiver.ranks,
                receiver.batch_shares,
                sender.ranks,
                sender.batch_shares,
                num_bytes,
            )
        )
    return StageCosts(
        forward_s=tuple(forward),
        backward_input_s=tuple(backward_input),
        backward_weight_s=tuple(backward_weight),
        activation_bytes=tuple(activation),
        send_forward_s=tuple(send_forward),
        send_backward_s=tuple(send_backward),
        cpu_share=tuple(share) if arrays.has_quota else None,
        cpu_period_s=tuple(period) if arrays.has_quota else None,
    )


_LOWERED: dict[tuple[str, int, int], RankSchedule] = {}


def _lowered(schedule: str, p: int, m: int) -> RankSchedule:
    """Generated, lowered (one simulated rank per stage) and validated; cached (pure data)."""
    key = (schedule, p, m)
    if key not in _LOWERED:
        placement = {s: s for s in range(p)}
        ranked = lower(generate(schedule, p, m), placement)
        validate(ranked, placement, m)
        if len(_LOWERED) > 256:
            _LOWERED.clear()
        _LOWERED[key] = ranked
    return _LOWERED[key]


def _simulate(
    costs: StageCosts, schedule: str, m: int, stage_schedule: StageSchedule | None = None
) -> tuple[float, float, dict[int, int]]:
    p = costs.num_stages
    placement = {s: s for s in range(p)}
    if stage_schedule is None:
        ranked = _lowered(schedule, p, m)
    else:  # a cost-fitted schedule (compact): not cached
        ranked = lower(stage_schedule, placement)
        validate(ranked, placement, m)
    result = simulate(ranked, placement, costs, num_microbatches=m)
    return result.step_time_s, result.bubble_ratio, result.peak_memory_bytes


def predict(
    profile: ClusterProfile,
    stages: Sequence[StagePlan],
    schedule: str,
    num_microbatches: int,
    global_batch_size: int,
    *,
    config: CostModelConfig | None = None,
    stage_schedule: StageSchedule | None = None,
) -> Prediction:
    """Predict one optimizer step of ``stages`` under ``schedule`` (see the module docstring).

    The micro-batch size is ``global_batch_size / num_microbatches`` samples (the mean, when
    the division is not exact). ``schedule="compact"`` needs its actions in ``stage_schedule``
    (:meth:`Plan.stage_schedule <lightning_deepcee.planner.Plan.stage_schedule>`); the other
    kinds are generated.
    """
    return _predict(
        profile,
        stages,
        schedule,
        num_microbatches,
        global_batch_size,
        config,
        breakdown=True,
        stage_schedule=stage_schedule,
    )


def predict_plan(
    profile: ClusterProfile, plan: Plan, *, config: CostModelConfig | None = None
) -> Prediction:
    """:func:`predict` of a saved or running ``plan`` (a compact plan with its own actions) on
    ``profile``: the same figure the search gave it when ``profile`` is the one it was made on."""
    return predict(
        profile,
        plan.stages,
        plan.schedule,
        plan.num_microbatches,
        plan.global_batch_size,
        config=config,
        stage_schedule=plan.stage_schedule() if plan.schedule == "compact" else None,
    )


def _predict(
    profile: ClusterProfile,
    stages: Sequence[StagePlan],
    schedule: str,
    m: int,
    global_batch_size: int,
    config: CostModelConfig | None,
    *,
    breakdown: bool,
    stage_schedule: StageSchedule | None = None,
) -> Prediction:
    config = config or CostModelConfig()
    if schedule == "compact":
        if stage_schedule is None:
            raise ValueError(
                "schedule 'compact' is fitted to costs: pass its actions as stage_schedule "
                "(plan_search makes them; Plan.stage_schedule() returns a plan's)"
            )
    elif schedule not in SCHEDULE_KINDS:
        raise ValueError(
            f"schedule: expected one of {', '.join((*SCHEDULE_KINDS, 'compact'))}, got {schedule!r}"
        )
    else:
        stage_schedule = None  # generated kinds: the cached generator
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"num_microbatches: expected a positive integer, got {m!r}")
    if global_batch_size < m:
        raise ValueError(
            f"global_batch_size: {global_batch_size} samples cannot fill {m} micro-batches; "
            f"use at most {global_batch_size} micro-batches"
        )
    _check_stages(profile, stages)
    arrays = _arrays(profile)
    b = global_batch_size / m
    costs = _stage_costs(arrays, stages, b)
    pipeline_s, bubble, activation_peak = _simulate(costs, schedule, m, stage_schedule)
    compute_s = m * max(
        f + bi + w
        for f, bi, w in zip(
            costs.forward_s, costs.backward_input_s, costs.backward_weight_s, strict=True
        )
    )
    transfer_s = 0.0
    if breakdown and len(stages) > 1:
        free = dataclasses.replace(
            costs,
            send_forward_s=(0.0,) * (len(stages) - 1),
            send_backward_s=(0.0,) * (len(stages) - 1),
        )
        transfer_s = max(0.0, pipeline_s - _simulate(free, schedule, m, stage_schedule)[0])
    allreduce_s = optimizer_s = cpu_floor_s = 0.0
    memory: dict[int, int] = {}
    over: list[int] = []
    for s, stage in enumerate(stages):
        params = arrays.parameter_bytes(stage.block_range)
        allreduce_s = max(allreduce_s, _allreduce(arrays, stage.ranks, params))
        index = np.asarray(stage.ranks)
        measured = arrays.optimizer_rate[index]
        rates = np.where(measured > 0, measured, config.optimizer_s_per_byte)
        optimizer_s = max(optimizer_s, float(rates.max()) * params)
        if arrays.has_quota:
            busy_s = m * (
                costs.forward_s[s] + costs.backward_input_s[s] + costs.backward_weight_s[s]
            )
            cpu_floor_s = max(
                cpu_floor_s,
                _cpu_floor(arrays, stages, s, busy_s, rates * params, m * b, config),
            )
        peaks = np.round(
            config.state_copies * params + activation_peak[s] * np.asarray(stage.batch_shares)
        )
        memory.update(zip(stage.ranks, peaks.astype(np.int64).tolist(), strict=True))
        over.extend(index[peaks > arrays.memory[index]].tolist())
    return Prediction(
        step_time_s=max(pipeline_s + allreduce_s + optimizer_s, cpu_floor_s),
        bubble_ratio=bubble,
        peak_memory_bytes=dict(sorted(memory.items())),
        pipeline_s=pipeline_s,
        compute_s=compute_s,
        transfer_s=transfer_s,
        allreduce_s=allreduce_s,
        optimizer_s=optimizer_s,
        over_memory_ranks=tuple(sorted(over)),
        cpu_floor_s=cpu_floor_s,
    )


def _cpu_floor(
    arrays: _Arrays,
    stages: Sequence[StagePlan],
    s: int,
    busy_s: float,
    optimizer_s: npt.NDArray[np.float64],
    samples: float,
    config: CostModelConfig,
) -> float:
    """Longest time stage ``s``'s quota-limited devices need for a step: their compute
    (``busy_s``, at sustained speed) and optimizer step, plus the host CPU of the step and of
    every byte they send or receive, at their quota (``cpu_share``). 0 when none has a quota."""
    stage = stages[s]
    start, end = stage.block_range
    boundary = 0.0  # bytes per sample crossing the stage's edges, each once forward, once back
    if s > 0:
        boundary += 2.0 * float(arrays.activation[start - 1])
    if s < len(stages) - 1:
        boundary += 2.0 * float(arrays.activation[end - 1])
    n = len(stage.ranks)
    ring = 4.0 * (n - 1) / n * arrays.parameter_bytes(stage.block_range)  # sent and received
    floor = 0.0
    for rank, share, optimizer in zip(stage.ranks, stage.batch_shares, optimizer_s, strict=True):
        device = arrays.profile.devices[rank]
        if not device.has_cpu_quota:
            continue
        moved = boundary * samples * share + ring
        host = config.host_cpu_s_per_step + config.host_cpu_s_per_byte * moved
        floor = max(floor, busy_s + float(optimizer) + host / device.cpu_share)
    return floor
