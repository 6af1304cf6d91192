"""Fixtures for the lab tests: root and Mininet required, a private state directory per test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_deepcee.lab.network import check_requirements
from lightning_deepcee.lab.state import StateStore

ROOT = Path(__file__).resolve().parents[2]


def require_lab() -> None:
    """Skip without root and Mininet; in CI (which installs them, as root) fail instead."""
    try:
        check_requirements()
    except RuntimeError as err:
        if os.environ.get("CI"):
            pytest.fail(f"lab requirements missing in CI: {err}")
        pytest.skip(str(err))


@pytest.fixture
def lab_store(tmp_path: Path) -> StateStore:
    """A state store of its own, so tests never read or replay a real lab's record."""
    require_lab()
    return StateStore(tmp_path / "lab-state")
