"""A tiny LightningModule and data for equivalence tests (no file named test_*, not collected)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.functional import accuracy

from lightning_deepcee import PipelineSpec


def _loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(out, batch[1])


def _accuracy(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return accuracy(out, batch[1], task="multiclass", num_classes=4)


def _metrics(out: torch.Tensor, batch: Any) -> dict[str, torch.Tensor]:
    return {"acc": _accuracy(out, batch)}


class TinyNet(pl.LightningModule):
    """An MLP of ``num_blocks`` blocks; a normal training_step plus ``configure_pipeline``.

    ``batch_norm`` puts a BatchNorm1d in the first block.
    """

    def __init__(self, num_blocks: int = 6, optimizer: str = "adamw", batch_norm: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.inp: nn.Module = nn.Linear(8, 16)
        if batch_norm:  # a batch-dependent first block
            self.inp = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16))
        self.hidden = nn.ModuleList(
            [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(num_blocks - 2)]
        )
        self.out = nn.Linear(16, 4)
        self.optimizer = optimizer

    def configure_pipeline(self) -> PipelineSpec:
        return PipelineSpec(
            blocks=[self.inp, *self.hidden, self.out], loss_fn=_loss, metrics_fn=_metrics
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.hidden:
            x = layer(x)
        return self.out(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out = self(batch[0])
        self.log("train_acc", _accuracy(out, batch), on_step=True, on_epoch=True)
        return _loss(out, batch)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out = self(batch[0])
        loss = _loss(out, batch)
        self.log("val_loss", loss)
        self.log("val_acc", _accuracy(out, batch))
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out = self(batch[0])
        loss = _loss(out, batch)
        self.log("test_loss", loss)
        self.log("test_acc", _accuracy(out, batch))
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).softmax(dim=-1)  # the module's own step after the forward

    def configure_optimizers(self) -> Any:
        if self.optimizer == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def make_loader(batch_size: int = 10, num_samples: int = 30) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(num_samples, 8, generator=g)
    y = torch.randint(0, 4, (num_samples,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)
