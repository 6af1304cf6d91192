"""How long ``plan_search`` takes on a large synthetic three-level cluster.

Builds ``regions x sites x devices`` devices (default 8 x 16 x 8 = 1024) with bandwidth set by
level (10 Gbit/s inside a site, 1 Gbit/s between sites of a region, 100 Mbit/s between regions),
latency by level, three device speeds (one per site, drawn at random) and a 48-block model, then
times ``plan_search`` on one core (``--runs`` searches, 3 by default; the median and the range
are reported) and prints the plan; ``--json`` also writes the figures (wall and CPU seconds, the
plan's summary, date and commit) for a committed result.

Run from the repository root::

    python benchmarks/plan_scaling.py [--regions 8] [--sites 16] [--devices 8] [--blocks 48]
        [--runs 3] [--json benchmarks/results/plan_scaling.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from lightning_deepcee.planner.search import plan_search
from lightning_deepcee.profiler.data import ClusterProfile, DeviceProfile

__all__ = ["main", "render", "synthetic_cluster"]

SITE_BYTES_PER_S = 10e9 / 8
REGION_BYTES_PER_S = 1e9 / 8
WAN_BYTES_PER_S = 100e6 / 8
LATENCY_S = (0.0001, 0.002, 0.03)
"""Latency inside a site, between sites of a region, between regions."""


def synthetic_cluster(
    *, regions: int, sites: int, devices: int, num_blocks: int, seed: int = 0
) -> ClusterProfile:
    """A ``regions x sites x devices`` cluster, ranks numbered region by region, site by site."""
    rng = np.random.default_rng(seed)
    n = regions * sites * devices
    site = np.arange(n) // devices
    region = site // sites
    same_site = site[:, None] == site[None, :]
    same_region = region[:, None] == region[None, :]
    bandwidth = np.where(
        same_site, SITE_BYTES_PER_S, np.where(same_region, REGION_BYTES_PER_S, WAN_BYTES_PER_S)
    )
    np.fill_diagonal(bandwidth, np.inf)
    latency = np.where(same_site, LATENCY_S[0], np.where(same_region, LATENCY_S[1], LATENCY_S[2]))
    np.fill_diagonal(latency, 0.0)
    speed = rng.choice([1.0, 2.0, 4.0], size=regions * sites)[site]
    block_s = 0.004 * (1.0 + 0.2 * rng.random(num_blocks))
    device_profiles = []
    for rank in range(n):
        per_block = tuple(float(t) for t in block_s / speed[rank])
        device_profiles.append(
            DeviceProfile(
                rank=rank,
                host=f"r{region[rank]}-s{site[rank]}-d{rank}",
                kind="gpu",
                memory_bytes=int(16e9 * speed[rank]),
                forward_s=per_block,
                backward_input_s=per_block,
                backward_weight_s=per_block,
                activation_bytes=(262_144,) * num_blocks,
                parameter_bytes=(8_398_848,) * num_blocks,
                reference_microbatch_size=4,
                capability=float(num_blocks / (3 * sum(per_block))),
            )
        )
    return ClusterProfile(
        devices=tuple(device_profiles),
        latency_s=tuple(tuple(row) for row in latency.tolist()),
        bandwidth_bytes_per_s=tuple(tuple(row) for row in bandwidth.tolist()),
        num_blocks=num_blocks,
        model_fingerprint="synthetic-model",
        cluster_fingerprint=f"synthetic-{regions}x{sites}x{devices}",
    )


def render(data: dict[str, Any]) -> str:
    """The Markdown table of a results file written with ``--json``."""
    plan = data["plan"]
    runs = data.get("plan_search_runs_s", [data["plan_search_s"]])
    layout = (
        f"{plan['stages']} stage(s), {plan['schedule']}, {plan['num_microbatches']} micro-batches, "
        f"{plan['idle_devices']} idle"
    )
    return "\n".join(
        [
            f"# Plan scaling (`{data['command']}`, {data['date']}, commit {data['commit']})",
            "",
            "| devices | blocks | plan_search wall (median, range) | CPU | plan | predicted step |",
            "|---|---|---|---|---|---|",
            f"| {data['devices']} | {data['blocks']} | {data['plan_search_s']:.1f} s "
            f"({min(runs):.1f}-{max(runs):.1f} s, {len(runs)} runs) | "
            f"{data['plan_search_cpu_s']:.1f} s | {layout} | {plan['predicted_step_s']:.2f} s |",
            "",
        ]
    )


def main() -> None:
    """Build the cluster, time one search, print the time and the plan."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regions", type=int, default=8)
    parser.add_argument("--sites", type=int, default=16)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--global-batch-size", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=3, help="searches to time (median reported)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs: expected a positive number of searches, got {args.runs}")
    start = time.perf_counter()
    profile = synthetic_cluster(
        regions=args.regions, sites=args.sites, devices=args.devices, num_blocks=args.blocks
    )
    built = time.perf_counter()
    walls, cpus = [], []
    for run in range(args.runs):
        began, cpu = time.perf_counter(), time.process_time()
        plan = plan_search(
            profile, num_blocks=args.blocks, global_batch_size=args.global_batch_size
        )
        walls.append(time.perf_counter() - began)
        cpus.append(time.process_time() - cpu)
        print(f"search {run + 1}/{args.runs}: {walls[-1]:.1f} s", flush=True)
    print(f"devices: {profile.num_devices}, blocks: {args.blocks}")
    print(f"profile built in {built - start:.1f} s")
    wall, cpu = float(np.median(walls)), float(np.median(cpus))
    print(
        f"plan_search took {wall:.1f} s median ({min(walls):.1f}-{max(walls):.1f} s over "
        f"{args.runs} runs; {cpu:.1f} s of CPU)"
    )
    print(plan.format_table())
    if args.json:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        figures = {
            "command": "python benchmarks/plan_scaling.py "
            + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "json"
            ),
            "devices": profile.num_devices,
            "blocks": args.blocks,
            "plan_search_s": round(wall, 2),
            "plan_search_runs_s": [round(w, 2) for w in walls],
            "plan_search_cpu_s": round(cpu, 2),
            "plan": {
                "stages": len(plan.stages),
                "schedule": plan.schedule,
                "num_microbatches": plan.num_microbatches,
                "idle_devices": len(plan.idle_ranks),
                "predicted_step_s": plan.predicted_step_time_s,
            },
            "date": datetime.date.today().isoformat(),
            "commit": commit,
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
