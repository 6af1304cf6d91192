"""Re-predict lab runs with and without the cost model's CPU floor, and each rank's CPU bound.

For every planned run of the given ``lab_bench.py`` result files: the prediction the run
recorded, the prediction of this checkout's cost model with the floor (defaults) and without it
(``host_cpu_s_per_step = host_cpu_s_per_byte = 0``), each as an error against the measured mean
step, and the measured CPU bound: the largest ``process CPU per step / cpu_share`` over the
ranks (a device under a quota cannot finish a step sooner than that). Pure: no torch.

    python benchmarks/results/experiments/cpu_floor/repredict.py benchmarks/results/cee6_gpt5m.json
"""

from __future__ import annotations

import json
import sys

import numpy as np

from lightning_deepcee.planner.cost_model import CostModelConfig, predict_plan
from lightning_deepcee.planner.plan import Plan
from lightning_deepcee.profiler.data import ClusterProfile

NO_FLOOR = CostModelConfig(host_cpu_s_per_step=0.0, host_cpu_s_per_byte=0.0)


def main(paths: list[str]) -> None:
    """Print one line per planned run and a summary per column."""
    errors: dict[str, list[float]] = {"recorded": [], "floor": [], "no floor": []}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for system, entry in data["systems"].items():
            if not system.startswith("deepcee"):
                continue
            for run in entry["runs"]:
                profile = ClusterProfile.from_dict(run["profile"])
                plan = Plan.from_dict(run["plan"])
                window = run["window_steps"]
                measured = sum(run["step_times_s"][-window:]) / window
                predicted = {
                    "recorded": run["predicted_step_s"],
                    "floor": predict_plan(profile, plan).step_time_s,
                    "no floor": predict_plan(profile, plan, config=NO_FLOOR).step_time_s,
                }
                bound = max(
                    stats["cpu_s"] / device.cpu_share
                    for stats, device in zip(run["rank_stats"], profile.devices, strict=True)
                )
                line = [f"{path.rsplit('/', 1)[-1]} {system} run {run['run']}"]
                line.append(f"measured {measured * 1e3:.0f} ms")
                for name, seconds in predicted.items():
                    errors[name].append(seconds / measured - 1)
                    line.append(f"{name} {seconds * 1e3:.0f} ({errors[name][-1]:+.1%})")
                line.append(f"CPU bound {bound * 1e3:.0f}")
                print(", ".join(line))
    for name, values in errors.items():
        e = np.asarray(values)
        print(
            f"{name}: mean {e.mean():+.1%}, mean |error| {np.abs(e).mean():.1%}, "
            f"within 15%: {(np.abs(e) <= 0.15).sum()} of {len(e)}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
