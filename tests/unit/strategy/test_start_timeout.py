"""The process group forms with a long timeout for slow starters, then runs with ``timeout_s``."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch.strategies.ddp as lightning_ddp
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator

from lightning_deepcee import DeepCEEStrategy
from lightning_deepcee._compat import default_store
from lightning_deepcee.strategy.deepcee import START_TIMEOUT_S


def _strategy(timeout_s: float) -> DeepCEEStrategy:
    return DeepCEEStrategy(
        timeout_s=timeout_s,
        accelerator=CPUAccelerator(),
        parallel_devices=[torch.device("cpu")],
        cluster_environment=LightningEnvironment(),
    )


@pytest.fixture
def _no_group() -> Iterator[None]:
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.usefixtures("_no_group")
def test_the_group_forms_with_the_start_timeout_and_runs_with_timeout_s(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    formed = {}

    def init(environment: Any, backend: str, **kwargs: Any) -> None:
        formed["timeout"] = kwargs["timeout"]
        dist.init_process_group(
            backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
            timeout=kwargs["timeout"],
        )  # fmt: skip

    monkeypatch.setattr(lightning_ddp, "_init_dist_connection", init)
    strategy = _strategy(7)
    strategy.setup_distributed()
    assert formed["timeout"] == timedelta(seconds=START_TIMEOUT_S)
    group = dist.distributed_c10d._get_default_group()
    assert group._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=7)
    assert default_store().timeout == timedelta(seconds=7)
    assert strategy._timeout == timedelta(seconds=7)


@pytest.mark.usefixtures("_no_group")
def test_a_timeout_longer_than_the_start_timeout_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    formed = {}

    def init(environment: Any, backend: str, **kwargs: Any) -> None:
        formed["timeout"] = kwargs["timeout"]  # no group: nothing to set afterwards

    monkeypatch.setattr(lightning_ddp, "_init_dist_connection", init)
    strategy = _strategy(2 * START_TIMEOUT_S)
    strategy.setup_distributed()
    assert formed["timeout"] == timedelta(seconds=2 * START_TIMEOUT_S)
    assert strategy._timeout == timedelta(seconds=2 * START_TIMEOUT_S)
