"""Elastic restarts in the lab: what a lost device costs, and what checkpointing costs (issue 22).

Every arm is one lab run under torchrun's elastic agent (``deepcee-lab run --elastic N-1:N``),
the whole job ``DeepCEEStrategy()`` (profile, plan, run) with ``ElasticCheckpoint`` and
``fit(ckpt_path="last")``:

- ``off``: no checkpoints, no loss: the step time to compare with.
- ``async@K`` / ``blocking@K``: a checkpoint every K steps, written in the background or not.
- ``loss@K``: a checkpoint every K steps (background); device ``--kill`` is killed with SIGKILL
  inside step ``--kill-step + 1``; nobody intervenes: the survivors recover in their processes
  (``recover_in_process``, the default). Measured: seconds from the kill to the end of the
  first step after it, the steps redone, and the recovery's phases.
- ``restart@K``: the same loss under ``recover_in_process=False``: torchrun's agents restart the
  whole job on the survivors, which resumes from the newest checkpoint.
- ``return@K``: the loss of ``loss@K``; once the survivors have trained a step, the lost device
  is started again to join the running job (the lab's ``join``: alone, outside torchrun,
  ``DEEPCEE_JOIN=1``). Measured: seconds from its start to the end of the first step that uses
  it, the longest time between two of the job's steps meanwhile, and the admission's phases.
- ``return-restart@K``: the same loss and return under ``recover_in_process=False``, the device
  started again under torchrun: the job restarts on the survivors, then again on every device
  at the rendezvous the returning device joins.

Step time is the median wall time between consecutive steps of rank 0 after ``--warmup`` steps
(steps across a restart excluded). Arms run interleaved, ``--runs`` times, in one invocation.

    sudo python benchmarks/elastic_bench.py --config configs/bench/elastic_cee6_gpt5m.yaml
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from harness import REPO, device_trainer, main, reuse_plan, worker_job, write_json


# --------------------------------------------------------------------------------- worker
def _clock() -> float:
    return time.monotonic() - float(os.environ.get("DEEPCEE_LAB_T0", "0"))


def worker_main(argv: list[str]) -> None:
    """One device's training job (run by torchrun's agent, again after every restart)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from models import build_model, gpt_kwargs

    from lightning_deepcee import DeepCEEStrategy, ElasticCheckpoint
    from lightning_deepcee.demo import ShakespeareDataModule
    from lightning_deepcee.runtime.admission import wants_to_join

    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--size", default="gpt5m")
    p.add_argument("--global-batch", type=int, default=48)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=0, help="checkpoint every N steps; 0: none")
    p.add_argument("--blocking", action="store_true")
    p.add_argument("--kill", help="device announcing the step it is killed in")
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--profile-budget-s", type=float, default=300.0)
    p.add_argument("--plan", help="run this saved plan (DeepCEEStrategy(plan=...))")
    p.add_argument("--profile-cache", help="DeepCEEStrategy(profile_cache=...)")
    p.add_argument("--plan-out", type=Path, help="write the planner's plan here at the start")
    p.add_argument("--restart", action="store_true", help="recover_in_process=False")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    class Recorder(Callback):
        start = 0  # the job's starts before this one (each restart of the worker group adds one)
        reported = False  # the in-process recovery's record is in steps.jsonl
        admitted = 0  # the admissions whose record is in steps.jsonl

        def on_fit_start(self, trainer: pl.Trainer, *rest: Any) -> None:
            starts = args.out / "starts.txt"
            if trainer.is_global_zero and not wants_to_join():  # a joining device: no start
                with starts.open("a") as f:
                    f.write(f"{trainer.world_size}\n")
            trainer.strategy.barrier("starts")
            self.start = len(starts.read_text().split()) - 1
            if args.plan_out is not None and trainer.is_global_zero:
                strategy = trainer.strategy
                assert isinstance(strategy, DeepCEEStrategy) and strategy.plan is not None
                strategy.plan.to_json(args.plan_out)

        def on_train_batch_start(self, trainer: pl.Trainer, *rest: Any) -> None:
            me = os.environ.get("DEEPCEE_DEVICE")
            first = self.start == 0 and not (args.out / "in_step").exists()
            if first and me == args.kill and trainer.global_step == args.kill_step:
                (args.out / "in_step").write_text(f"{_clock()}\n")
                time.sleep(600)  # the harness kills this device in here

        def on_train_batch_end(self, trainer: pl.Trainer, *rest: Any) -> None:
            if trainer.is_global_zero:
                row = dict(step=trainer.global_step, world=trainer.world_size, start=self.start,
                           t=round(_clock(), 3))  # fmt: skip
                recovery = trainer.strategy.recovery  # type: ignore[attr-defined]
                if recovery.last is not None and not self.reported:
                    row["recovery"], self.reported = recovery.last, True
                admission = trainer.strategy.admission  # type: ignore[attr-defined]
                if admission.admissions > self.admitted:
                    row["admission"], self.admitted = admission.last, admission.admissions
                with (args.out / "steps.jsonl").open("a") as f:
                    f.write(json.dumps(row) + "\n")

    pl.seed_everything(0)
    model = build_model("gpt", args.size)
    block = gpt_kwargs(args.size)["block_size"]
    data = ShakespeareDataModule(block_size=block, batch_size=args.global_batch, max_chars=400_000)
    callbacks: list[Callback] = [Recorder()]
    if args.every > 0:
        callbacks.append(
            ElasticCheckpoint(dirpath=str(args.out / "ckpt"), every_n_train_steps=args.every)
        )
    trainer = device_trainer(
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=DeepCEEStrategy(
            plan=args.plan,
            profile_cache=args.profile_cache,
            profile_budget_s=args.profile_budget_s,
            async_checkpoint=not args.blocking,
            recover_in_process=not args.restart,
        ),
        max_steps=args.steps,
        limit_val_batches=0,
        enable_checkpointing=args.every > 0,
        callbacks=callbacks,
        default_root_dir=str(args.out),
    )
    trainer.fit(model, datamodule=data, ckpt_path="last" if args.every > 0 else None)


# -------------------------------------------------------------------------------- harness
def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_time(rows: list[dict[str, Any]], warmup: int, mean: bool = False) -> float | None:
    """Median (or mean) seconds between consecutive steps of one job start, after ``warmup``
    steps, without the step that recovered from a loss. The mean counts the steps that carry a
    checkpoint's blocking part; the median not."""
    gaps = [
        b["t"] - a["t"]
        for a, b in itertools.pairwise(rows)
        if a["start"] == b["start"]
        and b["step"] == a["step"] + 1
        and a["step"] >= warmup
        and "recovery" not in b  # the step that recovered in process is no step time
    ]
    if not gaps:
        return None
    return statistics.fmean(gaps) if mean else statistics.median(gaps)


def step_figures(rows: list[dict[str, Any]], warmup: int) -> dict[str, float | None]:
    """The first start's median and mean step seconds."""
    first = [r for r in rows if r["start"] == 0]
    return {"step_s": step_time(first, warmup), "step_mean_s": step_time(first, warmup, True)}


def loss_figures(rows: list[dict[str, Any]], killed_at: float | None) -> dict[str, Any]:
    """Kill -> first step after it, steps redone, the world before and after, and how: a
    restart of the job, or recovery in the survivors' processes (with its phases)."""
    if killed_at is None:
        return {}
    before = [r for r in rows if r["start"] == 0 and r["t"] < killed_at]
    after = [r for r in rows if r["t"] > killed_at]
    if not before or not after:
        return {}
    first, last_done = after[0], before[-1]["step"]
    recovery = first.get("recovery")
    figures = {
        "kill_to_first_step_s": round(first["t"] - killed_at, 2),
        "steps_redone": recovery["steps_redone"] if recovery else last_done - (first["step"] - 1),
        "world_before": before[-1]["world"],
        "world_after": first["world"],
        "restarts": max(r["start"] for r in rows),
    }
    if recovery:
        figures["recovery"] = recovery
    return figures


def return_figures(rows: list[dict[str, Any]], joined_at: float | None, n: int) -> dict[str, Any]:
    """The lost device started again at ``joined_at`` to join: seconds from then to the end of
    the first step on all ``n`` devices, the longest time between two consecutive steps of the
    job from the last step before it on, and the admission's record (``Admission.last``)."""
    if joined_at is None:
        return {}
    before = [r for r in rows if r["t"] <= joined_at]
    after = [r for r in rows if r["t"] > joined_at]
    used = next((r for r in after if r["world"] == n), None)
    span = before[-1:] + after
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(span)]
    figures: dict[str, Any] = {
        "start_to_used_s": round(used["t"] - joined_at, 2) if used else None,
        "longest_pause_s": round(max(gaps), 2) if gaps else None,
        "used_from_step": used["step"] if used else None,
    }
    admission = next((r["admission"] for r in after if r.get("admission")), None)
    if admission:
        figures["admission"] = admission
    return figures


_LOSS_ARMS = ("loss", "restart", "return", "return-restart")
LINGER_S = 30.0
"""Devices still running this long after the last step are ended (torchrun's exit barrier)."""


def shared_plan(args: argparse.Namespace) -> tuple[Path, Path]:
    """``plan.json`` and ``profile.json`` that the checkpoint-cost arms all run: made once by a
    lab run that profiles, plans and trains one step; reused unless ``--fresh-plan``."""
    folder = args.logs / "plan"
    plan, profile, reused = reuse_plan(folder, args.fresh_plan, "elastic-bench")
    if reused:
        return plan, profile
    record = run_arm(args, "plan", 0, ["--plan-out", str(plan), "--profile-cache", str(profile)])
    if record["returncode"] != 0 or not plan.is_file() or not profile.is_file():
        raise SystemExit(f"[elastic-bench] the planning run failed: its logs are in {folder}")
    return plan, profile


def run_arm(
    args: argparse.Namespace, arm: str, run: int, extra: list[str] | None = None
) -> dict[str, Any]:
    """One lab run of ``arm`` (``plan``, ``off``, ``async@K``, ``blocking@K``, ``loss@K``,
    ``restart@K``);
    ``extra`` goes to the worker (the shared plan)."""
    from lightning_deepcee.lab.network import LabNetwork
    from lightning_deepcee.lab.runner import LabControl, RunConfig, run_command
    from lightning_deepcee.lab.topology import load_topology

    kind, _, every = arm.partition("@")
    out = args.logs / arm.replace("@", "_") / f"run{run}"
    work = out / "work"
    steps = 1 if kind == "plan" else args.steps
    worker = ["--out", str(work), "--size", args.size, "--global-batch", str(args.global_batch),
              "--steps", str(steps), "--every", every or "0",
              "--profile-budget-s", str(args.profile_budget_s), *(extra or [])]  # fmt: skip
    if kind == "blocking":
        worker.append("--blocking")
    if kind in _LOSS_ARMS:
        worker += ["--kill", args.kill, "--kill-step", str(args.kill_step)]
    if kind in ("restart", "return-restart"):
        worker.append("--restart")
    topology = load_topology(args.topology)
    n = len(topology.devices)
    killed: dict[str, float] = {}

    def control(lab: LabControl) -> None:
        if kind in _LOSS_ARMS and not killed and (work / "in_step").is_file():
            lab.kill(args.kill)
            killed["at"] = lab.elapsed_s
        # After a recovery torchrun's agents wait 300 s at exit for the lost device's agent.
        rows = _rows(work / "steps.jsonl") if killed else []
        back = kind.startswith("return") and "joined" not in killed
        if back and rows and rows[-1]["t"] > killed["at"]:  # the survivors train: it comes back
            if kind == "return":
                lab.join(args.kill)  # alone, outside torchrun: admitted at a step boundary
            else:
                lab.start(args.kill)  # under torchrun: joins the next rendezvous (a restart)
            killed["joined"] = lab.elapsed_s
        if rows and rows[-1]["step"] >= steps and lab.elapsed_s - rows[-1]["t"] > LINGER_S:
            for device in topology.devices:
                if lab.running(device.name):
                    lab.kill(device.name)

    config = RunConfig(
        command=tuple(worker_job(__file__, *worker)),
        out_dir=out,
        cwd=str(REPO),
        timeout_s=args.run_timeout_s,
        echo=False,
        elastic=f"{n - 1}:{n}",
        max_restarts=3,
    )
    print(f"[elastic-bench] {arm} run {run + 1}: {out}", flush=True)
    with LabNetwork(topology) as net:
        result = run_command(net, config, control=control)
    rows = _rows(work / "steps.jsonl")
    record: dict[str, Any] = {
        "returncode": result.returncode,
        "lab_s": result.duration_s,
        "steps": rows[-1]["step"] if rows else 0,
        **step_figures(rows, args.warmup),
    }
    record.update(loss_figures(rows, killed.get("at")))
    record.update(return_figures(rows, killed.get("joined"), n))
    print(f"[elastic-bench]   {json.dumps(record)}", flush=True)
    return record


def render(result: dict[str, Any]) -> str:
    """The Markdown table of ``result`` (medians over runs)."""
    cfg = result["config"]
    lines = [
        f"# Elastic restarts: {cfg['topology']}, GPT {cfg['size']}, batch {cfg['global_batch']}",
        "",
        f"Measured {result['date']} at commit {result['commit']}: "
        f"`python benchmarks/elastic_bench.py --config {cfg.get('config', '...')}`; "
        f"{cfg['runs']} run(s) per arm, interleaved; device `{cfg['kill']}` killed inside step "
        f"{cfg['kill_step'] + 1}.",
        "",
        _plan_sentence(result),
        *(["", result["note"]] if result.get("note") else []),
        "",
        "| arm | step s (median) | vs off | step s (mean) | vs off | kill -> first step s "
        "| steps redone | world | how |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = _median(result["arms"].get("off", []), "step_s")
    base_mean = _median(result["arms"].get("off", []), "step_mean_s")
    for arm, runs in result["arms"].items():
        step, mean = _median(runs, "step_s"), _median(runs, "step_mean_s")
        ratio = f"{step / base - 1:+.1%}" if step and base else "-"
        ratio_mean = f"{mean / base_mean - 1:+.1%}" if mean and base_mean else "-"
        kill = _median(runs, "kill_to_first_step_s")
        redone = _median(runs, "steps_redone")
        worlds = {
            f"{r.get('world_before')}->{r.get('world_after')}" for r in runs if "world_after" in r
        }
        how = {
            "in process" if r.get("recovery") else f"{r['restarts']} restart(s)"
            for r in runs
            if "restarts" in r
        }
        lines.append(
            f"| {arm} | {_fmt(step, 3)} | {ratio} | {_fmt(mean, 3)} | {ratio_mean} | "
            f"{_fmt(kill, 1)} | {_fmt(redone, 0)} | "
            f"{', '.join(sorted(worlds)) or '-'} | {', '.join(sorted(how)) or '-'} |"
        )
    return "\n".join(lines + _phase_lines(result) + _return_lines(result)) + "\n"


RECOVERY_PHASES = {
    "named": "loss named and agreed",
    "regroup": "group re-formed",
    "plan": "planned",
    "load": "checkpoint loaded",
    "redo": "steps redone",
    "step": "the failed step",
}
"""The phases of an in-process recovery (``InProcessRecovery.last``), from the failed step's
start on the survivors' rank 0."""


def _phase_lines(result: dict[str, Any]) -> list[str]:
    """Where the in-process recoveries' seconds went, per arm (medians over runs)."""
    rows = []
    for arm, runs in result["arms"].items():
        records = [r["recovery"] for r in runs if r.get("recovery")]
        if records:
            cells = [_fmt(_median(records, phase), 1) for phase in RECOVERY_PHASES]
            rows.append(f"| {arm} | {' | '.join(cells)} | {_fmt(_median(records, 'seconds'), 1)} |")
    if not rows:
        return []
    return [
        "",
        "In-process recoveries, seconds from the start of the step that failed (rank 0, medians):",
        "",
        "| arm | " + " | ".join(RECOVERY_PHASES.values()) + " | in all |",
        "|---" * (len(RECOVERY_PHASES) + 2) + "|",
        *rows,
    ]


ADMISSION_PHASES = {
    "checkpoint": "checkpoint saved",
    "waited": "device waited for",
    "plan": "planned",
    "load": "checkpoint loaded",
}
"""The phases of an admission (``Admission.last``) on the job's rank 0."""


def _return_lines(result: dict[str, Any]) -> list[str]:
    """The returning device per arm (medians over runs): its start to the first step that uses
    it, the job's longest time between two steps meanwhile, the admission's pause by phase."""
    rows = []
    for arm, runs in result["arms"].items():
        back = [r for r in runs if "start_to_used_s" in r]
        if not back:
            continue
        records = [r["admission"] for r in back if r.get("admission")]
        used = [r["start_to_used_s"] for r in back]
        cells = [
            " / ".join(_fmt(u, 1) for u in used),
            _fmt(_median(back, "start_to_used_s"), 1),
            _fmt(max((r["longest_pause_s"] or 0.0) for r in back), 1),
            *(_fmt(_median(records, phase), 1) for phase in ADMISSION_PHASES),
            _fmt(_median(records, "seconds"), 1),
        ]
        rows.append(f"| {arm} | {' | '.join(cells)} |")
    if not rows:
        return []
    head = ["runs: start -> used s", "median", "longest pause s (max)", *ADMISSION_PHASES.values()]
    return [
        "",
        "The lost device started again to join the running job: seconds from its start to the "
        "end of the first step that uses it; the job's longest time between two steps from "
        "then on (any run); the admission's pause on the job's rank 0 by phase (medians):",
        "",
        "| arm | " + " | ".join(head) + " | pause in all |",
        "|---" * (len(head) + 2) + "|",
        *rows,
    ]


def _plan_sentence(result: dict[str, Any]) -> str:
    """Which plan the arms ran: the step-time columns compare arms only on one plan."""
    plan = result.get("plan")
    if plan is None:
        return (
            "Every arm profiled and planned at its own start, so two arms may have run different "
            "plans: the step-time columns compare arms only as far as their plans agree."
        )
    stages = " | ".join(",".join(str(r) for r in stage["ranks"]) for stage in plan["stages"])
    return (
        f"`off`, `async` and `blocking` ran one plan, made once by a planning run and saved "
        f"({len(plan['stages'])} stages, ranks {stages}; {plan['schedule']}, "
        f"{plan['num_microbatches']} micro-batches), so they differ only by checkpoints. "
        "`loss` and `restart` arms profile and plan at every start, as an elastic job does."
    )


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def rescan(args: argparse.Namespace) -> int:
    """Recompute every record's step figures from its run's ``steps.jsonl`` (same raw data)."""
    path = args.results / f"{args.name}.json"
    result = json.loads(path.read_text())
    for arm, runs in result["arms"].items():
        for run, record in enumerate(runs):
            rows = _rows(args.logs / arm.replace("@", "_") / f"run{run}" / "work" / "steps.jsonl")
            if rows:
                record.update(step_figures(rows, int(result["config"]["warmup"])))
    write_json(path, result)
    table = render(result)
    (args.results / f"{args.name}.md").write_text(table)
    print(table)
    return 0


def harness_main(argv: list[str]) -> int:
    from lab_bench import _git_commit, parse_with_config

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", type=Path)
    p.add_argument("--topology", type=Path, default=REPO / "configs/lab/cee6.yaml")
    p.add_argument("--name", default="elastic_cee6_gpt5m")
    p.add_argument("--size", default="gpt5m")
    p.add_argument("--global-batch", type=int, default=48)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--intervals", default="5,10", help="checkpoint intervals (steps)")
    p.add_argument("--kill", default="edge0", help="the device lost in the loss and restart arms")
    p.add_argument("--kill-step", type=int, default=17)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument(
        "--arms", default="off,async,blocking,loss", help="which kinds of arm to run (and restart)"
    )
    p.add_argument("--profile-budget-s", type=float, default=300.0)
    p.add_argument("--run-timeout-s", type=float, default=1500.0)
    p.add_argument(
        "--fresh-plan", action="store_true", help="profile and plan the shared plan again"
    )
    p.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--logs", type=Path, default=REPO / "runs" / "bench" / "elastic")
    p.add_argument(
        "--rescan", action="store_true",
        help="recompute the step figures of <results>/<name>.json from the runs' steps.jsonl",
    )  # fmt: skip
    args = parse_with_config(p, argv)
    if args.rescan:
        return rescan(args)
    if os.geteuid() != 0:
        p.error("the lab needs root (network namespaces, cgroups)")
    intervals = [int(k) for k in args.intervals.split(",") if k.strip()]
    kinds = [k.strip() for k in args.arms.split(",") if k.strip()]
    first = intervals[0]
    arms = [a for a in ("off",) if "off" in kinds]
    arms += [f"async@{first}"] if "async" in kinds else []
    arms += [f"blocking@{first}"] if "blocking" in kinds else []
    arms += [f"loss@{k}" for k in intervals] if "loss" in kinds else []
    arms += [f"restart@{k}" for k in intervals] if "restart" in kinds else []
    arms += [f"return@{k}" for k in intervals] if "return" in kinds else []
    arms += [f"return-restart@{k}" for k in intervals] if "return-restart" in kinds else []
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result: dict[str, Any] = dict(
        config=config, date=time.strftime("%Y-%m-%d"), commit=_git_commit(),
        arms={a: [] for a in arms},
    )  # fmt: skip
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / f"{args.name}.json"
    shared: list[str] = []
    if any(not arm.startswith(_LOSS_ARMS) for arm in arms):
        plan, profile = shared_plan(args)
        shared = ["--plan", str(plan), "--profile-cache", str(profile)]
        result["plan"] = json.loads(plan.read_text())
    for run in range(args.runs):
        for arm in arms:
            extra = [] if arm.startswith(_LOSS_ARMS) else shared
            result["arms"][arm].append(run_arm(args, arm, run, extra))
            write_json(path, result)
    table = render(result)
    (args.results / f"{args.name}.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    main(worker_main, harness_main)
