"""The planner on a 20-GPU, 3-zone cluster (Sailor's OPT-350M profiles) at three WAN speeds.

For each profile in ``configs/profiles/sailor_opt350m/`` it times ``plan_search`` with its
defaults on the whole cluster, plans each zone alone, and records the chosen plan, its
prediction, its compute bounds and the best single-zone prediction. The planner's answer must be
no slower than the best zone alone (``tests/unit/planner/test_planner_cases.py`` keeps that); this
benchmark adds the planning time, which depends on the machine.

Run from the repository root (writes ``benchmarks/results/planner_cases.json``; then
``python benchmarks/report.py`` renders the table)::

    python benchmarks/planner_cases.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path
from typing import Any

from lightning_deepcee.planner.plan import compact_ranks
from lightning_deepcee.planner.search import plan_search
from lightning_deepcee.planner.subsets import restrict
from lightning_deepcee.profiler.data import ClusterProfile

__all__ = ["main", "render", "run"]

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "configs" / "profiles" / "sailor_opt350m"
WAN = {"w10": "10 Gbit/s", "w1": "1 Gbit/s", "w01": "0.1 Gbit/s"}
ZONES = {"GH-96": (0, 1, 2, 3), "A100-40": tuple(range(4, 12)), "V100-16": tuple(range(12, 20))}
GLOBAL_BATCH = 1024


def run(name: str) -> dict[str, Any]:
    """Plan one case on the whole cluster (timed) and on each zone alone."""
    profile = ClusterProfile.from_yaml(CASES / f"{name}_mbs2.yaml")
    started = time.perf_counter()
    plan = plan_search(profile, num_blocks=profile.num_blocks, global_batch_size=GLOBAL_BATCH)
    seconds = time.perf_counter() - started
    zones = {
        zone: plan_search(
            restrict(profile, ranks),
            num_blocks=profile.num_blocks,
            global_batch_size=GLOBAL_BATCH,
        ).predicted_step_time_s
        for zone, ranks in ZONES.items()
    }
    print(f"{name}: planned in {seconds:.2f} s\n{plan.format_table()}", flush=True)
    return {
        "case": name,
        "wan": WAN[name],
        "planning_s": seconds,
        "predicted_step_s": plan.predicted_step_time_s,
        "ranks": compact_ranks(plan.ranks),
        "stages": plan.num_stages,
        "schedule": plan.schedule,
        "num_microbatches": plan.num_microbatches,
        "compute_bound_s": plan.compute_bound_s,
        "cluster_bound_s": plan.cluster_bound_s,
        "zones_s": zones,
    }


def render(data: dict[str, Any]) -> str:
    """The Markdown table of a results file."""
    lines = [
        f"# Planner cases (`{data['command']}`, {data['date']}, commit {data['commit']})",
        "",
        "| WAN | plan | devices | predicted step | best zone alone | compute bound (its "
        "devices / all) | planning |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in data["cases"]:
        zone, best = min(case["zones_s"].items(), key=lambda item: item[1])
        plan = f"{case['stages']} stage(s), {case['schedule']}, {case['num_microbatches']} mb"
        lines.append(
            f"| {case['wan']} | {plan} | {case['ranks']} | {case['predicted_step_s']:.2f} s | "
            f"{best:.2f} s ({zone}) | {case['compute_bound_s']:.2f} / "
            f"{case['cluster_bound_s']:.2f} s | {case['planning_s']:.1f} s |"
        )
    lines += ["", f"Machine: {data['machine']}.", ""]
    return "\n".join(lines)


def main() -> None:
    """Run every case and write the results JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = ROOT / "benchmarks" / "results" / "planner_cases.json"
    parser.add_argument("--out", default=str(default), help="results JSON (default: %(default)s)")
    args = parser.parse_args()
    from lab_bench import _git_commit

    commit = _git_commit()
    data = {
        "command": "python benchmarks/planner_cases.py",
        "date": datetime.date.today().isoformat(),
        "commit": commit or "unknown",
        "machine": f"{platform.machine()}, {platform.python_implementation()} "
        f"{platform.python_version()}, one core",
        "cases": [run(name) for name in WAN],
    }
    out = Path(args.out)
    out.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(render(data), encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
