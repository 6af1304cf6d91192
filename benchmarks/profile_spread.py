"""Every lab run's plan re-predicted under every run's profile: what the profile alone explains.

Each planned run of ``benchmarks/lab_bench.py`` records the profile its set-up measured, the plan
the search chose on it, the plan's predicted step and the measured steps. This script re-predicts
every run's plan under every run's profile of the same benchmark (same lab, same code, same
model) with the cost model of this checkout, and prints, per plan:

- the prediction under its own profile (what the run reported) and its error;
- the median prediction under the *other* runs' profiles and its error;
- the spread of the predictions over all profiles (largest / smallest - 1): what re-measuring
  the same lab a few minutes later does to the prediction of one fixed plan;
- the rank of its own profile among them (1 = its own profile was the most optimistic for it).

A search picks the plan its profile makes look fastest, so a profile that happens to be optimistic
for some plan makes that plan the winner and its prediction too low (the winner's curse); the
rank column shows how often that happened. Pure: the planner and the profile data, no torch.

Run from the repository root::

    python benchmarks/profile_spread.py benchmarks/results/cee6_gpt5m.json \
        benchmarks/results/cee6_cnn.json --out benchmarks/results/profile_spread.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness import planned_runs

from lightning_deepcee.planner.cost_model import predict_plan
from lightning_deepcee.planner.plan import Plan
from lightning_deepcee.profiler.data import ClusterProfile

__all__ = ["PlannedRun", "cross_predictions", "header", "load_runs", "main", "report", "sections"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedRun:
    """One planned lab run: its profile, its plan and the mean step of its measured window."""

    label: str
    profile: ClusterProfile
    plan: Plan
    measured_s: float


def load_runs(path: str | Path) -> list[PlannedRun]:
    """Every run of a ``lab_bench.py`` results file that has a profile and a plan."""
    runs = []
    for system, index, run in planned_runs(path):
        if not run.get("step_times_s"):
            continue
        window = run["step_times_s"][-int(run["window_steps"]) :]
        runs.append(
            PlannedRun(
                label=f"{system} {index}",
                profile=ClusterProfile.from_dict(run["profile"]),
                plan=Plan.from_dict(run["plan"]),
                measured_s=statistics.fmean(window),
            )
        )
    return runs


def cross_predictions(runs: list[PlannedRun]) -> list[list[float]]:
    """``table[i][j]``: run ``i``'s plan predicted under run ``j``'s profile, in seconds."""
    return [[predict_plan(other.profile, run.plan).step_time_s for other in runs] for run in runs]


def _error(predicted_s: float, measured_s: float) -> str:
    return f"{predicted_s / measured_s - 1:+.0%}"


def report(name: str, runs: list[PlannedRun], table: list[list[float]]) -> str:
    """A Markdown section: one row per plan, then the benchmark's summary."""
    lines = [
        f"### {name}",
        "",
        "| run | layout | measured ms | own profile ms | error | others' median ms | error "
        "| spread over profiles | own profile's rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    own_errors, other_errors, first = [], [], 0
    for i, run in enumerate(runs):
        row = table[i]
        own = row[i]
        others = [value for j, value in enumerate(row) if j != i]
        rank = 1 + sum(value < own for value in others)
        first += rank == 1
        median = statistics.median(others) if others else own
        own_errors.append(abs(own / run.measured_s - 1))
        other_errors.append(abs(median / run.measured_s - 1))
        lines.append(
            f"| {run.label} | {_layout(run.plan)} | {run.measured_s * 1e3:.0f} "
            f"| {own * 1e3:.0f} | {_error(own, run.measured_s)} | {median * 1e3:.0f} "
            f"| {_error(median, run.measured_s)} | {max(row) / min(row) - 1:.0%} "
            f"| {rank} of {len(row)} |"
        )
    lines += [
        "",
        f"Own profile the most optimistic for its plan: {first} of {len(runs)} runs "
        f"(by chance alone one in {len(runs)} per run, so 1 expected). "
        f"Mean |error|: {statistics.fmean(own_errors):.1%} with the run's own profile, "
        f"{statistics.fmean(other_errors):.1%} with the other profiles' median.",
        "",
    ]
    return "\n".join(lines)


def _layout(plan: Plan) -> str:
    stages = " ".join(
        f"{s.block_range[0]}-{s.block_range[1]}@{','.join(map(str, s.ranks))}" for s in plan.stages
    )
    return f"{plan.schedule} m={plan.num_microbatches} {stages}"


def sections(paths: Sequence[str | Path]) -> str:
    """One report section per results file with at least two planned runs (notes on stderr)."""
    out = []
    for path in paths:
        runs = load_runs(path)
        if len(runs) < 2:
            print(f"{path}: fewer than two planned runs, nothing to compare", file=sys.stderr)
            continue
        table = cross_predictions(runs)
        for i, run in enumerate(runs):  # the checkout's cost model must reproduce each run's
            recorded = run.plan.predicted_step_time_s
            if abs(table[i][i] - recorded) > 1e-6 * max(1.0, recorded):
                print(
                    f"{path}: {run.label}: re-predicted {table[i][i]:.4f} s under its own profile, "
                    f"the run recorded {recorded:.4f} s (the cost model changed since)",
                    file=sys.stderr,
                )
        out.append(report(Path(path).stem, runs, table))
    return "\n".join(out)


def header(results: Sequence[str], out: str) -> str:
    """The top of the ``--out`` file: the command that made it."""
    return "\n".join(
        [
            "# Every plan under every profile (`benchmarks/profile_spread.py`)",
            "",
            "```bash",
            "python benchmarks/profile_spread.py " + " ".join(results) + f" --out {out}",
            "```",
            "",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="lab_bench.py results files (JSON)")
    parser.add_argument("--out", help="also write the report to this Markdown file")
    args = parser.parse_args(argv)
    text = sections(args.results)
    print(text)
    if args.out:
        Path(args.out).write_text(header(args.results, args.out) + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
