"""The compute monitor on synthetic streams, as the link monitor is tested: no proposal on noise,
on stalls of a minority of steps or on slow first steps; a device slowed to a third proposed on
within the window and its streak; a device that gets faster proposed on; a recovery returns to
normal without a proposal; the state survives a checkpoint; the observed profile scales the
device's times. End to end (the synthetic world of ``test_adapter_decisions``): a device slowed
to a third moves the plan, and noise moves nothing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_deepcee.adapter.compute import ComputeMonitor, compute_ratios, observed_compute
from lightning_deepcee.adapter.gate import with_microbatches
from lightning_deepcee.adapter.records import MonitorConfig
from lightning_deepcee.planner import predict_plan
from tests.helpers.adapter_world import profile_at, run_adapter, world_plan, world_profile

CONFIG = MonitorConfig()  # window 5, react_after 3, thresholds 1.5 / 1.25, warm-up 5, 10 samples


def _feed(
    monitor: ComputeMonitor, seconds: list[list[float]], start: int = 1
) -> list[tuple[int, dict]]:
    out = []
    for i, row in enumerate(seconds):
        out += [(start + i, d) for d in monitor.observe(start + i, row)]
    return out


def _stream(n: int, seed: int, noise: float = 0.2, base: float = 1.0) -> list[list[float]]:
    rng = np.random.default_rng(seed)
    return [[base * rng.uniform(1 - noise, 1 + noise), 0.0, 2.0] for _ in range(n)]


@pytest.mark.parametrize("seed", range(20))
def test_no_proposal_on_noise(seed: int) -> None:
    monitor = ComputeMonitor([0, 2], CONFIG)
    assert _feed(monitor, _stream(500, seed)) == []
    assert monitor.signature() == []


def test_no_proposal_on_slow_first_steps_or_a_minority_of_stalls() -> None:
    monitor = ComputeMonitor([0, 2], CONFIG)
    slow_start = [[5.0, 0.0, 10.0]] * 5  # the warm-up: left out
    stalls = [[3.0 if i % 3 == 0 else 1.0, 0.0, 2.0] for i in range(300)]  # a third of the steps
    assert _feed(monitor, slow_start + stalls) == []


def test_a_device_slowed_to_a_third_is_proposed_on_once() -> None:
    monitor = ComputeMonitor([0, 2], CONFIG)
    steady = [[1.0, 0.0, 2.0]] * 30
    slowed = [[3.0, 0.0, 2.0]] * 30
    proposals = _feed(monitor, steady + slowed)
    ((step, decision),) = proposals
    # The window holds only slowed samples at the 5th; the streak reaches 3 two steps later.
    assert step == 30 + 5 + 2
    assert decision["device"] == 0 and decision["kind"] == "replan"
    assert decision["ratio"] == pytest.approx(3.0) and decision["old_s"] == pytest.approx(1.0)
    assert monitor.signature() == [[0, "slowed"]]
    assert monitor.ratios() == {0: pytest.approx(3.0)}
    # Back to its figure: normal again, with no proposal.
    assert _feed(monitor, [[1.0, 0.0, 2.0]] * 20, start=61) == []
    assert monitor.signature() == [] and monitor.ratios() == {}


def test_a_device_that_gets_faster_is_proposed_on() -> None:
    monitor = ComputeMonitor([2], CONFIG)
    proposals = _feed(monitor, [[0.0, 0.0, 3.0]] * 20 + [[0.0, 0.0, 1.0]] * 20)
    ((_, decision),) = proposals
    assert decision["device"] == 2 and decision["ratio"] == pytest.approx(1 / 3)
    assert "faster" in decision["reason"]


def test_a_rank_that_does_not_train_is_not_judged() -> None:
    monitor = ComputeMonitor([0], CONFIG)
    assert _feed(monitor, [[1.0, 5.0, 0.0]] * 20 + [[1.0, 50.0, 0.0]] * 20) == []
    assert monitor.ranks == [0]


def test_the_monitor_survives_a_checkpoint() -> None:
    monitor = ComputeMonitor([0, 2], CONFIG)
    head = [[1.0, 0.0, 2.0]] * 30 + [[3.0, 0.0, 2.0]] * 4
    tail = [[3.0, 0.0, 2.0]] * 10
    _feed(monitor, head)
    restored = ComputeMonitor([], CONFIG)
    restored.load_state_dict(json.loads(json.dumps(monitor.state_dict())))
    assert _feed(restored, tail, start=35) == _feed(monitor, tail, start=35) != []


def test_the_observed_profile_scales_the_slowed_devices_times() -> None:
    profile = world_profile()
    slowed, applied = observed_compute(profile, {2: 3.0, 0: 1.0})
    assert applied == {2: 3.0}
    device = slowed.devices[2]
    assert device.forward_s == tuple(3 * t for t in profile.devices[2].forward_s)
    assert device.backward_weight_s == tuple(3 * t for t in profile.devices[2].backward_weight_s)
    assert device.capability == pytest.approx(profile.devices[2].capability / 3)
    assert slowed.devices[0] == profile.devices[0]
    plan = world_plan()  # device 2 holds the second stage alone: its step takes longer
    assert predict_plan(slowed, plan).step_time_s > predict_plan(profile, plan).step_time_s
    with pytest.raises(ValueError, match="ratio"):
        observed_compute(profile, {1: 0.0})
    decisions = [{"device": 2, "ratio": 3.0}, {"link": [0, 2], "old_bandwidth": 1.0}]
    assert compute_ratios(decisions) == {2: 3.0}


def _slow(step: int) -> float:
    return 3.0 if step >= 60 else 1.0


def _slowed_world(step: int, strategy: Any, fraction: float) -> float:
    """The cost model's step for what runs now, with device 2 at ``_slow(step)``."""
    profile, _ = observed_compute(profile_at(fraction), {2: _slow(step)})
    running = with_microbatches(strategy.plan, strategy.num_microbatches)
    return float(predict_plan(profile, running).step_time_s)


def test_a_device_slowed_to_a_third_moves_the_plan_away_from_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = run_adapter(
        monkeypatch, 140, world=_slowed_world, compute=lambda step: [0.5, 0.5, 0.5 * _slow(step)]
    )
    (proposal,) = [d for d in run.adapter.decisions if d.get("device") is not None]
    # Window full of slowed samples at 64, the streak of 3 at 66.
    assert proposal["step"] == 66 and proposal["device"] == 2
    (applied,) = run.kinds("replan-applied")
    assert applied["step"] > 66 and "device 2 computing x3.00" in applied["reason"]
    assert [d["action"] for d in run.kinds("confirmed")] == ["replan"]
    slowed, _ = observed_compute(profile_at(1.0), {2: 3.0})
    moved = run.strategy.plan
    assert predict_plan(slowed, moved).step_time_s < predict_plan(slowed, world_plan()).step_time_s
    assert run.strategy.cluster_profile.devices[2].capability == pytest.approx(1 / 3)


def test_an_unchanged_device_moves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    run = run_adapter(monkeypatch, 200, compute=lambda step: list(rng.uniform(0.4, 0.6, 3)))
    assert [d for d in run.adapter.decisions if "device" in d] == []
    assert run.strategy.moves == []


def test_the_exchange_carries_every_ranks_compute_seconds() -> None:
    from lightning_deepcee.adapter.exchange import pack, unpack
    from lightning_deepcee.runtime.transport import TransferRecord

    pairs = [(0, 1), (1, 0)]
    # Two transfers 1 -> 0: the stamps' error comes off each (the short one to 0), not the sum.
    received = [
        TransferRecord(1, 2**20, 0.5, "recv", 0.1),
        TransferRecord(1, 2**20, 0.5, "recv", 0.004),
    ]
    parts = [
        pack(pairs, received if rank == 0 else [], rank=rank, world=2, min_bytes=1,
             step_s=1.0 + rank, count=rank, search_done=False, compute_s=0.25 * (rank + 1),
             probe_s=0.0 if rank == 0 else 0.125, stamp_error_s=0.01)
        for rank in range(2)
    ]  # fmt: skip
    summed = [a + b for a, b in zip(*parts, strict=True)]
    landed = unpack(7, pairs, 2, summed)
    assert landed.compute_s == (0.25, 0.5) and landed.probe_s == (0.0, 0.125)
    assert landed.rows == [[1, 0, 2**21, pytest.approx(0.104), pytest.approx(0.09)]]
    assert landed.slowest_s == 2.0 and landed.anyone


def test_a_device_waiting_for_a_slowed_one_is_not_read_as_faster() -> None:
    """Device 0 slows to a third and the step with it; device 2, which waits for it, computes
    in half the time (under a quota a waiting device stalls less): no proposal for device 2.
    The same reading with the step as calibrated is a device that got faster."""
    monitor = ComputeMonitor([0, 2], CONFIG)
    calm = [([1.0, 0.0, 2.0], 3.0)] * 30
    slowed = [([3.0, 0.0, 1.0], 6.0)] * 30
    proposals = [
        d for step, (row, step_s) in enumerate(calm + slowed, 1)
        for d in monitor.observe(step, row, step_s)
    ]  # fmt: skip
    assert [d["device"] for d in proposals] == [0]
    assert monitor.step_slower() and monitor.signature() == [[0, "slowed"]]
    steady = ComputeMonitor([0, 2], CONFIG)
    faster = [([1.0, 0.0, 1.0], 3.0)] * 30
    proposals = [
        d for step, (row, step_s) in enumerate(calm + faster, 1)
        for d in steady.observe(step, row, step_s)
    ]  # fmt: skip
    assert [d["device"] for d in proposals] == [2] and not steady.step_slower()


def test_no_device_is_made_faster_than_measured_at_setup() -> None:
    profile = world_profile()
    slowed, _ = observed_compute(profile, {2: 3.0})
    # On the setup profile a faster reading changes nothing ...
    same, applied = observed_compute(profile, {2: 0.5}, ceiling=profile)
    assert applied == {} and same.devices[2] == profile.devices[2]
    # ... and a device slowed in the running profile recovers at most to its setup figure.
    back, applied = observed_compute(slowed, {2: 0.2}, ceiling=profile)
    assert applied == {2: pytest.approx(1 / 3)}
    setup = sum(profile.devices[2].block_seconds)
    assert sum(back.devices[2].block_seconds) == pytest.approx(setup)
    _, applied = observed_compute(slowed, {2: 0.5}, ceiling=profile)
    assert applied == {2: 0.5}


def test_profile_drift_names_the_figures_that_moved_beyond_the_tolerance() -> None:
    from lightning_deepcee.adapter.replan import profile_drift

    profile = world_profile()
    assert profile_drift(profile, profile, 1.5) == []
    slowed, _ = observed_compute(profile, {2: 3.0})
    assert profile_drift(profile, slowed, 1.5) == ["device 2 computing x3.00"]
    assert profile_drift(profile, observed_compute(profile, {2: 1.4})[0], 1.5) == []
    matrix = [list(row) for row in profile.bandwidth_bytes_per_s]
    matrix[0][1] /= 10
    cut = dataclasses.replace(profile, bandwidth_bytes_per_s=tuple(map(tuple, matrix)))
    (line,) = profile_drift(cut, profile, 1.5)
    assert line.startswith("link 0->1 ")
    with pytest.raises(ValueError, match="tolerance"):
        profile_drift(profile, profile, 1.0)


def test_a_slowed_device_is_watched_by_its_probe_and_recovers() -> None:
    from lightning_deepcee.adapter.comeback import DeviceWatch, slowed_devices

    replans = [{"device": 2, "ratio": 3.0}, {"device": 1, "ratio": 0.5},
               {"device": 0, "ratio": 3.0}, {"link": [0, 2], "new_bandwidth": 1.0}]  # fmt: skip
    assert slowed_devices(replans) == [0, 2]  # 1 got faster; a link is no device
    watch = DeviceWatch([2], window=5, slow_threshold=1.5)
    for seconds in [2.0, 0.0, 2.5]:  # the warm-up: the move's own work, left out
        watch.observe([0.4, 0.4, seconds])
    assert watch.slowed_s(2) is None and watch.skipped == {2: 2}
    for seconds in [0.9] * 5 + [0.0] * 3:  # the calibration: the device as it was left
        watch.observe([0.4, 0.4, seconds])
    assert watch.slowed_s(2) == pytest.approx(0.9) and watch.speedup(2) is None
    for seconds in [0.8, 0.7, 0.9, 0.85, 0.2]:  # a minority of fast samples: not back
        watch.observe([0.0, 0.0, seconds])
    assert watch.recovered() == []
    for _ in range(2):
        watch.observe([0.0, 0.0, 0.3])
    assert watch.recovered() == [2] and watch.speedup(2) == pytest.approx(3.0)
    restored = DeviceWatch.from_state_dict(json.loads(json.dumps(watch.state_dict())))
    assert restored.recovered() == [2] and restored.samples == watch.samples


def test_the_compute_probe_times_its_work_in_a_thread() -> None:
    from lightning_deepcee.runtime.compute_probe import ComputeProbe

    # From 8x8 matrices the probe grows them until one product takes op_s (a few x 8^3 flops
    # never take a millisecond), so that it takes the interpreter's lock rarely.
    probe = ComputeProbe(first_s=0.01, interval_s=0.0, size=8, op_s=0.001)
    try:
        seconds = 0.0
        for _ in range(2000):
            seconds = probe.take()
            if seconds > 0:
                break
            import time

            time.sleep(0.005)
        assert seconds > 0 and probe.repeats is not None and probe.repeats >= 1
        assert 8 < probe.size <= 1024
    finally:
        assert probe.close()
    with pytest.raises(ValueError, match="first_s"):
        ComputeProbe(first_s=0.0)
    from lightning_deepcee.callbacks.comeback import start_compute_probe

    training, idle = start_compute_probe(True), start_compute_probe(False)
    try:  # a device that trains is probed less often and shorter: the probe takes its CPU
        assert training.interval_s > idle.interval_s and training.first_s < idle.first_s
    finally:
        assert training.close() and idle.close()


def test_a_probe_under_a_cpu_quota_lasts_three_of_its_periods(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning_deepcee.callbacks.comeback import start_compute_probe
    from lightning_deepcee.runtime.cpu_quota import CPU_MAX_ENV

    monkeypatch.setenv(CPU_MAX_ENV, "20000 200000")  # a tenth of a core in 200 ms periods
    training, idle = start_compute_probe(True), start_compute_probe(False)
    try:
        assert training.first_s == idle.first_s == pytest.approx(0.6)
    finally:
        assert training.close() and idle.close()


def _slow_then_back(step: int) -> float:
    return 3.0 if 60 <= step < 160 else 1.0


def test_a_device_left_idle_brings_the_plan_back_when_it_recovers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Device 2 computes three times as long from step 60 to 160: the plan moves away from it,
    its probe (its compute slot while it is idle) shows it back, and the plan left returns.
    The clock decides both moves: here the plan with device 2 runs 0.5 s a step at its full
    speed (1.5 s slowed), any plan without it 0.8 s."""

    def world(step: int, strategy: Any, fraction: float) -> float:
        uses = any(2 in stage.ranks for stage in strategy.plan.stages)
        return 0.5 * _slow_then_back(step) if uses else 0.8

    slowed = lambda step: [0.5, 0.5, 0.5 * _slow_then_back(step)]  # noqa: E731
    run = run_adapter(monkeypatch, 260, world=world, compute=slowed, probe=slowed)
    (moved,) = run.kinds("replan-applied")
    assert 60 < moved["step"] < 160
    (back,) = run.kinds("return-applied")
    assert back["step"] > 160 and "what it left is back" in back["reason"]
    assert run.strategy.plan == world_plan()
    assert [d["action"] for d in run.kinds("confirmed")] == ["replan", "return"]
    assert run.adapter.comeback.devices is None  # the probe stopped with the return


def test_the_searcher_is_never_the_device_the_probe_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device 2, slowed and left idle, is the only idle device: the searcher is rank 0, not 2."""
    run = run_adapter(
        monkeypatch, 100, world=_slowed_world, compute=lambda step: [0.5, 0.5, 0.5 * _slow(step)]
    )
    assert run.strategy.plan.idle_ranks == (2,) and run.adapter.watched_devices() == [2]
    assert run.adapter.replanner.searcher(run.strategy) == 0


def test_a_device_that_stays_slow_is_not_returned_to(monkeypatch: pytest.MonkeyPatch) -> None:
    slowed = lambda step: [0.5, 0.5, 0.5 * _slow(step)]  # noqa: E731
    run = run_adapter(monkeypatch, 260, world=_slowed_world, compute=slowed, probe=slowed)
    assert len(run.kinds("replan-applied")) == 1 and run.kinds("return-applied") == []
    assert run.adapter.comeback.devices is not None  # still watched


def _recorded() -> dict[str, Any]:
    """Compute seconds recorded on the lab under link jitter, no device changed (see "about")."""
    return json.loads((Path(__file__).parent / "data" / "compute_cee7_jitter.json").read_text())


def _proposals_from(record: dict[str, Any], start: int, config: MonitorConfig) -> list[dict]:
    """Run a fresh monitor of the recorded ranks from step index ``start`` on."""
    monitor = ComputeMonitor([0, 1, 2, 3], config)
    out = []
    for i in range(start, len(record["steps"])):
        out += monitor.observe(i, record["compute_s"][i], record["step_s"][i])
    return out


def test_no_proposal_on_compute_recorded_under_link_jitter() -> None:
    """A device under a CPU quota that mostly waits reads anywhere from its CPU time to twice
    that with nothing changed; judged against the band of its calibration, no starting point of
    the recorded run proposes anything. Judged against a single figure (a band of width zero,
    the median) the same stream proposes slowdowns from several starting points."""
    record = _recorded()
    starts = range(0, len(record["steps"]) - 40, 2)
    assert all(_proposals_from(record, s, CONFIG) == [] for s in starts)
    narrow = dataclasses.replace(CONFIG, compute_band_quantile=0.5)
    assert sum(bool(_proposals_from(record, s, narrow)) for s in starts) >= 5


def test_a_device_slowed_to_a_third_in_the_recorded_stream_is_proposed_on() -> None:
    """Every figure of rank 2 (22% of a core) three times longer from step 120 on: a lower
    bound of what losing two thirds of the quota does (it also takes the short bursts' head
    start away). The band still sees it within 25 steps, and only there."""
    record = _recorded()
    at = 120
    for row in record["compute_s"][at:]:
        row[2] *= 3
    proposals = _proposals_from(record, 0, CONFIG)
    assert proposals and {(d["device"], d["kind"]) for d in proposals} == {(2, "replan")}
    assert at + CONFIG.window - 1 <= proposals[0]["step"] <= at + 25
    assert 2.0 < proposals[0]["ratio"] < 4.5
