"""The stage copies' bucketed gradient sum equals one flat all-reduce, and starts during backward.

Three gloo ranks hold the same small model and compute different gradients (two micro-batches,
the hooks armed for the second only, as the executor arms them). ``BucketedGradSync`` must give
every rank the sum that ``sum_gradients`` (one flat all-reduce after the step) gives: with
buckets of one parameter each (every bucket started by a hook, in order) and with one bucket for
all; a rank with no rows this step (it never arms, and sums zeros) and a parameter that gets no
gradient (zeros) included.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_deepcee.runtime.grad_buckets import BucketedGradSync
from lightning_deepcee.runtime.stage_groups import sum_gradients

pytestmark = pytest.mark.multiprocess

WORLD = 3


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.seq = nn.Sequential(
            nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)
        )
        self.unused = nn.Linear(3, 3)  # never in the graph: no gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq(x)


def _model() -> nn.Module:
    return _Net()


def _backward(model: nn.Module, rank: int, step: int, micro: int) -> None:
    torch.manual_seed(100 * rank + 10 * step + micro)
    model(torch.randn(5, 6)).pow(2).mean().backward()


def _grads(rank: int, bucket_bytes: int | None) -> list[dict[str, object]]:
    """Two steps on one model; per step, the gradients and how many buckets started early."""
    model = _model()
    params = list(model.parameters())
    group = dist.new_group(list(range(WORLD)))
    sync = (
        None if bucket_bytes is None else BucketedGradSync(params, group, bucket_bytes=bucket_bytes)
    )
    steps = []
    for step in range(2):
        for p in params:
            p.grad = None
        if rank != 2:  # rank 2 has no rows: no backward, never armed
            _backward(model, rank, step, 0)
            if sync is not None:
                sync.arm()
            _backward(model, rank, step, 1)
        if sync is None:
            sum_gradients(params, group)
        else:
            sync.finish()
        steps.append(
            {
                "grads": [
                    p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params
                ],
                "early": 0 if sync is None else sync.started_early,
                "buckets": 0 if sync is None else sync.num_buckets,
            }
        )
    return steps


def _worker(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    reference = _grads(rank, None)
    result: dict[str, object] = {}
    for name, size in (("per_parameter", 1), ("one_bucket", 2**30)):
        steps = _grads(rank, size)
        result[name] = [
            {
                "close": all(
                    torch.allclose(g, r, rtol=1e-6, atol=1e-7)
                    for g, r in zip(got["grads"], ref["grads"], strict=True)  # type: ignore[call-overload]
                ),
                "early": got["early"],
                "buckets": got["buckets"],
            }
            for got, ref in zip(steps, reference, strict=True)
        ]
    unused = reference[0]["grads"][-1]  # type: ignore[index]
    result["unused_zero"] = bool(torch.count_nonzero(unused) == 0)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_bucketed_sums_equal_one_flat_all_reduce_and_start_during_backward(
    tmp_path: Path,
) -> None:
    init = f"file://{tmp_path / 'store'}"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(init, str(tmp_path)), nprocs=WORLD, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for rank, result in enumerate(results):
        for name in ("per_parameter", "one_bucket"):
            assert all(step["close"] for step in result[name]), (rank, name, result[name])
        assert [step["buckets"] for step in result["one_bucket"]] == [1, 1]
        # 3 linears x (weight, bias), and the unused layer's 2.
        assert [step["buckets"] for step in result["per_parameter"]] == [8, 8]
        assert result["unused_zero"]
    # First step: the buckets follow the reverse parameter order, and the unused layer's come
    # first, so nothing can start before finish. From the second step they follow the order
    # the first backward completed them in (rank 0's, broadcast), the unused last: the armed
    # ranks start the 6 used parameters' buckets during backward; the rank with no rows none.
    early = [[step["early"] for step in r["per_parameter"]] for r in results]
    assert early == [[0, 6], [0, 6], [0, 0]]
