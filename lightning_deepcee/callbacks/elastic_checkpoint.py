"""ElasticCheckpoint: checkpoints every N steps that an elastic restart resumes from by itself.

Use it with ``trainer.fit(..., ckpt_path="last")`` (``ckpt_path: last`` in a LightningCLI
YAML): on the first start there is no checkpoint yet and training begins from scratch; after
torchrun restarts the job (a device lost, or one joining) every process finds the newest
complete checkpoint in ``dirpath`` and resumes from it, re-planned for the devices it now has.

Every save is crash-safe (a save cut short by a lost device never replaces the previous
checkpoint) and, under ``DeepCEEStrategy(async_checkpoint=True)``, written off the training loop.
``dirpath`` must be a directory every device reads and writes (a shared file system).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_deepcee._compat import checkpoint_dir_of
from lightning_deepcee.runtime.checkpoint import newest_checkpoint

__all__ = ["ElasticCheckpoint"]


class ElasticCheckpoint(ModelCheckpoint):
    """A ``ModelCheckpoint`` for elastic jobs: every ``every_n_train_steps`` steps, and
    ``ckpt_path="last"`` means the newest complete DeepCEE checkpoint in ``dirpath``.

    Args:
        dirpath: where checkpoints go (shared by every device). ``None``: Lightning's default,
            ``<default_root_dir>/checkpoints``.
        every_n_train_steps: save after every this many optimizer steps; the steps since the
            newest checkpoint are what a restart redoes.
        save_top_k: checkpoints kept (``1``: the newest; an older one is removed only once the
            newer is complete; ``-1``: all).
        filename: Lightning's checkpoint name template.
        **kwargs: any other ``ModelCheckpoint`` argument.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_train_steps: int = 50,
        save_top_k: int = 1,
        filename: str = "step={step}",
        **kwargs: Any,
    ) -> None:
        if every_n_train_steps < 1:
            raise ValueError(
                f"ElasticCheckpoint(every_n_train_steps={every_n_train_steps}) must be >= 1."
            )
        kwargs.setdefault("auto_insert_metric_name", False)
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            every_n_train_steps=every_n_train_steps,
            save_top_k=save_top_k,
            **kwargs,
        )

    @override
    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        newest = newest_checkpoint(checkpoint_dir_of(self, trainer))
        return set() if newest is None else {str(newest)}
