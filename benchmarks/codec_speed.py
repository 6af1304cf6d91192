"""How long the compression codecs take against an Adam step, on one CPU thread.

The cost model charges a hop's encode and decode as ``CompressionMethod.cost_factor`` times the
device's measured optimizer seconds per parameter byte, per value: this measures both on the
machine it runs on (one thread; the fastest of ``--repeats`` timings of a GPT-sized activation's
round trip and of an Adam step over one transformer block's parameters, as the profiler times
it) and prints each method's measured ratio beside the factor the cost model uses, and its
round-trip error on Gaussian data. ``--json`` writes the figures for a committed result.

Run from the repository root::

    python benchmarks/codec_speed.py [--values 196608] [--repeats 15]
        [--json benchmarks/results/codec_speed.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_deepcee.planner.compression import METHODS
from lightning_deepcee.runtime.compression import decode, encode

__all__ = ["BLOCK_SHAPES", "COMMAND", "main", "measure", "render"]

COMMAND = "python benchmarks/codec_speed.py --json benchmarks/results/codec_speed.json"

BLOCK_SHAPES = ((256, 768), (768,), (256, 256), (1024, 256), (1024,), (256, 1024), (256,))
"""Attention projections and the MLP of one transformer block of width 256."""


def _fastest_s(work: Callable[[], object], repeats: int) -> float:
    work()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(values: int, repeats: int) -> dict[str, Any]:
    """Seconds per value of each codec's round trip, Adam's seconds per byte, and the ratios."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(values)
    # A transformer block's parameters (d_model 256), with small gradients, as the profiler
    # times Adam on the largest block.
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in BLOCK_SHAPES]
    for param in params:
        param.grad = torch.randn_like(param).mul_(1e-3)
    adam = torch.optim.Adam(params, lr=1e-3)
    adam.step()
    num_bytes = 4 * sum(p.numel() for p in params)
    adam_s_per_byte = _fastest_s(adam.step, repeats) / num_bytes
    methods = {}
    for name, method in METHODS.items():
        if method.code == 0:
            continue
        seconds = _fastest_s(lambda m=method: decode(m, encode(m, x), x.shape), repeats)
        y = decode(method, encode(method, x), x.shape)
        methods[name] = {
            "s_per_value": seconds / values,
            "measured_factor": seconds / values / adam_s_per_byte,
            "cost_factor": method.cost_factor,
            "wire_ratio": method.ratio,
            "relative_error": float((y - x).norm() / x.norm()),
            "typical_error": method.typical_error,
        }
    return {"values": values, "adam_s_per_byte": adam_s_per_byte, "methods": methods}


def render(data: dict[str, Any]) -> str:
    """The Markdown table of a results file written with ``--json``."""
    lines = [
        f"# Codec speed (`{COMMAND}`, {data['date']}, commit {data['commit']})",
        "",
        f"One CPU thread, {data['values']} float32 values; Adam "
        f"{data['adam_s_per_byte'] * 1e9:.3f} ns per parameter byte.",
        "",
        "| method | wire bytes | ns per value (encode + decode) | x Adam per byte | cost model "
        "| error (Gaussian) | stated typical |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in data["methods"].items():
        lines.append(
            f"| {name} | {row['wire_ratio']:.3f} | {row['s_per_value'] * 1e9:.2f} | "
            f"{row['measured_factor']:.2f} | {row['cost_factor']:.1f} | "
            f"{row['relative_error']:.4f} | {row['typical_error']:.4f} |"
        )
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--values", type=int, default=6 * 128 * 256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    result = measure(args.values, args.repeats)
    print(f"Adam: {result['adam_s_per_byte'] * 1e9:.3f} ns per parameter byte (one thread)")
    for name, row in result["methods"].items():
        print(
            f"{name:5s} {row['s_per_value'] * 1e9:6.2f} ns/value = "
            f"{row['measured_factor']:5.2f}x Adam/byte (cost model: {row['cost_factor']:.1f}x), "
            f"{row['wire_ratio']:.3f} of the bytes, error {row['relative_error']:.4f} "
            f"(stated typical {row['typical_error']:.4f})"
        )
    if args.json is not None:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        stamped = {**result, "date": datetime.date.today().isoformat(), "commit": commit}
        args.json.write_text(json.dumps(stamped, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
