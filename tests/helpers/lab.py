"""The lab tests' shared parts: the requirements (root and Mininet, docs/lab.md), the rows a
worker writes, and the devices' logs for a failure's message."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from lightning_deepcee.lab.network import check_requirements
from lightning_deepcee.lab.runner import LabResult


def require_lab() -> None:
    """Skip without root and Mininet; in CI (which installs them, as root) fail instead."""
    try:
        check_requirements()
    except RuntimeError as err:
        if os.environ.get("CI"):
            pytest.fail(f"lab requirements missing in CI: {err}")
        pytest.skip(str(err))


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON lines a worker wrote to ``path`` (none if it wrote nothing)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def device_logs(result: LabResult) -> str:
    """The tail of every device's log, for an assertion's message."""
    return "\n".join(f"== {d.name}\n{Path(d.log_path).read_text()[-3000:]}" for d in result.devices)
