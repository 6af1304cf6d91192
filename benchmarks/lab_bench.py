"""Side-by-side throughput benchmark on the emulated lab (issue 3).

    sudo python benchmarks/lab_bench.py --topology configs/lab/cee6.yaml --model gpt --size tiny \\
        --runs 3 --steps 12 --warmup 4 --systems deepcee,ddp,ddp-regions,pipe-1f1b,pipe-zb

For every system and run it starts the lab (``deepcee-lab run`` as a subprocess, so the lab's own
setup and teardown apply), runs this same file in ``worker`` mode on every emulated device, and
parses the ``BENCH {...}`` JSON line that rank 0 prints. Every system trains the same model
(``--model gpt`` on Shakespeare windows or ``--model cnn`` on seeded synthetic images; same
initial weights), on the same data, with the same *global* batch per optimizer step:

- ``deepcee``: ``DeepCEEStrategy()`` -- profile devices and links at setup, search a plan, run it.
- ``deepcee-adapter``: the same plus the ``DynamicEnvironmentAdapter`` callback (adapter on; the
  ``deepcee`` system is the adapter-off arm).
- ``deepcee-zip``: ``DeepCEEStrategy(compression="auto")``: the planner may compress each
  pipeline hop where the link makes it pay (``deepcee`` is the compression-off arm).
- ``deepcee-kept``: ``DeepCEEStrategy(device_cache=DIR)``, one DIR for the system's runs of an
  invocation (emptied before its first run): the first run measures, searches and times its
  rivals; the later ones keep the block timings, the link figures (after a probe of each pair)
  and the plan (set-up on figures kept from an earlier run).
- ``deepcee-manual``: ``DeepCEEStrategy(schedule="1f1b", num_microbatches=M)``, one stage per
  device, parameter-balanced partition (planner ablation).
- ``deepcee-dp``: ``DeepCEEStrategy(num_stages=1, num_microbatches=1, profile=True)``: data
  parallelism over every device, as DDP runs it (the strategy's own replicas against DDP's; the
  profile sizes the gradient buckets for the measured links). ``deepcee-dp-flat``: the same with
  one bucket (``DEEPCEE_GRAD_BUCKET_MB=inf``), summed when backward is over: the buckets'
  ablation.
- ``ddp``: Lightning ``DDPStrategy``, per-device batch = global / N (DDP runs the multiple of N
  nearest to the global batch when N does not divide it).
- ``pipe-gpipe`` / ``pipe-1f1b`` / ``pipe-zb``: plain ``torch.distributed.pipelining``
  (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleavedZeroBubble`` with 2 virtual stages per
  rank where the blocks allow, else 1), a uniform split by block count, stages in rank order, M
  micro-batches.
- ``SYSTEM@region+region``: that system on those regions' devices alone (the lab starts only
  them); ``ddp-regions`` adds ``ddp@`` each subset of :func:`region_subsets`.

Throughput: rank 0 records a timestamp after every optimizer step; samples/s =
global batch x K / (time of the last K steps), K = steps - warmup (set-up, profiling, planning,
shape inference and the first steps are outside the window).

One invocation, one table: systems run interleaved run by run; ``<results>/<name>.json`` holds
every run (samples/s, step times, config, date, commit), ``<name>.md`` the table (median, min,
max, ratio to the best alternative: the fastest system that is not DeepCEE) and ``<name>.png``.
``--report-only`` rebuilds the table and plot from the JSON.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness import HERE, REPO, device_trainer, lab_command, main, worker_job, write_json

if TYPE_CHECKING:  # the worker imports torch and Lightning only where it runs them
    from lightning_deepcee import DeepCEEStrategy

LIGHTNING_SYSTEMS = (
    "deepcee",
    "deepcee-adapter",
    "deepcee-manual",
    "deepcee-dp",
    "deepcee-dp-flat",
    "deepcee-zip",
    "deepcee-kept",
    "ddp",
)
PIPE_SYSTEMS = ("pipe-gpipe", "pipe-1f1b", "pipe-zb")
SYSTEMS = LIGHTNING_SYSTEMS + PIPE_SYSTEMS
DEEPCEE_SYSTEMS = tuple(s for s in LIGHTNING_SYSTEMS if s.startswith("deepcee"))
PLANNED_SYSTEMS = ("deepcee", "deepcee-adapter", "deepcee-zip", "deepcee-kept")
"""The DeepCEE systems whose plan is searched (unless ``--plan`` gives one): they run the trial."""
REGION_SUBSETS = "ddp-regions"
"""Expands to ``ddp@<regions>`` for every region subset of :func:`region_subsets`."""


# =============================================================================== worker side
def _emit(global_batch: int, stamps: list[float], warmup: int, extra: dict[str, Any]) -> None:
    """Print the BENCH line (rank 0): samples/s over the steps after ``warmup``."""
    steps = len(stamps)
    window = stamps[warmup - 1 :] if warmup >= 1 else stamps
    k = len(window) - 1
    if k < 1:
        raise RuntimeError(f"need steps > warmup + 1 (got steps={steps}, warmup={warmup})")
    elapsed = window[-1] - window[0]
    step_times = [b - a for a, b in itertools.pairwise(stamps)]
    record = dict(
        samples_per_s=global_batch * k / elapsed,
        window_steps=k,
        window_s=elapsed,
        global_batch=global_batch,
        step_times_s=[round(t, 4) for t in step_times],
        **extra,
    )
    print("BENCH " + json.dumps(record), flush=True)


def _data(args: argparse.Namespace, batch_size: int):
    """The benchmark's data module: Shakespeare windows (gpt) or seeded synthetic images (cnn)."""
    if getattr(args, "model", "gpt") == "cnn":
        from lightning_deepcee.demo import SyntheticImageDataModule

        return SyntheticImageDataModule(batch_size=batch_size, num_train=4096)
    from models import gpt_kwargs

    from lightning_deepcee.demo import ShakespeareDataModule

    block = gpt_kwargs(args.size)["block_size"]
    return ShakespeareDataModule(block_size=block, batch_size=batch_size, max_chars=args.max_chars)


def deepcee_summary(st: DeepCEEStrategy) -> dict[str, Any]:
    """What a run records of DeepCEE's layout: stages, micro-batches, placement and, once set
    up, the plan (schedule, block ranges, shares, its predicted step: the cost model's error),
    the profile and rank 0's set-up seconds part by part."""
    out: dict[str, Any] = {
        "num_stages": st.num_stages,
        "num_microbatches": st.num_microbatches,
        "placement": [list(ranks) for ranks in st.where.stages],
        "setup_s": st.setup_seconds,
        "trial_cost_s": st.trial.cost_s,
    }
    if st.plan is not None:
        out["schedule"] = st.plan.schedule
        out["ranges"] = [list(stage.block_range) for stage in st.plan.stages]
        out["predicted_step_s"] = st.plan.predicted_step_time_s
        out["shares"] = [list(stage.batch_shares) for stage in st.plan.stages]
        out["plan"] = st.plan.to_dict()
    if st.cluster_profile is not None:
        out["profile"] = st.cluster_profile.to_dict()
    return out


def _lightning_worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy
    from models import build_model, count_parameters

    from lightning_deepcee import DeepCEEStrategy

    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    g = args.global_batch
    if args.system == "ddp":
        if g % world:
            raise SystemExit(f"global batch {g} is not divisible by {world} devices")
        strategy: Any = DDPStrategy(process_group_backend="gloo")
        per_loader = g // world
    elif args.system in PLANNED_SYSTEMS:
        # Automatic profile + plan (or --plan: a saved plan, no profiling or search). Only the
        # profiling time budget is raised (default 60 s).
        strategy = DeepCEEStrategy(
            plan=args.plan,
            profile_budget_s=args.profile_budget_s,
            receive_ahead=args.receive_ahead == "on",
            compression="auto" if args.system == "deepcee-zip" else "off",
            device_cache=args.device_cache or "auto",
        )
        per_loader = g  # one pipeline replica: every rank reads the whole global batch
    elif args.system in ("deepcee-dp", "deepcee-dp-flat"):
        if args.system == "deepcee-dp-flat":
            os.environ["DEEPCEE_GRAD_BUCKET_MB"] = "inf"  # one bucket, after backward
        if g % world:
            raise SystemExit(f"global batch {g} is not divisible by {world} devices")
        strategy = DeepCEEStrategy(
            num_stages=1,
            num_microbatches=1,
            schedule="1f1b",
            profile=True,
            profile_budget_s=args.profile_budget_s,
            receive_ahead=args.receive_ahead == "on",
        )
        per_loader = g // world  # one replica per device, each reading its shard
    else:
        strategy = DeepCEEStrategy(schedule="1f1b", num_microbatches=args.microbatches)
        per_loader = g

    class BenchTimer(Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.rank_steps: list[dict[str, float]] = []
            self.cpu = time.process_time()  # all threads: executor, gloo, receive timers
            # Python's garbage collector: wall time of its collections in each step (a full
            # collection on a device at 12% of a core can stall a pipeline step).
            self.gc_s = 0.0
            self.gc_full = 0
            self._gc_start = 0.0
            gc.callbacks.append(self._on_gc)

        def _on_gc(self, phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                self._gc_start = time.perf_counter()
            else:
                self.gc_s += time.perf_counter() - self._gc_start
                self.gc_full += int(info.get("generation", 0) == 2)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.batch_start = time.perf_counter()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.before_optimizer = time.perf_counter()
            self.before_optimizer_cpu = time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.stamps.append(time.perf_counter())
            cpu, self.cpu = self.cpu, time.process_time()
            stats = getattr(trainer.strategy, "last_step_stats", None)
            if stats is not None:  # this rank's executor time by action kind, for the cost model
                step = {**stats.seconds_by_kind, "executor_wall": stats.wall_s}
                step.update({f"cpu_{k}": v for k, v in stats.cpu_s_by_kind.items()})
                step["executor_cpu"] = stats.cpu_s
                # Where the rest of the step goes: the stage's gradient all-reduce (the cost
                # model's allreduce term), the optimizer (its optimizer term), and Lightning's
                # loop between batches (data loading, hooks; not modelled).
                step["grad_sync_s"] = stats.grad_sync_s
                step["batch_wall"] = self.stamps[-1] - self.batch_start
                step["optimizer_wall"] = self.stamps[-1] - self.before_optimizer
                step["optimizer_cpu"] = time.process_time() - self.before_optimizer_cpu
                if len(self.stamps) > 1:
                    step["between_batches"] = self.batch_start - self.stamps[-2]
                # CPU this process used in the step: against the device's CPU quota, how close
                # to it the device ran (the lab's cgroup counters are not visible in its netns).
                step["cpu_s"] = self.cpu - cpu
                step["gc_s"], step["gc_full"] = self.gc_s, float(self.gc_full)
                self.gc_s, self.gc_full = 0.0, 0
                step["timeline"] = [
                    (str(a), round(t0, 6), round(t1, 6)) for a, t0, t1 in stats.timeline
                ]
                for r in trainer.strategy.transfer_records:  # received bytes and wire time per peer
                    if r.direction == "recv":
                        step[f"recv_bytes_from{r.peer}"] = (
                            step.get(f"recv_bytes_from{r.peer}", 0) + r.num_bytes
                        )
                        step[f"recv_wire_s_from{r.peer}"] = step.get(
                            f"recv_wire_s_from{r.peer}", 0
                        ) + (r.wire_s or 0.0)
                        step[f"recv_msgs_from{r.peer}"] = step.get(f"recv_msgs_from{r.peer}", 0) + 1
                self.rank_steps.append(step)

        def on_train_end(self, trainer, pl_module) -> None:
            rank_stats = None
            if isinstance(trainer.strategy, DeepCEEStrategy):
                import torch.distributed as dist

                window = self.rank_steps[args.warmup :] or self.rank_steps
                kinds = sorted({k for step in window for k in step if k != "timeline"})
                mine = {k: statistics.median(s.get(k, 0.0) for s in window) for k in kinds}
                mine["last_timeline"] = window[-1].get("timeline", []) if window else []
                # Per step (medians hide a one-off stall): wall, CPU and garbage collection.
                for key in ("batch_wall", "cpu_s", "gc_s", "gc_full"):
                    mine[f"{key}_steps"] = [round(s.get(key, 0.0), 4) for s in self.rank_steps]
                if args.all_timelines:  # every step's actions: find the slow steps
                    mine["timelines"] = [s.get("timeline", []) for s in self.rank_steps]
                rank_stats = [None] * world
                dist.all_gather_object(rank_stats, mine)
            if trainer.is_global_zero:
                extra: dict[str, Any] = dict(system=args.system, world_size=world)
                extra["parameters"] = count_parameters(pl_module)
                if isinstance(trainer.strategy, DeepCEEStrategy):
                    extra.update(deepcee_summary(trainer.strategy))
                    # Median seconds per step by action kind on every rank (after warm-up):
                    # where the measured step goes, against the cost model's per-stage costs.
                    extra["rank_stats"] = rank_stats
                _emit(g, self.stamps, args.warmup, extra)

    callbacks: list[Callback] = [BenchTimer()]
    if args.system == "deepcee-adapter":
        from lightning_deepcee import DynamicEnvironmentAdapter

        callbacks.append(DynamicEnvironmentAdapter())
    pl.seed_everything(0)
    model = build_model(args.model, args.size)
    trainer = device_trainer(
        strategy=strategy,
        max_steps=args.steps,
        limit_val_batches=0,
        precision="32-true",
        callbacks=callbacks,
        default_root_dir=str(REPO / "runs" / "bench"),
    )
    trainer.fit(model, datamodule=_data(args, per_loader))
    if rank == 0:
        print(f"[bench] rank 0 done ({args.system})", flush=True)


def _pipe_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from models import build_model, count_parameters, model_blocks, model_loss, uniform_split
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleavedZeroBubble,
    )

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_model(args.model, args.size)  # identical weights on every rank (seeded)
    n_params = count_parameters(model)
    blocks = model_blocks(model)
    # Interleaved zero bubble: 2 virtual stages per rank where the blocks allow it, else one
    # (the same schedule with split backward), so a layout exists for any rank count.
    per_rank = 2 if args.system == "pipe-zb" and 2 * world <= len(blocks) else 1
    num_stages = world * per_rank
    ranges = uniform_split(len(blocks), num_stages)
    # Rank order: stage s on rank s % world (ZB: rank r holds stages r and r + world).
    my_stages = [s for s in range(num_stages) if s % world == rank]
    device = torch.device("cpu")
    stages = [
        PipelineStage(nn.Sequential(*blocks[ranges[s][0] : ranges[s][1]]), s, num_stages, device)
        for s in my_stages
    ]
    params = [p for st in stages for p in st.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    m = args.microbatches

    loss_fn = model_loss(args.model)

    if args.system == "pipe-gpipe":
        schedule: Any = ScheduleGPipe(stages[0], m, loss_fn=loss_fn)
    elif args.system == "pipe-1f1b":
        schedule = Schedule1F1B(stages[0], m, loss_fn=loss_fn)
    else:
        schedule = ScheduleInterleavedZeroBubble(stages, m, loss_fn=loss_fn)
    first = 0 in my_stages
    last = (num_stages - 1) in my_stages

    # Same windows in the same order on every rank (seeded shuffle), whole global batch.
    data = _data(args, args.global_batch)
    data.setup("fit")
    gen = torch.Generator().manual_seed(0)
    loader = torch.utils.data.DataLoader(
        data.train_set, batch_size=args.global_batch, shuffle=True, drop_last=True, generator=gen
    )
    stamps: list[float] = []
    it = iter(loader)
    for _ in range(args.steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {}
        if last:
            kwargs = dict(target=y, losses=losses)
        if first:
            schedule.step(x, **kwargs)
        else:
            schedule.step(**kwargs)
        opt.step()
        stamps.append(time.perf_counter())
    if rank == 0:
        _emit(
            args.global_batch,
            stamps,
            args.warmup,
            dict(
                system=args.system,
                world_size=world,
                parameters=n_params,
                num_stages=num_stages,
                num_microbatches=m,
                ranges=[list(r) for r in ranges],
            ),
        )
    dist.barrier()
    dist.destroy_process_group()


def worker_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="lab_bench.py worker")
    p.add_argument("--system", required=True, choices=SYSTEMS)
    p.add_argument("--model", default="gpt", choices=["gpt", "cnn"])
    p.add_argument("--size", default="tiny")
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--max-chars", type=int, default=400_000)
    p.add_argument("--profile-budget-s", type=float, default=300.0)
    p.add_argument("--plan", default=None)
    p.add_argument("--device-cache", default=None)
    p.add_argument("--receive-ahead", default="on", choices=["on", "off"])
    p.add_argument("--all-timelines", action="store_true")
    args = p.parse_args(argv)
    if args.system in LIGHTNING_SYSTEMS:
        _lightning_worker(args)
    else:
        _pipe_worker(args)


# =============================================================================== harness side
def split_system(system: str) -> tuple[str, tuple[str, ...]]:
    """``"ddp@cloud+edge"`` -> ``("ddp", ("cloud", "edge"))``; no ``@``: every region (``()``)."""
    base, _, regions = system.partition("@")
    return base, tuple(r for r in regions.split("+") if r)


def region_subsets(topo: Any) -> list[tuple[str, ...]]:
    """The proper region subsets a user could train on alone, fastest first.

    A subset must hold the fastest region (the one with the fastest device: a set without it
    loses to the same set with it for data parallelism) and be connected by the topology's WAN
    links without passing through a region outside it. Regions keep the topology's order.
    """
    names = [r.name for r in topo.regions if topo.devices_in(r.name)]
    fastest = max(names, key=lambda n: max(d.cpu for d in topo.devices_in(n)))
    neighbours = {n: set() for n in names}
    for link in topo.wan:
        a, b = link.regions
        if a in neighbours and b in neighbours:
            neighbours[a].add(b)
            neighbours[b].add(a)
    subsets = []
    for size in range(1, len(names)):
        for subset in itertools.combinations(names, size):
            if fastest not in subset:
                continue
            seen, todo = {fastest}, [fastest]
            while todo:
                for n in neighbours[todo.pop()] & set(subset):
                    if n not in seen:
                        seen.add(n)
                        todo.append(n)
            if len(seen) == len(subset):
                subsets.append(subset)
    return subsets


def sub_topology(topo: Any, regions: tuple[str, ...]) -> Any:
    """``topo`` restricted to ``regions``: their devices (rank order kept), LANs and WAN links."""
    from lightning_deepcee.lab.topology import Topology

    keep = set(regions)
    return Topology(
        name=f"{topo.name}-{'+'.join(regions)}",
        regions=tuple(r for r in topo.regions if r.name in keep),
        devices=tuple(d for d in topo.devices if d.region in keep),
        wan=tuple(w for w in topo.wan if set(w.regions) <= keep),
        cpu_period_ms=topo.cpu_period_ms,
    )


TRIAL_STEPS = 3
"""``lightning_deepcee.planner.rivals.TRIAL_STEPS`` (the driver imports no torch)."""
TRIAL_CANDIDATES = 4
"""``DeepCEEStrategy(plan_trial=...)``'s default: the searched plan and up to three rivals."""
TRIAL_WARMUP = TRIAL_CANDIDATES * TRIAL_STEPS + 2
"""Warm-up steps a DeepCEE system with an automatic plan needs at least: its plan trial
(up to ``TRIAL_CANDIDATES`` candidates, ``TRIAL_STEPS`` training steps each) trains the fit's
first steps, plus a step after each of the last moves; the trial needs twice its steps left in
the fit, or it is skipped."""


def system_steps(system: str, steps: int, warmup: int, planned: bool) -> tuple[int, int]:
    """The (steps, warm-up) ``system`` runs: as given, but a DeepCEE system with an automatic
    plan (``planned``) warms up past its plan trial, and its fit is long enough for the trial
    to run; the window (``steps - warmup``) is the same for every system."""
    if split_system(system)[0] not in PLANNED_SYSTEMS or not planned:
        return steps, warmup
    window = steps - warmup
    longer = max(warmup, TRIAL_WARMUP, 2 * TRIAL_CANDIDATES * TRIAL_STEPS - window)
    return longer + window, longer


def system_batch(system: str, num_devices: int, global_batch: int) -> int:
    """The global batch ``system`` runs: DDP needs a multiple of its device count (the nearest,
    at least one sample per device); every other system runs ``global_batch`` as given."""
    if split_system(system)[0] != "ddp" or global_batch % num_devices == 0:
        return global_batch
    return max(1, round(global_batch / num_devices)) * num_devices


def _git_commit() -> str:
    """HEAD's short hash, with ``+dirty`` when the tree has uncommitted changes (results that
    benchmarks wrote under ``benchmarks/results`` do not count: the code is HEAD's)."""
    status = ["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
              ":(exclude)benchmarks/results"]  # fmt: skip
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(status, cwd=REPO, text=True, capture_output=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _load(path: Path) -> dict[str, Any]:
    if path.exists():
        return json.loads(path.read_text())
    return {}


def _rank0_bench(log: Path) -> dict[str, Any] | None:
    if not log.exists():
        return None
    for line in log.read_text(errors="replace").splitlines():
        line = line.strip()
        if line.startswith("BENCH "):
            return json.loads(line[len("BENCH ") :])
    return None


def _other_lab_shells() -> list[int]:
    """Pids of Mininet host/switch shells (``bash ... mininet:<node>``) of any running lab.

    The lab's lock lives in its state directory, so a lab started with another
    ``DEEPCEE_LAB_STATE_DIR`` (the lab tests use a temporary one) is not excluded by it, and both
    would use the same device names. Read-only check; nothing is stopped.
    """
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(c.startswith(b"mininet:") for c in cmd):
            pids.append(int(d.name))
    return pids


def _wait_for_quiet_lab(max_wait_s: float) -> bool:
    deadline = time.time() + max_wait_s
    warned = False
    while True:
        busy = _other_lab_shells()
        if not busy:
            return True
        if time.time() > deadline:
            return False
        if not warned:
            print(f"[bench] another lab is running (shell pids {busy[:4]}...): waiting", flush=True)
            warned = True
        time.sleep(5)


def run_one(args: argparse.Namespace, system: str, run: int, out: Path) -> dict[str, Any]:
    """One lab run of ``system`` (``base@regions`` runs on those regions' devices alone)."""
    import yaml

    from lightning_deepcee.lab.topology import load_topology

    topo = load_topology(args.topology)
    base, regions = split_system(system)
    topology_file = Path(args.topology)
    if regions:
        topo = sub_topology(topo, regions)
        out.mkdir(parents=True, exist_ok=True)
        topology_file = out / "topology.yaml"
        topology_file.write_text(yaml.safe_dump(topo.to_dict(), sort_keys=False))
    batch = system_batch(system, len(topo.devices), args.global_batch)
    steps, warmup = system_steps(system, args.steps, args.warmup, planned=args.plan is None)
    kept = out.parent / "device-cache"  # the system's runs share it
    if base == "deepcee-kept" and run == 0:
        shutil.rmtree(kept, ignore_errors=True)
    worker = worker_job(
        __file__,
        "--system", base,
        "--model", args.model,
        "--size", args.size,
        "--global-batch", str(batch),
        "--microbatches", str(args.microbatches),
        "--steps", str(steps),
        "--warmup", str(warmup),
        "--max-chars", str(args.max_chars),
        "--profile-budget-s", str(args.profile_budget_s),
        "--receive-ahead", args.receive_ahead,
        *(["--plan", str(Path(args.plan).resolve())] if args.plan else []),
        *(["--device-cache", str(kept.resolve())] if base == "deepcee-kept" else []),
        *(["--all-timelines"] if args.all_timelines else []),
    )  # fmt: skip
    cmd = lab_command(topology_file, out, args.run_timeout_s, worker, master_port=args.master_port)
    if not _wait_for_quiet_lab(args.wait_other_lab_s):
        return dict(run=run, returncode=3, error="another lab kept running; not started")
    if out.exists():  # never parse a BENCH line left by an earlier run
        for old in out.glob("*.log"):
            old.unlink()
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.time()
    print(f"[bench] {system} run {run + 1}/{args.runs}: {' '.join(cmd)}", flush=True)
    try:
        # The lab bounds itself with --timeout-s; this outer bound only covers set-up/teardown.
        proc = subprocess.run(cmd, cwd=REPO, timeout=args.run_timeout_s + 120, text=True,
                              capture_output=True)  # fmt: skip
        rc, err = proc.returncode, proc.stderr[-3000:]
    except subprocess.TimeoutExpired:
        rc, err = 124, "harness timeout"
    lab_s = time.time() - t0
    bench = _rank0_bench(out / f"{topo.devices[0].name}.log")
    record: dict[str, Any] = dict(run=run, returncode=rc, lab_wall_s=round(lab_s, 1), out=str(out))
    record["devices"] = [d.name for d in topo.devices]
    record["loadavg_before"] = load_before  # the machine is shared: other jobs may compete
    if bench is not None and rc == 0:
        record.update(bench)
        print(f"[bench]   {system}: {bench['samples_per_s']:.2f} samples/s "
              f"(lab {lab_s:.0f} s)", flush=True)  # fmt: skip
    else:
        record["error"] = err.strip().splitlines()[-5:] if err else "no BENCH line"
        print(f"[bench]   {system} FAILED rc={rc}: {record['error']}", flush=True)
    return record


def _stats(runs: list[dict[str, Any]]) -> dict[str, float] | None:
    vals = [r["samples_per_s"] for r in runs if "samples_per_s" in r]
    if not vals:
        return None
    return dict(median=statistics.median(vals), min=min(vals), max=max(vals), n=len(vals))


def cluster_bound(result: dict[str, Any]) -> dict[str, float] | None:
    """The all-devices compute bound in samples/s: the devices' summed sustained speed on the
    whole model (no bubble, transfer, fixed per-call cost or optimizer step), from each
    profile a run measured on every device of the topology; median, min, max over them."""
    from lightning_deepcee.planner.subsets import sample_rates
    from lightning_deepcee.profiler.data import ClusterProfile

    everyone = len(result["config"].get("devices", [])) or None
    bounds = []
    for system in result["systems"].values():
        for run in system.get("runs", []):
            profile = run.get("profile")
            if isinstance(profile, dict) and len(profile.get("devices", [])) == everyone:
                bounds.append(float(sample_rates(ClusterProfile.from_dict(profile)).sum()))
    if not bounds:
        return None
    return dict(median=statistics.median(bounds), min=min(bounds), max=max(bounds), n=len(bounds))


def _order(result: dict[str, Any]) -> list[str]:
    """Systems in the invocation's order (older files: :data:`SYSTEMS` order, then the rest)."""
    systems = result["systems"]
    given = [s for s in result["config"].get("systems", []) if s in systems]
    known = [s for s in SYSTEMS if s in systems and s not in given]
    return given + known + [s for s in systems if s not in given and s not in known]


def best_alternative(result: dict[str, Any]) -> tuple[str, dict[str, float]] | None:
    """The fastest system that is not DeepCEE (median samples/s), or None if none ran."""
    best: tuple[str, dict[str, float]] | None = None
    for s, entry in result["systems"].items():
        st = _stats(entry["runs"])
        if split_system(s)[0] in DEEPCEE_SYSTEMS or st is None:
            continue
        if best is None or st["median"] > best[1]["median"]:
            best = (s, st)
    return best


def _layout(cfg: dict[str, Any], r: dict[str, Any]) -> str:
    if "num_stages" not in r:
        n = r.get("world_size", 1)
        return f"{n} replicas x {r.get('global_batch', cfg['global_batch']) // n}"
    layout = f"{r['num_stages']} stages"
    if "schedule" in r:
        layout += f", {r['schedule']}"
    layout += f", m={r.get('num_microbatches')}"
    if "ranges" in r:
        layout += ", blocks " + " ".join(f"{a}-{b}" for a, b in r["ranges"])
    if "placement" in r:
        layout += ", ranks " + " ".join(",".join(str(x) for x in ranks) for ranks in r["placement"])
    idle = (r.get("plan") or {}).get("idle_ranks") or []
    if idle:
        layout += ", idle " + ",".join(str(x) for x in idle)
    hops = (r.get("plan") or {}).get("hop_compression") or []
    if any(h != "off" for h in hops):
        layout += ", hops " + " ".join(hops)
    return layout


def render(result: dict[str, Any]) -> str:
    """The Markdown of ``<name>.md`` (``benchmarks/report.py`` renders it too)."""
    cfg = result["config"]
    systems: dict[str, Any] = result["systems"]
    order = _order(result)
    best = best_alternative(result)
    model = cfg.get("model", "gpt")
    sample = (
        f"{cfg['gpt']['block_size']} tokens" if model == "gpt" else "32x32 RGB images (synthetic)"
    )
    topology = Path(cfg["topology"]).stem
    when = (
        f"one invocation on {cfg['date']} at commit `{cfg['commit']}`, systems interleaved run by "
        "run"
        if "date" in cfg
        else "runs of several invocations, date and commit not recorded"
    )
    lines = [
        f"Topology `{topology}`, {model.upper()} `{cfg['size']}` "
        f"({cfg.get('parameters', '?'):,} parameters), "
        f"global batch {cfg['global_batch']} x {sample}, {cfg['steps']} steps, "
        f"window = last {cfg['steps'] - cfg['warmup']} steps, pipelining micro-batches "
        f"{cfg['microbatches']}; {when}.",
        "",
    ]
    if cfg.get(model, {}).get("pipeline_blocks") == "sublayer":
        lines[-1:-1] = [
            "Every system trains the same model and weights; the pipelines see each layer's "
            "attention and MLP as blocks of their own, so a stage may end mid-layer.",
        ]
    deepcee = _stats(systems.get("deepcee", {}).get("runs", []))
    if deepcee and best:
        lines += [
            f"**`deepcee` {deepcee['median']:.2f} samples/s against the best alternative "
            f"`{best[0]}` {best[1]['median']:.2f}: {deepcee['median'] / best[1]['median']:.2f}x** "
            "(medians).",
            "",
        ]
    bound = cluster_bound(result)
    if bound is not None:
        spread = f"; {bound['min']:.2f}-{bound['max']:.2f}" if bound["n"] > 1 else ""
        lines += [
            f"All-devices compute bound: {bound['median']:.2f} samples/s (the devices' summed "
            f"sustained speed on the whole model, from the {bound['n']} profile(s) DeepCEE "
            f"measured{spread}); `of bound` is each system's median against it.",
            "",
        ]
    lines += [
        "| system | devices | runs ok | samples/s median | min | max | of bound | median vs "
        "best alternative | layout |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    errors: list[str] = []
    notes: list[str] = []
    setups: list[str] = []
    # Runs from before the trial trained (its whole time a set-up part) have no trial cost.
    runs = [r for entry in systems.values() for r in entry.get("runs", [])]
    with_cost = any("trial_cost_s" in r for r in runs)
    for s in order:
        runs = systems[s]["runs"]
        st = _stats(runs)
        ok = f"{st['n'] if st else 0}/{len(runs)}"
        layouts = []
        devices = next((r["devices"] for r in runs if "devices" in r), None)
        for r in (r for r in runs if "samples_per_s" in r):
            if r.get("predicted_step_s"):  # a manual layout predicts nothing (0)
                measured = r["global_batch"] / r["samples_per_s"]
                predicted = r["predicted_step_s"]
                window = r["step_times_s"][-r["window_steps"] :]
                median = statistics.median(window)
                errors.append(
                    f"| {s} | {r.get('run', '?')} | {predicted * 1e3:.0f} | {measured * 1e3:.0f} "
                    f"| {(predicted - measured) / measured:+.0%} | {median * 1e3:.0f} "
                    f"| {(predicted - median) / median:+.0%} | {max(window) * 1e3:.0f} |"
                )
            if r.get("setup_s"):
                setups.append(_setup_row(s, r, with_cost))
            if r.get("global_batch", cfg["global_batch"]) != cfg["global_batch"]:
                note = (
                    f"`{s}` runs global batch {r['global_batch']}, the multiple of its "
                    f"{r['world_size']} devices nearest to {cfg['global_batch']}."
                )
                if note not in notes:
                    notes.append(note)
            if r.get("warmup", cfg["warmup"]) != cfg["warmup"]:
                note = (
                    f"`{s}` runs {r['steps']} steps and warms up {r['warmup']} (its plan trial "
                    "trains the first steps), the same window."
                )
                if note not in notes:
                    notes.append(note)
            layout = _layout(cfg, r)
            if layout not in layouts:
                layouts.append(layout)
        layout = (
            "differs by run: " + " / ".join(layouts)
            if len(layouts) > 1
            else (layouts[0] if layouts else "")
        )
        where = ", ".join(devices) if devices else "all"
        if st is None:
            lines.append(f"| {s} | {where} | {ok} | failed | | | | | |")
            continue
        ratio = f"{st['median'] / best[1]['median']:.2f}x" if best else "n/a"
        of_bound = f"{st['median'] / bound['median']:.0%}" if bound else ""
        lines.append(
            f"| {s} | {where} | {ok} | {st['median']:.2f} | {st['min']:.2f} | {st['max']:.2f} "
            f"| {of_bound} | {ratio} | {layout} |"
        )
    if notes:
        lines += ["", *notes]
    if errors:
        lines += [
            "",
            "Cost-model error (planned runs): predicted step vs measured mean step of the window "
            "(what samples/s counts), and vs the window's median step (one stalled step moves "
            "the mean, not the median; the slowest step is shown).",
            "",
            "| system | run | predicted ms | measured ms | error | median ms | error vs median "
            "| slowest ms |",
            "|---|---|---|---|---|---|---|---|",
            *errors,
        ]
    if setups and with_cost:
        lines += [
            "",
            "Set-up on rank 0 before the first step (`DeepCEE: set-up` line), in seconds: "
            "profiling (the slowest device's block timings, then the links), planning, building, "
            "the plan trial's set-up part (choosing the rivals; blank: none ran); then what the "
            "trial's training steps cost beyond the winner's pace, moves included "
            "(`PlanTrial.cost_s`; 0: no trial ran), and the two summed.",
            "",
            "| system | run | set-up | profile | blocks | network | plan | build | trial "
            "| trial cost | set-up + trial cost |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            *setups,
        ]
    elif setups:
        lines += [
            "",
            "Set-up on rank 0 before the first step (`DeepCEE: set-up` line), in seconds: "
            "profiling (the slowest device's block timings, then the links), planning, building, "
            "the plan trial (blank: none ran).",
            "",
            "| system | run | set-up | profile | blocks | network | plan | build | trial |",
            "|---|---|---|---|---|---|---|---|---|",
            *setups,
        ]
    return "\n".join(lines) + "\n"


def _setup_row(system: str, run: dict[str, Any], with_cost: bool) -> str:
    parts = run["setup_s"]
    total = sum(v for k, v in parts.items() if k in ("profile", "plan", "build", "trial"))
    cells = [f"{parts[k]:.1f}" if k in parts else "" for k in SETUP_PARTS]
    if with_cost:
        cost = run.get("trial_cost_s", 0.0)
        cells += [f"{cost:.1f}", f"{total + cost:.1f}"]
    return f"| {system} | {run.get('run', '?')} | {total:.1f} | " + " | ".join(cells) + " |"


SETUP_PARTS = ("profile", "profile_blocks", "profile_network", "plan", "build", "trial")
"""Keys of a run's ``setup_s`` (``DeepCEEStrategy.setup_seconds``), in the table's order."""


def report(result: dict[str, Any], results_dir: Path, name: str) -> str:
    table = render(result)
    (results_dir / f"{name}.md").write_text(table)
    _plot(result, _order(result), results_dir / f"{name}.png", name)
    return table


def _plot(result: dict[str, Any], order: list[str], path: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, med, lo, hi, pts = [], [], [], [], []
    for s in order:
        st = _stats(result["systems"][s]["runs"])
        if st is None:
            continue
        labels.append(s)
        med.append(st["median"])
        lo.append(st["median"] - st["min"])
        hi.append(st["max"] - st["median"])
        pts.append(
            [r["samples_per_s"] for r in result["systems"][s]["runs"] if "samples_per_s" in r]
        )
    fig, ax = plt.subplots(figsize=(1.3 * max(3, len(labels)) + 1, 3.6))
    x = range(len(labels))
    ax.bar(x, med, yerr=[lo, hi], capsize=4, color="#4c72b0")
    for i, p in enumerate(pts):
        ax.scatter([i] * len(p), p, color="k", s=10, zorder=3)
    ax.set_xticks(list(x), labels, rotation=20)
    ax.set_ylabel("samples/s (median, min-max)")
    cfg = result["config"]
    model = cfg.get("model", "gpt").upper()
    ax.set_title(f"{name}: {model} {cfg['size']}, global batch {cfg['global_batch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_with_config(p: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; a ``--config`` YAML (configs/bench/) supplies defaults for any option.

    Keys may use ``-`` or ``_``. The file is checked against a dataclass made from ``p``'s options
    (an int option takes an int, a flag true or false, a path or text option text) by the schema
    loader (omegaconf); an unknown key, a wrong type or a value outside an option's choices stops
    with an error naming the file and the key. Command-line options override the file.
    """
    import dataclasses
    from collections.abc import Mapping

    from lightning_deepcee.profiler.schema import load_structured, read_yaml

    pre, _ = p.parse_known_args(argv)
    if pre.config is None:
        return p.parse_args(argv)
    options = [a for a in p._actions if a.dest not in ("help", "config", argparse.SUPPRESS)]
    kinds = {
        a.dest: bool if a.nargs == 0 else a.type if a.type in (int, float) else str for a in options
    }
    schema = dataclasses.make_dataclass(
        "BenchConfig",
        [(dest, kind | None, dataclasses.field(default=None)) for dest, kind in kinds.items()],
    )
    source = str(pre.config)
    try:
        data = read_yaml(pre.config)
    except FileNotFoundError:
        p.error(f"config file {source!r} does not exist")
    except ValueError as err:  # not valid YAML
        p.error(str(err))
    if isinstance(data, Mapping) or data is None:  # an empty file sets nothing
        data = {str(key).replace("-", "_"): value for key, value in (data or {}).items()}
    try:
        config = load_structured(schema, data, source=source)
        for action in options:
            value = getattr(config, action.dest)
            if action.dest in data and action.choices and value not in action.choices:
                raise ValueError(
                    f"{source}: {action.dest}: expected one of {list(action.choices)}, got "
                    f"{value!r}; write one of them"
                )
    except ValueError as err:
        p.error(str(err))
    p.set_defaults(**{dest: getattr(config, dest) for dest in data})
    return p.parse_args(argv)


def harness_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--topology", type=Path, help="lab topology YAML (required, or in --config)")
    p.add_argument("--model", default="gpt", choices=["gpt", "cnn"])
    p.add_argument("--size", default="tiny", help="preset of benchmarks/models.py")
    p.add_argument(
        "--name", help="results file name (default: the topology's name): <results>/<name>.json"
    )
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps excluded from the window")
    p.add_argument("--global-batch", type=int, default=48)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--max-chars", type=int, default=400_000)
    p.add_argument(
        "--systems",
        default=f"deepcee,ddp,{REGION_SUBSETS},pipe-gpipe,pipe-1f1b,pipe-zb",
        help=f"comma-separated; SYSTEM@region+region runs on those regions alone; "
        f"{REGION_SUBSETS} adds ddp@ every subset of region_subsets()",
    )
    p.add_argument("--results", type=Path, default=HERE / "results")
    p.add_argument("--logs", type=Path, default=REPO / "runs" / "bench")
    p.add_argument("--run-timeout-s", type=float, default=400.0)
    p.add_argument("--master-port", type=int, default=29517)
    p.add_argument(
        "--wait-other-lab-s",
        type=float,
        default=600.0,
        help="wait this long for another running lab to finish before each run",
    )
    p.add_argument(
        "--profile-budget-s",
        type=float,
        default=300.0,
        help="DeepCEEStrategy(profile_budget_s=...) for the deepcee system",
    )
    p.add_argument(
        "--plan", default=None, help="deepcee systems: run this saved plan (no profiling/search)"
    )
    p.add_argument(
        "--receive-ahead",
        default="on",
        choices=["on", "off"],
        help="deepcee systems: DeepCEEStrategy(receive_ahead=...) (the A/B of the transport)",
    )
    p.add_argument(
        "--all-timelines",
        action="store_true",
        help="deepcee systems: keep every step's action timeline per rank in the results "
        "(default: the last step's; each step's wall, CPU and garbage-collection time are "
        "always kept)",
    )
    p.add_argument("--report-only", action="store_true")
    p.add_argument(
        "--fresh",
        action="store_true",
        help="accepted for old command lines: every invocation writes a new table",
    )
    p.add_argument(
        "--config", type=Path, help="YAML of defaults for these options (configs/bench/)"
    )
    args = parse_with_config(p, argv)
    if args.topology is None:
        p.error("--topology is required (on the command line or in --config)")
    args.topology = Path(args.topology)

    from lightning_deepcee.lab.topology import load_topology

    topo = load_topology(args.topology)
    name = args.name or topo.name
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / f"{name}.json"
    if args.report_only:
        print(report(_load(path), args.results, name))
        return 0

    from models import MODELS, build_model, count_parameters

    if args.size not in MODELS[args.model]:
        sizes = sorted(MODELS[args.model])
        p.error(f"unknown {args.model} size {args.size!r}; choose from {sizes}")
    config = dict(
        topology=str(args.topology),
        model=args.model,
        size=args.size,
        **{args.model: MODELS[args.model][args.size]},
        parameters=count_parameters(build_model(args.model, args.size)),
        global_batch=args.global_batch,
        microbatches=args.microbatches,
        steps=args.steps,
        warmup=args.warmup,
        max_chars=args.max_chars,
        devices=[dict(name=d.name, region=d.region, cpu=d.cpu) for d in topo.devices],
        wan=[dict(regions=list(w.regions), mbit=w.mbit) for w in topo.wan],
    )
    config["date"] = time.strftime("%Y-%m-%d")
    config["commit"] = _git_commit()
    systems: list[str] = []
    for s in (s.strip() for s in args.systems.split(",") if s.strip()):
        if s == REGION_SUBSETS:
            systems += [f"ddp@{'+'.join(sub)}" for sub in region_subsets(topo)]
            continue
        base, regions = split_system(s)
        if base not in SYSTEMS:
            p.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)} or {REGION_SUBSETS}")
        unknown = [r for r in regions if r not in {x.name for x in topo.regions}]
        if unknown:
            p.error(f"system {s!r}: no region {unknown[0]!r} in {args.topology}")
        systems.append(s)
    systems = list(dict.fromkeys(systems))
    config["systems"] = systems
    # One invocation, one table: systems interleaved run by run (A1 B1 C1, A2 B2 C2, ...), so
    # a drift of the machine's state touches every system alike.
    result = dict(config=config, systems={s: {"runs": []} for s in systems})
    print(f"[bench] {len(systems)} systems x {args.runs} runs, interleaved: {', '.join(systems)}")
    for r in range(args.runs):
        for s in systems:
            out = args.logs / name / s.replace("@", "_at_").replace("+", "_") / f"run{r}"
            rec = run_one(args, s, r, out)
            steps, warmup = system_steps(s, args.steps, args.warmup, planned=args.plan is None)
            rec.update(steps=steps, warmup=warmup, command_microbatches=args.microbatches)
            result["systems"][s]["runs"].append(rec)
            result["updated"] = time.strftime("%Y-%m-%d %H:%M:%S")
            write_json(path, result)
    print(report(result, args.results, name))
    return 0


if __name__ == "__main__":
    main(worker_main, harness_main)
