"""The lab's record of what it created, and the teardown that removes exactly that.

Before the lab creates anything it writes down the names it is about to create (bridges,
root-namespace interfaces, cgroups); as processes start it adds their ids (with their kernel start
time, so a recycled pid is never killed). Teardown replays the record: kill the recorded processes
and whatever is inside the recorded cgroups, delete the recorded interfaces and bridges, remove the
recorded cgroups. The same replay runs on success, failure, Ctrl-C, and at the next start when a
crashed run left its record behind. Nothing is ever killed or deleted by name pattern.

The record lives in ``$DEEPCEE_LAB_STATE_DIR`` (default ``/run/deepcee-lab``) as ``state.json``,
next to a ``lock`` file that one running lab holds (``flock``), so two labs never overlap.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = [
    "LabRecord",
    "StateStore",
    "cgroup_dirs",
    "default_state_dir",
    "leftovers",
    "netns_id",
    "process_start_ticks",
    "teardown",
]

_CGROUP_CONTROLLERS = ("cpu", "cpuacct", "cpuset")
_SYS_NET = Path("/sys/class/net")


def default_state_dir() -> Path:
    return Path(os.environ.get("DEEPCEE_LAB_STATE_DIR", "/run/deepcee-lab"))


@dataclass
class LabRecord:
    """Everything one lab run created (mutable: it grows as the network is built)."""

    owner_pid: int
    owner_start_ticks: int
    topology: str
    created_unix: float = field(default_factory=time.time)
    bridges: list[str] = field(default_factory=list)
    """Linux bridges in the root namespace (one per region)."""
    root_interfaces: list[str] = field(default_factory=list)
    """Root-namespace veth ends; deleting one deletes its peer too."""
    host_interfaces: list[str] = field(default_factory=list)
    """Host-side veth ends, inside the hosts' namespaces (for reference; they die with them)."""
    cgroups: list[str] = field(default_factory=list)
    """cgroup names under the cpu, cpuacct and cpuset hierarchies (one per host)."""
    processes: list[dict[str, Any]] = field(default_factory=list)
    """``{pid, start_ticks, what}``: host and switch shells, and the commands run on hosts."""
    netns: list[str] = field(default_factory=list)
    """``net:[inode]`` of each host's network namespace, to check that it is gone."""

    def add_process(self, pid: int, what: str) -> None:
        ticks = process_start_ticks(pid)
        if ticks is not None:
            self.processes.append({"pid": pid, "start_ticks": ticks, "what": what})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LabRecord:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


MACHINE_LOCK = Path("/run/deepcee-lab.machine.lock")
"""Held by whichever lab runs on this machine: bridge, interface and cgroup names are global to
the machine, so two labs (even with separate state directories) must never overlap."""


def _wait_for_machine_lock(path: Path, wait_s: float) -> IO[str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = open(path, "a+")  # noqa: SIM115 (held until release())
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lock
        except BlockingIOError:
            if time.monotonic() >= deadline:
                lock.close()
                raise RuntimeError(
                    f"another deepcee-lab has held {path} for over {wait_s:.0f} s; wait for it "
                    "to finish or stop it (Ctrl-C) first"
                ) from None
            if not told:
                print(f"deepcee-lab: waiting for the lab already running ({path})", flush=True)
                told = True
            time.sleep(1.0)


class StateStore:
    """The state file and the lock that says a lab is running."""

    def __init__(self, directory: Path | None = None, *, machine_wait_s: float = 900.0) -> None:
        self.directory = directory or default_state_dir()
        self.path = self.directory / "state.json"
        self.machine_wait_s = machine_wait_s
        self._lock_file: IO[str] | None = None
        self._machine_lock: IO[str] | None = None

    def acquire(self) -> None:
        """Take the machine-wide lab lock (waiting up to ``machine_wait_s`` for another lab to
        finish), then this store's lock; raise RuntimeError naming the lab that holds it."""
        self._machine_lock = _wait_for_machine_lock(MACHINE_LOCK, self.machine_wait_s)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = open(self.directory / "lock", "a+")  # noqa: SIM115 (held until release())
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            lock.close()
            self._release_machine()
            raise RuntimeError(
                f"another deepcee-lab is running (pid {holder}, lock {self.directory / 'lock'}); "
                "wait for it to finish or stop it (Ctrl-C) first"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        self._lock_file = lock

    def release(self) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None
        self._release_machine()

    def _release_machine(self) -> None:
        if self._machine_lock is not None:
            fcntl.flock(self._machine_lock, fcntl.LOCK_UN)
            self._machine_lock.close()
            self._machine_lock = None

    def load(self) -> LabRecord | None:
        try:
            return LabRecord.from_dict(json.loads(self.path.read_text()))
        except FileNotFoundError:
            return None

    def save(self, record: LabRecord) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(record.to_dict(), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def clear(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    @contextlib.contextmanager
    def locked(self) -> Iterator[StateStore]:
        self.acquire()
        try:
            yield self
        finally:
            self.release()


# ---------------------------------------------------------------------- probes (read-only)
def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; None if gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _alive(proc: dict[str, Any]) -> bool:
    return process_start_ticks(int(proc["pid"])) == int(proc["start_ticks"])


def netns_id(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def cgroup_dirs(name: str) -> list[Path]:
    """Existing directories of cgroup ``name`` in the cpu/cpuacct/cpuset v1 hierarchies."""
    dirs: dict[str, Path] = {}
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return []
    for line in mounts:
        parts = line.split()
        if len(parts) < 4 or parts[2] != "cgroup":
            continue
        if not set(parts[3].split(",")) & set(_CGROUP_CONTROLLERS):
            continue
        path = Path(parts[1]) / name
        if path.is_dir():
            dirs[os.path.realpath(path)] = path
    return list(dirs.values())


def _interface_exists(name: str) -> bool:
    return (_SYS_NET / name).exists()


def _live_netns(ids: set[str]) -> set[str]:
    found: set[str] = set()
    if not ids:
        return found
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                ns = os.readlink(entry / "ns" / "net")
                if ns in ids:
                    found.add(ns)
    return found


def leftovers(record: LabRecord) -> list[str]:
    """What of ``record`` still exists (empty when teardown was complete)."""
    left = [f"process {p['pid']} ({p['what']})" for p in record.processes if _alive(p)]
    left += [f"bridge {b}" for b in record.bridges if _interface_exists(b)]
    left += [f"interface {i}" for i in record.root_interfaces if _interface_exists(i)]
    left += [f"cgroup {d}" for name in record.cgroups for d in cgroup_dirs(name)]
    left += [f"network namespace {ns}" for ns in sorted(_live_netns(set(record.netns)))]
    return left


# ---------------------------------------------------------------------- teardown (by id and name)
def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        # Each recorded process leads its own session (mnexec -d), so its group is ours too.
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def _run(argv: list[str]) -> None:
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run(argv, capture_output=True, timeout=10, check=False)


def _kill_cgroup_members(name: str) -> None:
    for directory in cgroup_dirs(name):
        with contextlib.suppress(OSError):
            for line in (directory / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(line), signal.SIGKILL)


def teardown(
    record: LabRecord,
    log: Callable[[str], None] = lambda _msg: None,
    grace_s: float = 3.0,
    timeout_s: float = 20.0,
) -> list[str]:
    """Remove everything in ``record``; returns what could not be removed (normally nothing)."""
    deadline = time.monotonic() + timeout_s
    live = [p for p in record.processes if _alive(p)]
    for proc in live:
        # Mininet's shells are interactive bash, which ignores SIGTERM: kill them outright;
        # commands get SIGTERM first so that they can flush their logs.
        is_shell = str(proc["what"]).startswith(("host ", "switch "))
        _kill(int(proc["pid"]), signal.SIGKILL if is_shell else signal.SIGTERM)
    grace_end = min(deadline, time.monotonic() + grace_s)
    while live and time.monotonic() < grace_end:
        time.sleep(0.05)
        live = [p for p in live if _alive(p)]
    for proc in live:
        _kill(int(proc["pid"]), signal.SIGKILL)
    for name in record.cgroups:
        _kill_cgroup_members(name)
    for name in record.root_interfaces:
        if _interface_exists(name):
            _run(["ip", "link", "del", name])
    for name in record.bridges:
        if _interface_exists(name):
            _run(["ip", "link", "set", name, "down"])
            _run(["ip", "link", "del", name])
    while time.monotonic() < deadline:
        for name in record.cgroups:
            _kill_cgroup_members(name)
            for directory in cgroup_dirs(name):
                with contextlib.suppress(OSError):
                    directory.rmdir()
        left = leftovers(record)
        if not left:
            return []
        time.sleep(0.1)
    left = leftovers(record)
    for item in left:
        log(f"deepcee-lab: could not remove {item}")
    return left
