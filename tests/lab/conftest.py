"""Fixtures for the lab tests: root and Mininet required, a private state directory per test."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_deepcee.lab.state import StateStore
from tests.helpers.lab import require_lab

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def lab_store(tmp_path: Path) -> StateStore:
    """A state store of its own, so tests never read or replay a real lab's record."""
    require_lab()
    return StateStore(tmp_path / "lab-state")
