"""Benchmark tables: lab_bench's set-up of each planned run, tta_bench's target and invocation."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _bench(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(ROOT / "benchmarks"))  # tta_bench imports lab_bench
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _lab_bench() -> ModuleType:
    return _bench("lab_bench")


def _result(setup: dict[str, float] | None) -> dict[str, Any]:
    run: dict[str, Any] = dict(
        run=0, samples_per_s=50.0, global_batch=48, world_size=2, num_stages=2,
        schedule="zb-h1", num_microbatches=4, ranges=[[0, 6], [6, 12]], placement=[[0], [1]],
        predicted_step_s=1.0, step_times_s=[1.0, 0.96, 0.96], window_steps=2,
    )  # fmt: skip
    if setup is not None:
        run["setup_s"] = setup
    config = dict(
        topology="configs/lab/cee8.yaml", model="gpt", size="gpt5m", gpt=dict(block_size=32),
        global_batch=48, steps=3, warmup=1, microbatches=8, systems=["deepcee"], parameters=10,
    )  # fmt: skip
    return dict(config=config, systems=dict(deepcee=dict(runs=[run])))


def test_the_table_gives_each_planned_runs_set_up_parts() -> None:
    parts = dict(profile=28.5, profile_blocks=17.9, profile_network=10.2, plan=4.4, build=0.1)
    table = _lab_bench().render(_result(parts))
    assert "| deepcee | 0 | 33.0 | 28.5 | 17.9 | 10.2 | 4.4 | 0.1 |" in table
    # Runs recorded before set-up was kept get no set-up table.
    assert "Set-up on rank 0" not in _lab_bench().render(_result(None))


def test_the_time_to_accuracy_table_names_its_target_and_invocation() -> None:
    def run(step: int, train_s: float) -> dict[str, Any]:
        return dict(run=0, reached=dict(step=step, train_s=train_s, val_loss=2.29))

    config = dict(
        topology="configs/lab/cee6.yaml", size="gpt5m", global_batch=48, target=2.297,
        target_from="ddp@cloud at step 100", eval_batches=4, eval_every=10, date="2026-12-03",
        commit="abc1234",
    )  # fmt: skip
    result = dict(
        config=config,
        systems={"ddp@cloud": dict(runs=[run(90, 80.0)]), "deepcee": dict(runs=[run(90, 64.0)])},
    )
    table = _bench("tta_bench").render(result)
    assert "target validation loss 2.297 (reached by ddp@cloud at step 100; on the first" in table
    assert "One invocation on 2026-12-03 at commit `abc1234`" in table
    assert "| ddp@cloud | 1/1 | 80.0 | 80.0 | 80.0 | 90 | 1.25x |" in table
