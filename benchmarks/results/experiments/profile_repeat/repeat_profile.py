"""Time the blocks on every lab device several times in a row, as set-up does (all at once).

    python -m lightning_deepcee.lab.cli run --topology configs/lab/cee6.yaml --out DIR --quiet \
        -- python benchmarks/results/experiments/profile_repeat/repeat_profile.py --rounds 4

Each round: a barrier, then ``measure_blocks`` of the GPT 5.3M on a 12-sample micro-batch (the
reference size of the benchmark's profiles). Every rank prints ``REPEAT {json}`` with, per round,
its pass total (F+B+W over the 12 blocks), fixed per-call cost, sustained factor and the wall
time the round began. Question: do consecutive measurements of one run agree better than the
profiles of different runs do?
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from models import build_model

from lightning_deepcee.runtime.measure import measure_blocks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    spec = build_model("gpt", "gpt5m").configure_pipeline()
    x = torch.randint(0, 96, (12, 32))
    batch = (x, torch.randint(0, 96, (12, 32)))
    rounds = []
    start = time.time()
    for _ in range(args.rounds):
        dist.barrier()
        began = time.time() - start
        t = measure_blocks(
            spec.blocks, spec.input_fn(batch), loss_fn=spec.loss_fn, sample_batch=batch
        )
        rounds.append(
            dict(
                began_s=round(began, 2),
                pass_ms=round(
                    1e3 * (sum(t.forward_s) + sum(t.backward_input_s) + sum(t.backward_weight_s)), 1
                ),
                fixed_ms=round(1e3 * sum(t.fixed_s), 1),
                factor=round(t.sustained_factor, 3),
                took_s=round(time.time() - start - began, 2),
            )
        )
    print(
        "REPEAT " + json.dumps(dict(rank=dist.get_rank(), host=os.uname().nodename, rounds=rounds)),
        flush=True,
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
