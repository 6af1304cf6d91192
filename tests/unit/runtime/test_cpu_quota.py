"""Unit tests of reading the process's CFS quota (cgroup v1 and v2) and recording it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_deepcee.lab import runner
from lightning_deepcee.runtime.cpu_quota import CPU_MAX_ENV, CpuQuota, read_cpu_quota
from lightning_deepcee.runtime.measure import cluster as measure


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _v1(tmp_path: Path, cgroup: str, limits: dict[str, tuple[int, int]]) -> tuple[Path, Path]:
    """A cgroup v1 ``cpu,cpuacct`` hierarchy under tmp_path with the given (quota, period) in us."""
    mount = tmp_path / "cpu,cpuacct"
    for relative, (quota, period) in limits.items():
        directory = mount / relative.strip("/") if relative.strip("/") else mount
        _write(directory / "cpu.cfs_quota_us", f"{quota}\n")
        _write(directory / "cpu.cfs_period_us", f"{period}\n")
    mounts = tmp_path / "mounts"
    _write(
        mounts,
        f"proc /proc proc rw 0 0\ncgroup {mount} cgroup rw,nosuid,cpu,cpuacct 0 0\n"
        f"cgroup {tmp_path / 'memory'} cgroup rw,memory 0 0\n",
    )
    proc = tmp_path / "cgroup"
    _write(proc, f"4:memory:/other\n2:cpu,cpuacct:{cgroup}\n0::/\n")
    return proc, mounts


def test_v1_quota_of_the_process_cgroup(tmp_path: Path) -> None:
    proc, mounts = _v1(tmp_path, "/lab/end0", {"/": (-1, 100000), "/lab/end0": (24000, 100000)})
    assert read_cpu_quota(proc, mounts) == CpuQuota(cores=0.24, period_s=0.1)


def test_the_tightest_ancestor_wins(tmp_path: Path) -> None:
    proc, mounts = _v1(
        tmp_path, "/lab/end0", {"/lab": (10000, 10000 * 10), "/lab/end0": (48000, 100000)}
    )
    assert read_cpu_quota(proc, mounts) == CpuQuota(cores=0.1, period_s=0.1)


def test_no_limit_reads_as_none(tmp_path: Path) -> None:
    proc, mounts = _v1(tmp_path, "/", {"/": (-1, 100000)})
    assert read_cpu_quota(proc, mounts) is None
    assert read_cpu_quota(tmp_path / "missing", tmp_path / "missing") is None


def test_v2_cpu_max(tmp_path: Path) -> None:
    mount = tmp_path / "unified"
    _write(mount / "pod" / "cpu.max", "max 100000\n")
    _write(mount / "pod" / "worker" / "cpu.max", "150000 100000\n")
    mounts = tmp_path / "mounts"
    _write(mounts, f"cgroup2 {mount} cgroup2 rw,nosuid 0 0\n")
    proc = tmp_path / "cgroup"
    _write(proc, "0::/pod/worker\n")
    assert read_cpu_quota(proc, mounts) == CpuQuota(cores=1.5, period_s=0.1)
    _write(mount / "pod" / "worker" / "cpu.max", "max 100000\n")
    assert read_cpu_quota(proc, mounts) is None


def test_environment_wins_over_the_cgroup_files(tmp_path: Path) -> None:
    proc, mounts = _v1(tmp_path, "/lab/end0", {"/lab/end0": (24000, 100000)})
    env = {CPU_MAX_ENV: "12000 10000"}
    assert read_cpu_quota(proc, mounts, env) == CpuQuota(cores=1.2, period_s=0.01)
    assert read_cpu_quota(proc, mounts, {CPU_MAX_ENV: "max 100000"}) is None
    assert read_cpu_quota(proc, mounts, {CPU_MAX_ENV: " "}) == CpuQuota(cores=0.24, period_s=0.1)
    with pytest.raises(ValueError, match="DEEPCEE_CPU_MAX='half a core'"):
        read_cpu_quota(proc, mounts, {CPU_MAX_ENV: "half a core"})


def test_the_lab_hands_each_device_its_quota() -> None:
    env = runner.device_env(
        {},
        device="end0",
        region="end",
        rank=4,
        world_size=6,
        master_addr="10.0.0.1",
        master_port=29500,
        interface="end0-eth0",
        cpu_max="12000 100000",
    )
    assert read_cpu_quota(environ=env) == CpuQuota(cores=0.12, period_s=0.1)


def test_profile_records_the_share_of_the_compute_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(measure, "read_cpu_quota", lambda: CpuQuota(cores=0.48, period_s=0.1))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert measure._cpu_quota(cpu) == (0.48, 0.1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert measure._cpu_quota(cpu) == (0.24, 0.1)
    # A quota the threads cannot exceed, no quota, and a GPU's compute: nothing is modelled.
    monkeypatch.setattr(measure, "read_cpu_quota", lambda: CpuQuota(cores=4.0, period_s=0.1))
    assert measure._cpu_quota(cpu) == (1.0, 0.0)
    monkeypatch.setattr(measure, "read_cpu_quota", lambda: None)
    assert measure._cpu_quota(cpu) == (1.0, 0.0)
    monkeypatch.setattr(measure, "read_cpu_quota", lambda: CpuQuota(cores=0.48, period_s=0.1))
    assert measure._cpu_quota(torch.device("cuda", 0)) == (1.0, 0.0)


def test_device_profile_carries_the_gathered_quota() -> None:
    timings = measure.BlockTimings(
        forward_s=(0.01,),
        backward_input_s=(0.02,),
        backward_weight_s=(0.01,),
        activation_bytes=(64,),
        parameter_bytes=(256,),
        microbatch_size=4,
    )
    record = {"kind": "end", "memory_bytes": 2**30, "timings": timings, "cpu_quota": (0.12, 0.1)}
    device = measure._device_profile(3, "end0", record)
    assert (device.cpu_share, device.cpu_period_s, device.has_cpu_quota) == (0.12, 0.1, True)
    del record["cpu_quota"]  # no quota gathered: none modelled
    assert not measure._device_profile(3, "end0", record).has_cpu_quota
