"""The figures every rank returns from a step: loss, tokens and metrics, summed over the ranks.

Only the last stage's devices hold the loss and the module's ``metrics_fn`` metrics, and only
each replica's first device counts the tokens, but every rank logs them (a checkpoint or an
early stop that monitors ``train_loss`` must decide alike everywhere), so one all-reduce sums
each rank's part. A rank outside the last stage knows its part before the step's schedule runs:
it posts the sum first and waits for it after its own work. It then never idles at the step's
end until the slowest rank arrives, and the first stage begins the next step as soon as its own
work is done, while the later stages still finish theirs (a pipeline needs no barrier between
steps: each stage's optimizer step depends only on its own gradients). The sum runs on a gloo
group of its own, so that no pipeline message queues behind a pending sum.

Strategy layer: torch.distributed, no Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_deepcee.runtime.transport import start_all_reduce

__all__ = ["StepTotals"]


class StepTotals:
    """Sums ``[loss, tokens, *metrics]`` over every rank, one step at a time."""

    def __init__(self) -> None:
        self.names: list[str] | None = None
        """The metric names, once every rank agreed on them (:meth:`agree_names`)."""
        self._group: Any = None

    def agree_names(self, metrics: dict[str, Any]) -> list[str]:
        """The names ``metrics_fn`` returns, agreed once by every rank (only last-stage ranks
        see them; the sum needs the same list everywhere). A blocking collective the first
        time: every rank calls it after its first step's schedule."""
        if self.names is None:
            gathered: list[list[str] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, sorted(metrics))
            self.names = sorted({n for part in gathered for n in part or []})
        return self.names

    def release_group(self) -> None:
        """Drop the sum's process group (the process group is being re-formed). The next
        step agrees on the names again, so that every rank makes the new group at the same
        point (after its schedule), and posts then."""
        self._group, self.names = None, None

    def post(
        self,
        loss: torch.Tensor | None,
        tokens: float,
        metrics: dict[str, Any],
        device: torch.device,
        signal: float = 0.0,
    ) -> Callable[[], torch.Tensor]:
        """Post this rank's part of the sum (zeros where it holds none); the returned callable
        waits and returns ``[loss, tokens, *metrics, signal]`` summed over every rank (a rank's
        ``signal`` tells every other rank something at the end of the same step: a device
        waits to join). Every rank posts exactly once per step, after :meth:`agree_names`."""
        if self.names is None:
            raise RuntimeError("StepTotals.post before the ranks agreed on the metric names")
        shares = [float(metrics.get(name, 0.0)) for name in self.names]
        figures = torch.tensor(
            [0.0, float(tokens), *shares, float(signal)], dtype=torch.float64, device=device
        )
        if loss is not None:
            figures[0] = loss.detach().double()
        if self._group is None and dist.get_world_size() > 1:
            # Made by every rank at its first post: the same call in the same order everywhere.
            self._group = dist.new_group(backend="gloo")
        return start_all_reduce(figures, self._group)
