"""Traces: bandwidth changes and devices lost or regained, at given times of a lab run (pure).

A trace YAML is a list of events (or a mapping with an ``events`` list)::

    - {at_s: 10, link: [cloud, edge], bandwidth_mbit: 20}   # a WAN link: [region, region]
    - {at_s: 30, link: [end0, end], bandwidth_mbit: 5}      # a LAN link: [device, its region]
    - {at_s: 60, device: edge0, action: kill}               # SIGKILL every process of edge0
    - {at_s: 90, link: [cloud, edge], bandwidth_mbit: 100}
    - {at_s: 120, device: edge0, action: start}             # run edge0's command again
    - {at_s: 200, device: edge1, action: kill}
    - {at_s: 240, device: edge1, action: join}              # edge1 joins the running job
    - {at_s: 150, device: edge1, cpu: 0.05}                 # edge1's CPU quota, as in topology

``at_s`` counts from the moment the command starts on every device. Latency, loss and jitter are
refused (no netem on this kernel). An event is a bandwidth change (``link`` and
``bandwidth_mbit``, checked against :class:`TraceEventEntry`), a device event (``device`` and
``action``, checked against :class:`DeviceEventEntry`) or a CPU change (``device`` and ``cpu``,
:class:`CpuEventEntry`: another tenant taking part of the device, or leaving), one kind each;
the schema loader (omegaconf) checks keys and types, ranges and names are checked after.
Nothing here imports Mininet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_deepcee.lab.topology import (
    MAX_LINK_MBIT,
    Topology,
    latency_key_hint,
    read_lab_yaml,
)
from lightning_deepcee.profiler.schema import load_structured

__all__ = [
    "DEVICE_ACTIONS",
    "CpuEvent",
    "CpuEventEntry",
    "DeviceEvent",
    "DeviceEventEntry",
    "Trace",
    "TraceEvent",
    "TraceEventEntry",
    "TraceFile",
    "load_trace",
]

DEVICE_ACTIONS = ("kill", "start", "join")
"""``kill``: SIGKILL every process of the device; ``start``: run its command again (under the
launcher: an elastic run restarts at its next rendezvous); ``join``: run its command alone to
join the running job at a step boundary (``DEEPCEE_JOIN=1``, the others keep running)."""
_DEVICE_KEYS = frozenset({"device", "action"})
_LINK_KEYS = frozenset({"link", "bandwidth_mbit"})


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceEvent:
    """At ``at_s`` seconds, set the bandwidth of ``link`` (both directions)."""

    at_s: float
    """Seconds after the command started on every device."""
    link: tuple[str, str]
    """``(region, region)`` for a WAN link or ``(device, region)`` for a device's LAN link."""
    bandwidth_mbit: float
    """New bandwidth in Mbit/s."""

    def to_dict(self) -> dict[str, Any]:
        return {"at_s": self.at_s, "link": list(self.link), "bandwidth_mbit": self.bandwidth_mbit}


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceEvent:
    """At ``at_s`` seconds, kill ``device`` (every process, SIGKILL), start its command again,
    or start it to join the running job.

    A kill is what losing a site looks like to the others (no goodbye, sockets reset); a start
    is the site coming back, which in an elastic run joins the job at its next rendezvous; a
    join brings it back at a step boundary of the job as it runs.
    """

    at_s: float
    """Seconds after the command started on every device."""
    device: str
    """A device of the topology."""
    action: str
    """One of :data:`DEVICE_ACTIONS`."""

    def to_dict(self) -> dict[str, Any]:
        return {"at_s": self.at_s, "device": self.device, "action": self.action}


@dataclass(frozen=True, kw_only=True, slots=True)
class CpuEvent:
    """At ``at_s`` seconds, set ``device``'s CPU quota to ``cpu`` (a fraction of all the
    machine's cores, as the topology's ``cpu``); its processes keep running."""

    at_s: float
    device: str
    cpu: float

    def to_dict(self) -> dict[str, Any]:
        return {"at_s": self.at_s, "device": self.device, "cpu": self.cpu}


@dataclass(frozen=True, kw_only=True, slots=True)
class Trace:
    """Bandwidth, device and CPU events, each sorted by time (stable for equal times)."""

    events: tuple[TraceEvent, ...] = ()
    """Bandwidth changes."""
    device_events: tuple[DeviceEvent, ...] = ()
    """Kills, starts and joins (kept apart so that ``events`` keeps meaning bandwidth changes)."""
    cpu_events: tuple[CpuEvent, ...] = ()
    """CPU quota changes."""

    def __post_init__(self) -> None:
        for name in ("events", "device_events", "cpu_events"):
            events = getattr(self, name)
            if [e.at_s for e in events] != sorted(e.at_s for e in events):
                object.__setattr__(self, name, tuple(sorted(events, key=lambda e: e.at_s)))

    def validate(self, topology: Topology) -> None:
        """Raise ValueError naming the event whose link or device is not in ``topology``, or
        whose action cannot happen then (a kill of a device already killed, a start or join of
        one still running: every device runs from t=0), or a CPU change that would give the devices
        more than the machine (their ``cpu`` sums above 1)."""
        for i, link_event in enumerate(self.events):
            topology.resolve_link(link_event.link, where=f"trace[{i}].link")
        cpu = {d.name: d.cpu for d in topology.devices}
        for change in self.cpu_events:
            where = f"trace event {{at_s: {change.at_s:g}, device: {change.device}, cpu: "
            where += f"{change.cpu:g}}}"
            if change.device not in cpu:
                raise ValueError(f"{where}: no device {change.device!r} in the topology")
            cpu[change.device] = change.cpu
            if sum(cpu.values()) > 1.0 + 1e-9:
                raise ValueError(
                    f"{where}: the devices' cpu would sum to {sum(cpu.values()):.3f} > 1.0 (a "
                    "fraction of ALL the machine's cores); lower another device first"
                )
        killed: set[str] = set()
        for event in self.device_events:
            where = f"trace event {{at_s: {event.at_s:g}, device: {event.device}, "
            where += f"action: {event.action}}}"
            try:
                topology.device(event.device)
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
            if event.action == "kill":
                if event.device in killed:
                    raise ValueError(f"{where}: {event.device} is already killed; start it first")
                killed.add(event.device)
            elif event.device in killed:
                killed.remove(event.device)
            else:
                raise ValueError(
                    f"{where}: {event.device} is still running then (every device runs from "
                    "t=0); kill it first"
                )

    def in_order(self) -> list[TraceEvent | DeviceEvent | CpuEvent]:
        """Every event, sorted by time (stable: for equal times, bandwidth, device, CPU)."""
        every: list[TraceEvent | DeviceEvent | CpuEvent] = [
            *self.events, *self.device_events, *self.cpu_events,
        ]  # fmt: skip
        return sorted(every, key=lambda e: e.at_s)

    def to_list(self) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self.in_order()]

    @classmethod
    def from_data(cls, data: Any) -> Trace:
        """Build from a parsed trace file: a list of events, a mapping ``{events: [...]}`` or
        nothing. ``ValueError`` names the event (``trace[3].at_s``), the expected type or
        value and the fix."""
        if data is None:
            return cls()
        if isinstance(data, Mapping):
            wrapper = load_structured(TraceFile, data, key="trace", passthrough={"events"})
            data = wrapper.events or []
        if not isinstance(data, list):
            raise ValueError(
                f"trace: expected a list of events {{at_s, link, bandwidth_mbit}}, got "
                f"{type(data).__name__} {data!r}; a device event is {{at_s, device, action}}"
            )
        parsed = [_any_event(entry, f"trace[{i}]") for i, entry in enumerate(data)]
        return cls(
            events=tuple(e for e in parsed if isinstance(e, TraceEvent)),
            device_events=tuple(e for e in parsed if isinstance(e, DeviceEvent)),
            cpu_events=tuple(e for e in parsed if isinstance(e, CpuEvent)),
        )


@dataclass(kw_only=True)
class TraceEventEntry:
    """The keys and types of one event in a trace file (the schema the loader checks)."""

    at_s: float
    link: list[str]
    bandwidth_mbit: float


@dataclass(kw_only=True)
class DeviceEventEntry:
    """The keys and types of one device event (kill or start) in a trace file."""

    at_s: float
    device: str
    action: str


@dataclass(kw_only=True)
class CpuEventEntry:
    """The keys and types of one CPU change in a trace file."""

    at_s: float
    device: str
    cpu: float


@dataclass(kw_only=True)
class TraceFile:
    """A trace written as a mapping: only ``events`` (a list of :class:`TraceEventEntry`)."""

    events: list[Any] | None = None


def _any_event(entry: Any, where: str) -> TraceEvent | DeviceEvent | CpuEvent:
    keys = set(entry) if isinstance(entry, Mapping) else set()
    if "cpu" in keys and not keys & (_LINK_KEYS | {"action"}):
        change = load_structured(CpuEventEntry, entry, key=where)
        _check_at(change.at_s, where)
        if not 0 < change.cpu <= 1:
            raise ValueError(
                f"{where}.cpu={change.cpu:g} must be a fraction of all cores in (0, 1], as the "
                "topology's cpu"
            )
        return CpuEvent(at_s=change.at_s, device=change.device, cpu=change.cpu)
    if not keys & _DEVICE_KEYS:
        return _event(entry, where)  # a bandwidth event (or the loader's error for one)
    if keys & _LINK_KEYS:
        raise ValueError(
            f"{where}: an event has either link and bandwidth_mbit (a bandwidth change) or device "
            f"and action (kill/start/join), not both; got keys {', '.join(map(str, entry))}"
        )
    event = load_structured(DeviceEventEntry, entry, key=where, unknown_key_hint=latency_key_hint)
    _check_at(event.at_s, where)
    if event.action not in DEVICE_ACTIONS:
        raise ValueError(f"{where}.action={event.action!r} must be one of {DEVICE_ACTIONS}")
    return DeviceEvent(at_s=event.at_s, device=event.device, action=event.action)


def _check_at(at_s: float, where: str) -> None:
    if at_s < 0:
        raise ValueError(f"{where}.at_s={at_s:g} must be a number of seconds >= 0")


def _event(entry: Any, where: str) -> TraceEvent:
    event = load_structured(TraceEventEntry, entry, key=where, unknown_key_hint=latency_key_hint)
    _check_at(event.at_s, where)
    if len(event.link) != 2:
        raise ValueError(
            f"{where}.link={event.link!r} must be [region, region] or [device, region]"
        )
    if not 0 < event.bandwidth_mbit <= MAX_LINK_MBIT:
        raise ValueError(
            f"{where}.bandwidth_mbit={event.bandwidth_mbit:g} must be a number in "
            f"(0, {MAX_LINK_MBIT:g}] Mbit/s"
        )
    return TraceEvent(
        at_s=event.at_s, link=(event.link[0], event.link[1]), bandwidth_mbit=event.bandwidth_mbit
    )


def load_trace(path: str | Path, topology: Topology | None = None) -> Trace:
    """Read a trace YAML; with ``topology``, also check that every link exists in it."""
    path = Path(path)
    data = read_lab_yaml(path, "trace")
    try:
        trace = Trace.from_data(data)
        if topology is not None:
            trace.validate(topology)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return trace
