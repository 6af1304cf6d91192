"""PipelineThroughputMonitor: samples/s and tokens/s counted once per pipeline replica.

Lightning's ``ThroughputMonitor`` multiplies a per-device rate by ``world_size``, which counts a
pipeline once per stage. This callback uses the samples the strategy actually consumed in a step
(global batch over all replicas) and its wall time, and every ``log_every_n_steps`` gathers each
rank's compute and transfer seconds so the logger also gets per-stage times. On a planned run it
also sets the measured step time beside the plan's predicted one, so every run validates the
cost model in whatever logger the user has.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_deepcee.callbacks.after_step import AfterStepCallback
from lightning_deepcee.callbacks.strategy_view import deepcee_strategy

if TYPE_CHECKING:
    from lightning_deepcee.strategy.deepcee import DeepCEEStrategy

__all__ = ["PipelineThroughputMonitor"]


class PipelineThroughputMonitor(AfterStepCallback):
    """Log ``deepcee/samples_per_s``, ``deepcee/tokens_per_s`` and per-stage times.

    Per stage: ``stage{i}_compute_s`` (wall seconds in F/B/W), ``stage{i}_transfer_s`` (wall
    seconds in sends and receives), ``stage{i}_cpu_s`` (the executor thread's CPU seconds over
    the step) and ``stage{i}_grad_sync_s`` (wall seconds summing a shared stage's gradients), all
    of the last step.

    The cost model, checked on every run: ``step_s`` (mean wall seconds per step over the
    window) and, while the running layout is the plan's (its micro-batch count and global batch;
    a planned run, not a manual layout), ``predicted_step_s`` (the plan's prediction) and
    ``cost_model_error`` (``predicted / measured - 1``, the sign the benchmarks use: negative
    means the run is slower than predicted). The measured side counts only steps run under the
    current prediction: it starts again, skipping one warm-up step, whenever a re-plan or a
    micro-batch split changes what runs. The last comparison is printed when training ends.

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
        self._prediction: float | None = None
        """The plan's predicted step seconds for the layout this step runs; None without one."""
        self._predicted_times: deque[float] = deque(maxlen=window_size)
        """Wall seconds of the steps run under ``_prediction`` (its first step skipped)."""
        self._prediction_key: tuple[Any, ...] | None = None
        self._skip_prediction_step = True

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._start = time.perf_counter()
        strategy = trainer.strategy
        plan = getattr(strategy, "plan", None)
        key = (plan, getattr(strategy, "num_microbatches", None))
        fresh = key != self._prediction_key
        if fresh:
            # What runs changed (a re-plan, a split, the first step): compare afresh, and skip
            # this step, which includes the new layout's warm-up.
            self._prediction_key = key
            self._predicted_times.clear()
            self._prediction = None
            if plan is not None and plan.num_microbatches == key[1]:
                self._prediction = plan.predicted_step_time_s or None  # 0: no prediction
        self._skip_prediction_step = fresh

    @override
    def after_train_step(self, trainer: pl.Trainer) -> None:
        strategy: DeepCEEStrategy = deepcee_strategy(trainer, "PipelineThroughputMonitor")
        self._steps += 1
        step_s = time.perf_counter() - self._start
        if self._steps > 1:  # the first step includes warm-up
            self._times.append(step_s)
            self._samples.append(strategy.last_step_samples)
            if strategy.last_step_tokens is not None:
                self._tokens.append(strategy.last_step_tokens)
        plan = strategy.plan
        # A short last batch is not the batch the plan was sized for: not compared.
        planned_batch = plan is not None and strategy.last_step_samples == plan.global_batch_size
        if self._prediction is not None and planned_batch and not self._skip_prediction_step:
            self._predicted_times.append(step_s)
        every = int(self.log_every_n_steps or getattr(trainer, "log_every_n_steps", 50) or 1)
        if trainer.global_step % every != 0:
            return
        metrics: dict[str, float] = {}
        elapsed = sum(self._times)
        if elapsed > 0:
            metrics["deepcee/samples_per_s"] = sum(self._samples) / elapsed
            metrics["deepcee/step_s"] = elapsed / len(self._times)
            if self._tokens:
                metrics["deepcee/tokens_per_s"] = sum(self._tokens) / elapsed
        metrics.update(self.cost_model_check())
        stats = strategy.last_step_stats
        figures = (
            [stats.compute_s, stats.transfer_s, stats.cpu_s, stats.grad_sync_s]
            if stats is not None
            else [0.0] * 4
        )
        local = torch.tensor(
            figures,
            dtype=torch.float64,
            device=strategy.root_device,
        )
        gathered = strategy.all_gather(local)  # (world, 4) on every rank: all ranks call it
        if trainer.is_global_zero:
            for rank in range(min(strategy.num_stages, gathered.shape[0])):
                metrics[f"deepcee/stage{rank}_compute_s"] = float(gathered[rank][0])
                metrics[f"deepcee/stage{rank}_transfer_s"] = float(gathered[rank][1])
                # The executor thread's CPU: compute_s far above it means the device stalled
                # (a CPU quota, a noisy neighbour) rather than computed.
                metrics[f"deepcee/stage{rank}_cpu_s"] = float(gathered[rank][2])
                # Summing a shared stage's gradients (asymmetric DP): the cost model's
                # allreduce term, measured.
                metrics[f"deepcee/stage{rank}_grad_sync_s"] = float(gathered[rank][3])
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def cost_model_check(self) -> dict[str, float]:
        """``deepcee/predicted_step_s`` and ``deepcee/cost_model_error`` of the current plan.

        Empty until a step has run under a plan's prediction (see the class docstring).
        """
        if self._prediction is None or not self._predicted_times:
            return {}
        return {
            "deepcee/predicted_step_s": self._prediction,
            "deepcee/cost_model_error": self._prediction / self._measured_s() - 1.0,
        }

    def _measured_s(self) -> float:
        return sum(self._predicted_times) / len(self._predicted_times)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check = self.cost_model_check()
        if check:
            rank_zero_info(
                f"PipelineThroughputMonitor: the plan predicted "
                f"{check['deepcee/predicted_step_s'] * 1e3:.0f} ms a step, the last "
                f"{len(self._predicted_times)} steps took {self._measured_s() * 1e3:.0f} ms "
                f"(cost-model error {check['deepcee/cost_model_error']:+.0%})"
            )
