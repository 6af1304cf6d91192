"""What a LightningModule must allow for the strategy to train it exactly, checked at setup.

The strategy runs the blocks of :class:`~lightning_deepcee.PipelineSpec` itself (forward,
backward and the gradient sync of every micro-batch), so a module whose ``training_step``
drives its own optimizers cannot be honoured: the check raises on every rank at once, before
any rank waits on another.
"""

from __future__ import annotations

import lightning.pytorch as pl

__all__ = ["refuse_manual_optimization"]


def refuse_manual_optimization(module: pl.LightningModule) -> None:
    """Raise when ``module`` uses manual optimization (``automatic_optimization = False``)."""
    if not module.automatic_optimization:
        raise ValueError(
            f"DeepCEEStrategy cannot train {type(module).__name__}: it sets "
            "automatic_optimization = False (manual optimization), but the strategy runs the "
            "pipeline's forward and backward itself from configure_pipeline() and never calls "
            "a training_step that steps its own optimizers. Use automatic optimization (one "
            "loss in PipelineSpec.loss_fn, optimizers from configure_optimizers), or train "
            "this module with another strategy (e.g. strategy='ddp')."
        )
