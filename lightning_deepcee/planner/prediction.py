"""The cost model's records: its constants and its answer.

:class:`CostModelConfig` and :class:`Prediction` live apart from the arithmetic
(:mod:`lightning_deepcee.planner.evaluator`) and from the functional API
(:mod:`lightning_deepcee.planner.cost_model`) so that both can import them. The model they
belong to is described in :mod:`lightning_deepcee.planner.cost_model`.

Pure: standard library only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_deepcee.planner.compression import allowed_methods

__all__ = ["CostModelConfig", "Prediction"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModelConfig:
    """Constants of the cost model that the profile does not measure."""

    optimizer_s_per_byte: float = 1e-10
    """Optimizer seconds per byte of a stage's parameters on a device whose profile did not
    measure it (``DeviceProfile.optimizer_s_per_byte == 0``). Adam reads and writes about four
    tensors per parameter; 1e-10 s/B is ~40 GB/s of effective memory traffic."""
    state_copies: int = 4
    """Bytes held per parameter byte: the weights, their gradient and Adam's two moments."""
    host_cpu_s_per_step: float = 0.018
    """CPU seconds (at full speed) a device spends per step outside its blocks' compute and its
    optimizer: Lightning's loop, hooks and logging, the executor's bookkeeping. Only charged to
    devices under a CPU quota (see the cost model's *Host CPU under a quota*); a constant fitted
    to measured runs, not a per-device measurement."""
    host_cpu_s_per_byte: float = 0.7e-9
    """CPU seconds per byte a device sends or receives (activations, their gradients and the
    stage's gradient all-reduce), charged like ``host_cpu_s_per_step`` and fitted the same way
    (gloo over TCP)."""
    compression: tuple[str, ...] = ()
    """Compression methods the planner may choose per pipeline hop
    (:mod:`~lightning_deepcee.planner.compression`); ``()``: none, every hop exact. Accepts a
    setting of :func:`~lightning_deepcee.planner.compression.allowed_methods` (``"auto"``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "compression", allowed_methods(self.compression))
        for name in ("optimizer_s_per_byte", "host_cpu_s_per_step", "host_cpu_s_per_byte"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value >= 0)
            ):
                raise ValueError(f"{name}: expected a non-negative finite number, got {value!r}")
        if (
            isinstance(self.state_copies, bool)
            or not isinstance(self.state_copies, int)
            or (self.state_copies < 1)
        ):
            raise ValueError(
                f"state_copies: expected a positive integer (4 for Adam), got {self.state_copies!r}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    """What the cost model expects one optimizer step of a plan to cost."""

    step_time_s: float
    """``pipeline_s + allreduce_s + optimizer_s``, or ``cpu_floor_s`` when that is longer."""
    bubble_ratio: float
    """Idle share of stage-time in the simulated pipeline."""
    peak_memory_bytes: dict[int, int]
    """Peak bytes per rank: parameter state, plus what in-flight micro-batches save for
    backward and the transient of the one computing (scaled by the rank's share)."""
    pipeline_s: float
    """Simulated time of the forward/backward pipeline (compute and non-hidden transfers)."""
    compute_s: float
    """Compute seconds of the busiest stage (DeepCEE's ``B * t_c``)."""
    transfer_s: float
    """Activation/gradient transfer time the schedule fails to hide behind compute (``t_l``):
    the simulated pipeline minus the same pipeline with free transfers."""
    allreduce_s: float
    """Gradient all-reduce of the slowest stage group (DeepCEE's ``AL``)."""
    optimizer_s: float
    """Optimizer step of the largest stage."""
    over_memory_ranks: tuple[int, ...]
    """Ranks whose predicted peak exceeds their ``memory_bytes``; empty when the plan fits."""
    cpu_floor_s: float = 0.0
    """The longest step a CPU quota allows (cost model, *Host CPU under a quota*): the slowest
    quota-limited device's compute, optimizer and host CPU at its quota; 0 without quotas.
    ``step_time_s`` is at least this."""
    hop_compression: tuple[str, ...] = ()
    """The compression method of each hop the prediction assumed (``()``: none)."""

    @property
    def fits_memory(self) -> bool:
        """True when every rank's predicted peak fits its memory."""
        return not self.over_memory_ranks

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (rank keys as strings)."""
        return {
            "step_time_s": self.step_time_s,
            "bubble_ratio": self.bubble_ratio,
            "peak_memory_bytes": {str(r): v for r, v in sorted(self.peak_memory_bytes.items())},
            "pipeline_s": self.pipeline_s,
            "compute_s": self.compute_s,
            "transfer_s": self.transfer_s,
            "allreduce_s": self.allreduce_s,
            "optimizer_s": self.optimizer_s,
            "over_memory_ranks": list(self.over_memory_ranks),
            "cpu_floor_s": self.cpu_floor_s,
            **({"hop_compression": list(self.hop_compression)} if self.hop_compression else {}),
        }
