"""Core packages stay pure: no Lightning, no torch.distributed, no torch at all."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "lightning_deepcee"
CORE = ["schedule", "planner", "profiler", "adapter"]
FORBIDDEN = ("lightning", "pytorch_lightning", "torch")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("package", CORE)
def test_core_imports_no_torch_or_lightning(package: str) -> None:
    files = sorted((PKG / package).rglob("*.py"))
    assert files, f"no files in {package}"
    bad = [
        f"{f.relative_to(PKG)}: {name}"
        for f in files
        for name in _imports(f)
        if name.split(".")[0] in FORBIDDEN
    ]
    assert not bad, bad
