"""Bandwidth traces: link bandwidth changes at given times into a lab run (pure).

A trace YAML is a list of events (or a mapping with an ``events`` list)::

    - {at_s: 10, link: [cloud, edge], bandwidth_mbit: 20}   # a WAN link: [region, region]
    - {at_s: 30, link: [end0, end], bandwidth_mbit: 5}      # a LAN link: [device, its region]
    - {at_s: 60, link: [cloud, edge], bandwidth_mbit: 100}

``at_s`` counts from the moment the command starts on every device. Latency, loss and jitter are
refused (no netem on this kernel). Each event's keys and types are checked against
:class:`TraceEventEntry` by the schema loader (omegaconf); ranges and the link's two ends are
checked after. Nothing here imports Mininet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_deepcee.lab.topology import MAX_LINK_MBIT, Topology, latency_key_hint
from lightning_deepcee.profiler.schema import load_structured, read_yaml

__all__ = ["Trace", "TraceEvent", "TraceEventEntry", "TraceFile", "load_trace"]


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
class Trace:
    """Events sorted by time (stable for equal times)."""

    events: tuple[TraceEvent, ...] = ()

    def __post_init__(self) -> None:
        times = [e.at_s for e in self.events]
        if times != sorted(times):
            object.__setattr__(self, "events", tuple(sorted(self.events, key=lambda e: e.at_s)))

    def validate(self, topology: Topology) -> None:
        """Raise ValueError naming the event whose link is not in ``topology``."""
        for i, event in enumerate(self.events):
            topology.resolve_link(event.link, where=f"trace[{i}].link")

    def to_list(self) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self.events]

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
                f"{type(data).__name__} {data!r}"
            )
        return cls(events=tuple(_event(entry, f"trace[{i}]") for i, entry in enumerate(data)))


@dataclass(kw_only=True)
class TraceEventEntry:
    """The keys and types of one event in a trace file (the schema the loader checks)."""

    at_s: float
    link: list[str]
    bandwidth_mbit: float


@dataclass(kw_only=True)
class TraceFile:
    """A trace written as a mapping: only ``events`` (a list of :class:`TraceEventEntry`)."""

    events: list[Any] | None = None


def _event(entry: Any, where: str) -> TraceEvent:
    event = load_structured(TraceEventEntry, entry, key=where, unknown_key_hint=latency_key_hint)
    if event.at_s < 0:
        raise ValueError(f"{where}.at_s={event.at_s:g} must be a number of seconds >= 0")
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
    try:
        data = read_yaml(path)
    except FileNotFoundError:
        raise ValueError(f"trace file {str(path)!r} does not exist") from None
    try:
        trace = Trace.from_data(data)
        if topology is not None:
            trace.validate(topology)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return trace
