"""Fit the cost model's host-CPU constants to the CPU that lab ranks spent outside their blocks.

A device under a CPU quota also spends CPU outside its blocks' compute and its optimizer step:
Lightning's loop, hooks and logging, and the handling of every byte it sends or receives. The
cost model charges that as ``CostModelConfig.host_cpu_s_per_step + host_cpu_s_per_byte * bytes``
(docs/planner.md, "CPU floor"). For every rank of every planned run, ``lab_bench.py`` records
the median per step of the process CPU (``cpu_s``), the executor's CPU in F, B and W
(``cpu_F``, ``cpu_B``, ``cpu_W``), the optimizer step's CPU (``optimizer_cpu``) and the bytes
received from each peer (``recv_bytes_from<peer>``). This script fits, by least squares,

    cpu_s - (cpu_F + cpu_B + cpu_W) - optimizer_cpu = per_step + per_byte * bytes

over the quota-limited ranks, where ``bytes`` is what the rank received, what it sent (its peers'
``recv_bytes_from<rank>``) and its stage's ring all-reduce (``4 (n-1)/n`` times the stage's
parameter bytes: sent and received), and prints the fit next to the constants in force.

    python benchmarks/fit_cpu_floor.py                  # the runs the constants were fitted to
    python benchmarks/fit_cpu_floor.py benchmarks/results/cee6_gpt5m.json ...  # other runs

Without arguments it reads ``benchmarks/results/cpu_floor_fit_rows.json``: these figures for the
84 ranks of the 15 planned lab runs of 2026-12-01 (the results files of commit ``fd23b99``,
which later runs replaced), written by ``--save-rows`` from those files::

    for n in cee6_gpt5m cee6_cnn cee6p10_gpt5m lan4_gpt5m; do
        git show fd23b99:benchmarks/results/$n.json > /tmp/$n.json; done
    python benchmarks/fit_cpu_floor.py /tmp/{cee6_gpt5m,cee6_cnn,cee6p10_gpt5m,lan4_gpt5m}.json \\
        --save-rows benchmarks/results/cpu_floor_fit_rows.json \\
        --about "the results files of commit fd23b99, 2026-12-01"

Pure: numpy and the cost model's config, no torch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from harness import planned_runs

from lightning_deepcee.planner.cost_model import CostModelConfig

__all__ = ["ROWS_FILE", "Fit", "RankRow", "fit", "load_rows", "main", "render", "rows_from_results"]

ROWS_FILE = Path(__file__).resolve().parent / "results" / "cpu_floor_fit_rows.json"
_MB = 1e6


@dataclass(frozen=True, kw_only=True, slots=True)
class RankRow:
    """One rank of one planned lab run: its CPU per step and the bytes it moved per step."""

    benchmark: str
    system: str
    run: int
    rank: int
    cpu_share: float
    cpu_s: float
    compute_cpu_s: float
    optimizer_cpu_s: float
    received_bytes: float
    sent_bytes: float
    allreduce_bytes: float

    @property
    def host_cpu_s(self) -> float:
        """CPU outside the blocks' compute and the optimizer step."""
        return self.cpu_s - self.compute_cpu_s - self.optimizer_cpu_s

    @property
    def moved_bytes(self) -> float:
        return self.received_bytes + self.sent_bytes + self.allreduce_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class Fit:
    """``host CPU = per_step_s + per_byte_s * bytes`` and how far the rows lie from it."""

    per_step_s: float
    per_byte_s: float
    residual_s: float
    """Root mean square of the rows' residuals."""
    num_ranks: int
    num_runs: int


def rows_from_results(path: str | Path) -> list[RankRow]:
    """Every rank of every planned run (with rank statistics) of a ``lab_bench.py`` results file."""
    rows = []
    for system, _, run in planned_runs(path):
        stats = run.get("rank_stats")
        if not stats:
            continue
        devices = run["profile"]["devices"]
        for stage in run["plan"]["stages"]:
            start, end = stage["block_range"]
            n = len(stage["ranks"])
            for rank in stage["ranks"]:
                mine = stats[rank]
                device = devices[rank]
                parameter_bytes = sum(device["parameter_bytes"][start:end])
                rows.append(
                    RankRow(
                        benchmark=Path(path).stem,
                        system=system,
                        run=int(run["run"]),
                        rank=rank,
                        cpu_share=float(device.get("cpu_share", 1.0)),
                        cpu_s=mine["cpu_s"],
                        compute_cpu_s=sum(mine.get(f"cpu_{k}", 0.0) for k in "FBW"),
                        optimizer_cpu_s=mine.get("optimizer_cpu", 0.0),
                        received_bytes=sum(
                            v for k, v in mine.items() if k.startswith("recv_bytes_from")
                        ),
                        sent_bytes=sum(other.get(f"recv_bytes_from{rank}", 0) for other in stats),
                        allreduce_bytes=4.0 * (n - 1) / n * parameter_bytes,
                    )
                )
    return rows


def load_rows(paths: Sequence[str | Path]) -> list[RankRow]:
    """Rows of ``lab_bench.py`` results files, or of a ``--save-rows`` file."""
    rows: list[RankRow] = []
    for path in paths:
        data: dict[str, Any] = json.loads(Path(path).read_text())
        if "rows" in data:
            rows.extend(RankRow(**row) for row in data["rows"])
        else:
            rows.extend(rows_from_results(path))
    return rows


def fit(rows: Sequence[RankRow]) -> Fit:
    """Least squares over the quota-limited rows (the only ones the cost model charges)."""
    limited = [row for row in rows if row.cpu_share < 1.0]
    if len(limited) < 2:
        raise ValueError(
            f"need at least 2 ranks under a CPU quota to fit a line, got {len(limited)}"
        )
    x = np.array([row.moved_bytes for row in limited])
    y = np.array([row.host_cpu_s for row in limited])
    design = np.stack([np.ones_like(x), x], axis=1)
    (per_step_s, per_byte_s), *_ = np.linalg.lstsq(design, y, rcond=None)
    residual = y - design @ np.array([per_step_s, per_byte_s])
    return Fit(
        per_step_s=float(per_step_s),
        per_byte_s=float(per_byte_s),
        residual_s=float(np.sqrt(np.mean(residual**2))),
        num_ranks=len(limited),
        num_runs=len({(r.benchmark, r.system, r.run) for r in limited}),
    )


def _residual(rows: Sequence[RankRow], per_step_s: float, per_byte_s: float) -> float:
    limited = [row for row in rows if row.cpu_share < 1.0]
    errors = [row.host_cpu_s - per_step_s - per_byte_s * row.moved_bytes for row in limited]
    return math.sqrt(sum(e * e for e in errors) / len(errors))


def render(datasets: dict[str, Sequence[RankRow]]) -> str:
    """A Markdown table: one fit per data set, then the constants in force (their residual on
    the first data set)."""
    lines = [
        "| data | ranks (runs) | ms per step | ms per MB moved | residual ms (RMS) |",
        "|---|---|---|---|---|",
    ]
    for label, rows in datasets.items():
        f = fit(rows)
        lines.append(
            f"| {label} | {f.num_ranks} ({f.num_runs}) | {f.per_step_s * 1e3:.1f} "
            f"| {f.per_byte_s * _MB * 1e3:.2f} | {f.residual_s * 1e3:.1f} |"
        )
    config = CostModelConfig()
    first = next(iter(datasets.values()))
    residual = _residual(first, config.host_cpu_s_per_step, config.host_cpu_s_per_byte)
    lines.append(
        "| `CostModelConfig` defaults (residual on the first row's data) | | "
        f"{config.host_cpu_s_per_step * 1e3:.1f} | {config.host_cpu_s_per_byte * _MB * 1e3:.2f} "
        f"| {residual * 1e3:.1f} |"
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "results",
        nargs="*",
        help=f"lab_bench.py results files or a --save-rows file (default: {ROWS_FILE.name})",
    )
    parser.add_argument("--save-rows", type=Path, help="write the rows of the inputs here")
    parser.add_argument("--about", default="", help="with --save-rows: where the inputs came from")
    args = parser.parse_args(argv)
    paths = args.results or [str(ROWS_FILE)]
    rows = load_rows(paths)
    if args.save_rows:
        payload = {
            "about": "Per-rank CPU and bytes per step of planned lab runs, for "
            "benchmarks/fit_cpu_floor.py, made from "
            + " ".join(Path(p).name for p in paths)
            + (f" ({args.about})" if args.about else ""),
            "rows": [asdict(row) for row in rows],
        }
        args.save_rows.write_text(json.dumps(payload, indent=1) + "\n")
    label = ROWS_FILE.name if not args.results else " ".join(Path(p).name for p in paths)
    print(render({label: rows}), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
