"""Compression on the pipeline's hops, as the cost model sees it: bytes, codec time, choice.

A hop's method shrinks the bytes its activation and gradient take over the link
(``CompressionMethod.ratio``) and costs both of its stages an encode and a decode per
micro-batch, charged like the device's optimizer: ``cost_factor`` times its measured seconds
per parameter byte, per value (both are passes over memory on the same device). The planner
chooses per hop among the methods the user allows (``CostModelConfig.compression``).

Pure: numpy and the standard library.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np

from lightning_deepcee.planner.compression import METHODS, CompressionMethod
from lightning_deepcee.planner.plan import StagePlan
from lightning_deepcee.planner.prediction import CostModelConfig
from lightning_deepcee.planner.profile_arrays import ProfileArrays

__all__ = ["HOP_MARGIN", "HopCodecs"]

HOP_MARGIN = 0.05
"""A hop takes a lossier method only if it moves the hop faster than the next by more than this
share of its slower stage's compute per micro-batch."""


class HopCodecs:
    """The hops' compression costs on one profile; ``transfer_time_s`` is the evaluator's."""

    def __init__(
        self,
        arrays: ProfileArrays,
        config: CostModelConfig,
        transfer_time_s: Callable[[StagePlan, StagePlan, float], float],
    ) -> None:
        self._arrays = arrays
        self._config = config
        self._transfer_time_s = transfer_time_s

    def boundary_bytes(self, sender: StagePlan, b: float) -> float:
        """Bytes of a ``b``-sample micro-batch's activation that ``sender`` passes on (fp32)."""
        return float(self._arrays.activation[sender.block_range[1] - 1]) * b

    def codec_time_s(self, stage: StagePlan, method: CompressionMethod, num_bytes: float) -> float:
        """Seconds ``stage`` spends on one micro-batch of a hop that carries ``num_bytes`` (fp32)
        each way, encoding one direction with ``method`` and decoding the other (its slowest
        device, on its share of the rows)."""
        if method.code == 0:
            return 0.0
        rates = self._arrays.optimizer_rates(stage.ranks, self._config.optimizer_s_per_byte)
        shares = np.asarray(stage.batch_shares)
        return float((rates * shares).max()) * num_bytes / 4 * method.cost_factor

    def hop_time_s(self, sender: StagePlan, receiver: StagePlan, method: str, b: float) -> float:
        """A ``b``-sample micro-batch's activation and gradient over the hop with ``method``:
        both directions on the wire plus both stages' encode and decode."""
        codec = METHODS[method]
        num_bytes = self.boundary_bytes(sender, b)
        return (
            self._transfer_time_s(sender, receiver, num_bytes * codec.ratio)
            + self._transfer_time_s(receiver, sender, num_bytes * codec.ratio)
            + self.codec_time_s(sender, codec, num_bytes)
            + self.codec_time_s(receiver, codec, num_bytes)
        )

    def explain(self, stages: Sequence[StagePlan], b: float, hops: Sequence[str]) -> str:
        """Why each compressed hop is: a ``b``-sample micro-batch's activation and gradient over
        its link in fp32 and with its method (codec time included); empty when none is."""
        parts = []
        for h, method in enumerate(hops):
            if method == "off":
                continue
            sender, receiver = stages[h], stages[h + 1]
            moved = [self.hop_time_s(sender, receiver, m, b) for m in ("off", method)]
            parts.append(
                f"hop {h}->{h + 1} {method}: a micro-batch's activation and gradient take "
                f"{moved[0] * 1e3:.1f} ms in fp32, {moved[1] * 1e3:.1f} ms compressed"
            )
        return "; ".join(parts)

    def choose(
        self, stages: Sequence[StagePlan], b: float, compute_s: Sequence[float]
    ) -> tuple[str, ...]:
        """Per hop, the method of ``config.compression`` (or off) that moves a ``b``-sample
        micro-batch's activation and gradient fastest, counting both ends' encode and decode;
        among the methods within ``HOP_MARGIN`` of the hop's stages' compute per micro-batch
        (``compute_s``, the slower of the two) of the fastest, the most accurate: a hop whose
        transfers are small beside its compute stays exact. ``()`` when the config allows none
        or every hop stays off."""
        allowed = self._config.compression
        if not allowed or len(stages) < 2:
            return ()
        chosen = []
        for h, (sender, receiver) in enumerate(itertools.pairwise(stages)):
            seconds = {n: self.hop_time_s(sender, receiver, n, b) for n in ("off", *allowed)}
            fastest = min(seconds.values())
            slack = HOP_MARGIN * max(compute_s[h], compute_s[h + 1])
            near = [n for n, t in seconds.items() if t <= fastest + slack]
            chosen.append(min(near, key=lambda n: METHODS[n].typical_error))
        return () if all(name == "off" for name in chosen) else tuple(chosen)
