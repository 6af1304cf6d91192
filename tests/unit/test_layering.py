"""Core packages stay pure: no Lightning, no torch.distributed, no torch at all."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

PKG = ROOT / "lightning_deepcee"
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


PURE_MODULES = [
    "lightning_deepcee.profiler",
    "lightning_deepcee.planner",
    "lightning_deepcee.schedule",
    "lightning_deepcee.adapter",
    "lightning_deepcee.adapter.monitor",
]
HEAVY = ("lightning", "pytorch_lightning", "torch", "torch.distributed")


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_core_imports_alone(module: str) -> None:
    """Importing a core package (which runs the package ``__init__`` too) loads no framework."""
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_importing_the_package_registers_the_strategy_name() -> None:
    """``import lightning_deepcee`` registers "deepcee" whether Lightning loads before or after."""
    for order in (
        "import lightning_deepcee, lightning.pytorch",
        "import lightning.pytorch, lightning_deepcee",
    ):
        code = (
            f"{order}\n"
            "from lightning.pytorch.strategies import StrategyRegistry\n"
            "strategy = StrategyRegistry.get('deepcee')\n"
            "print(type(strategy).__name__)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
        )
        assert out.stdout.strip().splitlines()[-1] == "DeepCEEStrategy", order


PRIVATE = re.compile(
    r"\b(?:torch|lightning|lightning_utilities)(?:\.\w+)*\._(?!_)\w+|"
    r"\bfrom\s+(?:torch|lightning)(?:\.\S*)?\s+import\s+[^\n]*\b_[a-zA-Z]\w*|"
    r"\.(?:fit_loop|distributed_c10d)\._(?!_)\w+"
)


def test_private_framework_names_only_in_compat() -> None:
    """Private torch/Lightning names live behind ``_compat.py`` (one file to check on upgrade)."""
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        if path.name == "_compat.py":
            continue
        code = "\n".join(
            line.split("#")[0] for line in path.read_text().splitlines()
        )  # comments may name them
        for match in PRIVATE.finditer(code):
            bad.append(f"{path.relative_to(PKG)}: {match.group(0)}")
    assert not bad, bad


MAX_LINES = 600


def test_modules_stay_small() -> None:
    """Files by responsibility: no module of the package over 600 lines."""
    long = {
        str(path.relative_to(PKG)): n
        for path in sorted(PKG.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_no_private_names_imported_across_modules() -> None:
    """A module uses another module's public names only (``_compat`` re-exports the framework's
    private ones under public names); a package's private module (``profiler/_checks.py``) is
    for its own package."""
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        package = ".".join([PKG.name, *path.relative_to(PKG).parent.parts])
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PKG.name):
                bad += [
                    f"{path.relative_to(PKG)}: {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_")
                    and not alias.name.startswith("__")
                    and not (node.module == package and (path.parent / f"{alias.name}.py").exists())
                ]
    assert not bad, bad
