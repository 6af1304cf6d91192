"""The lab: an emulated cloud-edge-end testbed on one Linux machine (Mininet, needs root).

Regions are Linux-bridge switches, devices are CPU-limited hosts, links are htb-shaped; a command
runs on every device as one torchrun node each, and a trace changes link bandwidths over time.
Latency is not emulated (this kernel has no netem); see docs/lab.md.

    sudo deepcee-lab run --topology configs/lab/cee6.yaml --out runs/lab -- python train.py ...

``topology`` and ``trace`` are pure (no root, no Mininet); ``network`` imports Mininet lazily.
"""

from __future__ import annotations

from lightning_deepcee.lab.network import LabNetwork, check_requirements, plan_network
from lightning_deepcee.lab.runner import LabResult, RunConfig, run_command
from lightning_deepcee.lab.state import LabRecord, StateStore, leftovers, teardown
from lightning_deepcee.lab.topology import Device, Region, Topology, WanLink, load_topology
from lightning_deepcee.lab.trace import Trace, TraceEvent, load_trace

__all__ = [
    "Device",
    "LabNetwork",
    "LabRecord",
    "LabResult",
    "Region",
    "RunConfig",
    "StateStore",
    "Topology",
    "Trace",
    "TraceEvent",
    "WanLink",
    "check_requirements",
    "leftovers",
    "load_topology",
    "load_trace",
    "plan_network",
    "run_command",
    "teardown",
]
