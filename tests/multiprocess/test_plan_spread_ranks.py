"""The spread plan search over gloo: every rank gets the serial search's plan, calls run on the
ranks they were assigned to, and a failure on any rank raises on every rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_deepcee.planner.search import plan_search
from lightning_deepcee.planner.subsets import restrict
from lightning_deepcee.profiler.data import ClusterProfile
from lightning_deepcee.runtime.spread_search import assign_calls, spread, spread_plan_search
from tests.helpers.paths import EXAMPLE_PROFILE as EXAMPLE

pytestmark = pytest.mark.multiprocess

WORLD = 3

WEIGHTS = [2.0, 1.0, 1.0]


def _profile() -> ClusterProfile:
    """A cloud, an edge and an end device of the example cluster, as ranks 0-2."""
    return restrict(ClusterProfile.from_yaml(EXAMPLE), (0, 2, 4))


def _rank_of(item: int) -> tuple[int, int]:
    return item * item, dist.get_rank()


def _fail_on_rank_2(item: int) -> int:
    if dist.get_rank() == 2:
        raise ArithmeticError(f"item {item}")
    return item


def _outcome(call: Any) -> str:
    try:
        call()
    except Exception as error:  # the test compares the messages
        return f"{type(error).__name__}: {error}"
    return "no error"


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    result: dict[str, Any] = {}
    result["mapped"] = spread(
        lambda map_fn: [map_fn(_rank_of, range(8)), map_fn(_rank_of, [])], WEIGHTS
    )
    profile = _profile()
    result["plan"] = spread_plan_search(
        profile, num_blocks=profile.num_blocks, global_batch_size=48
    ).to_dict()
    result["call_failed"] = _outcome(
        lambda: spread(lambda map_fn: map_fn(_fail_on_rank_2, range(6)), WEIGHTS)
    )

    def fail_on_rank_0(map_fn: Any) -> None:
        raise LookupError("no plan fits")

    result["work_failed"] = _outcome(lambda: spread(fail_on_rank_0, WEIGHTS))
    # The group still works after the failures: every rank left each spread at the same point.
    result["after"] = spread(lambda map_fn: map_fn(_rank_of, range(3)), WEIGHTS)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_spread_over_three_ranks(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'store'}"
    mp.start_processes(_worker, args=(init, str(tmp_path)), nprocs=WORLD, start_method="spawn")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    owners = assign_calls([1.0] * 8, WEIGHTS)
    assert sorted(set(owners)) == [0, 1, 2]
    expected = [[[i * i, owners[i]] for i in range(8)], []]
    profile = _profile()
    serial = plan_search(profile, num_blocks=profile.num_blocks, global_batch_size=48).to_dict()
    for rank, got in enumerate(results):
        assert got["mapped"] == expected, rank
        assert got["plan"] == json.loads(json.dumps(serial)), rank
        assert "ArithmeticError: item" in got["call_failed"], rank
        assert "rank 2" in got["call_failed"], rank
        assert "LookupError: no plan fits" in got["work_failed"], rank
        assert got["after"] == [[i * i, assign_calls([1.0] * 3, WEIGHTS)[i]] for i in range(3)], (
            rank
        )
