"""measure_network / profile_cluster over gloo on loopback: same matrices everywhere, sane values,
N-1 (even) or N (odd) rounds, YAML round trip, cache reuse, and a budget that fails on every rank.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_deepcee.profiler import ClusterProfile
from lightning_deepcee.runtime.measure import (
    ProfilingTimeoutError,
    measure_network,
    profile_cluster,
    profile_or_load,
    round_robin_rounds,
)

pytestmark = pytest.mark.multiprocess


def _worker(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    result: dict[str, object] = {}
    start = time.perf_counter()
    network = measure_network()  # the defaults
    result["network_wall_s"] = time.perf_counter() - start
    result["latency_s"] = [list(row) for row in network.latency_s]
    result["bandwidth"] = [[repr(v) for v in row] for row in network.bandwidth_bytes_per_s]
    result["num_rounds"] = network.num_rounds

    torch.manual_seed(0)
    blocks = [nn.Linear(6, 16), nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 3)]
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    options = {
        "loss_fn": lambda out, batch: nn.functional.cross_entropy(out, batch[1]),
        "sample_batch": (x, y),
        "repeats": 2,
        "warmup": 1,
        "large_bytes": 2**20,
        "network_repeats": 2,
    }
    profile = profile_cluster(blocks, x, **options)  # type: ignore[arg-type]
    profile.to_yaml(Path(out) / f"profile{rank}.yaml")
    result["roundtrip"] = ClusterProfile.from_yaml(Path(out) / f"profile{rank}.yaml") == profile

    cache = Path(out) / "cache" / "profile.yaml"
    first = profile_or_load(cache, blocks, x, **options)
    second = profile_or_load(cache, blocks, x, **options)
    result["cache_reused"] = second == first and cache.exists()

    # Kept link figures: only the probes run, and the figures come back while they agree.
    base = measure_network(large_bytes=2**20, repeats=1)
    same = measure_network(large_bytes=2**20, repeats=1, kept=base, kept_tolerance=1e9)
    # Kept figures that put rank 0 behind a slow link: the check measures it, and finds it fast.
    behind = dataclasses.replace(
        base,
        bandwidth_bytes_per_s=tuple(
            tuple(v if i == j or 0 not in (i, j) else 1e4 for j, v in enumerate(row))
            for i, row in enumerate(base.bandwidth_bytes_per_s)
        ),
    )
    again = measure_network(large_bytes=2**20, repeats=1, kept=behind)
    result["links_kept"] = [
        same.kept,
        same.latency_s == base.latency_s
        and same.bandwidth_bytes_per_s == base.bandwidth_bytes_per_s,
        same.num_rounds < base.num_rounds,
        again.kept,
        again.num_rounds > same.num_rounds,  # measured after its probes
    ]
    lines: list[str] = []
    kept_dir = Path(out) / "devices"
    profile_cluster(blocks, x, device_cache=kept_dir, progress=lines.append, **options)  # type: ignore[arg-type]
    profile_cluster(blocks, x, device_cache=kept_dir, progress=lines.append, **options)  # type: ignore[arg-type]
    result["kept_lines"] = [line for line in lines if "kept" in line or "again" in line]
    result["links_files"] = len(list(kept_dir.glob("links-*.json")))

    try:
        measure_network(budget_s=1e-6, large_bytes=4096)
        result["timeout"] = None
    except ProfilingTimeoutError as exc:
        result["timeout"] = str(exc)
    (Path(out) / f"result{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [3, 4])
def test_measure_network_and_profile_cluster(
    tmp_path: Path, world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    init = f"file://{tmp_path / 'store'}"
    mp.spawn(_worker, args=(world, init, str(tmp_path)), nprocs=world, join=True)
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(world)]

    for r in results[1:]:
        assert r["latency_s"] == results[0]["latency_s"]
        assert r["bandwidth"] == results[0]["bandwidth"]
    latency = results[0]["latency_s"]
    bandwidth = [[float(v) for v in row] for row in results[0]["bandwidth"]]
    for i in range(world):
        for j in range(world):
            if i == j:
                assert latency[i][j] == 0 and bandwidth[i][j] == math.inf
            else:
                assert 0 < latency[i][j] < 1
                assert math.isfinite(bandwidth[i][j]) and bandwidth[i][j] > 10e6  # loopback
    # The probe rounds, then the measured ones: the same rounds for pairs inside a network group
    # (loopback is normally one), one round per measured pair across groups (the probes of
    # processes on two busy cores can differ enough to split them).
    probe = world if world % 2 else world - 1
    pairs = world * (world - 1) // 2
    assert all(probe < r["num_rounds"] <= probe + pairs for r in results)
    assert all(r["network_wall_s"] < 30 for r in results)
    print(f"measure_network defaults, {world} ranks: {results[0]['network_wall_s']:.3f} s")

    profiles = [ClusterProfile.from_yaml(tmp_path / f"profile{r}.yaml") for r in range(world)]
    assert all(p == profiles[0] for p in profiles)
    assert profiles[0].num_devices == world and profiles[0].num_blocks == 3
    assert [d.rank for d in profiles[0].devices] == list(range(world))
    assert profiles[0].devices[0].activation_bytes == (64, 64, 12)
    assert all(r["roundtrip"] and r["cache_reused"] for r in results)
    assert all(r["links_kept"] == [True, True, True, False, True] for r in results)
    # The second profile with a device cache keeps every device's block timings and offers
    # rank 0's link figures (kept or measured again, as the probes on two busy cores decide).
    lines = results[0]["kept_lines"]
    assert len(lines) == 2 and "block timings kept" in lines[0], lines
    assert "links kept" in lines[1] or "links measured again" in lines[1], lines
    assert results[0]["links_files"] == 1 and all(not r["kept_lines"] for r in results[1:])

    for rank, r in enumerate(results):
        message = r["timeout"]
        assert message is not None, f"rank {rank} did not raise ProfilingTimeoutError"
        assert "budget_s=1e-06" in message and "round 1 of" in message
        low, high = round_robin_rounds(world)[0][0]  # the first pair of round 1 ran out
        assert f"rank {low} <-> rank {high}" in message


def _silent_peer_worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    if rank == 1:  # a device that never answers
        time.sleep(3)
        os._exit(0)
    try:
        measure_network(op_timeout_s=0.5, hosts=["cloud-0", "edge-1"])
        message = "no error"
    except ProfilingTimeoutError as exc:
        message = str(exc)
    (Path(out) / "silent.txt").write_text(message)
    os._exit(0)  # the group is broken; skip destroy_process_group


def test_silent_peer_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    init = f"file://{tmp_path / 'store'}"
    mp.spawn(_silent_peer_worker, args=(init, str(tmp_path)), nprocs=2, join=True)
    message = (tmp_path / "silent.txt").read_text()
    assert "rank 0 (cloud-0): could not send to rank 1 (edge-1)" in message, message


class _Slow(nn.Module):
    """A block whose forward sleeps: a device whose block timings take longer than the timeout."""

    def __init__(self, sleep_s: float) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.sleep_s = sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.sleep_s)
        return self.linear(x)


def _slow_rank_worker(rank: int, world: int, init: str, out: str) -> None:
    from datetime import timedelta

    from lightning_deepcee.runtime.liveness import (
        DeviceLostError,
        Heartbeat,
        default_store,
        wait_for_ranks,
    )

    torch.set_num_threads(1)
    # A 2 s timeout, as DeepCEEStrategy(timeout_s=2) would give: rank 1 measures for longer.
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=2)
    )
    store = default_store()
    beat = Heartbeat(store, rank, interval_s=0.2).start()
    result: dict[str, object] = {}
    blocks = [_Slow(1.0 if rank == 1 else 0.0), nn.Linear(4, 2)]
    start = time.perf_counter()
    profile = profile_cluster(
        blocks, torch.randn(8, 4), repeats=1, warmup=0, rounds=1, network_repeats=1,
        large_bytes=4096,
    )  # fmt: skip
    result["profile_s"] = time.perf_counter() - start
    result["forward_s"] = [sum(d.forward_s) for d in profile.devices]
    # A rank whose heartbeat stops and that never arrives is named, well before any timeout.
    if rank == 1:
        beat.stop()
        time.sleep(6.0)
    else:
        start = time.perf_counter()
        try:
            wait_for_ranks(store, rank, world, "gone", stale_s=1.0)
            result["lost"] = None
        except DeviceLostError as exc:
            result["lost"] = list(exc.lost_ranks or [])
            result["lost_after_s"] = time.perf_counter() - start
    (Path(out) / f"slow{rank}.json").write_text(json.dumps(result))
    beat.stop()


def test_profile_cluster_waits_for_a_device_slower_than_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    init = f"file://{tmp_path / 'store'}"
    mp.spawn(_slow_rank_worker, args=(2, init, str(tmp_path)), nprocs=2, join=True)
    fast, slow = (json.loads((tmp_path / f"slow{r}.json").read_text()) for r in range(2))
    # Rank 1 timed its blocks for several times the 2 s timeout; rank 0 waited and both agree.
    assert slow["profile_s"] > 4.0 and fast["profile_s"] > 4.0, (fast, slow)
    assert fast["forward_s"] == slow["forward_s"] and slow["forward_s"][1] > 0.9
    assert fast["lost"] == [1] and fast["lost_after_s"] < 5.0, fast
