"""The test suite's own layout: no test module imports another, helpers live in tests.helpers.

A test module (``test_*.py``) that imports another runs the other's imports and module-level
code again and ties the two files together; what two test modules share belongs in
``tests/helpers/`` (or, for the scripts torchrun starts, ``tests/multiprocess/workers/``).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import ROOT

TESTS = ROOT / "tests"
SOURCES = sorted(TESTS.rglob("*.py"))
SYS_PATH_ALLOWED = {
    TESTS / "helpers" / "benchmarks.py",  # benchmarks/ is not a package
    TESTS / "multiprocess" / "workers" / "real_models_worker.py",  # nor is examples/
}


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _imported(source: str, module: str) -> list[str]:
    """Every module that ``source``, the module named ``module``, imports at any depth
    (relative imports resolved; ``from p import m`` also counts ``p.m``)."""
    package = module.split(".")[:-1]
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in node.names]
    return names


def _test_modules_imported(source: str, module: str) -> list[str]:
    return [n for n in _imported(source, module) if n.rsplit(".", 1)[-1].startswith("test_")]


def test_the_scan_finds_imports_of_test_modules() -> None:
    source = (
        "from tests.unit.planner.test_search import EXAMPLE\n"
        "from . import test_plan\n"
        "def f():\n"
        "    import test_cost_model\n"
        "from tests.helpers.clusters import make_profile\n"
    )
    found = _test_modules_imported(source, "tests.unit.planner.test_x")
    assert found == [
        "tests.unit.planner.test_search",
        "tests.unit.planner.test_plan",
        "test_cost_model",
    ]
    assert sum(p.name.startswith("test_") for p in SOURCES) > 50


def test_no_module_under_tests_imports_a_test_module() -> None:
    offenders = {
        str(path.relative_to(ROOT)): found
        for path in SOURCES
        if (found := _test_modules_imported(path.read_text(), _module_name(path)))
    }
    assert not offenders, f"move what they share to tests/helpers/: {offenders}"


def test_no_module_puts_a_test_folder_on_sys_path() -> None:
    """Test code imports through the ``tests`` package; only the loaders of benchmarks/ and
    examples/, which are not packages, put a folder on ``sys.path``."""
    offenders = [
        str(path.relative_to(ROOT))
        for path in SOURCES
        if path not in SYS_PATH_ALLOWED
        and path != Path(__file__)
        and "sys.path.insert" in path.read_text()
    ]
    assert not offenders, offenders


def test_every_test_folder_is_a_package() -> None:
    """Equal basenames in two folders (tests/unit/lab/, tests/lab/) then import apart."""
    folders = {path.parent for path in SOURCES}
    missing = sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists())
    assert not missing, missing
