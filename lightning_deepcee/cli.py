"""deepcee: measure a cluster, plan DeepCEE pipelines offline and merge their checkpoints.

deepcee profile SCRIPT [ARGS...]            run a LightningCLI training script's set-up only
                                            (profile, plan, save the record), no training
deepcee plan --profile P.yaml --global-batch-size B --out plan.json [--timeline plan.png]
                                            plan offline from a (measured or hand-written) profile
deepcee consolidate CHECKPOINT_DIR OUT.pt   merge a sharded pipeline checkpoint
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["DEVICE_GAIN_DEFAULT", "main"]

DEVICE_GAIN_DEFAULT = 0.05
"""``planner.DEVICE_GAIN``, written out so that parsing the command line imports no planner
(``tests/unit/test_cli_plan.py`` checks that the two agree)."""


def _consolidate(args: argparse.Namespace) -> int:
    import torch

    from lightning_deepcee.runtime.checkpoint import consolidate_checkpoint

    state = consolidate_checkpoint(args.checkpoint)
    torch.save(state, args.output)
    num = sum(v.numel() for v in state.values())
    print(f"wrote {args.output}: {len(state)} tensors, {num:,} values")
    return 0


def _refuse_overwrite(args: argparse.Namespace) -> None:
    """Raise when an output file exists and ``--force`` was not given."""
    existing = [p for p in (args.out, args.timeline, args.trace) if p and Path(p).exists()]
    if existing and not args.force:
        raise FileExistsError(
            f"{', '.join(existing)} already exist(s); pass --force to overwrite, or choose "
            "another --out / --timeline / --trace"
        )


def _profile(args: argparse.Namespace) -> int:
    """``SCRIPT fit ARGS --trainer.max_steps=0`` in a child process with this environment (so
    torchrun's variables reach it): Lightning sets up (the strategy profiles, plans and saves
    the record) and stops before the first step."""
    import subprocess

    script = Path(args.script)
    if not script.is_file():
        raise FileNotFoundError(f"{script}: no such training script")
    command = [sys.executable, str(script), "fit", *args.args, "--trainer.max_steps=0"]
    return subprocess.run(command, check=False).returncode


def _plan(args: argparse.Namespace) -> int:
    from lightning_deepcee.planner import plan_search
    from lightning_deepcee.planner.record import format_device_sets, plan_timeline, simulate_plan
    from lightning_deepcee.planner.search import DeviceSetScore
    from lightning_deepcee.profiler import ClusterProfile

    _refuse_overwrite(args)
    path = str(args.profile)
    is_json = path.endswith(".json")
    profile = ClusterProfile.from_json(path) if is_json else ClusterProfile.from_yaml(path)
    device_sets: dict[tuple[int, ...], DeviceSetScore] = {}
    plan = plan_search(
        profile,
        num_blocks=profile.num_blocks,
        global_batch_size=args.global_batch_size,
        schedules=tuple(args.schedules.split(",")),
        beam_width=args.beam_width,
        device_gain=args.device_gain,
        device_sets=device_sets,
    )
    print(plan.format_table())
    print(format_device_sets(profile, device_sets, plan))
    print(f"(estimates: the cost model's predictions from the figures in {path})")
    plan.to_json(args.out)
    print(f"wrote {args.out}")
    if args.trace:
        simulate_plan(plan, profile).write_chrome_trace(args.trace)
        print(f"wrote {args.trace} (open in Perfetto)")
    if args.timeline:
        plan_timeline(plan, profile, args.timeline)
        print(f"wrote {args.timeline}")
    return 0


def _subcommand(
    sub: Any, func: Callable[[argparse.Namespace], int], help: str, description: str | None = None
) -> argparse.ArgumentParser:
    """The sub-command that runs ``func`` (named after it, without the underscore)."""
    parser: argparse.ArgumentParser = sub.add_parser(
        func.__name__.lstrip("_"), help=help, description=description
    )
    parser.set_defaults(func=func)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from lightning_deepcee._version import VERSION

    parser = argparse.ArgumentParser(
        prog="deepcee",
        description="Plan DeepCEE pipelines offline from a cluster profile, and merge sharded "
        "pipeline checkpoints into one state_dict. Training itself runs through Lightning: "
        "Trainer(strategy=DeepCEEStrategy()).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {VERSION}")
    sub = parser.add_subparsers(dest="command", required=True)
    cons = _subcommand(
        sub,
        _consolidate,
        "merge a sharded pipeline checkpoint into one plain state_dict",
    )
    cons.add_argument("checkpoint", help="checkpoint directory (with meta.pt and stage_NNN.pt)")
    cons.add_argument("output", help="output file for torch.save(state_dict)")
    prof = _subcommand(
        sub,
        _profile,
        "measure the devices and links without training",
        "Run a LightningCLI training script (launched like training: torchrun on every site, or "
        "Lightning's own launcher) through DeepCEEStrategy's set-up only: it profiles every "
        "device and link, plans, and saves plan.json, profile.json, timeline.png and why.txt in "
        "<default_root_dir>/deepcee/, then stops before the first step. Plan again on the "
        "profile with 'deepcee plan --profile'.",
    )
    prof.add_argument("script", help="the training script, e.g. examples/train_gpt.py")
    prof.add_argument(
        "args", nargs=argparse.REMAINDER, help="its arguments, e.g. --config configs/sites.yaml"
    )
    plan = _subcommand(
        sub,
        _plan,
        "search a plan offline from a cluster profile",
        "Search a plan offline from a cluster profile (one that "
        "DeepCEEStrategy(profile_cache=...) measured, or one written by hand) and write it as "
        "JSON; train with it by DeepCEEStrategy(plan='plan.json'), which skips the search.",
    )
    plan.add_argument(
        "--profile", required=True, metavar="FILE", help="cluster profile, YAML or JSON"
    )
    plan.add_argument(
        "--global-batch-size",
        type=int,
        required=True,
        metavar="N",
        help="samples per optimizer step over the whole cluster (what the plan is sized for)",
    )
    plan.add_argument(
        "--schedules",
        default="1f1b,zb-h1,compact",
        help="schedules the search may choose, comma-separated (default: %(default)s)",
    )
    plan.add_argument(
        "--beam-width",
        type=int,
        default=8,
        help="stage orders kept per depth while searching; larger is slower and rarely better "
        "(default: %(default)s)",
    )
    plan.add_argument(
        "--device-gain",
        type=float,
        default=DEVICE_GAIN_DEFAULT,
        help="use more devices only when predicted at least this fraction faster "
        "(default: %(default)s)",
    )
    plan.add_argument(
        "--out", default="plan.json", help="where to write the plan, JSON (default: %(default)s)"
    )
    plan.add_argument(
        "--force", action="store_true", help="overwrite --out (and the picture files) if they exist"
    )
    plan.add_argument(
        "--timeline",
        help="also write the simulated step as a PNG: a row per stage (its devices), a box per "
        "F/B/W of each micro-batch, the bubble fraction in the title",
    )
    plan.add_argument(
        "--trace", help="also write the simulated step as a chrome trace (open in Perfetto)"
    )
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"deepcee {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
