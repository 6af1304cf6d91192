"""ResNet-18 with BatchNorm trained as a pipeline on CIFAR-like 32x32 images (synthetic).

    python examples/resnet18.py fit                                 # 2 CPU processes, DeepCEE
    python examples/resnet18.py fit --trainer.devices=3 --model.width=32
    python examples/resnet18.py fit --trainer.strategy=ddp          # any other strategy

The network is ``torchvision.models.resnet18`` when torchvision imports (and ``width`` is its
64), else :class:`ResNet`, a copy with the same modules, parameter names and initialisation, so
``state_dict``s are interchangeable. ``ResNet18Classifier`` puts the network's modules directly
on the LightningModule: its ``state_dict`` loads into ``torchvision.models.resnet18()`` as is.
The pipeline blocks are those modules in execution order: ``conv1``, ``bn1``, ``relu``,
``maxpool`` (the stem; the parameter-free ones stay with a neighbour), each ``BasicBlock`` of
``layer1`` .. ``layer4``, ``avgpool`` (which also flattens) and ``fc``.

BatchNorm normalises over the samples it sees, so the pipeline equals one device on the whole
batch only with ``num_microbatches=1`` and one device per stage (setup warns otherwise; see
docs/model_contract.md): the default strategy here is ``DeepCEEStrategy(num_microbatches=1)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn

import lightning_deepcee  # noqa: F401  (registers strategy="deepcee")
from lightning_deepcee import PipelineSpec
from lightning_deepcee.demo import SyntheticImageDataModule, class_accuracy, class_loss

__all__ = ["BasicBlock", "ResNet", "ResNet18Classifier", "main", "resnet18", "torchvision_resnet18"]


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """3x3 convolution with padding, no bias (torchvision's)."""
    return nn.Conv2d(in_planes, out_planes, 3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """1x1 convolution, no bias (torchvision's)."""
    return nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """torchvision's ``BasicBlock``: two 3x3 convolutions with BatchNorm and a shortcut."""

    expansion = 1

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ``ResNet`` for ``BasicBlock`` (same names, construction order and init).

    ``width`` is the first stage's channel count (64 in torchvision); later stages double it.
    """

    def __init__(self, layers: list[int], num_classes: int = 1000, width: int = 64) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * BasicBlock.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * BasicBlock.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * BasicBlock.expansion, stride),
                nn.BatchNorm2d(planes * BasicBlock.expansion),
            )
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * BasicBlock.expansion
        layers += [BasicBlock(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def torchvision_resnet18() -> Callable[..., nn.Module] | None:
    """``torchvision.models.resnet18``, or None when torchvision does not import.

    The PyPI torchvision wheel for a CPU-only torch can be a CUDA build that fails to import
    (a missing ``libc10_cuda.so``), hence any exception, not only ImportError.
    """
    try:
        from torchvision.models import resnet18 as tv_resnet18
    except Exception:
        return None
    return tv_resnet18


def resnet18(num_classes: int = 1000, width: int = 64) -> nn.Module:
    """torchvision's ResNet-18 when available and ``width == 64``, else :class:`ResNet`."""
    tv_resnet18 = torchvision_resnet18() if width == 64 else None
    if tv_resnet18 is not None:
        return tv_resnet18(num_classes=num_classes)
    return ResNet([2, 2, 2, 2], num_classes=num_classes, width=width)


class GlobalAvgPoolFlatten(nn.AdaptiveAvgPool2d):
    """``avgpool`` as a block: pools to 1x1 and flattens to ``(B, C)`` (no state).

    Flattening a 2-D tensor again is a no-op, so the unsplit network's own forward still works.
    """

    def __init__(self) -> None:
        super().__init__((1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(super().forward(x), 1)


class ResNet18Classifier(pl.LightningModule):
    """ResNet-18 for ``(B, 3, H, W)`` images and integer labels ``(B,)``.

    Args:
        num_classes: size of ``fc``'s output.
        width: channels of the first stage (64 is torchvision's ResNet-18; smaller is faster).
        learning_rate, weight_decay: AdamW settings.
        seed: the initial weights, identical on every process.
    """

    # The network's children, set in __init__ under torchvision's names.
    conv1: nn.Conv2d
    bn1: nn.BatchNorm2d
    relu: nn.Module
    maxpool: nn.Module
    layer1: nn.Sequential
    layer2: nn.Sequential
    layer3: nn.Sequential
    layer4: nn.Sequential
    avgpool: nn.Module
    fc: nn.Linear

    def __init__(
        self,
        num_classes: int = 10,
        width: int = 64,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)  # identical initial weights on every process
        net = resnet18(num_classes=num_classes, width=width)
        for name, child in net.named_children():
            self.add_module(name, child)
        # The stem's ReLU must not work in place: as the first block of a stage it would
        # modify the received activation, a leaf that requires grad. No state changes.
        self.relu = nn.ReLU()
        self.avgpool = GlobalAvgPoolFlatten()

    def configure_pipeline(self) -> PipelineSpec:
        """The stem's modules, each BasicBlock, pooling and ``fc``, and the loss."""
        stem = [self.conv1, self.bn1, self.relu, self.maxpool]
        return PipelineSpec(
            blocks=[*stem, *self.residual_blocks(), self.avgpool, self.fc],
            loss_fn=class_loss,
            # Logged as train_acc / val_acc, as validation_step logs it under other strategies.
            metrics_fn=lambda logits, batch: {"acc": class_accuracy(logits, batch)},
        )

    def residual_blocks(self) -> list[nn.Module]:
        """The BasicBlocks of ``layer1`` .. ``layer4`` in order."""
        layers = (self.layer1, self.layer2, self.layer3, self.layer4)
        return [block for layer in layers for block in layer]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, num_classes)``: the blocks in order, what the pipeline runs."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for block in self.residual_blocks():
            x = block(x)
        return self.fc(self.avgpool(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(batch[0])
        loss = class_loss(logits, batch)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=True)
        self.log("train_acc", class_accuracy(logits, batch), on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(batch[0])
        loss = class_loss(logits, batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_acc", class_accuracy(logits, batch), prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(),
            lr=self.hparams["learning_rate"],
            weight_decay=self.hparams["weight_decay"],
        )


class _CLI(LightningCLI):
    """LightningCLI that prints the final loss once (rank 0)."""

    def after_fit(self) -> None:
        metrics = self.trainer.callback_metrics
        loss = metrics.get("train_loss_step", metrics.get("train_loss"))  # the last step's
        if self.trainer.is_global_zero and loss is not None:
            print(f"final train_loss {float(loss):.4f} after {self.trainer.global_step} steps")


def main(args: list[str] | None = None) -> None:
    """Train on synthetic 32x32 images; defaults: 2 CPU processes, one micro-batch, 20 steps."""
    _CLI(
        ResNet18Classifier,
        SyntheticImageDataModule,
        args=args,
        trainer_defaults={
            "accelerator": "cpu",
            "devices": 2,
            "strategy": {
                "class_path": "lightning_deepcee.DeepCEEStrategy",
                "init_args": {"num_microbatches": 1},  # exact with BatchNorm
            },
            "max_steps": 20,
            "limit_val_batches": 4,
            "logger": False,
            "enable_checkpointing": False,
        },
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
