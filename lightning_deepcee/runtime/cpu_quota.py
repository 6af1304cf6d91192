"""The CPU quota this process runs under: a container's CPU limit, a Linux cgroup's CFS quota.

A process limited to ``quota`` seconds of CPU per ``period`` runs at full speed until its
period's budget is spent, then stalls until the next period. The profiler records the quota
(:attr:`~lightning_deepcee.profiler.DeviceProfile.cpu_share` and ``cpu_period_s``) so that the
planner's simulator can model it: a device that waits for a message does not use its budget,
and its next actions run at full speed. Kubernetes' CPU limits, Docker's ``--cpus`` and the
lab's Mininet hosts all set such a quota.

Both cgroup versions are read: v1 (``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` in the ``cpu``
hierarchy) and v2 (``cpu.max``). The process's own cgroup and every ancestor are checked and the
tightest limit wins, as the kernel applies all of them. Where the cgroup files are not visible
(the lab's Mininet hosts remount ``/sys`` for their network namespace), the environment variable
``DEEPCEE_CPU_MAX`` gives the quota in ``cpu.max``'s words, ``"<quota_us> <period_us>"``; the lab
sets it for each device, and it wins over the files.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CPU_MAX_ENV", "CpuQuota", "read_cpu_quota"]

CPU_MAX_ENV = "DEEPCEE_CPU_MAX"
"""``"<quota_us> <period_us>"`` (or ``"max <period_us>"``: none); wins over the cgroup files."""


@dataclass(frozen=True, slots=True)
class CpuQuota:
    """A CFS quota: ``cores`` of CPU on average (quota / period), in periods of ``period_s``."""

    cores: float
    period_s: float


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _v1_limit(directory: Path) -> CpuQuota | None:
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    if quota is None or period is None:
        return None
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:
        return None
    if quota_us <= 0 or period_us <= 0:  # -1: no limit
        return None
    return CpuQuota(cores=quota_us / period_us, period_s=period_us / 1e6)


def _v2_limit(directory: Path) -> CpuQuota | None:
    return _parse_cpu_max(_read(directory / "cpu.max"))


def _parse_cpu_max(text: str | None) -> CpuQuota | None:
    """``"<quota_us> <period_us>"`` as a quota; ``"max ..."``, missing or malformed text: None."""
    if text is None:
        return None
    words = text.split()
    if len(words) != 2 or words[0] == "max":
        return None
    try:
        quota_us, period_us = int(words[0]), int(words[1])
    except ValueError:
        return None
    if quota_us <= 0 or period_us <= 0:
        return None
    return CpuQuota(cores=quota_us / period_us, period_s=period_us / 1e6)


def _mounts(proc_mounts: Path) -> tuple[Path | None, Path | None]:
    """Mount points of the v1 ``cpu`` hierarchy and of the v2 unified hierarchy."""
    v1 = v2 = None
    for line in (_read(proc_mounts) or "").splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        if parts[2] == "cgroup" and "cpu" in parts[3].split(",") and v1 is None:
            v1 = Path(parts[1])
        elif parts[2] == "cgroup2" and v2 is None:
            v2 = Path(parts[1])
    return v1, v2


def _ancestors(mount: Path, relative: str) -> list[Path]:
    """``mount/relative`` and each parent directory up to ``mount``, innermost first."""
    parts = [p for p in relative.split("/") if p and p not in (".", "..")]
    return [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def read_cpu_quota(
    proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
    proc_mounts: str | os.PathLike[str] = "/proc/mounts",
    environ: Mapping[str, str] | None = None,
) -> CpuQuota | None:
    """This process's tightest CFS quota, or None where there is none (or it cannot be read).

    ``DEEPCEE_CPU_MAX`` in ``environ`` (``os.environ`` by default) wins when set. A value that
    cannot be read is an error rather than a silent "no quota".
    ``proc_cgroup`` and ``proc_mounts`` are the kernel's files; tests pass their own.
    """
    text = (os.environ if environ is None else environ).get(CPU_MAX_ENV, "").strip()
    if text:
        quota = _parse_cpu_max(text)
        if quota is None and not text.startswith("max"):
            raise ValueError(
                f"{CPU_MAX_ENV}={text!r}: expected '<quota_us> <period_us>' as in cgroup v2's "
                "cpu.max, e.g. '48000 100000' for 0.48 of a core in 100 ms periods, or "
                "'max 100000' for none"
            )
        return quota
    v1_mount, v2_mount = _mounts(Path(proc_mounts))
    best: CpuQuota | None = None
    for line in (_read(Path(proc_cgroup)) or "").splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, relative = fields
        if controllers == "" and v2_mount is not None:
            directories, reader = _ancestors(v2_mount, relative), _v2_limit
        elif "cpu" in controllers.split(",") and v1_mount is not None:
            directories, reader = _ancestors(v1_mount, relative), _v1_limit
        else:
            continue
        for directory in directories:
            limit = reader(directory)
            if limit is not None and (best is None or limit.cores < best.cores):
                best = limit
    if best is None or not math.isfinite(best.cores):
        return None
    return best
