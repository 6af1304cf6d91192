"""The slow response in one process: observed profile, the re-plan choice, the callback's routing
and ``DeepCEEStrategy.check_plan`` (what ``apply_plan`` refuses before anything moves)."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from torch import nn

from lightning_deepcee import DeepCEEStrategy, DynamicEnvironmentAdapter, PipelineSpec
from lightning_deepcee.adapter import (
    LinkFigure,
    LinkMonitor,
    LinkObservation,
    MonitorConfig,
    ReplanChoice,
    SharedLink,
    choose_replan,
    figure_from_decision,
    figures_from_decision,
    link_figures,
    observed_profile,
)
from lightning_deepcee.adapter.search_process import SearchProcess
from lightning_deepcee.callbacks import replanner as replanning
from lightning_deepcee.planner import Plan, StagePlan, plan_search, predict_plan
from lightning_deepcee.profiler import ClusterProfile, DeviceProfile
from lightning_deepcee.runtime import build_stage
from lightning_deepcee.runtime.measure import model_fingerprint
from tests.helpers.plans import hand_plan


def _profile(n: int = 3, bandwidth: float = 1e8) -> ClusterProfile:
    seconds = (1e-2,) * 6
    devices = tuple(
        DeviceProfile(
            rank=r, host=f"h{r}", kind="cpu", memory_bytes=2**34, forward_s=seconds,
            backward_input_s=seconds, backward_weight_s=tuple(2 * t for t in seconds),
            activation_bytes=(64,) * 6, parameter_bytes=(1088,) * 6, reference_microbatch_size=5,
            capability=1.0,
        )
        for r in range(n)
    )  # fmt: skip
    return ClusterProfile(
        devices=devices,
        latency_s=[[0.0 if i == j else 1e-4 for j in range(n)] for i in range(n)],
        bandwidth_bytes_per_s=[
            [math.inf if i == j else bandwidth for j in range(n)] for i in range(n)
        ],
        num_blocks=6,
        model_fingerprint="model",
        cluster_fingerprint="cluster",
    )  # fmt: skip


def _figure(
    link: tuple[int, int], expected: float, measured: float | None, state: Any
) -> LinkFigure:
    return LinkFigure(
        link=link, expected_bandwidth=expected, measured_bandwidth=measured, state=state
    )


# --------------------------------------------------------------------------- observed profile


def test_a_degraded_link_is_rescaled_both_ways_unless_the_reverse_is_observed() -> None:
    profile = _profile()
    # Calibrated at 2 MB/s, now 1 MB/s: half of the profile's figure, whatever its scale.
    updated, changes = observed_profile(profile, [_figure((0, 1), 2e6, 1e6, "degraded")])
    bw = updated.bandwidth_bytes_per_s
    assert bw[0][1] == pytest.approx(5e7) and bw[1][0] == pytest.approx(5e7)  # reverse: assumed
    assert changes == {(0, 1): (1e8, 5e7), (1, 0): (1e8, 5e7)}
    untouched = [(i, j) for i in range(3) for j in range(3) if i != j and {i, j} != {0, 1}]
    assert all(bw[i][j] == 1e8 for i, j in untouched)
    assert profile.bandwidth_bytes_per_s[0][1] == 1e8  # the input is not modified

    # The reverse watched and normal: it keeps its figure.
    figures = [_figure((0, 1), 2e6, 1e6, "degraded"), _figure((1, 0), 2e6, 2.1e6, "normal")]
    updated, changes = observed_profile(profile, figures)
    assert updated.bandwidth_bytes_per_s[1][0] == 1e8 and set(changes) == {(0, 1)}

    # The reverse still normal but reading under 1 / slow_threshold (changing, its state not
    # caught up): its own ratio; one reading within it keeps its figure.
    figures = [_figure((0, 1), 2e6, 1e6, "degraded"), _figure((1, 0), 2e6, 6e5, "normal")]
    updated, changes = observed_profile(profile, figures, changing_below=1 / 1.5)
    assert updated.bandwidth_bytes_per_s[1][0] == pytest.approx(3e7)
    assert changes[(1, 0)] == (1e8, pytest.approx(3e7))
    figures = [_figure((0, 1), 2e6, 1e6, "degraded"), _figure((1, 0), 2e6, 1.4e6, "normal")]
    updated, changes = observed_profile(profile, figures, changing_below=1 / 1.5)
    assert updated.bandwidth_bytes_per_s[1][0] == 1e8 and set(changes) == {(0, 1)}

    # The reverse off its expectation too: its own ratio.
    figures = [_figure((0, 1), 2e6, 1e6, "degraded"), _figure((1, 0), 2e6, 5e5, "degraded")]
    updated, _ = observed_profile(profile, figures)
    assert updated.bandwidth_bytes_per_s[1][0] == pytest.approx(2.5e7)

    # An improved link is rescaled up; a link without a measurement says nothing.
    figures = [_figure((1, 2), 1e6, 3e6, "improved"), _figure((2, 0), 1e6, None, "degraded")]
    updated, changes = observed_profile(profile, figures)
    assert updated.bandwidth_bytes_per_s[1][2] == pytest.approx(3e8)
    assert set(changes) == {(1, 2), (2, 1)}

    with pytest.raises(ValueError, match="link 0->3 is not a link"):
        observed_profile(profile, [_figure((0, 3), 1.0, 0.5, "degraded")])


def test_a_recovering_link_rises_at_most_to_its_measured_figure() -> None:
    """After a re-plan on a slow link, the running profile holds the slow figure; when the link
    recovers, a ratio against an expectation calibrated while it was slow reads high. The
    profile measured at setup caps the rise; it never lowers a figure."""
    measured = _profile()  # 1e8 B/s everywhere, as profiled
    slow, _ = observed_profile(measured, [_figure((0, 1), 1e6, 2.5e5, "degraded")])
    assert slow.bandwidth_bytes_per_s[0][1] == pytest.approx(2.5e7)
    # Calibrated at 2.5e5 while slow, now reads 2.2e6: 8.8x, above what the link ever did.
    recovered = [_figure((0, 1), 2.5e5, 2.2e6, "improved")]
    uncapped, _ = observed_profile(slow, recovered)
    assert uncapped.bandwidth_bytes_per_s[0][1] == pytest.approx(2.2e8)
    capped, changes = observed_profile(slow, recovered, ceiling=measured)
    assert capped.bandwidth_bytes_per_s[0][1] == pytest.approx(1e8)
    assert changes[(0, 1)] == pytest.approx((2.5e7, 1e8))
    # A partial recovery stays below the ceiling; a drop is not raised to it.
    partial, _ = observed_profile(slow, [_figure((0, 1), 2.5e5, 5e5, "improved")], ceiling=measured)
    assert partial.bandwidth_bytes_per_s[0][1] == pytest.approx(5e7)
    lower, _ = observed_profile(slow, [_figure((0, 1), 2.5e5, 1e5, "degraded")], ceiling=measured)
    assert lower.bandwidth_bytes_per_s[0][1] == pytest.approx(1e7)


def test_link_figures_read_the_monitor_state_and_decisions() -> None:
    config = MonitorConfig(window=3, react_after=1, warmup_steps=0, calibration_steps=0)
    monitor = LinkMonitor({(0, 1): 1e6, (1, 2): 1e6}, None, config)
    for step in range(1, 4):
        observations = [
            LinkObservation(step, 0, 1, 1_000_000, 2.0),  # 0.5 MB/s: degraded
            LinkObservation(step, 1, 2, 1_000_000, 1.0),  # as expected
        ]
        monitor.observe(step, observations)
    figures = {f.link: f for f in link_figures(monitor.state_dict())}
    assert figures[(0, 1)].state == "degraded" and figures[(0, 1)].ratio == pytest.approx(0.5)
    assert figures[(1, 2)].state == "normal" and figures[(1, 2)].ratio == pytest.approx(1.0)
    decision = {"link": [2, 0], "old_bandwidth": 4e6, "new_bandwidth": 1e6}
    figure = figure_from_decision(decision)
    assert figure.link == (2, 0) and figure.state == "degraded" and figure.ratio == 0.25
    shared = {**decision, "pairs": [[2, 0], [2, 1]]}
    assert [f.link for f in figures_from_decision(shared)] == [(2, 0), (2, 1)]


def test_a_shared_link_gives_every_pair_its_figures_and_changes_read_conservatively() -> None:
    shared = SharedLink(name="net0->net1", pairs=((0, 2), (1, 2)), capacity=4e6)
    config = MonitorConfig(window=3, react_after=1, warmup_steps=0, calibration_steps=3)
    for factor, state, ratio in ((0.25, "degraded", 0.25), (8.0, "improved", 2.0)):
        # Calibrated at half the plan's capacity (2 MB/s), then the link changes by ``factor``.
        monitor = LinkMonitor({}, None, config, [shared])
        for step in range(9):
            rate = 2e6 * (1.0 if step < 3 else factor)
            seconds = 1e6 / (rate / 2)  # both pairs at once, each at half the link
            monitor.observe(step, [LinkObservation(step, s, 2, 10**6, seconds) for s in (0, 1)])
        figures = {f.link: f for f in link_figures(monitor.state_dict())}
        assert set(figures) == {(0, 2), (1, 2)}
        assert all(f.state == state for f in figures.values())
        # Degraded: against the calibrated 2 MB/s (a quarter). Improved: the pessimistic figure
        # (pairs one after the other: 8 MB/s) against the plan's 4 MB/s (twice), not the
        # calibration's (four times): the smaller change either way.
        assert figures[(0, 2)].ratio == pytest.approx(ratio)


# --------------------------------------------------------------------------- the choice


def test_choose_replan_moves_only_for_a_clear_gain() -> None:
    fast = _profile()
    current = plan_search(fast, num_blocks=6, global_batch_size=10)
    assert current.num_stages == 1  # data parallelism over the three devices
    slow, _ = observed_profile(fast, [_figure((0, 1), 1e8, 1e4, "degraded")])

    choice = choose_replan(slow, current, gain=0.1)
    assert choice.apply and choice.plan is not None
    assert choice.new_step_time_s is not None
    assert choice.new_step_time_s < 0.9 * choice.current_step_time_s
    assert choice.plan.stages != current.stages
    assert ReplanChoice.from_dict(choice.to_dict()) == choice

    # The same figures, a margin the gain does not reach: keep the layout.
    kept = choose_replan(slow, current, gain=0.99)
    assert not kept.apply and "below the margin 99%" in kept.reason

    # The search picks the running layout again: nothing to move.
    same = choose_replan(fast, current, gain=0.0, search=lambda *a, **k: current)
    assert not same.apply and "running layout again" in same.reason

    def infeasible(*args: Any, **kwargs: Any) -> Plan:
        raise ValueError("no candidate fits in memory")

    failed = choose_replan(slow, current, gain=0.1, search=infeasible)
    assert not failed.apply and failed.plan is None and "no candidate fits" in failed.reason
    assert ReplanChoice.from_dict(failed.to_dict()) == failed

    with pytest.raises(ValueError, match="gain must be in"):
        choose_replan(slow, current, gain=1.0)


def test_replan_gain_is_checked() -> None:
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="replan_gain"):
            DynamicEnvironmentAdapter(replan_gain=bad)


# --------------------------------------------------------------------------- the callback


def _replan_decision() -> dict[str, Any]:
    return dict(
        step=30, link=[0, 1], kind="replan", old_bandwidth=2e6, new_bandwidth=1e6,
        split_factor=1, reason="test", step_bytes=10**6, step_s=1.0,
    )  # fmt: skip


def _profiled_adapter() -> tuple[DynamicEnvironmentAdapter, DeepCEEStrategy, Any]:
    """An adapter over a profiled 3-device data-parallel plan, at step 30 (world of one)."""
    strategy = DeepCEEStrategy(schedule="1f1b", num_microbatches=2)
    strategy.cluster_profile = _profile()
    strategy.stage_part.plan = _dp_plan((0, 1, 2))
    trainer: Any = SimpleNamespace(strategy=strategy, loggers=[], global_step=30)
    adapter = DynamicEnvironmentAdapter()
    adapter.split_state.base_microbatches = 2
    return adapter, strategy, trainer


def test_a_replan_decision_reaches_the_slow_response() -> None:
    adapter, strategy, trainer = _profiled_adapter()
    adapter._decide(trainer, strategy, [_replan_decision()])  # world 1: no collective
    search = adapter.replanner.search
    assert search is not None and search.replans[0]["kind"] == "replan"
    assert adapter.decisions[-1]["kind"] == "replan-search"
    # The search runs in a child process on the searcher (rank 0: no device is idle) while
    # training goes on; every rank takes its outcome when the searcher says it is done.
    job = search.job
    assert job is not None
    outcome = job.result()
    assert job.done() and outcome["current_step_time_s"] > 0
    # A second proposal while it runs supersedes it: that search is dropped, a new one begins
    # (it plans for every figure the monitors hold, the first change's included).
    adapter._decide(trainer, strategy, [_replan_decision()])
    again = adapter.replanner.search
    assert again is not None and again is not search and again.job is not job
    assert [d["kind"] for d in adapter.decisions[-2:]] == ["replan-dropped", "replan-search"]
    assert "supersedes" in adapter.decisions[-2]["reason"]
    assert again.job.result()["current_step_time_s"] > 0
    adapter.replanner.finish(trainer, strategy)
    assert adapter.replanner.search is None
    assert adapter.decisions[-1]["kind"] in ("replan-applied", "replan-kept")


def test_a_search_is_dropped_when_the_configuration_changed_meanwhile() -> None:
    adapter, strategy, trainer = _profiled_adapter()
    adapter._decide(trainer, strategy, [_replan_decision()])
    adapter.new_monitor(strategy)  # the layout changed while the search ran (a revert)
    adapter.replanner.finish(trainer, strategy)
    assert adapter.decisions[-1]["kind"] == "replan-dropped"
    assert strategy.plan == _dp_plan((0, 1, 2))


def test_a_search_is_dropped_when_what_it_planned_for_changed_meanwhile() -> None:
    """A search that ends after the device it was for recovered is not moved to: its observed
    profile had device 2 at three times its compute, the monitors now say it is as profiled."""
    from lightning_deepcee.adapter.compute import observed_compute

    adapter, strategy, trainer = _profiled_adapter()
    adapter._decide(trainer, strategy, [_replan_decision()])
    search = adapter.replanner.search
    assert search is not None
    search.observed, _ = observed_compute(search.observed, {2: 3.0})
    adapter.replanner.finish(trainer, strategy)
    dropped = adapter.decisions[-1]
    assert dropped["kind"] == "replan-dropped" and "device 2 computing x0.33" in dropped["reason"]
    assert strategy.plan == _dp_plan((0, 1, 2))


def test_a_state_change_that_moves_no_figure_keeps_the_search() -> None:
    """A device that reads faster (it waits for another) moves no figure of the observed
    profile, whose devices are never faster than measured at setup: the search stands."""
    from lightning_deepcee.adapter.compute import ComputeMonitor

    adapter, strategy, trainer = _profiled_adapter()
    adapter._decide(trainer, strategy, [_replan_decision()])
    compute = ComputeMonitor([0, 1, 2], adapter.config)
    for step in range(40):  # device 1 reads twice as fast from step 20, the step as calibrated
        compute.observe(step, [1.0, 1.0 if step < 20 else 0.5, 1.0], 1.0)
    assert compute.signature() == [[1, "faster"]]
    adapter.compute = compute
    adapter.replanner.finish(trainer, strategy)
    assert adapter.decisions[-1]["kind"] in ("replan-applied", "replan-kept")


def test_a_failed_search_process_raises_its_error() -> None:
    job = SearchProcess({"profile": {}, "plan": {}, "gain": 0.1})
    with pytest.raises(RuntimeError, match="ValueError: devices: missing required key"):
        job.result()
    assert job.done()


def test_a_cancelled_search_process_stops() -> None:
    adapter, strategy, trainer = _profiled_adapter()
    adapter._decide(trainer, strategy, [_replan_decision()])
    job = adapter.replanner.search.job  # type: ignore[union-attr]
    adapter.on_train_end(trainer, None)  # type: ignore[arg-type]
    assert adapter.replanner.search is None and job.done()
    with pytest.raises(ProcessLookupError):
        os.kill(job.pid, 0)  # reaped, not a zombie


def test_the_search_child_paces_itself_before_it_loads_the_planner() -> None:
    """The child's entry (``python -m lightning_deepcee.adapter._paced_child``, which runs the
    package ``__init__`` first) loads only the standard library before it lowers its priority
    and paces itself: the planner's imports (numpy, scipy: over a second of CPU) come after, so
    they too keep to the share of a device's quota."""
    code = (
        "import json, sys\n"
        "import lightning_deepcee.adapter._paced_child\n"
        "heavy = ('numpy', 'scipy', 'torch', 'lightning_deepcee.planner')\n"
        "print(json.dumps([m for m in heavy if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[-2] == "[]", out.stdout + out.stderr


def test_the_search_spends_at_most_its_share_of_the_quota() -> None:
    """Under a quota of 0.5 cores the search may spend a fifth of it: 0.1 s of CPU per second."""
    code = (
        "import signal, time\n"
        "from lightning_deepcee.adapter.search_process import pace\n"
        "pace(0.5, 0.05, 0.2)\n"
        "start, cpu = time.monotonic(), time.process_time()\n"
        "while time.monotonic() - start < 1.0:\n"
        "    pass\n"
        "signal.setitimer(signal.ITIMER_PROF, 0, 0)\n"
        "print(time.process_time() - cpu)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    spent = float(out.stdout.split()[-1])
    # 0.1 s, plus at most one timer tick (the kernel counts CPU time in ticks of 1-10 ms).
    assert 0.02 < spent < 0.13, f"spent {spent:.3f} s of CPU in 1 s of busy loop"


def test_no_search_starts_when_none_can_gain_the_margin() -> None:
    """A plan's step on slower links is at least its step on setup's: when the running plan on
    the links as measured is within the margin of setup's plan on setup's, no search starts."""
    adapter, strategy, trainer = _profiled_adapter()
    observed, _ = adapter.observed(strategy, [_replan_decision()])
    running_s = predict_plan(observed, strategy.plan).step_time_s
    adapter.replanner.floor_s = running_s * 0.95  # the margin is 10%
    adapter._decide(trainer, strategy, [_replan_decision()])
    kept = adapter.decisions[-1]
    assert adapter.replanner.search is None
    assert kept["kind"] == "replan-kept" and "no plan can gain the margin 10%" in kept["reason"]
    adapter.replanner.floor_s = running_s * 0.85
    adapter._decide(trainer, strategy, [_replan_decision()])
    assert adapter.replanner.search is not None and adapter.decisions[-1]["kind"] == "replan-search"
    adapter.on_train_end(trainer, None)  # type: ignore[arg-type]


def test_the_floor_is_setups_plan_on_setups_profile_and_survives_a_resume() -> None:
    from lightning_deepcee.callbacks.replanner import _setup_floor

    adapter, strategy, _ = _profiled_adapter()
    floor = _setup_floor(strategy)
    assert floor == pytest.approx(predict_plan(strategy.cluster_profile, strategy.plan).step_time_s)
    adapter.replanner.floor_s = floor
    restored = DynamicEnvironmentAdapter()
    restored.load_state_dict(adapter.state_dict())
    assert restored.replanner.floor_s == floor
    manual = DeepCEEStrategy(schedule="1f1b", num_microbatches=2)
    manual.cluster_profile = _profile()
    manual.stage_part.plan = dataclasses.replace(_dp_plan((0, 1, 2)), notes="manual layout")
    assert _setup_floor(manual) is None  # a hand-made layout is no floor


def test_a_replan_without_a_profile_is_logged_and_skipped() -> None:
    strategy = DeepCEEStrategy(schedule="1f1b", num_microbatches=2)
    assert strategy.cluster_profile is None
    trainer: Any = SimpleNamespace(strategy=strategy, loggers=[], global_step=30)
    adapter = DynamicEnvironmentAdapter()
    adapter.split_state.base_microbatches = 2
    adapter._decide(trainer, strategy, [_replan_decision()])  # no collective on this path
    skipped = adapter.decisions[-1]
    assert skipped["kind"] == "replan-skipped" and "needs a cluster profile" in skipped["reason"]
    assert strategy.num_microbatches == 2
    # The state round-trips (resume) with the new fields.
    restored = DynamicEnvironmentAdapter()
    restored.load_state_dict(adapter.state_dict())
    assert restored.decisions == adapter.decisions and restored.replanner.replanned is None


# --------------------------------------------------------------------------- check_plan


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(6)])

    def configure_pipeline(self) -> PipelineSpec:
        return PipelineSpec(blocks=list(self.blocks), loss_fn=lambda out, batch: out.mean())


def _set_up(strategy: DeepCEEStrategy, world_size: int) -> _Net:
    """What setup leaves behind that check_plan reads, without processes."""
    assert isinstance(strategy.cluster_environment, LightningEnvironment)
    strategy.cluster_environment.set_world_size(world_size)
    model = _Net()
    strategy._lightning_module = model
    part = strategy.stage_part
    part.adopt(model)
    assert part.spec is not None
    part.stage = build_stage(model, part.spec, [(0, 6)], 0)
    return model


def _dp_plan(ranks: tuple[int, ...], blocks: int = 6, fingerprint: str | None = None) -> Plan:
    return hand_plan(
        [((0, blocks), ranks, (1 / len(ranks),) * len(ranks))],
        num_microbatches=1,
        global_batch_size=10,
        model_fingerprint=fingerprint or model_fingerprint(list(_Net().blocks)),
    )


def test_check_plan_refuses_a_plan_that_does_not_fit_before_anything_moves() -> None:
    strategy = DeepCEEStrategy(
        schedule="1f1b", num_microbatches=1, cluster_environment=LightningEnvironment()
    )
    with pytest.raises(RuntimeError, match="set-up strategy"):
        strategy.check_plan(_dp_plan((0, 1, 2)))
    _set_up(strategy, world_size=3)
    strategy.check_plan(_dp_plan((0, 1, 2)))  # fits
    with pytest.raises(ValueError, match="covers 5 blocks but the model has 6"):
        strategy.check_plan(_dp_plan((0, 1, 2), blocks=5))
    with pytest.raises(ValueError, match=r"names ranks \[0, 1\] but the world has 3 ranks"):
        strategy.check_plan(_dp_plan((0, 1)))
    with pytest.raises(ValueError, match="model structure changed"):
        strategy.check_plan(_dp_plan((0, 1, 2), fingerprint="another model"))
    with pytest.raises(TypeError, match=r"expects a lightning_deepcee\.Plan"):
        strategy.check_plan(_dp_plan((0, 1, 2)).to_dict())  # type: ignore[arg-type]


def test_check_plan_refuses_a_run_with_several_replicas() -> None:
    # One stage on three processes: three data-parallel replicas, each reading its own shard.
    environment = LightningEnvironment()
    strategy = DeepCEEStrategy(
        schedule="1f1b", num_microbatches=1, num_stages=1, cluster_environment=environment
    )
    _set_up(strategy, world_size=3)
    assert strategy.num_replicas == 3
    with pytest.raises(ValueError, match="3 data-parallel pipeline replicas"):
        strategy.check_plan(_dp_plan((0, 1, 2)))
    with pytest.raises(ValueError, match="3 data-parallel pipeline replicas"):
        strategy.current_plan()


def test_the_search_runs_on_the_fastest_idle_device() -> None:
    profile = _profile()
    busy = _dp_plan((0, 1, 2))
    assert replanning.searcher(busy, profile) == 0  # every device trains: rank 0
    speeds = {0: 5.0, 1: 1.0, 2: 3.0}
    devices = tuple(dataclasses.replace(d, capability=speeds[d.rank]) for d in profile.devices)
    faster = dataclasses.replace(profile, devices=devices)
    stage = StagePlan(block_range=(0, busy.num_blocks), ranks=(0,), batch_shares=(1.0,))
    idle = dataclasses.replace(busy, stages=(stage,), idle_ranks=(1, 2))
    assert replanning.searcher(idle, faster) == 2  # idle, and faster than idle rank 1
    assert replanning.searcher(idle, None) == 1  # no profile: the first idle rank
    # A device the come-back's compute probe times is never the searcher.
    assert replanning.searcher(idle, faster, exclude=[2]) == 1
    assert replanning.searcher(idle, faster, exclude=[1, 2]) == 0


def test_the_outcome_comes_from_the_searcher_and_its_error_is_raised_everywhere() -> None:
    sent: list[tuple[Any, int]] = []

    class Rank(SimpleNamespace):
        def broadcast(self, obj: Any, src: int = 0) -> Any:
            sent.append((obj, src))
            return {"answer": 42} if self.global_rank != src else obj

    calls: list[int] = []

    def compute() -> dict[str, Any]:
        calls.append(1)
        return {"n": 1}

    other = Rank(global_rank=1)
    outcome = replanning.on_one_rank(other, "x", compute, src=2)
    assert outcome == {"answer": 42} and calls == [] and sent[-1] == ({}, 2)  # computes nothing
    searcher = Rank(global_rank=2)
    assert replanning.on_one_rank(searcher, "x", lambda: {"answer": 7}, src=2) == {"answer": 7}
    assert sent[-1] == ({"answer": 7}, 2)
    with pytest.raises(RuntimeError, match="failed on rank 2: ZeroDivisionError"):
        replanning.on_one_rank(searcher, "x", lambda: {"v": 1 / 0}, src=2)


def test_a_rise_capped_at_the_setup_figure_starts_no_search() -> None:
    adapter, strategy, trainer = _profiled_adapter()  # 1e8 B/s between every pair
    faster = {**_replan_decision(), "old_bandwidth": 1e8, "new_bandwidth": 2e8}
    adapter._decide(trainer, strategy, [faster])
    assert adapter.replanner.search is None
    kept = adapter.decisions[-1]
    assert kept["kind"] == "replan-kept" and "change no figure" in kept["reason"]
    # A drop does change the profile: that one is searched.
    adapter._decide(trainer, strategy, [_replan_decision()])
    assert adapter.replanner.search is not None


def _clock_reference(adapter: DynamicEnvironmentAdapter, strategy: DeepCEEStrategy) -> float:
    """Steps of 1 s while the links are as profiled: the configuration's clock reference.
    Returns the model's prediction it pairs with."""
    adapter.new_monitor(strategy)
    assert adapter.monitor is not None and adapter.monitor.calibrated  # no link to calibrate
    confirm = adapter.config.window + adapter.config.react_after
    for step in range(adapter.guard.config.window + confirm):
        adapter.guard.record(step, 1.0)
        adapter.replanner.note_clock(strategy, step)
        # A candidate is the reference once the links stayed as profiled long enough for the
        # monitor to have flagged a change inside its window.
        assert bool(adapter.replanner.clock) == (step >= adapter.guard.config.window - 1 + confirm)
    ((measured, predicted),) = adapter.replanner.clock.values()
    assert measured == 1.0
    assert predicted == pytest.approx(predict_plan(_profile(), strategy.plan).step_time_s)
    return predicted


def test_the_clock_starts_a_search_the_model_alone_thinks_hopeless() -> None:
    """The model underrates what the slower link costs; the guard's steps say the running plan
    runs twice the model's figure, so a search starts and judges plans against that."""
    adapter, strategy, trainer = _profiled_adapter()
    reference = _clock_reference(adapter, strategy)
    observed, _ = adapter.observed(strategy, [_replan_decision()])
    running_s = predict_plan(observed, strategy.plan).step_time_s
    adapter.replanner.floor_s = running_s * 0.95  # the model alone: within the margin of the floor
    slower = 2 * running_s / reference  # the clock: twice the model's figure
    for step in range(30, 30 + adapter.guard.config.window):
        adapter.guard.record(step, slower)
        adapter.replanner.note_clock(strategy, step)
    assert len(adapter.replanner.clock) == 1  # one reference per configuration, taken once
    clocked = adapter.replanner.clocked_step(strategy)
    assert clocked == pytest.approx((2 * running_s, slower))
    adapter._decide(trainer, strategy, [_replan_decision()])
    search = adapter.replanner.search
    assert search is not None and adapter.decisions[-1]["kind"] == "replan-search"
    assert search.job.result()["current_step_time_s"] == pytest.approx(2 * running_s)
    adapter.on_train_end(trainer, None)  # type: ignore[arg-type]


def test_the_clock_keeps_a_plan_whose_steps_did_not_slow() -> None:
    """The model predicts the slower link costs more than the margin; the guard's steps did not
    slow at all (the transfers hide behind compute): no search starts."""
    adapter, strategy, trainer = _profiled_adapter()
    reference = _clock_reference(adapter, strategy)
    adapter.replanner.floor_s = reference  # setup's plan on setup's profile
    slow = dict(_replan_decision(), new_bandwidth=2e3)
    observed, _ = adapter.observed(strategy, [slow])
    assert predict_plan(observed, strategy.plan).step_time_s * 0.9 > reference
    adapter._decide(trainer, strategy, [slow])
    kept = adapter.decisions[-1]
    assert adapter.replanner.search is None and kept["kind"] == "replan-kept"
    assert "in the cost model's scale (measured 1000.0 ms" in kept["reason"]
    # Without the clock's reference the model alone starts a search.
    adapter.replanner.clock.clear()
    adapter._decide(trainer, strategy, [slow])
    assert adapter.replanner.search is not None and adapter.decisions[-1]["kind"] == "replan-search"
    adapter.on_train_end(trainer, None)  # type: ignore[arg-type]


def test_the_search_process_plans_with_the_strategys_device_gain() -> None:
    from lightning_deepcee.adapter.search_process import run
    from tests.helpers.clusters import two_zones

    # At 10 MB/s both zones are predicted under 20% faster than zone A alone.
    profile = two_zones(1e7)
    current = plan_search(profile, num_blocks=8, global_batch_size=32, device_gain=0.0)
    request = {"profile": profile.to_dict(), "plan": current.to_dict(), "gain": 0.1}
    kept = run({**request, "device_gain": 0.0})
    assert not kept["apply"] and "running layout again" in kept["reason"], kept["reason"]
    fewer = Plan.from_dict(run({**request, "device_gain": 0.2})["plan"])
    assert fewer.ranks == (0, 1), fewer.format_table()


def test_the_re_plan_search_takes_a_plan_near_the_running_one_without_the_whole_search(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import lightning_deepcee.planner.search as planner_search
    from lightning_deepcee.adapter.search_process import run
    from tests.helpers.clusters import two_zones

    # Planned on both zones with a fast WAN; the WAN then falls to 100 kB/s, and zone A alone
    # (a subset of the running plan's devices: its neighbourhood) pays.
    current = plan_search(two_zones(1e9), num_blocks=8, global_batch_size=32, device_gain=0.0)
    assert len(current.ranks) > 2, current.format_table()
    whole: list[object] = []
    full_search = planner_search.plan_search
    monkeypatch.setattr(
        planner_search, "plan_search", lambda *a, **k: whole.append(a) or full_search(*a, **k)
    )
    request = {"profile": two_zones(1e5).to_dict(), "plan": current.to_dict(), "gain": 0.1}
    near = run({**request, "device_gain": 0.0})
    assert near["apply"] and whole == [], near["reason"]
    assert set(Plan.from_dict(near["plan"]).ranks) <= set(current.ranks)
    # Planned on zone A alone; with a fast WAN the better plan adds zone B, which is not near
    # the running plan: the whole cluster is searched then.
    alone = plan_search(two_zones(1e5), num_blocks=8, global_batch_size=32, device_gain=0.0)
    assert set(alone.ranks) <= {0, 1}, alone.format_table()
    request = {"profile": two_zones(1e10).to_dict(), "plan": alone.to_dict(), "gain": 0.1}
    far = run({**request, "device_gain": 0.0})
    assert len(whole) == 1
    assert not far["apply"] or set(Plan.from_dict(far["plan"]).ranks) - {0, 1}, far["reason"]
