"""The emulated network: a Mininet build of a Topology, recorded, shaped, and always torn down.

Regions become Linux bridges (``dlab<i>``, no STP: the region graph is a tree), devices become
``CPULimitedHost`` s with their CPU share, and every link is a ``TCLink`` with an htb bandwidth:
``<device>-eth0`` <-> ``dlab<i>-<device>`` inside a region, ``dlab<i>-to<j>`` <-> ``dlab<j>-to<i>``
between regions. Hosts get ``10.0.0.<rank + 1>/24``.

Every name is planned and written to the state record (``state.py``) before it is created, and
every process id right after it starts; ``stop()`` replays that record. Mininet is imported only
inside ``LabNetwork.start()``; its own cleanup (``mn -c``) is never used because it kills by name.

    with LabNetwork(load_topology("configs/lab/cee6.yaml")) as net:
        net.exec_in("cloud0", ["ping", "-c1", net.ip("end0")])
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_deepcee.lab.state import (
    LabRecord,
    StateStore,
    cgroup_dirs,
    netns_id,
    process_start_ticks,
    teardown,
)
from lightning_deepcee.lab.topology import Topology

__all__ = ["LabNetwork", "NetworkPlan", "check_requirements", "plan_network"]

# executable -> (Debian package that ships it, why the lab needs it)
_TOOLS = {
    "mnexec": ("mininet", "runs commands inside the emulated hosts"),
    "ifconfig": ("net-tools", "Mininet configures interfaces with it"),
    "brctl": ("bridge-utils", "Mininet's LinuxBridge switch"),
    "cgcreate": ("cgroup-tools", "CPULimitedHost's CPU shares"),
    "cgset": ("cgroup-tools", "CPULimitedHost's CPU shares"),
    "tc": ("iproute2", "bandwidth shaping (htb)"),
    "ip": ("iproute2", "veth links"),
}
_INSTALL = (
    "apt-get install -y --no-install-recommends mininet bridge-utils cgroup-tools iproute2 "
    "net-tools; pip install mininet (or pip install 'lightning-deepcee[lab]')"
)


def check_requirements() -> None:
    """Raise RuntimeError naming what is missing: root, a Debian package, or the PyPI package."""
    problems = []
    if os.geteuid() != 0:
        problems.append(
            "deepcee-lab needs root (it creates network namespaces, bridges and cgroups): "
            "run it with sudo, e.g. sudo $(which deepcee-lab) run ..."
        )
    missing: dict[str, list[str]] = {}
    for tool, (package, _why) in _TOOLS.items():
        if shutil.which(tool) is None and not Path("/sbin", tool).exists():
            missing.setdefault(package, []).append(tool)
    if missing:
        listed = "; ".join(f"{', '.join(t)} (Debian package {p})" for p, t in missing.items())
        problems.append(
            f"missing {listed}: apt-get install -y --no-install-recommends {' '.join(missing)}"
        )
    if importlib.util.find_spec("mininet") is None:
        problems.append(
            f"the Python package 'mininet' is not importable by {sys.executable}: pip install "
            "mininet (or pip install 'lightning-deepcee[lab]')"
        )
    if problems:
        raise RuntimeError("deepcee-lab cannot start:\n  - " + "\n  - ".join(problems))


@dataclass(frozen=True, kw_only=True, slots=True)
class NetworkPlan:
    """Every name the lab will create for a topology (computed before anything exists)."""

    switches: tuple[str, ...]
    """One bridge per region, in topology order."""
    host_interfaces: tuple[str, ...]
    """``<device>-eth0`` per device (inside its host's namespace)."""
    lan_ports: tuple[str, ...]
    """``dlab<i>-<device>``: the switch end of each device's LAN link (root namespace)."""
    wan_ports: tuple[tuple[str, str], ...]
    """``(dlab<a>-to<b>, dlab<b>-to<a>)`` per WAN link (both in the root namespace)."""
    ips: tuple[str, ...]
    """Host IP per device, rank order."""

    @property
    def root_interfaces(self) -> tuple[str, ...]:
        return self.lan_ports + tuple(p for pair in self.wan_ports for p in pair)


def plan_network(topology: Topology) -> NetworkPlan:
    index = {r.name: i for i, r in enumerate(topology.regions)}
    wan_ports = []
    for link in topology.wan:
        a, b = (index[r] for r in link.regions)
        wan_ports.append((f"dlab{a}-to{b}", f"dlab{b}-to{a}"))
    return NetworkPlan(
        switches=tuple(f"dlab{i}" for i in range(len(topology.regions))),
        host_interfaces=tuple(f"{d.name}-eth0" for d in topology.devices),
        lan_ports=tuple(f"dlab{index[d.region]}-{d.name}" for d in topology.devices),
        wan_ports=tuple(wan_ports),
        ips=tuple(f"10.0.0.{rank + 1}" for rank in range(len(topology.devices))),
    )


class LabNetwork:
    """A running emulated network; use as a context manager so it is always torn down."""

    def __init__(
        self,
        topology: Topology,
        store: StateStore | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if len(topology.devices) > 250:
            raise ValueError(f"{len(topology.devices)} devices; the lab supports at most 250")
        self.topology = topology
        self.plan = plan_network(topology)
        self.store = store or StateStore()
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.record: LabRecord | None = None
        self._net: Any = None
        self._hosts: dict[str, Any] = {}
        self._popens: list[subprocess.Popen[bytes]] = []
        self._started = False

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> LabNetwork:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        check_requirements()
        self.store.acquire()
        self._started = True
        try:
            self._replay_stale()
            self._refuse_conflicts()
            me = os.getpid()
            self.record = LabRecord(
                owner_pid=me,
                owner_start_ticks=process_start_ticks(me) or 0,
                topology=self.topology.name,
                bridges=list(self.plan.switches),
                root_interfaces=list(self.plan.root_interfaces),
                host_interfaces=list(self.plan.host_interfaces),
                cgroups=[d.name for d in self.topology.devices],
            )
            self.store.save(self.record)
            self._build()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Remove everything recorded; idempotent. Raises RuntimeError if something is left."""
        if not self._started:
            return
        self._started = False
        left: list[str] = []
        try:
            if self.record is not None:
                left = teardown(self.record, log=self.log)
            self._release_mininet()
        finally:
            if not left:
                self.store.clear()
            self.store.release()
        if left:
            raise RuntimeError(
                f"deepcee-lab teardown left {', '.join(left)}; the record stays in "
                f"{self.store.path} and is replayed at the next start"
            )

    def _replay_stale(self) -> None:
        stale = self.store.load()
        if stale is None:
            return
        self.log(
            f"deepcee-lab: removing what a previous run (pid {stale.owner_pid}, topology "
            f"{stale.topology!r}) left behind, from {self.store.path}"
        )
        left = teardown(stale, log=self.log)
        if left:
            raise RuntimeError(
                f"could not remove leftovers of a previous lab run: {', '.join(left)} "
                f"(record: {self.store.path})"
            )
        self.store.clear()

    def _refuse_conflicts(self) -> None:
        # Mininet deletes same-named interfaces before creating its own: make sure none exist,
        # so that the lab never touches anything that is not its own.
        taken = [n for n in (*self.plan.switches, *self.plan.root_interfaces) if _exists(n)]
        taken += [str(p) for d in self.topology.devices for p in cgroup_dirs(d.name)]
        if taken:
            raise RuntimeError(
                f"deepcee-lab will not start: {', '.join(taken)} already exist and are not in the "
                "lab's record; remove them yourself or rename the devices in the topology"
            )

    def _save(self) -> None:
        assert self.record is not None
        self.store.save(self.record)

    def _build(self) -> None:
        from mininet.link import TCLink
        from mininet.log import setLogLevel
        from mininet.net import Mininet
        from mininet.node import CPULimitedHost
        from mininet.nodelib import LinuxBridge

        assert self.record is not None
        setLogLevel("error")
        _quiet_htb_warnings()
        net = Mininet(
            host=CPULimitedHost,
            link=TCLink,
            switch=LinuxBridge,
            controller=None,
            build=False,
            autoSetMacs=True,
        )
        self._net = net
        switches = {}
        for i, region in enumerate(self.topology.regions):
            switch = net.addSwitch(self.plan.switches[i], dpid=f"{i + 1:016x}", stp=False)
            switches[region.name] = switch
            self.record.add_process(switch.pid, f"switch {switch.name} ({region.name})")
            self._save()
        for rank, device in enumerate(self.topology.devices):
            period_us = round(self.topology.cpu_period_ms * 1000)
            quota_us = period_us * device.cpu * (os.cpu_count() or 1)
            if quota_us < 1000:
                raise ValueError(
                    f"device {device.name}: a CPU quota of {quota_us / 1000:.2f} ms per "
                    f"{period_us / 1000:g} ms period is below the kernel's 1 ms minimum; raise "
                    "cpu_period_ms or the device's cpu"
                )
            host = net.addHost(
                device.name,
                cpu=device.cpu,
                period_us=period_us,
                ip=f"{self.plan.ips[rank]}/24",
            )
            self._hosts[device.name] = host
            self.record.add_process(host.pid, f"host {device.name}")
            ns = netns_id(host.pid)
            if ns is not None:
                self.record.netns.append(ns)
            self._save()
        for rank, device in enumerate(self.topology.devices):
            net.addLink(
                self._hosts[device.name],
                switches[device.region],
                intfName1=self.plan.host_interfaces[rank],
                intfName2=self.plan.lan_ports[rank],
                bw=self.topology.region(device.region).lan_mbit,
            )
        for link, (port_a, port_b) in zip(self.topology.wan, self.plan.wan_ports, strict=True):
            a, b = link.regions
            net.addLink(switches[a], switches[b], intfName1=port_a, intfName2=port_b, bw=link.mbit)
        with warnings.catch_warnings():
            # Mininet 2.3 logs through the deprecated Logger.warn.
            warnings.simplefilter("ignore", DeprecationWarning)
            net.build()
            net.start()

    def _release_mininet(self) -> None:
        # The processes are already gone (teardown); reap them and close Mininet's ptys.
        nodes = list(self._hosts.values()) + (list(self._net.switches) if self._net else [])
        for node in nodes:
            shell = getattr(node, "shell", None)
            if shell is not None:
                with contextlib.suppress(Exception):
                    shell.wait(timeout=2)
                with contextlib.suppress(Exception):
                    node.stdin.close()
                with contextlib.suppress(Exception):
                    os.close(node.slave)
                node.shell = None
        for popen in self._popens:
            with contextlib.suppress(Exception):
                popen.wait(timeout=2)
        self._hosts.clear()
        self._net = None

    # ------------------------------------------------------------------ use
    def ip(self, device: str) -> str:
        return self.plan.ips[self._rank(device)]

    def interface(self, device: str) -> str:
        return self.plan.host_interfaces[self._rank(device)]

    def _rank(self, device: str) -> int:
        return [d.name for d in self.topology.devices].index(self.topology.device(device).name)

    def _host(self, device: str) -> Any:
        if device not in self._hosts:
            raise RuntimeError(f"the lab network is not running (no host {device!r})")
        return self._hosts[device]

    def popen(
        self,
        device: str,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``device`` (its namespace and CPU cgroup), stdout+stderr piped."""
        host = self._host(device)
        popen: subprocess.Popen[bytes] = host.popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
        )
        self._popens.append(popen)
        assert self.record is not None
        self.record.add_process(popen.pid, f"command on {device}")
        self._save()
        return popen

    def exec_in(
        self, device: str, argv: Sequence[str], timeout_s: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """Run a short command in ``device``'s network namespace (not its cgroup) and wait."""
        host = self._host(device)
        return subprocess.run(
            ["mnexec", "-a", str(host.pid), *argv],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def reachable(self, src: str, dst: str, port: int = 29399, timeout_s: float = 10.0) -> bool:
        """Whether a TCP connection from ``src`` to ``dst``'s lab IP succeeds (no ping needed)."""
        server = self._host(dst).popen(
            [sys.executable, "-c", _TCP_SERVER, self.ip(dst), str(port), str(timeout_s)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        assert self.record is not None
        self.record.add_process(server.pid, f"probe server on {dst}")
        try:
            client = self.exec_in(
                src,
                [sys.executable, "-c", _TCP_CLIENT, self.ip(dst), str(port), str(timeout_s)],
                timeout_s=timeout_s + 5,
            )
            return client.returncode == 0 and server.wait(timeout=timeout_s + 5) == 0
        finally:
            if server.poll() is None:
                server.kill()
                server.wait(timeout=5)
            self.record.processes = [p for p in self.record.processes if p["pid"] != server.pid]

    def link_interfaces(self, endpoints: Sequence[str]) -> list[tuple[str, str | None]]:
        """``(interface, device whose namespace holds it or None for root)`` of a link's ends."""
        kind, a, b = self.topology.resolve_link(endpoints)
        if kind == "lan":
            rank = self._rank(a)
            return [(self.plan.lan_ports[rank], None), (self.plan.host_interfaces[rank], a)]
        for link, ports in zip(self.topology.wan, self.plan.wan_ports, strict=True):
            if set(link.regions) == {a, b}:
                return [(ports[0], None), (ports[1], None)]
        raise AssertionError("resolve_link accepted a WAN link that has no ports")

    def set_bandwidth(self, endpoints: Sequence[str], mbit: float) -> None:
        """Change a link's htb rate on both ends (``tc class change``; queues are kept)."""
        if not 0 < mbit <= 1000:
            raise ValueError(f"bandwidth {mbit} Mbit/s must be in (0, 1000]")
        for interface, device in self.link_interfaces(endpoints):
            tc = ["tc", "class", "change", "dev", interface, "parent", "5:0", "classid", "5:1"]
            tc += ["htb", "rate", f"{mbit:g}mbit", "burst", "15k"]
            result = self._run_tc(tc, device)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(tc)} failed: {result.stderr.strip()}")

    def rate_mbit(self, interface: str, device: str | None = None) -> float:
        """The htb rate currently set on ``interface`` (for checks and logs)."""
        out = self._run_tc(["tc", "class", "show", "dev", interface], device).stdout
        words = out.split()
        value = words[words.index("rate") + 1]
        scale = {"Gbit": 1000.0, "Mbit": 1.0, "Kbit": 0.001, "bit": 1e-6}
        for suffix, factor in scale.items():
            if value.endswith(suffix):
                return float(value[: -len(suffix)]) * factor
        raise RuntimeError(f"cannot parse tc rate {value!r} of {interface}")

    def _run_tc(self, tc: list[str], device: str | None) -> subprocess.CompletedProcess[str]:
        if device is not None:
            return self.exec_in(device, tc, timeout_s=10)
        return subprocess.run(tc, capture_output=True, text=True, timeout=10, check=False)

    def set_cpu(self, device: str, cpu: float) -> None:
        """Change ``device``'s CFS quota to ``cpu`` (a fraction of all the machine's cores, as the
        topology's ``cpu``) at its current period; its processes keep running."""
        _, period_us = self._cfs(device)
        quota_us = round(period_us * cpu * (os.cpu_count() or 1))
        if not 0 < cpu <= 1 or quota_us < 1000:
            raise ValueError(
                f"device {device}: cpu {cpu:g} gives a quota of {quota_us / 1000:.2f} ms per "
                f"{period_us / 1000:g} ms period; it must be in (0, 1] and at least the "
                "kernel's 1 ms"
            )
        for directory in cgroup_dirs(device):
            quota = directory / "cpu.cfs_quota_us"
            if quota.exists():
                quota.write_text(str(quota_us))
                return
        raise RuntimeError(f"no cpu cgroup for {device!r}")

    def cpu_quota(self, device: str) -> float:
        """The host's CFS quota in cores (quota / period), e.g. 0.4 for cpu=0.2 on 2 cores."""
        quota_us, period_us = self._cfs(device)
        return quota_us / period_us

    def cpu_max(self, device: str) -> str | None:
        """The host's CFS quota as cgroup v2's ``cpu.max`` says it: ``"<quota_us> <period_us>"``.

        None without a quota (``-1``). The devices' processes get it as ``DEEPCEE_CPU_MAX``.
        """
        quota_us, period_us = self._cfs(device)
        return None if quota_us <= 0 else f"{quota_us} {period_us}"

    def _cfs(self, device: str) -> tuple[int, int]:
        for directory in cgroup_dirs(device):
            quota = directory / "cpu.cfs_quota_us"
            if quota.exists():
                return int(quota.read_text()), int((directory / "cpu.cfs_period_us").read_text())
        raise RuntimeError(f"no cpu cgroup for {device!r}")


_TCP_SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
s.settimeout(float(sys.argv[3]))
c, _ = s.accept()
c.sendall(b"ok")
c.close()
"""
_TCP_CLIENT = """
import socket, sys, time
end = time.monotonic() + float(sys.argv[3])
while True:
    try:
        with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2) as c:
            sys.exit(0 if c.recv(2) == b"ok" else 1)
    except OSError:
        if time.monotonic() > end:
            sys.exit(1)
        time.sleep(0.1)
"""


class _DropHtbQuantum(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "quantum of class" not in record.getMessage()


def _quiet_htb_warnings() -> None:
    # htb warns "quantum of class ... is big" at high rates; harmless (docs/lab.md), and Mininet
    # logs it as an error once per interface.
    from mininet.log import lg

    if not any(isinstance(f, _DropHtbQuantum) for f in lg.filters):
        lg.addFilter(_DropHtbQuantum())


def _exists(interface: str) -> bool:
    return Path("/sys/class/net", interface).exists()
