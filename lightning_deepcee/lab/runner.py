"""Run one command on every emulated device as a real multi-node launch, and play a trace.

Each device is one node of a torchrun job (the default launcher)::

    python -m torch.distributed.run --nnodes N --node-rank i --nproc-per-node 1 \\
        --master-addr <rank-0 device IP> --master-port P  <the command's script and args>

or, with ``launcher="env"``, the command itself with MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK and NODE_RANK set. Either way ``GLOO_SOCKET_IFNAME`` is
the device's own interface: without it gloo resolves the hostname to 127.0.0.1 and the
cross-namespace connect is refused. Device rank = its position in the topology's device list.

Every output line goes to ``<out>/<device>.log`` and to the console as ``[device] line``;
``<out>/summary.json`` gets return codes, durations and the trace events as applied. When a device
fails, the others get ``fail_grace_s`` to finish, then are stopped (they would otherwise wait in a
collective until their own timeout). The whole run is bounded by ``timeout_s``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from lightning_deepcee.lab.network import LabNetwork
from lightning_deepcee.lab.trace import Trace

__all__ = ["DeviceResult", "LabResult", "RunConfig", "device_argv", "device_env", "run_command"]

LAUNCHERS = ("torchrun", "env")
_DIST_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """How to run a command on the lab's devices."""

    command: tuple[str, ...]
    """The per-device command, e.g. ``("python", "examples/train_gpt.py", "fit", ...)``."""
    out_dir: Path
    """Where ``<device>.log`` and ``summary.json`` go (created)."""
    launcher: str = "torchrun"
    """``torchrun`` (one node per device) or ``env`` (plain launch with the env variables)."""
    master_port: int = 29500
    """TCP port of the rendezvous on the rank-0 device."""
    timeout_s: float = 3600.0
    """Stop every device after this many seconds (return code 124)."""
    fail_grace_s: float = 15.0
    """After one device fails, how long the others may take to exit before they are stopped."""
    cwd: str | None = None
    """Working directory of the command on every device (default: the current one)."""
    extra_env: tuple[tuple[str, str], ...] = ()
    """Extra environment variables for every device."""
    echo: bool = True
    """Also print every line to the console, prefixed with ``[device]``."""

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("no command given: deepcee-lab run ... -- python train.py ...")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher={self.launcher!r} is unknown; choose one of {LAUNCHERS}")
        if not 1024 <= self.master_port <= 65535:
            raise ValueError(f"master_port={self.master_port} must be in 1024..65535")
        if self.timeout_s <= 0 or self.fail_grace_s < 0:
            raise ValueError("timeout_s must be > 0 and fail_grace_s >= 0")


@dataclass
class DeviceResult:
    name: str
    rank: int
    returncode: int | None
    duration_s: float
    log_path: str


@dataclass
class LabResult:
    returncode: int
    """0 if every device returned 0; 124 on timeout; else the first failure's return code."""
    devices: list[DeviceResult]
    trace_applied: list[dict[str, Any]] = field(default_factory=list)
    timed_out: bool = False
    first_failure: str | None = None
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def device_argv(
    command: Sequence[str],
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    launcher: str = "torchrun",
) -> list[str]:
    """The argv that runs ``command`` as node ``rank`` of ``world_size``."""
    if launcher == "env":
        return list(command)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(world_size)]
    torchrun += ["--node-rank", str(rank), "--nproc-per-node", "1"]
    torchrun += ["--master-addr", master_addr, "--master-port", str(master_port)]
    first = os.path.basename(command[0])
    is_python = bool(_PYTHON.match(first)) or command[0] == sys.executable
    if is_python and len(command) > 1 and (command[1] == "-m" or command[1][:1] != "-"):
        return torchrun + list(command[1:])  # a script or -m module: torchrun runs it
    # Anything else (a binary, python -c ...) runs as is, under torchrun's environment.
    return [*torchrun, "--no-python", *command]


def device_env(
    base: dict[str, str],
    *,
    device: str,
    region: str,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    interface: str,
    launcher: str = "torchrun",
    cpu_max: str | None = None,
) -> dict[str, str]:
    """``base`` without stray distributed variables, plus the lab's and the launcher's.

    ``cpu_max`` is the device's CPU quota, ``"<quota_us> <period_us>"``: a Mininet host remounts
    ``/sys``, so the profiler cannot read its cgroup and takes it from ``DEEPCEE_CPU_MAX``
    (:mod:`lightning_deepcee.runtime.cpu_quota`) instead.
    """
    env = {k: v for k, v in base.items() if k not in _DIST_ENV}
    env.update(
        GLOO_SOCKET_IFNAME=interface,
        PYTHONUNBUFFERED="1",
        DEEPCEE_LAB_DEVICE=device,
        DEEPCEE_LAB_REGION=region,
        DEEPCEE_LAB_RANK=str(rank),
    )
    if cpu_max is not None:
        env["DEEPCEE_CPU_MAX"] = cpu_max
    # One device = one CPU share: don't let torch spawn a thread per machine core.
    env.setdefault("OMP_NUM_THREADS", "1")
    if launcher == "env":
        env.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            GROUP_RANK=str(rank),
            NODE_RANK=str(rank),
        )
    return env


class _Console:
    def __init__(self, echo: bool) -> None:
        self.echo = echo
        self._lock = threading.Lock()

    def line(self, prefix: str, text: str) -> None:
        if self.echo:
            with self._lock:
                sys.stdout.write(f"[{prefix}] {text}\n")
                sys.stdout.flush()


def _pump(stream: IO[bytes], log_file: IO[str], name: str, console: _Console) -> None:
    # Progress bars rewrite a line with \r: show each state as its own console line.
    for raw in iter(stream.readline, b""):
        text = raw.decode("utf-8", errors="replace")
        log_file.write(text)
        log_file.flush()
        for part in text.rstrip("\n").split("\r"):
            if part.strip():
                console.line(name, part)
    stream.close()


def _stop(popen: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    if popen.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, signal.SIGTERM)  # mnexec -d: each command leads its own group
    try:
        popen.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=grace_s)


def run_command(
    net: LabNetwork,
    config: RunConfig,
    trace: Trace | None = None,
    log: Callable[[str], None] | None = None,
) -> LabResult:
    """Run ``config.command`` on every device of ``net``; returns when all have exited."""
    topology = net.topology
    trace = trace or Trace()
    trace.validate(topology)
    console = _Console(config.echo)
    say = log or (lambda msg: print(f"[lab] {msg}", file=sys.stderr, flush=True))
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    world = len(topology.devices)
    master = net.ip(topology.devices[0].name)
    base_env = {**os.environ, **dict(config.extra_env)}
    popens: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    log_files: list[IO[str]] = []
    ended: dict[int, float] = {}
    result = LabResult(returncode=0, devices=[])
    t0 = time.monotonic()
    try:
        for rank, device in enumerate(topology.devices):
            argv = device_argv(
                config.command, rank, world, master, config.master_port, config.launcher
            )
            env = device_env(
                base_env,
                device=device.name,
                region=device.region,
                rank=rank,
                world_size=world,
                master_addr=master,
                master_port=config.master_port,
                interface=net.interface(device.name),
                launcher=config.launcher,
                cpu_max=net.cpu_max(device.name),
            )
            # The trace's clock: CLOCK_MONOTONIC is one clock for every namespace of the kernel,
            # so a device can place its own events on the trace's time axis.
            env["DEEPCEE_LAB_T0"] = f"{t0:.6f}"
            log_file: IO[str] = open(out / f"{device.name}.log", "w")  # noqa: SIM115
            log_files.append(log_file)
            if rank == 0:
                say(f"rank 0 of {world}: {' '.join(argv)}")
            popen = net.popen(device.name, argv, env=env, cwd=config.cwd or os.getcwd())
            popens.append(popen)
            assert popen.stdout is not None
            pump = threading.Thread(
                target=_pump, args=(popen.stdout, log_file, device.name, console), daemon=True
            )
            pump.start()
            pumps.append(pump)
        _supervise(net, config, trace, popens, ended, result, t0, say)
    finally:
        for popen in popens:
            _stop(popen)
        for pump in pumps:
            pump.join(timeout=5)
        for log_file in log_files:
            log_file.close()
    now = time.monotonic()
    result.duration_s = round(now - t0, 3)
    for rank, device in enumerate(topology.devices[: len(popens)]):
        result.devices.append(
            DeviceResult(
                name=device.name,
                rank=rank,
                returncode=popens[rank].returncode,
                duration_s=round(ended.get(rank, now) - t0, 3),
                log_path=str(out / f"{device.name}.log"),
            )
        )
    if result.returncode == 0 and any(d.returncode != 0 for d in result.devices):
        result.returncode = next(d.returncode or 1 for d in result.devices if d.returncode != 0)
    summary = {"topology": topology.to_dict(), "command": list(config.command), **result.to_dict()}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    say(
        f"finished in {result.duration_s:.1f} s with return code {result.returncode}"
        + (f" (first failure: {result.first_failure})" if result.first_failure else "")
    )
    return result


def _supervise(
    net: LabNetwork,
    config: RunConfig,
    trace: Trace,
    popens: list[subprocess.Popen[bytes]],
    ended: dict[int, float],
    result: LabResult,
    t0: float,
    say: Callable[[str], None],
) -> None:
    pending = list(trace.events)
    names = [d.name for d in net.topology.devices]
    failed_at: float | None = None
    while True:
        now = time.monotonic()
        elapsed = now - t0
        while pending and pending[0].at_s <= elapsed:
            event = pending.pop(0)
            net.set_bandwidth(event.link, event.bandwidth_mbit)
            applied = {**event.to_dict(), "applied_at_s": round(time.monotonic() - t0, 3)}
            result.trace_applied.append(applied)
            say(
                f"t={elapsed:.1f}s trace: link {'-'.join(event.link)} -> "
                f"{event.bandwidth_mbit:g} Mbit/s"
            )
        for rank, popen in enumerate(popens):
            rc = popen.poll()
            if rc is None or rank in ended:
                continue
            ended[rank] = now
            if rc != 0 and failed_at is None:
                failed_at = now
                result.returncode = rc
                result.first_failure = f"{names[rank]} (rank {rank}) exited with {rc}"
                say(
                    f"{names[rank]} failed with return code {rc}; stopping the others in "
                    f"{config.fail_grace_s:g} s"
                )
        if len(ended) == len(popens):
            return
        if failed_at is not None and now - failed_at > config.fail_grace_s:
            return
        if elapsed > config.timeout_s:
            result.timed_out = True
            result.returncode = 124
            result.first_failure = result.first_failure or f"timeout after {config.timeout_s:g} s"
            say(f"timeout after {config.timeout_s:g} s: stopping every device")
            return
        time.sleep(0.05)
