"""Candidates of one plan search: how a layout is scored, memoised and refined.

A candidate is a *layout* (the devices of each stage, in pipeline order, and each stage's block
range) with a schedule kind and a micro-batch count. :class:`SearchContext` holds what one
search evaluates candidates against (an :class:`~lightning_deepcee.planner.evaluator.Evaluator`,
the global batch, the (schedule, micro-batch count) pairs, whether memory is checked) and
memoises per search: scored candidates, per-stage range costs and compute-balanced partitions.
It also owns the local improvement of a layout's block boundaries (:meth:`SearchContext.refine`).

A search's costliest steps are independent calls of pure functions, mapped with a
:class:`MapFn` (:func:`serial_map` by default); a caller with idle processes passes one that
spreads the calls over them. A context pickles without its memos, so handing it out is cheap.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard

import numpy as np
import numpy.typing as npt

from lightning_deepcee.planner.evaluator import Evaluator
from lightning_deepcee.planner.partition import Ranges, min_max_split
from lightning_deepcee.planner.plan import StagePlan
from lightning_deepcee.planner.prediction import Prediction
from lightning_deepcee.schedule.generators import StageSchedule

__all__ = [
    "MAX_MEMORY_COUNT",
    "Candidate",
    "MapFn",
    "SearchContext",
    "Structure",
    "improves",
    "memory_counts",
    "serial_map",
]

Structure = tuple[tuple[int, ...], ...]
"""Devices of each stage, in pipeline order."""
Array = npt.NDArray[np.float64]


class MapFn(Protocol):
    """``map_fn(fn, items, costs)`` returns ``[fn(item) for item in items]``, in order, however
    it runs them; ``fn`` and the items pickle (module-level functions, ``functools.partial``).
    ``costs`` (optional) are the calls' relative costs, for a map that shares them out."""

    def __call__(
        self,
        fn: Callable[[Any], Any],
        items: Sequence[Any],
        costs: Sequence[float] | None = None,
    ) -> list[Any]: ...


def serial_map(
    fn: Callable[[Any], Any], items: Sequence[Any], costs: Sequence[float] | None = None
) -> list[Any]:
    """The default :class:`MapFn`: every call here, in order."""
    return [fn(item) for item in items]


MAX_MEMORY_COUNT = 1024
"""The most micro-batches :func:`memory_counts` proposes: a step's simulation grows with the
count, and 1024 micro-batches are one sample each at a global batch of 1024."""


def memory_counts(top: int, global_batch_size: int) -> tuple[int, ...]:
    """Micro-batch counts above ``top`` to try when a layout fits at no count up to ``top``:
    divisors of the global batch, each at least twice the one before, up to the batch itself
    (one sample per micro-batch) or ``MAX_MEMORY_COUNT``. Smaller micro-batches hold fewer
    activations, so a large global batch on few devices can need more of them than a search
    usually tries."""
    divisors = sorted(
        {
            d
            for k in range(1, math.isqrt(global_batch_size) + 1)
            if global_batch_size % k == 0
            for d in (k, global_batch_size // k)
        }
    )
    found: list[int] = []
    for m in divisors:
        if m > MAX_MEMORY_COUNT:
            break
        if m >= 2 * (found[-1] if found else top):
            found.append(m)
    return tuple(found)


_EXACT_PARTITIONS = 64
"""Structures with at most this many block partitions have all of them tried."""
_SCREENED_PARTITIONS = 8
"""Of those, the partitions this fast under the candidate's own (schedule, micro-batch count)
are tried at every pair (the best cuts shift with the pair, but not far down the order)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A scored candidate: its layout, schedule, micro-batch count, stages and prediction."""

    step_time_s: float
    structure: Structure
    ranges: Ranges
    schedule: str
    num_microbatches: int
    stages: tuple[StagePlan, ...]
    prediction: Prediction
    stage_schedule: StageSchedule | None = None
    """``"compact"`` only: the fitted actions."""


def improves(trial: Candidate | None, best: Candidate) -> TypeGuard[Candidate]:
    """Whether ``trial`` exists and is faster than ``best`` by more than rounding (1e-9 relative;
    ties keep the candidate found first, so the search is deterministic)."""
    return trial is not None and trial.step_time_s < best.step_time_s * (1 - 1e-9)


_CONTEXT_MEMOS = frozenset({"_evaluated", "_range_cost", "_partition"})


class SearchContext:
    """Everything one search evaluates candidates against, with memoisation."""

    def __init__(
        self,
        evaluator: Evaluator,
        *,
        global_batch_size: int,
        schedules: Sequence[str],
        microbatch_counts: Sequence[int],
        memory_check: bool,
    ) -> None:
        self.evaluator = evaluator
        self.profile = evaluator.profile
        self.global_batch_size = global_batch_size
        self.schedules = tuple(schedules)
        self.microbatch_counts = tuple(microbatch_counts)
        self.memory_check = memory_check
        # Counts above microbatch_counts for layouts that fit at none of them (memory_counts).
        self.memory_counts = (
            memory_counts(max(self.microbatch_counts), global_batch_size) if memory_check else ()
        )
        self._evaluated: dict[tuple[Structure, Ranges, str, int], Candidate | None] = {}
        self._range_cost: dict[tuple[int, ...], Array] = {}
        self._partition: dict[Structure, Ranges | None] = {}

    def __getstate__(self) -> dict[str, Any]:
        """The context without its memos: what a process needs to evaluate candidates."""
        return {k: {} if k in _CONTEXT_MEMOS else v for k, v in self.__dict__.items()}

    @property
    def pairs(self) -> list[tuple[str, int]]:
        """Every (schedule kind, micro-batch count) to try, counts outermost."""
        return [(k, m) for m in self.microbatch_counts for k in self.schedules]

    def evaluate(
        self, structure: Structure, ranges: Ranges, schedule: str, m: int
    ) -> Candidate | None:
        """The layout scored under ``schedule`` with ``m`` micro-batches (memoised); ``None``
        when it cannot fit memory."""
        key = (structure, ranges, schedule, m)
        if key not in self._evaluated:
            self._evaluated[key] = self._evaluate(structure, ranges, schedule, m)
        return self._evaluated[key]

    def _evaluate(
        self, structure: Structure, ranges: Ranges, schedule: str, m: int
    ) -> Candidate | None:
        evaluator = self.evaluator
        arrays = evaluator.arrays
        if arrays.parameter_prefix[-1] > 0 and any(arrays.parameter_bytes(r) == 0 for r in ranges):
            return None  # a stage without parameters would have nothing to optimise
        b = self.global_batch_size / m
        in_flight = evaluator.in_flight_microbatches(schedule, len(structure), m)
        stages = []
        for s, (ranks, block_range) in enumerate(zip(structure, ranges, strict=True)):
            shares = evaluator.speed_shares(
                ranks,
                block_range,
                microbatch_size=b,
                in_flight=in_flight[s],
                bounded_by_memory=self.memory_check,
            )
            if shares is None:
                return None
            stages.append(StagePlan.trusted(block_range, ranks, shares))
        prediction = evaluator.predict(stages, schedule, m, self.global_batch_size, breakdown=False)
        if self.memory_check and not prediction.fits_memory:
            return None
        return Candidate(
            prediction.step_time_s, structure, ranges, schedule, m, tuple(stages), prediction
        )

    def best_over_pairs(self, structure: Structure, ranges: Ranges) -> Candidate | None:
        """The layout's fastest (schedule, micro-batch count); ``None`` when none fits.

        When it fits at no count of ``microbatch_counts``, the :attr:`memory_counts` are tried
        in order and the first count where it fits is taken."""
        best = self._fastest(structure, ranges, self.pairs)
        if best is None:
            for m in self.memory_counts:
                best = self._fastest(structure, ranges, [(k, m) for k in self.schedules])
                if best is not None:
                    break
        return best

    def _fastest(
        self, structure: Structure, ranges: Ranges, pairs: Sequence[tuple[str, int]]
    ) -> Candidate | None:
        best: Candidate | None = None
        for schedule, m in pairs:
            scored = self.evaluate(structure, ranges, schedule, m)
            if scored is not None and (best is None or scored.step_time_s < best.step_time_s):
                best = scored
        return best

    def range_cost(self, ranks: tuple[int, ...]) -> Array:
        """Per-sample seconds of a stage on ``ranks`` for each block range ``[i, j)``.

        With speed-proportional shares the stage takes ``1 / sum_d (1 / T_d)`` per sample; a range
        is infinite where some device cannot hold its parameter state and one sample in flight
        (every device of a stage holds at least one row: a bound no schedule goes below).
        """
        if ranks not in self._range_cost:
            arrays = self.evaluator.arrays
            total = arrays.sample_s_prefix[np.asarray(ranks)]
            with np.errstate(divide="ignore"):
                per_device = total[:, None, :] - total[:, :, None]
                speed = np.where(per_device > 0, 1.0 / per_device, np.inf).sum(axis=0)
                cost = np.where(speed > 0, 1.0 / speed, np.inf)
            if self.memory_check:
                params, saved = arrays.parameter_prefix, arrays.saved_prefix
                state = self.evaluator.config.state_copies * (params[None, :] - params[:, None])
                need = state + saved[None, :] - saved[:, None] + arrays.transient_peak
                cost = np.where(need > arrays.memory[list(ranks)].min(), np.inf, cost)
            self._range_cost[ranks] = cost
        return self._range_cost[ranks]

    def partition(self, structure: Structure) -> Ranges | None:
        """The compute-balanced block ranges of ``structure`` (memoised); ``None`` when no
        split fits memory or there are more stages than blocks."""
        if structure not in self._partition:
            if len(structure) > self.profile.num_blocks:
                self._partition[structure] = None
            else:
                costs = [self.range_cost(ranks) for ranks in structure]
                self._partition[structure] = min_max_split(costs)
        return self._partition[structure]

    def refine(self, scored: Candidate, max_iter: int) -> Candidate:
        """Improve the block boundaries under the full cost model, then re-pick (schedule, m).

        The compute-balanced partition ignores transfers, which depend on where the cuts fall.
        When a structure has at most ``_EXACT_PARTITIONS`` partitions they are all tried, each
        with every (schedule, micro-batch count) pair (the best cuts depend on the pair: fewer,
        larger micro-batches favour other cuts than many small ones); otherwise up to
        ``max_iter`` rounds of hill climbing move one boundary, or two adjacent boundaries
        together (shifting a whole stage), by one block, keeping the best move.
        """
        current = scored
        p, n = len(current.ranges), self.profile.num_blocks
        if math.comb(n - 1, p - 1) <= _EXACT_PARTITIONS:
            partitions = [
                tuple(itertools.pairwise((0, *cuts, n)))
                for cuts in itertools.combinations(range(1, n), p - 1)
            ]
            screened = sorted(
                partitions,
                key=lambda r: _seconds(
                    self.evaluate(current.structure, r, current.schedule, current.num_microbatches)
                ),
            )
            for ranges in screened[:_SCREENED_PARTITIONS]:
                trial = self.best_over_pairs(current.structure, ranges)
                if improves(trial, current):
                    current = trial
        else:
            for _ in range(max_iter):
                best = current
                for ranges in _neighbours(current.ranges):
                    trial = self.evaluate(
                        current.structure, ranges, current.schedule, current.num_microbatches
                    )
                    if improves(trial, best):
                        best = trial
                if best is current:
                    break
                current = best
        again = self.best_over_pairs(current.structure, current.ranges)
        return again if again is not None and again.step_time_s < current.step_time_s else current


def _seconds(scored: Candidate | None) -> float:
    """A candidate's predicted step, ``inf`` when it does not fit."""
    return math.inf if scored is None else scored.step_time_s


def _neighbours(ranges: Ranges) -> list[Ranges]:
    """Partitions one move away: one boundary, or two adjacent ones together, by +-1 block."""
    cuts = [start for start, _ in ranges[1:]]
    n = ranges[-1][1]
    out = []
    for first in range(len(cuts)):
        for last in range(first, min(first + 2, len(cuts))):
            for delta in (-1, 1):
                moved = list(cuts)
                for k in range(first, last + 1):
                    moved[k] += delta
                bounds = (0, *moved, n)
                if all(a < b for a, b in itertools.pairwise(bounds)):
                    out.append(tuple(itertools.pairwise(bounds)))
    return out
