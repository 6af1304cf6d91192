"""Text the strategy prints for people: the cluster profile table."""

from __future__ import annotations

from lightning_deepcee.profiler import ClusterProfile, DeviceGroups

__all__ = ["format_cluster"]


def format_cluster(profile: ClusterProfile, groups: DeviceGroups) -> str:
    """The profiling table printed at setup: devices, groups, memory and the bandwidth matrix."""
    lines = ["DeepCEE cluster profile:", groups.format_table(profile)]
    lines.append("  rank | memory GiB | F+B+W ms, all blocks, one micro-batch (fixed part)")
    for d in profile.devices:
        total, fixed = sum(d.block_seconds) * 1e3, sum(d.fixed_s) * 1e3
        lines.append(
            f"  {d.rank:>4} | {d.memory_bytes / 2**30:>10.1f} | {total:.1f} at "
            f"{d.reference_microbatch_size} samples ({fixed:.1f} fixed)"
        )
    lines.append("  bandwidth Mbit/s (row sends to column), latency ms:")
    n = profile.num_devices
    lines.append("        " + "".join(f"{j:>10}" for j in range(n)))
    for i in range(n):
        cells = []
        for j in range(n):
            bw = profile.bandwidth_bytes_per_s[i][j]
            lat = profile.latency_s[i][j]
            cells.append("         -" if i == j else f"{bw * 8 / 1e6:>6.0f}/{lat * 1e3:<3.1f}")
        lines.append(f"  {i:>4}  " + "".join(f"{c:>10}" for c in cells))
    return "\n".join(lines)
