"""DeepCEEStrategy freezes the garbage collector's survivors for training, then unfreezes them."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator

from lightning_deepcee import DeepCEEStrategy


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_training_freezes_the_set_up_objects_and_unfreezes_them() -> None:
    strategy = DeepCEEStrategy(verbose=False)
    survivor = [object() for _ in range(100)]  # alive when training starts
    strategy.on_train_start()
    assert gc.get_freeze_count() >= len(survivor)
    frozen = gc.get_freeze_count()
    strategy.on_train_start()  # a second fit's start does not freeze twice
    assert gc.get_freeze_count() == frozen
    strategy.on_train_end()
    assert gc.get_freeze_count() == 0


def test_teardown_unfreezes_after_a_failed_fit() -> None:
    strategy = DeepCEEStrategy(
        verbose=False, accelerator=CPUAccelerator(), cluster_environment=LightningEnvironment()
    )
    strategy.on_train_start()
    assert gc.get_freeze_count() > 0
    strategy.teardown()  # training ended in an exception: no on_train_end
    assert gc.get_freeze_count() == 0


def test_freeze_gc_false_leaves_the_collector_alone() -> None:
    strategy = DeepCEEStrategy(verbose=False, freeze_gc=False)
    strategy.on_train_start()
    assert gc.get_freeze_count() == 0
    strategy.on_train_end()
