"""PipelineThroughputMonitor: the measured step time beside the plan's prediction, per run."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_deepcee import DeepCEEStrategy, PipelineThroughputMonitor
from lightning_deepcee.callbacks import throughput as callbacks_module
from lightning_deepcee.planner import Plan
from tests.helpers.plans import hand_plan


class _Strategy(DeepCEEStrategy):
    """A DeepCEEStrategy with no processes: gathers return this rank's figures for every stage."""

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
        return tensor.unsqueeze(0).repeat(self.num_stages, 1)


class _Logger:
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append(dict(metrics))


def _plan(predicted_s: float = 0.5) -> Plan:
    return hand_plan(
        [((0, 2), (0, 1), (0.5, 0.5)), ((2, 4), (2,), (1.0,))],
        num_microbatches=4,
        global_batch_size=16,
        predicted_step_time_s=predicted_s,
        predicted_bubble_ratio=0.1,
        predicted_peak_memory_bytes={0: 1, 1: 1, 2: 1},
        model_fingerprint="m" * 16,
        cluster_fingerprint="c" * 16,
    )


class _Run:
    """Drives the monitor's hooks step by step on a fake clock."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, plan: Plan | None) -> None:
        self.now = 0.0
        monkeypatch.setattr(callbacks_module, "time", SimpleNamespace(perf_counter=self._clock))
        self.strategy = _Strategy(schedule="1f1b", num_microbatches=4)
        self.strategy.stage_part.plan = plan
        self.logger = _Logger()
        self.trainer: Any = SimpleNamespace(
            strategy=self.strategy,
            loggers=[self.logger],
            global_step=0,
            is_global_zero=True,
            log_every_n_steps=1,
        )
        self.monitor = PipelineThroughputMonitor(window_size=10)

    def _clock(self) -> float:
        return self.now

    def step(self, seconds: float, samples: int = 16) -> dict[str, float]:
        self.monitor.on_train_batch_start(self.trainer, None, None, 0)  # type: ignore[arg-type]
        self.now += seconds
        self.strategy.step_log.samples = samples
        self.trainer.global_step += 1
        self.monitor.on_train_batch_end(self.trainer, None, None, None, 0)  # type: ignore[arg-type]
        return self.logger.rows[-1]


def test_error_compares_the_plans_prediction_with_the_steps_after_warm_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = _Run(monkeypatch, _plan(predicted_s=0.5))
    first = run.step(3.0)  # warm-up: neither the rate nor the comparison counts it
    assert "deepcee/cost_model_error" not in first and "deepcee/step_s" not in first
    run.step(0.4)
    row = run.step(0.4)
    assert row["deepcee/step_s"] == pytest.approx(0.4)
    assert row["deepcee/samples_per_s"] == pytest.approx(40.0)
    assert row["deepcee/predicted_step_s"] == pytest.approx(0.5)
    assert row["deepcee/cost_model_error"] == pytest.approx(0.5 / 0.4 - 1)  # +25%: fast run
    row = run.step(1.0)  # slower steps move the error below zero
    assert row["deepcee/cost_model_error"] == pytest.approx(0.5 / 0.6 - 1)


def test_a_split_or_a_replan_restarts_the_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    run = _Run(monkeypatch, _plan(predicted_s=0.5))
    run.step(3.0)
    run.step(0.5)
    assert run.step(0.5)["deepcee/cost_model_error"] == pytest.approx(0.0)
    # The adapter splits micro-batches: the plan no longer describes what runs.
    run.strategy.stage_part.num_microbatches = 8
    row = run.step(0.8)
    assert "deepcee/cost_model_error" not in row and "deepcee/predicted_step_s" not in row
    assert row["deepcee/step_s"] == pytest.approx(1.8 / 3)
    # Merged again: the step of the change is skipped, then only the new steps count.
    run.strategy.stage_part.num_microbatches = 4
    assert "deepcee/cost_model_error" not in run.step(2.0)
    assert run.step(0.25)["deepcee/cost_model_error"] == pytest.approx(1.0)
    # A re-plan to another prediction: compared afresh, again after one skipped step.
    run.strategy.stage_part.plan = _plan(predicted_s=0.3)
    assert "deepcee/cost_model_error" not in run.step(2.0)
    row = run.step(0.6)
    assert row["deepcee/predicted_step_s"] == pytest.approx(0.3)
    assert row["deepcee/cost_model_error"] == pytest.approx(-0.5)


def test_a_short_batch_and_a_manual_layout_are_not_compared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = _Run(monkeypatch, _plan(predicted_s=0.5))
    run.step(3.0)
    run.step(0.5)
    # The epoch's last batch holds 4 samples, not the plan's 16: its time is not the plan's.
    row = run.step(0.1, samples=4)
    assert row["deepcee/cost_model_error"] == pytest.approx(0.0)
    manual = _Run(monkeypatch, None)
    manual.step(3.0)
    row = manual.step(0.5)
    assert row["deepcee/step_s"] == pytest.approx(0.5)
    assert not any(key.startswith("deepcee/cost_model") for key in row)


def test_training_end_prints_the_comparison(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    printed: list[str] = []
    monkeypatch.setattr(callbacks_module, "rank_zero_info", printed.append)
    run = _Run(monkeypatch, _plan(predicted_s=0.5))
    run.monitor.on_train_end(run.trainer, None)  # type: ignore[arg-type]
    assert printed == []  # nothing measured yet: nothing to say
    run.step(3.0)
    run.step(0.4)
    run.monitor.on_train_end(run.trainer, None)  # type: ignore[arg-type]
    assert printed == [
        "PipelineThroughputMonitor: the plan predicted 500 ms a step, the last 1 steps took "
        "400 ms (cost-model error +25%)"
    ]
