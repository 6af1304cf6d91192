"""The package's shape: no import cycle, a small root, no module setting another's privates."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "lightning_deepcee"
MAX_ROOT_MODULES = 5


def _module_name(path: Path) -> str:
    parts = [PKG.name, *path.relative_to(PKG).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PKG.rglob("*.py"))}


def _imported(name: str, path: Path) -> set[str]:
    """The package's modules ``name`` imports anywhere in its file: at the top, inside
    functions and under ``TYPE_CHECKING`` alike. A package's ``__init__`` that a submodule's
    import runs first is not counted (Python runs it for every submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # ``from pkg import module`` imports the module; ``from pkg import name``, pkg.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_no_import_cycle_counting_type_checking_imports() -> None:
    graph = {name: _imported(name, path) for name, path in MODULES.items()}
    assert not _cycles(graph), _cycles(graph)


def test_the_cycle_check_finds_a_cycle() -> None:
    """A check that cannot fail is a defect: a two-module cycle and a self-contained chain."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_package_root_holds_at_most_five_modules() -> None:
    modules = sorted(p.name for p in PKG.glob("*.py"))
    assert len(modules) <= MAX_ROOT_MODULES, modules


def _private_assignments(source: str) -> list[str]:
    """Assignments to ``<something>._name`` where something is not ``self`` or ``cls``."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        else:
            continue
        flat: list[ast.expr] = []
        for target in targets:
            flat += list(target.elts) if isinstance(target, ast.Tuple | ast.List) else [target]
        for target in flat:
            if (
                isinstance(target, ast.Attribute)
                and target.attr.startswith("_")
                and not target.attr.startswith("__")
                and not (isinstance(target.value, ast.Name) and target.value.id in ("self", "cls"))
            ):
                bad.append(f"line {node.lineno}: {ast.unparse(target)}")
    return bad


def test_no_module_assigns_another_objects_private_attributes() -> None:
    bad = [
        f"{path.relative_to(PKG)} {found}"
        for path in MODULES.values()
        for found in _private_assignments(path.read_text())
    ]
    assert not bad, bad


def test_the_private_assignment_check_finds_one() -> None:
    assert _private_assignments("strategy._size = 3\nself._own = 1\nx.public = 2") == [
        "line 1: strategy._size"
    ]
    assert _private_assignments("a._x, self._y = 1, 2\nobj._n += 1") == [
        "line 1: a._x",
        "line 2: obj._n",
    ]
