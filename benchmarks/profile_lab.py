"""Profiler accuracy on the emulated lab (issue 4): measured vs configured links, groups, time.

    sudo python benchmarks/profile_lab.py --topology configs/lab/cee8.yaml --runs 3

Each run starts the lab (``deepcee-lab run``) and, on every emulated device, the profiling job of
``configs/lab/profile_gpt.yaml``: ``DeepCEEStrategy()`` profiles every device and link at setup
(exactly as in training), writes the profile through ``profile_cache`` and trains two steps. The
harness then compares, for every ordered pair of devices, the measured bandwidth with the
configured bottleneck of the path (both LAN links and every WAN link between the regions,
:meth:`Topology.path_mbit`), checks that the first-level network groups equal the configured
regions, and reads the profiling wall time that rank 0 printed.

Results: ``<results>/profile_<topology>.json`` (every run's matrices, errors, groups, time) and
``profile_<topology>.md`` (per link class: min/median/max of measured / configured, how many pairs
are within 20%; groups; time), with the command that made them.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import REPO, lab_command, write_json

TOLERANCE = 0.20
MBIT = 1e6 / 8  # bytes/s per Mbit/s


def _link_class(topology: Any, src: str, dst: str) -> str:
    a, b = topology.device(src).region, topology.device(dst).region
    return f"{a} LAN" if a == b else f"{a} -> {b}"


def analyse(topology: Any, profile: Any, profile_s: float | None) -> dict[str, Any]:
    """Measured vs configured for every ordered pair, groups vs regions, profiling time."""
    from lightning_deepcee.profiler import group_devices

    names = [d.name for d in topology.devices]
    pairs = []
    for i, src in enumerate(names):
        for j, dst in enumerate(names):
            if i == j:
                continue
            configured = topology.path_mbit(src, dst)
            measured = profile.bandwidth_bytes_per_s[i][j] / MBIT
            pairs.append(
                dict(
                    src=src,
                    dst=dst,
                    link=_link_class(topology, src, dst),
                    configured_mbit=configured,
                    measured_mbit=round(measured, 2),
                    ratio=round(measured / configured, 3),
                    within=abs(measured - configured) <= TOLERANCE * configured,
                    latency_ms=round(profile.latency_s[i][j] * 1e3, 3),
                )
            )
    groups = group_devices(profile)
    measured_groups = sorted(sorted(names[r] for r in g) for g in groups.network_groups)
    regions = sorted(sorted(d.name for d in topology.devices_in(r.name)) for r in topology.regions)
    return dict(
        pairs=pairs,
        within=sum(p["within"] for p in pairs),
        num_pairs=len(pairs),
        groups=measured_groups,
        regions=regions,
        groups_match=measured_groups == regions,
        profile_s=profile_s,
    )


def run_one(args: argparse.Namespace, run: int, out: Path) -> dict[str, Any]:
    from lightning_deepcee.lab.topology import load_topology
    from lightning_deepcee.profiler import ClusterProfile

    topology = load_topology(args.topology)
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "profile.yaml"
    cache.unlink(missing_ok=True)  # a cached profile would be reused, not measured
    for old in out.glob("*.log"):
        old.unlink()
    job = ["python", "examples/train_gpt.py", "fit", "--config", "configs/lab/profile_gpt.yaml"]
    job += [f"--trainer.num_nodes={len(topology.devices)}", "--trainer.devices=1"]
    job += [f"--trainer.strategy.init_args.profile_cache={cache}"]
    job += [f"--trainer.default_root_dir={out}", f"--trainer.logger.init_args.save_dir={out}"]
    cmd = lab_command(args.topology, out, args.run_timeout_s, job)
    print(f"[profile] run {run + 1}/{args.runs}: {' '.join(cmd)}", flush=True)
    began = time.time()
    proc = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True, check=False)
    lab_s = time.time() - began
    log = out / f"{topology.devices[0].name}.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    if proc.returncode != 0 or not cache.exists():
        tail = (proc.stderr or text)[-2000:]
        raise SystemExit(f"[profile] run {run + 1} failed (rc={proc.returncode}):\n{tail}")
    match = re.search(r"DeepCEE: profiled \d+ devices in ([0-9.]+) s", text)
    result = analyse(
        topology, ClusterProfile.from_yaml(cache), float(match.group(1)) if match else None
    )
    result.update(run=run, lab_wall_s=round(lab_s, 1), out=str(out))
    print(
        f"[profile]   {result['within']}/{result['num_pairs']} pairs within 20%, groups "
        f"{'=' if result['groups_match'] else '!='} regions, profiled in {result['profile_s']} s",
        flush=True,
    )
    return result


def report(result: dict[str, Any]) -> str:
    """Markdown: per link class the measured/configured ratios over all runs; groups; time."""
    runs = result["runs"]
    classes: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        for pair in run["pairs"]:
            classes.setdefault(pair["link"], []).append(pair)
    lines = [
        f"# Profiler on the lab: {result['topology']}",
        "",
        f"Command: `{result['command']}` ({result['updated']}).",
        "",
        "Measured bandwidth of every ordered pair of devices against the configured bottleneck of "
        f"its path, over {len(runs)} runs (each run measures every pair once, both directions).",
        "",
        "| link | configured Mbit/s | measured min / median / max | pairs within 20% |",
        "|---|---|---|---|",
    ]
    for name, pairs in sorted(classes.items()):
        measured = [p["measured_mbit"] for p in pairs]
        configured = sorted({p["configured_mbit"] for p in pairs})
        lines.append(
            f"| {name} | {', '.join(f'{c:g}' for c in configured)} | "
            f"{min(measured):.1f} / {statistics.median(measured):.1f} / {max(measured):.1f} | "
            f"{sum(p['within'] for p in pairs)} of {len(pairs)} |"
        )
    within = sum(r["within"] for r in runs)
    total = sum(r["num_pairs"] for r in runs)
    lines += [
        "",
        f"All pairs: {within} of {total} within 20% ({100 * within / total:.0f}%).",
        "",
        "| run | pairs within 20% | network groups = regions | profiling wall time (s) |",
        "|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['run'] + 1} | {r['within']} of {r['num_pairs']} | "
            f"{'yes' if r['groups_match'] else 'no: ' + str(r['groups'])} | {r['profile_s']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default="configs/lab/cee8.yaml")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="runs/profile")
    parser.add_argument("--results", default="benchmarks/results")
    parser.add_argument("--run-timeout-s", type=float, default=600)
    args = parser.parse_args(argv)
    from lightning_deepcee.lab.topology import load_topology

    name = load_topology(args.topology).name
    runs = [run_one(args, k, REPO / args.out / name / f"run{k}") for k in range(args.runs)]
    result = dict(
        topology=name,
        command=f"sudo python benchmarks/profile_lab.py --topology {args.topology} "
        f"--runs {args.runs}",
        updated=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        tolerance=TOLERANCE,
        runs=runs,
    )
    results = REPO / args.results
    results.mkdir(parents=True, exist_ok=True)
    write_json(results / f"profile_{name}.json", result, final_newline=True)
    table = report(result)
    (results / f"profile_{name}.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
