"""Bandwidth traces: link bandwidth changes at given times into a lab run (pure).

A trace YAML is a list of events (or a mapping with an ``events`` list)::

    - {at_s: 10, link: [cloud, edge], bandwidth_mbit: 20}   # a WAN link: [region, region]
    - {at_s: 30, link: [end0, end], bandwidth_mbit: 5}      # a LAN link: [device, its region]
    - {at_s: 60, link: [cloud, edge], bandwidth_mbit: 100}

``at_s`` counts from the moment the command starts on every device. Latency, loss and jitter are
refused (no netem on this kernel). Nothing here imports Mininet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lightning_deepcee.lab.topology import MAX_LINK_MBIT, Topology, refuse_latency_keys

__all__ = ["Trace", "TraceEvent", "load_trace"]


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
        if data is None:
            return cls()
        if isinstance(data, Mapping):
            if set(data) != {"events"}:
                raise ValueError("a trace is a list of events, or a mapping with only 'events'")
            data = data["events"] or []
        if not isinstance(data, list):
            raise ValueError(f"a trace must be a list of events, got {type(data).__name__}")
        return cls(events=tuple(_event(entry, f"trace[{i}]") for i, entry in enumerate(data)))


def _event(entry: Any, where: str) -> TraceEvent:
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where} must be a mapping {{at_s, link, bandwidth_mbit}}, got {entry!r}")
    refuse_latency_keys(entry, where)
    allowed = {"at_s", "link", "bandwidth_mbit"}
    unknown = sorted(set(map(str, entry)) - allowed)
    if unknown:
        raise ValueError(f"{where}.{unknown[0]} is not a known key; allowed: {sorted(allowed)}")
    missing = sorted(allowed - set(entry))
    if missing:
        raise ValueError(f"{where}.{missing[0]} is required")
    at_s, link, mbit = entry["at_s"], entry["link"], entry["bandwidth_mbit"]
    if isinstance(at_s, bool) or not isinstance(at_s, int | float) or at_s < 0:
        raise ValueError(f"{where}.at_s={at_s!r} must be a number of seconds >= 0")
    if not isinstance(link, list | tuple) or len(link) != 2:
        raise ValueError(f"{where}.link={link!r} must be [region, region] or [device, region]")
    if isinstance(mbit, bool) or not isinstance(mbit, int | float) or not 0 < mbit <= MAX_LINK_MBIT:
        raise ValueError(
            f"{where}.bandwidth_mbit={mbit!r} must be a number in (0, {MAX_LINK_MBIT:g}] Mbit/s"
        )
    return TraceEvent(
        at_s=float(at_s), link=(str(link[0]), str(link[1])), bandwidth_mbit=float(mbit)
    )


def load_trace(path: str | Path, topology: Topology | None = None) -> Trace:
    """Read a trace YAML; with ``topology``, also check that every link exists in it."""
    path = Path(path)
    try:
        trace = Trace.from_data(yaml.safe_load(path.read_text()))
        if topology is not None:
            trace.validate(topology)
    except FileNotFoundError:
        raise ValueError(f"trace file {str(path)!r} does not exist") from None
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return trace
