"""benchmarks/elastic_bench.py's figures: step time, what a loss cost, and its table."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from tests.helpers.benchmarks import load_benchmark


def _bench() -> ModuleType:
    return load_benchmark("elastic_bench")


def _row(step: int, t: float, start: int = 0, world: int = 6) -> dict[str, Any]:
    return {"step": step, "t": t, "start": start, "world": world}


# Steps 1-8 on six devices (one a second, step 6 slow), killed at t=8.5 in step 9; the job
# resumes at step 6 (checkpoint at 5) on five devices at t=40.
ROWS = [_row(s, float(s) + (2.0 if s >= 6 else 0.0)) for s in range(1, 9)] + [
    _row(s, 34.0 + s, start=1, world=5) for s in range(6, 10)
]


def test_step_time_is_the_median_gap_within_one_start() -> None:
    bench = _bench()
    first = [r for r in ROWS if r["start"] == 0]
    assert bench.step_time(first, warmup=2) == pytest.approx(1.0)  # the 3 s gap is outvoted
    assert bench.step_time(first, warmup=2, mean=True) == pytest.approx(8.0 / 6)  # not here
    assert bench.step_figures(ROWS, 2) == {
        "step_s": pytest.approx(1.0),
        "step_mean_s": pytest.approx(8.0 / 6),
    }
    assert bench.step_time(ROWS, warmup=100) is None
    # A gap across a restart never counts, even when the steps are consecutive; nor the step
    # that recovered in process.
    assert bench.step_time([_row(5, 0.0), _row(6, 50.0, start=1)], warmup=0) is None
    recovered = {**_row(6, 20.0), "recovery": {"seconds": 19.0}}
    assert bench.step_time([_row(5, 0.0), recovered, _row(7, 21.0)], warmup=0) == 1.0


def test_loss_figures() -> None:
    figures = _bench().loss_figures(ROWS, killed_at=10.5)
    assert figures == {
        "kill_to_first_step_s": 29.5,  # step 6 of the second start at t=40
        "steps_redone": 3,  # steps 6, 7, 8 trained twice
        "world_before": 6,
        "world_after": 5,
        "restarts": 1,
    }
    assert _bench().loss_figures(ROWS, killed_at=None) == {}


def test_loss_figures_of_a_recovery_in_process() -> None:
    """No restart: the steps go on in the same start; the failed step's row carries the
    recovery's record (steps redone, phases)."""
    record = {"lost": ["edge0"], "steps_redone": 3, "seconds": 9.0, "named": 4.0, "redo": 3.0}
    rows = [_row(s, float(s)) for s in range(1, 9)] + [
        {**_row(9, 19.5, world=5), "recovery": record},
        _row(10, 20.5, world=5),
    ]
    figures = _bench().loss_figures(rows, killed_at=8.5)
    assert figures == {
        "kill_to_first_step_s": 11.0,  # the end of step 9, the one that failed
        "steps_redone": 3,
        "world_before": 6,
        "world_after": 5,
        "restarts": 0,
        "recovery": record,
    }


def test_render_compares_with_the_run_without_checkpoints() -> None:
    result = {
        "config": {"topology": "configs/lab/cee6.yaml", "size": "gpt5m", "global_batch": 48,
                   "runs": 1, "kill": "edge0", "kill_step": 17,
                   "config": "configs/bench/elastic_cee6_gpt5m.yaml"},
        "date": "2026-12-03",
        "commit": "abc1234",
        "arms": {
            "off": [{"step_s": 1.0, "step_mean_s": 1.0}],
            "async@5": [{"step_s": 1.05, "step_mean_s": 1.2}],
            "loss@5": [{"step_s": 1.0, "step_mean_s": 1.0, "kill_to_first_step_s": 11.0,
                        "steps_redone": 2, "world_before": 6, "world_after": 5, "restarts": 0,
                        "recovery": {"seconds": 9.5, "named": 4.0, "regroup": 0.5, "plan": 1.0,
                                     "load": 1.0, "redo": 2.0, "step": 1.0}}],
            "restart@5": [{"step_s": 1.0, "step_mean_s": 1.0, "kill_to_first_step_s": 61.0,
                           "steps_redone": 2, "world_before": 6, "world_after": 5,
                           "restarts": 1}],
        },
    }  # fmt: skip
    table = _bench().render(result)
    assert "| async@5 | 1.050 | +5.0% | 1.200 | +20.0% | - | - | - | - |" in table
    assert "| loss@5 | 1.000 | +0.0% | 1.000 | +0.0% | 11.0 | 2 | 6->5 | in process |" in table
    assert "| restart@5 | 1.000 | +0.0% | 1.000 | +0.0% | 61.0 | 2 | 6->5 | 1 restart(s) |" in table
    # Where the recovery's seconds went: one row per arm that recovered in process.
    assert "| loss@5 | 4.0 | 0.5 | 1.0 | 1.0 | 2.0 | 1.0 | 9.5 |" in table
    assert "| restart@5 | 4" not in table
    assert "2026-12-03 at commit abc1234" in table
    assert "may have run different plans" in table  # no shared plan recorded


def test_render_names_the_shared_plan() -> None:
    plan = {
        "stages": [{"block_range": [0, 4], "ranks": [0, 1]}, {"block_range": [4, 8], "ranks": [2]}],
        "schedule": "zb",
        "num_microbatches": 6,
    }
    sentence = _bench()._plan_sentence({"plan": plan})
    assert "2 stages, ranks 0,1 | 2; zb, 6 micro-batches" in sentence
    assert "differ only by checkpoints" in sentence


def test_return_figures_time_the_device_back_and_the_job_s_longest_pause() -> None:
    """Five devices after the loss; the device starts again at t=20.5 and is used from step 14
    on (the admission paused the job between steps 13 and 14)."""
    admitted = {"device": "edge0", "world": 6, "seconds": 3.0, "checkpoint": 0.5, "waited": 1.0}
    rows = [_row(s, float(s) + 10.0, world=5) for s in range(10, 14)] + [
        {**_row(14, 27.5), "admission": admitted},
        _row(15, 28.5),
    ]
    figures = _bench().return_figures(rows, joined_at=20.5, n=6)
    assert figures == {
        "start_to_used_s": 7.0,  # the end of step 14, the first on six devices
        "longest_pause_s": 4.5,  # step 13 at t=23 -> step 14 at t=27.5
        "used_from_step": 14,
        "admission": admitted,
    }
    assert _bench().return_figures(rows, joined_at=None, n=6) == {}
    never = _bench().return_figures(rows[:4], joined_at=20.5, n=6)  # no step used it
    assert never["start_to_used_s"] is None and never["longest_pause_s"] == 1.0


def test_render_lists_each_run_of_a_return() -> None:
    admitted = {"seconds": 3.0, "checkpoint": 0.5, "waited": 1.0, "plan": 1.4, "load": 0.1}
    runs = [
        {"step_s": 1.0, "step_mean_s": 1.0, "start_to_used_s": used, "longest_pause_s": pause,
         "admission": admitted}
        for used, pause in ((27.5, 4.3), (25.0, 9.0), (30.0, 4.0))
    ]  # fmt: skip
    result = {
        "config": {"topology": "t.yaml", "size": "gpt5m", "global_batch": 48, "runs": 3,
                   "kill": "edge0", "kill_step": 17},
        "date": "2026-12-07",
        "commit": "abc1234",
        "arms": {"return@5": runs, "restart@5": [{"step_s": 1.0, "step_mean_s": 1.0}]},
    }  # fmt: skip
    table = _bench().render(result)
    assert "| return@5 | 27.5 / 25.0 / 30.0 | 27.5 | 9.0 | 0.5 | 1.0 | 1.4 | 0.1 | 3.0 |" in table
    assert "| restart@5 | 27" not in table  # no return in that arm
