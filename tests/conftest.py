"""How the suite shares out over pytest-xdist workers (``-n 2 --dist loadgroup``, README.md).

The lab tests run one after another on one worker: each builds an emulated network in the
machine's namespaces and cgroups, and two at once would contend for the same host names. Their
devices sit mostly idle under their CPU quotas, so the other worker's tests overlap them. Every
other module's tests stay on one worker too, so a module-scoped fixture (a torchrun job whose
result several tests check) runs once. Without xdist the markers do nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_LAB = Path(__file__).resolve().parent / "lab"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give each test its xdist group: ``lab`` for tests/lab, else its module."""
    for item in items:
        group = "lab" if item.path.is_relative_to(_LAB) else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))
