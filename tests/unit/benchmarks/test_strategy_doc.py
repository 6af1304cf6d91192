"""benchmarks/strategy_doc.py: docs/strategy.md lists every ``DeepCEEStrategy`` argument, with
its type, default and description, as the code has them."""

from __future__ import annotations

import inspect

import pytest

from lightning_deepcee import DeepCEEStrategy
from tests.helpers.benchmarks import load_benchmark
from tests.helpers.paths import ROOT


def test_every_argument_is_in_docs_strategy_md_with_its_default() -> None:
    doc = (ROOT / "docs" / "strategy.md").read_text()
    params = inspect.signature(DeepCEEStrategy.__init__).parameters
    for name, p in params.items():
        if name == "self":
            continue
        row = next((line for line in doc.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"docs/strategy.md has no row for {name}: run benchmarks/report.py"
        assert f"`{p.default!r}`" in row, row


def test_every_argument_has_a_description() -> None:
    strategy_doc = load_benchmark("strategy_doc")
    assert strategy_doc.missing_descriptions(DeepCEEStrategy) == []


def test_an_undescribed_argument_is_an_error() -> None:
    strategy_doc = load_benchmark("strategy_doc")

    class Documented:
        """A class.

        Args:
            alpha: the first,
                continued here.
            beta: the second.

        Returns:
            nothing: not an argument.
        """

        def __init__(self, alpha: int, beta: str = "b", gamma: float = 1.0) -> None: ...

    assert strategy_doc.docstring_arguments(Documented) == {
        "alpha": "the first, continued here.",
        "beta": "the second.",
    }
    assert strategy_doc.missing_descriptions(Documented) == ["gamma"]
    with pytest.raises(ValueError, match="no description for gamma"):
        strategy_doc.render(Documented)


def test_the_table_gives_type_default_and_description() -> None:
    strategy_doc = load_benchmark("strategy_doc")

    class Small:
        """A class.

        Args:
            size: how many.
        """

        def __init__(self, size: int | None = 3) -> None: ...

    table = strategy_doc.render(Small)
    assert "| `size` | `int \\| None` | `3` | how many. |" in table
