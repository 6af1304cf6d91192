"""The codecs keep their stated error bounds and byte counts on every kind of tensor."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_deepcee.planner.compression import METHODS, TILE
from lightning_deepcee.runtime.compression import decode, encode, encodes

LOSSY = [name for name in METHODS if name != "off"]


def _cases() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    spiky = torch.zeros(5, TILE)
    spiky[:, 3] = torch.tensor([1e-30, 1.0, -7.0, 1e20, 3e-3])  # all of a tile in one value
    return [
        torch.randn(3, 5, 7, generator=gen),  # not a whole number of tiles
        torch.randn(128, 256, generator=gen) * 1e-6,  # gradient-sized values
        torch.randn(64, 96, generator=gen).exp() * 50,  # heavy tail, all positive
        spiky,
        torch.full((2, TILE), -3.5),
        torch.tensor(2.5),  # 0-dim
    ]


@pytest.mark.parametrize("name", LOSSY)
def test_round_trip_within_the_stated_bound_tile_by_tile(name: str) -> None:
    method = METHODS[name]
    for x in _cases():
        payload = encode(method, x)
        assert payload.dtype == torch.uint8 and payload.numel() == method.wire_bytes(x.numel())
        y = decode(method, payload, x.shape)
        assert y.shape == x.shape and y.dtype == torch.float32
        if name == "bf16":  # per value
            assert torch.all((y - x).abs() <= x.abs() * method.worst_error)
            continue
        n = x.numel()
        tiles = math.ceil(n / TILE)
        pad = tiles * TILE - n
        xt = torch.nn.functional.pad(x.reshape(-1).double(), (0, pad)).view(tiles, TILE)
        yt = torch.nn.functional.pad(y.reshape(-1).double(), (0, pad)).view(tiles, TILE)
        error, norm = (yt - xt).norm(dim=1), xt.norm(dim=1)
        assert torch.all(error <= norm * method.worst_error * (1 + 1e-5)), (error / norm).max()


@pytest.mark.parametrize("name", LOSSY)
def test_typical_error_on_gaussian_data(name: str) -> None:
    method = METHODS[name]
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(1))
    y = decode(method, encode(method, x), x.shape)
    relative = ((y - x).norm() / x.norm()).item()
    assert 0.5 * method.typical_error < relative < 1.3 * method.typical_error, relative


@pytest.mark.parametrize("name", LOSSY)
def test_zeros_stay_zeros_and_encoding_is_deterministic(name: str) -> None:
    method = METHODS[name]
    zeros = torch.zeros(3, 40)
    assert torch.equal(decode(method, encode(method, zeros), zeros.shape), zeros)
    x = torch.randn(10, 33)
    assert torch.equal(encode(method, x), encode(method, x.clone()))


def test_wire_bytes_shrink_by_the_method_ratio() -> None:
    assert METHODS["off"].wire_bytes(1000) == 4000
    assert METHODS["bf16"].ratio == 0.5
    # bits per value plus one 16-bit scale per tile of 32 values
    assert METHODS["tah8"].ratio == pytest.approx((8 + 16 / TILE) / 32)
    assert METHODS["tah4"].ratio == pytest.approx((4 + 16 / TILE) / 32)


def test_only_float32_is_encoded() -> None:
    for name in LOSSY:
        assert encodes(METHODS[name], torch.zeros(2))
        for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool):
            assert not encodes(METHODS[name], torch.zeros(2, dtype=dtype))
    assert not encodes(METHODS["off"], torch.zeros(2))
