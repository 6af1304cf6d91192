"""The repository's folders and the committed files tests read."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root (the folder holding lightning_deepcee/, tests/ and benchmarks/)."""
BENCHMARKS = ROOT / "benchmarks"
EXAMPLES = ROOT / "examples"
EXAMPLE_PROFILE = ROOT / "configs" / "profiles" / "example_cee6.yaml"
"""The committed six-device cloud-edge-end profile."""
WORKERS = ROOT / "tests" / "multiprocess" / "workers"
"""The scripts ``tests.helpers.launch.torchrun`` starts, one process a rank."""
