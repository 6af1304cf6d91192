"""The profiling step of ``DeepCEEStrategy`` set-up: measure every device and link once.

Kept apart from :mod:`lightning_deepcee.strategy` (the step loop and its hooks): this runs once,
before the plan exists, on the first training micro-batch.
"""

from __future__ import annotations

import time
import warnings
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_deepcee._compat import fit_dataloader
from lightning_deepcee.console import format_cluster, warn_once_per_job
from lightning_deepcee.profiler import group_devices
from lightning_deepcee.runtime import batch_size_of, split_batch, split_sizes
from lightning_deepcee.runtime.measure import profile_cluster, profile_or_load

if TYPE_CHECKING:
    from lightning_deepcee.strategy import DeepCEEStrategy

__all__ = ["profile_at_setup"]


def profile_at_setup(strategy: DeepCEEStrategy, trainer: pl.Trainer) -> dict[str, float]:
    """Measure devices and links on the first training micro-batch (all ranks), set the
    strategy's ``cluster_profile``, ``device_groups`` and global batch size, print the table,
    and return the seconds of the parts (the slowest device's block timings, the network)."""
    assert strategy.spec is not None
    batch = strategy.batch_to_device(next(iter(fit_dataloader(trainer))))
    strategy._global_batch_size = batch_size_of(batch)
    micro = split_batch(batch, split_sizes(batch_size_of(batch), strategy.num_microbatches))[0]
    parts: dict[str, float] = {}
    options: dict[str, Any] = dict(
        loss_fn=strategy.spec.loss_fn,
        sample_batch=micro,
        device=strategy.root_device,
        budget_s=strategy.profile_budget_s,
        rounds=strategy.profile_rounds,
        device_cache=strategy.device_cache_dir(),
        block_budget_s=strategy.profile_block_budget_s,
        parts=parts,
    )
    blocks, sample = list(strategy.spec.blocks), strategy.spec.input_fn(micro)
    budget = strategy.profile_block_budget_s
    rank_zero_info(
        f"DeepCEE: profiling {strategy.world_size} devices: block timings"
        + (f" (about {budget:g} s per device)" if budget is not None else "")
        + ", then every link"
    )
    began = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if strategy.profile_cache is not None:
            profile = profile_or_load(strategy.profile_cache, blocks, sample, **options)
        else:
            profile = profile_cluster(blocks, sample, **options)
    seconds = time.perf_counter() - began
    warn_once_per_job([str(w.message) for w in caught], strategy.world_size)
    strategy.cluster_profile = profile
    strategy.device_groups = group_devices(profile)
    rank_zero_info(format_cluster(profile, strategy.device_groups))
    rank_zero_info(f"DeepCEE: profiled {profile.num_devices} devices in {seconds:.1f} s")
    metrics = {f"deepcee/capability_rank{d.rank}": d.capability for d in profile.devices}
    metrics["deepcee/profile_s"] = seconds
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=0)
    return parts
