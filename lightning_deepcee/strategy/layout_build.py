"""Building a plan on this rank and switching plans between two steps: the Lightning side.

The stage part (:class:`~lightning_deepcee.strategy.stage_part.PipelineStagePart`) splits the
module, makes the process groups and the executors and moves the training state; what Lightning
owns is done here, through the strategy's public Lightning API (:class:`BuildHost`): putting the
module on its device under the precision plugin, (re)creating the optimizers, and loading the
re-partitioned state. :func:`build_layout` is the one path used by setup, re-plan, resume and
the plan trial; :func:`relayout_from` is ``DeepCEEStrategy.apply_plan`` (a re-plan, a move of
the plan trial).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.types import LRSchedulerConfig
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_deepcee._compat import mock_optimizer, optimizers_to_device
from lightning_deepcee.planner import Plan
from lightning_deepcee.profiler import ClusterProfile
from lightning_deepcee.runtime.layout_text import layout_line
from lightning_deepcee.strategy.stage_part import PipelineStagePart

__all__ = ["BuildHost", "build_layout", "live_shard", "relayout_from"]


class BuildHost(Protocol):
    """What building a layout uses of the strategy: its stage part and Lightning's own API."""

    stage_part: PipelineStagePart
    verbose: bool
    cluster_profile: ClusterProfile | None
    optimizers: list[torch.optim.Optimizer]
    lr_scheduler_configs: list[LRSchedulerConfig]

    @property
    def lightning_module(self) -> pl.LightningModule | None: ...

    @property
    def model(self) -> torch.nn.Module | None: ...

    @property
    def precision_plugin(self) -> Precision: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_idle(self) -> bool: ...

    def model_to_device(self) -> None: ...

    def setup_optimizers(self, trainer: pl.Trainer) -> None: ...

    def setup_precision_plugin(self) -> None: ...

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]: ...

    def lightning_module_state_dict(self) -> dict[str, Any]: ...

    def check_plan(self, plan: Plan) -> None: ...


def build_layout(
    host: BuildHost, plan: Plan, trainer: pl.Trainer, shards: list[dict[str, Any]] | None = None
) -> None:
    """Build (or rebuild) this rank's part of ``plan``: the one path for every layout.

    Used by setup, re-plan (:func:`relayout_from`, with the gathered ``shards`` of the training
    state) and hence resume, whose checkpoint is re-partitioned onto what this builds. The stage
    part splits the module, re-creates the process groups and the executors; this puts the
    module on the device under the precision plugin, (re)creates the optimizers through
    Lightning while fitting, and loads the re-partitioned state when ``shards`` are given.
    """
    module, part = host.lightning_module, host.stage_part
    assert module is not None
    fitting = trainer.state.fn == TrainerFn.FITTING

    def place() -> None:
        assert host.model is not None
        host.precision_plugin.convert_module(host.model)
        host.model_to_device()

    part.build(
        plan,
        rank=host.global_rank,
        device=host.root_device,
        place=place,
        fresh=shards is None,
        forward_context=lambda: host.precision_plugin.forward_context(),
        profile=host.cluster_profile,
    )
    if fitting and host.is_idle:
        # Nothing to optimise: Lightning's own stand-in for "no optimizer" keeps the loop
        # (and its collectives, such as gradient clipping's norm) in step with the others.
        host.optimizers, host.lr_scheduler_configs = [mock_optimizer()], []
    elif fitting:
        host.setup_optimizers(trainer)
    host.setup_precision_plugin()
    share, tied_shares = part.norm_shares()
    host.precision_plugin.norm_share = share  # type: ignore[attr-defined]
    host.precision_plugin.norm_shares = tied_shares  # type: ignore[attr-defined]
    if shards is not None and not host.is_idle:
        local = part.repartitioned(shards, host.optimizers)
        module.load_state_dict(local["state_dict"], strict=True)
        for optimizer, state in zip(host.optimizers, local["optimizer_states"], strict=True):
            optimizer.load_state_dict(state)
        if fitting:
            schedulers = host.lr_scheduler_configs
            for config, state in zip(schedulers, local["lr_schedulers"], strict=True):
                config.scheduler.load_state_dict(state)
    if fitting:
        optimizers_to_device(host.optimizers, host.root_device)
    if host.verbose:
        rank_zero_info(part.describe())


def relayout_from(host: BuildHost, plan: Plan, trainer: pl.Trainer, why: str) -> None:
    """``DeepCEEStrategy.apply_plan``: from the running layout, whose devices of each stage
    hold its part of the training state (:func:`live_shard`), to ``plan``. Collective:

    1. ``host.check_plan`` (local, so a bad plan raises on every rank before anything moves);
    2. a device of a stage that sends copies its stage's part of the training state to host
       memory: weights, optimizer state, LR-scheduler state and the global name of each
       optimizer parameter, exactly a checkpoint shard; each rank of the new layout receives,
       point to point from the old stage's first device, the part of each old stage's shard
       its new blocks use (:mod:`~lightning_deepcee.runtime.relayout`: a rank that held those
       blocks takes its own copy, an idle rank receives nothing). The ranks first agree on the
       plan (a digest of it, gathered): unequal plans raise on every rank;
    3. the blocks ``build_stage`` replaced by ``nn.Identity`` are put back and
       :func:`build_layout` builds the new layout, as setup does, loading this rank's part
       rebuilt from the shards with the checkpoint code
       (:func:`~lightning_deepcee.runtime.checkpoint.repartition`): weights, optimizer state (by
       parameter name, so Adam moments follow their block) and scheduler state.
       ``configure_optimizers`` runs again through Lightning, so the optimizers and schedulers
       cover this rank's new parameters from the next step on.

    Gradients stay exact: nothing changes inside a step, the moved state is bit-for-bit the
    state the old owner would have used. Cost: the state of the blocks that change owner crosses
    the links from their old to their new owners, pickled on the host.
    """
    host.check_plan(plan)
    source = host.stage_part.plan
    assert source is not None  # check_plan: a set-up strategy
    began = time.perf_counter()
    before = layout_line(source, source.num_microbatches)
    shards, sent = host.stage_part.relayout(source, lambda: live_shard(host), plan, host.world_size)
    build_layout(host, plan, trainer, shards)
    rank_zero_info(
        f"DeepCEE: {why} at step {trainer.global_step}, moved the training state "
        f"({sent / 1e6:.2f} MB sent point to point) in "
        f"{time.perf_counter() - began:.2f} s:\n  before: {before}\n  after:  "
        f"{layout_line(plan, host.stage_part.num_microbatches)}"
    )


def live_shard(host: BuildHost) -> dict[str, Any]:
    """A copy of this stage's training state on the host, in the checkpoint's shard format."""
    shard = {
        "state_dict": host.lightning_module_state_dict(),
        "optimizer_states": [host.optimizer_state(opt) for opt in host.optimizers],
        "lr_schedulers": [c.scheduler.state_dict() for c in host.lr_scheduler_configs],
        "optimizer_param_names": host.stage_part.optimizer_param_names(host.optimizers),
    }
    # A copy, not a view: on a CPU device ``.cpu()`` returns the live tensor, which the new
    # layout's build may overwrite while the shard is still read (a replica takes its stage's
    # first device's copy). Pickling a CUDA tensor would unpickle it on the receiver's GPU of the
    # same index, so the copy is on the host.
    return apply_to_collection(shard, torch.Tensor, lambda t: t.detach().to("cpu", copy=True))
