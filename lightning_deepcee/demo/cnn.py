"""A small convolutional network and a synthetic image set, for the CNN benchmark.

``ConvNet`` is a plain LightningModule (it trains with any strategy) whose
``configure_pipeline`` hands DeepCEE its blocks: a stem, ``num_blocks`` residual convolution
blocks (the channel count doubles and the image halves at every ``downsample_every``-th block)
and a pooling head. Normalisation is GroupNorm, not BatchNorm: BatchNorm's statistics depend on
how a batch is split into micro-batches, so no pipeline could match one device on the whole batch.

``SyntheticImageDataModule`` draws a fixed, learnable image set from a seed (class-dependent
low-frequency patterns plus noise): the benchmark needs identical data on every device and
nothing downloaded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset
from torchmetrics.functional import accuracy

from lightning_deepcee.demo.base import BlockModule, TrainValDataModule
from lightning_deepcee.runtime.stage import PipelineSpec

__all__ = [
    "ConvNet",
    "SyntheticImageDataModule",
    "class_accuracy",
    "class_loss",
    "synthetic_images",
]


def _groups(channels: int) -> int:
    return min(8, channels)


class _Stem(nn.Module):
    def __init__(self, in_channels: int, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, width, 3, padding=1, bias=False)
        self.norm = nn.GroupNorm(_groups(width), width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.conv(x)))


class _ResBlock(nn.Module):
    """Two 3x3 convolutions with a shortcut; ``stride=2`` halves the image, doubling channels."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(_groups(channels_out), channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(_groups(channels_out), channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Conv2d(channels_in, channels_out, 1, stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(y)) + self.shortcut(x))


class _Head(nn.Module):
    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


def class_loss(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    """Cross entropy of the labels ``batch[1]``, a mean over the micro-batch."""
    return F.cross_entropy(logits, batch[1])


def class_accuracy(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    """Share of labels ``batch[1]`` predicted right, a mean over the micro-batch."""
    return accuracy(logits, batch[1], task="multiclass", num_classes=logits.shape[-1])


class ConvNet(BlockModule):
    """Residual CNN for ``(B, C, H, W)`` images and integer labels ``(B,)``."""

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 3,
        width: int = 32,
        num_blocks: int = 10,
        downsample_every: int = 4,
        learning_rate: float = 1e-3,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if num_blocks < 1 or downsample_every < 1 or width < 1:
            raise ValueError(
                f"ConvNet: num_blocks ({num_blocks}), downsample_every ({downsample_every}) and "
                f"width ({width}) must be >= 1"
            )
        self.save_hyperparameters()
        torch.manual_seed(seed)  # identical initial weights on every process
        self.stem = _Stem(in_channels, width)
        layers, channels = [], width
        for index in range(num_blocks):
            down = index > 0 and index % downsample_every == 0
            out = channels * 2 if down else channels
            layers.append(_ResBlock(channels, out, 2 if down else 1))
            channels = out
        self.layers = nn.ModuleList(layers)
        self.head = _Head(channels, num_classes)

    def configure_pipeline(self) -> PipelineSpec:
        """The one addition DeepCEEStrategy needs: stem, residual blocks, head."""
        return PipelineSpec(
            blocks=self.sequence(),
            loss_fn=class_loss,
            # Logged as train_acc / val_acc, as validation_step logs it in one process.
            metrics_fn=lambda logits, batch: {"acc": class_accuracy(logits, batch)},
        )

    def sequence(self) -> list[nn.Module]:
        return [self.stem, *self.layers, self.head]

    def step_loss(self, logits: torch.Tensor, batch: Any) -> torch.Tensor:
        return class_loss(logits, batch)

    def step_accuracy(self, logits: torch.Tensor, batch: Any) -> torch.Tensor:
        return class_accuracy(logits, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["learning_rate"])


def synthetic_images(
    num_samples: int,
    *,
    image_size: int = 32,
    channels: int = 3,
    num_classes: int = 10,
    noise: float = 1.0,
    seed: int = 0,
) -> TensorDataset:
    """``num_samples`` images: each class a fixed smooth pattern, plus Gaussian noise.

    The same ``seed`` gives the same images and labels on every process.
    """
    if num_samples < 1 or image_size < 4 or num_classes < 2:
        raise ValueError(
            f"synthetic_images: need num_samples >= 1, image_size >= 4 and num_classes >= 2, got "
            f"{num_samples}, {image_size}, {num_classes}"
        )
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(num_classes, channels, 4, 4, generator=g)
    patterns = F.interpolate(coarse, size=(image_size, image_size), mode="bilinear")
    labels = torch.randint(0, num_classes, (num_samples,), generator=g)
    images = patterns[labels] + noise * torch.randn(
        num_samples, channels, image_size, image_size, generator=g
    )
    return TensorDataset(images, labels)


class SyntheticImageDataModule(TrainValDataModule[TensorDataset]):
    """Train and validation splits of :func:`synthetic_images` (different seeds)."""

    def __init__(
        self,
        batch_size: int = 32,
        num_train: int = 4096,
        num_val: int = 512,
        image_size: int = 32,
        num_classes: int = 10,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size)
        self.num_train = num_train
        self.num_val = num_val
        self.image_size = image_size
        self.num_classes = num_classes
        self.seed = seed

    def setup(self, stage: str | None = None) -> None:
        options = dict(image_size=self.image_size, num_classes=self.num_classes)
        self.train_set = synthetic_images(self.num_train, seed=self.seed, **options)
        # Same class patterns (same seed for them), fresh noise and labels.
        val = synthetic_images(self.num_train + self.num_val, seed=self.seed, **options)
        self.val_set = TensorDataset(*(t[self.num_train :] for t in val.tensors))
