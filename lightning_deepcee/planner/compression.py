"""Compression methods for what crosses a pipeline hop: their names, wire bytes and costs.

A pipeline hop (stage ``s`` to stage ``s + 1``) carries each micro-batch's boundary activation
forward and its gradient back. Over a slow WAN link those bytes dominate the step; a method here
sends fewer of them at the price of some compute on both ends and a bounded rounding error.
The planner chooses one method per hop (``Plan.hop_compression``) from those the user allows
(``CostModelConfig.compression``); the runtime's codecs
(:mod:`lightning_deepcee.runtime.compression`) implement them. Only ``float32`` tensors are
compressed; anything else crosses unchanged.

- ``"off"``: fp32 as is. Exact.
- ``"bf16"``: rounded to bfloat16; 2 bytes per value, relative error at most 2^-8 per value.
- ``"tah8"`` / ``"tah4"``: tile-wise Hadamard quantization (the TAH-Quant kind): every tile of
  ``TILE`` consecutive values is rotated by the orthonormal Hadamard matrix (which spreads an
  outlier over the tile), scaled by its largest magnitude and rounded to 8 or 4-bit integers;
  one bfloat16 scale per tile. No per-sample state and no error feedback: the rounding error is
  bounded per tile (below) and unbiased in sign across tiles.

Error bounds, per tile ``x`` (``qmax = 2^(bits-1) - 1``): rounding moves each rotated value by at
most half the tile's scale, ``max|Hx| / (2 qmax)`` raised by at most 1.2% (the bf16 scale is
rounded up), and the rotation keeps L2 norms, so ``|x - x'|_2 <= 1.012 sqrt(TILE) |x|_2 /
(2 qmax)``: ``worst_error`` is that bound relative to the tile's norm (a tile whose energy sits in
one rotated value); ``typical_error`` is the relative L2 error on Gaussian data, which
activations and gradients resemble after the rotation.

Pure: standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["AUTO", "METHODS", "TILE", "CompressionMethod", "allowed_methods", "check_hops"]

TILE = 32
"""Values per Hadamard tile (a power of two); each tile carries one bfloat16 scale."""


@dataclass(frozen=True, slots=True)
class CompressionMethod:
    """One way to send a float32 tensor over a hop."""

    name: str
    code: int
    """The method's number in a transfer's header (0 = sent as is)."""
    bits: int
    """Bits per value on the wire (scales aside)."""
    cost_factor: float
    """Encode plus decode seconds per value, as a multiple of the device's optimizer (Adam)
    seconds per parameter byte: both are a few passes over memory on the same device. Measured
    with the runtime's codecs on one CPU core (``benchmarks/codec_speed.py``)."""
    worst_error: float
    """Guaranteed bound on the relative L2 error of a round trip, per tile (see module doc)."""
    typical_error: float
    """Relative L2 error of a round trip on Gaussian data."""

    def wire_bytes(self, num_values: int) -> int:
        """Bytes on the wire for ``num_values`` float32 values."""
        if self.code == 0:
            return 4 * num_values
        if self.name == "bf16":
            return 2 * num_values
        tiles = math.ceil(num_values / TILE)
        return tiles * 2 + tiles * TILE * self.bits // 8

    @property
    def ratio(self) -> float:
        """Wire bytes per fp32 byte, for large tensors."""
        return self.wire_bytes(TILE * 1024) / (4 * TILE * 1024)


def _hadamard(bits: int, cost_factor: float, code: int) -> CompressionMethod:
    qmax = 2 ** (bits - 1) - 1
    # The stored bf16 scale is at most (1 + 2^-7)(1 + 2^-8) times max|Hx| / qmax.
    worst = math.sqrt(TILE) / (2 * qmax) * (1 + 2.0**-7) * (1 + 2.0**-8)
    # Gaussian tile: max of TILE normals ~ 2.4 sigma; uniform rounding error ~ scale / sqrt(12).
    typical = 2.4 / (qmax * math.sqrt(12.0))
    return CompressionMethod(f"tah{bits}", code, bits, cost_factor, worst, typical)


METHODS: dict[str, CompressionMethod] = {
    "off": CompressionMethod("off", 0, 32, 0.0, 0.0, 0.0),
    "bf16": CompressionMethod("bf16", 1, 16, 0.8, 2.0**-8, 2.0**-9),
    "tah8": _hadamard(8, 10.0, 2),
    "tah4": _hadamard(4, 13.0, 3),
}
"""Every method by name; ``code`` is its index in this order."""

AUTO = ("bf16", "tah8")
"""What ``"auto"`` allows: the methods whose error per message is under 1%. ``tah4`` (about 10%)
must be named: on cee7_thinwan it took 70 steps to the validation loss that fp32 reached in 60
(``benchmarks/results/tta_cee7_thinwan_tah4.md``)."""


def allowed_methods(setting: str | Sequence[str]) -> tuple[str, ...]:
    """The methods a ``compression`` setting lets the planner choose, besides ``"off"``.

    ``"off"`` (none), ``"auto"`` (:data:`AUTO`), one method's name, or a list of names.
    """
    if isinstance(setting, str):
        if setting == "off":
            return ()
        if setting == "auto":
            return AUTO
        names: Sequence[str] = (setting,)
    elif isinstance(setting, Sequence) and all(isinstance(n, str) for n in setting):
        names = setting
    else:
        raise ValueError(
            f"compression: expected 'off', 'auto', a method name or a list of them, got {setting!r}"
        )
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(
            f"compression: unknown method(s) {unknown}; choose from 'off', 'auto', "
            f"{', '.join(repr(n) for n in METHODS if n != 'off')}"
        )
    return tuple(dict.fromkeys(n for n in names if n != "off"))


def check_hops(hops: object, num_stages: int) -> tuple[str, ...]:
    """``hops`` as a tuple of method names, one per hop, or ``()`` (no hop compressed)."""
    if isinstance(hops, (str, bytes)) or not isinstance(hops, Sequence):
        raise ValueError(f"hop_compression: expected a list of method names, got {hops!r}")
    if len(hops) not in (0, num_stages - 1) or any(h not in METHODS for h in hops):
        raise ValueError(
            f"hop_compression: expected one of {sorted(METHODS)} per hop ({num_stages - 1} "
            f"hops), got {list(hops)!r}"
        )
    out = tuple(str(h) for h in hops)
    return () if all(h == "off" for h in out) else out
