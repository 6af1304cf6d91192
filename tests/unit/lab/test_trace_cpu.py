"""CPU changes in a lab trace: parsed, sorted and round-tripped with the other events, checked
against the topology (a device it has, a quota the machine can give), and refused when malformed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_deepcee.lab.topology import load_topology
from lightning_deepcee.lab.trace import CpuEvent, Trace, load_trace

ROOT = Path(__file__).resolve().parents[3]
CEE6 = ROOT / "configs" / "lab" / "cee6.yaml"  # cpu 0.24, 0.24, 0.15, 0.15, 0.06, 0.06


def test_cpu_events_parse_sort_and_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(
        "- {at_s: 160, device: edge0, cpu: 0.05}\n"
        "- {at_s: 30, link: [cloud, edge], bandwidth_mbit: 5}\n"
        "- {at_s: 260, device: edge0, cpu: 0.15}\n"
    )
    trace = load_trace(path, load_topology(CEE6))
    assert trace.cpu_events == (
        CpuEvent(at_s=160.0, device="edge0", cpu=0.05),
        CpuEvent(at_s=260.0, device="edge0", cpu=0.15),
    )
    assert [e.link for e in trace.events] == [("cloud", "edge")] and trace.device_events == ()
    assert [e["at_s"] for e in trace.to_list()] == [30.0, 160.0, 260.0]
    assert Trace.from_data({"events": trace.to_list()}) == trace


def test_cpu_events_validate_against_the_topology() -> None:
    topology = load_topology(CEE6)
    Trace.from_data([{"at_s": 1, "device": "end0", "cpu": 0.02}]).validate(topology)
    with pytest.raises(ValueError, match="no device 'edge9'"):
        Trace.from_data([{"at_s": 1, "device": "edge9", "cpu": 0.1}]).validate(topology)
    # The devices' shares sum to 0.9 already: edge0 cannot take 0.3 more.
    with pytest.raises(ValueError, match=r"would sum to 1\.150 > 1\.0"):
        Trace.from_data([{"at_s": 1, "device": "edge0", "cpu": 0.4}]).validate(topology)
    # ... unless another device gave its share up first.
    Trace.from_data(
        [{"at_s": 1, "device": "cloud0", "cpu": 0.04}, {"at_s": 2, "device": "edge0", "cpu": 0.3}]
    ).validate(topology)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"at_s": 1, "device": "edge0", "cpu": 0}, r"trace\[0\]\.cpu=0 must be a fraction"),
        ({"at_s": 1, "device": "edge0", "cpu": 1.5}, r"trace\[0\]\.cpu=1\.5 must be a fraction"),
        ({"at_s": -1, "device": "edge0", "cpu": 0.1}, r"trace\[0\]\.at_s=-1"),
        ({"at_s": 1, "cpu": 0.1}, r"trace\[0\]\.device: missing required key"),
        ({"at_s": 1, "device": "edge0", "cpu": 0.1, "action": "kill"}, r"unknown key"),
    ],
)
def test_cpu_event_errors(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Trace.from_data([entry])
