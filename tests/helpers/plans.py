"""Plans written by hand: the layout a test needs, with placeholder predictions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_deepcee.planner import Plan, StagePlan

Stage = tuple[tuple[int, int], tuple[int, ...], tuple[float, ...]]
"""(block range, ranks, batch shares) of one stage."""


def hand_plan(
    stages: Sequence[Stage],
    *,
    model_fingerprint: str,
    global_batch_size: int,
    schedule: str = "1f1b",
    num_microbatches: int = 2,
    idle_ranks: tuple[int, ...] = (),
    predicted_step_time_s: float = 1.0,
    predicted_bubble_ratio: float = 0.0,
    predicted_peak_memory_bytes: Mapping[int, int] | None = None,
    cluster_fingerprint: str = "",
    notes: str = "",
) -> Plan:
    """A plan of these stages; unless given, its predictions are placeholders (1 s a step, no
    bubble, no memory figures) and it names no cluster."""
    return Plan(
        stages=tuple(StagePlan(block_range=r, ranks=k, batch_shares=s) for r, k, s in stages),
        schedule=schedule,
        num_microbatches=num_microbatches,
        global_batch_size=global_batch_size,
        predicted_step_time_s=predicted_step_time_s,
        predicted_bubble_ratio=predicted_bubble_ratio,
        predicted_peak_memory_bytes=dict(predicted_peak_memory_bytes or {}),
        model_fingerprint=model_fingerprint,
        cluster_fingerprint=cluster_fingerprint,
        idle_ranks=idle_ranks,
        notes=notes,
    )
