"""What the strategy's arguments and a LightningModule must allow, checked early.

The strategy's numeric arguments are checked at construction (:func:`check_arguments`), before
any process exists.

The strategy runs the blocks of :class:`~lightning_deepcee.PipelineSpec` itself (forward,
backward and the gradient sync of every micro-batch), so a module whose ``training_step``
drives its own optimizers cannot be honoured: the check raises on every rank at once, before
any rank waits on another.
"""

from __future__ import annotations

import lightning.pytorch as pl

__all__ = ["check_arguments", "plan_argument", "refuse_manual_optimization"]


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


def check_arguments(
    *,
    timeout_s: float,
    profile_budget_s: float,
    profile_block_budget_s: float | None,
    profile_rounds: int,
    device_gain: float,
    plan_trial: int,
) -> None:
    """Raise ``ValueError`` naming the first ``DeepCEEStrategy`` argument out of range."""
    for name, value in (
        ("timeout_s", timeout_s),
        ("profile_budget_s", profile_budget_s),
        (
            "profile_block_budget_s",
            1.0 if profile_block_budget_s is None else profile_block_budget_s,
        ),
    ):
        if value <= 0:
            raise ValueError(f"DeepCEEStrategy({name}={value}) must be > 0.")
    rounds = profile_rounds
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"DeepCEEStrategy(profile_rounds={rounds!r}) must be an integer >= 1.")
    if isinstance(device_gain, bool) or not 0 <= device_gain < 1:
        raise ValueError(f"DeepCEEStrategy(device_gain={device_gain!r}) must be in [0, 1).")
    if isinstance(plan_trial, bool) or not isinstance(plan_trial, int) or plan_trial < 1:
        raise ValueError(f"DeepCEEStrategy(plan_trial={plan_trial!r}) must be an integer >= 1.")


def plan_argument(plan: str | None, *, manual: bool) -> str | None:
    """What set-up plans from: ``plan`` (a saved plan's path, or ``"auto"``), ``None`` for a
    ``manual`` layout, ``"auto"`` when neither is given; both at once raise ``ValueError``."""
    if plan is not None and manual:
        raise ValueError(
            "DeepCEEStrategy(plan=...) decides partition, schedule, micro-batches and "
            "placement; pass either a plan or those arguments, not both."
        )
    return plan if plan is not None else (None if manual else "auto")
