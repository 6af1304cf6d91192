"""One step run through the stage part, with its loss, tokens and metrics summed and logged.

:class:`StepLog` is the part of ``DeepCEEStrategy`` that runs a training or evaluation step
(:meth:`~lightning_deepcee.strategy.stage_part.PipelineStagePart.run`) and logs what every rank
must log alike: the loss and the module's ``metrics_fn`` metrics travel in one all-reduce
(:class:`~lightning_deepcee.runtime.step_totals.StepTotals`; each rank holds its rows' weighted
share), posted before the schedule by every rank outside the last stage. It keeps the last
step's sample and token counts (the throughput callback reads them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_deepcee.runtime import batch_size_of
from lightning_deepcee.runtime.executors import call_with_output
from lightning_deepcee.runtime.step_totals import StepTotals
from lightning_deepcee.strategy.stage_part import PipelineStagePart

__all__ = ["StepLog"]


class StepLog:
    """Runs and logs steps (see the module docstring)."""

    def __init__(self) -> None:
        self.totals = StepTotals()
        self.samples = 0
        """Samples of the last step over all replicas."""
        self.tokens: int | None = None
        """Tokens of the last step (``PipelineSpec.tokens_fn``), ``None`` without one."""
        self.signal = 0.0
        """The ``signal`` of the last logged training step, summed over every rank."""

    def predict(self, part: PipelineStagePart, batch: Any) -> Any:
        """The pipeline's output for ``batch``, on every rank (``trainer.predict``)."""
        part.run("predict", batch)
        return part.gathered_output(dist.get_world_size() if dist.is_initialized() else 1)

    def call_predict(
        self,
        part: PipelineStagePart,
        module: pl.LightningModule,
        output: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """The module's ``predict_step`` with ``output`` standing in for its ``forward``."""
        assert part.spec is not None
        batch = args[0] if args else kwargs["batch"]
        return call_with_output(
            module, output, batch, part.spec.input_fn, module.predict_step, *args, **kwargs
        )

    def release_group(self) -> None:
        """Drop the step sums' process group (the process group is being re-formed)."""
        self.totals.release_group()

    def run(
        self,
        part: PipelineStagePart,
        kind: str,
        batch: Any,
        prefix: str,
        *,
        module: pl.LightningModule,
        rank: int,
        device: torch.device,
        signal: float = 0.0,
    ) -> torch.Tensor:
        """Run one step of ``kind`` (``"train"`` or ``"eval"``) on ``batch``; log and return the
        whole batch's loss on every rank, as ``<prefix>_loss`` and ``<prefix>_<name>`` (so
        whichever rank writes the logs has them; an empty ``prefix`` logs nothing: a replayed
        step). An idle rank computes nothing and adds zeros. ``signal`` is summed with the
        other ranks' into :attr:`signal` (training steps that log)."""
        assert part.spec is not None
        tokens_fn, where = part.spec.tokens_fn, part.where
        # Tokens from each replica's first device (an idle rank's batch is a stand-in).
        first = rank in where.stages[0][: where.num_replicas]
        tokens = float(tokens_fn(batch)) if tokens_fn is not None and first else 0.0
        totals = self.totals

        def post(loss: torch.Tensor | None, metrics: dict[str, Any]) -> Callable[[], torch.Tensor]:
            return totals.post(loss, tokens, metrics, device, signal)

        early = totals.names is not None and rank not in where.stages[-1]
        pending = post(None, {}) if early else None
        loss = part.run(kind, batch)
        if pending is None:
            executor = part.executor(kind)
            mine = {} if executor is None else executor.last_metrics
            totals.agree_names(mine)
            pending = post(loss, mine)
        summed = pending()  # the last-stage devices each contribute their rows
        self.samples = batch_size_of(batch) * where.num_replicas
        self.tokens = round(summed[1].item()) if tokens_fn else None
        assert totals.names is not None
        training = prefix == "train"
        value = summed[0].float()
        if not prefix:
            return value
        if training:
            self.signal = float(summed[-1].item())
        module.log(f"{prefix}_loss", value, prog_bar=True, on_step=training, on_epoch=True)
        for name, metric in zip(totals.names, summed[2:-1].float(), strict=True):
            module.log(f"{prefix}_{name}", metric, on_step=training, on_epoch=True)
        return value
