"""Adapter benchmark: a WAN link the plan uses drops and recovers; throughput with and without it.

    sudo python benchmarks/adapter_bench.py --config configs/bench/adapter_wan.yaml
    sudo python benchmarks/adapter_bench.py --config configs/bench/adapter_cee7_farend.yaml
    sudo python benchmarks/adapter_bench.py --config configs/bench/adapter_wan_manual.yaml

Runs the same training twice on the lab under the same bandwidth trace, once with
``DynamicEnvironmentAdapter`` and once without, and compares samples/s per phase of the trace
(normal, degraded, recovered). The two arms differ only by the adapter:

- ``--layout plan`` (the default): both arms run the planner's own plan, made once. A first lab
  run (no trace) profiles the cluster into ``profile.json`` (``DeepCEEStrategy(profile_cache=)``),
  searches a plan and writes it to ``plan.json`` after one step; both arms then run
  ``DeepCEEStrategy(plan="plan.json", profile_cache="profile.json")``, so they start from the same
  layout and the adapter has the profile it predicts with. The files are reused by later
  invocations (``--fresh-plan`` makes them again). Without ``--trace`` the trace is made from
  the plan: the slowest WAN link its traffic crosses (or ``--link``) drops to ``--drop-factor``
  of its bandwidth at ``--drop-at-s`` and is restored at ``--restore-at-s``.
- ``--layout manual``: ``DeepCEEStrategy(schedule=..., num_microbatches=M)``, stages in rank order
  (``--profile`` profiles at setup in both arms, so the adapter can predict and act); give
  ``--trace``.

``--jitter J`` makes a noise trace instead of a drop: from ``--drop-at-s`` to ``--restore-at-s``
the link alternates between ``1 + J`` and ``1 - J`` times its bandwidth every
``--jitter-period-s``; the middle phase is called ``jitter``, and the right response is none.

An ``oracle`` arm (``--modes off,on,oracle``, planned layout only) is the static run of the plan
made for the degraded network: the planner's search on ``profile.json`` with every pair whose
path crosses the degraded link read at the degraded rate (:func:`degraded_profile`), written to
``oracle_plan.json`` and run without the adapter over the same trace. No adapter can beat the
best plan for the network it is on, so the table gives, for each phase, the adapter's share of
the oracle's gain over the static plan: ``(on - off) / (oracle - off)``.

Every device runs this file in ``worker`` mode, rank 0 writing one JSON line per optimizer
step: its end on the trace's clock (``DEEPCEE_LAB_T0``), its wall time, and the micro-batch count
in force. Results: ``<results>/adapter_<topology>[_planned|_replan].json`` (per-step records of
both runs, phase figures, decisions), ``.md`` (the phase table) and ``.png`` (samples/s over
time, trace phases shaded). A step belongs to the phase in which it ended; the first
``--settle`` steps of the degraded and recovered phases are reported separately (the adapter
needs about ``window + react_after`` steps to notice a change, the baseline nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from harness import (
    HERE,
    REPO,
    device_trainer,
    lab_command,
    main,
    reuse_plan,
    worker_job,
    write_json,
)

# =============================================================================== worker side


def worker_main(argv: list[str]) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.distributed
    from lightning.pytorch.callbacks import Callback
    from models import gpt_kwargs

    from lightning_deepcee import DeepCEEStrategy, DynamicEnvironmentAdapter
    from lightning_deepcee.demo import GPT, ShakespeareDataModule

    p = argparse.ArgumentParser()
    p.add_argument("--adapter", choices=["on", "off"], default="off")
    p.add_argument("--size", default="tiny")
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--end-s", type=float, default=0.0, help="stop after this trace time")
    p.add_argument("--steps-log", type=Path)
    p.add_argument("--profile", action="store_true", help="profile at setup (manual layout)")
    p.add_argument("--plan", type=Path, help="run this saved plan")
    p.add_argument("--profile-cache", type=Path, help="DeepCEEStrategy(profile_cache=...)")
    p.add_argument("--plan-out", type=Path, help="plan, write the plan here, train one step")
    p.add_argument("--profile-budget-s", type=float, default=300.0)
    args = p.parse_args(argv)
    t0 = float(os.environ["DEEPCEE_LAB_T0"])

    class StepLog(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            if args.plan_out is not None and trainer.is_global_zero:
                trainer.strategy.plan.to_json(args.plan_out)
            self.stop_group = torch.distributed.new_group(backend="gloo")
            self.stop_posted: tuple[Any, torch.Tensor] | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.start = time.monotonic()
            self.microbatches = trainer.strategy.num_microbatches

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            now = time.monotonic()
            if trainer.is_global_zero and args.steps_log is not None:
                record = dict(
                    step=trainer.global_step,
                    end_s=round(now - t0, 4),
                    wall_s=round(now - self.start, 4),
                    microbatches=self.microbatches,
                )
                with args.steps_log.open("a") as f:
                    f.write(json.dumps(record) + "\n")
            # Every rank must stop after the same step: each posts whether the trace is over
            # and reads the sum a step later, so no step waits for every rank to end the one
            # before (a blocking vote would be a barrier a pipeline does not have).
            if self.stop_posted is not None:
                work, votes = self.stop_posted
                work.wait()
                if votes.item() > 0:
                    trainer.should_stop = True
            votes = torch.tensor([float(now - t0 >= args.end_s)], dtype=torch.float64)
            work = torch.distributed.all_reduce(votes, group=self.stop_group, async_op=True)
            self.stop_posted = (work, votes)

    callbacks: list[Any] = [StepLog()]
    if args.adapter == "on":
        callbacks.append(DynamicEnvironmentAdapter())
    cache = None if args.profile_cache is None else str(args.profile_cache)
    if args.plan_out is not None:  # the planner's own choice, profiled into the cache
        strategy = DeepCEEStrategy(profile_cache=cache, profile_budget_s=args.profile_budget_s)
    elif args.plan is not None:
        strategy = DeepCEEStrategy(plan=str(args.plan), profile_cache=cache)
    else:
        strategy = DeepCEEStrategy(
            schedule=args.schedule, num_microbatches=args.microbatches, profile=args.profile
        )
    pl.seed_everything(0)
    kw = gpt_kwargs(args.size)
    model = GPT(**kw)
    data = ShakespeareDataModule(
        block_size=kw["block_size"], batch_size=args.global_batch, max_chars=400_000
    )
    trainer = device_trainer(
        # Receive-ahead (the default) in both arms: the arms differ only by the adapter.
        strategy=strategy,
        max_steps=1 if args.plan_out is not None else 100_000,
        limit_val_batches=0,
        callbacks=callbacks,
        default_root_dir=str(REPO / "runs" / "adapter_bench"),
    )
    trainer.fit(model, datamodule=data)


# =============================================================================== the plan's links


def plan_wan_links(plan: dict[str, Any], topology: Any) -> list[tuple[str, str]]:
    """The WAN links (``(region, region)``, names sorted) that ``plan``'s traffic crosses, in the
    order the pipeline meets them: every hop between consecutive stages first (activations and
    their gradients), then the gradient all-reduce inside each stage. Rank ``r`` is the
    topology's device ``r``."""
    regions = [d.region for d in topology.devices]
    stages = [list(stage["ranks"]) for stage in plan["stages"]]
    pairs = [(a, b) for s, r in itertools.pairwise(stages) for a in s for b in r]
    pairs += [(a, b) for stage in stages for a in stage for b in stage if a < b]
    links: list[tuple[str, str]] = []
    for a, b in pairs:
        for wan in topology.region_path(regions[a], regions[b]):
            first, second = sorted(wan.regions)
            if (first, second) not in links:
                links.append((first, second))
    return links


def make_trace(
    topology: Any, link: tuple[str, str], drop_at_s: float, restore_at_s: float, factor: float
) -> list[dict[str, Any]]:
    """Two events: ``link`` drops to ``factor`` of its configured bandwidth, then is restored."""
    if not 0 < factor < 1:
        raise ValueError(f"--drop-factor must be in (0, 1), got {factor}")
    if not 0 <= drop_at_s < restore_at_s:
        raise ValueError(
            f"expected 0 <= --drop-at-s < --restore-at-s, got {drop_at_s}, {restore_at_s}"
        )
    mbit = topology.wan_link(*link).mbit
    return [
        {"at_s": drop_at_s, "link": list(link), "bandwidth_mbit": round(mbit * factor, 3)},
        {"at_s": restore_at_s, "link": list(link), "bandwidth_mbit": mbit},
    ]


def jitter_trace(
    topology: Any,
    link: tuple[str, str],
    start_s: float,
    end_s: float,
    jitter: float,
    period_s: float,
) -> list[dict[str, Any]]:
    """``link`` alternates between ``1 + jitter`` and ``1 - jitter`` times its configured
    bandwidth every ``period_s`` from ``start_s``, and is back at it at ``end_s``: noise around
    the planned figure, to which the right response is none."""
    if not 0 < jitter < 1:
        raise ValueError(f"--jitter must be in (0, 1), got {jitter}")
    if not period_s > 0 or not 0 <= start_s < end_s:
        raise ValueError(
            f"expected --jitter-period-s > 0 and 0 <= --drop-at-s < --restore-at-s, got "
            f"{period_s}, {start_s}, {end_s}"
        )
    mbit = topology.wan_link(*link).mbit
    count = int((end_s - start_s) // period_s + (1 if (end_s - start_s) % period_s else 0))
    events = [
        {"at_s": round(start_s + k * period_s, 3), "link": list(link),
         "bandwidth_mbit": round(mbit * (1 + jitter if k % 2 == 0 else 1 - jitter), 3)}
        for k in range(count)
    ]  # fmt: skip
    return [*events, {"at_s": end_s, "link": list(link), "bandwidth_mbit": mbit}]


def slow_trace(
    topology: Any, device: str, start_s: float, end_s: float, factor: float
) -> list[dict[str, Any]]:
    """Two events: ``device`` keeps ``1 / factor`` of its CPU quota from ``start_s`` (another
    tenant takes the rest), and gets it back at ``end_s``."""
    if not factor > 1:
        raise ValueError(f"--slow-factor must be above 1, got {factor}")
    if not 0 <= start_s < end_s:
        raise ValueError(f"expected 0 <= --drop-at-s < --restore-at-s, got {start_s}, {end_s}")
    cpu = topology.device(device).cpu
    return [
        {"at_s": start_s, "device": device, "cpu": round(cpu / factor, 6)},
        {"at_s": end_s, "device": device, "cpu": cpu},
    ]


def degraded_profile(profile: Any, topology: Any, changes: dict[tuple[str, str], float]) -> Any:
    """``profile`` as the links would read with the WAN links of ``changes`` (``(region,
    region)``, names sorted -> Mbit/s) at their new rates: each pair's measured bandwidth scaled
    by how much its path's configured bottleneck moves (the path keeps its measured efficiency);
    latencies, devices and fingerprints unchanged. Rank ``r`` is the topology's device ``r``."""
    wan = tuple(
        dataclasses.replace(link, mbit=changes.get(tuple(sorted(link.regions)), link.mbit))
        for link in topology.wan
    )
    changed = dataclasses.replace(topology, wan=wan)
    names = [device.name for device in topology.devices]
    if len(names) != profile.num_devices:
        raise ValueError(
            f"the profile has {profile.num_devices} devices, the topology {len(names)}"
        )
    rows = []
    for a, row in enumerate(profile.bandwidth_bytes_per_s):
        rows.append(tuple(
            cell if a == b else cell * changed.path_mbit(names[a], names[b])
            / topology.path_mbit(names[a], names[b])
            for b, cell in enumerate(row)
        ))  # fmt: skip
    return dataclasses.replace(profile, bandwidth_bytes_per_s=tuple(rows))


def degraded_devices(trace: list[dict[str, Any]], topology: Any) -> dict[int, float]:
    """The devices whose CPU the first event of ``trace`` lowers, by rank: how many times as
    long each then computes (its configured ``cpu`` over the new one); the oracle plans for
    them."""
    first = min(event["at_s"] for event in trace)
    names = [device.name for device in topology.devices]
    return {
        names.index(event["device"]): topology.device(event["device"]).cpu / float(event["cpu"])
        for event in trace
        if event["at_s"] == first and "cpu" in event
    }


def degraded_links(trace: list[dict[str, Any]], topology: Any) -> dict[tuple[str, str], float]:
    """The WAN links the first event of ``trace`` (the drop) sets, with their rates; the
    oracle plans for them (with the devices of :func:`degraded_devices`). Raises SystemExit for
    an event on anything but a WAN link or a device's CPU."""
    first = min(event["at_s"] for event in trace)
    out: dict[tuple[str, str], float] = {}
    for event in trace:
        if event["at_s"] != first or "cpu" in event:
            continue
        kind, a, b = topology.resolve_link(event["link"])
        if kind != "wan" or "bandwidth_mbit" not in event:
            raise SystemExit(
                f"[adapter-bench] the oracle plans for WAN bandwidth changes; the trace's "
                f"first event sets {event}"
            )
        out[(min(a, b), max(a, b))] = float(event["bandwidth_mbit"])
    return out


def oracle_plan(
    profile_path: Path, plan: dict[str, Any], topology: Any, trace: list[dict[str, Any]],
    path: Path,
) -> dict[str, Any]:  # fmt: skip
    """Search the plan for the degraded network (the strategy's defaults on the degraded
    profile, for the static plan's global batch), write it to ``path`` and return it."""
    from lightning_deepcee.adapter.compute import observed_compute
    from lightning_deepcee.planner import Plan, plan_search
    from lightning_deepcee.profiler import ClusterProfile

    profile = ClusterProfile.from_json(profile_path)
    degraded = degraded_profile(profile, topology, degraded_links(trace, topology))
    degraded, _ = observed_compute(degraded, degraded_devices(trace, topology))
    found = plan_search(
        degraded,
        num_blocks=degraded.num_blocks,
        global_batch_size=Plan.from_dict(plan).global_batch_size,
    )
    found.to_json(path)
    print(
        f"[adapter-bench] the oracle's plan for the degraded network:\n{found.format_table()}",
        flush=True,  # before the lab runs' output
    )
    return found.to_dict()


# =============================================================================== harness side


def _phases(
    trace: list[dict[str, Any]], end_s: float, middle: str = "degraded"
) -> list[tuple[str, float, float]]:
    """(name, start, end) of normal / ``middle`` / recovered: before the trace's first event,
    up to its last, after it. A drop trace has two events (drop, restore); a jitter trace
    (``middle="jitter"``) has any number."""
    if len(trace) < 2 or (middle == "degraded" and len(trace) != 2):
        raise SystemExit("the adapter benchmark expects a trace of two events: drop, restore")
    times = sorted(e["at_s"] for e in trace)
    first, last = times[0], times[-1]
    return [("normal", 0.0, first), (middle, first, last), ("recovered", last, end_s)]


def describe_trace(cfg: dict[str, Any]) -> str:
    """The trace in words: a jitter trace as its pattern, any other as its events."""
    trace = cfg["trace"]
    if "cpu" in trace[0]:
        first, last = trace[0], trace[-1]
        return (
            f"trace: {first['device']} keeps {first['cpu'] / last['cpu']:.2g} of its CPU quota "
            f"({first['cpu']:g} of {last['cpu']:g} of the machine) from {first['at_s']:g} to "
            f"{last['at_s']:g} s"
        )
    if not cfg.get("jitter"):
        return f"trace {trace}"
    first, last = trace[0], trace[-1]
    period = trace[1]["at_s"] - first["at_s"] if len(trace) > 2 else last["at_s"] - first["at_s"]
    return (
        f"trace: link {'-'.join(first['link'])} alternating between {1 + cfg['jitter']:g}x and "
        f"{1 - cfg['jitter']:g}x its {last['bandwidth_mbit']:g} Mbit/s every {period:g} s from "
        f"{first['at_s']:g} to {last['at_s']:g} s"
    )


def config_phases(cfg: dict[str, Any]) -> list[tuple[str, float, float]]:
    """The phases of a stored result's config."""
    return _phases(cfg["trace"], cfg["end_s"], "jitter" if cfg.get("jitter") else "degraded")


def _rate(
    steps: list[dict[str, Any]],
    records: list[dict[str, Any]],
    begin: float,
    end: float,
    global_batch: int,
) -> float | None:
    """Samples/s of a phase: the samples of ``steps`` (those that ended in ``[begin, end)``)
    over the time the run spent in that window, every step's span (from the end of the one
    before, so what callbacks do between steps counts) clipped to it. A step still running when
    the window ends (a stall, a move of blocks) counts for its part of the window; a window the
    run spent in one such step reads 0. None: the run did not reach the window."""
    covered = sum(
        max(0.0, min(r["end_s"], end) - max(r["end_s"] - r["span_s"], begin)) for r in records
    )
    return global_batch * len(steps) / covered if covered > 0 else None


def with_spans(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` with ``span_s``: seconds from the previous step's end (the first step: its
    own wall time)."""
    out, previous = [], None
    for r in sorted(records, key=lambda r: r["step"]):
        span = r["wall_s"] if previous is None else r["end_s"] - previous["end_s"]
        out.append({**r, "span_s": round(span, 4)})
        previous = r
    return out


def summarise(
    records: list[dict[str, Any]],
    phases: list[tuple[str, float, float]],
    global_batch: int,
    settle: int,
    skip_s: float,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    records = with_spans(records)
    for name, start, end in phases:
        begin = max(start, skip_s) if name == "normal" else start
        steps = [r for r in records if begin <= r["end_s"] < end]
        tail = steps[settle:] if name != "normal" else steps
        settled_from = tail[0]["end_s"] - tail[0]["span_s"] if tail else end
        out[name] = dict(
            steps=len(steps),
            samples_per_s=_rate(steps, records, begin, end, global_batch),
            settled_samples_per_s=_rate(tail, records, settled_from, end, global_batch),
            microbatches=sorted({r["microbatches"] for r in steps}),
            last_microbatches=steps[-1]["microbatches"] if steps else None,
        )
    return out


def _lab(topology: Path, trace: Path | None, out: Path, timeout_s: float, worker: list[str]) -> int:
    """Run this file in ``worker`` mode on every device of the lab; its return code."""
    cmd = lab_command(topology, out, timeout_s, worker_job(__file__, *worker), trace=trace)
    print(f"[adapter-bench] {' '.join(cmd)}", flush=True)
    return subprocess.run(cmd, cwd=REPO, check=False).returncode


def _planner_plan(args: argparse.Namespace, folder: Path) -> tuple[Path, Path]:
    """``plan.json`` and ``profile.json``: made once by a lab run without a trace, then reused."""
    plan, profile, reused = reuse_plan(folder, args.fresh_plan, "adapter-bench")
    if reused:
        return plan, profile
    folder.mkdir(parents=True, exist_ok=True)
    rc = _lab(args.topology, None, folder / "plan_logs", args.profile_budget_s + 600, [
        "--size", args.size, "--global-batch", str(args.global_batch), "--plan-out", str(plan),
        "--profile-cache", str(profile), "--profile-budget-s", str(args.profile_budget_s),
    ])  # fmt: skip
    if rc != 0 or not plan.exists() or not profile.exists():
        raise SystemExit(
            f"[adapter-bench] the planning run failed (rc={rc}); its logs: {folder / 'plan_logs'}"
        )
    return plan, profile


def _trace_for_plan(
    args: argparse.Namespace, topology: Any, plan: dict[str, Any], folder: Path
) -> tuple[Path, list[dict[str, Any]]]:
    """The given trace (checked against the plan's links), or one made on a link it uses."""
    import yaml

    from lightning_deepcee.lab.trace import load_trace

    used = plan_wan_links(plan, topology)
    if args.trace is not None:
        trace = load_trace(args.trace, topology).to_list()
        touched = {tuple(sorted(e["link"])) for e in trace if "link" in e}
        if not touched & set(used):
            print(
                f"[adapter-bench] warning: the trace changes {sorted(touched)} but the plan's "
                f"traffic crosses {used}: the adapter has nothing to react to",
                flush=True,
            )
        return args.trace, trace
    path = folder / "trace.yaml"
    if args.slow_device is not None:
        ranks = {r for stage in plan["stages"] for r in stage["ranks"]}
        names = [device.name for device in topology.devices]
        if args.slow_device not in names or names.index(args.slow_device) not in ranks:
            raise SystemExit(
                f"[adapter-bench] --slow-device {args.slow_device}: the plan trains on "
                f"{sorted(names[r] for r in ranks)}; slowing another device changes nothing"
            )
        trace = slow_trace(
            topology, args.slow_device, args.drop_at_s, args.restore_at_s, args.slow_factor
        )
        path.write_text(yaml.safe_dump(trace, default_flow_style=None, sort_keys=False))
        return path, trace
    link: tuple[str, str]
    if args.link is not None:
        ends = sorted(args.link.split(","))
        if len(ends) != 2:
            raise SystemExit(f"--link: expected region,region, got {args.link!r}")
        link = (ends[0], ends[1])
    elif used:  # the plan's slowest WAN link: where a drop costs the most
        link = min(used, key=lambda pair: topology.wan_link(*pair).mbit)
    else:
        raise SystemExit(
            "[adapter-bench] the plan's traffic crosses no WAN link (it keeps to one region): a "
            "WAN trace cannot reach it; use another topology or --layout manual with --trace"
        )
    if args.jitter is not None:
        trace = jitter_trace(
            topology, link, args.drop_at_s, args.restore_at_s, args.jitter, args.jitter_period_s
        )
    else:
        trace = make_trace(topology, link, args.drop_at_s, args.restore_at_s, args.drop_factor)
    path.write_text(yaml.safe_dump(trace, default_flow_style=None, sort_keys=False))
    return path, trace


def harness_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", type=Path, help="YAML with any of these options")
    p.add_argument("--topology", type=Path)
    p.add_argument(
        "--layout",
        choices=["plan", "manual"],
        default="plan",
        help="plan: both arms run the planner's plan, made once; manual: a rank-order layout",
    )
    p.add_argument("--trace", type=Path, help="bandwidth trace (manual: required; plan: made)")
    p.add_argument("--link", help="plan layout: the WAN link to drop, region,region")
    p.add_argument("--drop-at-s", type=float, default=70.0)
    p.add_argument("--restore-at-s", type=float, default=150.0)
    p.add_argument("--drop-factor", type=float, default=0.5, help="of the link's bandwidth")
    p.add_argument(
        "--jitter",
        type=float,
        help="instead of a drop: the link alternates between 1 + J and 1 - J times its "
        "bandwidth every --jitter-period-s, from --drop-at-s to --restore-at-s",
    )
    p.add_argument("--jitter-period-s", type=float, default=10.0)
    p.add_argument(
        "--slow-device",
        help="instead of a link: this device keeps 1/--slow-factor of its CPU quota from "
        "--drop-at-s to --restore-at-s (another tenant)",
    )
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument("--fresh-plan", action="store_true", help="profile and plan again")
    p.add_argument("--profile-budget-s", type=float, default=300.0)
    p.add_argument("--size", default="tiny")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=2, help="manual layout")
    p.add_argument("--schedule", default="1f1b", help="manual layout")
    p.add_argument("--end-s", type=float, default=200.0)
    p.add_argument("--skip-s", type=float, default=40.0, help="normal phase starts here")
    p.add_argument("--settle", type=int, default=8)
    p.add_argument(
        "--modes", default="off,on", help="arms, of off, on and oracle (planned layout only)"
    )
    p.add_argument("--runs", type=int, default=1, help="runs per arm, interleaved")
    p.add_argument("--results", type=Path, default=HERE / "results")
    p.add_argument(
        "--name", help="results file stem (default adapter_<topology>_planned, _replan or none)"
    )
    p.add_argument("--logs", type=Path, default=REPO / "runs" / "adapter_bench")
    p.add_argument("--report-only", action="store_true")
    p.add_argument(
        "--profile",
        action="store_true",
        help="manual layout: profile the cluster at setup in both arms, so the adapter can "
        "predict and act; results go to adapter_<topology>_replan.*",
    )
    from lab_bench import _git_commit, parse_with_config

    args = parse_with_config(p, argv)
    if args.topology is None:
        p.error("--topology is required (or in --config)")
    if args.layout == "manual" and args.trace is None:
        p.error("--layout manual needs --trace")
    modes = [] if args.report_only else [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - {"off", "on", "oracle"}:
        p.error(f"--modes: expected arms of off, on and oracle, got {args.modes!r}")
    if "oracle" in modes and args.layout != "plan":
        p.error("--modes oracle needs --layout plan (the oracle is the planner's plan)")
    if args.jitter is not None and ("oracle" in modes or args.layout != "plan"):
        p.error("--jitter needs --layout plan and no oracle arm (noise has no plan of its own)")
    from lightning_deepcee.lab.topology import load_topology
    from lightning_deepcee.lab.trace import load_trace

    topology = load_topology(args.topology)
    planned = args.layout == "plan"
    name = f"adapter_{topology.name}" + (
        "_planned" if planned else "_replan" if args.profile else ""
    )
    folder = args.logs / name  # the plan made once is the topology's, whatever the name
    name = args.name or name
    args.results.mkdir(parents=True, exist_ok=True)
    result_path = args.results / f"{name}.json"
    result: dict[str, Any] = json.loads(result_path.read_text()) if result_path.exists() else {}
    plan: dict[str, Any] | None = None
    oracle: dict[str, Any] | None = None
    arms: dict[str, list[str]] = {}
    if planned and args.report_only:
        plan, trace = result["config"]["plan"], result["config"]["trace"]
        oracle = result["config"].get("oracle_plan")
    elif planned:
        plan_path, profile_path = _planner_plan(args, folder)
        plan = json.loads(plan_path.read_text())
        trace_path, trace = _trace_for_plan(args, topology, plan, folder)
        arm = ["--plan", str(plan_path), "--profile-cache", str(profile_path)]
        if "oracle" in modes:
            oracle_path = folder / "oracle_plan.json"
            oracle = oracle_plan(profile_path, plan, topology, trace, oracle_path)
            arms["oracle"] = ["--plan", str(oracle_path), "--profile-cache", str(profile_path)]
    else:
        trace_path, trace = args.trace, load_trace(args.trace, topology).to_list()
        arm = ["--microbatches", str(args.microbatches), "--schedule", args.schedule,
               *(["--profile"] if args.profile else [])]  # fmt: skip
    phases = _phases(trace, args.end_s, "jitter" if args.jitter is not None else "degraded")
    if not args.report_only:
        arms = {"off": arm, "on": arm, **arms}
    result["config"] = dict(
        topology=str(args.topology), trace=trace, size=args.size, global_batch=args.global_batch,
        microbatches=args.microbatches, schedule=args.schedule, end_s=args.end_s,
        skip_s=args.skip_s, settle=args.settle, profile=args.profile,
        **({} if args.jitter is None else {"jitter": args.jitter}),
    )  # fmt: skip
    if planned:
        result["config"].update(layout="plan", plan=plan)
    if oracle is not None:
        result["config"]["oracle_plan"] = oracle
    if modes:  # a table never mixes invocations: this one's runs replace the file's
        result["modes"] = {mode: {"runs": []} for mode in modes}
        result["date"], result["commit"] = time.strftime("%Y-%m-%d"), _git_commit()
    for run in range(args.runs):  # interleaved: off run 1, on run 1, off run 2, ...
        for mode in modes:
            out = folder / mode / f"run{run}"
            out.mkdir(parents=True, exist_ok=True)
            log = out / "steps.jsonl"
            log.unlink(missing_ok=True)
            began = time.time()
            rc = _lab(args.topology, trace_path, out, args.end_s + 240, [
                "--adapter", "on" if mode == "on" else "off", "--size", args.size,
                "--global-batch", str(args.global_batch), "--end-s", str(args.end_s),
                "--steps-log", str(log.resolve()), *arms[mode],
            ])  # fmt: skip
            records = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
            decisions = []
            rank0_log = out / f"{topology.devices[0].name}.log"
            if rank0_log.exists():
                decisions = [
                    line.strip()
                    for line in rank0_log.read_text().splitlines()
                    if "DeepCEE adapter" in line
                ]
            result["modes"][mode]["runs"].append(dict(
                returncode=rc, wall_s=round(time.time() - began, 1), records=records,
                decisions=decisions,
                phases=summarise(records, phases, args.global_batch, args.settle, args.skip_s),
            ))  # fmt: skip
            print(
                f"[adapter-bench] arm {mode} run {run + 1}/{args.runs}: rc={rc}, "
                f"{len(records)} steps",
                flush=True,
            )
            write_json(result_path, result, final_newline=True)  # nothing lost
    if args.report_only:  # the stored steps, summarised as this version counts them
        for entry in result.get("modes", {}).values():
            for stored in entry.get("runs", [entry]):
                stored["phases"] = summarise(
                    stored["records"], phases, args.global_batch, args.settle, args.skip_s
                )
    result["updated"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_json(result_path, result, final_newline=True)
    table = report(result, phases, args.results / name)
    print(table)
    return 0


def mode_runs(result: dict[str, Any], mode: str) -> list[dict[str, Any]]:
    """The runs of one arm (a file written before ``--runs`` holds one run per arm)."""
    entry = result.get("modes", {}).get(mode)
    if entry is None:
        return []
    return list(entry["runs"]) if "runs" in entry else [entry]


def phase_median(runs: list[dict[str, Any]], phase: str, key: str) -> float | None:
    """The median over runs of one phase figure (runs without it left out)."""
    values = [
        r["phases"][phase][key]
        for r in runs
        if r.get("phases", {}).get(phase, {}).get(key) is not None
    ]
    return statistics.median(values) if values else None


def render(result: dict[str, Any]) -> str:
    """The Markdown of ``<name>.md`` (``benchmarks/report.py`` renders it too)."""
    cfg = result["config"]
    phases = config_phases(cfg)
    off_runs, on_runs = mode_runs(result, "off"), mode_runs(result, "on")
    oracle_runs = mode_runs(result, "oracle")
    if cfg.get("layout") == "plan":
        plan = cfg["plan"]
        stages = " | ".join(",".join(str(r) for r in st["ranks"]) for st in plan["stages"])
        layout = (
            f"the planner's plan (ranks {stages}, {plan['schedule']} with "
            f"{plan['num_microbatches']} micro-batches) made once and run by the arms off and on"
        )
    else:
        layout = f"{cfg['schedule']} with {cfg['microbatches']} micro-batches"
    n = min(len(off_runs), len(on_runs))
    when = (
        f"Measured {result['date']} at commit {result['commit']}, {n} run(s) per arm "
        f"interleaved in one invocation; figures are medians over runs. "
        if "date" in result
        else ""
    )
    oracle_note, oracle_head = "", ""
    if oracle_runs and cfg.get("oracle_plan"):
        found = cfg["oracle_plan"]
        stages = " | ".join(",".join(str(r) for r in st["ranks"]) for st in found["stages"])
        oracle_note = (
            f" The oracle arm runs, without the adapter, the plan searched for the degraded "
            f"network (ranks {stages}, {found['schedule']} with {found['num_microbatches']} "
            f"micro-batches); 'share' is the adapter's part of the oracle's gain over the static "
            f"plan, settled: (on - off) / (oracle - off)."
        )
        oracle_head = " settled oracle | share |"
    lines = [
        f"{when}Topology `{Path(cfg['topology']).stem}`, {describe_trace(cfg)}, GPT "
        f"`{cfg['size']}`, global batch {cfg['global_batch']}, {layout}; samples/s count each "
        f"step from the end of the one before; the normal phase is counted from "
        f"{cfg['skip_s']} s (after set-up); "
        f"'settled' leaves out the first {cfg['settle']} steps of a phase.{oracle_note}",
        "",
        "| phase | seconds | adapter off samples/s | adapter on samples/s | on/off "
        "| on/off per run | settled off | settled on | settled on/off |"
        f"{oracle_head} micro-batches on (last) |",
        "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if oracle_head else "") + "---|",
    ]

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or not b else f"{a / b:.2f}x"

    for name, start, end in phases:
        off, on = (phase_median(off_runs, name, "samples_per_s"),
                   phase_median(on_runs, name, "samples_per_s"))  # fmt: skip
        settled_off = phase_median(off_runs, name, "settled_samples_per_s")
        settled_on = phase_median(on_runs, name, "settled_samples_per_s")
        per_run = ", ".join(
            ratio(b["phases"][name]["samples_per_s"], a["phases"][name]["samples_per_s"])
            for a, b in zip(off_runs, on_runs, strict=False)
            if "phases" in a and "phases" in b
        )
        counts = sorted({m for r in on_runs for m in r.get("phases", {}).get(name, {}).get(
            "microbatches", [])})  # fmt: skip
        lasts = [r.get("phases", {}).get(name, {}).get("last_microbatches", "-") for r in on_runs]
        oracle_cells = ""
        if oracle_head:
            settled_oracle = phase_median(oracle_runs, name, "settled_samples_per_s")
            share = oracle_share(settled_off, settled_on, settled_oracle)
            oracle_cells = f" {fmt(settled_oracle)} | {share} |"
        lines.append(
            f"| {name} | {start:g}-{end:g} | {fmt(off)} | {fmt(on)} | {ratio(on, off)} | "
            f"{per_run or '-'} | {fmt(settled_off)} | {fmt(settled_on)} | "
            f"{ratio(settled_on, settled_off)} |{oracle_cells} {counts or '-'} "
            f"({', '.join(map(str, lasts))}) |"
        )
    drop_s = phases[1][1]
    restore_s = phases[2][1] if len(phases) > 2 else None
    reactions = [reactions_s(run, drop_s, restore_s) for run in on_runs]
    if any(reactions):
        returned = any("return-applied" in d for run in on_runs for d in run.get("decisions", []))
        returns = (
            f" (a return to the plan left: from the restore at {restore_s:g} s)"
            if returned and restore_s is not None
            else ""
        )
        listed = "; ".join(
            f"run {i + 1}: {', '.join(f'{s:g} s' for s in r) or 'none'}"
            for i, r in enumerate(reactions)
        )
        lines += [
            "",
            f"Reaction of each move the adapter applied (a split or a re-plan), from the "
            f"{'drop' if phases[1][0] == 'degraded' else 'first change'} at {drop_s:g} "
            f"s{returns} to the end of the first step after it: {listed}.",
            *after_reaction(result, phases),
        ]
    for i, run in enumerate(on_runs):
        if run.get("decisions"):
            lines += ["", f"Adapter decisions, run {i + 1} (rank 0's console):", "", "```text",
                      *run["decisions"], "```"]  # fmt: skip
    return "\n".join(lines) + "\n"


_APPLIED = re.compile(r"step (\d+) (?:re-plan for [^:]*: applied|split-applied|(return-applied))")


def reactions_s(run: dict[str, Any], drop_s: float, restore_s: float | None = None) -> list[float]:
    """Seconds from ``drop_s`` (the trace's drop) to the end of the first step after each split
    or re-plan the adapter applied after it (rank 0's decisions, the steps' trace clock): the
    reaction time of each move, the move of blocks included. A return to the plan a re-plan
    left counts from ``restore_s`` (the trace's restore), when given."""
    records = sorted(run.get("records", []), key=lambda r: r["step"])
    out = []
    for decision in run.get("decisions", []):
        found = _APPLIED.search(decision)
        if found is None:
            continue
        step = int(found.group(1))
        start_s = restore_s if found.group(2) and restore_s is not None else drop_s
        after = next((r for r in records if r["step"] > step), None)
        if after is not None and after["end_s"] > start_s:
            out.append(round(after["end_s"] - start_s, 1))
    return out


def move_ends(run: dict[str, Any]) -> list[float]:
    """The end of the first step after each move the adapter applied (the trace's clock)."""
    records = sorted(run.get("records", []), key=lambda r: r["step"])
    ends = []
    for decision in run.get("decisions", []):
        found = _APPLIED.search(decision)
        after = None if found is None else next(
            (r for r in records if r["step"] > int(found.group(1))), None
        )  # fmt: skip
        if after is not None:
            ends.append(float(after["end_s"]))
    return ends


def after_reaction(result: dict[str, Any], phases: list[tuple[str, float, float]]) -> list[str]:
    """A table of each changed phase's samples/s after the adapter's reaction: per adapter run
    from the end of the first step after its last move in the phase (the phase's start if it
    made none) to the phase's end; the static and oracle arms over the same window, starting at
    the median of the adapter runs' offsets into the phase."""
    cfg, gb = result["config"], int(result["config"]["global_batch"])
    arms = {mode: mode_runs(result, mode) for mode in ("off", "on", "oracle")}
    rows = []
    for name, start, end in phases[1:]:
        offsets = []
        for run in arms["on"]:
            moved = [t for t in move_ends(run) if start <= t < end]
            offsets.append((max(moved) if moved else start) - start)
        if not offsets:
            continue
        offset = statistics.median(offsets)
        rates: dict[str, float | None] = {}
        for mode, runs in arms.items():
            values = []
            for i, run in enumerate(runs):
                begin = start + (offsets[i] if mode == "on" and i < len(offsets) else offset)
                records = with_spans(run.get("records", []))
                steps = [r for r in records if begin <= r["end_s"] < end]
                rate = _rate(steps, records, begin, end, gb)
                if rate is not None:
                    values.append(rate)
            rates[mode] = statistics.median(values) if values else None
        rows.append((name, offset, end - start, rates))
    if not rows:
        return []

    def cell(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    def times(a: float | None, b: float | None) -> str:
        return "-" if a is None or not b else f"{a / b:.2f}x"

    oracle = bool(arms["oracle"]) and cfg.get("oracle_plan") is not None
    lines = [
        "",
        "After the reaction (each adapter run from the end of the first step after its last "
        "move in the phase; the other arms over the same window, from the median offset):",
        "",
        "| phase | window | off | on | on/off |" + (" oracle | on/oracle |" if oracle else ""),
        "|---|---|---|---|---|" + ("---|---|" if oracle else ""),
    ]
    for name, offset, length, r in rows:
        degraded = name == "degraded"  # the oracle's plan is made for that phase's network
        extra = (
            f" {cell(r['oracle'] if degraded else None)} | "
            f"{times(r['on'], r['oracle']) if degraded else '-'} |"
            if oracle
            else ""
        )
        lines.append(
            f"| {name} | last {length - offset:.0f} of {length:.0f} s | {cell(r['off'])} | "
            f"{cell(r['on'])} | {times(r['on'], r['off'])} |{extra}"
        )
    return lines


def oracle_share(off: float | None, on: float | None, oracle: float | None) -> str:
    """The adapter's share of the oracle's gain over the static plan, ``(on - off) / (oracle -
    off)``, as a percentage; ``-`` when a figure is missing or the oracle gains nothing (a share
    of no gain means nothing)."""
    if off is None or on is None or oracle is None or oracle <= off:
        return "-"
    return f"{(on - off) / (oracle - off):.0%}"


def report(result: dict[str, Any], phases: list[tuple[str, float, float]], stem: Path) -> str:
    table = render(result)
    stem.with_suffix(".md").write_text(table)
    _plot(result, phases, stem.with_suffix(".png"))
    return table


def _plot(result: dict[str, Any], phases: list[tuple[str, float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = result["config"]["global_batch"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for name, start, end in phases:
        if name in ("degraded", "jitter"):
            changed = "device slowed" if "cpu" in result["config"]["trace"][0] else f"link {name}"
            ax.axvspan(start, end, color="#f4cccc", label=changed)
    for mode, colour in (("off", "#888888"), ("on", "#4c72b0"), ("oracle", "#55a868")):
        for i, run in enumerate(mode_runs(result, mode)):
            records = with_spans(run.get("records", []))
            if not records:
                continue
            xs = [r["end_s"] for r in records]
            ys = [g / max(r["span_s"], 1e-6) for r in records]
            smooth = [statistics.median(ys[max(0, j - 2) : j + 3]) for j in range(len(ys))]
            arm = "oracle's plan" if mode == "oracle" else f"adapter {mode}"
            label = f"{arm} (median of 5 steps)" if i == 0 else None
            ax.plot(xs, smooth, color=colour, alpha=0.8, linewidth=1, label=label)
    ax.set_xlabel("trace time (s)")
    ax.set_ylabel("samples/s")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main(worker_main, harness_main)
