"""Hand-built cluster profiles: what a planner test runs on without measuring a device."""

from __future__ import annotations

import math

import numpy as np

from lightning_deepcee.profiler.data import ClusterProfile, DeviceProfile


def make_profile(
    *,
    speeds: list[float],
    num_blocks: int,
    bandwidth: np.ndarray | float = math.inf,
    latency: float = 0.0,
    block_s: float = 1.0,
    activation_bytes: int = 1000,
    parameter_bytes: int = 0,
    memory_bytes: int = 10**12,
    reference_microbatch_size: int = 1,
    fixed_fraction: float = 0.0,
) -> ClusterProfile:
    """Identical blocks; device ``d`` takes ``block_s / speeds[d]`` for each of F, B and W."""
    n = len(speeds)
    bw = np.full((n, n), bandwidth) if np.isscalar(bandwidth) else np.asarray(bandwidth, float)
    bw = bw.copy()
    np.fill_diagonal(bw, math.inf)
    lat = np.full((n, n), latency)
    np.fill_diagonal(lat, 0.0)
    devices = tuple(
        DeviceProfile(
            rank=r,
            host=f"h{r}",
            kind="cpu",
            memory_bytes=memory_bytes,
            forward_s=(block_s / speeds[r],) * num_blocks,
            backward_input_s=(block_s / speeds[r],) * num_blocks,
            backward_weight_s=(block_s / speeds[r],) * num_blocks,
            activation_bytes=(activation_bytes,) * num_blocks,
            parameter_bytes=(parameter_bytes,) * num_blocks,
            reference_microbatch_size=reference_microbatch_size,
            capability=speeds[r],
            fixed_s=(3 * fixed_fraction * block_s / speeds[r],) * num_blocks,
        )
        for r in range(n)
    )
    return ClusterProfile(
        devices=devices,
        latency_s=tuple(tuple(row) for row in lat.tolist()),
        bandwidth_bytes_per_s=tuple(tuple(row) for row in bw.tolist()),
        num_blocks=num_blocks,
        model_fingerprint="model",
        cluster_fingerprint="cluster",
    )


def two_zones(wan_bytes_per_s: float) -> ClusterProfile:
    """Zone A: 2 fast devices; zone B: 4 devices 4x slower; 10 GB/s inside a zone."""
    speeds = [4.0, 4.0, 1.0, 1.0, 1.0, 1.0]
    zone = np.array([0, 0, 1, 1, 1, 1])
    bandwidth = np.where(zone[:, None] == zone[None, :], 1e10, wan_bytes_per_s)
    return make_profile(
        speeds=speeds,
        num_blocks=8,
        bandwidth=bandwidth,
        latency=0.001,
        block_s=0.01,
        activation_bytes=200_000,
        parameter_bytes=20_000_000,
    )


def random_profile(
    seed: int, num_devices: int, num_blocks: int, memory_bytes: int = 10**12
) -> ClusterProfile:
    """Devices in 1-3 regions (fast links inside, slow between), random speeds and block costs."""
    rng = np.random.default_rng(seed)
    region = rng.integers(0, 3, num_devices)
    wan = rng.uniform(1e5, 1e7, (3, 3))
    wan = np.minimum(wan, wan.T)
    same = region[:, None] == region[None, :]
    bandwidth = np.where(
        same, 1e8 * rng.uniform(0.8, 1.2, (num_devices,) * 2), wan[region][:, region]
    )
    np.fill_diagonal(bandwidth, math.inf)
    latency = np.where(same, 1e-4, 1e-2)
    np.fill_diagonal(latency, 0.0)
    base = rng.uniform(0.5, 2.0, num_blocks) * 1e-2
    activation = rng.integers(1_000, 100_000, num_blocks)
    params = rng.integers(1_000, 1_000_000, num_blocks)
    devices = []
    for rank in range(num_devices):
        speed = rng.uniform(0.5, 4.0)
        per_block = tuple(float(t) for t in base / speed)
        devices.append(
            DeviceProfile(
                rank=rank,
                host=f"h{rank}",
                kind="cpu",
                memory_bytes=memory_bytes,
                forward_s=per_block,
                backward_input_s=per_block,
                backward_weight_s=tuple(2 * t for t in per_block),
                activation_bytes=tuple(int(a) for a in activation),
                parameter_bytes=tuple(int(p) for p in params),
                reference_microbatch_size=int(rng.integers(1, 5)),
                capability=float(speed),
            )
        )
    return ClusterProfile(
        devices=tuple(devices),
        latency_s=tuple(tuple(row) for row in latency.tolist()),
        bandwidth_bytes_per_s=tuple(tuple(row) for row in bandwidth.tolist()),
        num_blocks=num_blocks,
        model_fingerprint="model",
        cluster_fingerprint="cluster",
    )
