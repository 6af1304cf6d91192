"""What the demo models and data modules share, so that each states only what is its own.

:class:`BlockModule` is a LightningModule whose ``forward`` runs its blocks in order and whose
training and validation steps log its loss and accuracy (:class:`~lightning_deepcee.demo.ConvNet`
and :class:`~lightning_deepcee.demo.GPT`). :class:`TrainValDataModule` holds the train and
validation sets a data module's ``setup`` makes and serves them (shuffled whole batches for
training), for :class:`~lightning_deepcee.demo.SyntheticImageDataModule` and
:class:`~lightning_deepcee.demo.ShakespeareDataModule`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Generic, TypeVar

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

__all__ = ["BlockModule", "TrainValDataModule"]

_SetT = TypeVar("_SetT", bound="Dataset[Any]")


class BlockModule(pl.LightningModule):
    """Runs :meth:`sequence` in order; logs :meth:`step_loss` and :meth:`step_accuracy`."""

    val_acc_in_progress_bar: ClassVar[bool] = True
    """Whether ``val_acc`` shows in the progress bar (``val_loss`` always does)."""

    def sequence(self) -> list[nn.Module]:
        """The modules ``forward`` runs, in order (the whole model)."""
        raise NotImplementedError

    def step_loss(self, logits: torch.Tensor, batch: Any) -> torch.Tensor:
        """The loss of ``logits`` for ``batch``, a mean over the micro-batch."""
        raise NotImplementedError

    def step_accuracy(self, logits: torch.Tensor, batch: Any) -> torch.Tensor:
        """The share of ``batch``'s targets that ``logits`` predicts right."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self.sequence():
            x = module(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.step_loss(self(batch[0]), batch)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(batch[0])
        loss = self.step_loss(logits, batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        accuracy = self.step_accuracy(logits, batch)
        self.log("val_acc", accuracy, prog_bar=self.val_acc_in_progress_bar, sync_dist=True)
        return loss


class TrainValDataModule(pl.LightningDataModule, Generic[_SetT]):
    """Serves ``train_set`` and ``val_set``, which a subclass's ``setup`` makes."""

    def __init__(self, batch_size: int, num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.train_set: _SetT | None = None
        self.val_set: _SetT | None = None

    def train_dataloader(self) -> DataLoader[Any]:
        assert self.train_set is not None
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader[Any]:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)
