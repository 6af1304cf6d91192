"""What the adapter callback may use of the strategy: a small typed Protocol.

:class:`~lightning_deepcee.callbacks.adapter.DynamicEnvironmentAdapter` and its
:class:`~lightning_deepcee.callbacks.replanner.Replanner` read the running plan and profile,
the step's transfers and this rank's place, and change the layout only through the public
methods listed here (``DeepCEEStrategy`` provides them all). Written as a Protocol so that the
callbacks import nothing of the strategy package and the two never form an import cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import lightning.pytorch as pl

if TYPE_CHECKING:
    import torch

    from lightning_deepcee.planner import Plan
    from lightning_deepcee.profiler import ClusterProfile
    from lightning_deepcee.runtime.executor import StepStats
    from lightning_deepcee.runtime.transport import TransferRecord

__all__ = ["AdaptableStrategy", "deepcee_strategy"]


class AdaptableStrategy(Protocol):
    """The strategy as the adapter sees it: the running plan, its profile, and the calls that
    change the split or the layout between two steps (collective: every rank together)."""

    cluster_profile: ClusterProfile | None
    """The profile the running plan is judged on; a re-plan replaces it with the links as
    measured, a revert puts the previous one back."""
    device_gain: float
    """The search's margin for using more devices (``DeepCEEStrategy(device_gain=...)``)."""
    compression: tuple[str, ...]
    """The methods a re-plan may choose per hop (``DeepCEEStrategy(compression=...)``)."""
    last_step_stats: StepStats | None
    """This rank's timings of the last training step (``compute_s``: its compute)."""

    @property
    def plan(self) -> Plan | None:
        """The running layout."""
        ...

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step now."""
        ...

    @property
    def trial_running(self) -> bool:
        """Whether the plan trial runs: the layout changes at the coming step boundaries."""
        ...

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def num_replicas(self) -> int: ...

    @property
    def transfer_records(self) -> list[TransferRecord]:
        """This rank's transfers of the last training step."""
        ...

    def current_plan(self) -> Plan:
        """The running layout as a Plan, with the micro-batch count in force."""
        ...

    def check_plan(self, plan: Plan) -> None:
        """Raise unless ``plan`` can replace the running layout."""
        ...

    def apply_plan(self, plan: Plan, trainer: pl.Trainer, why: str = ...) -> None:
        """Switch to ``plan`` between two steps, moving the training state."""
        ...

    def set_num_microbatches(self, num_microbatches: int) -> None:
        """Use ``num_microbatches`` from the next step on."""
        ...

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of rank ``src`` on every rank."""
        ...


def deepcee_strategy(trainer: pl.Trainer, callback: str) -> Any:
    """The trainer's strategy; ``TypeError`` naming ``callback`` unless it is a
    ``DeepCEEStrategy`` (imported here, on call: the callbacks import nothing of the strategy
    package at import time)."""
    from lightning_deepcee.strategy.deepcee import DeepCEEStrategy

    if not isinstance(trainer.strategy, DeepCEEStrategy):
        raise TypeError(f"{callback} needs Trainer(strategy=DeepCEEStrategy()).")
    return trainer.strategy
