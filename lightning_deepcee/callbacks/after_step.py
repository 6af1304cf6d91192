"""A Lightning callback that acts once after each training step and reads only the trainer.

:class:`~lightning_deepcee.callbacks.throughput.PipelineThroughputMonitor` and
:class:`~lightning_deepcee.callbacks.adapter.DynamicEnvironmentAdapter` both act at the end of
every training step on what the strategy recorded, never on the step's outputs or batch: this
base class takes Lightning's ``on_train_batch_end`` arguments once and hands them the trainer.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["AfterStepCallback"]


class AfterStepCallback(Callback):
    """A callback whose per-step work is :meth:`after_train_step` (the trainer is all it needs)."""

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.after_train_step(trainer)

    def after_train_step(self, trainer: pl.Trainer) -> None:
        """Act on the training step that just ended (every rank calls it, in step order)."""
        raise NotImplementedError
