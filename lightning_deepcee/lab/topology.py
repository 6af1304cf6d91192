"""Lab topologies: regions, devices and the links between them, parsed and validated (pure).

A topology YAML looks like::

    name: cee6
    regions:                       # one switch (Linux bridge) per region
      cloud: {lan_mbit: 1000}      # bandwidth of each device's link to its region switch
      edge: {lan_mbit: 1000}
    devices:                       # one emulated host per device; rank order = list order
      - {name: cloud0, region: cloud, cpu: 0.2}   # cpu: fraction of ALL the machine's cores
      - {name: edge0, region: edge, cpu: 0.1}
    wan:                           # region-to-region links; the region graph must be a tree
      - {regions: [cloud, edge], mbit: 100}

Latency, delay, loss and jitter are refused: this kernel has no ``netem``, so the lab can only
shape bandwidth (htb). Latency belongs in the simulator (``lightning_deepcee.schedule.simulate``).

The file's keys and types are checked against :class:`TopologyFile` by the schema loader
(:func:`lightning_deepcee.profiler.schema.load_structured`, omegaconf); what no type can say
(names, ranges, the region graph being a tree) is checked when the :class:`Topology` is built.
Nothing here imports Mininet; every check runs without root.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from lightning_deepcee.profiler.schema import load_structured, read_yaml

__all__ = [
    "LATENCY_KEYS",
    "MAX_LINK_MBIT",
    "Device",
    "Region",
    "Topology",
    "TopologyFile",
    "WanLink",
    "find_named",
    "latency_key_hint",
    "load_topology",
    "read_lab_yaml",
]

MAX_LINK_MBIT = 1000.0
"""Mininet's TCLink ignores (with only a log line) any ``bw`` above 1000 Mbit/s."""

LATENCY_KEYS = frozenset(
    {
        "latency",
        "latency_ms",
        "latency_s",
        "delay",
        "delay_ms",
        "delay_s",
        "loss",
        "loss_pct",
        "jitter",
        "jitter_ms",
        "jitter_s",
    }
)
_NO_NETEM = (
    "this kernel has no netem qdisc, so the lab cannot emulate latency, loss or jitter (only "
    "bandwidth). Remove the key; model latency in the simulator instead (see docs/lab.md)."
)
# Device names become Mininet host names, cgroup names and interface names: the switch-side
# port is "dlab<region index>-<device>" and Linux limits interface names to 15 characters.
_DEVICE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,8}$")
_REGION_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_RESERVED_PREFIX = "dlab"
_MAX_REGIONS = 10


def latency_key_hint(key: str) -> str | None:
    """Why ``key`` is refused when it asks for latency, delay, loss or jitter; else ``None``."""
    return _NO_NETEM if key.lower() in LATENCY_KEYS else None


def _check_mbit(value: float, where: str) -> None:
    if not 0 < value <= MAX_LINK_MBIT:
        raise ValueError(
            f"{where}={value:g} Mbit/s is out of range: use 0 < {where.rsplit('.', 1)[-1]} <= "
            f"{MAX_LINK_MBIT:g} (Mininet's TCLink limit)"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Region:
    """One region (cloud, edge, end): a switch that its devices hang off."""

    name: str
    """Region name, used in WAN links and traces."""
    lan_mbit: float
    """Bandwidth of each device-to-switch link in this region, in Mbit/s (htb-shaped)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    """One emulated device: a Mininet host with a CPU share, running one process."""

    name: str
    """Host name (also its log prefix, cgroup name and ``<name>-eth0`` interface)."""
    region: str
    """The region whose switch this device's LAN link joins."""
    cpu: float
    """CPU quota as a fraction of ALL cores (Mininet's ``cpu=``): on 2 cores, 0.2 = 40% of one."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WanLink:
    """A wide-area link between two region switches."""

    regions: tuple[str, str]
    """The two regions it joins (order does not matter)."""
    mbit: float
    """Bandwidth in Mbit/s, in each direction (htb-shaped on both ends)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """Regions, devices (rank order) and WAN links; validated on construction."""

    name: str
    regions: tuple[Region, ...]
    devices: tuple[Device, ...]
    wan: tuple[WanLink, ...] = ()
    cpu_period_ms: float = 100.0
    """The CFS period of every device's CPU quota (Mininet's ``period_us``, default 100 ms). A
    quota lets a device run at full speed for ``cpu x cores x period``, then stalls it until the
    period ends: with 100 ms, a device at 12% of a core runs 12 ms and stalls 88 ms, far
    burstier than a slow CPU when its actions and messages take milliseconds. A shorter period
    spreads the same share evenly; the quota must stay >= 1 ms (the kernel's least)."""

    def __post_init__(self) -> None:
        _validate(self)

    # ------------------------------------------------------------------ lookups
    def region(self, name: str) -> Region:
        return find_named(self.regions, name, "region")

    def region_index(self, name: str) -> int:
        return [r.name for r in self.regions].index(self.region(name).name)

    def device(self, name: str) -> Device:
        return find_named(self.devices, name, "device")

    def devices_in(self, region: str) -> tuple[Device, ...]:
        return tuple(d for d in self.devices if d.region == region)

    def wan_link(self, a: str, b: str) -> WanLink:
        for link in self.wan:
            if set(link.regions) == {a, b}:
                return link
        raise ValueError(f"no WAN link between regions {a!r} and {b!r}")

    def link_mbit(self, endpoints: Sequence[str]) -> float:
        """Configured bandwidth of ``[region, region]`` (WAN) or ``[device, region]`` (LAN)."""
        kind, a, b = self.resolve_link(endpoints)
        return self.wan_link(a, b).mbit if kind == "wan" else self.region(b).lan_mbit

    def region_path(self, a: str, b: str) -> tuple[WanLink, ...]:
        """The WAN links crossed from region ``a`` to region ``b`` (the region graph is a tree)."""
        self.region(a), self.region(b)
        previous: dict[str, tuple[str, WanLink] | None] = {a: None}
        frontier = [a]
        while frontier and b not in previous:
            here = frontier.pop()
            for link in self.wan:
                if here in link.regions:
                    there = link.regions[1] if link.regions[0] == here else link.regions[0]
                    if there not in previous:
                        previous[there] = (here, link)
                        frontier.append(there)
        path: list[WanLink] = []
        node = b
        while (step := previous[node]) is not None:
            node, link = step
            path.append(link)
        return tuple(reversed(path))

    def path_mbit(self, src: str, dst: str) -> float:
        """Configured bottleneck between two devices: both LAN links and every WAN link between.

        What an ideal bandwidth probe from ``src`` to ``dst`` would read (htb shapes every hop
        at its rate, so the slowest hop sets the rate).
        """
        a, b = self.device(src), self.device(dst)
        rates = [self.region(a.region).lan_mbit, self.region(b.region).lan_mbit]
        rates += [link.mbit for link in self.region_path(a.region, b.region)]
        return min(rates)

    def resolve_link(self, endpoints: Sequence[str], where: str = "link") -> tuple[str, str, str]:
        """``("wan", region_a, region_b)`` or ``("lan", device, region)``; ValueError otherwise."""
        if len(endpoints) != 2 or not all(isinstance(e, str) for e in endpoints):
            raise ValueError(f"{where} must be two names, got {endpoints!r}")
        a, b = endpoints
        regions = {r.name for r in self.regions}
        devices = {d.name: d for d in self.devices}
        if a in regions and b in regions:
            if not any(set(w.regions) == {a, b} for w in self.wan):
                raise ValueError(f"{where}={[a, b]}: no WAN link joins regions {a!r} and {b!r}")
            return "wan", a, b
        if b in devices and a in regions:
            a, b = b, a
        if a in devices and b in regions:
            if devices[a].region != b:
                raise ValueError(
                    f"{where}={[a, b]}: device {a!r} is in region {devices[a].region!r}, not {b!r}"
                )
            return "lan", a, b
        unknown = [e for e in (a, b) if e not in regions and e not in devices]
        raise ValueError(
            f"{where}={list(endpoints)}: "
            + (f"unknown name {unknown[0]!r}" if unknown else "two devices are not a link")
            + "; use [region, region] for a WAN link or [device, its region] for a LAN link"
        )

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "regions": {r.name: {"lan_mbit": r.lan_mbit} for r in self.regions},
            "devices": [{"name": d.name, "region": d.region, "cpu": d.cpu} for d in self.devices],
            "wan": [{"regions": list(w.regions), "mbit": w.mbit} for w in self.wan],
            "cpu_period_ms": self.cpu_period_ms,
        }

    @classmethod
    def from_dict(cls, data: Any, default_name: str = "lab") -> Topology:
        """Build from a parsed topology file (see :class:`TopologyFile`); ``ValueError`` names
        the key, the expected type or value and the fix."""
        file = load_structured(TopologyFile, data, unknown_key_hint=latency_key_hint)
        wan = []
        for i, link in enumerate(file.wan or ()):
            if len(link.regions) != 2:
                raise ValueError(f"wan[{i}].regions must be two region names, got {link.regions}")
            wan.append(WanLink(regions=(link.regions[0], link.regions[1]), mbit=link.mbit))
        return cls(
            name=default_name if file.name is None else file.name,
            regions=tuple(Region(name=n, lan_mbit=r.lan_mbit) for n, r in file.regions.items()),
            devices=tuple(file.devices),
            wan=tuple(wan),
            cpu_period_ms=file.cpu_period_ms,
        )


@dataclass(kw_only=True)
class RegionEntry:
    """A region in a topology file, under its name: ``cloud: {lan_mbit: 1000}``."""

    lan_mbit: float


@dataclass(kw_only=True)
class WanEntry:
    """A WAN link in a topology file: ``{regions: [cloud, edge], mbit: 100}``."""

    regions: list[str]
    mbit: float


@dataclass(kw_only=True)
class TopologyFile:
    """The keys and types of a topology YAML file (the schema the loader checks it against)."""

    name: str | None = None
    """Defaults to the file name without its extension."""
    regions: dict[str, RegionEntry]
    devices: list[Device]
    wan: list[WanEntry] | None = None
    cpu_period_ms: float = 100.0


def _validate(topo: Topology) -> None:
    region_names = [r.name for r in topo.regions]
    if not region_names:
        raise ValueError("regions is empty; declare at least one region")
    if len(region_names) > _MAX_REGIONS:
        raise ValueError(
            f"regions has {len(region_names)} regions; at most {_MAX_REGIONS}: merge some"
        )
    _unique(region_names, "regions")
    for r in topo.regions:
        if not _REGION_NAME.match(r.name):
            raise ValueError(f"regions.{r.name}: region names must match {_REGION_NAME.pattern}")
        _check_mbit(r.lan_mbit, f"regions.{r.name}.lan_mbit")
    if not topo.devices:
        raise ValueError("devices is empty; declare at least one device")
    device_names = [d.name for d in topo.devices]
    _unique(device_names, "devices")
    for i, d in enumerate(topo.devices):
        where = f"devices[{i}]"
        if not _DEVICE_NAME.match(d.name) or d.name.startswith(_RESERVED_PREFIX):
            raise ValueError(
                f"{where}.name={d.name!r}: device names must match {_DEVICE_NAME.pattern} (they "
                f"become interface names, 15 characters at most) and not start with "
                f"{_RESERVED_PREFIX!r}"
            )
        if d.name in region_names:
            raise ValueError(f"{where}.name={d.name!r} is also a region name; rename one of them")
        if d.region not in region_names:
            raise ValueError(f"{where}.region={d.region!r} is not a region; known: {region_names}")
        if not 0 < d.cpu <= 1:
            raise ValueError(
                f"{where}.cpu={d.cpu:g} must be a fraction of all cores in (0, 1] "
                "(Mininet's CPULimitedHost cpu=)"
            )
    total_cpu = sum(d.cpu for d in topo.devices)
    if total_cpu > 1.0 + 1e-9:
        raise ValueError(
            f"devices[*].cpu sum to {total_cpu:.3f} > 1.0: cpu is a fraction of ALL the machine's "
            "cores, so the shares cannot exceed the machine; scale them down"
        )
    for name in region_names:
        if not topo.devices_in(name):
            raise ValueError(f"regions.{name} has no device; add one or remove the region")
    if not 1 <= topo.cpu_period_ms <= 1000:
        raise ValueError(
            f"cpu_period_ms={topo.cpu_period_ms:g} must be a number of milliseconds in [1, 1000] "
            "(the kernel's CFS period range)"
        )
    _validate_wan(topo, region_names)


def _validate_wan(topo: Topology, region_names: list[str]) -> None:
    seen: set[frozenset[str]] = set()
    parent = {name: name for name in region_names}

    def root(x: str) -> str:
        while parent[x] != x:
            x = parent[x]
        return x

    for i, link in enumerate(topo.wan):
        where = f"wan[{i}]"
        a, b = link.regions
        for end in (a, b):
            if end not in region_names:
                raise ValueError(f"{where}.regions: {end!r} is not a region; known: {region_names}")
        if a == b:
            raise ValueError(f"{where}.regions=[{a}, {b}] joins a region to itself")
        _check_mbit(link.mbit, f"{where}.mbit")
        key = frozenset((a, b))
        if key in seen:
            raise ValueError(f"{where}.regions=[{a}, {b}]: duplicate WAN link")
        seen.add(key)
        ra, rb = root(a), root(b)
        if ra == rb:
            raise ValueError(
                f"{where}.regions=[{a}, {b}] closes a cycle in the region graph; the lab's Linux "
                "bridges run without STP, so the WAN links must form a tree: remove one link"
            )
        parent[ra] = rb
    groups = {root(name) for name in region_names}
    if len(groups) > 1:
        raise ValueError(
            f"the WAN links leave the regions disconnected ({len(groups)} parts); add "
            f"{len(groups) - 1} wan link(s) so every region is reachable"
        )


def _unique(names: list[str], field: str) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{field}: duplicate name {name!r}; names must be unique")
        seen.add(name)


class _Named(Protocol):
    @property
    def name(self) -> str: ...


_NamedT = TypeVar("_NamedT", bound=_Named)


def find_named(items: Sequence[_NamedT], name: str, what: str) -> _NamedT:
    """The item called ``name``; a ValueError listing the known names of ``what`` otherwise.

    One lookup for the lab's named things (regions, devices, launched commands), so that an
    unknown name reads the same everywhere.
    """
    for item in items:
        if item.name == name:
            return item
    raise ValueError(f"unknown {what} {name!r}; known: {[i.name for i in items]}")


def read_lab_yaml(path: Path, what: str) -> Any:
    """The parsed YAML at ``path``; a missing file is a ValueError naming the ``what`` file.

    Topology and trace files are read alike, so that a wrong path reads the same for both.
    """
    try:
        return read_yaml(path)
    except FileNotFoundError:
        raise ValueError(f"{what} file {str(path)!r} does not exist") from None


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology YAML file; every error starts with the file name."""
    path = Path(path)
    data = read_lab_yaml(path, "topology")
    try:
        return Topology.from_dict(data, default_name=path.stem)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
