"""Small demo models and data sets used by the examples, tests and benchmarks.

They are ordinary LightningModules that also train with DDP; the only addition DeepCEE needs is
``configure_pipeline``.
"""

from lightning_deepcee.demo.cnn import (
    ConvNet,
    SyntheticImageDataModule,
    class_accuracy,
    class_loss,
    synthetic_images,
)
from lightning_deepcee.demo.gpt import GPT, GPTConfig, lm_loss, token_accuracy
from lightning_deepcee.demo.text import ShakespeareDataModule, load_shakespeare

__all__ = [
    "GPT",
    "ConvNet",
    "GPTConfig",
    "ShakespeareDataModule",
    "SyntheticImageDataModule",
    "class_accuracy",
    "class_loss",
    "lm_loss",
    "load_shakespeare",
    "synthetic_images",
    "token_accuracy",
]
