"""Adapter benchmark (issue 6): a WAN link halves and recovers; throughput with and without it.

    sudo python benchmarks/adapter_bench.py --config configs/bench/adapter_wan.yaml

Runs the same training twice on the lab under the same bandwidth trace, once with
``DynamicEnvironmentAdapter`` and once without, and compares samples/s per phase of the trace
(normal, degraded, recovered). Every device runs this file in ``worker`` mode: a GPT split over
the devices in rank order by ``DeepCEEStrategy(schedule=..., num_microbatches=M)`` (a fixed
layout, so the adapter's micro-batch split is the only thing that differs), with rank 0 writing
one JSON line per optimizer step: its end on the trace's clock (``DEEPCEE_LAB_T0``), its wall
time, and the micro-batch count in force.

Results: ``<results>/adapter_<topology>.json`` (per-step records of both runs, phase figures,
decisions), ``.md`` (the phase table) and ``.png`` (samples/s over time, trace phases shaded).
``--profile`` profiles the cluster at setup in both arms, so the adapter's ``replan`` can act
(the slow response); its results are ``adapter_<topology>_replan.*``.
A step belongs to the phase in which it ended; the first ``--settle`` steps of the degraded and
recovered phases are reported separately (the adapter needs ``window + react_after`` steps to
react, the baseline nothing), and the figures of the whole phases are given too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

# =============================================================================== worker side


def worker_main(argv: list[str]) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from models import gpt_kwargs

    from lightning_deepcee import DeepCEEStrategy, DynamicEnvironmentAdapter
    from lightning_deepcee.demo import GPT, ShakespeareDataModule

    p = argparse.ArgumentParser()
    p.add_argument("--adapter", choices=["on", "off"], required=True)
    p.add_argument("--size", default="tiny")
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--end-s", type=float, required=True, help="stop after this trace time")
    p.add_argument("--steps-log", type=Path, required=True)
    p.add_argument("--profile", action="store_true", help="profile at setup (re-plan possible)")
    args = p.parse_args(argv)
    t0 = float(os.environ["DEEPCEE_LAB_T0"])
    world = int(os.environ["WORLD_SIZE"])

    class StepLog(Callback):
        def __init__(self) -> None:
            self.last = time.monotonic()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.start = time.monotonic()
            self.microbatches = trainer.strategy.num_microbatches

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            now = time.monotonic()
            if trainer.is_global_zero:
                record = dict(
                    step=trainer.global_step,
                    end_s=round(now - t0, 4),
                    wall_s=round(now - self.start, 4),
                    microbatches=self.microbatches,
                )
                with args.steps_log.open("a") as f:
                    f.write(json.dumps(record) + "\n")
            # Every rank must stop after the same step: decide together.
            if trainer.strategy.reduce_boolean_decision(now - t0 >= args.end_s, all=False):
                trainer.should_stop = True

    callbacks: list[Any] = [StepLog()]
    if args.adapter == "on":
        callbacks.append(DynamicEnvironmentAdapter())
    pl.seed_everything(0)
    kw = gpt_kwargs(args.size)
    model = GPT(**kw)
    data = ShakespeareDataModule(
        block_size=kw["block_size"], batch_size=args.global_batch, max_chars=400_000
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=world,
        # Receive-ahead (the default) in both arms: the arms differ only by the adapter.
        strategy=DeepCEEStrategy(
            schedule=args.schedule, num_microbatches=args.microbatches, profile=args.profile
        ),
        max_steps=100_000,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=str(REPO / "runs" / "adapter_bench"),
    )
    trainer.fit(model, datamodule=data)


# =============================================================================== harness side


def _phases(trace: list[dict[str, Any]], end_s: float) -> list[tuple[str, float, float]]:
    """(name, start, end) of normal / degraded / recovered from a two-event trace."""
    if len(trace) != 2:
        raise SystemExit("the adapter benchmark expects a trace of two events: drop, restore")
    drop, restore = sorted(e["at_s"] for e in trace)
    return [("normal", 0.0, drop), ("degraded", drop, restore), ("recovered", restore, end_s)]


def _rate(steps: list[dict[str, Any]], global_batch: int) -> float | None:
    """Samples/s over consecutive steps: samples / summed step wall times."""
    if not steps:
        return None
    return global_batch * len(steps) / sum(s["wall_s"] for s in steps)


def summarise(
    records: list[dict[str, Any]],
    phases: list[tuple[str, float, float]],
    global_batch: int,
    settle: int,
    skip_s: float,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, start, end in phases:
        begin = max(start, skip_s) if name == "normal" else start
        steps = [r for r in records if begin <= r["end_s"] < end]
        tail = steps[settle:] if name != "normal" else steps
        out[name] = dict(
            steps=len(steps),
            samples_per_s=_rate(steps, global_batch),
            settled_samples_per_s=_rate(tail, global_batch),
            microbatches=sorted({r["microbatches"] for r in steps}),
            last_microbatches=steps[-1]["microbatches"] if steps else None,
        )
    return out


def harness_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", type=Path, help="YAML with any of these options")
    p.add_argument("--topology", type=Path)
    p.add_argument("--trace", type=Path)
    p.add_argument("--size", default="tiny")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--end-s", type=float, default=200.0)
    p.add_argument("--skip-s", type=float, default=40.0, help="normal phase starts here")
    p.add_argument("--settle", type=int, default=8)
    p.add_argument("--modes", default="off,on")
    p.add_argument("--results", type=Path, default=HERE / "results")
    p.add_argument("--logs", type=Path, default=REPO / "runs" / "adapter_bench")
    p.add_argument("--report-only", action="store_true")
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile the cluster at setup in both arms, so the adapter can re-plan (the slow "
        "response); results go to adapter_<topology>_replan.*",
    )
    from lab_bench import parse_with_config

    args = parse_with_config(p, argv)
    if args.topology is None or args.trace is None:
        p.error("--topology and --trace are required (or in --config)")
    from lightning_deepcee.lab.topology import load_topology
    from lightning_deepcee.lab.trace import load_trace

    topology = load_topology(args.topology)
    trace = load_trace(args.trace, topology).to_list()
    phases = _phases(trace, args.end_s)
    name = f"adapter_{topology.name}" + ("_replan" if args.profile else "")
    args.results.mkdir(parents=True, exist_ok=True)
    result_path = args.results / f"{name}.json"
    result: dict[str, Any] = json.loads(result_path.read_text()) if result_path.exists() else {}
    result["config"] = dict(
        topology=str(args.topology), trace=trace, size=args.size, global_batch=args.global_batch,
        microbatches=args.microbatches, schedule=args.schedule, end_s=args.end_s,
        skip_s=args.skip_s, settle=args.settle, profile=args.profile,
    )  # fmt: skip
    result.setdefault("modes", {})
    for mode in [] if args.report_only else args.modes.split(","):
        out = args.logs / name / mode
        out.mkdir(parents=True, exist_ok=True)
        log = out / "steps.jsonl"
        log.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "lightning_deepcee.lab.cli", "run", "--topology",
               str(args.topology), "--trace", str(args.trace), "--out", str(out), "--quiet",
               "--timeout-s", str(args.end_s + 240), "--", "python", str(Path(__file__).resolve()),
               "worker", "--adapter", mode, "--size", args.size, "--global-batch",
               str(args.global_batch), "--microbatches", str(args.microbatches), "--schedule",
               args.schedule, "--end-s", str(args.end_s), "--steps-log", str(log),
               *(["--profile"] if args.profile else [])]  # fmt: skip
        print(f"[adapter-bench] adapter {mode}: {' '.join(cmd)}", flush=True)
        began = time.time()
        rc = subprocess.run(cmd, cwd=REPO, check=False).returncode
        records = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
        decisions = []
        rank0_log = out / f"{topology.devices[0].name}.log"
        if rank0_log.exists():
            decisions = [
                line.strip()
                for line in rank0_log.read_text().splitlines()
                if "DeepCEE adapter" in line
            ]
        result["modes"][mode] = dict(
            returncode=rc, wall_s=round(time.time() - began, 1), records=records,
            decisions=decisions,
            phases=summarise(records, phases, args.global_batch, args.settle, args.skip_s),
        )  # fmt: skip
        print(f"[adapter-bench] adapter {mode}: rc={rc}, {len(records)} steps", flush=True)
    result["updated"] = time.strftime("%Y-%m-%d %H:%M:%S")
    result_path.write_text(json.dumps(result, indent=1) + "\n")
    table = report(result, phases, args.results / name)
    print(table)
    return 0


def render(result: dict[str, Any]) -> str:
    """The Markdown of ``<name>.md`` (``benchmarks/report.py`` renders it too)."""
    cfg = result["config"]
    phases = _phases(cfg["trace"], cfg["end_s"])
    modes = result["modes"]
    lines = [
        f"Topology `{Path(cfg['topology']).stem}`, trace {cfg['trace']}, GPT `{cfg['size']}`, "
        f"global batch {cfg['global_batch']}, {cfg['schedule']} with {cfg['microbatches']} "
        f"micro-batches; the normal phase is counted from {cfg['skip_s']} s (after set-up); "
        f"'settled' leaves out the first {cfg['settle']} steps of a phase.",
        "",
        "| phase | seconds | adapter off samples/s | adapter on samples/s | on/off | settled off | "
        "settled on | settled on/off | micro-batches off | micro-batches on (last) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, start, end in phases:
        off = modes.get("off", {}).get("phases", {}).get(name, {})
        on = modes.get("on", {}).get("phases", {}).get(name, {})

        def fmt(x: float | None) -> str:
            return "-" if x is None else f"{x:.2f}"

        def ratio(a: float | None, b: float | None) -> str:
            return "-" if not a or not b else f"{a / b:.2f}x"

        lines.append(
            f"| {name} | {start:g}-{end:g} | {fmt(off.get('samples_per_s'))} | "
            f"{fmt(on.get('samples_per_s'))} | "
            f"{ratio(on.get('samples_per_s'), off.get('samples_per_s'))} | "
            f"{fmt(off.get('settled_samples_per_s'))} | {fmt(on.get('settled_samples_per_s'))} | "
            f"{ratio(on.get('settled_samples_per_s'), off.get('settled_samples_per_s'))} | "
            f"{off.get('microbatches', '-')} | {on.get('microbatches', '-')} "
            f"({on.get('last_microbatches', '-')}) |"
        )
    decisions = modes.get("on", {}).get("decisions", [])
    if decisions:
        lines += ["", "Adapter decisions (rank 0's console):", "", "```text", *decisions, "```"]
    return "\n".join(lines) + "\n"


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
        if name == "degraded":
            ax.axvspan(start, end, color="#f4cccc", label="link halved")
    for mode, colour in (("off", "#888888"), ("on", "#4c72b0")):
        records = result["modes"].get(mode, {}).get("records", [])
        if not records:
            continue
        xs = [r["end_s"] for r in records]
        ys = [g / r["wall_s"] for r in records]
        smooth = [statistics.median(ys[max(0, i - 2) : i + 3]) for i in range(len(ys))]
        ax.plot(xs, smooth, color=colour, label=f"adapter {mode} (median of 5 steps)")
    ax.set_xlabel("trace time (s)")
    ax.set_ylabel("samples/s")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker_main(sys.argv[2:])
    else:
        sys.exit(harness_main(sys.argv[1:]))
