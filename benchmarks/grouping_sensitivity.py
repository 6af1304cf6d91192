"""Sensitivity of first-level (network) grouping to its threshold and to measurement noise.

Draws random 3-region clusters (2-4 devices per region, LAN 1 Gbit/s inside a region, one WAN
speed per region pair drawn log-uniformly in 20-200 Mbit/s), multiplies every ordered bandwidth
entry by an independent factor in [1 - noise, 1 + noise], groups the devices with
``group_by_network`` and prints, as a Markdown table, the fraction of trials whose groups equal the
true regions exactly. Pure numpy/scipy; runs in a few seconds on one core.

Run from the repository root::

    python benchmarks/grouping_sensitivity.py [--trials 50] [--seed 0]
"""

from __future__ import annotations

import argparse

import numpy as np
import numpy.typing as npt

from lightning_deepcee.profiler.grouping import GroupingConfig, group_by_network

__all__ = ["main", "random_regions", "sweep"]

LAN_BYTES_PER_S = 1e9 / 8
WAN_MIN_BYTES_PER_S = 20e6 / 8
WAN_MAX_BYTES_PER_S = 200e6 / 8
THRESHOLDS = (1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0)
NOISE_LEVELS = (0.0, 0.1, 0.2, 0.3)


def random_regions(
    rng: np.random.Generator, *, num_regions: int = 3, noise: float = 0.0
) -> tuple[npt.NDArray[np.float64], tuple[tuple[int, ...], ...]]:
    """A noisy bandwidth matrix (bytes/s) and its true regions, ranks numbered region by region."""
    sizes = rng.integers(2, 5, size=num_regions)
    region_of = np.repeat(np.arange(num_regions), sizes)
    log_wan = rng.uniform(
        np.log(WAN_MIN_BYTES_PER_S), np.log(WAN_MAX_BYTES_PER_S), (num_regions, num_regions)
    )
    wan = np.exp(np.triu(log_wan, 1) + np.triu(log_wan, 1).T)
    bandwidth = np.where(
        region_of[:, None] == region_of[None, :],
        LAN_BYTES_PER_S,
        wan[region_of[:, None], region_of[None, :]],
    )
    bandwidth = bandwidth * rng.uniform(1 - noise, 1 + noise, bandwidth.shape)
    np.fill_diagonal(bandwidth, np.inf)
    truth = tuple(
        tuple(int(rank) for rank in np.flatnonzero(region_of == region))
        for region in range(num_regions)
    )
    return bandwidth, truth


def sweep(*, trials: int, seed: int) -> dict[tuple[float, float], float]:
    """Fraction of exact recoveries for each (threshold, noise); the same clusters per column."""
    results: dict[tuple[float, float], float] = {}
    for noise in NOISE_LEVELS:
        clusters = [
            random_regions(np.random.default_rng([seed, trial]), noise=noise)
            for trial in range(trials)
        ]
        for threshold in THRESHOLDS:
            config = GroupingConfig(bandwidth_ratio_threshold=threshold)
            hits = sum(group_by_network(bw, config) == truth for bw, truth in clusters)
            results[(threshold, noise)] = hits / trials
    return results


def main() -> None:
    """Print the sweep as a Markdown table (rows: threshold, columns: noise)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=50, help="random clusters per cell")
    parser.add_argument("--seed", type=int, default=0, help="base seed")
    args = parser.parse_args()
    results = sweep(trials=args.trials, seed=args.seed)
    print(f"3 regions, {args.trials} trials per cell, seed {args.seed}; default threshold 4.0")
    print()
    print(
        "| bandwidth_ratio_threshold | "
        + " | ".join(f"noise ±{n:.0%}" for n in NOISE_LEVELS)
        + " |"
    )
    print("|---:|" + "---:|" * len(NOISE_LEVELS))
    for threshold in THRESHOLDS:
        cells = " | ".join(f"{results[(threshold, n)]:.2f}" for n in NOISE_LEVELS)
        print(f"| {threshold:g} | {cells} |")


if __name__ == "__main__":
    main()
