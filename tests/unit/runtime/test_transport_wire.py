"""Which device a tensor travels on: gloo moves host memory only, NCCL moves GPU memory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_deepcee.runtime import all_reduce_, wire_device


@pytest.fixture
def gloo_world_of_one(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_gloo_stages_cuda_tensors_through_the_host(gloo_world_of_one: None) -> None:
    # torch.device("cuda") needs no GPU to exist: the choice depends on type and backend only.
    assert wire_device(torch.device("cuda", 0)) == torch.device("cpu")
    assert wire_device(torch.device("cpu")) == torch.device("cpu")


def test_all_reduce_in_place_on_host_tensors(gloo_world_of_one: None) -> None:
    value = torch.tensor([1.5, -2.0])
    out = all_reduce_(value)
    assert out is value  # in place, as dist.all_reduce
    torch.testing.assert_close(value, torch.tensor([1.5, -2.0]))  # world of one: the sum is x
