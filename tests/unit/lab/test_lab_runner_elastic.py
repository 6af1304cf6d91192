"""The lab runner's elastic mode, kill/start events and supervision (pure: no root, no Mininet).

The argv and env a device gets, the checks of ``RunConfig.elastic`` and of kill/start trace
events, the run's bookkeeping (when it ends, which return code), and ``run_command`` itself over
a stand-in network whose hosts are plain subprocesses: a trace kills a device (and the child it
started in its own session, as torchrun starts its worker) and starts it again.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from lightning_deepcee.lab.runner import (
    DeviceState,
    LabControl,
    RunConfig,
    device_argv,
    device_env,
    kill_process_tree,
    parse_elastic,
    run_command,
    run_finished,
    run_returncode,
)
from lightning_deepcee.lab.topology import Topology, load_topology
from lightning_deepcee.lab.trace import DeviceEvent, Trace, load_trace
from tests.helpers.paths import ROOT

CEE3 = ROOT / "configs" / "lab" / "cee3_small.yaml"  # cloud0, cloud1, edge0
CMD = ["python", "train.py", "fit"]


def _elastic(spec: str = "2:3", **kw: Any) -> RunConfig:
    return RunConfig(command=tuple(CMD), out_dir=Path("x"), elastic=spec, **kw)


def test_elastic_argv_anchor_and_others() -> None:
    config = _elastic(max_restarts=5, rdzv_last_call_s=4)
    anchor = device_argv(
        CMD, 0, 3, "10.0.0.1", 29500, elastic=config, local_addr="10.0.0.1", run_id="r1"
    )
    other = device_argv(
        CMD, 2, 3, "10.0.0.1", 29500, elastic=config, local_addr="10.0.0.3", run_id="r1"
    )
    conf = "join_timeout=600,last_call_timeout=4,keep_alive_interval=2,keep_alive_max_attempt=3"
    assert anchor == [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29500", "--rdzv-id", "r1",
        "--max-restarts", "5", "--monitor-interval", "0.5", "--local-addr", "10.0.0.1",
        "--rdzv-conf", f"is_host=true,{conf}", "train.py", "fit",
    ]  # fmt: skip
    # Same job, except who hosts the rendezvous and which address the agent publishes.
    differ = [i for i, (a, b) in enumerate(zip(anchor, other, strict=True)) if a != b]
    assert [(anchor[i], other[i]) for i in differ] == [
        ("10.0.0.1", "10.0.0.3"),
        (f"is_host=true,{conf}", f"is_host=false,{conf}"),
    ]
    assert other[other.index("--local-addr") + 1] == "10.0.0.3"
    assert "--node-rank" not in anchor and "--master-addr" not in anchor
    # Not a python script: the same --no-python rule as the fixed-size launch.
    binary = device_argv(["./run.sh", "-x"], 1, 3, "h", 1, elastic=config, local_addr="a")
    assert binary[-3:] == ["--no-python", "./run.sh", "-x"]
    assert "is_host=false" in binary[binary.index("--rdzv-conf") + 1]
    # A config without elastic keeps the fixed-size argv.
    fixed = RunConfig(command=tuple(CMD), out_dir=Path("x"))
    assert device_argv(CMD, 1, 3, "h", 1, elastic=fixed, local_addr="a")[3:7] == [
        "--nnodes", "3", "--node-rank", "1",
    ]  # fmt: skip


def test_elastic_argv_checks_max_against_the_devices() -> None:
    with pytest.raises(ValueError, match="MAX=4 exceeds the topology's 3 devices"):
        device_argv(CMD, 0, 3, "h", 1, elastic=_elastic("2:4"), local_addr="a")
    with pytest.raises(ValueError, match="needs the device's local_addr"):
        device_argv(CMD, 0, 3, "h", 1, elastic=_elastic("2:3"))
    assert parse_elastic(" 1:3 ", 3) == (1, 3)
    assert parse_elastic("3:3") == (3, 3)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("3", "must be MIN:MAX node counts"),
        ("a:b", "must be MIN:MAX node counts"),
        ("2:3:4", "must be MIN:MAX node counts"),
        ("-1:3", "must be MIN:MAX node counts"),
        ("", "must be MIN:MAX node counts"),
        ("0:2", r"need 1 <= MIN <= MAX"),
        ("3:2", r"need 1 <= MIN <= MAX"),
    ],
)
def test_run_config_refuses_bad_elastic(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _elastic(spec)


def test_run_config_elastic_settings() -> None:
    with pytest.raises(ValueError, match="needs launcher='torchrun'"):
        _elastic(launcher="env")
    with pytest.raises(ValueError, match="max_restarts=-1 must be >= 0"):
        _elastic(max_restarts=-1)
    with pytest.raises(ValueError, match="rdzv_last_call_s=0 must be a whole number >= 1"):
        _elastic(rdzv_last_call_s=0)
    with pytest.raises(ValueError, match="rdzv_keep_alive_s=0"):
        _elastic(rdzv_keep_alive_s=0)
    # Without elastic the rendezvous settings are not used, so not checked.
    assert RunConfig(command=("x",), out_dir=Path("x"), rdzv_last_call_s=0).elastic is None


def test_env_names_the_device_and_disables_the_shared_store_when_elastic() -> None:
    kw: dict[str, Any] = dict(
        device="edge0", region="edge", rank=2, world_size=3, master_addr="10.0.0.1",
        master_port=29500, interface="edge0-eth0",
    )  # fmt: skip
    base = {"TORCHELASTIC_RESTART_COUNT": "2", "PATH": "/bin"}
    fixed = device_env(base, **kw)
    elastic = device_env(base, elastic=True, **kw)
    for env in (fixed, elastic):
        assert env["DEEPCEE_DEVICE"] == env["DEEPCEE_LAB_DEVICE"] == "edge0"
        assert env["DEEPCEE_LAB_RANK"] == "2" and "TORCHELASTIC_RESTART_COUNT" not in env
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in fixed
    assert elastic["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert device_env(base, launcher="env", **kw)["DEEPCEE_DEVICE"] == "edge0"


def test_trace_device_events_parse_sort_and_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(
        "- {at_s: 120, device: edge0, action: start}\n"
        "- {at_s: 30, link: [cloud, edge], bandwidth_mbit: 5}\n"
        "- {at_s: 60, device: edge0, action: kill}\n"
    )
    trace = load_trace(path, load_topology(CEE3))
    assert trace.device_events == (
        DeviceEvent(at_s=60.0, device="edge0", action="kill"),
        DeviceEvent(at_s=120.0, device="edge0", action="start"),
    )
    assert [e.link for e in trace.events] == [("cloud", "edge")]  # bandwidth events stay apart
    assert [e["at_s"] for e in trace.to_list()] == [30.0, 60.0, 120.0]
    assert Trace.from_data({"events": trace.to_list()}) == trace


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"at_s": 1, "device": "edge0", "action": "kill", "link": ["cloud", "edge"]},
            r"^trace\[0\]: an event has either link and bandwidth_mbit .* or device and action",
        ),
        (
            {"at_s": 1, "action": "kill", "bandwidth_mbit": 5},
            r"^trace\[0\]: an event has either",
        ),
        ({"at_s": 1, "device": "edge0", "action": "pause"}, r"trace\[0\]\.action='pause'"),
        ({"at_s": 1, "device": "edge0"}, r"trace\[0\]\.action: missing required key"),
        ({"at_s": -2, "device": "edge0", "action": "kill"}, r"trace\[0\]\.at_s=-2"),
        (
            {"at_s": 1, "device": "edge0", "action": "kill", "signal": 9},
            r"trace\[0\]\.signal: unknown key of DeviceEventEntry",
        ),
    ],
)
def test_trace_device_event_errors(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Trace.from_data([entry])


def test_trace_device_events_validate_against_the_topology() -> None:
    topology = load_topology(CEE3)

    def check(*events: tuple[float, str, str]) -> None:
        Trace.from_data([{"at_s": t, "device": d, "action": a} for t, d, a in events]).validate(
            topology
        )

    check((5, "edge0", "kill"), (9, "edge0", "start"), (12, "edge0", "kill"), (1, "cloud1", "kill"))
    with pytest.raises(ValueError, match=r"device: edge9, action: kill\}: unknown device 'edge9'"):
        check((5, "edge9", "kill"))
    with pytest.raises(ValueError, match="edge0 is still running then"):
        check((5, "edge0", "start"))
    with pytest.raises(ValueError, match="edge0 is already killed"):
        check((5, "edge0", "kill"), (7, "edge0", "kill"))
    with pytest.raises(ValueError, match=r"at_s: 4, device: cloud0, action: start"):
        check((5, "cloud0", "kill"), (4, "cloud0", "start"))  # sorted: the start comes first
    check((5, "edge0", "kill"), (9, "edge0", "join"), (12, "edge0", "kill"), (14, "edge0", "start"))
    with pytest.raises(ValueError, match=r"action: join\}: edge0 is still running then"):
        check((5, "edge0", "join"))


def _s(name: str, rc: int | None, killed: bool = False) -> DeviceState:
    return DeviceState(name=name, returncode=rc, killed=killed)


def test_run_bookkeeping() -> None:
    # A killed device is neither waited for nor a failure.
    states = [_s("a", 0), _s("b", None, killed=True), _s("c", 0)]
    assert run_finished(states) and run_returncode(states) == (0, None)
    assert not run_finished([_s("a", 0), _s("b", None), _s("c", -9, killed=True)])
    # Killed and started again: its new launch counts like any other.
    assert run_returncode([_s("a", 0), _s("b", 2)]) == (2, "b exited with 2")
    assert run_returncode([_s("a", 0), _s("b", -9, killed=True), _s("c", -15)]) == (
        -15, "c exited with -15",
    )  # fmt: skip
    assert run_returncode([_s("a", 3), _s("b", 4)])[0] == 3  # rank order
    # Nothing left but killed devices: wait only for a start still to come.
    everyone_killed = [_s("a", -9, killed=True), _s("b", -9, killed=True)]
    assert not run_finished(everyone_killed, start_pending=True)
    assert run_finished(everyone_killed)
    assert run_returncode(everyone_killed) == (1, "every device was killed")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_kill_process_tree_reaches_a_child_in_its_own_session(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    child = None
    try:
        deadline = time.monotonic() + 20
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert os.getsid(child) != os.getsid(parent.pid)  # a killpg of the parent misses it
        assert set(kill_process_tree(parent.pid)) == {parent.pid, child}
        assert parent.wait(timeout=5) == -signal.SIGKILL
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        for pid in (parent.pid, child):
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        parent.wait(timeout=5)


class _ProcessNet:
    """Stands in for LabNetwork: each device's command is a plain local process."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.bandwidth: list[tuple[tuple[str, ...], float]] = []

    def ip(self, device: str) -> str:
        return f"10.0.0.{[d.name for d in self.topology.devices].index(device) + 1}"

    def interface(self, device: str) -> str:
        return f"{device}-eth0"

    def cpu_max(self, device: str) -> str | None:
        return None

    def popen(
        self, device: str, argv: Sequence[str], env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> subprocess.Popen[bytes]:  # fmt: skip
        return subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True,
        )  # fmt: skip

    def set_bandwidth(self, endpoints: Sequence[str], mbit: float) -> None:
        self.bandwidth.append((tuple(endpoints), mbit))


# A device: says who it is, runs SLEEP_<name> seconds (0.3 s from its second launch on), exits
# RC_<name>. edge0's first launch also starts a child in its own session, as torchrun does.
_DEVICE = """
import os, subprocess, sys, time
name, work = os.environ["DEEPCEE_DEVICE"], sys.argv[1]
again = os.path.exists(os.path.join(work, name + ".up"))
open(os.path.join(work, name + ".up"), "a").close()
print(f"up {name} rank={os.environ['DEEPCEE_LAB_RANK']} again={again} "
      f"join={os.environ.get('DEEPCEE_JOIN')} world={os.environ['WORLD_SIZE']}", flush=True)
if name == "edge0" and not again:
    c = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         start_new_session=True)
    open(os.path.join(work, "child.pid"), "w").write(str(c.pid))
time.sleep(0.3 if again else float(os.environ.get("SLEEP_" + name, "1")))
sys.exit(int(os.environ.get("RC_" + name, "0")))
"""


def _run(
    tmp_path: Path, trace: Trace | None = None, control: Any = None, **env: str
) -> tuple[Any, dict[str, Any]]:
    work = tmp_path / "work"
    work.mkdir(parents=True)
    config = RunConfig(
        command=("python", "-c", _DEVICE, str(work)), out_dir=tmp_path / "out", launcher="env",
        timeout_s=60, fail_grace_s=1, echo=False, extra_env=tuple(env.items()),
    )  # fmt: skip
    net = _ProcessNet(load_topology(CEE3))
    try:
        result = run_command(net, config, trace, log=lambda _msg: None, control=control)  # type: ignore[arg-type]
    finally:
        with contextlib.suppress(OSError, ValueError):
            child = int((work / "child.pid").read_text())
            if _alive(child):
                os.kill(child, signal.SIGKILL)
    return result, json.loads((tmp_path / "out" / "summary.json").read_text())


def test_trace_kills_a_device_and_starts_it_again(tmp_path: Path) -> None:
    trace = Trace.from_data(
        [
            {"at_s": 1.0, "device": "edge0", "action": "kill"},
            {"at_s": 2.0, "device": "edge0", "action": "start"},
            {"at_s": 0.5, "link": ["cloud", "edge"], "bandwidth_mbit": 5},
        ]
    )
    began = time.monotonic()
    result, summary = _run(tmp_path, trace, SLEEP_cloud0="3", SLEEP_cloud1="3", SLEEP_edge0="30")
    assert time.monotonic() - began < 20  # edge0's first launch (30 s) did not hold the run
    by_name = {d.name: d for d in result.devices}
    assert result.returncode == 0, result
    edge = by_name["edge0"]
    assert (edge.launches, edge.killed, edge.returncode) == (2, False, 0)
    assert by_name["cloud0"].launches == 1
    kill, start = result.device_events
    assert (kill["action"], kill["source"], kill["at_s"]) == ("kill", "trace", 1.0)
    assert 1.0 <= kill["applied_at_s"] < 2.0 and start["applied_at_s"] >= 2.0
    child = int((tmp_path / "work" / "child.pid").read_text())
    assert child in kill["pids"] and not _alive(child)  # its own session, killed all the same
    assert start["launch"] == 2
    log = Path(edge.log_path).read_text()
    assert log.index("up edge0 rank=2 again=False") < log.index("started again (launch 2)")
    assert log.index("started again (launch 2)") < log.index("up edge0 rank=2 again=True")
    assert summary["device_events"] == result.device_events and summary["elastic"] is None
    assert summary["devices"][2]["launches"] == 2
    assert [e["link"] for e in summary["trace_applied"]] == [["cloud", "edge"]]


def test_trace_join_starts_the_device_alone_to_join_the_running_job(tmp_path: Path) -> None:
    trace = Trace.from_data(
        [
            {"at_s": 1.0, "device": "edge0", "action": "kill"},
            {"at_s": 2.0, "device": "edge0", "action": "join"},
        ]
    )
    result, summary = _run(tmp_path, trace, SLEEP_cloud0="3", SLEEP_cloud1="3", SLEEP_edge0="30")
    assert result.returncode == 0, result
    edge = {d.name: d for d in result.devices}["edge0"]
    assert (edge.launches, edge.killed, edge.returncode) == (2, False, 0)
    kill, join = summary["device_events"]
    assert kill["action"] == "kill" and join["applied_at_s"] >= 2.0
    assert (join["action"], join["source"], join["launch"]) == ("join", "trace", 2)
    log = Path(edge.log_path).read_text()
    # Its first launch: rank 2 of the run's 3; the second: a world of its own, DEEPCEE_JOIN=1,
    # its lab rank kept (the strategy's admission gives it its rank in the job).
    assert "up edge0 rank=2 again=False join=None world=3" in log
    assert "up edge0 rank=2 again=True join=1 world=1" in log
    cloud = Path({d.name: d for d in result.devices}["cloud0"].log_path).read_text()
    assert "join=None world=3" in cloud


def test_control_kill_is_not_a_failure_and_not_waited_for(tmp_path: Path) -> None:
    seen: list[bool] = []

    def control(lab: LabControl) -> None:
        if lab.elapsed_s > 1.0 and lab.running("edge0"):
            lab.kill("edge0")
            seen.append(lab.running("edge0"))

    result, _ = _run(tmp_path, control=control, SLEEP_edge0="30", RC_edge0="7")
    edge = {d.name: d for d in result.devices}["edge0"]
    assert seen == [False]
    assert (result.returncode, edge.killed, edge.returncode) == (0, True, -signal.SIGKILL)
    assert result.first_failure is None and result.duration_s < 20
    assert result.device_events[0]["source"] == "control"
    with pytest.raises(RuntimeError, match="still running"):
        _run(tmp_path / "again", control=lambda lab: lab.start("cloud0"))


def test_a_device_failing_on_its_own_still_fails_the_run(tmp_path: Path) -> None:
    trace = Trace.from_data([{"at_s": 0.5, "device": "edge0", "action": "kill"}])
    result, summary = _run(tmp_path, trace, RC_cloud1="3", SLEEP_cloud0="30", SLEEP_edge0="30")
    assert result.returncode == 3
    assert result.first_failure == "cloud1 (rank 1) exited with 3"
    # cloud0 was stopped after fail_grace_s (1 s), not after its 30 s.
    assert result.duration_s < 15 and summary["first_failure"] == result.first_failure
