"""The lab's requirements: root and Mininet (docs/lab.md)."""

from __future__ import annotations

import os

import pytest

from lightning_deepcee.lab.network import check_requirements


def require_lab() -> None:
    """Skip without root and Mininet; in CI (which installs them, as root) fail instead."""
    try:
        check_requirements()
    except RuntimeError as err:
        if os.environ.get("CI"):
            pytest.fail(f"lab requirements missing in CI: {err}")
        pytest.skip(str(err))
