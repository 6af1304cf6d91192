"""In-process recovery's bookkeeping: which runs may recover, and which steps are kept."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

import lightning_deepcee.strategy.recovery as recovery_module
from lightning_deepcee.strategy.recovery import InProcessRecovery
from tests.helpers.models import TinyNet


class _Stepping(TinyNet):
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)


def _host(**changes: Any) -> SimpleNamespace:
    host = dict(
        plan_arg="auto",
        num_processes=1,
        cluster_environment=TorchElasticEnvironment(),
        lightning_module=TinyNet(),
        lr_scheduler_configs=[SimpleNamespace(reduce_on_plateau=False, interval="step",
                                              frequency=1)],
    )  # fmt: skip
    host.update(changes)
    return SimpleNamespace(**host)


def _trainer(**changes: Any) -> SimpleNamespace:
    trainer = dict(checkpoint_callback=SimpleNamespace(dirpath="/ckpt"), accumulate_grad_batches=1)
    trainer.update(changes)
    return SimpleNamespace(**trainer)


@pytest.mark.parametrize(
    ("host", "trainer", "reason"),
    [
        ({}, {}, None),
        ({"plan_arg": None}, {}, "manual or a saved plan"),
        ({"num_processes": 2}, {}, "several processes per node"),
        ({"cluster_environment": SLURMEnvironment()}, {}, "SLURMEnvironment"),
        ({}, {"checkpoint_callback": None}, "no checkpoint callback"),
        ({}, {"accumulate_grad_batches": 2}, "accumulate_grad_batches"),
        ({"lightning_module": _Stepping()}, {}, "overrides optimizer_step"),
        (
            {"lr_scheduler_configs": [SimpleNamespace(reduce_on_plateau=True, interval="epoch",
                                                      frequency=1)]},
            {},
            "plateau",
        ),
        (
            {"lr_scheduler_configs": [SimpleNamespace(reduce_on_plateau=False, interval="step",
                                                      frequency=3)]},
            {},
            "frequency > 1",
        ),
    ],
)  # fmt: skip
def test_why_a_run_would_restart(host: dict, trainer: dict, reason: str | None) -> None:
    why = InProcessRecovery(True, timeout_s=60).why_not(_host(**host), _trainer(**trainer))  # type: ignore[arg-type]
    if reason is None:
        assert why is None
    else:
        assert why is not None and reason in why, why


def test_a_run_that_cannot_recover_says_so_and_keeps_no_steps(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recovery = InProcessRecovery(True, timeout_s=60)
    trainer = _trainer(accumulate_grad_batches=4, global_step=0)
    with caplog.at_level(logging.INFO):
        recovery.start(_host(), trainer, world_size=3)  # type: ignore[arg-type]
    assert not recovery.enabled
    assert "will restart the job, not recover in its processes: accumulate" in caplog.text
    recovery.note_step(0, "batch", None)
    assert recovery._steps == []


def test_steps_are_kept_from_the_save_before_the_newest() -> None:
    """The newest save may not have committed when the device goes: a replay may start at the
    one before it, so the steps since that one stay."""
    recovery = InProcessRecovery(True, timeout_s=60)
    recovery.start(_host(), _trainer(global_step=0), world_size=3)  # type: ignore[arg-type]
    assert recovery.enabled
    for step in range(12):
        if step in (5, 10):
            recovery.note_save(step)
        recovery.note_step(step, f"batch{step}", None)
    assert [s.step for s in recovery._steps] == [5, 6, 7, 8, 9, 10, 11]
    recovery.note_save(10)  # the same save again (Lightning's last checkpoint): nothing drops
    assert recovery._steps[0].step == 5


def test_past_the_byte_limit_nothing_is_kept_until_the_next_save(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A loss before the next save then restarts the job; every rank counts the same bytes
    (an idle rank's stand-in has the real batch's shapes)."""
    monkeypatch.setattr(recovery_module, "KEEP_LIMIT_BYTES", 1000)
    recovery = InProcessRecovery(True, timeout_s=60)
    recovery.start(_host(), _trainer(global_step=0), world_size=3)  # type: ignore[arg-type]
    batch = (torch.zeros(50), torch.zeros(50, dtype=torch.int64))  # 200 + 400 bytes
    recovery.note_step(0, batch, None)
    assert [s.step for s in recovery._steps] == [0]
    recovery.note_step(1, batch, lambda: batch)  # a stand-in counts the same: 1200 > 1000
    assert recovery._steps == []
    recovery.note_step(2, batch, None)  # nothing kept until the next save
    assert recovery._steps == []
    recovery.note_save(3)
    recovery.note_step(3, batch, None)
    assert [s.step for s in recovery._steps] == [3]
