"""PipelineThroughputMonitor: samples/s and tokens/s counted once per pipeline replica.

Lightning's ``ThroughputMonitor`` multiplies a per-device rate by ``world_size``, which counts a
pipeline once per stage. This callback uses the samples the strategy actually consumed in a step
(global batch over all replicas) and its wall time, and every ``log_every_n_steps`` gathers each
rank's compute and transfer seconds so the logger also gets per-stage times.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["PipelineThroughputMonitor"]


class PipelineThroughputMonitor(Callback):
    """Log ``deepcee/samples_per_s``, ``deepcee/tokens_per_s`` and per-stage times.

    Args:
        window_size: steps averaged for the rates (the first step, which includes warm-up, is
            skipped).
        log_every_n_steps: gather per-stage times this often; ``None`` uses the Trainer's value.
    """

    def __init__(self, window_size: int = 20, log_every_n_steps: int | None = None) -> None:
        if window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {window_size}")
        self.window_size = window_size
        self.log_every_n_steps = log_every_n_steps
        self._times: deque[float] = deque(maxlen=window_size)
        self._samples: deque[int] = deque(maxlen=window_size)
        self._tokens: deque[int] = deque(maxlen=window_size)
        self._start = 0.0
        self._steps = 0

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        from lightning_deepcee.strategy import DeepCEEStrategy

        strategy = trainer.strategy
        if not isinstance(strategy, DeepCEEStrategy):
            raise TypeError("PipelineThroughputMonitor needs Trainer(strategy=DeepCEEStrategy()).")
        self._steps += 1
        if self._steps > 1:  # the first step includes warm-up
            self._times.append(time.perf_counter() - self._start)
            self._samples.append(strategy.last_step_samples)
            if strategy.last_step_tokens is not None:
                self._tokens.append(strategy.last_step_tokens)
        every = int(self.log_every_n_steps or getattr(trainer, "log_every_n_steps", 50) or 1)
        if trainer.global_step % every != 0:
            return
        metrics: dict[str, float] = {}
        elapsed = sum(self._times)
        if elapsed > 0:
            metrics["deepcee/samples_per_s"] = sum(self._samples) / elapsed
            if self._tokens:
                metrics["deepcee/tokens_per_s"] = sum(self._tokens) / elapsed
        stats = strategy.last_step_stats
        local = torch.tensor(
            [stats.compute_s, stats.transfer_s] if stats is not None else [0.0, 0.0],
            dtype=torch.float64,
            device=strategy.root_device,
        )
        gathered = strategy.all_gather(local)  # (world, 2) on every rank: all ranks call it
        if trainer.is_global_zero:
            for rank in range(min(strategy.num_stages, gathered.shape[0])):
                metrics[f"deepcee/stage{rank}_compute_s"] = float(gathered[rank][0])
                metrics[f"deepcee/stage{rank}_transfer_s"] = float(gathered[rank][1])
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
