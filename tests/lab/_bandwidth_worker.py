"""Measure one direction's bandwidth with a gloo send, inside a lab run (one rank per device).

    deepcee-lab run --topology T -- python tests/lab/_bandwidth_worker.py --src 0 --dst 2

Rank ``src`` sends ``--mbytes`` MB to rank ``dst`` ``--repeats`` times, each followed by a 1-element
ack; it prints ``MEASURED_MBIT <src>-><dst> <median Mbit/s>``. Other ranks only join the barriers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", type=int, default=0)
    parser.add_argument("--dst", type=int, default=1)
    parser.add_argument("--mbytes", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    payload = torch.zeros(int(args.mbytes * 1e6) // 4, dtype=torch.float32)
    ack = torch.zeros(1)
    dist.barrier()
    rates = []
    for i in range(args.repeats + 1):  # the first transfer warms up the connection
        if rank == args.src:
            start = time.perf_counter()
            dist.send(payload, args.dst)
            dist.recv(ack, args.dst)
            if i > 0:
                rates.append(payload.numel() * 4 * 8 / (time.perf_counter() - start) / 1e6)
        elif rank == args.dst:
            dist.recv(payload, args.src)
            dist.send(ack, args.src)
    if rank == args.src:
        print(f"MEASURED_MBIT {args.src}->{args.dst} {statistics.median(rates):.2f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
