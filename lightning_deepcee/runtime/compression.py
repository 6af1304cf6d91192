"""Codecs for the compression methods of :mod:`lightning_deepcee.planner.compression`.

:func:`encode` turns a float32 tensor into the method's wire bytes (a flat ``uint8`` tensor)
and :func:`decode` turns them back, given the shape; the transport calls both, so the executor
and the autograd graph only ever see float32 tensors. Encoding runs where the tensor is (a GPU
encodes before a gloo group stages the smaller payload through host memory).

Tile-wise Hadamard quantization (``tah8``/``tah4``): the values, padded with zeros to whole
tiles, are rotated tile by tile by the orthonormal Hadamard matrix ``H`` (``H = H^T = H^-1``),
scaled by each tile's largest magnitude over ``qmax`` and rounded to nearest. The payload is the
tiles' bf16 scales followed by their codes (one byte per value at 8 bits; two values per byte at
4 bits, offset by 8). Rounding is deterministic: the same tensor always sends the same bytes.

torch only.
"""

from __future__ import annotations

import functools
import math

import torch

from lightning_deepcee.planner.compression import METHODS, TILE, CompressionMethod

__all__ = ["BY_CODE", "decode", "encode", "encodes"]

_SCALE_UP = 1.0 + 2.0**-7
"""Scales are stored in bfloat16 (relative rounding error at most 2^-8), raised by this factor
first so that the stored scale is never below the tile's largest magnitude over ``qmax``."""

BY_CODE: dict[int, CompressionMethod] = {m.code: m for m in METHODS.values()}


def encodes(method: CompressionMethod, tensor: torch.Tensor) -> bool:
    """Whether ``method`` compresses ``tensor``: a method other than off, on float32 values."""
    return method.code != 0 and tensor.dtype == torch.float32


@functools.lru_cache(maxsize=8)
def _hadamard(device: torch.device) -> torch.Tensor:
    """The orthonormal ``TILE x TILE`` Hadamard matrix (Sylvester's construction)."""
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < TILE:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(TILE)).to(device)


def encode(method: CompressionMethod, tensor: torch.Tensor) -> torch.Tensor:
    """The wire bytes of float32 ``tensor`` under ``method`` (see :func:`encodes`)."""
    flat = tensor.detach().reshape(-1)
    if method.name == "bf16":
        return flat.to(torch.bfloat16).view(torch.uint8)
    n = flat.numel()
    tiles = math.ceil(n / TILE)
    padded = torch.zeros(tiles * TILE, dtype=torch.float32, device=flat.device)
    padded[:n] = flat
    rotated = padded.view(tiles, TILE) @ _hadamard(flat.device)
    qmax = 2 ** (method.bits - 1) - 1
    # A bf16 scale, rounded up (by more than bf16's half-ulp) so that no code exceeds qmax.
    scale = (rotated.abs().amax(dim=1) * (_SCALE_UP / qmax)).to(torch.bfloat16)
    wide = scale.to(torch.float32)
    safe = torch.where(wide > 0, wide, torch.ones_like(wide))
    codes = torch.round(rotated / safe[:, None]).clamp_(-qmax, qmax).to(torch.int16)
    if method.bits == 8:
        packed = (codes + 128).to(torch.uint8).view(-1)
    else:
        nibbles = (codes + 8).to(torch.uint8).view(-1, 2)
        packed = nibbles[:, 0] | (nibbles[:, 1] << 4)
    return torch.cat([scale.view(torch.uint8), packed])


def decode(
    method: CompressionMethod, payload: torch.Tensor, shape: list[int] | torch.Size
) -> torch.Tensor:
    """The float32 tensor of ``shape`` that :func:`encode` sent as ``payload``."""
    n = math.prod(shape)
    if method.name == "bf16":
        return payload.view(torch.bfloat16).to(torch.float32).reshape(shape)
    tiles = math.ceil(n / TILE)
    scale = payload[: tiles * 2].view(torch.bfloat16).to(torch.float32)
    packed = payload[tiles * 2 :]
    if method.bits == 8:
        codes = packed.to(torch.int16) - 128
    else:
        codes = torch.stack([packed & 15, packed >> 4], dim=1).to(torch.int16) - 8
    rotated = codes.view(tiles, TILE).to(torch.float32) * scale[:, None]
    values = rotated @ _hadamard(payload.device)
    return values.reshape(-1)[:n].reshape(shape)
