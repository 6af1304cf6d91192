"""Evaluator: the cost model of one cluster profile, with its arrays and memos.

An :class:`Evaluator` is built from a :class:`~lightning_deepcee.profiler.ClusterProfile` and a
:class:`~lightning_deepcee.planner.prediction.CostModelConfig` and answers every question the
search asks of the cost model: batch shares, per-stage simulator costs, transfer and all-reduce
times, and the :class:`~lightning_deepcee.planner.prediction.Prediction` of a candidate. It owns
the profile's numpy views (:class:`~lightning_deepcee.planner.profile_arrays.ProfileArrays`)
and the memos that repeat within a search (a group's slowest link, generated and lowered
schedules, in-flight counts). Both live as long as the evaluator, so two profiles never share a
cache and a finished search frees its own. The model itself (what is charged, and why) is
described in :mod:`lightning_deepcee.planner.cost_model`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_deepcee.planner.compression import METHODS
from lightning_deepcee.planner.hops import HopCodecs
from lightning_deepcee.planner.plan import Plan, StagePlan
from lightning_deepcee.planner.prediction import CostModelConfig, Prediction
from lightning_deepcee.planner.profile_arrays import ProfileArrays
from lightning_deepcee.profiler.data import ClusterProfile
from lightning_deepcee.schedule.actions import ActionKind
from lightning_deepcee.schedule.compiled import (
    CompiledSchedule,
    compile_schedule,
    compile_stage_schedule,
)
from lightning_deepcee.schedule.generators import (
    MERGED_BACKWARD_KINDS,
    SCHEDULE_KINDS,
    StageSchedule,
    generate,
)
from lightning_deepcee.schedule.lowering import RankSchedule, lower
from lightning_deepcee.schedule.simulate import StageCosts, simulate, simulate_stages
from lightning_deepcee.schedule.validate import validate

__all__ = ["Evaluator", "in_flight_microbatches"]

Array = npt.NDArray[np.float64]

_ROW_SLACK = 1e-9
"""Rounding slack when shares times rows are whole numbers up to float error."""

_LOWERED_CACHE_SIZE = 256
"""Lowered schedules an evaluator keeps; beyond, the memo is cleared (they are cheap to redo)."""
_STAGE_CACHE_SIZE = 100_000
"""Stage costs and transfers an evaluator keeps; beyond, the memo is cleared."""


def in_flight_microbatches(
    schedule: str, num_stages: int, num_microbatches: int
) -> tuple[int, ...]:
    """Peak number of micro-batches whose activations each stage holds (F until W or BW)."""
    stage_schedule = generate(schedule, num_stages, num_microbatches)
    return tuple(_peak_held(stage_schedule, s) for s in range(num_stages))


def _peak_held(stage_schedule: StageSchedule, stage: int) -> int:
    held = peak = 0
    for action in stage_schedule[stage]:
        if action.kind == ActionKind.F:
            held += 1
            peak = max(peak, held)
        elif action.kind in (ActionKind.W, ActionKind.BW):
            held -= 1
    return peak


def _peak_rows(shares: Sequence[float], microbatch_size: float) -> Array:
    """Whole rows each device holds of the largest micro-batch: what its memory must fit.

    The runtime gives a device the floor or the ceiling of its share of each micro-batch's rows
    (:func:`~lightning_deepcee.runtime.rows.split_step_rows`), and a micro-batch has at most
    ``ceil(microbatch_size)`` rows. Compute is charged by the mean rows; memory by the most.
    """
    largest = max(1, math.ceil(microbatch_size - _ROW_SLACK))
    return np.ceil(np.asarray(shares, dtype=np.float64) * largest - _ROW_SLACK)


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


_EVALUATOR_MEMOS = frozenset(
    {"_group_links", "_lowered", "_fitted", "_in_flight", "_transfers", "_stages", "_shares"}
)


class Evaluator:
    """The cost model bound to one profile and one set of constants.

    ``arrays`` holds the profile's numpy views (:class:`ProfileArrays`), which the search reads
    too; the memos (a group's slowest link, lowered schedules, in-flight counts) are private
    and live as long as the evaluator.
    """

    def __init__(self, profile: ClusterProfile, config: CostModelConfig | None = None) -> None:
        self.profile = profile
        self.config = config or CostModelConfig()
        self.arrays = ProfileArrays(profile)
        self._group_links: dict[tuple[int, ...], tuple[float, float]] = {}
        self._lowered: dict[tuple[str, int, int], tuple[RankSchedule, CompiledSchedule]] = {}
        self._fitted: dict[int, tuple[StageSchedule, CompiledSchedule | None]] = {}
        """The last cost-fitted schedule checked and compiled, by ``id`` (the entry holds it)."""
        self._in_flight: dict[tuple[str, int, int], tuple[int, ...]] = {}
        self._transfers: dict[tuple[Any, ...], float] = {}
        self._stages: dict[tuple[Any, ...], tuple[float, ...]] = {}
        self._shares: dict[tuple[Any, ...], tuple[float, ...] | None] = {}
        self.hops = HopCodecs(self.arrays, self.config, self.transfer_time_s)
        """Each hop's compression: its bytes, its codec's time, the choice (``choose_hops``)."""

    def __getstate__(self) -> dict[str, Any]:
        """The evaluator without its memos (a spread search hands it to other processes)."""
        return {k: {} if k in _EVALUATOR_MEMOS else v for k, v in self.__dict__.items()}

    def check_stages(self, stages: Sequence[StagePlan]) -> None:
        """Raise ``ValueError`` unless ``stages`` cover the profile's blocks with its ranks."""
        if not stages:
            raise ValueError("stages: expected at least one StagePlan, got none")
        end = stages[-1].block_range[1]
        if end != self.profile.num_blocks:
            raise ValueError(
                f"stages: the last stage ends at block {end} but the profile has "
                f"{self.profile.num_blocks} blocks; the stages must cover every block"
            )
        num_devices = self.profile.num_devices
        for index, stage in enumerate(stages):
            if max(stage.ranks) >= num_devices:
                raise ValueError(
                    f"stages[{index}].ranks: rank {max(stage.ranks)} is not in the profile's "
                    f"{num_devices} devices (0..{num_devices - 1})"
                )

    # ----------------------------------------------------------------------------------------
    # Building blocks
    # ----------------------------------------------------------------------------------------

    def in_flight_microbatches(
        self, schedule: str, num_stages: int, num_microbatches: int
    ) -> tuple[int, ...]:
        """:func:`in_flight_microbatches`, memoised."""
        key = (schedule, num_stages, num_microbatches)
        if key not in self._in_flight:
            self._in_flight[key] = in_flight_microbatches(*key)
        return self._in_flight[key]

    def speed_shares(
        self,
        ranks: Sequence[int],
        block_range: tuple[int, int],
        *,
        microbatch_size: float,
        in_flight: int,
        bounded_by_memory: bool = True,
    ) -> tuple[float, ...] | None:
        """Batch shares proportional to each device's speed on ``block_range``, bounded by memory.

        Device ``d``'s share is capped at the whole rows its memory holds after the stage's
        parameter state, ``floor((memory_bytes - state_copies * parameter_bytes) / (in_flight *
        saved_bytes + transient_bytes))`` (bytes per sample of the stage), over the rows of the
        largest micro-batch (see :func:`_peak_rows`); the rest of the batch goes to the uncapped
        devices in proportion to their speed (water filling). ``None`` when the devices cannot
        hold the stage at all. ``bounded_by_memory=False`` gives the plain speed-proportional
        shares. Memoised: a search scores many layouts that share most of their stages.
        """
        key = (tuple(ranks), block_range, microbatch_size, in_flight, bounded_by_memory)
        if key not in self._shares:
            if len(self._shares) > _STAGE_CACHE_SIZE:
                self._shares.clear()
            self._shares[key] = self._speed_shares(*key)
        return self._shares[key]

    def _speed_shares(
        self,
        ranks: tuple[int, ...],
        block_range: tuple[int, int],
        microbatch_size: float,
        in_flight: int,
        bounded_by_memory: bool,
    ) -> tuple[float, ...] | None:
        arrays = self.arrays
        start, end = block_range
        index = np.asarray(ranks)
        per_sample = arrays.sample_s_prefix[index, end] - arrays.sample_s_prefix[index, start]
        speed = 1.0 / np.maximum(per_sample, 1e-300)
        if not bounded_by_memory:
            return tuple((speed / speed.sum()).tolist())
        free = arrays.memory[index] - self.config.state_copies * arrays.parameter_bytes(block_range)
        if (free < 0).any():
            return None
        per_row = in_flight * arrays.saved_bytes(block_range) + arrays.transient_bytes(block_range)
        largest = max(1, math.ceil(microbatch_size - _ROW_SLACK))
        if per_row > 0:
            caps = np.floor(free / per_row + _ROW_SLACK) / largest
        else:
            caps = np.full(len(ranks), np.inf)
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
        return tuple(shares.tolist())

    def transfer_time_s(self, sender: StagePlan, receiver: StagePlan, num_bytes: float) -> float:
        """Seconds to move ``num_bytes`` (one whole micro-batch's tensor) between two stages.

        Each overlapping (sender, receiver) pair of rows costs ``latency + overlap_bytes /
        bandwidth``; a device's messages are serialised; messages between two network groups
        share their WAN link (the cost model's *Activation transfers*).
        """
        if len(sender.ranks) == 1 and len(receiver.ranks) == 1:
            src, dst = sender.ranks[0], receiver.ranks[0]
            arrays = self.arrays
            return float(arrays.latency[src, dst] + num_bytes / arrays.bandwidth[src, dst])
        key = (sender.ranks, sender.batch_shares, receiver.ranks, receiver.batch_shares, num_bytes)
        found = self._transfers.get(key)
        if found is None:
            if len(self._transfers) > _STAGE_CACHE_SIZE:
                self._transfers.clear()
            found = self._transfers[key] = self._transfer(*key)
        return found

    def _transfer(
        self,
        ranks: Sequence[int],
        shares: Sequence[float] | Array,
        receiver_ranks: Sequence[int],
        receiver_shares: Sequence[float] | Array,
        num_bytes: float,
    ) -> float:
        arrays = self.arrays
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

    def allreduce_time_s(self, ranks: Sequence[int], num_bytes: float) -> float:
        """Ring all-reduce of ``num_bytes`` among ``ranks``; 0 for a single rank.

        ``2 (n-1)/n * num_bytes / min_bandwidth + 2 (n-1) * max_latency`` over every ordered
        pair of the group (the ring order is not known, so the slowest pair bounds every hop).
        """
        arrays = self.arrays
        n = len(ranks)
        if n < 2:
            return 0.0
        key = tuple(ranks)
        if key not in self._group_links:
            index = np.asarray(ranks)
            off_diagonal = ~np.eye(n, dtype=bool)
            bandwidth = float(arrays.bandwidth[np.ix_(index, index)][off_diagonal].min())
            latency = float(arrays.latency[np.ix_(index, index)][off_diagonal].max())
            self._group_links[key] = (bandwidth, latency)
        bandwidth, latency = self._group_links[key]
        return 2.0 * (n - 1) / n * num_bytes / bandwidth + 2.0 * (n - 1) * latency

    # ----------------------------------------------------------------------------------------
    # Stage costs and prediction
    # ----------------------------------------------------------------------------------------

    def stage_costs(
        self,
        stages: Sequence[StagePlan],
        *,
        microbatch_size: float,
        hops: Sequence[str] | None = None,
    ) -> StageCosts:
        """Simulator costs of one micro-batch of ``microbatch_size`` samples on each stage.

        ``activation_bytes`` is what a whole micro-batch's F saves on the stage until its W, and
        ``transient_bytes`` what its F, B or W needs beyond that while it runs (each device
        holds its share of both); ``static_memory_bytes`` is left unset (:meth:`predict` adds
        the parameter state per device). Transfers carry the boundary block's output bytes,
        compressed by each hop's method (``hops``; ``None``: :meth:`choose_hops`), whose encode
        and decode are charged to both stages' F and B.
        """
        self.check_stages(stages)
        b = microbatch_size
        last = len(stages) - 1
        rows = [
            self._stage_cost(stage, b, int(s > 0) + int(s < last), s == 0)
            for s, stage in enumerate(stages)
        ]
        forward, backward_input, backward_weight, merged, share, period, activation, transient = (
            [row[k] for row in rows] for k in range(8)
        )
        if hops is None:
            hops = self.choose_hops(stages, b)
        send_forward, send_backward = [], []
        for h, (sender, receiver) in enumerate(itertools.pairwise(stages)):
            num_bytes = self.hops.boundary_bytes(sender, b)
            method = METHODS[hops[h]] if hops else None
            if method is not None:
                for s in (h, h + 1):  # each side encodes one direction and decodes the other
                    codec_s = self.hops.codec_time_s(stages[s], method, num_bytes) / 2
                    forward[s] += codec_s
                    backward_input[s] += codec_s
                    merged[s] += codec_s
                num_bytes *= method.ratio
            send_forward.append(self.transfer_time_s(sender, receiver, num_bytes))
            send_backward.append(self.transfer_time_s(receiver, sender, num_bytes))
        return StageCosts(
            forward_s=tuple(forward),
            backward_input_s=tuple(backward_input),
            backward_weight_s=tuple(backward_weight),
            backward_s=tuple(merged),
            activation_bytes=tuple(activation),
            transient_bytes=tuple(transient),
            send_forward_s=tuple(send_forward),
            send_backward_s=tuple(send_backward),
            cpu_share=tuple(share) if self.arrays.has_quota else None,
            cpu_period_s=tuple(period) if self.arrays.has_quota else None,
        )

    def choose_hops(self, stages: Sequence[StagePlan], b: float) -> tuple[str, ...]:
        """:meth:`HopCodecs.choose`: each hop's compression for micro-batches of ``b``."""
        if not self.config.compression or len(stages) < 2:
            return ()
        last = len(stages) - 1
        compute = [
            sum(self._stage_cost(stage, b, int(s > 0) + int(s < last), s == 0)[:3])
            for s, stage in enumerate(stages)
        ]
        return self.hops.choose(stages, b, compute)

    def _stage_cost(self, stage: StagePlan, b: float, moves: int, first: bool) -> tuple[float, ...]:
        """One stage's ``(F, B, W, BW, cpu share, cpu period, saved bytes, transient bytes)`` for
        a micro-batch of ``b`` samples, with ``moves`` transfers per F and per B; memoised (a
        search scores many layouts that share most of their stages). The ``first`` stage runs
        its backward whole, as a BW does: its B only dispatches, its W is that backward."""
        key = (stage.ranks, stage.batch_shares, stage.block_range, b, moves, first)
        found = self._stages.get(key)
        if found is not None:
            return found
        arrays = self.arrays
        index = np.asarray(stage.ranks)
        rows = np.asarray(stage.batch_shares) * b  # mean rows per micro-batch
        active = np.minimum(rows, 1.0)  # below one row: a row in that fraction of them
        start, end = stage.block_range
        # Executor actions per micro-batch: F with its receive and send, B (or BW) with its
        # receive and send (none across the pipeline's ends), W.
        overhead = arrays.action_overhead[index]

        def part(slope: Array, fixed: Array, actions: int) -> Array:
            seconds = active * (fixed[index, end] - fixed[index, start] + actions * overhead)
            return seconds + rows * (slope[index, end] - slope[index, start])

        forward = part(arrays.forward, arrays.forward_fixed, 1 + moves)
        merged = part(arrays.backward, arrays.backward_fixed, 1 + moves)
        if first:
            backward_input = active * (1 + moves) * overhead
            backward_weight = merged - active * moves * overhead
        else:
            backward_input = part(arrays.backward_input, arrays.backward_input_fixed, 1 + moves)
            backward_weight = part(arrays.backward_weight, arrays.backward_weight_fixed, 1)
        # The stage keeps the pace of its slowest device, so that device's quota applies.
        slowest = int(index[int(np.argmax(forward + backward_input + backward_weight))])
        found = (
            *(float(t.max()) for t in (forward, backward_input, backward_weight, merged)),
            float(arrays.cpu_share[slowest]),
            float(arrays.cpu_period[slowest]),
            arrays.saved_bytes(stage.block_range) * b,
            arrays.transient_bytes(stage.block_range) * b,
        )
        if len(self._stages) > _STAGE_CACHE_SIZE:
            self._stages.clear()
        self._stages[key] = found
        return found

    def _lowered_schedule(
        self, schedule: str, p: int, m: int
    ) -> tuple[RankSchedule, CompiledSchedule]:
        """Generated, lowered (one simulated rank per stage), validated and compiled; memoised."""
        key = (schedule, p, m)
        if key not in self._lowered:
            placement = {s: s for s in range(p)}
            ranked = lower(generate(schedule, p, m), placement)
            validate(ranked, placement, m)
            if len(self._lowered) > _LOWERED_CACHE_SIZE:
                self._lowered.clear()
            self._lowered[key] = (ranked, compile_schedule(ranked, placement))
        return self._lowered[key]

    def _simulate(
        self, costs: StageCosts, schedule: str, m: int, stage_schedule: StageSchedule | None
    ) -> tuple[float, float, dict[int, int]]:
        p = costs.num_stages
        placement = {s: s for s in range(p)}
        if stage_schedule is None:
            ranked, compiled = self._lowered_schedule(schedule, p, m)
            result = simulate(
                ranked, placement, costs, num_microbatches=m, events=False, compiled=compiled
            )
        else:  # a cost-fitted schedule (compact): checked and compiled once per schedule object
            kept = self._fitted.get(id(stage_schedule))
            if kept is None or kept[0] is not stage_schedule:
                validate(lower(stage_schedule, placement), placement, m)
                self._fitted.clear()
                kept = self._fitted[id(stage_schedule)] = (
                    stage_schedule,
                    compile_stage_schedule(stage_schedule),
                )
            result = simulate_stages(stage_schedule, costs, num_microbatches=m, compiled=kept[1])
        return result.step_time_s, result.bubble_ratio, result.peak_memory_bytes

    def predict(
        self,
        stages: Sequence[StagePlan],
        schedule: str,
        num_microbatches: int,
        global_batch_size: int,
        *,
        stage_schedule: StageSchedule | None = None,
        breakdown: bool = True,
        hops: Sequence[str] | None = None,
    ) -> Prediction:
        """Predict one optimizer step of ``stages`` under ``schedule``.

        The micro-batch size is ``global_batch_size / num_microbatches`` (the mean, when the
        division is not exact). ``schedule="compact"`` needs its actions in ``stage_schedule``;
        the other kinds are generated. ``breakdown=False`` skips the second simulation that
        measures ``transfer_s`` (left 0), which the search does not need. ``hops``: each hop's
        compression method (``()``: none); ``None`` chooses them (:meth:`choose_hops`).
        """
        m = num_microbatches
        if schedule == "compact":
            if stage_schedule is None:
                raise ValueError(
                    "schedule 'compact' is fitted to costs: pass its actions as stage_schedule "
                    "(plan_search makes them; Plan.stage_schedule() returns a plan's)"
                )
        elif schedule not in SCHEDULE_KINDS:
            kinds = ", ".join((*SCHEDULE_KINDS, "compact"))
            raise ValueError(f"schedule: expected one of {kinds}, got {schedule!r}")
        else:
            stage_schedule = None  # generated kinds: the memoised generator
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"num_microbatches: expected a positive integer, got {m!r}")
        if global_batch_size < m:
            raise ValueError(
                f"global_batch_size: {global_batch_size} samples cannot fill {m} micro-batches; "
                f"use at most {global_batch_size} micro-batches"
            )
        arrays = self.arrays
        b = global_batch_size / m
        hops = self.choose_hops(stages, b) if hops is None else tuple(hops)
        costs = self.stage_costs(stages, microbatch_size=b, hops=hops)
        pipeline_s, bubble, activation_peak = self._simulate(costs, schedule, m, stage_schedule)
        if schedule in MERGED_BACKWARD_KINDS:
            backward = costs.merged_backward_s
        else:
            backward = tuple(map(operator.add, costs.backward_input_s, costs.backward_weight_s))
        busy = [m * (f + bw) for f, bw in zip(costs.forward_s, backward, strict=True)]
        compute_s = max(busy)
        transfer_s = 0.0
        if breakdown and len(stages) > 1:
            free = dataclasses.replace(
                costs,
                send_forward_s=(0.0,) * (len(stages) - 1),
                send_backward_s=(0.0,) * (len(stages) - 1),
            )
            free_s = self._simulate(free, schedule, m, stage_schedule)[0]
            transfer_s = max(0.0, pipeline_s - free_s)
        config = self.config
        allreduce_s = optimizer_s = cpu_floor_s = 0.0
        memory: dict[int, int] = {}
        over: list[int] = []
        for s, stage in enumerate(stages):
            params = arrays.parameter_bytes(stage.block_range)
            allreduce_s = max(allreduce_s, self.allreduce_time_s(stage.ranks, params))
            index = np.asarray(stage.ranks)
            rates = arrays.optimizer_rates(stage.ranks, config.optimizer_s_per_byte)
            optimizer_s = max(optimizer_s, float(rates.max()) * params)
            if arrays.has_quota:
                floor_s = self._cpu_floor(stages, s, busy[s], rates * params, m * b, hops)
                cpu_floor_s = max(cpu_floor_s, floor_s)
            per_row = activation_peak[s] / b  # the simulator's peak is for b rows
            peaks = np.round(
                config.state_copies * params + per_row * _peak_rows(stage.batch_shares, b)
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
            hop_compression=hops,
        )

    def predict_plan(self, plan: Plan) -> Prediction:
        """:meth:`predict` of a saved or running ``plan`` (a compact plan with its own actions)."""
        return self.predict(
            plan.stages,
            plan.schedule,
            plan.num_microbatches,
            plan.global_batch_size,
            stage_schedule=plan.stage_schedule() if plan.schedule == "compact" else None,
            hops=plan.hop_compression,
        )

    def _cpu_floor(
        self,
        stages: Sequence[StagePlan],
        s: int,
        busy_s: float,
        optimizer_s: Array,
        samples: float,
        hops: Sequence[str],
    ) -> float:
        """Longest time stage ``s``'s quota-limited devices need for a step: their compute
        (``busy_s``, at sustained speed) and optimizer step, plus the host CPU of the step and of
        every byte they send or receive, at their quota (``cpu_share``). 0 when none has one."""
        arrays = self.arrays
        config = self.config
        stage = stages[s]
        start, end = stage.block_range
        boundary = 0.0  # bytes per sample crossing the stage's edges, each once forward, once back
        if s > 0:
            ratio = METHODS[hops[s - 1]].ratio if hops else 1.0
            boundary += 2.0 * float(arrays.activation[start - 1]) * ratio
        if s < len(stages) - 1:
            ratio = METHODS[hops[s]].ratio if hops else 1.0
            boundary += 2.0 * float(arrays.activation[end - 1]) * ratio
        n = len(stage.ranks)
        ring = 4.0 * (n - 1) / n * arrays.parameter_bytes(stage.block_range)  # sent and received
        floor = 0.0
        for rank, share, optimizer in zip(
            stage.ranks, stage.batch_shares, optimizer_s, strict=True
        ):
            device = self.profile.devices[rank]
            if not device.has_cpu_quota:
                continue
            moved = boundary * samples * share + ring
            host = config.host_cpu_s_per_step + config.host_cpu_s_per_byte * moved
            floor = max(floor, busy_s + float(optimizer) + host / device.cpu_share)
        return floor
