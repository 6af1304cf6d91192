"""Run one command on every emulated device as a real multi-node launch, and play a trace.

Each device is one node of a torchrun job (the default launcher)::

    python -m torch.distributed.run --nnodes N --node-rank i --nproc-per-node 1 \\
        --master-addr <rank-0 device IP> --master-port P  <the command's script and args>

or, with ``launcher="env"``, the command itself with MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK and NODE_RANK set. Either way ``GLOO_SOCKET_IFNAME`` is
the device's own interface: without it gloo resolves the hostname to 127.0.0.1 and the
cross-namespace connect is refused. Device rank = its position in the topology's device list.

With ``elastic="MIN:MAX"`` every device runs torchrun's elastic agent (c10d rendezvous hosted by
the first device, the *anchor*), so a device can be killed and started again (trace events or a
``control`` callable) the way a site is lost and regained: the survivors restart their workers
in a smaller world, a returning device joins at the next rendezvous. Losing the anchor ends the
job (it holds the rendezvous store). A device may also come back by *joining* (a trace's
``join`` event, :meth:`LabControl.join`): its command alone, outside torchrun, with
``DEEPCEE_JOIN=1``; the strategy admits it at a step boundary while the others keep running.

Every output line goes to ``<out>/<device>.log`` and to the console as ``[device] line``;
``<out>/summary.json`` gets return codes, durations and the trace and device events as applied.
When a device fails (a killed one does not count), the others get ``fail_grace_s`` to finish,
then are stopped (they would otherwise wait in a collective until their own timeout). The whole
run is bounded by ``timeout_s``.
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
from lightning_deepcee.lab.processes import kill_process_tree
from lightning_deepcee.lab.topology import find_named
from lightning_deepcee.lab.trace import CpuEvent, DeviceEvent, Trace, TraceEvent

__all__ = [
    "DeviceResult", "DeviceState", "LabControl", "LabResult", "RunConfig", "device_argv",
    "device_env", "joining_env", "kill_process_tree", "parse_elastic", "run_command",
    "run_finished", "run_returncode",
]  # fmt: skip

LAUNCHERS = ("torchrun", "env")
_DIST_ENV = (
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "GROUP_RANK", "NODE_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
)  # fmt: skip
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")
_ELASTIC = re.compile(r"^(\d+):(\d+)$")
_MONITOR_INTERVAL_S = 0.5  # how often an elastic agent checks its worker and waiting nodes
_KEEP_ALIVE_MAX_ATTEMPT = 3  # missed heartbeats that drop a node from the rendezvous (torch's)


def parse_elastic(text: str, devices: int | None = None) -> tuple[int, int]:
    """``"MIN:MAX"`` as ``(MIN, MAX)``; ValueError unless 1 <= MIN <= MAX (<= ``devices``)."""
    match = _ELASTIC.match(text.strip())
    if match is None:
        raise ValueError(f"elastic={text!r} must be MIN:MAX node counts, e.g. 2:3")
    low, high = int(match[1]), int(match[2])
    if not 1 <= low <= high:
        raise ValueError(f"elastic={text!r}: need 1 <= MIN <= MAX")
    if devices is not None and high > devices:
        raise ValueError(f"elastic={text!r}: MAX={high} exceeds the topology's {devices} devices")
    return low, high


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
    elastic: str | None = None
    """``"MIN:MAX"`` (MAX <= devices): torchrun's elastic agent, devices may leave and rejoin."""
    max_restarts: int = 3
    """Elastic: failed worker groups an agent restarts (a lost peer costs one) before it fails."""
    rdzv_last_call_s: int = 3
    """Elastic: once MIN nodes are in, how long a rendezvous waits for more (torch: 30 s)."""
    rdzv_keep_alive_s: int = 2
    """Elastic: heartbeat interval; 3 missed beats drop a killed node (torch: 5 s, 15 s)."""
    rdzv_join_s: int = 600
    """Elastic: how long a rendezvous may take (e.g. waiting for MIN nodes) before failing."""

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("no command given: deepcee-lab run ... -- python train.py ...")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher={self.launcher!r} is unknown; choose one of {LAUNCHERS}")
        if not 1024 <= self.master_port <= 65535:
            raise ValueError(f"master_port={self.master_port} must be in 1024..65535")
        if self.timeout_s <= 0 or self.fail_grace_s < 0:
            raise ValueError("timeout_s must be > 0 and fail_grace_s >= 0")
        if self.elastic is None:
            return
        parse_elastic(self.elastic)
        if self.launcher != "torchrun":
            raise ValueError(f"elastic={self.elastic!r} needs launcher='torchrun'")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts} must be >= 0")
        for name in ("rdzv_last_call_s", "rdzv_keep_alive_s", "rdzv_join_s"):
            if getattr(self, name) < 1:  # torch reads them as whole seconds > 0
                raise ValueError(f"{name}={getattr(self, name)} must be a whole number >= 1")


@dataclass
class DeviceResult:
    name: str
    rank: int
    returncode: int | None
    """Of the device's last launch."""
    duration_s: float
    log_path: str
    killed: bool = False
    """The last launch was ended by a kill event (its return code is not a failure)."""
    launches: int = 1
    """How many times the command was started (1 + the start and join events applied)."""


@dataclass
class LabResult:
    returncode: int
    """0 if every device whose last launch was not killed returned 0; 124 on timeout; else the
    first failure's return code."""
    devices: list[DeviceResult]
    trace_applied: list[dict[str, Any]] = field(default_factory=list)
    """Bandwidth events, each with ``applied_at_s``."""
    timed_out: bool = False
    first_failure: str | None = None
    duration_s: float = 0.0
    device_events: list[dict[str, Any]] = field(default_factory=list)
    """Kills and starts (from the trace or ``control``), each with ``applied_at_s``."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def device_argv(
    command: Sequence[str],
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    launcher: str = "torchrun",
    *,
    elastic: RunConfig | None = None,
    local_addr: str | None = None,
    run_id: str = "deepcee-lab",
) -> list[str]:
    """The argv that runs ``command`` as node ``rank`` of ``world_size``.

    With ``elastic`` (a config whose ``elastic`` is set): torchrun's elastic agent, in a c10d
    rendezvous ``run_id`` at ``master_addr:master_port`` that rank 0 hosts. ``is_host`` is
    explicit because in a namespace the hostname resolves to the machine, not the device, and
    ``--local-addr`` is ``local_addr`` (the device's IP): torch publishes MASTER_ADDR from it.
    """
    if launcher == "env":
        return list(command)
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if elastic is None or elastic.elastic is None:
        torchrun += ["--nnodes", str(world_size), "--node-rank", str(rank), "--nproc-per-node", "1"]
        torchrun += ["--master-addr", master_addr, "--master-port", str(master_port)]
    else:
        low, high = parse_elastic(elastic.elastic, world_size)
        if local_addr is None:
            raise ValueError("an elastic launch needs the device's local_addr")
        conf = f"is_host={'true' if rank == 0 else 'false'},join_timeout={elastic.rdzv_join_s},"
        conf += f"last_call_timeout={elastic.rdzv_last_call_s},keep_alive_interval="
        conf += f"{elastic.rdzv_keep_alive_s},keep_alive_max_attempt={_KEEP_ALIVE_MAX_ATTEMPT}"
        torchrun += ["--nnodes", f"{low}:{high}", "--nproc-per-node", "1", "--rdzv-backend"]
        torchrun += ["c10d", "--rdzv-endpoint", f"{master_addr}:{master_port}", "--rdzv-id", run_id]
        torchrun += ["--max-restarts", str(elastic.max_restarts), "--monitor-interval"]
        torchrun += [f"{_MONITOR_INTERVAL_S:g}", "--local-addr", local_addr, "--rdzv-conf", conf]
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
    elastic: bool = False,
) -> dict[str, str]:
    """``base`` without stray distributed variables, plus the lab's and the launcher's.

    ``cpu_max`` is the device's CPU quota, ``"<quota_us> <period_us>"``: a Mininet host remounts
    ``/sys``, so the profiler cannot read its cgroup and takes it from ``DEEPCEE_CPU_MAX``
    (:mod:`lightning_deepcee.runtime.cpu_quota`) instead. ``DEEPCEE_DEVICE`` names the device
    across restarts (its group rank changes at every elastic rendezvous). ``elastic`` turns off
    the agent-shared TCPStore: reused across rendezvous rounds, it hands a restarted worker group
    the previous group's gloo addresses (connect refused or hung, see docs/lab.md).
    """
    env = {k: v for k, v in base.items() if k not in _DIST_ENV}
    env.update(
        GLOO_SOCKET_IFNAME=interface,
        PYTHONUNBUFFERED="1",
        DEEPCEE_DEVICE=device,
        DEEPCEE_LAB_DEVICE=device,
        DEEPCEE_LAB_REGION=region,
        DEEPCEE_LAB_RANK=str(rank),
    )
    if cpu_max is not None:
        env["DEEPCEE_CPU_MAX"] = cpu_max
    if elastic:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
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


def joining_env(
    env: dict[str, str], net: LabNetwork, device: str, rank: int, port: int
) -> dict[str, str]:
    """The environment of ``device`` (rank ``rank`` of the run, environment ``env``) started to
    join the running job: a world of one of its own (its store on its own address and ``port``),
    ``DEEPCEE_JOIN=1``, its lab variables kept."""
    joining = device_env(
        env, device=device, region=env.get("DEEPCEE_LAB_REGION", ""), rank=0, world_size=1,
        master_addr=net.ip(device), master_port=port, interface=net.interface(device),
        launcher="env", cpu_max=net.cpu_max(device),
    )  # fmt: skip
    joining.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return {**joining, "DEEPCEE_LAB_RANK": str(rank), "DEEPCEE_JOIN": "1"}


@dataclass(frozen=True, slots=True)
class DeviceState:
    """A device's last launch as the supervision sees it (the input of the run's bookkeeping)."""

    name: str
    returncode: int | None
    """``None`` while it runs."""
    killed: bool = False
    """Ended by a kill event: its exit is not a failure, and the run does not wait for it."""


def run_finished(states: Sequence[DeviceState], *, start_pending: bool = False) -> bool:
    """Whether every device whose last launch was not killed has exited. With every device
    killed, the run waits only for a pending start event (``start_pending``)."""
    counted = [s for s in states if not s.killed]
    if not counted:
        return not start_pending
    return all(s.returncode is not None for s in counted)


def run_returncode(states: Sequence[DeviceState]) -> tuple[int, str | None]:
    """``(0, None)`` if every not-killed device exited 0; else the first failure's (rank order)
    return code and who it was; ``(1, why)`` when every device was killed."""
    counted = [s for s in states if not s.killed]
    if not counted:
        return 1, "every device was killed"
    for s in counted:
        if s.returncode != 0:
            return s.returncode or 1, f"{s.name} exited with {s.returncode}"
    return 0, None


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
        kill_process_tree(popen.pid)  # its children too: torchrun's have sessions of their own
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=grace_s)


@dataclass(eq=False)
class _Device:
    """One device's command across its launches."""

    name: str
    rank: int
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    pump: threading.Thread | None = None
    log_file: IO[str] | None = None
    ended_at: float | None = None
    killed: bool = False
    launches: int = 0

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def state(self) -> DeviceState:
        rc = None if self.popen is None else self.popen.poll()
        return DeviceState(name=self.name, returncode=rc, killed=self.killed)


class LabControl:
    """Kills and (re)starts the devices' commands during a run, and records it.

    A ``control`` callable gets this object on every supervision tick (every 0.05 s), so it can
    kill and restart devices at times or on conditions a trace cannot express (e.g. once a log
    line appears); the trace's kill and start events go through it too.
    """

    def __init__(
        self, net: LabNetwork, config: RunConfig, devices: list[_Device], t0: float,
        result: LabResult, say: Callable[[str], None],
    ) -> None:  # fmt: skip
        self.net, self.config, self.devices, self.t0 = net, config, devices, t0
        self.result, self.say = result, say
        self._console = _Console(config.echo)

    @property
    def elapsed_s(self) -> float:
        """Seconds since the command started on every device (the trace's clock)."""
        return time.monotonic() - self.t0

    def running(self, device: str) -> bool:
        """Whether ``device``'s command (its last launch) is running."""
        return self._device(device).running()

    def kill(self, device: str, source: str = "control", at_s: float | None = None) -> None:
        """SIGKILL every process of ``device``; its exit is then not a failure of the run."""
        dev = self._device(device)
        event = self._record(device, "kill", source, at_s)
        if dev.popen is None or not dev.running():
            event["was_running"] = False
            self.say(f"t={self.elapsed_s:.1f}s kill {device}: it had already exited")
            return
        dev.killed = True
        event["pids"] = kill_process_tree(dev.popen.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            dev.popen.wait(timeout=5)
        dev.ended_at = time.monotonic()
        anchor = dev.rank == 0 and self.config.elastic is not None
        note = " (the anchor: it hosts the rendezvous, so the job ends)" if anchor else ""
        self.say(f"t={self.elapsed_s:.1f}s killed {device}{note}")

    def start(self, device: str, source: str = "control", at_s: float | None = None) -> None:
        """Run ``device``'s command again (same argv and env); RuntimeError if it runs."""
        dev = self._device(device)
        if dev.running():
            raise RuntimeError(f"cannot start {device}: it is still running (kill it first)")
        self._launch(dev)
        self._record(device, "start", source, at_s)["launch"] = dev.launches
        self.say(f"t={self.elapsed_s:.1f}s started {device} again (launch {dev.launches})")

    def join(self, device: str, source: str = "control", at_s: float | None = None) -> None:
        """Start ``device``'s command alone, outside the launcher, to join the running job at a
        step boundary (``DEEPCEE_JOIN=1``, a world of one: :func:`joining_env`); RuntimeError if
        it runs. The job's other devices keep their processes (no rendezvous round)."""
        dev = self._device(device)
        if dev.running():
            raise RuntimeError(f"cannot join {device}: it is still running (kill it first)")
        env = joining_env(dev.env, self.net, dev.name, dev.rank, self.config.master_port)
        self._launch(dev, list(self.config.command), env)
        self._record(device, "join", source, at_s)["launch"] = dev.launches
        self.say(f"t={self.elapsed_s:.1f}s started {device} to join (launch {dev.launches})")

    def _device(self, name: str) -> _Device:
        return find_named(self.devices, name, "device")

    def _launch(
        self, dev: _Device, argv: list[str] | None = None, env: dict[str, str] | None = None
    ) -> None:
        if dev.log_file is None:
            dev.log_file = open(dev.log_path, "w")  # noqa: SIM115
        else:
            if dev.pump is not None:
                dev.pump.join(timeout=5)  # the killed launch's last lines first
            dev.log_file.write(
                f"\n===== deepcee-lab: {dev.name} started again (launch {dev.launches + 1}) "
                f"at t={self.elapsed_s:.1f}s =====\n"
            )
            dev.log_file.flush()
        cwd = self.config.cwd or os.getcwd()
        dev.popen = self.net.popen(dev.name, argv or dev.argv, env=env or dev.env, cwd=cwd)
        dev.launches, dev.killed, dev.ended_at = dev.launches + 1, False, None
        assert dev.popen.stdout is not None
        args = (dev.popen.stdout, dev.log_file, dev.name, self._console)
        dev.pump = threading.Thread(target=_pump, args=args, daemon=True)
        dev.pump.start()

    def _record(self, name: str, action: str, source: str, at_s: float | None) -> dict[str, Any]:
        event: dict[str, Any] = {"device": name, "action": action, "source": source}
        if at_s is not None:
            event["at_s"] = at_s
        event["applied_at_s"] = round(self.elapsed_s, 3)
        self.result.device_events.append(event)
        return event

    def _close(self) -> None:
        for dev in self.devices:
            if dev.popen is not None:
                _stop(dev.popen)
        for dev in self.devices:
            if dev.pump is not None:
                dev.pump.join(timeout=5)
            if dev.log_file is not None:
                dev.log_file.close()


def run_command(
    net: LabNetwork,
    config: RunConfig,
    trace: Trace | None = None,
    log: Callable[[str], None] | None = None,
    control: Callable[[LabControl], None] | None = None,
) -> LabResult:
    """Run ``config.command`` on every device of ``net``; returns when all have exited (a killed
    device only if it was started again). ``control`` is called on every supervision tick."""
    topology = net.topology
    trace = trace or Trace()
    trace.validate(topology)
    say = log or (lambda msg: print(f"[lab] {msg}", file=sys.stderr, flush=True))
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    world = len(topology.devices)
    run_id = f"deepcee-lab-{os.getpid()}-{int(time.time())}"
    elastic = config if config.elastic is not None else None  # MAX is checked by device_argv
    master = net.ip(topology.devices[0].name)
    base_env = {**os.environ, **dict(config.extra_env)}
    result = LabResult(returncode=0, devices=[])
    t0 = time.monotonic()
    devices = []
    for rank, device in enumerate(topology.devices):
        argv = device_argv(
            config.command, rank, world, master, config.master_port, config.launcher,
            elastic=elastic, local_addr=net.ip(device.name), run_id=run_id,
        )  # fmt: skip
        env = device_env(
            base_env, device=device.name, region=device.region, rank=rank, world_size=world,
            master_addr=master, master_port=config.master_port,
            interface=net.interface(device.name), launcher=config.launcher,
            cpu_max=net.cpu_max(device.name), elastic=elastic is not None,
        )  # fmt: skip
        # The trace's clock: CLOCK_MONOTONIC is one clock for every namespace of the kernel,
        # so a device can place its own events on the trace's time axis.
        env["DEEPCEE_LAB_T0"] = f"{t0:.6f}"
        devices.append(_Device(device.name, rank, argv, env, out / f"{device.name}.log"))
    fleet = LabControl(net, config, devices, t0, result, say)
    try:
        say(f"rank 0 of {world}: {' '.join(devices[0].argv)}")
        for dev in devices:
            fleet._launch(dev)
        _supervise(fleet, trace, control)
    finally:
        fleet._close()
    now = time.monotonic()
    result.duration_s = round(now - t0, 3)
    launched = [d for d in devices if d.popen is not None]
    for dev in launched:
        assert dev.popen is not None
        duration = round((dev.ended_at or now) - t0, 3)
        result.devices.append(
            DeviceResult(dev.name, dev.rank, dev.popen.returncode, duration, str(dev.log_path),
                         killed=dev.killed, launches=dev.launches)
        )  # fmt: skip
    if result.returncode == 0:
        result.returncode, result.first_failure = run_returncode([d.state() for d in launched])
    summary: dict[str, Any] = {"topology": topology.to_dict(), "command": list(config.command)}
    summary.update(elastic=config.elastic, rdzv_id=run_id if elastic else None)
    (out / "summary.json").write_text(json.dumps({**summary, **result.to_dict()}, indent=1))
    failure = f" (first failure: {result.first_failure})" if result.first_failure else ""
    say(f"finished in {result.duration_s:.1f} s with return code {result.returncode}{failure}")
    return result


def _supervise(
    fleet: LabControl, trace: Trace, control: Callable[[LabControl], None] | None
) -> None:
    config, result, say = fleet.config, fleet.result, fleet.say
    pending = trace.in_order()
    failed_at: float | None = None
    while True:
        elapsed = fleet.elapsed_s
        while pending and pending[0].at_s <= elapsed:
            event = pending.pop(0)
            if isinstance(event, TraceEvent | CpuEvent):
                if isinstance(event, TraceEvent):
                    fleet.net.set_bandwidth(event.link, event.bandwidth_mbit)
                    what = f"link {'-'.join(event.link)} -> {event.bandwidth_mbit:g} Mbit/s"
                else:
                    fleet.net.set_cpu(event.device, event.cpu)
                    what = f"{event.device} cpu -> {event.cpu:g}"
                applied = {**event.to_dict(), "applied_at_s": round(fleet.elapsed_s, 3)}
                result.trace_applied.append(applied)
                say(f"t={elapsed:.1f}s trace: {what}")
            elif event.action == "kill":
                fleet.kill(event.device, "trace", event.at_s)
            elif fleet.running(event.device):  # a control started it already
                say(f"t={elapsed:.1f}s trace: {event.action} {event.device} skipped, it runs")
            elif event.action == "join":
                fleet.join(event.device, "trace", event.at_s)
            else:
                fleet.start(event.device, "trace", event.at_s)
        if control is not None:
            control(fleet)
        now = time.monotonic()
        for dev in fleet.devices:
            rc = None if dev.popen is None else dev.popen.poll()
            if rc is None or dev.ended_at is not None:
                continue
            dev.ended_at = now
            if rc != 0 and not dev.killed and failed_at is None:
                failed_at = now
                result.returncode = rc
                result.first_failure = f"{dev.name} (rank {dev.rank}) exited with {rc}"
                say(
                    f"{dev.name} failed with return code {rc}; stopping the others in "
                    f"{config.fail_grace_s:g} s"
                )
        start_pending = any(isinstance(e, DeviceEvent) and e.action != "kill" for e in pending)
        if run_finished([d.state() for d in fleet.devices], start_pending=start_pending):
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
