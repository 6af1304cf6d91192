"""``torchrun`` jobs of a worker script, as the multi-process tests start them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.helpers.paths import ROOT, WORKERS
from tests.helpers.ports import free_port


def worker_env(**extra: str) -> dict[str, str]:
    """This process's environment, one OpenMP thread, and the repository first on PYTHONPATH:
    a worker runs as a script, and imports ``tests.helpers`` and this checkout's package."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, **extra)


def write_configs(out: Path, configs: list[dict[str, Any]]) -> Path:
    """``out/configs.json``: the configs a worker runs one after another."""
    path = out / "configs.json"
    path.write_text(json.dumps(configs))
    return path


def _command(
    worker: Path, args: tuple[str | Path, ...], layout: list[str], node: int, port: int
) -> list[str]:
    """One node's torchrun command line, on loopback."""
    return [
        sys.executable, "-m", "torch.distributed.run", *layout, f"--node_rank={node}",
        "--master_addr=127.0.0.1", f"--master_port={port}", str(worker), *map(str, args),
    ]  # fmt: skip


def torchrun(
    worker: Path,
    *args: str | Path,
    world: int,
    one_node_per_rank: bool = False,
    timeout: float = 900.0,
) -> list[str]:
    """Run ``worker`` on ``world`` ranks; every launch must exit 0. Returns each launch's output
    (stdout and stderr as one stream, so a worker's report lines stay in order).

    One ``torchrun --nproc_per_node=world``, or with ``one_node_per_rank`` one torchrun per rank
    (``--nnodes=world``, each its own node, as the lab launches devices)."""
    port = free_port()
    if one_node_per_rank:
        layout, launches = [f"--nnodes={world}", "--nproc_per_node=1"], world
    else:
        layout, launches = [f"--nproc_per_node={world}"], 1
    procs = []
    for node in range(launches):
        cmd = _command(worker, args, layout, node, port)
        procs.append(
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=worker_env()
            )
        )
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for node, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"node {node}:\n{text[-8000:]}"
    return outputs


def torchrun_until(
    worker: Path,
    *args: str | Path,
    world: int,
    out: Path,
    done: Callable[[], bool],
    timeout: float = 600.0,
    grace_s: float = 20.0,
) -> list[str]:
    """One torchrun per rank (each its own node), ended ``grace_s`` after ``done()`` holds: a
    test that kills a device leaves the other agents waiting 300 s at exit for the dead node's
    agent. Returns each launch's output (``out/node<n>.log``); fails if ``done()`` never holds
    within ``timeout``."""
    port = free_port()
    procs, logs = [], []
    for node in range(world):
        cmd = _command(worker, args, [f"--nnodes={world}", "--nproc_per_node=1"], node, port)
        log = (out / f"node{node}.log").open("w")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=worker_env()))
    deadline = time.monotonic() + timeout
    try:
        while not done() and time.monotonic() < deadline:
            time.sleep(0.5)
        finished = done()
        end = time.monotonic() + grace_s
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    outputs = [(out / f"node{node}.log").read_text(errors="replace") for node in range(world)]
    assert finished, "not done within the timeout:\n" + "\n".join(o[-4000:] for o in outputs)
    return outputs


def launch_fit(world: int, configs: list[dict[str, Any]], out: Path) -> None:
    """One torchrun of ``workers/fit_worker.py`` on ``world`` ranks: ``TinyNet`` trained once
    per config, each rank's parameters under ``out/<name>/``."""
    torchrun(WORKERS / "fit_worker.py", out, write_configs(out, configs), world=world)
