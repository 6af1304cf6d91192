"""``deepcee-lab``: build the emulated network, run a command on every device, tear it down.

    sudo deepcee-lab run --topology configs/lab/cee6.yaml [--trace T.yaml] --out runs/lab -- \\
        python examples/train_gpt.py fit --config configs/lab/tiny_gpt.yaml \\
        --trainer.num_nodes=6 --trainer.devices=1
    sudo deepcee-lab run ... --elastic 5:6 [--max-restarts 3] --trace kill_edge0.yaml -- ...
    deepcee-lab check --topology configs/lab/cee6.yaml [--trace T.yaml]   # no root needed
    sudo deepcee-lab clean                 # remove what a crashed run left (from its record)

Exit code of ``run``: the command's (0 when every device succeeded, 124 on timeout, 130 on
Ctrl-C); 2 for a bad topology, trace or command line; 3 when the lab cannot start.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from lightning_deepcee.lab.network import check_requirements, plan_network
from lightning_deepcee.lab.state import StateStore, teardown
from lightning_deepcee.lab.topology import Topology, load_topology
from lightning_deepcee.lab.trace import Trace, load_trace

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepcee-lab",
        description="Emulated cloud-edge-end testbed (Mininet): bandwidth-shaped links, CPU "
        "shares, one torchrun node per device. Latency cannot be emulated (no netem).",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="build the network, run a command on every device")
    run.add_argument("--topology", required=True, type=Path, help="topology YAML")
    run.add_argument("--trace", type=Path, help="bandwidth trace YAML (optional)")
    run.add_argument("--out", type=Path, default=Path("runs/lab"), help="log directory")
    run.add_argument("--launcher", choices=("torchrun", "env"), default="torchrun")
    run.add_argument("--master-port", type=int, default=29500)
    run.add_argument("--timeout-s", type=float, default=3600.0)
    run.add_argument("--fail-grace-s", type=float, default=15.0)
    run.add_argument(
        "--elastic",
        metavar="MIN:MAX",
        help="torchrun's elastic agent on every device (c10d rendezvous on the first device): "
        "devices may be killed and started again (trace {at_s, device, action: kill|start})",
    )
    run.add_argument(
        "--max-restarts",
        type=int,
        metavar="K",
        default=3,
        help="with --elastic: worker-group restarts per device before it fails (default 3)",
    )
    run.add_argument("--quiet", action="store_true", help="only write logs, do not echo them")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- the command for every device")
    check = sub.add_parser("check", help="validate a topology (and trace); print the plan")
    check.add_argument("--topology", required=True, type=Path)
    check.add_argument("--trace", type=Path)
    sub.add_parser("clean", help="remove what a crashed lab run left behind (its record)")
    return parser


def _describe(topology: Topology, trace: Trace | None) -> str:
    plan = plan_network(topology)
    lines = [f"topology {topology.name}: {len(topology.devices)} devices"]
    for rank, d in enumerate(topology.devices):
        lan = topology.region(d.region).lan_mbit
        lines.append(
            f"  rank {rank}  {d.name:<9} {d.region:<8} cpu {d.cpu:<5g} ip {plan.ips[rank]:<10} "
            f"LAN {lan:g} Mbit/s via {plan.host_interfaces[rank]}"
        )
    for w in topology.wan:
        lines.append(f"  WAN {w.regions[0]} <-> {w.regions[1]}: {w.mbit:g} Mbit/s")
    lines.append("  latency: not emulated (no netem on this kernel)")
    for e in trace.events if trace else ():
        lines.append(f"  trace t={e.at_s:g}s {'-'.join(e.link)} -> {e.bandwidth_mbit:g} Mbit/s")
    for k in trace.device_events if trace else ():
        lines.append(f"  trace t={k.at_s:g}s {k.action} {k.device}")
    for c in trace.cpu_events if trace else ():
        lines.append(f"  trace t={c.at_s:g}s {c.device} cpu -> {c.cpu:g}")
    return "\n".join(lines)


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGINT/SIGTERM/SIGHUP raise, so that ``finally`` tears the network down."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        # One interruption is enough: ignore more while the teardown runs (it is time-bounded).
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        raise _Interrupted(signum)

    previous = {
        s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    }
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _run(args: argparse.Namespace) -> int:
    from lightning_deepcee.lab.network import LabNetwork
    from lightning_deepcee.lab.runner import RunConfig, parse_elastic, run_command

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    topology = load_topology(args.topology)
    trace = load_trace(args.trace, topology) if args.trace else Trace()
    config = RunConfig(
        command=tuple(command),
        out_dir=args.out,
        launcher=args.launcher,
        master_port=args.master_port,
        timeout_s=args.timeout_s,
        fail_grace_s=args.fail_grace_s,
        echo=not args.quiet,
        elastic=args.elastic,
        max_restarts=args.max_restarts,
    )
    if config.elastic is not None:  # MAX against the topology, before the network is built
        parse_elastic(config.elastic, len(topology.devices))
    print(_describe(topology, trace), file=sys.stderr, flush=True)
    check_requirements()
    try:
        with _signals_raise():
            net = LabNetwork(topology)
            try:
                net.start()
                result = run_command(net, config, trace)
            finally:
                # Ignore further signals while tearing down (the teardown is time-bounded).
                old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
                try:
                    net.stop()
                finally:
                    for sig, handler in old.items():
                        signal.signal(sig, handler)
    except _Interrupted as stop:
        print(f"deepcee-lab: {stop} received; the network was torn down", file=sys.stderr)
        return 128 + stop.signum
    return result.returncode


def _clean() -> int:
    check_requirements()
    store = StateStore()
    with store.locked():
        record = store.load()
        if record is None:
            print(f"deepcee-lab: nothing to clean ({store.path} does not exist)")
            return 0
        left = teardown(record, log=lambda m: print(m, file=sys.stderr))
        if left:
            print(f"deepcee-lab: could not remove {', '.join(left)}", file=sys.stderr)
            return 1
        store.clear()
        print(f"deepcee-lab: removed the leftovers of pid {record.owner_pid}'s lab run")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "check":
            topology = load_topology(args.topology)
            trace = load_trace(args.trace, topology) if args.trace else None
            print(_describe(topology, trace))
            return 0
        if args.cmd == "clean":
            return _clean()
        return _run(args)
    except ValueError as err:
        print(f"deepcee-lab: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"deepcee-lab: {err}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
