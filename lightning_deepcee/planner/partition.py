"""Contiguous block partitions (pure core).

A partition assigns each pipeline stage a contiguous range of the model's blocks. This module
owns the min-max splits, the classic linear-partition problem solved exactly by dynamic
programming in ``O(stages * blocks^2)``:

- :func:`balanced_partition`: per-block weights (parameter counts, or measured seconds) over
  identical stages;
- :func:`heterogeneous_partition`: per-block costs over stages of *different* speeds, in a fixed
  pipeline order;
- :func:`min_max_split`: the general form the search uses, any cost per (stage, block range);

and the checks and conversions of a partition (:func:`check_partition`,
:func:`partition_from_sizes`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = [
    "balanced_partition",
    "check_partition",
    "heterogeneous_partition",
    "min_max_split",
    "partition_from_sizes",
]

Ranges = tuple[tuple[int, int], ...]
"""Half-open block range of each stage, in pipeline order."""


def check_partition(ranges: Sequence[tuple[int, int]], num_blocks: int) -> None:
    """Raise ``ValueError`` unless ``ranges`` are non-empty, contiguous and cover every block."""
    if not ranges:
        raise ValueError("A partition needs at least one stage.")
    expected = 0
    for i, (start, end) in enumerate(ranges):
        if start != expected or end <= start:
            raise ValueError(
                f"Stage {i} covers blocks [{start}, {end}); expected a non-empty range starting at "
                f"block {expected}. Stages must be contiguous, in order, and cover blocks "
                f"0..{num_blocks - 1}; got {list(ranges)}."
            )
        expected = end
    if expected != num_blocks:
        raise ValueError(
            f"The partition {list(ranges)} covers {expected} blocks but the model has {num_blocks}."
        )


def partition_from_sizes(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Turn stage sizes such as ``[3, 2, 3]`` into block ranges ``[(0, 3), (3, 5), (5, 8)]``."""
    ranges, start = [], 0
    for n in sizes:
        ranges.append((start, start + n))
        start += n
    return ranges


def balanced_partition(weights: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """Split ``weights`` into ``num_stages`` contiguous ranges minimising the heaviest range.

    Ties are broken towards earlier stages holding fewer blocks, which keeps the result
    deterministic.
    """
    n = len(weights)
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > n:
        raise ValueError(
            f"Cannot split {n} blocks into {num_stages} stages: every stage needs at least one "
            f"block. Use at most {n} devices per pipeline, or expose a finer list of blocks."
        )
    prefix = [0.0]
    for w in weights:
        if w < 0:
            raise ValueError(f"Block weights must be >= 0, got {w}")
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[k][j]: minimal max-load splitting the first j blocks into k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(k - 1, j):
                load = max(best[k - 1][i], prefix[j] - prefix[i])
                if load < best[k][j] - 1e-12:
                    best[k][j], cut[k][j] = load, i
    ranges: list[tuple[int, int]] = []
    j = n
    for k in range(num_stages, 0, -1):
        i = cut[k][j]
        ranges.append((i, j))
        j = i
    return ranges[::-1]


def min_max_split(range_cost: Sequence[npt.NDArray[np.float64]]) -> Ranges | None:
    """Contiguous split minimising ``max_s range_cost[s][start_s, end_s]``; None if all inf.

    ``range_cost[s]`` is an ``(n+1) x (n+1)`` matrix: the time stage ``s`` takes for blocks
    ``[i, j)`` (only ``i < j`` is read). Ties go to the earliest cut.
    """
    p = len(range_cost)
    n = range_cost[0].shape[0] - 1
    if p > n:
        return None
    upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    cuts = []
    for s in range(p):
        load = np.where(upper, np.maximum(best[:, None], range_cost[s]), np.inf)
        cut = np.argmin(load, axis=0)
        best = load[cut, np.arange(n + 1)]
        cuts.append(cut)
    if not math.isfinite(best[n]):
        return None
    ranges = []
    end = n
    for s in range(p - 1, -1, -1):
        start = int(cuts[s][end])
        ranges.append((start, end))
        end = start
    return tuple(ranges[::-1])


def heterogeneous_partition(
    block_costs: Sequence[float], stage_speeds: Sequence[float]
) -> list[tuple[int, int]]:
    """Split blocks over stages of different speeds so that the slowest stage is fastest.

    Stage ``s`` takes ``sum(block_costs[start:end]) / stage_speeds[s]`` for its half-open range;
    the order of the stages is fixed (it is the pipeline order). Exact, ``O(p n^2)``.
    """
    n, p = len(block_costs), len(stage_speeds)
    if p < 1 or p > n:
        raise ValueError(
            f"Cannot split {n} blocks into {p} stages: every stage needs at least one block "
            f"(use 1..{n} stages, or expose a finer list of blocks)"
        )
    if any(c < 0 or not math.isfinite(c) for c in block_costs):
        raise ValueError(f"block_costs: expected non-negative finite costs, got {block_costs!r}")
    if any(v <= 0 or not math.isfinite(v) for v in stage_speeds):
        raise ValueError(f"stage_speeds: expected positive finite speeds, got {stage_speeds!r}")
    prefix = np.concatenate([[0.0], np.cumsum(block_costs)])
    work = prefix[None, :] - prefix[:, None]
    ranges = min_max_split([work / speed for speed in stage_speeds])
    assert ranges is not None  # every entry is finite when p <= n
    return list(ranges)
