"""Per-device block timings cache: a restart re-measures only devices it has not seen.

One process (a one-rank gloo group); ``measure_blocks`` is counted, not mocked away.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_deepcee.runtime.measure import cluster

MEASURE = cluster.measure_blocks


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _profile(
    cache: Path | None,
    monkeypatch: pytest.MonkeyPatch,
    calls: list[int],
    lines: list[str] | None = None,
) -> float:
    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return MEASURE(*args, **kwargs)

    monkeypatch.setattr(cluster, "measure_blocks", counted)
    torch.manual_seed(0)
    blocks = [nn.Linear(8, 8), nn.Linear(8, 4)]
    profile = cluster.profile_cluster(
        blocks,
        torch.randn(4, 8),
        repeats=1,
        warmup=0,
        rounds=1,
        device_cache=cache,
        progress=None if lines is None else lines.append,
    )
    return profile.devices[0].forward_s[0]


def test_a_device_reuses_its_own_timings(
    one_rank: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setenv("DEEPCEE_DEVICE", "edge7")
    first = _profile(tmp_path, monkeypatch, calls)
    # The device's block timings, and rank 0's link figures.
    assert len(calls) == 1 and sorted(p.name[:6] for p in tmp_path.iterdir()) == [
        "edge7-",
        "links-",
    ]
    again = _profile(tmp_path, monkeypatch, calls)
    assert len(calls) == 1 and again == first  # read back, not measured
    monkeypatch.setenv("DEEPCEE_DEVICE", "edge8")  # another device: measured
    _profile(tmp_path, monkeypatch, calls)
    assert len(calls) == 2
    for path in tmp_path.iterdir():  # an unreadable entry is measured again, never trusted
        path.write_text("{not json")
    _profile(tmp_path, monkeypatch, calls)
    assert len(calls) == 3
    _profile(None, monkeypatch, calls)  # no cache: always measured
    assert len(calls) == 4


def test_the_console_names_the_devices_whose_timings_were_kept_and_their_age(
    one_rank: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setenv("DEEPCEE_DEVICE", "edge7")
    measured: list[str] = []
    _profile(tmp_path, monkeypatch, calls, measured)
    assert not any("kept" in line for line in measured)
    kept: list[str] = []
    _profile(tmp_path, monkeypatch, calls, kept)
    assert len(calls) == 1
    (line,) = [line for line in kept if "block timings kept" in line]
    assert "on 1 of 1 devices: edge7 (rank 0)" in line and " s old" in line
    (line,) = [line for line in kept if "links kept" in line]  # one device: nothing to probe
    assert " s old" in line and "not measured again" in line


def test_kept_line_says_how_old_each_kept_figure_is() -> None:
    hosts = ["cloud0", "edge0", "end0"]
    line = cluster.kept_line([None, 150.0, 3 * 86400.0], hosts)
    assert "on 2 of 3 devices: edge0 (rank 1) 2.5 min old, end0 (rank 2) 3.0 d old" in line
    assert cluster.kept_line([None, None, None], hosts) == ""
