"""The emulated network for real (root, Mininet): build, reach, shape, trace, tear down.

python -m pytest tests/lab -m lab -q
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_deepcee.lab.network import LabNetwork
from lightning_deepcee.lab.runner import RunConfig, run_command
from lightning_deepcee.lab.state import StateStore, cgroup_dirs, leftovers
from lightning_deepcee.lab.topology import load_topology
from lightning_deepcee.lab.trace import Trace

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "configs" / "lab" / "cee3_small.yaml"
WORKER = ROOT / "tests" / "lab" / "_bandwidth_worker.py"
TOLERANCE = 0.25


def _measure(net: LabNetwork, out: Path, trace: Trace | None = None) -> float:
    """Mbit/s from cloud0 (rank 0) to edge0 (rank 2), i.e. across the WAN link."""
    command = ("python", str(WORKER), "--src", "0", "--dst", "2", "--mbytes", "4")
    config = RunConfig(command=command, out_dir=out, cwd=str(ROOT), timeout_s=90, echo=False)
    result = run_command(net, config, trace)
    log = (out / "cloud0.log").read_text()
    assert result.returncode == 0, log + (out / "edge0.log").read_text()
    match = re.search(r"MEASURED_MBIT 0->2 ([0-9.]+)", log)
    assert match, log
    return float(match.group(1))


def test_build_shape_trace_and_teardown(lab_store: StateStore, tmp_path: Path) -> None:
    topology = load_topology(SMALL)
    net = LabNetwork(topology, store=lab_store)
    with net:
        record = net.record
        assert record is not None and lab_store.path.exists()
        for name in (*net.plan.switches, *net.plan.root_interfaces):
            assert Path("/sys/class/net", name).exists(), name
        assert net.reachable("cloud0", "edge0") and net.reachable("edge0", "cloud1")
        assert net.reachable("cloud1", "cloud0")
        cores = os.cpu_count() or 1
        assert net.cpu_quota("cloud0") == pytest.approx(0.3 * cores, rel=0.01)
        cpu_max = net.cpu_max("cloud0")  # what the device's processes get as DEEPCEE_CPU_MAX
        assert cpu_max is not None
        quota_us, period_us = (int(word) for word in cpu_max.split())
        assert (quota_us / period_us, period_us) == (pytest.approx(0.3 * cores, rel=0.01), 100_000)
        assert net.rate_mbit("dlab0-to1") == pytest.approx(20)
        assert net.rate_mbit("cloud0-eth0", "cloud0") == pytest.approx(1000)

        configured = topology.link_mbit(["cloud", "edge"])
        measured = _measure(net, tmp_path / "wan20")
        print(f"WAN cloud-edge configured {configured:g} Mbit/s, measured {measured:.2f}")
        assert abs(measured - configured) <= TOLERANCE * configured

        trace = Trace.from_data([{"at_s": 0, "link": ["cloud", "edge"], "bandwidth_mbit": 8}])
        measured = _measure(net, tmp_path / "wan8", trace)
        print(f"WAN cloud-edge traced to 8 Mbit/s, measured {measured:.2f}")
        assert abs(measured - 8) <= TOLERANCE * 8
        assert net.rate_mbit("dlab0-to1") == pytest.approx(8)
        assert net.rate_mbit("dlab1-to0") == pytest.approx(8)

        # Another tenant takes most of cloud0: its quota changes while its processes run.
        trace = Trace.from_data([{"at_s": 0, "device": "cloud0", "cpu": 0.1}])
        trace.validate(topology)
        _measure(net, tmp_path / "cpu", trace)
        assert net.cpu_quota("cloud0") == pytest.approx(0.1 * cores, rel=0.01)
        with pytest.raises(ValueError, match="kernel's 1 ms"):
            net.set_cpu("cloud0", 0.001)
    assert leftovers(record) == []
    assert not lab_store.path.exists()
    for name in (*net.plan.switches, *net.plan.root_interfaces):
        assert not Path("/sys/class/net", name).exists(), name
    assert not any(cgroup_dirs(d.name) for d in topology.devices)
    assert len(record.netns) == 3 and len(record.processes) >= 3 + 2


_CRASH = """
import os, signal, sys
from pathlib import Path
from lightning_deepcee.lab.network import LabNetwork
from lightning_deepcee.lab.state import StateStore
from lightning_deepcee.lab.topology import load_topology
net = LabNetwork(load_topology(sys.argv[1]), store=StateStore(Path(sys.argv[2])))
net.start()
print("READY", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # a crash: no teardown at all
"""


def test_crashed_run_is_cleaned_at_next_start(lab_store: StateStore) -> None:
    crashed = subprocess.run(
        [sys.executable, "-c", _CRASH, str(SMALL), str(lab_store.directory)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert "READY" in crashed.stdout, crashed.stderr
    stale = lab_store.load()
    assert stale is not None
    assert "bridge dlab0" in leftovers(stale)
    net = LabNetwork(load_topology(SMALL), store=lab_store)
    with net:  # replays the stale record first, then builds anew
        assert not [x for x in leftovers(stale) if x.startswith(("process", "network ns"))]
        assert net.record is not None and net.record.owner_pid == os.getpid()
    assert leftovers(stale) == [] and leftovers(net.record) == []
    assert not lab_store.path.exists()


def test_ctrl_c_tears_down(lab_store: StateStore, tmp_path: Path) -> None:
    env = {**os.environ, "DEEPCEE_LAB_STATE_DIR": str(lab_store.directory)}
    command = "import os, time; print('PID', os.getpid(), flush=True); time.sleep(120)"
    cli = [sys.executable, "-m", "lightning_deepcee.lab.cli", "run", "--topology", str(SMALL)]
    cli += ["--out", str(tmp_path / "out"), "--launcher", "env", "--", "python", "-c", command]
    proc = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    pids: list[int] = []
    lines: list[str] = []
    deadline = time.monotonic() + 60
    try:
        assert proc.stdout is not None
        while len(pids) < 3 and time.monotonic() < deadline:
            line = proc.stdout.readline().decode()
            if not line:
                break
            lines.append(line)
            if match := re.search(r"PID (\d+)", line):
                pids.append(int(match.group(1)))
        assert len(pids) == 3, "".join(lines)
        assert lab_store.path.exists()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 128 + signal.SIGINT
    assert not lab_store.path.exists()
    assert not Path("/sys/class/net/dlab0").exists() and not cgroup_dirs("cloud0")
    for pid in pids:  # the commands' pids as seen in the root pid namespace (same namespace)
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
