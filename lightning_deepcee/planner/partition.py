"""Contiguous block partitions (pure core).

A partition assigns each pipeline stage a contiguous range of the model's blocks. This module
balances a list of per-block weights (parameter counts, or measured seconds) so that the heaviest
stage is as light as possible, the classic linear-partition problem, solved exactly by dynamic
programming in ``O(stages * blocks^2)``.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balanced_partition", "check_partition", "partition_from_sizes"]


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
