"""The loaders of lightning_deepcee.runtime.loaders: stand-ins on idle ranks, resume, re-plans
mid-epoch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_deepcee.runtime.loaders import (
    StepLoader,
    TrainLoader,
    real_batch,
    stand_in_warning,
    stands_in,
)


class _Counted(Dataset[dict[str, torch.Tensor]]):
    """``num`` samples ``{"x": [i, i], "y": i}``; counts the samples read."""

    def __init__(self, num: int) -> None:
        self.num, self.reads = num, 0

    def __len__(self) -> int:
        return self.num

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.reads += 1
        return {"x": torch.full((2,), float(index)), "y": torch.tensor(index)}


class _Stream(IterableDataset[torch.Tensor]):
    def __init__(self) -> None:
        self.reads = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(10):
            self.reads += 1
            yield torch.tensor([float(i)])


class _Switch:
    """Whether the rank is idle, flipped by the test (a re-plan)."""

    def __init__(self, idle: bool) -> None:
        self.idle = idle

    def __call__(self) -> bool:
        return self.idle


def _train(data: Dataset[Any], idle: _Switch, batch_size: int = 4) -> TrainLoader:
    return TrainLoader(
        DataLoader(data, batch_size=batch_size), idle, epoch=lambda: 0, trained=lambda: 0
    )


def _ys(batch: dict[str, torch.Tensor]) -> list[int]:
    return [int(v) for v in batch["y"]]


def test_an_active_rank_reads_every_batch_as_the_loader_does() -> None:
    data = _Counted(10)
    loader = _train(data, _Switch(False))
    got = [_ys(b) for b in loader]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert data.reads == 10 and loader.reads == 10
    assert [loader.take() for _ in range(3)] == [None, None, None]


def test_an_idle_rank_reads_one_batch_and_stands_in_with_the_real_row_counts() -> None:
    data = _Counted(10)
    loader = _train(data, _Switch(True))
    batches = list(loader)
    assert [len(b["y"]) for b in batches] == [4, 4, 2]  # the short last batch too
    assert all(set(b) == {"x", "y"} for b in batches)
    assert data.reads == 4, "an idle rank read more than its one stand-in"
    assert [loader.take() for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert loader.take() is None
    list(loader)  # the next epoch keeps the stand-in
    assert data.reads == 4


def test_a_rank_made_active_mid_epoch_gets_the_real_batches() -> None:
    data = _Counted(12)
    idle = _Switch(True)
    loader = _train(data, idle)
    iterator = iter(loader)
    first, prefetched = next(iterator), next(iterator)  # Lightning fetches one batch ahead
    got, reread = real_batch(loader, first, idle.idle, lambda b: b)
    assert got is first and reread is not None  # still idle
    idle.idle = False  # a re-plan brings the rank in before the prefetched batch's step
    step, reread = real_batch(loader, prefetched, idle.idle, lambda b: b)
    assert step is not prefetched and _ys(step) == [4, 5, 6, 7] and reread is None
    rest = next(iterator)
    assert _ys(rest) == [8, 9, 10, 11]
    assert real_batch(loader, rest, idle.idle, lambda b: b) == (rest, None)
    assert data.reads == 12  # the stand-in, the re-read prefetched batch and the last


def test_an_idle_step_reads_its_real_batch_later() -> None:
    """A replay after a lost device may make an idle rank active: it reads the real rows of
    the steps it stood in for."""
    data = _Counted(12)
    idle = _Switch(True)
    loader = _train(data, idle)
    iterator = iter(loader)
    first, second = next(iterator), next(iterator)
    _, reread_first = real_batch(loader, first, idle.idle, lambda b: b)
    _, reread_second = real_batch(loader, second, idle.idle, lambda b: {**b, "moved": True})
    assert reread_first is not None and reread_second is not None
    reads = data.reads
    assert _ys(reread_second()) == [4, 5, 6, 7] and reread_second()["moved"] is True
    assert _ys(reread_first()) == [0, 1, 2, 3]
    assert data.reads == reads + 12


def test_real_batch_moves_the_batch_it_reads() -> None:
    idle = _Switch(True)
    loader = _train(_Counted(8), idle)
    iterator = iter(loader)
    stand_in = next(iterator)
    idle.idle = False
    moved, _ = real_batch([loader], stand_in, idle.idle, lambda b: {**b, "moved": True})
    assert moved["moved"] is True and _ys(moved) == [0, 1, 2, 3]


def test_a_stand_in_from_one_of_several_train_loaders_is_an_error() -> None:
    idle = _Switch(True)
    one, two = _train(_Counted(8), idle), _train(_Counted(8), idle)
    next(iter(one)), next(iter(two))
    idle.idle = False
    with pytest.raises(RuntimeError, match="2 train dataloaders"):
        real_batch({"a": one, "b": two}, None, idle.idle, lambda b: b)


@pytest.mark.parametrize("idle", [False, True])
def test_a_resumed_epoch_skips_the_trained_batches_without_reading_them_when_idle(
    idle: bool,
) -> None:
    data = _Counted(12)
    loader = _train(data, _Switch(idle))
    loader.load_state_dict({"batches_done": 2})
    batches = list(loader)
    assert len(batches) == 1
    if idle:
        assert loader.take() == [8, 9, 10, 11] and data.reads == 4
    else:
        assert _ys(batches[0]) == [8, 9, 10, 11]
    assert len(list(loader)) == 3, "the skip is for the first epoch after the resume only"


def test_the_epoch_order_is_set_before_each_iterator() -> None:
    data = _Counted(8)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, seed=0)
    epochs = iter([0, 1])
    loader = TrainLoader(
        DataLoader(data, batch_size=4, sampler=sampler),
        _Switch(True),
        epoch=lambda: next(epochs),
        trained=lambda: 0,
    )
    list(loader)
    first = [loader.take() for _ in range(2)]
    list(loader)
    second = [loader.take() for _ in range(2)]
    sampler.set_epoch(1)
    assert second == [list(sampler)[:4], list(sampler)[4:]] and first != second


def test_a_stream_cannot_stand_in_and_is_read() -> None:
    data = _Stream()
    loader = TrainLoader(
        DataLoader(data, batch_size=5), _Switch(True), epoch=lambda: 0, trained=lambda: 0
    )
    assert not stands_in(loader.loader)
    assert len(list(loader)) == 2 and data.reads == 10


def test_evaluation_loaders_stand_in_and_record_nothing() -> None:
    data = _Counted(10)
    loader = StepLoader(DataLoader(data, batch_size=4), _Switch(True))
    assert [len(b["y"]) for b in loader] == [4, 4, 2] and data.reads == 4
    assert not hasattr(loader, "take") and not hasattr(loader, "state_dict")


def test_loader_attributes_are_read_and_set_on_the_wrapped_loader() -> None:
    inner = DataLoader(_Counted(4), batch_size=2)
    loader = StepLoader(inner, _Switch(False))
    assert loader.batch_size == 2 and len(loader) == 2

    def seed(worker: int) -> None:  # what Lightning's seed_everything(workers=True) sets
        del worker

    loader.worker_init_fn = seed
    assert inner.worker_init_fn is seed


def test_setup_warns_of_user_batch_hooks_only_when_ranks_are_idle() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import LearningRateMonitor

    from lightning_deepcee.callbacks.throughput import PipelineThroughputMonitor

    class Plain(pl.LightningModule):
        pass

    class Hooked(pl.LightningModule):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            del batch, batch_idx

    class Peeks(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            del args

    ours = [LearningRateMonitor(), PipelineThroughputMonitor()]
    assert stand_in_warning((), Hooked(), [Peeks()]) is None
    assert stand_in_warning((5, 6), Plain(), ours) is None
    said = stand_in_warning((5, 6), Hooked(), [*ours, Peeks()])
    assert said is not None and "rank(s) 5, 6" in said
    assert "Hooked.on_train_batch_start" in said and "Peeks.on_train_batch_end" in said
    assert "LearningRateMonitor" not in said and "PipelineThroughputMonitor" not in said
