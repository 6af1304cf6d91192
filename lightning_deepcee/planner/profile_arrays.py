"""Numpy views of one cluster profile, as the cost model reads them.

A :class:`~lightning_deepcee.profiler.ClusterProfile` is a tree of frozen tuples (two ``n x n``
link matrices among them), too slow to read per candidate. :class:`ProfileArrays` turns it once
into the arrays the cost model indexes: link matrices, per-device prefix sums of block times
(split into per-sample slope and fixed part), per-block bytes (output, held for backward,
transient, parameters), per-device memory, optimizer rates and CPU quotas, and the network
groups with the WAN capacity between them. An
:class:`~lightning_deepcee.planner.evaluator.Evaluator` owns one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from lightning_deepcee.profiler.data import ClusterProfile
from lightning_deepcee.profiler.grouping import group_by_network

__all__ = ["ProfileArrays"]

Array = npt.NDArray[np.float64]


class ProfileArrays:
    """Numpy views of one profile: matrices, per-sample prefix sums, per-block bytes.

    Prefix sums have a leading 0 column, so blocks ``[start, end)`` of device ``d`` take
    ``prefix[d, end] - prefix[d, start]``. Block times are split as the cost model describes
    (*Compute is affine in the micro-batch size*): for each of F, B, W and the whole backward in
    one call (BW) a per-sample slope (``forward``, ...) and the fixed part per call
    (``forward_fixed``, ...).
    """

    def __init__(self, profile: ClusterProfile) -> None:
        self.profile = profile
        devices = profile.devices
        self.latency: Array = profile.latency_matrix()
        self.bandwidth: Array = profile.bandwidth_matrix()
        ref = np.array([d.reference_microbatch_size for d in devices], dtype=np.float64)

        total = np.array([d.block_seconds for d in devices], dtype=np.float64)
        fixed = np.array([d.fixed_s for d in devices], dtype=np.float64)
        fixed_share = np.divide(fixed, total, out=np.zeros_like(total), where=total > 0)
        fixed_share = np.clip(fixed_share, 0.0, 1.0)

        def prefix(values: Array) -> Array:
            zero = np.zeros((len(ref), 1))
            return np.concatenate([zero, np.cumsum(values, axis=1)], axis=1)

        def split(name: str) -> tuple[Array, Array]:
            seconds = np.array([getattr(d, name) for d in devices], dtype=np.float64)
            per_sample = seconds * (1.0 - fixed_share) / ref[:, None]
            return prefix(per_sample), prefix(seconds * fixed_share)

        self.forward, self.forward_fixed = split("forward_s")
        self.backward_input, self.backward_input_fixed = split("backward_input_s")
        self.backward_weight, self.backward_weight_fixed = split("backward_weight_s")
        # The whole backward in one call (a BW action, a first stage) saves what B then W spend
        # twice per call (the graph walked twice, two dispatches): a fixed cost. Its slope is
        # B + W's; its fixed part is theirs less the saving (all of it at the measured size).
        split_s = np.array([d.backward_input_s for d in devices], dtype=np.float64) + np.array(
            [d.backward_weight_s for d in devices], dtype=np.float64
        )
        merged_s = np.array([d.merged_backward_s for d in devices], dtype=np.float64)
        split_fixed = split_s * fixed_share
        merged_fixed = np.clip(split_fixed - (split_s - merged_s), 0.0, None)
        self.backward: Array = prefix((merged_s - merged_fixed) / ref[:, None])
        """Per-sample prefix sums of the whole backward in one call (B + W's slope)."""
        self.backward_fixed: Array = prefix(merged_fixed)
        """Prefix sums of its fixed part per call."""
        num_calls = 3 * max(fixed.shape[1], 1)
        self.action_overhead: Array = fixed.sum(axis=1) / num_calls
        """Seconds each executor action costs a device beyond its compute: its mean per-call
        fixed cost (its ``fixed_s`` over all blocks, per F, B or W call); the cost model's
        *Runtime overhead*."""
        self.sample_s_prefix: Array = prefix(total / ref[:, None])
        """Prefix sums of F+B+W per sample *at the reference size* (fixed part included): the
        speed that batch shares and the compute-balanced partition use. The affine split of one
        profile into slope and intercept is noisy (two short measurements); the whole time at the
        measured size is not."""
        act = np.array([d.activation_bytes for d in devices], dtype=np.float64).max(axis=0)
        params = np.array([d.parameter_bytes for d in devices], dtype=np.float64).max(0)
        self.activation: Array = act
        """Output bytes per sample of each block (the largest over devices): what crosses a
        stage boundary."""
        saved = np.array([d.held_bytes for d in devices], dtype=np.float64).max(axis=0)
        self.saved_prefix: Array = np.concatenate([[0.0], np.cumsum(saved)])
        """Prefix sums of the bytes per sample each block holds per micro-batch in flight
        (``DeviceProfile.held_bytes``, the largest over devices)."""
        transient = np.array(
            [d.transient_bytes or (0,) * len(d.forward_s) for d in devices], dtype=np.float64
        ).max(axis=0)
        self.transient_peak: Array = np.zeros((len(transient) + 1, len(transient) + 1))
        """``[start, end]``: the largest transient bytes per sample of blocks ``[start, end)``
        beyond what they hold (the largest over devices; 0 where not measured)."""
        for start in range(len(transient)):
            self.transient_peak[start, start + 1 :] = np.maximum.accumulate(transient[start:])
        self.parameter_prefix: Array = np.concatenate([[0.0], np.cumsum(params)])
        self.memory: Array = np.array([d.memory_bytes for d in devices], dtype=np.float64)
        self.optimizer_rate: Array = np.array(
            [d.optimizer_s_per_byte for d in devices], dtype=np.float64
        )
        """Measured optimizer seconds per parameter byte of each device; 0 = not measured."""
        self.cpu_share: Array = np.array([d.cpu_share for d in devices], dtype=np.float64)
        self.cpu_period: Array = np.array([d.cpu_period_s for d in devices], dtype=np.float64)
        self.has_quota = any(d.has_cpu_quota for d in devices)
        """Whether any device runs under a CPU quota (the simulator then models it)."""
        groups = group_by_network(self.bandwidth)
        self.network_groups = groups
        """First-level network groups (:func:`group_by_network`, default config)."""
        self.network_group = np.zeros(len(ref), dtype=np.intp)
        """First-level network group of each rank (:func:`group_by_network`, default config)."""
        for index, members in enumerate(groups):
            self.network_group[list(members)] = index
        count = len(groups)
        self.group_capacity: Array = np.full((count, count), np.inf)
        """Bytes/s that all traffic from group ``a`` to group ``b`` shares (``a != b``): the
        median pair between them, a reading of the WAN link every such pair crosses."""
        for a in range(count):
            self.group_capacity[a] = _median_by_label(
                self.bandwidth[self.network_group == a], self.network_group, count, a
            )

    def optimizer_rates(self, ranks: Sequence[int], default: float) -> Array:
        """Optimizer seconds per parameter byte of ``ranks``: measured, else ``default``."""
        measured = self.optimizer_rate[np.asarray(ranks)]
        return np.where(measured > 0, measured, default)

    def parameter_bytes(self, block_range: tuple[int, int]) -> float:
        """Parameter bytes of the blocks ``[start, end)`` (the largest over devices)."""
        return float(self.parameter_prefix[block_range[1]] - self.parameter_prefix[block_range[0]])

    def saved_bytes(self, block_range: tuple[int, int]) -> float:
        """Bytes per sample a stage on blocks ``[start, end)`` holds per micro-batch in flight,
        from its F to its W: what all its blocks save for backward."""
        start, end = block_range
        return float(self.saved_prefix[end] - self.saved_prefix[start])

    def transient_bytes(self, block_range: tuple[int, int]) -> float:
        """Bytes per sample a stage needs beyond what it holds while it computes: the largest
        transient of its blocks (they run one at a time)."""
        return float(self.transient_peak[block_range])


def _median_by_label(rows: Array, labels: npt.NDArray[np.intp], count: int, skip: int) -> Array:
    """The median of the finite entries of ``rows`` in each column label ``0..count-1``
    (``inf`` where a label has none, and for label ``skip``): one sort for all labels, as
    ``np.median`` per label would take a call per pair of groups."""
    values = rows.ravel()
    column = np.broadcast_to(labels, rows.shape).ravel()
    keep = np.isfinite(values) & (column != skip)
    values, column = values[keep], column[keep]
    order = np.lexsort((values, column))
    values, column = values[order], column[order]
    counts = np.bincount(column, minlength=count)
    starts = np.cumsum(counts) - counts
    out = np.full(count, np.inf)
    has = counts > 0
    low = (starts + (counts - 1) // 2)[has]
    high = (starts + counts // 2)[has]
    out[has] = (values[low] + values[high]) / 2
    return out
