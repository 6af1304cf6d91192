"""Lab topologies and traces: parsing and validation (pure: no root, no Mininet)."""

from __future__ import annotations

import ast
import copy
import re
from pathlib import Path
from typing import Any

import pytest

from lightning_deepcee.lab.network import plan_network
from lightning_deepcee.lab.runner import RunConfig, device_argv, device_env
from lightning_deepcee.lab.topology import Topology, load_topology
from lightning_deepcee.lab.trace import Trace, load_trace
from tests.helpers.paths import ROOT

CONFIGS = ROOT / "configs" / "lab"

BASE: dict[str, Any] = {
    "name": "t",
    "regions": {"cloud": {"lan_mbit": 1000}, "edge": {"lan_mbit": 500}, "end": {"lan_mbit": 100}},
    "devices": [
        {"name": "cloud0", "region": "cloud", "cpu": 0.3},
        {"name": "edge0", "region": "edge", "cpu": 0.2},
        {"name": "end0", "region": "end", "cpu": 0.1},
    ],
    "wan": [{"regions": ["cloud", "edge"], "mbit": 100}, {"regions": ["edge", "end"], "mbit": 20}],
}


def _with(path: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    target: Any = data
    keys: list[Any] = [int(k) if k.isdigit() else k for k in path.split(".")]
    for key in keys[:-1]:
        target = target[key]
    target[keys[-1]] = value
    return data


def test_base_round_trips() -> None:
    topo = Topology.from_dict(BASE)
    assert [d.name for d in topo.devices] == ["cloud0", "edge0", "end0"]
    assert Topology.from_dict(topo.to_dict()) == topo
    assert topo.link_mbit(["cloud", "edge"]) == 100
    assert topo.link_mbit(["edge", "cloud"]) == 100
    assert topo.link_mbit(["end0", "end"]) == 100
    assert topo.link_mbit(["end", "end0"]) == 100
    assert topo.cpu_period_ms == 100.0  # Mininet's default CFS period
    short = Topology.from_dict({**BASE, "cpu_period_ms": 10})
    assert short.cpu_period_ms == 10.0 and Topology.from_dict(short.to_dict()) == short


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("devices.0.region", "moon", r"devices\[0\]\.region='moon' is not a region"),
        ("devices.1.name", "cloud0", "devices: duplicate name 'cloud0'"),
        ("devices.0.name", "cloud", "also a region name"),
        ("devices.0.name", "averyverylongname", r"devices\[0\]\.name=.*15 characters"),
        ("devices.0.name", "dlab7", "not start with 'dlab'"),
        ("devices.0.cpu", 0.8, r"devices\[\*\]\.cpu sum to 1\.100 > 1\.0"),
        ("devices.0.cpu", 0, r"devices\[0\]\.cpu=0 must be a fraction"),
        ("devices.0.cpu", -0.1, r"devices\[0\]\.cpu=-0\.1"),
        ("regions.cloud.lan_mbit", -5, r"regions\.cloud\.lan_mbit=-5 Mbit/s is out of range"),
        ("regions.cloud.lan_mbit", 10000, r"lan_mbit=10000 Mbit/s is out of range"),
        ("wan.0.mbit", -1, r"wan\[0\]\.mbit=-1"),
        ("wan.0.mbit", "fast", r"^wan\[0\]\.mbit: expected float, got str 'fast'; write a number$"),
        ("wan.1.regions", ["edge", "mars"], r"wan\[1\]\.regions: 'mars' is not a region"),
        ("wan.1.regions", ["cloud", "edge"], "duplicate WAN link"),
        ("wan.1.regions", ["edge", "edge"], "joins a region to itself"),
        ("wan.0.latency_ms", 20, r"wan\[0\]\.latency_ms: this kernel has no netem"),
        ("wan.0.delay", "10ms", r"wan\[0\]\.delay: .*no netem"),
        ("devices.2.loss", 1, r"devices\[2\]\.loss: .*no netem"),
        ("regions.edge.jitter_ms", 3, r"regions\.edge\.jitter_ms: .*no netem"),
        ("latency", {"cloud": 5}, r"^latency: this kernel has no netem"),
        (
            "devices.0.gpu",
            1,
            r"^devices\[0\]\.gpu: unknown key of Device; remove it or fix its spelling "
            r"\(allowed: name, region, cpu\)$",
        ),
        ("colour", "red", r"^colour: unknown key of TopologyFile; .*\(allowed: name, regions,"),
        ("devices.1", "edge0", r"^devices\[1\]: expected a mapping of Device keys \(name, region"),
        (
            "devices.1.cpu",
            True,
            r"^devices\[1\]\.cpu: expected float, got bool True; write a number",
        ),
        ("devices.1.name", 7, r"^devices\[1\]\.name: expected str, got int 7; quote it"),
        ("wan.0.regions", ["cloud", 3], r"^wan\[0\]\.regions\[1\]: expected str, got int 3"),
        ("wan.0.regions", ["cloud"], r"^wan\[0\]\.regions must be two region names"),
        ("regions.cloud", 1000, r"^regions\.cloud: expected a mapping of RegionEntry keys"),
        ("cpu_period_ms", 0.5, r"cpu_period_ms=0\.5 must be a number of milliseconds"),
        (
            "cpu_period_ms",
            "10",
            r"^cpu_period_ms: expected float, got str '10'; write the number without quotes$",
        ),
    ],
)
def test_invalid_topologies_name_the_field(path: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Topology.from_dict(_with(path, value))


def test_region_cycle_and_disconnection_are_refused() -> None:
    cyclic = copy.deepcopy(BASE)
    cyclic["wan"].append({"regions": ["end", "cloud"], "mbit": 50})
    with pytest.raises(ValueError, match=r"wan\[2\].*cycle.*tree"):
        Topology.from_dict(cyclic)
    split = copy.deepcopy(BASE)
    split["wan"] = split["wan"][:1]
    with pytest.raises(ValueError, match="disconnected"):
        Topology.from_dict(split)


def test_missing_and_empty_fields() -> None:
    with pytest.raises(
        ValueError,
        match=r"^devices\[0\]\.cpu: missing required key of Device; add it \(cpu: <float>\)$",
    ):
        Topology.from_dict(_with("devices.0", {"name": "cloud0", "region": "cloud"}))
    with pytest.raises(ValueError, match=r"regions\.end has no device"):
        Topology.from_dict(_with("devices", BASE["devices"][:2]))
    with pytest.raises(ValueError, match=r"^devices is empty; declare at least one device"):
        Topology.from_dict(_with("devices", []))


def test_path_rate_is_the_slowest_hop() -> None:
    topo = Topology.from_dict(BASE)
    assert [link.mbit for link in topo.region_path("cloud", "end")] == [100, 20]
    assert [link.mbit for link in topo.region_path("end", "cloud")] == [20, 100]
    assert topo.region_path("edge", "edge") == ()
    assert topo.path_mbit("cloud0", "edge0") == 100  # LANs 1000 and 500, WAN 100
    assert topo.path_mbit("cloud0", "end0") == 20  # through the edge: 100 then 20
    assert topo.path_mbit("end0", "cloud0") == 20
    star = _with("wan", [{"regions": ["edge", "cloud"], "mbit": 400}])
    star["wan"].append({"regions": ["edge", "end"], "mbit": 300})
    topo = Topology.from_dict(star)
    assert topo.path_mbit("end0", "cloud0") == 100  # the end LAN (100) is the slowest hop
    assert topo.path_mbit("cloud0", "edge0") == 400
    with pytest.raises(ValueError, match="unknown device"):
        topo.path_mbit("cloud0", "nowhere")


def test_shipped_topologies_meet_the_issue() -> None:
    cee6 = load_topology(CONFIGS / "cee6.yaml")
    by_region = {r.name: [d for d in cee6.devices if d.region == r.name] for r in cee6.regions}
    assert {k: len(v) for k, v in by_region.items()} == {"cloud": 2, "edge": 2, "end": 2}
    assert all(r.lan_mbit >= 1000 for r in cee6.regions)
    assert all(20 <= w.mbit <= 200 for w in cee6.wan)
    end_links = [set(w.regions) for w in cee6.wan if "end" in w.regions]
    assert end_links == [{"end", "edge"}], "end devices reach the cloud only through the edge"
    assert min(d.cpu for d in by_region["cloud"]) >= 3 * max(d.cpu for d in by_region["end"])
    assert sum(d.cpu for d in cee6.devices) <= 1.0
    lan4 = load_topology(CONFIGS / "lan4.yaml")
    assert len(lan4.devices) == 4 and len({d.cpu for d in lan4.devices}) == 1
    assert lan4.regions[0].lan_mbit == 1000 and not lan4.wan
    small = load_topology(CONFIGS / "cee3_small.yaml")
    assert len(small.regions) == 2 and len(small.devices) == 3
    load_trace(CONFIGS / "trace_wan_dip.yaml", cee6)


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("regions: {a: {lan_mbit: 100, delay_ms: 5}}\ndevices: []\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: regions\.a\.delay_ms: .*netem"):
        load_topology(bad)
    with pytest.raises(ValueError, match="does not exist"):
        load_topology(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "regions: {a: {lan_mbit: fast}}\ndevices: []\n",
            r"regions\.a\.lan_mbit: expected float, got str 'fast'; write a number$",
        ),
        (
            "regions: {a: {lan_mbit: 100}}\ndevices: [{name: a0, region: a, cpus: 1}]\n",
            r"devices\[0\]\.cpus: unknown key of Device; remove it or fix its spelling "
            r"\(allowed: name, region, cpu\)$",
        ),
        (
            "regions: {a: {lan_mbit: 100}}\n",
            r"devices: missing required key of TopologyFile; add it \(devices: <list\[Device\]>\)$",
        ),
        (
            "regions: {a: {lan_mbit: [100}}\n",
            r"not valid YAML at line 1, column 29: expected ',' or '\]', but got '\}'",
        ),
    ],
)
def test_topology_file_errors_name_the_file_the_key_and_the_type(
    tmp_path: Path, text: str, message: str
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ValueError, match=f"^{re.escape(str(bad))}: {message}"):
        load_topology(bad)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "- {at_s: 10, link: [cloud, edge], bandwidth_mbit: 20}\n"
            "- {at_s: soon, link: [cloud, edge], bandwidth_mbit: 20}\n",
            r"trace\[1\]\.at_s: expected float, got str 'soon'; write a number$",
        ),
        (
            "- {at_s: 10, link: [cloud, edge], mbit: 20}\n",
            r"trace\[0\]\.mbit: unknown key of TraceEventEntry; remove it or fix its spelling "
            r"\(allowed: at_s, link, bandwidth_mbit\)$",
        ),
        (
            "- {at_s: 10, link: [cloud, edge]}\n",
            r"trace\[0\]\.bandwidth_mbit: missing required key of TraceEventEntry; add it "
            r"\(bandwidth_mbit: <float>\)$",
        ),
        (
            "- {at_s: 10, link: cloud, bandwidth_mbit: 20}\n",
            r"trace\[0\]\.link: expected list\[str\]",
        ),
        (
            "events: []\nloop: true\n",
            r"trace\.loop: unknown key of TraceFile; .*\(allowed: events\)$",
        ),
        (
            "just text\n",
            r"trace: expected a list of events \{at_s, link, bandwidth_mbit\}, got str",
        ),
    ],
)
def test_trace_file_errors_name_the_file_the_key_and_the_type(
    tmp_path: Path, text: str, message: str
) -> None:
    bad = tmp_path / "trace.yaml"
    bad.write_text(text)
    with pytest.raises(ValueError, match=f"^{re.escape(str(bad))}: {message}"):
        load_trace(bad)
    (tmp_path / "empty.yaml").write_text("")
    assert load_trace(tmp_path / "empty.yaml") == Trace()


def test_trace_parsing_and_validation() -> None:
    topo = Topology.from_dict(BASE)
    trace = Trace.from_data(
        [
            {"at_s": 5, "link": ["edge", "end"], "bandwidth_mbit": 5},
            {"at_s": 1, "link": ["cloud0", "cloud"], "bandwidth_mbit": 50},
        ]
    )
    assert [e.at_s for e in trace.events] == [1.0, 5.0]
    trace.validate(topo)
    assert Trace.from_data({"events": trace.to_list()}) == trace
    with pytest.raises(ValueError, match=r"trace\[0\]\.link=\['cloud', 'end'\]: no WAN link"):
        Trace.from_data([{"at_s": 0, "link": ["cloud", "end"], "bandwidth_mbit": 5}]).validate(topo)
    with pytest.raises(ValueError, match="device 'end0' is in region 'end', not 'edge'"):
        Trace.from_data([{"at_s": 0, "link": ["end0", "edge"], "bandwidth_mbit": 5}]).validate(topo)
    with pytest.raises(ValueError, match="unknown name 'moon'"):
        Trace.from_data([{"at_s": 0, "link": ["moon", "edge"], "bandwidth_mbit": 5}]).validate(topo)
    for entry, message in [
        ({"at_s": -1, "link": ["a", "b"], "bandwidth_mbit": 5}, r"at_s=-1"),
        ({"at_s": 0, "link": ["a", "b"], "bandwidth_mbit": 0}, r"bandwidth_mbit=0"),
        ({"at_s": 0, "link": ["a"], "bandwidth_mbit": 5}, r"link=\['a'\]"),
        ({"at_s": 0, "link": ["a", "b"], "bandwidth_mbit": 5, "delay_ms": 3}, "no netem"),
    ]:
        with pytest.raises(ValueError, match=message):
            Trace.from_data([entry])


def test_network_plan_names_fit_linux_limits() -> None:
    topo = load_topology(CONFIGS / "cee6.yaml")
    plan = plan_network(topo)
    assert plan.switches == ("dlab0", "dlab1", "dlab2")
    assert plan.wan_ports == (("dlab0-to1", "dlab1-to0"), ("dlab1-to2", "dlab2-to1"))
    assert plan.lan_ports[4] == "dlab2-end0" and plan.host_interfaces[0] == "cloud0-eth0"
    # LinuxBridge adds only ports whose name contains the switch name.
    for rank, device in enumerate(topo.devices):
        assert plan.switches[topo.region_index(device.region)] in plan.lan_ports[rank]
    names = [*plan.switches, *plan.root_interfaces, *plan.host_interfaces]
    assert len(set(names)) == len(names) and max(map(len, names)) <= 15


def test_torchrun_argv_and_env() -> None:
    cmd = ["python", "examples/train_gpt.py", "fit", "--trainer.num_nodes=3"]
    argv = device_argv(cmd, 2, 3, "10.0.0.1", 29500)
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    assert argv[3:] == [
        "--nnodes", "3", "--node-rank", "2", "--nproc-per-node", "1",
        "--master-addr", "10.0.0.1", "--master-port", "29500", *cmd[1:],
    ]  # fmt: skip
    assert device_argv(["python", "-m", "x"], 0, 2, "h", 1)[-2:] == ["-m", "x"]
    assert device_argv(["./run.sh"], 0, 2, "h", 1)[-2:] == ["--no-python", "./run.sh"]
    assert device_argv(cmd, 0, 3, "h", 1, launcher="env") == cmd
    assert device_argv(["python", "-c", "pass"], 0, 2, "h", 1)[-4:] == [
        "--no-python", "python", "-c", "pass",
    ]  # fmt: skip
    base = {"PATH": "/bin", "RANK": "7", "MASTER_ADDR": "stale"}
    env = device_env(
        base, device="edge0", region="edge", rank=2, world_size=3, master_addr="10.0.0.1",
        master_port=29500, interface="edge0-eth0",
    )  # fmt: skip
    assert env["GLOO_SOCKET_IFNAME"] == "edge0-eth0" and "RANK" not in env
    assert "MASTER_ADDR" not in env and env["PATH"] == "/bin"
    env = device_env(
        base, device="edge0", region="edge", rank=2, world_size=3, master_addr="10.0.0.1",
        master_port=29500, interface="edge0-eth0", launcher="env",
    )  # fmt: skip
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == ("2", "3", "10.0.0.1")
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == ("0", "1", "2")
    with pytest.raises(ValueError, match="no command given"):
        RunConfig(command=(), out_dir=Path("x"))
    with pytest.raises(ValueError, match="launcher='srun' is unknown"):
        RunConfig(command=("x",), out_dir=Path("x"), launcher="srun")


def test_lab_imports_mininet_only_lazily() -> None:
    for path in (ROOT / "lightning_deepcee" / "lab").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                module = node.module if isinstance(node, ast.ImportFrom) else None
                assert "mininet" not in (module or ""), path.name
                assert not any(n.startswith("mininet") for n in names), path.name
    pure = ["topology.py", "trace.py"]
    for name in pure:
        text = (ROOT / "lightning_deepcee" / "lab" / name).read_text()
        assert "import torch" not in text and "lightning.pytorch" not in text


def test_requirements_errors_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    import os
    import shutil

    from lightning_deepcee.lab import network

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool in ("brctl", "mnexec") else "/x")
    monkeypatch.setattr(network, "Path", lambda *a: Path("/nonexistent/x"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError) as info:
        network.check_requirements()
    message = str(info.value)
    assert "needs root" in message and "sudo" in message
    assert "mnexec (Debian package mininet)" in message
    assert "brctl (Debian package bridge-utils)" in message
    assert "apt-get install -y --no-install-recommends mininet bridge-utils" in message
    assert "pip install mininet" in message
