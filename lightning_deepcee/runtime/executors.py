"""One rank's executors of a Plan, and the prediction call built on their output.

:func:`build_executors` lowers and validates the plan's schedule and wraps this rank's part in
:class:`~lightning_deepcee.runtime.executor.PipelineExecutor` objects for training, evaluation
and prediction; :func:`call_with_output` runs the module's own ``predict_step`` with the
pipeline's output standing in for ``forward``.

torch; no Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_deepcee.planner.plan import Plan
from lightning_deepcee.runtime.executor import PipelineExecutor
from lightning_deepcee.runtime.routing import Router, StageLayout
from lightning_deepcee.runtime.stage import PipelineSpec, Stage
from lightning_deepcee.runtime.transport import P2PTransport
from lightning_deepcee.schedule import lower, validate
from lightning_deepcee.schedule.generators import forward_only

__all__ = ["Executors", "build_executors", "call_with_output", "hop_peers", "stage_layouts"]


def hop_peers(plan: Plan, stage_index: int) -> dict[int, str]:
    """The compression method of the ranks next to stage ``stage_index``: the previous stage's
    by the hop before it, the next stage's by the hop after it (only compressed hops)."""
    peers = {}
    for hop, other in ((stage_index - 1, stage_index - 1), (stage_index, stage_index + 1)):
        if 0 <= hop < plan.num_stages - 1 and plan.hop_method(hop) != "off":
            peers.update(dict.fromkeys(plan.stages[other].ranks, plan.hop_method(hop)))
    return peers


def stage_layouts(plan: Plan, rank: int) -> list[StageLayout]:
    """The pipeline ``rank`` belongs to: per stage, its devices and their row shares."""
    if plan.num_replicas > 1:
        d = plan.replica_of(rank)
        return [StageLayout((st.ranks[d],), (1.0,)) for st in plan.stages]
    return [StageLayout(st.ranks, st.batch_shares) for st in plan.stages]


@dataclass(frozen=True)
class Executors:
    """A rank's executors for training, evaluation and prediction."""

    train: PipelineExecutor
    evaluation: PipelineExecutor
    prediction: PipelineExecutor


def build_executors(
    plan: Plan,
    *,
    num_microbatches: int,
    stage: Stage,
    spec: PipelineSpec,
    rank: int,
    device: torch.device,
    receive_ahead: bool,
    measure_saved: bool = False,
) -> Executors:
    """Lower and validate the plan's schedule for ``num_microbatches``, then build executors.

    The schedule is per stage; devices sharing a stage run the same list, and the router
    expands each transfer into the row pieces exchanged with the neighbouring devices.
    ``measure_saved``: the training executor reports ``StepStats.peak_saved_bytes``.
    Training sends float32 tensors over each hop with the plan's compression
    (``Plan.hop_compression``); evaluation and prediction send them exactly, so that their
    figures are the model's own.
    """
    num_stages = plan.num_stages
    placement = {s: s for s in range(num_stages)}
    common: dict[str, Any] = dict(
        stage=stage,
        transport=P2PTransport(device, prefetch=receive_ahead),
        router=Router(stage_layouts(plan, rank), stage.stage_index, rank),
        loss_fn=spec.loss_fn,
        input_fn=spec.input_fn,
        metrics_fn=spec.metrics_fn,
        rank=rank,
    )
    m = num_microbatches
    train = lower(plan.stage_schedule(m), placement)
    validate(train, placement, m)
    evaluation = lower(forward_only(num_stages, m), placement)
    validate(evaluation, placement, m, require_backward=False)
    compressed = P2PTransport(
        device, prefetch=receive_ahead, compression=hop_peers(plan, stage.stage_index)
    )
    return Executors(
        train=PipelineExecutor(
            actions=train[stage.stage_index],
            measure_saved=measure_saved,
            **{**common, "transport": compressed},
        ),
        evaluation=PipelineExecutor(actions=evaluation[stage.stage_index], **common),
        prediction=PipelineExecutor(
            actions=evaluation[stage.stage_index], keep_outputs=True, **common
        ),
    )


def call_with_output(
    module: torch.nn.Module,
    output: Any,
    batch: Any,
    input_fn: Callable[[Any], Any],
    step: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Call ``step`` (the module's own ``predict_step``) with ``output`` standing in for what
    ``module(...)`` returns on the batch: ``self(batch)`` or ``self(input_fn(batch))`` gives the
    pipeline's output; calling it on anything else raises, since only that ran."""
    expected = input_fn(batch)

    def forward(*f_args: Any, **f_kwargs: Any) -> Any:
        x = f_args[0] if f_args else next(iter(f_kwargs.values()), None)
        same = x is batch or x is expected
        if not same and isinstance(x, torch.Tensor) and isinstance(expected, torch.Tensor):
            same = x.shape == expected.shape and bool(torch.equal(x, expected))
        if not same:
            raise ValueError(
                f"DeepCEEStrategy.predict: {type(module).__name__}.predict_step called the model "
                "on something other than the batch's input; under the pipeline only the model "
                "on input_fn(batch) ran. Call self(batch) or self(input_fn(batch)) once, or "
                "predict with the consolidated plain module (deepcee consolidate)."
            )
        return output

    module.forward = forward
    try:
        return step(*args, **kwargs)
    finally:
        del module.forward
