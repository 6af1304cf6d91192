"""What the lab benchmarks share: the ``worker`` / harness split of one script, the lab run
that starts the worker on every emulated device, the Trainer each device builds, the plan a
benchmark makes once and reuses, and the result files.

A lab benchmark (adapter_bench, elastic_bench, lab_bench, tta_bench) is one script in two
modes. The harness (``python benchmarks/X.py ...``, as root) starts lab runs; each lab run
starts ``python benchmarks/X.py worker ...`` on every device under torchrun, and that worker
trains and records. Both modes start in :func:`main`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
"""benchmarks/: on ``sys.path`` when a benchmark runs (the benchmarks import each other)."""
REPO = HERE.parent
"""The repository root: the lab runs' working directory."""


def main(
    worker_main: Callable[[list[str]], None], harness_main: Callable[[list[str]], int]
) -> None:
    """``X.py worker ARGS``: one device's job; ``X.py ARGS``: the harness, exiting with its code."""
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker_main(sys.argv[2:])
    else:
        sys.exit(harness_main(sys.argv[1:]))


def worker_job(script: str | Path, *args: str) -> list[str]:
    """What every lab device runs: ``python SCRIPT worker ARGS``."""
    return ["python", str(Path(script).resolve()), "worker", *args]


def lab_command(
    topology: str | Path,
    out: Path,
    timeout_s: float,
    job: Sequence[str],
    *,
    trace: Path | None = None,
    master_port: int | None = None,
) -> list[str]:
    """``deepcee-lab run``: ``job`` on every device of ``topology`` (under ``trace`` if given),
    logs under ``out``, bounded by ``timeout_s``; run it with ``cwd=REPO``."""
    cmd = [sys.executable, "-m", "lightning_deepcee.lab.cli", "run", "--topology", str(topology)]
    if trace is not None:
        cmd += ["--trace", str(trace)]
    cmd += ["--out", str(out), "--quiet", "--timeout-s", str(timeout_s)]
    if master_port is not None:
        cmd += ["--master-port", str(master_port)]
    return [*cmd, "--", *job]


def device_trainer(**kwargs: Any) -> Any:
    """The Trainer of one lab device: its CPU, one process a node, one node a rank of
    ``WORLD_SIZE``; no logger, checkpoints, progress bar or summary unless ``kwargs`` say so."""
    import lightning.pytorch as pl

    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    settings.update(kwargs)
    if "num_nodes" not in settings:
        settings["num_nodes"] = int(os.environ["WORLD_SIZE"])
    return pl.Trainer(**settings)


def reuse_plan(folder: Path, fresh: bool, tag: str) -> tuple[Path, Path, bool]:
    """``folder/plan.json`` and ``folder/profile.json`` (absolute), deleted first if ``fresh``,
    and whether both exist (then they are reused, and that is said)."""
    plan, profile = (folder / "plan.json").resolve(), (folder / "profile.json").resolve()
    if fresh:
        plan.unlink(missing_ok=True)
        profile.unlink(missing_ok=True)
    reused = plan.is_file() and profile.is_file()
    if reused:
        print(f"[{tag}] reusing {plan} and {profile} (--fresh-plan makes them again)")
    return plan, profile, reused


def planned_runs(path: str | Path) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """``(system, index, run)`` for every run of a ``lab_bench.py`` results file that recorded
    its plan and its profile."""
    data = json.loads(Path(path).read_text())
    for system, entry in data["systems"].items():
        for index, run in enumerate(entry["runs"]):
            if "plan" in run and "profile" in run:
                yield system, index, run


def write_json(path: Path, data: Any, *, final_newline: bool = False) -> None:
    """A result file: ``data`` as JSON, indented by one (each benchmark keeps its own ending)."""
    path.write_text(json.dumps(data, indent=1) + ("\n" if final_newline else ""))
