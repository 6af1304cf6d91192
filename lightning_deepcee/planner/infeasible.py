"""Why no plan fits in memory: the error :func:`~.search.plan_search` raises, with what to change.

Planner layer: pure Python and numpy, no torch.
"""

from __future__ import annotations

import math

import numpy as np

from lightning_deepcee.planner.candidates import SearchContext

__all__ = ["infeasible"]


def infeasible(context: SearchContext) -> ValueError:
    """Why no candidate fits in memory, and what to change."""
    arrays = context.evaluator.arrays
    copies = context.evaluator.config.state_copies
    largest_memory = float(arrays.memory.max())
    per_block = np.diff(arrays.parameter_prefix) * copies
    total = float(arrays.parameter_prefix[-1]) * copies
    n = context.profile.num_blocks
    gib = 2.0**30
    one_sample = np.diff(arrays.saved_prefix) + np.diag(arrays.transient_peak, 1)
    more_counts = (
        f" and up to {context.memory_counts[-1]} where those did not fit"
        if context.memory_counts
        else ""
    )
    advice = (
        "Use a smaller global batch or add devices with more memory"
        if context.memory_counts
        else "Use more micro-batches or a smaller global batch"
    )
    if (per_block + one_sample).max() > largest_memory:
        block = int((per_block + one_sample).argmax())
        return ValueError(
            f"No plan fits in memory: block {block} alone needs {per_block[block] / gib:.2f} GiB "
            f"of parameter state ({copies} copies of its parameters) and "
            f"{one_sample[block] / gib:.2f} GiB of activations for one sample, but the largest "
            f"device has {largest_memory / gib:.2f} GiB. Split the model into smaller blocks or "
            "add memory."
        )
    needed = math.ceil(total / largest_memory)
    if needed > n:
        return ValueError(
            f"No plan fits in memory: the model's parameter state ({total / gib:.2f} GiB) needs at "
            f"least {needed} pipeline stages on the largest device ({largest_memory / gib:.2f} "
            f"GiB) but the model has only {n} blocks (fewer blocks than needed stages). Expose "
            "more, smaller blocks, or add devices with more memory."
        )
    return ValueError(
        f"No plan fits in memory: every candidate (pure data parallelism, a plain pipeline and "
        f"the network-group pipelines, with {list(context.microbatch_counts)} micro-batches"
        f"{more_counts}) "
        f"exceeds some device's memory (smallest device: {float(arrays.memory.min()) / gib:.2f} "
        f"GiB; model parameter state: {total / gib:.2f} GiB). {advice}, or pass memory_check=False "
        "to plan anyway."
    )
